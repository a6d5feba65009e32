"""Correlated fabric faults blamed on a shared part (switch, NVSwitch tray, rack): the pure logic.

When an InfiniBand switch, an NVSwitch tray or a rack's power fails, many nodes report NCCL
transport errors, NVLink or SXid faults within seconds. Node-level rules would take them out one by
one; here they are grouped by the topology labels the operator names in the policy
(``RescuePolicy.spec.sharedParts``) and, from ``minNodes`` nodes sharing a label value within
``window`` seconds, become one ``SharedPartIncident`` about the part.

Two stages, each where its input lives:

1. **Per node, in the aggregation** (``fabric_signal``, called by ``Aggregator.step``): a fabric-class
   event becomes a ``FabricSignal`` on its own topic (``gpu.fabric.signals``), keyed by node, at most once per node per
   ``debounce_window_s`` of event time (a storm of a million lines is a handful of signals). The
   worker has no Kubernetes access and no policy, so it cannot know a node's rack or switch, and it
   needs neither: the node's lines stay on its partition, and its own incidents are unchanged (a
   node's fatal kernel fault, Xid 79, is still that node's incident).
2. **Per label value, in the actuator** (``observe``): the actuator watches every GPU node (labels)
   and holds the policy, so it resolves the grouping. Correlation across nodes needs one place per
   label value: the part's entry in one ConfigMap (``pipeline.actuator.sharedparts``), written with
   its resourceVersion, so replicas owning different node partitions serialise their updates to one
   part and exactly one of them opens its incident. A redelivered signal changes nothing (its id is
   remembered), so at-least-once delivery gives one incident per part.

Event time (the signal's log time) drives the window, so ``xidflow replay`` decides the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

from pydantic import BaseModel, Field

from pipeline.detection.catalog import Catalog
from schemas.records import Action, FabricSignal, FaultEvent, FaultKind, SharedPartIncident, stable_id

NCCL_TRANSPORT_SIGNALS = frozenset({
    "nccl_net_ib_error",
    "nccl_ibv_call_failed",
    "nccl_net_ofi_error",
    "nccl_net_socket_error",
    "nccl_remote_error",
})
"""Pod signals (``pipeline.ingest.parsing.pod``) of NCCL's network transports: what a broken switch makes every
rank behind it print. Watchdog timeouts and aborted communicators are left out: a hung job prints them
whatever the fabric does."""

POD_NVLINK_SIGNALS = frozenset({"cuda_nvlink_uncorrectable"})

RECENT_SIGNALS = 256
"""Signal ids remembered per part to drop redeliveries."""


def fault_class(event: FaultEvent, catalog: Catalog) -> str | None:
    """Which fabric class an event belongs to (``nccl_transport``, ``nvlink``, ``sxid``, ``gpu_lost``), or None.

    Kernel events the catalog says to ignore (a non-fatal SXid, a Nonfatal NVLink5 row) count for nothing.
    """
    if event.kind is FaultKind.POD_ERROR:
        if event.name in NCCL_TRANSPORT_SIGNALS:
            return "nccl_transport"
        return "nvlink" if event.name in POD_NVLINK_SIGNALS else None
    if event.action is Action.IGNORE:
        return None
    if event.kind is FaultKind.GPU_FALLEN_OFF_BUS:
        return "gpu_lost"
    if event.kind is FaultKind.SXID:
        return "sxid"
    if event.kind is FaultKind.XID:
        if catalog.workflow(event.code) == "gpu_lost":
            return "gpu_lost"
        if catalog.problem("xid", event.code) == "nvlink":
            return "nvlink"
    return None


def blamed_on_part(kind: FaultKind, code: int | None, signature: str, catalog: Catalog) -> bool:
    """Whether a node incident of this kind is one a shared part explains (NVLink, SXid, a pod's NVLink error),
    so that a node already blamed on an open part is not also quarantined for it. A lost GPU (Xid 79, fallen
    off the bus) is the node's own: it counts towards a part but is still handled as the node's incident."""
    if kind is FaultKind.SXID:
        return True
    if kind is FaultKind.XID:
        return catalog.workflow(code) != "gpu_lost" and catalog.problem("xid", code) == "nvlink"
    if kind is FaultKind.POD_ERROR:
        return any(name in signature for name in POD_NVLINK_SIGNALS)
    return False


def fabric_signal(
    node: str, last_emitted: Mapping[str, float], event: FaultEvent, signature: str, catalog: Catalog, every_s: float
) -> FabricSignal | None:
    """The signal to emit for this event, or None (not fabric-class, or one of its class was emitted less
    than ``every_s`` of event time before). The caller keeps ``signal.ts`` in ``last_emitted[fault_class]``:
    per class, so a node's own Xid 79 in the middle of an NCCL storm is still told."""
    cls = fault_class(event, catalog)
    if cls is None:
        return None
    ts = event.ts.timestamp()
    last = last_emitted.get(cls)
    if last is not None and ts - last < every_s:
        return None
    return FabricSignal(
        signal_id=stable_id(node, "fabric", event.id),
        node=node,
        kind=event.kind,
        code=event.code,
        signature=signature,
        fault_class=cls,
        ts=event.ts,
        event_ids=[event.id],
    )


# -- per label value --------------------------------------------------------------------------------------
class Member(BaseModel):
    """A node of the part that reported fabric faults: event times, epoch seconds."""

    first: float
    last: float
    classes: list[str] = Field(default_factory=list)
    signature: str = ""


class PartState(BaseModel):
    """Everything the correlation remembers about one label value (JSON in the ConfigMap)."""

    label: str
    value: str
    members: dict[str, Member] = Field(default_factory=dict)
    recent: list[str] = Field(default_factory=list, description="Signal ids applied, to drop redeliveries")
    incident: SharedPartIncident | None = None
    applied: dict[str, int] = Field(
        default_factory=dict, description="Node -> incident revision whose effects are on it (actuator)"
    )
    event_for: int | None = Field(default=None, description="Incident revision whose Event and audit were written")


def part_key(label: str, value: str) -> str:
    return f"{label}={value}"


def observe(
    state: PartState,
    signal: FabricSignal,
    *,
    part: str,
    min_nodes: int,
    window_s: float,
    rule: str = "",
    now: datetime | None = None,
) -> str | None:
    """Apply one signal of a node carrying ``state.label=state.value``. Mutates ``state``.

    Returns ``"opened"`` when this signal makes ``min_nodes`` distinct nodes within ``window_s`` (event
    time) and no incident is open, ``"joined"`` when a new node joins an open incident (revision + 1),
    else None. Members whose last signal fell out of the window (against the newest signal of the
    part) no longer count towards opening; an open incident keeps its nodes until a person clears it.
    """
    if signal.signal_id in state.recent:
        return None
    state.recent.append(signal.signal_id)
    del state.recent[:-RECENT_SIGNALS]
    ts = signal.ts.timestamp()
    member = state.members.get(signal.node)
    if member is None:
        member = state.members[signal.node] = Member(first=ts, last=ts, signature=signal.signature)
    member.first, member.last = min(member.first, ts), max(member.last, ts)
    if signal.fault_class not in member.classes:
        member.classes.append(signal.fault_class)
    newest = max(m.last for m in state.members.values())
    horizon = newest - window_s
    for node in [n for n, m in state.members.items() if m.last < horizon]:
        del state.members[node]
    inc = state.incident
    if inc is not None:
        if ts > inc.last_seen.timestamp():
            inc.last_seen = _dt(ts)
        if signal.node in inc.nodes:
            _add(inc, signal)  # a new fault class of a node already named (no new revision: same nodes)
            return None
        if signal.node not in state.members:
            return None
        inc.nodes = sorted({*inc.nodes, signal.node})
        _add(inc, signal)
        inc.revision += 1
        return "joined"
    if len(state.members) < min_nodes:
        return None
    members = state.members
    state.incident = SharedPartIncident(
        incident_id=stable_id("shared-part", state.label, state.value, signal.signal_id),
        label=state.label,
        value=state.value,
        part=part,
        nodes=sorted(members),
        fault_classes=sorted({c for m in members.values() for c in m.classes}),
        signatures=sorted({m.signature for m in members.values() if m.signature})[:16],
        first_seen=_dt(min(m.first for m in members.values())),
        last_seen=_dt(newest),
        opened_at=now or datetime.now(UTC),
        min_nodes=min_nodes,
        window_s=window_s,
        rule=rule,
    )
    return "opened"


def _add(inc: SharedPartIncident, signal: FabricSignal) -> None:
    if signal.fault_class not in inc.fault_classes:
        inc.fault_classes = sorted({*inc.fault_classes, signal.fault_class})
    if signal.signature not in inc.signatures and len(inc.signatures) < 16:
        inc.signatures.append(signal.signature)


def _dt(value: float) -> datetime:
    return datetime.fromtimestamp(value, UTC)
