"""The aggregation's rule families that act on a node's state apart from folding one event in.

``pipeline.aggregate.aggregator.Aggregator`` dispatches each event and folds it into an incident; what it
delegates lives here, as pure functions of a ``pipeline.aggregate.state.NodeState`` and the
``pipeline.aggregate.settings.AggregationSettings``:

- escalation: ``track_bursts`` counts bursts of a sticky or repeating signature inside the escalation
  window and says when the action goes up (``escalated_severity``, ``max_severity``);
- recovery: ``observe_boot`` notes a new boot, ``recover_after_reboot`` closes the old boot's
  incidents once its health checks pass; ``cancel`` closes an incident a later code ends (the catalog's
  ``cancels``: Xid 162 ends Xid 163);
- transient: ``close_quiet`` closes incidents that need no one once they stayed quiet, ``expire``
  forgets history that can no longer matter.

Event time (the log line's timestamp) drives bursts and windows so that a replay decides the same
way; wall-clock ``now`` drives the quiet period. Pure: no Faust, no I/O.
"""

from __future__ import annotations

from typing import Literal

from pipeline.aggregate.settings import AggregationSettings
from pipeline.aggregate.state import BurstTrack, NodeState, OpenIncident, epoch, utc
from pipeline.detection.catalog import Catalog
from schemas.records import Action, FaultEvent, FaultKind, NodeIncident, NodeRecovered, Severity

Output = NodeIncident | NodeRecovered

KERNEL_KINDS = frozenset({FaultKind.XID, FaultKind.SXID, FaultKind.GPU_FALLEN_OFF_BUS, FaultKind.KERNEL_SEGFAULT})
"""Fault kinds that count as kernel evidence for corroborating sympathetic pod errors."""

XID_KINDS = frozenset({FaultKind.XID, FaultKind.GPU_FALLEN_OFF_BUS})
"""Incidents an Xid 45 may follow."""


# -- escalation -------------------------------------------------------------------------------


def recovered(state: NodeState, inc: OpenIncident, reason: Literal["reboot", "quiet"], now: float, detail: str
              ) -> NodeRecovered:
    """The record that closes ``inc`` on ``state``'s node (pure)."""
    return NodeRecovered(
        incident_id=inc.incident_id,
        node=state.node,
        reason=reason,
        boot_id=state.boot_id,
        recovered_at=utc(now),
        detail=detail,
    )


def track_bursts(
    state: NodeState,
    event: FaultEvent,
    group: str,
    ts: float,
    settings: AggregationSettings,
    catalog: Catalog,
    workflow: str,
) -> tuple[Action, str] | None:
    """Count bursts for the escalation rules; return (action, reason) when a threshold is reached.

    ``workflow``: the catalog's workflow of the event's Xid (``repeat_gpc_tpc``, ``repeat_gpu``, ...).
    """
    s = settings
    rule: tuple[str, int, Action, str] | None = None
    code = event.code
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
        or (event.kind is FaultKind.XID and code is not None and catalog.xid(code).sticky)
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


def escalated_severity(action: Action) -> Severity:
    """The least severity an incident escalated to ``action`` carries."""
    if action is Action.CONTACT_SUPPORT or action is Action.REBOOT_NODE:
        return Severity.CRITICAL
    if action.quarantines:
        return Severity.ERROR
    return Severity.WARNING


def max_severity(a: Severity, b: Severity) -> Severity:
    """The more severe of two severities."""
    return a if a.rank >= b.rank else b


# -- recovery ---------------------------------------------------------------------------------


def observe_boot(state: NodeState, boot_id: str, now: float) -> list[Output]:
    """Note the node's boot id; a new one marks a reboot whose health checks are then awaited."""
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


def recover_after_reboot(state: NodeState, now: float, settings: AggregationSettings) -> list[Output]:
    """Close the incidents of the old boot once enough checks passed on the new one and none fails."""
    checks = state.boot_checks
    if len(checks) < settings.reboot_min_passing_checks or not all(checks.values()):
        return []
    outputs: list[Output] = []
    for group, inc in list(state.incidents.items()):
        if inc.boot_id == state.boot_id:
            continue  # opened on the new boot: the reboot did not fix it
        del state.incidents[group]
        detail = f"new boot {state.boot_id}; checks passed: {', '.join(sorted(checks))}"
        outputs.append(recovered(state, inc, "reboot", now, detail))
    state.rebooted = False
    return outputs


# -- codes that cancel -----------------------------------------------------------------------


def cancel(state: NodeState, event: FaultEvent, codes: frozenset[int], signature: str, name: str, now: float
           ) -> list[Output]:
    """Close the node's open incidents of Xid ``codes`` on the event's GPU that a later Xid ends (the catalog's
    ``cancels``), with the event as their evidence; nothing when none is open (pure).

    Same GPU: both name a PCI address and they agree, or either names none. Later: the event's log time is not
    before the incident's first line (a line shipped late cannot end a fault it predates).
    """
    ts = epoch(event.ts)
    out: list[Output] = []
    for group, inc in list(state.incidents.items()):
        if inc.kind is not FaultKind.XID or inc.code not in codes or ts < inc.first_seen:
            continue
        if event.pci and inc.pci and event.pci != inc.pci:
            continue
        del state.incidents[group]
        where = f" on {inc.pci}" if inc.pci else ""
        out.append(NodeRecovered(
            incident_id=inc.incident_id,
            node=state.node,
            reason="cancelled",
            boot_id=state.boot_id,
            recovered_at=utc(now),
            detail=f"Xid {event.code} ({name}) cancels Xid {inc.code}{where}: {event.line.strip()}"[:1024],
            cancelled_by=signature,
            evidence_ids=[event.id],
        ))
    return out


# -- transient --------------------------------------------------------------------------------


def close_quiet(state: NodeState, now: float, settings: AggregationSettings) -> list[Output]:
    """Close transient incidents quiet for ``quiet_period_s`` (health-check incidents close on a pass)."""
    outputs: list[Output] = []
    for group, inc in list(state.incidents.items()):
        if inc.action.quarantines or inc.kind is FaultKind.HEALTH_CHECK:
            continue
        quiet_for = now - inc.last_seen_wall
        if quiet_for >= settings.quiet_period_s:
            del state.incidents[group]
            outputs.append(
                recovered(state, inc, "quiet", now, f"{inc.signature} quiet for {quiet_for:.0f}s")
            )
    return outputs


def expire(state: NodeState, now: float, settings: AggregationSettings) -> None:
    """Forget burst history and pending evidence that can no longer matter.

    Against the node's event-time watermark, not the wall clock: lines replayed or shipped late
    keep their windows.
    """
    if state.watermark is None:
        return
    s = settings
    now = state.watermark
    horizon = now - s.escalation_window_s - s.debounce_window_s
    for key, track in list(state.tracks.items()):
        if track.last_ts < horizon:
            del state.tracks[key]
    pending_horizon = now - max(s.corroboration_window_s, s.xid45_follow_window_s)
    state.pending = [p for p in state.pending if p.ts >= pending_horizon]

# -- records --------------------------------------------------------------------------------
