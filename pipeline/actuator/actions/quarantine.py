"""quarantine: cordon + taint + condition + event when the catalog says the fault quarantines, else event only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.actuator.actions.base import ActionDef, Kind

if TYPE_CHECKING:
    from pipeline.actuator.policy import ActionSpec
    from schemas.records import NodeIncident


def expand(spec: ActionSpec, incident: NodeIncident) -> list[ActionSpec]:
    from pipeline.actuator.policy import ActionSpec

    if not (incident.quarantine or incident.action.quarantines):
        return [ActionSpec(name="event")]
    attrs = (("key", spec.key), ("value", spec.value), ("effect", spec.effect))
    taint = {k: v for k, v in attrs if v}
    return [
        ActionSpec(name="cordon"),
        ActionSpec(name="taint", **taint),
        ActionSpec(name="condition"),
        ActionSpec(name="event"),
    ]


ACTION = ActionDef(name="quarantine", kind=Kind.MACRO, attrs=frozenset({"key", "value", "effect"}), expand=expand)
