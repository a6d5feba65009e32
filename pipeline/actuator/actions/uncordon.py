"""unCordon: make the node schedulable again, only when the cordon is xidflow's and no other flow needs it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.actuator import effects
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepLike

if TYPE_CHECKING:
    from pipeline.actuator.nodeview import NodeView
    from pipeline.actuator.ownership import Ledger


def change(view: NodeView, ledger: Ledger, step: StepLike, ctx: StepContext) -> effects.NodeChange:
    return effects.uncordon_change(view, ledger, ctx.plan.flow_key)


ACTION = ActionDef(
    name="unCordon",
    kind=Kind.NODE,
    requestable=True,
    dropped_on_escalation=True,
    change=change,
)
