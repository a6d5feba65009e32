"""quarantine: what the catalog's action asks of the node.

cordon + taint + condition + event when the fault quarantines; condition + event for ALERT (tell a person
and repair tooling, keep serving); one event for RESTART_APP; nothing for IGNORE. Either quarantine also tells
the pods on the node (notifyWorkload: pod Events and the GPU-fault pod condition).

With ``perGpu: true`` a quarantine is taintDevice + condition + event + notifyWorkload + a drain of that GPU's
pods: the faulty GPU only, where the catalog and the cluster allow. The device taint is ``NoSchedule`` unless the
rule says otherwise (nothing new lands on the GPU), and the pods holding the GPU leave through xidflow's own drain
(``scope: gpu``): the Eviction API, so PodDisruptionBudgets hold, and a checkpoint request first when the rule
gives ``checkpointGrace``. With ``effect: NoExecute`` there is no drain step: Kubernetes' device-taint eviction
controller deletes those pods itself, at once and past any PodDisruptionBudget; ``effect: None`` is a dry run that
evicts nothing.
"""

from __future__ import annotations

from typing import Any

from pipeline.actuator.actions.base import ActionDef, ActionSpecLike, Expansion, Kind
from schemas.records import Action, NodeIncident

GPU_EFFECTS_WITHOUT_DRAIN = ("NoExecute", "None")
"""Device taint effects after which the per-GPU quarantine drains nothing: NoExecute (Kubernetes deletes the pods
holding the GPU itself) and None (a dry run)."""


def expand(spec: ActionSpecLike, incident: NodeIncident) -> Expansion:
    """The actions the quarantine stands for, as (name, attributes); ``plan`` validates them as ActionSpecs."""
    if not (incident.quarantine or incident.action.quarantines):
        if incident.action is Action.ALERT:
            return [("condition", {}), ("event", {})]
        return [] if incident.action is Action.IGNORE else [("event", {})]
    attrs = (("key", spec.key), ("value", spec.value), ("effect", spec.effect))
    taint: dict[str, Any] = {k: v for k, v in attrs if v}
    if spec.per_gpu:
        # Per-GPU quarantine: taintDevice takes the one GPU out, or the node when the fault is node-scoped,
        # the GPU is not published by a DRA driver, or the node has too many tainted (see its module).
        cap = {"max_tainted_devices": spec.max_tainted_devices} if spec.max_tainted_devices is not None else {}
        steps: Expansion = [("taintDevice", {**taint, **cap}), ("condition", {}), ("event", {}), ("notifyWorkload", {})]
        if spec.effect not in GPU_EFFECTS_WITHOUT_DRAIN:
            grace = {"checkpoint_grace": spec.checkpoint_grace} if spec.checkpoint_grace is not None else {}
            steps.append(("drain", {"scope": "gpu", **grace}))
        return steps
    return [("cordon", {}), ("taint", taint), ("condition", {}), ("event", {}), ("notifyWorkload", {})]


ACTION = ActionDef(
    name="quarantine",
    kind=Kind.MACRO,
    attrs=frozenset({"key", "value", "effect", "per_gpu", "max_tainted_devices", "checkpoint_grace"}),
    expand=expand,
)
