"""reboot: ask for a reboot (privileged Job, node annotation, or webhook) and wait for a new bootID.

The bootID before the reboot is recorded with the claim, so a replica that resumes the step after
the first one died waits for the same reboot instead of asking for a second one.

A hook Job (this one and resetGpu's, ``start_hook_job``) runs only on a node that carries xidflow's own
taint (``XIDFLOW_ACTUATOR_TAINT_KEY``): the admission policy of ``deploy/rbac/hook-jobs-admission.yaml``
refuses it anywhere else, so that a stolen actuator token cannot run it on a node in service. A flow
that did not taint the node with that key (``[cordon, reboot]``, a rescue request's ``[reboot]``) gets
the taint from the hook step, owned by the flow and undone with it (and by ``uncordonAfter``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pipeline.actuator import effects, jobtemplates
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepLike, StepResult
from pipeline.actuator.ownership import REBOOT_REQUEST_ANNOTATION, taint_effect_key
from schemas.records import Outcome

if TYPE_CHECKING:
    from pipeline.actuator.nodeview import NodeView
    from pipeline.actuator.ownership import Ledger


HOOK_TAINT = "hook_taint"
"""Flow value: the hook step put xidflow's taint on the node (so ``uncordonAfter`` takes it away again)."""


def read_template(path: str, default: str) -> str:
    if not path:
        return default
    with open(path, encoding="utf-8") as fh:
        return fh.read()


async def _taint_for_hook(ctx: StepContext) -> str:
    """xidflow's own taint on the node, before a hook Job (what the admission policy demands); a note."""
    plan, settings = ctx.plan, ctx.settings
    key, effect = settings.taint_key, settings.taint_effect
    value = plan.problem.taint_value if plan.problem else "rescue-request"

    def mutate(view: NodeView, ledger: Ledger) -> tuple[effects.NodeChange | None, str]:
        if any(t.get("key") == key for t in view.taints):
            return None, f"node carries {key}"
        change = effects.taint_change(view, ledger, plan.flow_key, key, value, effect)
        ledger.set_flow_value(plan.flow_key, HOOK_TAINT, True, time.time())
        return change, f"tainted {key}:{effect} for the hook Job"

    note, _ = await ctx.writer.update(plan.node, mutate, f"hook-taint {plan.flow_key}")
    return note


async def start_hook_job(
    ctx: StepContext, prefix: str, template_path: str, default: str, env: dict[str, str] | None = None,
    labels: dict[str, str] | None = None, deadline_s: int | None = None,
) -> dict[str, Any]:
    """Create the flow's hook Job on its node (deterministic name: once), after xidflow's taint; its details.

    ``labels`` join the flow's label; ``deadline_s`` is the Job's ``activeDeadlineSeconds`` (the Job controller
    ends a Job that runs longer)."""
    plan, settings = ctx.plan, ctx.settings
    name = effects.object_name(prefix, plan.node, plan.flow_key, length=12)
    job = effects.render_job(read_template(template_path, default), name, settings.namespace, plan.node,
                             {"xidflow.dev/flow": plan.flow_key[:63], **(labels or {})})
    if deadline_s is not None:
        job["spec"]["activeDeadlineSeconds"] = deadline_s
    job = jobtemplates.enforce(job, settings.hook_service_account)  # the operator's Job, its own account
    for container in job["spec"]["template"]["spec"]["containers"]:
        container.setdefault("env", []).extend({"name": k, "value": v} for k, v in (env or {}).items())
    details: dict[str, Any] = {"job": name, "taint": await _taint_for_hook(ctx)}
    details["created"] = await effects.create_hook_job(ctx.kube, job)
    return details


async def run(ctx: StepContext, step: StepLike) -> StepResult:
    plan, spec = ctx.plan, step.spec
    flow = plan.flow_key
    before = ctx.view.ledger.flow_value(flow, "boot_id_before") or ctx.view.boot_id
    hook = spec.hook or "job"
    details: dict[str, Any] = {"hook": hook, "boot_id_before": before}
    if hook == "job":
        details |= await start_hook_job(ctx, "xidflow-reboot", ctx.settings.reboot_job_template,
                                        effects.DEFAULT_REBOOT_JOB)
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
            key, effect = ctx.settings.taint_key, ctx.settings.taint_effect
            owned = flow in ledger.owners(taint_effect_key(key, effect))
            if ledger.flow_value(flow, HOOK_TAINT) and owned and ledger.disown(taint_effect_key(key, effect), flow):
                change.spec.update(effects.remove_taints_change(v, [(key, effect)]).spec)  # the hook's taint
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
