"""Per-node aggregation of fault events into incidents: pure logic, no Faust, no I/O.

One ``NodeState`` per node holds everything the rules need: the open incidents (one per signature
group), burst history for escalation, evidence waiting for a kernel signal, and what the node's
boot and health checks look like. ``Aggregator.step`` applies one ``FaultEvent`` and returns the
records to emit; ``Aggregator.tick`` closes transient incidents that stayed quiet;
``Aggregator.on_boot`` is the reboot/health-check recovery rule. The state is a pydantic model so a
Faust table can store it (``to_bytes``/``from_bytes``) and a restarted worker picks up where the last
one left off.

Vocabulary:

- *group*: which open incident an event folds into (``xid:31:0000:4e:00.0``; Xid 79 and "fallen off
  the bus" for one PCI share ``gpu_lost:<pci>``).
- *burst*: occurrences of a signature closer together than the debounce window. A storm of a million
  identical lines is one burst: one incident, a count, nothing re-emitted per repeat.
- *repeat* (for escalation): a new burst. Sticky codes, Xid 31 on one GPU and Xid 13 on one GPC/TPC
  raise the action after a configured number of bursts inside the escalation window, and the same
  incident id is re-emitted with ``revision + 1``.

Event time (the log line's timestamp) drives bursts and windows so that a replay decides the same
way; wall-clock ``now`` (when the worker saw the event) drives the quiet period and summaries.
Incident ids are ``stable_id(node, group, first event id)``: a replay produces the same ids.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import orjson
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.catalog import Catalog
from pipeline.sharedparts import fabric_signal
from schemas.records import (
    Action,
    FabricSignal,
    FaultEvent,
    FaultKind,
    NodeIncident,
    NodeRecovered,
    Severity,
    SignalGrade,
    Source,
    stable_id,
)

Output = NodeIncident | NodeRecovered

KERNEL_KINDS = frozenset({FaultKind.XID, FaultKind.SXID, FaultKind.GPU_FALLEN_OFF_BUS, FaultKind.KERNEL_SEGFAULT})
"""Fault kinds that count as kernel evidence for corroborating sympathetic pod errors."""

XID_KINDS = frozenset({FaultKind.XID, FaultKind.GPU_FALLEN_OFF_BUS})
"""Incidents an Xid 45 may follow."""


class AggregationSettings(BaseSettings):
    """Windows and thresholds of the aggregation rules (environment: ``XIDFLOW_AGG_<FIELD>``)."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_AGG_", extra="ignore")

    debounce_window_s: float = Field(
        default=60.0, ge=0, le=604_800,
        description="Default 60. Occurrences of one signature closer than this (event time) are one burst: "
        "they raise the count and last-seen only.",
    )
    summary_interval_s: float = Field(
        default=300.0, ge=0, le=604_800,
        description="Default 300. An open incident whose count grew is re-emitted (revision+1) at most once "
        "per this many seconds of wall time; 0 disables count updates.",
    )
    quiet_period_s: float = Field(
        default=900.0, gt=0, le=2_592_000,
        description="Default 900. A transient (non-quarantining) incident with no new occurrence for this "
        "long (wall time) is closed with NodeRecovered(reason='quiet').",
    )
    escalation_window_s: float = Field(
        default=86400.0, gt=0, le=31_536_000,
        description="Default 86400 (24 h). Bursts older than this no longer count as repeats.",
    )
    sticky_codes: frozenset[int] = Field(
        default=frozenset(),
        description="Default empty. Xid codes whose repeats point to hardware, in addition to the catalog's "
        "sticky rows (the catalog is the source: set `sticky: true` there through catalog overrides).",
    )
    sticky_repeat_threshold: int = Field(
        default=2, ge=1, le=10_000,
        description="Default 2. Bursts of a sticky code on one GPU that escalate its incident."
    )
    sticky_escalated_action: Action = Field(
        default=Action.CONTACT_SUPPORT,
        description="Default CONTACT_SUPPORT. Action of a repeating sticky code (repeated -> replace).",
    )
    xid13_repeat_threshold: int = Field(
        default=3, ge=1, le=10_000,
        description="Default 3. Bursts of Xid 13 on the same GPU, GPC and TPC that escalate."
    )
    xid13_escalated_action: Action = Field(
        default=Action.RESET_GPU, description="Default RESET_GPU. Action of Xid 13 repeating on one GPC/TPC."
    )
    xid31_repeat_threshold: int = Field(
        default=3, ge=1, le=10_000, description="Default 3. Bursts of Xid 31 on the same GPU that escalate."
    )
    xid31_escalated_action: Action = Field(
        default=Action.RESET_GPU, description="Default RESET_GPU. Action of Xid 31 repeating on one GPU."
    )
    corroboration_window_s: float = Field(
        default=300.0, ge=0, le=604_800,
        description="Default 300. Sympathetic pod errors within this (event time) of kernel evidence on the "
        "node are attached to it as evidence; alone they open nothing.",
    )
    xid45_follow_window_s: float = Field(
        default=300.0, ge=0, le=604_800,
        description="Default 300. Xid 45 within this of another Xid on the node joins that incident; alone "
        "it is noise.",
    )
    fallen_off_bus_merge_window_s: float = Field(
        default=300.0, ge=0, le=604_800,
        description="Default 300. 'Fallen off the bus' and Xid 79 for one PCI within this are one burst of "
        "one incident.",
    )
    reboot_min_passing_checks: int = Field(
        default=1, ge=1, le=100,
        description="Default 1. After a new boot id, this many distinct health checks must pass (and none "
        "fail) before the incidents of the old boot are closed with NodeRecovered(reason='reboot').",
    )
    max_evidence_ids: int = Field(default=32, ge=1, le=10_000,
    description="Default 32. Evidence ids kept per incident.")
    max_pending_evidence: int = Field(
        default=64, ge=1, le=10_000,
        description="Default 64. Xid 45 / sympathetic events held per node waiting for a kernel Xid.",
    )
    max_signatures: int = Field(default=16, ge=1, le=1000,
    description="Default 16. Distinct signatures kept per incident.")
    fabric_signals: bool = Field(
        default=True,
        description="Default true. Fabric-class events (NCCL transport, NVLink, SXid, fallen off the bus) also "
        "emit a FabricSignal (at most one per node per debounce window) for the actuator's shared-part "
        "correlation (pipeline.sharedparts); the node's own incidents are unchanged.",
    )
    recent_ids: int = Field(
        default=64, ge=1, le=100_000,
        description="Default 64. Recent event ids remembered per node to drop redelivered events."
    )


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
        description="Event time of the last FabricSignal emitted for the node, per fault class (pipeline.sharedparts)",
    )

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    @classmethod
    def from_bytes(cls, data: bytes | str) -> NodeState:
        return cls.model_validate_json(data)

    def has_transient(self) -> bool:
        """True when ``tick`` may have something to close."""
        return any(not inc.action.quarantines for inc in self.incidents.values())


def _ts(value: datetime) -> float:
    return value.timestamp()


def _dt(value: float) -> datetime:
    return datetime.fromtimestamp(value, UTC)


def event_signature(event: FaultEvent) -> str:
    """The signature of one event, as shown in incidents: ``<kind>:<code>:<where>``."""
    where = event.pci or event.nvswitch or event.gpu_uuid or "-"
    if event.kind is FaultKind.POD_ERROR:
        grade = event.grade.value if event.grade else "unknown"
        return f"pod_error:{grade}:{event.name or event.code or '-'}"
    if event.kind is FaultKind.HEALTH_CHECK:
        check = event.detail.get("check") or event.name or "-"
        gpu = event.pci or event.gpu_uuid or event.detail.get("gpu_index")
        return f"health_check:{check}:{gpu if gpu is not None else '-'}"
    if event.kind is FaultKind.KERNEL_SEGFAULT:
        return f"kernel_segfault:{event.process or event.name or '-'}"
    if event.kind is FaultKind.GPU_FALLEN_OFF_BUS:
        return f"gpu_fallen_off_bus:{where}"
    code = "-" if event.code is None else event.code
    return f"{event.kind.value}:{code}:{where}"


def group_key(event: FaultEvent, catalog: Catalog | None = None) -> str:
    """Which open incident an event folds into. The catalog's ``gpu_lost`` Xid (79) and fallen-off-bus
    share one per PCI."""
    if event.kind is FaultKind.GPU_FALLEN_OFF_BUS or (
        event.kind is FaultKind.XID and (catalog or Catalog.configured()).workflow(event.code) == "gpu_lost"
    ):
        return f"gpu_lost:{event.pci or event.gpu_uuid or '-'}"
    return event_signature(event)


def _replayed(state: NodeState, position: tuple[int, int] | None) -> bool:
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


def _remember(state: NodeState, event_id: str, position: tuple[int, int] | None, keep: int) -> None:
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


class Aggregator:
    """The aggregation rules, configured by ``AggregationSettings`` and the catalog. Stateless itself.

    The catalog (default :meth:`Catalog.configured`, so operator overrides apply) says which Xid is a
    follower (45), which is the lost-GPU group (79), which repeat rules apply (13, 31) and which codes
    are sticky; events carry the action it gave them at parse time.

    Quiet by default for what needs no one: an ``IGNORE`` event (NVIDIA's IGNORE bucket, a non-fatal
    SXid, a Nonfatal NVLink5 row, recovery action 0) opens no incident, so nothing reaches the node; it
    only counts in an incident already open for the same signature. ``RESTART_APP`` events open a
    transient incident: the actuator posts one Warning Event (the job on that node died of a GPU fault)
    and nothing else; repeats escalate per the rules above.
    """

    def __init__(self, settings: AggregationSettings | None = None, catalog: Catalog | None = None) -> None:
        self.settings = settings or AggregationSettings()
        self.catalog = catalog or Catalog.configured()

    def _workflow(self, event: FaultEvent | OpenIncident) -> str:
        return self.catalog.workflow(event.code) if event.kind is FaultKind.XID else ""

    @staticmethod
    def new_state(node: str) -> NodeState:
        return NodeState(node=node)

    # -- entry points ---------------------------------------------------------------------------

    def step(
        self,
        state: NodeState,
        event: FaultEvent,
        now: float,
        position: tuple[int, int] | None = None,
        signals: list[FabricSignal] | None = None,
    ) -> tuple[NodeState, list[Output]]:
        """Apply one fault event at wall time ``now`` (epoch s). Mutates and returns ``state``.

        ``position`` is the event's (partition, offset) on the fault-event topic: an event at or before
        the last applied position of the same partition is a redelivery and changes nothing.
        ``signals``, when given (the worker's agent, replay), receives the event's ``FabricSignal`` for the
        shared-part correlation (``pipeline.sharedparts``); they are not incidents, so they are kept apart.
        """
        if event.id in state.recent_ids:
            return state, []
        if _replayed(state, position):
            return state, []
        _remember(state, event.id, position, self.settings.recent_ids)

        event_ts = _ts(event.ts)
        if state.watermark is None or event_ts > state.watermark:
            state.watermark = event_ts
        outputs: list[Output] = []
        if event.boot_id:
            outputs += self._observe_boot(state, event.boot_id, now)
        if signals is not None and self.settings.fabric_signals:
            signal = fabric_signal(
                state.node, state.fabric_emitted, event, event_signature(event), self.catalog,
                self.settings.debounce_window_s,
            )
            if signal is not None:
                state.fabric_emitted[signal.fault_class] = event_ts
                signals.append(signal)
        if event.kind is FaultKind.HEALTH_CHECK:
            outputs += self._health_check(state, event, now)
            return state, outputs
        if self._workflow(event) == "follower":
            outputs += self._follower(state, event, "xid45", now)
            return state, outputs
        if event.kind is FaultKind.POD_ERROR and event.grade is SignalGrade.SYMPATHETIC:
            outputs += self._follower(state, event, "sympathetic", now)
            return state, outputs
        outputs += self._fault(state, event, now)
        return state, outputs

    def tick(self, state: NodeState, now: float) -> tuple[NodeState, list[Output]]:
        """Close transient incidents quiet for ``quiet_period_s`` and forget expired history."""
        outputs: list[Output] = []
        for group, inc in list(state.incidents.items()):
            if inc.action.quarantines or inc.kind is FaultKind.HEALTH_CHECK:
                continue
            quiet_for = now - inc.last_seen_wall
            if quiet_for >= self.settings.quiet_period_s:
                del state.incidents[group]
                outputs.append(
                    NodeRecovered(
                        incident_id=inc.incident_id,
                        node=state.node,
                        reason="quiet",
                        boot_id=state.boot_id,
                        recovered_at=_dt(now),
                        detail=f"{inc.signature} quiet for {quiet_for:.0f}s",
                    )
                )
        self._expire(state, now)
        return state, outputs

    def on_boot(
        self, state: NodeState, boot_id: str, now: float, checks: dict[str, bool] | None = None
    ) -> tuple[NodeState, list[Output]]:
        """Record the node's boot id and, after a reboot, health-check results (name -> passed).

        Incidents opened on an earlier boot close with ``NodeRecovered(reason='reboot')`` once at least
        ``reboot_min_passing_checks`` checks passed on the new boot and none is failing.
        """
        outputs = self._observe_boot(state, boot_id, now)
        if checks and state.rebooted:
            state.boot_checks.update(checks)
            outputs += self._maybe_recover_after_reboot(state, now)
        return state, outputs

    # -- rules ----------------------------------------------------------------------------------

    def _observe_boot(self, state: NodeState, boot_id: str, now: float) -> list[Output]:
        if state.boot_id is None:
            state.boot_id = boot_id
            return []
        if boot_id == state.boot_id:
            return []
        # A new boot: the incidents of the old boot stay open until the new boot's checks pass.
        state.boot_id = boot_id
        state.rebooted = True
        state.boot_checks = {}
        return []

    def _maybe_recover_after_reboot(self, state: NodeState, now: float) -> list[Output]:
        checks = state.boot_checks
        if len(checks) < self.settings.reboot_min_passing_checks or not all(checks.values()):
            return []
        outputs: list[Output] = []
        for group, inc in list(state.incidents.items()):
            if inc.boot_id == state.boot_id:
                continue  # opened on the new boot: the reboot did not fix it
            del state.incidents[group]
            outputs.append(
                NodeRecovered(
                    incident_id=inc.incident_id,
                    node=state.node,
                    reason="reboot",
                    boot_id=state.boot_id,
                    recovered_at=_dt(now),
                    detail=f"new boot {state.boot_id}; checks passed: {', '.join(sorted(checks))}",
                )
            )
        state.rebooted = False
        return outputs

    def _health_check(self, state: NodeState, event: FaultEvent, now: float) -> list[Output]:
        check = str(event.detail.get("check") or event.name or "check")
        passed = event.detail.get("passed") is True  # the detector emits failed checks only
        outputs: list[Output] = []
        if state.rebooted and (event.boot_id is None or event.boot_id == state.boot_id):
            state.boot_checks[check] = passed
            outputs += self._maybe_recover_after_reboot(state, now)
        group = group_key(event, self.catalog)
        if passed:
            inc = state.incidents.pop(group, None)
            if inc is not None:
                outputs.append(
                    NodeRecovered(
                        incident_id=inc.incident_id,
                        node=state.node,
                        reason="quiet",
                        boot_id=state.boot_id,
                        recovered_at=_dt(now),
                        detail=f"health check {check} passed again",
                    )
                )
            return outputs
        outputs += self._fault(state, event, now)
        return outputs

    def _follower(self, state: NodeState, event: FaultEvent, role: str, now: float) -> list[Output]:
        """Xid 45 and sympathetic pod errors: evidence for an incident, never an incident alone."""
        ts = _ts(event.ts)
        window = self.settings.xid45_follow_window_s if role == "xid45" else self.settings.corroboration_window_s
        target = self._lead_incident(state, role, ts, window, event.pci)
        sig = event_signature(event)
        if target is not None:
            self._add_evidence(target, event.id, sig)
            return []
        state.pending.append(PendingEvidence(event_id=event.id, signature=sig, role=role, ts=ts, pci=event.pci))
        if len(state.pending) > self.settings.max_pending_evidence:
            del state.pending[: len(state.pending) - self.settings.max_pending_evidence]
        return []

    def _lead_incident(
        self, state: NodeState, role: str, ts: float, window: float, pci: str | None
    ) -> OpenIncident | None:
        kinds = XID_KINDS if role == "xid45" else KERNEL_KINDS
        candidates = [
            inc
            for inc in state.incidents.values()
            if inc.kind in kinds and self._workflow(inc) != "follower" and abs(ts - inc.last_seen) <= window
        ]
        if not candidates:
            return None
        # Same GPU first, then the most disruptive action, then the most recent.
        return max(candidates, key=lambda i: (pci is not None and i.pci == pci, i.action.rank, i.last_seen))

    def _fault(self, state: NodeState, event: FaultEvent, now: float) -> list[Output]:
        ts = _ts(event.ts)
        group = group_key(event, self.catalog)
        sig = event_signature(event)
        escalation = self._track_bursts(state, event, group, ts)
        inc = state.incidents.get(group)
        if inc is None:
            if event.action is Action.IGNORE and escalation is None:
                return []  # nothing to do and no one to tell: no incident, nothing on the node
            return self._open(state, event, group, sig, ts, now, escalation)
        inc.count += 1
        if ts > inc.last_seen:
            inc.last_seen = ts
        inc.last_seen_wall = now
        if inc.gpu_uuid is None and event.gpu_uuid:
            inc.gpu_uuid = event.gpu_uuid
        if sig not in inc.signatures and len(inc.signatures) < self.settings.max_signatures:
            inc.signatures.append(sig)
            self._add_evidence(inc, event.id, None)
        reasons: list[str] = []
        action, severity = inc.action, inc.severity
        if event.action.rank > action.rank:
            action = event.action
            reasons.append(f"more severe signal {sig} ({event.action.value})")
        if escalation is not None:
            esc_action, reason = escalation
            if esc_action.rank > action.rank:
                action = esc_action
                reasons.append(reason)
        if event.severity.rank > severity.rank:
            severity = event.severity
        if action is not inc.action:
            self._add_evidence(inc, event.id, None)
            inc.action = action
            inc.severity = _max_severity(severity, _escalated_severity(action))
            inc.escalation_reason = "; ".join(reasons)
            return [self._emit(state, inc, now)]
        inc.severity = severity
        interval = self.settings.summary_interval_s
        if interval > 0 and inc.count > inc.emitted_count and now - inc.emitted_wall >= interval:
            return [self._emit(state, inc, now)]
        return []

    def _open(
        self,
        state: NodeState,
        event: FaultEvent,
        group: str,
        sig: str,
        ts: float,
        now: float,
        escalation: tuple[Action, str] | None,
    ) -> list[Output]:
        action, severity, reason = event.action, event.severity, None
        if escalation is not None and escalation[0].rank > action.rank:
            action, reason = escalation
            severity = _max_severity(severity, _escalated_severity(action))
        if event.kind is FaultKind.POD_ERROR and event.grade is SignalGrade.SYMPATHETIC and action.quarantines:
            # Defensive: step() never routes sympathetic errors here; they never quarantine alone.
            return []
        inc = OpenIncident(
            incident_id=stable_id(state.node, group, event.id),
            group=group,
            signature=sig,
            signatures=[sig],
            kind=event.kind,
            source=event.source,
            code=event.code,
            pci=event.pci,
            gpu_uuid=event.gpu_uuid,
            first_seen=ts,
            last_seen=ts,
            last_seen_wall=now,
            opened_wall=now,
            source_ts=ts,
            severity=severity,
            action=action,
            escalation_reason=reason,
            evidence_ids=[event.id],
            boot_id=state.boot_id,
            line=event.line,
            emitted_wall=now,
        )
        self._claim_pending(state, inc, event, ts)
        state.incidents[group] = inc
        return [self._to_record(state, inc)]

    def _claim_pending(self, state: NodeState, inc: OpenIncident, event: FaultEvent, ts: float) -> None:
        """Attach held Xid 45 / sympathetic evidence that this new incident can lead."""
        if not state.pending:
            return
        keep: list[PendingEvidence] = []
        for item in state.pending:
            if item.role == "xid45":
                fits = inc.kind in XID_KINDS and abs(ts - item.ts) <= self.settings.xid45_follow_window_s
            else:
                fits = inc.kind in KERNEL_KINDS and abs(ts - item.ts) <= self.settings.corroboration_window_s
            if fits:
                self._add_evidence(inc, item.event_id, item.signature)
            else:
                keep.append(item)
        state.pending = keep

    def _track_bursts(self, state: NodeState, event: FaultEvent, group: str, ts: float) -> tuple[Action, str] | None:
        """Count bursts for the escalation rules; return (action, reason) when a threshold is reached."""
        s = self.settings
        rule: tuple[str, int, Action, str] | None = None
        code = event.code
        workflow = self._workflow(event)
        if workflow == "repeat_gpc_tpc":
            gpc, tpc = event.detail.get("gpc"), event.detail.get("tpc")
            if gpc is not None and tpc is not None:
                key = f"xid{code}:{event.pci}:gpc{gpc}:tpc{tpc}"
                rule = (
                    key,
                    s.xid13_repeat_threshold,
                    s.xid13_escalated_action,
                    f"Xid {code} repeating on GPC {gpc} TPC {tpc}",
                )
        elif workflow == "repeat_gpu":
            rule = (
                f"xid{code}:{event.pci}",
                s.xid31_repeat_threshold,
                s.xid31_escalated_action,
                f"Xid {code} repeating on one GPU",
            )
        elif event.kind in XID_KINDS and (
            event.sticky
            or code in s.sticky_codes
            or (event.kind is FaultKind.XID and code is not None and self.catalog.xid(code).sticky)
            or group.startswith("gpu_lost:")
        ):
            label = "GPU fallen off the bus / Xid 79" if group.startswith("gpu_lost:") else f"sticky Xid {code}"
            rule = (
                f"sticky:{group}",
                s.sticky_repeat_threshold,
                s.sticky_escalated_action,
                f"{label} repeating",
            )
        if rule is None:
            return None
        key, threshold, action, label = rule
        track = state.tracks.get(key)
        gap = s.debounce_window_s
        if group.startswith("gpu_lost:"):
            gap = max(gap, s.fallen_off_bus_merge_window_s)
        if track is None:
            track = state.tracks[key] = BurstTrack(last_ts=ts, last_kind=event.kind, bursts=[ts])
        elif ts - track.last_ts > gap:
            track.bursts.append(ts)
            track.last_ts = ts
            track.last_kind = event.kind
        else:
            track.last_ts = max(track.last_ts, ts)
        horizon = ts - s.escalation_window_s
        track.bursts = [b for b in track.bursts if b >= horizon]
        if len(track.bursts) >= threshold:
            return action, f"{label}: {len(track.bursts)} bursts within {s.escalation_window_s:.0f}s"
        return None

    def _expire(self, state: NodeState, now: float) -> None:
        """Forget burst history and pending evidence that can no longer matter.

        Against the node's event-time watermark, not the wall clock: lines replayed or shipped late
        keep their windows.
        """
        if state.watermark is None:
            return
        s = self.settings
        now = state.watermark
        horizon = now - s.escalation_window_s - s.debounce_window_s
        for key, track in list(state.tracks.items()):
            if track.last_ts < horizon:
                del state.tracks[key]
        pending_horizon = now - max(s.corroboration_window_s, s.xid45_follow_window_s)
        state.pending = [p for p in state.pending if p.ts >= pending_horizon]

    # -- records --------------------------------------------------------------------------------

    def _add_evidence(self, inc: OpenIncident, event_id: str, signature: str | None) -> None:
        if event_id not in inc.evidence_ids and len(inc.evidence_ids) < self.settings.max_evidence_ids:
            inc.evidence_ids.append(event_id)
        if signature and signature not in inc.signatures and len(inc.signatures) < self.settings.max_signatures:
            inc.signatures.append(signature)

    def _emit(self, state: NodeState, inc: OpenIncident, now: float) -> NodeIncident:
        inc.revision += 1
        inc.emitted_count = inc.count
        inc.emitted_wall = now
        return self._to_record(state, inc)

    @staticmethod
    def _to_record(state: NodeState, inc: OpenIncident) -> NodeIncident:
        return NodeIncident(
            incident_id=inc.incident_id,
            node=state.node,
            signature=inc.signature,
            signatures=list(inc.signatures),
            kind=inc.kind,
            code=inc.code,
            pci=inc.pci,
            gpu_uuid=inc.gpu_uuid,
            count=inc.count,
            first_seen=_dt(inc.first_seen),
            last_seen=_dt(inc.last_seen),
            opened_at=_dt(inc.opened_wall),
            revision=inc.revision,
            severity=inc.severity,
            action=inc.action,
            quarantine=inc.action.quarantines,
            escalation_reason=inc.escalation_reason,
            evidence_ids=list(inc.evidence_ids),
            boot_id=inc.boot_id,
            line=inc.line,
            source_ts=_dt(inc.source_ts),
        )


def _escalated_severity(action: Action) -> Severity:
    if action is Action.CONTACT_SUPPORT or action is Action.REBOOT_NODE:
        return Severity.CRITICAL
    if action.quarantines:
        return Severity.ERROR
    return Severity.WARNING


def _max_severity(a: Severity, b: Severity) -> Severity:
    return a if a.rank >= b.rank else b


def state_to_dict(state: NodeState) -> dict[str, Any]:
    """JSON-safe dict of a node state (what the Faust table's changelog carries)."""
    return state.model_dump(mode="json")


def state_from_dict(data: dict[str, Any]) -> NodeState:
    return NodeState.model_validate(data)
