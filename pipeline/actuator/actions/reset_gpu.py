"""resetGpu: a privileged Job pinned to the node runs the GPU reset (deterministic name: created once).

Like reboot's Job, it runs only on a node carrying xidflow's own taint (``reboot.start_hook_job``).
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
    if spec.timeout:
        ok = await effects.wait_for_job(ctx.kube, settings.namespace, name, spec.timeout)
        if not ok:
            return StepResult(Outcome.FAILED, "reset Job failed" if ok is False else "reset Job timed out", details)
    return StepResult(Outcome.APPLIED, f"reset Job {name}", details)


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
