"""condition: set the problem's NodeCondition (GpuXid, GpuEcc, ...) to True for node-repair tooling."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.actuator import effects
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepResult
from pipeline.actuator.kube import Conflict, KubeUnavailable, NotFound
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import condition_effect_key
from pipeline.actuator.problems import ProblemClass, event_message
from schemas.records import Outcome

if TYPE_CHECKING:
    from pipeline.actuator.plan import Step


async def run(ctx: StepContext, step: Step) -> StepResult:
    """Conditional status write: of two replicas racing, one sets it and the other sees it set."""
    plan, problem = ctx.plan, ctx.plan.problem
    ctype = str(problem.condition_type) if problem else str(ProblemClass.XID)
    reason = "ContactSupport" if plan.escalated else (problem.event_reason if problem else "RescueRequest")
    message = event_message(ctx.incident) if ctx.incident else f"rescue request {plan.flow_key}"
    view = ctx.view
    for _ in range(50):
        current = view.condition(ctype)
        if current and current.get("status") == "True" and current.get("reason") == reason:
            return StepResult(Outcome.ALREADY_APPLIED, f"{ctype}=True already set")
        try:
            written = await effects.set_condition(
                ctx.kube, plan.node, ctype, True, reason, message, view.resource_version
            )
        except Conflict:
            fresh = await ctx.writer.read(plan.node)
            if fresh is None:
                raise NotFound(404, "NotFound", f"node {plan.node} is gone") from None
            view = fresh
            continue
        ctx.view = NodeView.from_object(written)
        return StepResult(Outcome.APPLIED, f"{ctype}=True ({reason})", owns=(condition_effect_key(ctype),))
    raise KubeUnavailable(f"node {plan.node}: condition kept conflicting")


def status_change(view: NodeView, step: Step, ctx: StepContext) -> tuple[dict[str, Any] | None, StepResult]:
    """The condition as a status change, written by the effector in one status write with the ledger."""
    plan, problem = ctx.plan, ctx.plan.problem
    ctype = str(problem.condition_type) if problem else str(ProblemClass.XID)
    reason = "ContactSupport" if plan.escalated else (problem.event_reason if problem else "RescueRequest")
    message = event_message(ctx.incident) if ctx.incident else f"rescue request {plan.flow_key}"
    current = view.condition(ctype)
    if current and current.get("status") == "True" and current.get("reason") == reason:
        return None, StepResult(Outcome.ALREADY_APPLIED, f"{ctype}=True already set")
    entry = effects.condition_entry(ctype, True, reason, message)
    return entry, StepResult(Outcome.APPLIED, f"{ctype}=True ({reason})", owns=(condition_effect_key(ctype),))


ACTION = ActionDef(
    name="condition",
    kind=Kind.INSTANT,
    owns="the NodeCondition of the problem class",
    undo="set the condition False (XidflowRecovered)",
    effect_key=lambda spec, settings, problem: condition_effect_key(problem.condition_type) if problem else None,
    run=run,
    status_change=status_change,
)
