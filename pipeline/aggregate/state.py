"""What the aggregation remembers per node: ``NodeState`` and its parts, stored in a Faust table.

One ``NodeState`` per node holds everything the rules (``pipeline.aggregate.aggregator``,
``pipeline.aggregate.rules``) need: the open incidents (one per signature group), burst history
for escalation, evidence waiting for a kernel signal, and what the node's boot and health checks look
like. It is a pydantic model so a Faust table can store it (``to_bytes``/``from_bytes``) and a
restarted worker picks up where the last one left off. Times in it are epoch seconds (``epoch``,
``utc`` convert). ``replayed``/``remember`` keep the redelivery bookkeeping (recent ids, offsets)
that makes applying an event twice a no-op. Pure: no Faust, no I/O.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, Field

from schemas.records import Action, FaultKind, Severity, Source


class OpenIncident(BaseModel):
    """An incident that has been emitted and not yet recovered. Times are epoch seconds."""

    incident_id: str
    group: str
    signature: str
    signatures: list[str]
    kind: FaultKind
    source: Source
    code: int | None = None
    pci: str | None = None
    gpu_uuid: str | None = None
    gpu_instance: int | None = None
    compute_instance: int | None = None
    reports: dict[str, int] = Field(
        default_factory=dict, description="SXid: reports counted per reporter (driver, fabric_manager)"
    )
    count: int = 1
    first_seen: float
    last_seen: float
    last_seen_wall: float
    opened_wall: float
    source_ts: float
    revision: int = 0
    severity: Severity
    action: Action
    escalation_reason: str | None = None
    evidence_ids: list[str] = Field(default_factory=list)
    boot_id: str | None = None
    line: str = ""
    emitted_count: int = 1
    emitted_wall: float


class PendingEvidence(BaseModel):
    """An Xid 45 or sympathetic pod error waiting for kernel evidence to attach to."""

    event_id: str
    signature: str
    role: str  # "xid45" or "sympathetic"
    ts: float
    pci: str | None = None


class BurstTrack(BaseModel):
    """Burst starts of one escalation key (event time), newest last."""

    last_ts: float
    last_kind: FaultKind | None = None
    bursts: list[float] = Field(default_factory=list)


class NodeState(BaseModel):
    """Everything the aggregation rules remember about one node."""

    node: str
    boot_id: str | None = None
    boot_checks: dict[str, bool] = Field(
        default_factory=dict, description="Latest result per health check since the last reboot was seen"
    )
    rebooted: bool = Field(default=False, description="A new boot id was seen and checks are still pending")
    incidents: dict[str, OpenIncident] = Field(default_factory=dict, description="Open incidents by group")
    pending: list[PendingEvidence] = Field(default_factory=list)
    tracks: dict[str, BurstTrack] = Field(default_factory=dict)
    recent_ids: list[str] = Field(default_factory=list)
    watermark: float | None = Field(
        default=None, description="Latest event time seen on the node (epoch s): what history expires against"
    )
    position: tuple[int, int] | None = Field(
        default=None, description="(partition, offset) of the last applied event, to skip redeliveries"
    )
    recent_offsets: list[int] = Field(
        default_factory=list,
        description="Offsets (in the partition of ``position``) of the events in ``recent_ids``, same order",
    )
    forgotten_offset: int | None = Field(
        default=None,
        description="Highest offset of an applied event no longer in ``recent_ids``: an event above it that "
        "is not among them was never applied, even if it comes after later ones (re-read after a drop)",
    )
    fabric_emitted: dict[str, float] = Field(
        default_factory=dict,
        description="Event time of the last FabricSignal emitted for the node, per fault class "
        "(pipeline.aggregate.sharedparts)",
    )

    def to_bytes(self) -> bytes:
        # pydantic's own JSON encoder, without the intermediate dict of model_dump (less than half the
        # time of orjson over it; one state per touched node per batch). The decoder reads both.
        return self.__pydantic_serializer__.to_json(self)

    @classmethod
    def from_bytes(cls, data: bytes | str) -> NodeState:
        return cls.model_validate_json(data)

    def has_transient(self) -> bool:
        """True when ``tick`` may have something to close."""
        return any(not inc.action.quarantines for inc in self.incidents.values())

    def tick_due(self, quiet_period_s: float) -> float | None:
        """Wall time (epoch s) from which a tick of this state may change it; None: never.

        A transient incident closes ``quiet_period_s`` after it was last seen (``rules.close_quiet``);
        one it does not close that way (a health-check incident) keeps the node due at once, on every
        tick, as ``has_transient`` always did (``tick`` also expires the node's history).
        """
        due: float | None = None
        for inc in self.incidents.values():
            if inc.action.quarantines:
                continue
            if inc.kind is FaultKind.HEALTH_CHECK:
                return 0.0
            at = inc.last_seen_wall + quiet_period_s
            due = at if due is None else min(due, at)
        return due


def epoch(value: datetime) -> float:
    """A datetime as the epoch seconds the state stores."""
    return value.timestamp()


def utc(value: float) -> datetime:
    """Epoch seconds of the state as an aware UTC datetime (what records carry)."""
    return datetime.fromtimestamp(value, UTC)


def replayed(state: NodeState, position: tuple[int, int] | None) -> bool:
    """The event at ``position`` (not among the recent ids) was applied before: a redelivery.

    At or before the last applied position of the same partition, it was applied unless it lies
    above ``forgotten_offset`` (every applied event above that is among the recent ids): such an
    event was fetched after later ones (a record the consumer dropped and read again) and is new.
    """
    if position is None or state.position is None or position[0] != state.position[0]:
        return False
    if position[1] > state.position[1]:
        return False
    if len(state.recent_offsets) != len(state.recent_ids):
        return True  # window of offsets unknown (state from an older version): as before
    if position[1] == state.position[1] or position[1] in state.recent_offsets:
        return True  # that very record was applied
    return state.forgotten_offset is not None and position[1] <= state.forgotten_offset


def remember(state: NodeState, event_id: str, position: tuple[int, int] | None, keep: int) -> None:
    """Record an applied event: its id, its offset, the last applied position."""
    if position is not None:
        if state.position is not None and position[0] != state.position[0]:
            # The node moved partition: earlier offsets say nothing about this one.
            state.recent_offsets, state.forgotten_offset = [], None
            state.recent_ids = []
        if state.position is None or position[0] != state.position[0] or position[1] > state.position[1]:
            state.position = position
    if len(state.recent_offsets) != len(state.recent_ids):
        # Older state without offsets: everything remembered counts as at or before the last position.
        last = state.position[1] if state.position is not None else -1
        state.recent_offsets = [last] * len(state.recent_ids)
        state.forgotten_offset = last if state.position is not None else None
    state.recent_ids.append(event_id)
    state.recent_offsets.append(position[1] if position is not None else -1)
    excess = len(state.recent_ids) - keep
    if excess > 0:
        evicted = state.recent_offsets[:excess]
        del state.recent_ids[:excess]
        del state.recent_offsets[:excess]
        previous = [state.forgotten_offset] if state.forgotten_offset is not None else []
        state.forgotten_offset = max([*evicted, *previous])


def state_to_dict(state: NodeState) -> dict[str, Any]:
    """JSON-safe dict of a node state (what the Faust table's changelog carries)."""
    return state.model_dump(mode="json")


def state_from_dict(data: dict[str, Any]) -> NodeState:
    return NodeState.model_validate(data)
