"""Reading a Node and writing it together with its ledger, conditionally (resourceVersion), retried on 409."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from pipeline.actuator import effects
from pipeline.actuator.effects import NodeChange
from pipeline.actuator.kube import Conflict, Kube, KubeUnavailable, NotFound
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import LAST_ACTION_ANNOTATION, LEDGER_ANNOTATION, Ledger

T = TypeVar("T")
Mutate = Callable[[NodeView, Ledger], tuple[NodeChange | None, T]]

# Nodes whose last written view is kept (a Node view is a few KB; the watch cache holds the rest).
_WRITTEN_CAP = 4096


def newest(a: NodeView | None, b: NodeView | None) -> NodeView | None:
    """The later of two views of one Node by resourceVersion (etcd's are integers; else the first)."""
    if a is None or b is None:
        return a or b
    if a.resource_version.isdigit() and b.resource_version.isdigit():
        return a if int(a.resource_version) >= int(b.resource_version) else b
    return a


class NodeWriter:
    """The one way the actuator changes a Node: the effect and its ledger record land together or not at all.

    A write starts from the Node as last seen - the newer of the watch cache (``peek``, the reconciler's) and
    the response to our own last write - instead of reading it first: every write is conditional on the
    resourceVersion of the view it was computed from, so a stale view costs a 409 and a recomputation,
    never a clobbered Node.

    Next to a cluster's node lifecycle controller that matters on every quarantine: it answers xidflow's
    cordon with a write of its own (its ``node.kubernetes.io/unschedulable`` taint), between xidflow's node
    patch and the status patch that follows it (Events and conditions wait until the taints are out). Had
    the status patch started from our own last write, as it once did, it was refused every time (409), and
    the node was read and the patch sent again: five calls a node instead of three. It starts from the
    watch's view once the watch has delivered that write, and a 409 takes the watch's newer view when it has
    one instead of a read. What the write is conditional on is unchanged (the whole Node's version): a
    person's uncordon or another replica's ledger write in between still refuses it and the decision is
    made again from what they wrote.
    """

    def __init__(self, kube: Kube, worker: str, max_flows: int) -> None:
        self.kube, self.worker, self.max_flows = kube, worker, max_flows
        self.peek: Callable[[str], NodeView | None] | None = None
        self._written: OrderedDict[str, NodeView] = OrderedDict()

    def _remember(self, view: NodeView) -> NodeView:
        self._written[view.name] = view
        self._written.move_to_end(view.name)
        while len(self._written) > _WRITTEN_CAP:
            self._written.popitem(last=False)
        return view

    def known(self, name: str) -> NodeView | None:
        """The Node as last seen without asking the API server (None: never seen)."""
        return newest(self.peek(name) if self.peek is not None else None, self._written.get(name))

    async def read(self, name: str) -> NodeView | None:
        try:
            return self._remember(NodeView.from_object(await self.kube.get_node(name)))
        except NotFound:
            self._written.pop(name, None)
            return None

    async def current(self, name: str) -> NodeView | None:
        """The Node as the watch last saw it, else read (None: it does not exist).

        Only the watch's view, not our own last write: a decision that writes nothing (a redelivery
        of a finished flow) is never checked by a 409, so it must come from a view that follows other
        writers too. A person's uncordon the watch has not delivered yet is handled when it arrives.
        """
        seen = self.peek(name) if self.peek is not None else None
        return seen or await self.read(name)

    async def update(
        self, node: str, mutate: Mutate[T], label: str, first: NodeView | None = None
    ) -> tuple[T, NodeView | None]:
        """Conditional read-modify-write of a Node and its ledger, recomputed on 409.

        ``mutate`` changes the ledger in place and returns the change (None: write nothing) and a
        result; it may run several times. Returns the result and the Node as written (None when
        nothing was written). A change with ``status`` goes through the status subresource, the
        ledger with it (one write); ``spec`` through the Node itself.
        """
        view = newest(first, self.known(node))
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
            try:
                if change.status:
                    assert not change.spec, "spec and status cannot be written in one call"
                    written = await self._write_status(node, body, change.status)
                else:
                    if change.spec:
                        body["spec"] = change.spec
                    written = NodeView.from_object(await self.kube.patch_node(node, body))
            except Conflict:
                # Someone else wrote the node: recompute from what they wrote, never clobber. The watch has
                # usually delivered it by now (a read only where it has not).
                view = self._seen_after(view)
                continue
            return result, self._remember(written)
        raise KubeUnavailable(f"node {node}: gave up after 100 conflicting writes")

    def _seen_after(self, refused: NodeView) -> NodeView | None:
        """The watch's view of the node when it is newer than ``refused`` (a write refused with 409), else None."""
        seen = self.peek(refused.name) if self.peek is not None else None
        if seen is None or not (seen.resource_version.isdigit() and refused.resource_version.isdigit()):
            return None
        return seen if int(seen.resource_version) > int(refused.resource_version) else None

    async def _write_status(self, node: str, body: dict[str, Any], status: dict[str, Any]) -> NodeView:
        """Status and ledger in one conditional status write (the status subresource keeps a Node's metadata).

        An API server that dropped the metadata of a status write gets the ledger in a second,
        conditional write of the Node: the record is never lost, only one call dearer.
        """
        written = NodeView.from_object(await self.kube.patch_node_status(node, {**body, "status": status}))
        wanted = body["metadata"]["annotations"]
        if all(written.annotations.get(k) == v for k, v in wanted.items() if v is not None):
            return written
        retry = {"metadata": {"resourceVersion": written.resource_version, "annotations": wanted}}
        return NodeView.from_object(await self.kube.patch_node(node, retry))
