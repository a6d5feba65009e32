"""cordon: mark the node unschedulable (never owning a cordon someone else made)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.actuator import effects
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepLike
from pipeline.actuator.ownership import CORDON

if TYPE_CHECKING:
    from pipeline.actuator.nodeview import NodeView
    from pipeline.actuator.ownership import Ledger


def change(view: NodeView, ledger: Ledger, step: StepLike, ctx: StepContext) -> effects.NodeChange:
    return effects.cordon_change(view, ledger, ctx.plan.flow_key)


ACTION = ActionDef(
    name="cordon",
    kind=Kind.NODE,
    quarantining=True,
    requestable=True,
    owns="the cordon, when the node was schedulable",
    undo="uncordon once no open flow owns the cordon",
    effect_key=lambda spec, settings, problem: CORDON,
    change=change,
)
