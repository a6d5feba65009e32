"""reboot: ask for a reboot (privileged Job, node annotation, or webhook) and wait for a new bootID.

The bootID before the reboot is recorded with the claim, so a replica that resumes the step after
the first one died waits for the same reboot instead of asking for a second one. The Job hook's Job is
created only while the node's kubelet answers (``_JobHook``) and followed: when the Job controller fails it
(its command failed) while the node keeps its old bootID, the step fails at once with the Job's reason
instead of waiting out its timeout (``job_failed``); a pod that the node's own shutdown terminated is the
reboot under way, not a failure.

A hook Job (this one and resetGpu's, ``start_hook_job``) runs only on a node that carries xidflow's own
taint (``XIDFLOW_ACTUATOR_TAINT_KEY``): the admission policy of ``deploy/rbac/hook-jobs-admission.yaml``
refuses it anywhere else, so that a stolen actuator token cannot run it on a node in service. A flow
that did not taint the node with that key (``[cordon, reboot]``, a rescue request's ``[reboot]``) gets
the taint from the hook step, owned by the flow and undone with it (and by ``uncordonAfter``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pipeline.actuator import effects, jobstatus, jobtemplates
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepLike, StepResult
from pipeline.actuator.kube import Kube, NotFound
from pipeline.actuator.ownership import REBOOT_REQUEST_ANNOTATION, taint_effect_key
from schemas.records import Outcome

if TYPE_CHECKING:
    from pipeline.actuator.nodeview import NodeView
    from pipeline.actuator.ownership import Ledger


JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
"""The label the Job controller puts on a Job's pods (the Job's name)."""
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


def _terminated_by_the_node(pod: Mapping[str, Any]) -> bool:
    """The pod carries ``DisruptionTarget`` (the kubelet's graceful node shutdown, an eviction). Pure."""
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "DisruptionTarget" and c.get("status") == "True" for c in conditions)


def _exit_of(pods: list[Mapping[str, Any]]) -> str:
    """The hook container's end as its pod reports it (``exit code 1 (Error)``), or empty. Pure."""
    for pod in pods:
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            done = (status.get("state") or {}).get("terminated")
            if done:
                return f"exit code {done.get('exitCode')} ({done.get('reason') or 'no reason'})"
    return ""


async def job_failed(kube: Kube, node: str, namespace: str, name: str) -> str | None:
    """Why the reboot's hook Job failed without the machine going down, or None: it runs, it completed, it is
    gone (``ttlSecondsAfterFinished``), or its pod was terminated by the node's shutdown (the reboot itself)."""
    try:
        end = jobstatus.job_end(await kube.get_job(namespace, name))
    except NotFound:
        return None
    if end is None or end.succeeded:
        return None
    pods = [p for p in await kube.list_pods_on_node(node)
            if ((p.get("metadata") or {}).get("labels") or {}).get(JOB_NAME_LABEL) == name
            and (p.get("metadata") or {}).get("namespace") == namespace]
    if any(_terminated_by_the_node(p) for p in pods):
        return None
    exit_note = _exit_of(pods)
    return f"reboot Job {name} {end.describe()}" + (f"; its pod: {exit_note}" if exit_note else "")


NOT_STARTED = "the node was unreachable: a reboot Job could not run there, so none was created"


class _JobHook:
    """The Job hook, round by round of the wait for the new bootID: the Job is created once the node's kubelet
    answers (at once, normally), then followed to its end.

    On an unreachable node (``NodeView.unreachable``) no Job is created: its pod could not run there, and would
    run when the machine comes back, rebooting it a second time after the power cycle that brought it back. A
    machine that comes back with a new bootID needs no Job; one that comes back with the old bootID gets it then.
    """

    def __init__(self, ctx: StepContext, details: dict[str, Any]) -> None:
        self.ctx, self.details = ctx, details

    async def round(self, view: NodeView) -> str | None:
        ctx = self.ctx
        if "job" not in self.details:
            if view.unreachable:
                return None
            self.details |= await start_hook_job(ctx, "xidflow-reboot", ctx.settings.reboot_job_template,
                                                 effects.DEFAULT_REBOOT_JOB)
            return None
        return await job_failed(ctx.kube, ctx.plan.node, ctx.settings.namespace, self.details["job"])


async def run(ctx: StepContext, step: StepLike) -> StepResult:
    plan, spec = ctx.plan, step.spec
    flow = plan.flow_key
    before = ctx.view.ledger.flow_value(flow, "boot_id_before") or ctx.view.boot_id
    hook = spec.hook or "job"
    details: dict[str, Any] = {"hook": hook, "boot_id_before": before}
    each_round = None
    if hook == "job":
        each_round = _JobHook(ctx, details).round
    elif hook == "annotation":

        def request(view: NodeView, ledger: Ledger) -> tuple[effects.NodeChange | None, None]:
            if view.annotations.get(REBOOT_REQUEST_ANNOTATION) == flow:
                return None, None
            return effects.reboot_annotation_change(flow), None

        await ctx.writer.update(plan.node, request, f"reboot-request {flow}")
    else:
        payload = {"node": plan.node, "flow": flow, "bootId": before, "action": "reboot"}
        details["status"] = await effects.call_webhook(spec.webhook_url or "", payload, flow)
    ok, view, failed = await effects.wait_for_reboot(
        ctx.kube, plan.node, before, spec.timeout or effects.DEFAULT_REBOOT_TIMEOUT, each_round=each_round
    )
    if hook == "job" and "job" not in details:
        details["job_not_started"] = NOT_STARTED
    if failed is not None:
        return StepResult(Outcome.FAILED, f"{failed}; the node kept bootID {before}", details)
    if not ok:
        unstarted = f" ({NOT_STARTED})" if "job_not_started" in details else ""
        return StepResult(Outcome.FAILED, f"node did not come back Ready with a new bootID{unstarted}", details)
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
