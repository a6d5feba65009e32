"""resetGpu: a privileged Job pinned to the node runs the GPU reset (deterministic name: created once).

Like reboot's Job, it runs only on a node carrying xidflow's own taint (``reboot.start_hook_job``). The
step follows the Job to its end as the Job controller records it: ``Complete`` is applied, ``Failed``
(the reset command failed: a process still holds the GPU, ...) fails the step with the Job's reason, and so
does a Job still running at the step's ``timeout`` (``effects.DEFAULT_RESET_TIMEOUT`` when the policy
gives none); a failed step leaves the node quarantined and the flow's later steps undone.
"""

from __future__ import annotations

from pipeline.actuator import effects
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepLike, StepResult
from pipeline.actuator.actions.reboot import start_hook_job
from schemas.records import Outcome


async def run(ctx: StepContext, step: StepLike) -> StepResult:
    spec, settings = step.spec, ctx.settings
    env = {"XIDFLOW_GPU_PCI": ctx.incident.pci} if ctx.incident is not None and ctx.incident.pci else None
    details = await start_hook_job(ctx, "xidflow-gpureset", settings.reset_job_template, effects.DEFAULT_RESET_JOB, env)
    name = details["job"]
    timeout = spec.timeout or effects.DEFAULT_RESET_TIMEOUT
    end = await effects.wait_for_job(ctx.kube, settings.namespace, name, timeout)
    if end is None:
        return StepResult(Outcome.FAILED, f"reset Job {name} did not end within {timeout:g}s", details)
    details["job_end"] = end.describe()
    if not end.succeeded:
        return StepResult(Outcome.FAILED, f"reset Job {name} {end.describe()}", details)
    return StepResult(Outcome.APPLIED, f"reset Job {name} completed", details)


ACTION = ActionDef(
    name="resetGpu",
    kind=Kind.LONG,
    attrs=frozenset({"job_template", "timeout"}),
    disruptive=True,
    dropped_on_escalation=True,
    repairs=True,
    uses_repair_budget=True,
    run=run,
)
