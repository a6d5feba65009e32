"""What the actuator needs to know about a Node, read from its JSON object. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.actuator.ownership import Ledger

CORDON_ANSWER_TAINT = "node.kubernetes.io/unschedulable"
"""The taint Kubernetes' node lifecycle controller adds to every cordoned Node (and removes on uncordon): its write
of its own on the Node, in answer to a cordon (``spec.unschedulable``; what ``nodeTaintsPolicy: Honor`` reads)."""


@dataclass(frozen=True)
class NodeView:
    """A Node as the planner, the effects and the reconciler see it."""

    name: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    unschedulable: bool
    taints: tuple[Mapping[str, Any], ...]
    ready: bool
    boot_id: str
    resource_version: str
    conditions: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def from_object(cls, node: Mapping[str, Any]) -> NodeView:
        meta = node.get("metadata") or {}
        spec = node.get("spec") or {}
        status = node.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        return cls(
            name=meta.get("name", ""),
            labels=meta.get("labels") or {},
            annotations=meta.get("annotations") or {},
            unschedulable=bool(spec.get("unschedulable")),
            taints=tuple(spec.get("taints") or ()),
            ready=ready,
            boot_id=(status.get("nodeInfo") or {}).get("bootID", ""),
            resource_version=meta.get("resourceVersion", ""),
            conditions=tuple(status.get("conditions") or ()),
        )

    def condition(self, condition_type: str) -> Mapping[str, Any] | None:
        return next((c for c in self.conditions if c.get("type") == condition_type), None)

    @property
    def unreachable(self) -> bool:
        """The node lifecycle controller's verdict that no kubelet answers for the node (its heartbeats stopped for
        longer than the grace period): Ready ``Unknown``, as it sets with its ``node.kubernetes.io/unreachable``
        taints. Pods there cannot start, and pods deleted there cannot end, until the machine is back."""
        ready = self.condition("Ready")
        return ready is not None and ready.get("status") == "Unknown"

    @property
    def ledger(self) -> Ledger:
        return Ledger.from_annotations(self.annotations)

    def opted_out(self, opt_out_label: str) -> bool:
        return str(self.labels.get(opt_out_label, "")).lower() == "true"
