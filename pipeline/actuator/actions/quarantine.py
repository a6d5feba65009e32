"""quarantine: what the catalog's action asks of the node.

cordon + taint + condition + event when the fault quarantines; condition + event for ALERT (tell a person
and repair tooling, keep serving); one event for RESTART_APP; nothing for IGNORE. A quarantine also
tells the pods on the node (notifyWorkload: pod Events and the GPU-fault pod condition).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.actuator.actions.base import ActionDef, Kind

if TYPE_CHECKING:
    from pipeline.actuator.policy import ActionSpec
    from schemas.records import NodeIncident


def expand(spec: ActionSpec, incident: NodeIncident) -> list[ActionSpec]:
    from pipeline.actuator.policy import ActionSpec
    from schemas.records import Action

    if not (incident.quarantine or incident.action.quarantines):
        if incident.action is Action.ALERT:
            return [ActionSpec(name="condition"), ActionSpec(name="event")]
        return [] if incident.action is Action.IGNORE else [ActionSpec(name="event")]
    attrs = (("key", spec.key), ("value", spec.value), ("effect", spec.effect))
    taint = {k: v for k, v in attrs if v}
    return [
        ActionSpec(name="cordon"),
        ActionSpec(name="taint", **taint),
        ActionSpec(name="condition"),
        ActionSpec(name="event"),
        ActionSpec(name="notifyWorkload"),
    ]


ACTION = ActionDef(name="quarantine", kind=Kind.MACRO, attrs=frozenset({"key", "value", "effect"}), expand=expand)
