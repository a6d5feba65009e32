"""reboot: ask for a reboot (privileged Job, node annotation, or webhook) and wait for a new bootID.

The bootID before the reboot is recorded with the claim, so a replica that resumes the step after
the first one died waits for the same reboot instead of asking for a second one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.actuator import effects, jobtemplates
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepLike, StepResult
from pipeline.actuator.ownership import REBOOT_REQUEST_ANNOTATION
from schemas.records import Outcome

if TYPE_CHECKING:
    from pipeline.actuator.nodeview import NodeView
    from pipeline.actuator.ownership import Ledger


def read_template(path: str, default: str) -> str:
    if not path:
        return default
    with open(path, encoding="utf-8") as fh:
        return fh.read()


async def run(ctx: StepContext, step: StepLike) -> StepResult:
    plan, spec = ctx.plan, step.spec
    flow = plan.flow_key
    before = ctx.view.ledger.flow_value(flow, "boot_id_before") or ctx.view.boot_id
    hook = spec.hook or "job"
    details: dict[str, Any] = {"hook": hook, "boot_id_before": before}
    if hook == "job":
        name = effects.object_name("xidflow-reboot", plan.node, flow, length=12)
        template = spec.job_template or read_template(ctx.settings.reboot_job_template, effects.DEFAULT_REBOOT_JOB)
        job = effects.render_job(template, name, ctx.settings.namespace, plan.node, {"xidflow.dev/flow": flow[:63]})
        job = jobtemplates.enforce(job, ctx.settings.hook_service_account)  # the operator's Job, its own account
        details["job"] = name
        details["created"] = await effects.create_hook_job(ctx.kube, job)
    elif hook == "annotation":

        def request(view: NodeView, ledger: Ledger) -> tuple[effects.NodeChange | None, None]:
            if view.annotations.get(REBOOT_REQUEST_ANNOTATION) == flow:
                return None, None
            return effects.reboot_annotation_change(flow), None

        await ctx.writer.update(plan.node, request, f"reboot-request {flow}")
    else:
        payload = {"node": plan.node, "flow": flow, "bootId": before, "action": "reboot"}
        details["status"] = await effects.call_webhook(spec.webhook_url or "", payload, flow)
    ok, view = await effects.wait_for_reboot(
        ctx.kube, plan.node, before, spec.timeout or effects.DEFAULT_REBOOT_TIMEOUT
    )
    if not ok:
        return StepResult(Outcome.FAILED, "node did not come back Ready with a new bootID", details)
    details["boot_id_after"] = view.boot_id
    if hook == "annotation":

        def clear(v: NodeView, ledger: Ledger) -> tuple[effects.NodeChange | None, None]:
            if REBOOT_REQUEST_ANNOTATION not in v.annotations:
                return None, None
            return effects.NodeChange(annotations={REBOOT_REQUEST_ANNOTATION: None}), None

        await ctx.writer.update(plan.node, clear, f"reboot-done {flow}")
    if spec.uncordon_after:

        def uncordon(v: NodeView, ledger: Ledger) -> tuple[effects.NodeChange | None, str]:
            change = effects.uncordon_change(v, ledger, flow)
            return change, change.note or "uncordoned"

        details["uncordon"], _ = await ctx.writer.update(plan.node, uncordon, f"uncordon-after-reboot {flow}")
    return StepResult(Outcome.APPLIED, f"rebooted: bootID {before} -> {view.boot_id}", details)


ACTION = ActionDef(
    name="reboot",
    kind=Kind.LONG,
    attrs=frozenset({"hook", "webhook_url", "job_template", "uncordon_after", "timeout"}),
    disruptive=True,
    requestable=True,
    dropped_on_escalation=True,
    repairs=True,
    uses_repair_budget=True,
    claim_values=lambda view: {"boot_id_before": view.boot_id},
    run=run,
)
