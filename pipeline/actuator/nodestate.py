"""Reading a Node and writing it together with its ledger, conditionally (resourceVersion), retried on 409."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from pipeline.actuator import effects
from pipeline.actuator.effects import NodeChange
from pipeline.actuator.kube import Conflict, Kube, KubeUnavailable, NotFound
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import LAST_ACTION_ANNOTATION, LEDGER_ANNOTATION, Ledger

T = TypeVar("T")
Mutate = Callable[[NodeView, Ledger], tuple[NodeChange | None, T]]


class NodeWriter:
    """The one way the actuator changes a Node: the effect and its ledger record land together or not at all."""

    def __init__(self, kube: Kube, worker: str, max_flows: int) -> None:
        self.kube, self.worker, self.max_flows = kube, worker, max_flows

    async def read(self, name: str) -> NodeView | None:
        try:
            return NodeView.from_object(await self.kube.get_node(name))
        except NotFound:
            return None

    async def update(
        self, node: str, mutate: Mutate[T], label: str, first: NodeView | None = None
    ) -> tuple[T, NodeView | None]:
        """Conditional read-modify-write of a Node and its ledger, recomputed on 409.

        ``mutate`` changes the ledger in place and returns the change (None: write nothing) and a
        result; it may run several times. Returns the result and the Node as written (None when
        nothing was written).
        """
        view = first
        for _ in range(100):
            if view is None:
                view = await self.read(node)
                if view is None:
                    raise NotFound(404, "NotFound", f"node {node} is gone")
            ledger = view.ledger
            change, result = mutate(view, ledger)
            if change is None:
                return result, None
            ledger.prune(self.max_flows)
            annotations: dict[str, str | None] = {
                LEDGER_ANNOTATION: ledger.to_annotation(),
                LAST_ACTION_ANNOTATION: f"{label} by {self.worker} at {effects.now_rfc3339()}",
                **change.annotations,
            }
            body: dict[str, Any] = {"metadata": {"resourceVersion": view.resource_version, "annotations": annotations}}
            if change.spec:
                body["spec"] = change.spec
            try:
                return result, NodeView.from_object(await self.kube.patch_node(node, body))
            except Conflict:
                view = None  # someone else wrote the node: read it again and recompute, never clobber
        raise KubeUnavailable(f"node {node}: gave up after 100 conflicting writes")
