"""Per-node aggregation of fault events into incidents: pure logic, no Faust, no I/O.

One ``NodeState`` per node (``pipeline.aggregate.state``, stored in a Faust table) holds everything
the rules need. ``Aggregator.step`` applies one ``FaultEvent`` and returns the records to emit;
``Aggregator.tick`` closes transient incidents that stayed quiet; ``Aggregator.on_boot`` is the
reboot/health-check recovery rule. This module routes each event and folds it into its incident
(followers, evidence, the incident records); the escalation, recovery and expiry rule families are
``pipeline.aggregate.rules``, the windows and thresholds ``pipeline.aggregate.settings``.

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

from pipeline.aggregate.rules import (
    KERNEL_KINDS,
    XID_KINDS,
    Output,
    cancel,
    close_quiet,
    escalated_severity,
    expire,
    max_severity,
    observe_boot,
    recover_after_reboot,
    recovered,
    track_bursts,
)
from pipeline.aggregate.settings import AggregationSettings
from pipeline.aggregate.sharedparts import fabric_signal
from pipeline.aggregate.state import NodeState, OpenIncident, PendingEvidence, epoch, remember, replayed, utc
from pipeline.detection.catalog import Catalog
from schemas.records import (
    Action,
    FabricSignal,
    FaultEvent,
    FaultKind,
    NodeIncident,
    SignalGrade,
    stable_id,
)


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
    if event.gpu_instance is not None:  # a MIG instance's faults are that instance's incident
        where = f"{where}/gi{event.gpu_instance}"
    return f"{event.kind.value}:{code}:{where}"


def group_key(event: FaultEvent, catalog: Catalog | None = None) -> str:
    """Which open incident an event folds into. The catalog's ``gpu_lost`` Xid (79) and fallen-off-bus
    share one per PCI."""
    if event.kind is FaultKind.GPU_FALLEN_OFF_BUS or (
        event.kind is FaultKind.XID and (catalog or Catalog.configured()).workflow(event.code) == "gpu_lost"
    ):
        return f"gpu_lost:{event.pci or event.gpu_uuid or '-'}"
    return event_signature(event)


def _new_reports(inc: OpenIncident, event: FaultEvent) -> int:
    """How much ``event`` adds to the incident's count. Pure but for ``inc.reports``.

    An SXid is reported twice, by the NVSwitch driver's kernel line and by Fabric Manager's log, seconds apart
    and in either order (both reach the node's partition of the kernel topic): one fault, one incident (same
    signature), counted once. The incident counts each reporter's reports and its count grows with the larger
    of them, so a storm of N errors that both print counts N, and a fault only one of them printed still counts.
    """
    if event.reporter is None:
        return 1
    before = max(inc.reports.values(), default=0)
    inc.reports[event.reporter.value] = inc.reports.get(event.reporter.value, 0) + 1
    return max(inc.reports.values()) - before


UNADDRESSED_LOST = "gpu_lost:-"
"""The lost-GPU group of a signal that names no GPU (only the last line of the three-line message)."""


def fold_unaddressed(state: NodeState, group: str) -> str:
    """The lost-GPU group an event joins when one side names no GPU. Pure.

    A signal that names no GPU joins the node's open lost-GPU incident (the latest one); a signal that
    names one, when the node's only open lost-GPU incident is the unaddressed one, joins that. Why: the
    three-line fallen-off-the-bus message can reach the parse stage in two parts. Its first lines (which
    name the GPU) are emitted as one event once the multi-line timeout passes, or by a worker that is then
    restarted, and the last line arrives alone; or, shipped without a Kafka key (rsyslog's default), its
    lines land on different partitions and the last one is read first. Either way one fault would open two
    incidents: two Events and two flows on a node already out of service for a lost GPU.
    """
    if not group.startswith("gpu_lost:") or group in state.incidents:
        return group
    if group == UNADDRESSED_LOST:
        open_lost = [(inc.last_seen, g) for g, inc in state.incidents.items() if g.startswith("gpu_lost:")]
        return max(open_lost)[1] if open_lost else group
    if UNADDRESSED_LOST in state.incidents and not any(
        g.startswith("gpu_lost:") and g != UNADDRESSED_LOST for g in state.incidents
    ):
        return UNADDRESSED_LOST
    return group


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
        shared-part correlation (``pipeline.aggregate.sharedparts``); they are not incidents, so they are kept apart.
        """
        if event.id in state.recent_ids:
            return state, []
        if replayed(state, position):
            return state, []
        remember(state, event.id, position, self.settings.recent_ids)

        event_ts = epoch(event.ts)
        if state.watermark is None or event_ts > state.watermark:
            state.watermark = event_ts
        outputs: list[Output] = []
        if event.boot_id:
            outputs += observe_boot(state, event.boot_id, now)
        if signals is not None and self.settings.fabric_signals:
            signal = fabric_signal(
                state.node, state.fabric_emitted, event, event_signature(event), self.catalog,
                self.settings.debounce_window_s,
            )
            if signal is not None:
                state.fabric_emitted[signal.fault_class] = event_ts
                signals.append(signal)
        if event.kind is FaultKind.XID and (codes := self.catalog.cancels(event.code)):
            closed = cancel(state, event, codes, event_signature(event), event.name or f"Xid {event.code}", now)
            if closed:  # it ends an open fault: that is all it says (no incident of its own)
                return state, outputs + closed
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
        outputs = close_quiet(state, now, self.settings)
        expire(state, now, self.settings)
        return state, outputs

    def on_boot(
        self, state: NodeState, boot_id: str, now: float, checks: dict[str, bool] | None = None
    ) -> tuple[NodeState, list[Output]]:
        """Record the node's boot id and, after a reboot, health-check results (name -> passed).

        Incidents opened on an earlier boot close with ``NodeRecovered(reason='reboot')`` once at least
        ``reboot_min_passing_checks`` checks passed on the new boot and none is failing.
        """
        outputs = observe_boot(state, boot_id, now)
        if checks and state.rebooted:
            state.boot_checks.update(checks)
            outputs += recover_after_reboot(state, now, self.settings)
        return state, outputs

    # -- rules ----------------------------------------------------------------------------------

    def _health_check(self, state: NodeState, event: FaultEvent, now: float) -> list[Output]:
        check = str(event.detail.get("check") or event.name or "check")
        passed = event.detail.get("passed") is True  # the detector emits failed checks only
        outputs: list[Output] = []
        if state.rebooted and (event.boot_id is None or event.boot_id == state.boot_id):
            state.boot_checks[check] = passed
            outputs += recover_after_reboot(state, now, self.settings)
        group = group_key(event, self.catalog)
        if passed:
            inc = state.incidents.pop(group, None)
            if inc is not None:
                outputs.append(recovered(state, inc, "quiet", now, f"health check {check} passed again"))
            return outputs
        outputs += self._fault(state, event, now)
        return outputs

    def _follower(self, state: NodeState, event: FaultEvent, role: str, now: float) -> list[Output]:
        """Xid 45 and sympathetic pod errors: evidence for an incident, never an incident alone."""
        ts = epoch(event.ts)
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
        ts = epoch(event.ts)
        group = fold_unaddressed(state, group_key(event, self.catalog))
        sig = event_signature(event)
        escalation = track_bursts(state, event, group, ts, self.settings, self.catalog, self._workflow(event))
        inc = state.incidents.get(group)
        if inc is None:
            if event.action is Action.IGNORE and escalation is None:
                return []  # nothing to do and no one to tell: no incident, nothing on the node
            return self._open(state, event, group, sig, ts, now, escalation)
        inc.count += _new_reports(inc, event)
        if event.reporter is not None and inc.reports.get(event.reporter.value) == 1:
            self._add_evidence(inc, event.id, None)  # the other reporter's first report of this fault
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
            inc.severity = max_severity(severity, escalated_severity(action))
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
            severity = max_severity(severity, escalated_severity(action))
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
            gpu_instance=event.gpu_instance,
            compute_instance=event.compute_instance,
            reports={event.reporter.value: 1} if event.reporter else {},
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
            gpu_instance=inc.gpu_instance,
            compute_instance=inc.compute_instance,
            count=inc.count,
            first_seen=utc(inc.first_seen),
            last_seen=utc(inc.last_seen),
            opened_at=utc(inc.opened_wall),
            revision=inc.revision,
            severity=inc.severity,
            action=inc.action,
            quarantine=inc.action.quarantines,
            escalation_reason=inc.escalation_reason,
            evidence_ids=list(inc.evidence_ids),
            boot_id=inc.boot_id,
            line=inc.line,
            source_ts=utc(inc.source_ts),
        )

