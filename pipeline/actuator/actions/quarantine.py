"""quarantine: what the catalog's action asks of the node.

cordon + taint + condition + event when the fault quarantines; condition + event for ALERT (tell a person
and repair tooling, keep serving); one event for RESTART_APP; nothing for IGNORE. With ``perGpu: true`` a
quarantine is taintDevice + condition + event: the faulty GPU only, where the catalog and the cluster allow.
Either quarantine also tells the pods on the node (notifyWorkload: pod Events and the GPU-fault pod condition).
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
    if spec.per_gpu:
        # Per-GPU quarantine: taintDevice takes the one GPU out, or the node when the fault is node-scoped,
        # the GPU is not published by a DRA driver, or the node has too many tainted (see its module).
        cap = {"max_tainted_devices": spec.max_tainted_devices} if spec.max_tainted_devices is not None else {}
        return [ActionSpec(name="taintDevice", **taint, **cap), ActionSpec(name="condition"), ActionSpec(name="event"),
                ActionSpec(name="notifyWorkload")]
    return [
        ActionSpec(name="cordon"),
        ActionSpec(name="taint", **taint),
        ActionSpec(name="condition"),
        ActionSpec(name="event"),
        ActionSpec(name="notifyWorkload"),
    ]


ACTION = ActionDef(
    name="quarantine",
    kind=Kind.MACRO,
    attrs=frozenset({"key", "value", "effect", "per_gpu", "max_tainted_devices"}),
    expand=expand,
)
