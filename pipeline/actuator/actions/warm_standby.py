"""enableWarmStandby: make a cordoned standby node (matching a WarmStandbyPolicy) schedulable."""

from __future__ import annotations

from pipeline.actuator import effects
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepLike, StepResult
from pipeline.actuator.kube import Conflict
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import STANDBY_FOR_ANNOTATION
from schemas.records import Outcome


async def run(ctx: StepContext, step: StepLike) -> StepResult:
    plan, settings = ctx.plan, ctx.settings
    marker = f"{plan.node}/{plan.flow_key}"
    # Standby nodes are part of the GPU fleet: the fleet selector keeps the choice inside it.
    selector = ",".join(x for x in (settings.gpu_node_selector, f"{settings.standby_label}=true") if x)
    standby = await ctx.kube.list_nodes(selector)
    # Resumed after a replica died: the standby it already enabled is the answer, not a second one.
    for node in standby:
        if (node["metadata"].get("annotations") or {}).get(STANDBY_FOR_ANNOTATION) == marker:
            chosen = node["metadata"]["name"]
            return StepResult(Outcome.APPLIED, f"standby {chosen} made schedulable", {"standby": chosen},
                              values={"standby": chosen})
    targets = ctx.policies.current.standby_targets(ctx.view.labels)
    chosen = effects.choose_standby([n for n in standby if n["metadata"]["name"] != plan.node], targets)
    if chosen is None:
        return StepResult(Outcome.FAILED, "no cordoned standby node available", {"targets": targets})
    for _ in range(20):
        node = NodeView.from_object(await ctx.kube.get_node(chosen))
        if not node.unschedulable:
            break
        change = effects.standby_change(node, plan.node, plan.flow_key)
        body = {
            "metadata": {"resourceVersion": node.resource_version, "annotations": change.annotations},
            "spec": change.spec,
        }
        try:
            await ctx.kube.patch_node(chosen, body)
            break
        except Conflict:
            continue
    return StepResult(
        Outcome.APPLIED, f"standby {chosen} made schedulable", {"standby": chosen}, values={"standby": chosen}
    )


ACTION = ActionDef(name="enableWarmStandby", kind=Kind.LONG, requestable=True, run=run)
