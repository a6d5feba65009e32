"""diagnose: the gate before a return to service. A diagnostics Job on the node (the operator's template, else
DCGM level 2), its verdict read from the Job's status and its termination message (``diagnostics``).

Created and followed like the reboot Job (``reboot.start_hook_job``: on a node carrying xidflow's taint, which
the hook-jobs admission policy demands): a deterministic name per flow (a redelivery, a racing replica or a
replica that resumes the step after the first one died finds the same Job, never a second),
claimed with a renewed lease, its deadline the Job's own ``activeDeadlineSeconds`` counted from the Job's
creation. The verdict is recorded in the node's repair case in the write that marks the step done, with what
follows (``repaircase.record_diagnostics``): a pass returns the node (the engine removes what the case's flows
applied), a fail or a timeout is a repair that did not hold (the repair again, or hardware inspection).
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from typing import Any

from pipeline.actuator import diagnostics, effects, jobstatus, repaircase
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepLike, StepResult, StopReason
from pipeline.actuator.actions.reboot import start_hook_job
from pipeline.actuator.kube import Kube
from schemas.records import Outcome

HOOK_LABEL = "xidflow.dev/hook"
POLL_SECONDS = 1.0


def _created_at(job: dict[str, Any]) -> float:
    stamp = (job.get("metadata") or {}).get("creationTimestamp")
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return time.time()


async def follow(kube: Kube, namespace: str, name: str, deadline_s: float) -> diagnostics.GateResult:
    """Poll the Job until the Job controller gives a verdict, or the deadline (from its creation) and grace pass."""
    while True:
        job = await kube.get_job(namespace, name)
        overdue = time.time() >= _created_at(job) + deadline_s + diagnostics.DEADLINE_GRACE
        message = None
        if jobstatus.job_end(job) is not None:
            pods = await kube.list_pods(namespace, f"batch.kubernetes.io/job-name={name}")
            message = next((m for p in pods if (m := diagnostics.termination_message(p))), None)
        result = diagnostics.verdict(job, message, overdue)
        if result.verdict is not None:
            return result
        await asyncio.sleep(POLL_SECONDS)


async def run(ctx: StepContext, step: StepLike) -> StepResult:
    plan, settings = ctx.plan, ctx.settings
    flow = plan.flow_key
    deadline = int(step.spec.timeout or diagnostics.DEFAULT_TIMEOUT)
    details = await start_hook_job(ctx, "xidflow-diag", settings.diagnostics_job_template,
                                   effects.DEFAULT_DIAGNOSTICS_JOB, labels={HOOK_LABEL: "diagnostics"},
                                   deadline_s=deadline)
    name = details["job"]
    result = await follow(ctx.kube, settings.namespace, name, deadline)
    verdict = result.verdict
    assert verdict is not None
    details |= {"verdict": verdict, "result": result.result}
    message = str(result.result.get("message") or result.reason)

    def record(ledger: Any, now: float) -> None:
        repaircase.record_diagnostics(ledger, flow, name, verdict, message, result.result, now)

    if verdict == "pass":
        return StepResult(Outcome.APPLIED, f"diagnostics passed: {result.reason}", details, ledger_update=record)
    return StepResult(Outcome.FAILED, f"diagnostics {verdict}: {result.reason}", details,
                      stop=StopReason.FAILED, ledger_update=record)


ACTION = ActionDef(
    name="diagnose",
    kind=Kind.LONG,
    attrs=frozenset({"timeout"}),
    dropped_on_escalation=True,
    uses_repair_budget=True,
    run=run,
)
