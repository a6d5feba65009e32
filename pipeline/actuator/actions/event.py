"""event: one Warning Event on the Node per flow (deterministic name: a retry finds it, never doubles it)."""

from __future__ import annotations

from pipeline.actuator import effects
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepLike, StepResult
from pipeline.actuator.problems import event_message
from schemas.records import Outcome


async def run(ctx: StepContext, step: StepLike) -> StepResult:
    plan, problem = ctx.plan, ctx.plan.problem
    message = event_message(ctx.incident) if ctx.incident else f"rescue request {plan.flow_key}"
    reason = problem.event_reason if problem else "RescueRequest"
    name = effects.object_name(plan.node[:200], plan.node, plan.flow_key, step.key)
    created = await effects.create_node_event(ctx.kube, ctx.view, name, reason, message)
    return StepResult(
        Outcome.APPLIED if created else Outcome.ALREADY_APPLIED,
        f"Warning {reason}" if created else f"Event {name} already exists",
        {"event": name},
    )


ACTION = ActionDef(name="event", kind=Kind.INSTANT, allowed_when_breaker_open=True, run=run)
