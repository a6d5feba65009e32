"""taint: add the quarantine taint (key/effect from the rule, else the settings; value names the problem)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.actuator import effects
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepLike
from pipeline.actuator.ownership import taint_effect_key

if TYPE_CHECKING:
    from pipeline.actuator.nodeview import NodeView
    from pipeline.actuator.ownership import Ledger


def change(view: NodeView, ledger: Ledger, step: StepLike, ctx: StepContext) -> effects.NodeChange:
    spec, settings, problem = step.spec, ctx.settings, ctx.plan.problem
    return effects.taint_change(
        view,
        ledger,
        ctx.plan.flow_key,
        spec.key or settings.taint_key,
        spec.value or (problem.taint_value if problem else "rescue-request"),
        spec.effect or settings.taint_effect,
    )


ACTION = ActionDef(
    name="taint",
    kind=Kind.NODE,
    attrs=frozenset({"key", "value", "effect"}),
    quarantining=True,
    owns="the taint (by key and effect), when it was not there before",
    undo="remove the taint once no open flow owns it",
    effect_key=lambda spec, settings, problem: taint_effect_key(
        spec.key or settings.taint_key, spec.effect or settings.taint_effect
    ),
    change=change,
)
