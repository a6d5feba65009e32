"""resetGpu: a privileged Job pinned to the node runs the GPU reset (deterministic name: created once)."""

from __future__ import annotations

from pipeline.actuator import effects, jobtemplates
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepLike, StepResult
from pipeline.actuator.actions.reboot import read_template
from schemas.records import Outcome


async def run(ctx: StepContext, step: StepLike) -> StepResult:
    plan, spec, settings = ctx.plan, step.spec, ctx.settings
    name = effects.object_name("xidflow-gpureset", plan.node, plan.flow_key, length=12)
    template = spec.job_template or read_template(settings.reset_job_template, effects.DEFAULT_RESET_JOB)
    job = effects.render_job(template, name, settings.namespace, plan.node, {"xidflow.dev/flow": plan.flow_key[:63]})
    job = jobtemplates.enforce(job, settings.hook_service_account)  # the operator's Job, its own account
    if ctx.incident is not None and ctx.incident.pci:
        for container in job["spec"]["template"]["spec"].get("containers", []):
            container.setdefault("env", []).append({"name": "XIDFLOW_GPU_PCI", "value": ctx.incident.pci})
    created = await effects.create_hook_job(ctx.kube, job)
    details = {"job": name, "created": created}
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
