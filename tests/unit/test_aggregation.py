"""The per-node aggregation rules (pure logic): one test per rule, then properties."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.aggregate.aggregator import Aggregator, group_key
from pipeline.aggregate.settings import AggregationSettings
from pipeline.aggregate.state import NodeState
from schemas.records import (
    Action,
    FaultEvent,
    FaultKind,
    NodeIncident,
    NodeRecovered,
    Severity,
    SignalGrade,
    Source,
    stable_id,
)

NODE = "gpu-node-1"
PCI = "0000:4e:00.0"
T0 = datetime(2025, 1, 1, tzinfo=UTC)
_ids = itertools.count()


def fault(
    code: int | None = 79,
    *,
    at: float = 0.0,
    kind: FaultKind = FaultKind.XID,
    action: Action = Action.REBOOT_NODE,
    pci: str | None = PCI,
    source: Source = Source.KERNEL,
    grade: SignalGrade | None = None,
    detail: dict | None = None,
    boot_id: str | None = None,
    sticky: bool = False,
    severity: Severity = Severity.ERROR,
    event_id: str | None = None,
) -> FaultEvent:
    return FaultEvent(
        id=event_id or f"ev-{next(_ids)}",
        node=NODE,
        kind=kind,
        source=source,
        code=code,
        pci=pci,
        grade=grade,
        action=action,
        severity=severity,
        sticky=sticky,
        detail=detail or {},
        ts=T0 + timedelta(seconds=at),
        boot_id=boot_id,
        line=f"NVRM: Xid (PCI:{pci}): {code}",
    )


def sympathetic(at: float = 0.0) -> FaultEvent:
    return fault(
        None,
        at=at,
        kind=FaultKind.POD_ERROR,
        source=Source.POD,
        grade=SignalGrade.SYMPATHETIC,
        action=Action.RESET_GPU,  # even if the catalog said so, it must not quarantine alone
        pci=None,
    )


def health(check: str, passed: bool, boot_id: str, at: float = 0.0) -> FaultEvent:
    return fault(
        None,
        at=at,
        kind=FaultKind.HEALTH_CHECK,
        source=Source.PROBE,
        action=Action.IGNORE if passed else Action.RESET_GPU,
        pci=None,
        detail={"check": check, "passed": passed},
        boot_id=boot_id,
    )


def run(agg: Aggregator, events: list[FaultEvent], state: NodeState | None = None, now: float = 1000.0):
    state = state or agg.new_state(NODE)
    out: list = []
    for ev in events:
        state, emitted = agg.step(state, ev, now)
        out += emitted
    return state, out


def incidents(out: list) -> list[NodeIncident]:
    return [o for o in out if isinstance(o, NodeIncident)]


def test_first_fault_opens_an_incident_at_once_with_a_deterministic_id() -> None:
    agg = Aggregator()
    ev = fault(79)
    _, out = run(agg, [ev])
    assert len(out) == 1
    inc = out[0]
    assert isinstance(inc, NodeIncident)
    assert inc.incident_id == stable_id(NODE, group_key(ev), ev.id)
    assert (inc.revision, inc.count, inc.action, inc.quarantine) == (0, 1, Action.REBOOT_NODE, True)
    assert inc.signature == f"xid:79:{PCI}"
    assert inc.evidence_ids == [ev.id]


def test_storm_of_identical_lines_is_one_incident_with_a_count_and_no_per_repeat_output() -> None:
    agg = Aggregator(AggregationSettings(summary_interval_s=0))
    events = [fault(95, at=i * 0.001, action=Action.RESET_GPU) for i in range(20_000)]
    state, out = run(agg, events)
    assert len(out) == 1
    assert state.incidents[f"xid:95:{PCI}"].count == 20_000
    # A storm is one burst: a sticky code does not escalate on its own storm.
    assert state.incidents[f"xid:95:{PCI}"].action is Action.RESET_GPU


def test_summary_interval_re_emits_the_count_rarely() -> None:
    agg = Aggregator(AggregationSettings(summary_interval_s=60))
    state, out = run(agg, [fault(95, action=Action.RESET_GPU)], now=0.0)
    state, out2 = run(agg, [fault(95, at=1, action=Action.RESET_GPU) for _ in range(100)], state, now=30.0)
    assert out2 == []
    state, out3 = run(agg, [fault(95, at=2, action=Action.RESET_GPU) for _ in range(100)], state, now=61.0)
    assert len(out3) == 1 and out3[0].incident_id == out[0].incident_id
    assert (out3[0].revision, out3[0].count) == (1, 102)  # emitted on the first event past the interval


def test_xid13_repeating_on_one_gpc_tpc_escalates_the_same_incident() -> None:
    agg = Aggregator()
    gap = agg.settings.debounce_window_s + 1
    same = {"gpc": 0, "tpc": 1, "sm": 0}
    state, out = run(agg, [fault(13, action=Action.RESTART_APP, detail=same)])
    assert out[0].action is Action.RESTART_APP and not out[0].quarantine
    state, out2 = run(agg, [fault(13, at=gap, action=Action.RESTART_APP, detail=same)], state)
    assert out2 == []
    state, out3 = run(agg, [fault(13, at=2 * gap, action=Action.RESTART_APP, detail=same)], state)
    assert len(out3) == 1
    assert out3[0].incident_id == out[0].incident_id
    assert (out3[0].revision, out3[0].action, out3[0].quarantine) == (1, Action.RESET_GPU, True)
    assert "GPC 0 TPC 1" in out3[0].escalation_reason


def test_xid13_on_different_gpc_tpc_does_not_escalate() -> None:
    agg = Aggregator()
    gap = agg.settings.debounce_window_s + 1
    events = [fault(13, at=i * gap, action=Action.RESTART_APP, detail={"gpc": i, "tpc": 0}) for i in range(5)]
    state, out = run(agg, events)
    assert len(out) == 1 and out[0].action is Action.RESTART_APP
    assert state.incidents[f"xid:13:{PCI}"].count == 5


def test_xid31_repeating_on_one_gpu_escalates() -> None:
    agg = Aggregator()
    gap = agg.settings.debounce_window_s + 1
    _, out = run(agg, [fault(31, at=i * gap, action=Action.RESTART_APP) for i in range(3)])
    assert [(o.revision, o.action) for o in out] == [(0, Action.RESTART_APP), (1, Action.RESET_GPU)]


def test_sticky_code_repeating_escalates_to_contact_support() -> None:
    agg = Aggregator()
    gap = agg.settings.debounce_window_s + 1
    _, out = run(agg, [fault(95, action=Action.RESET_GPU), fault(95, at=gap, action=Action.RESET_GPU)])
    assert [(o.revision, o.action) for o in out] == [(0, Action.RESET_GPU), (1, Action.CONTACT_SUPPORT)]
    assert out[1].severity is Severity.CRITICAL


def test_catalog_sticky_flag_counts_too() -> None:
    agg = Aggregator()
    gap = agg.settings.debounce_window_s + 1
    events = [fault(150, action=Action.RESET_GPU, sticky=True, at=i * gap) for i in range(2)]
    _, out = run(agg, events)
    assert out[-1].action is Action.CONTACT_SUPPORT


def test_sympathetic_pod_errors_alone_open_nothing() -> None:
    agg = Aggregator()
    state, out = run(agg, [sympathetic(at=i) for i in range(50)])
    assert out == [] and state.incidents == {}


def test_sympathetic_pod_errors_corroborate_kernel_evidence_in_the_window() -> None:
    agg = Aggregator()
    early = sympathetic(at=0)
    state, out = run(agg, [early, fault(79, at=10)])
    assert len(out) == 1 and early.id in out[0].evidence_ids
    assert any(sig.startswith("pod_error:sympathetic") for sig in out[0].signatures)
    late = sympathetic(at=20)
    state, out = run(agg, [late], state)
    assert out == [] and late.id in state.incidents[f"gpu_lost:{PCI}"].evidence_ids
    # Outside the window: held, not attached.
    far = sympathetic(at=10 + agg.settings.corroboration_window_s + 5)
    state, _ = run(agg, [far], state)
    assert far.id not in state.incidents[f"gpu_lost:{PCI}"].evidence_ids


def test_xid45_alone_is_noise_and_follows_other_xids() -> None:
    agg = Aggregator()
    state, out = run(agg, [fault(45, at=i, action=Action.IGNORE) for i in range(10)])
    assert out == [] and state.incidents == {}
    state, out = run(agg, [fault(62, at=20, action=Action.RESET_GPU)], state)
    assert len(out) == 1 and len(out[0].evidence_ids) == 11
    assert out[0].action is Action.RESET_GPU and f"xid:45:{PCI}" in out[0].signatures
    after = fault(45, at=21, action=Action.IGNORE)
    state, out = run(agg, [after], state)
    assert out == [] and after.id in state.incidents[f"xid:62:{PCI}"].evidence_ids


def test_fallen_off_bus_and_xid79_for_one_pci_within_five_minutes_are_one_incident() -> None:
    agg = Aggregator()
    fob = fault(None, kind=FaultKind.GPU_FALLEN_OFF_BUS, at=0)
    x79 = fault(79, at=200)
    state, out = run(agg, [fob, x79])
    assert len(out) == 1
    inc = state.incidents[f"gpu_lost:{PCI}"]
    assert inc.count == 2 and set(inc.signatures) == {f"gpu_fallen_off_bus:{PCI}", f"xid:79:{PCI}"}
    assert inc.action is Action.REBOOT_NODE  # one burst: not a repeat


def test_fallen_off_bus_again_after_the_merge_window_is_a_repeat() -> None:
    agg = Aggregator()
    fob = fault(None, kind=FaultKind.GPU_FALLEN_OFF_BUS, at=0)
    x79 = fault(79, at=agg.settings.fallen_off_bus_merge_window_s + 60)
    _, out = run(agg, [fob, x79])
    assert [(o.revision, o.action) for o in out] == [(0, Action.REBOOT_NODE), (1, Action.CONTACT_SUPPORT)]


def test_last_line_of_the_fallen_off_message_alone_joins_the_open_lost_gpu_incident() -> None:
    """The message's first lines were emitted on their own (multi-line timeout, worker restart); its last
    line, which names no GPU, arrives later: one fault, one incident."""
    agg = Aggregator()
    first = fault(None, kind=FaultKind.GPU_FALLEN_OFF_BUS, at=0)
    last = fault(None, kind=FaultKind.GPU_FALLEN_OFF_BUS, pci=None, at=3)
    state, out = run(agg, [first, last])
    assert len({o.incident_id for o in out}) == 1 and list(state.incidents) == [f"gpu_lost:{PCI}"]
    assert state.incidents[f"gpu_lost:{PCI}"].count == 2
    # Alone, it still opens its incident (address unknown).
    state, out = run(agg, [fault(None, kind=FaultKind.GPU_FALLEN_OFF_BUS, pci=None, at=0)])
    assert len(out) == 1 and list(state.incidents) == ["gpu_lost:-"]


def test_first_lines_read_after_the_last_line_join_its_incident() -> None:
    """Shipped without a key, the message's lines land on different partitions: the last one may come first."""
    agg = Aggregator()
    last = fault(None, kind=FaultKind.GPU_FALLEN_OFF_BUS, pci=None, at=0)
    first = fault(None, kind=FaultKind.GPU_FALLEN_OFF_BUS, at=0)
    x79_other_gpu = fault(79, pci="0000:4f:00.0", at=1)
    state, out = run(agg, [last, first])
    assert len({o.incident_id for o in out}) == 1 and state.incidents["gpu_lost:-"].count == 2
    # Once an addressed lost-GPU incident is open, another GPU's is its own again.
    state, out = run(agg, [fault(79, at=0), last, x79_other_gpu])
    assert len({o.incident_id for o in out}) == 2


def test_different_pci_is_a_different_incident() -> None:
    agg = Aggregator()
    _, out = run(agg, [fault(79), fault(79, pci="0000:4f:00.0")])
    assert len({o.incident_id for o in out}) == 2


def test_reboot_with_passing_checks_recovers_incidents_of_the_old_boot() -> None:
    agg = Aggregator()
    state, out = run(agg, [fault(79, boot_id="boot-a")])
    opened = out[0]
    state, out = run(agg, [health("gpu_count", True, "boot-a")], state)
    assert out == []  # same boot: no recovery
    state, out = run(agg, [health("gpu_count", False, "boot-b", at=100)], state)
    assert not [o for o in out if isinstance(o, NodeRecovered)]  # new boot, but a check fails
    state, out = run(agg, [health("gpu_count", True, "boot-b", at=110)], state)
    recovered = {(o.incident_id, o.reason) for o in out if isinstance(o, NodeRecovered)}
    # The failing check opened its own incident on the new boot; passing again closes it too.
    assert (opened.incident_id, "reboot") in recovered
    assert {reason for _, reason in recovered} == {"reboot", "quiet"}
    assert state.incidents == {}


def test_incident_opened_on_the_new_boot_survives_the_reboot_recovery() -> None:
    agg = Aggregator()
    state, _ = run(agg, [fault(79, boot_id="boot-a")])
    state, out = run(agg, [fault(62, boot_id="boot-b", at=50, action=Action.RESET_GPU)], state)
    state, rec = agg.on_boot(state, "boot-b", 2000.0, {"ecc": True})
    assert [r.reason for r in rec] == ["reboot"]
    assert list(state.incidents) == [f"xid:62:{PCI}"]


def test_transient_signature_recovers_after_the_quiet_period_and_quarantines_do_not() -> None:
    agg = Aggregator(AggregationSettings(quiet_period_s=600))
    state, out = run(agg, [fault(31, action=Action.RESTART_APP), fault(79)], now=0.0)
    state, rec = agg.tick(state, 599.0)
    assert rec == []
    state, rec = agg.tick(state, 600.0)
    assert [(r.incident_id, r.reason) for r in rec] == [(out[0].incident_id, "quiet")]
    assert list(state.incidents) == [f"gpu_lost:{PCI}"]
    # After recovery the same signature opens a new incident (new id).
    state, again = run(agg, [fault(31, at=700, action=Action.RESTART_APP)], state, now=700.0)
    assert again[0].incident_id != out[0].incident_id


def test_redelivered_events_change_nothing() -> None:
    agg = Aggregator()
    state = agg.new_state(NODE)
    ev = fault(79)
    state, out = agg.step(state, ev, 0.0, position=(3, 10))
    assert len(out) == 1
    state, out = agg.step(state, fault(79), 0.0, position=(3, 10))  # same offset, replayed
    assert out == [] and state.incidents[f"gpu_lost:{PCI}"].count == 1
    state, out = agg.step(state, ev, 0.0, position=(3, 11))  # same event produced twice upstream
    assert out == [] and state.incidents[f"gpu_lost:{PCI}"].count == 1


def test_state_round_trips_through_bytes() -> None:
    agg = Aggregator()
    state, _ = run(agg, [sympathetic(), fault(13, detail={"gpc": 1, "tpc": 2}, action=Action.RESTART_APP)])
    again = NodeState.from_bytes(state.to_bytes())
    assert again == state


# -- properties ---------------------------------------------------------------------------------

CODES = [13, 31, 45, 62, 79, 95, 119, 43]
ACTIONS = {
    13: Action.RESTART_APP,
    31: Action.RESTART_APP,
    45: Action.IGNORE,
    62: Action.RESET_GPU,
    79: Action.REBOOT_NODE,
    95: Action.RESET_GPU,
    119: Action.RESET_GPU,
    43: Action.IGNORE,
}

event_spec = st.tuples(
    st.sampled_from(CODES + ["fob", "sym", "hc+", "hc-"]),
    st.sampled_from(["0000:4e:00.0", "0000:4f:00.0"]),
    st.floats(min_value=0, max_value=5000, allow_nan=False),
    st.sampled_from(["boot-a", "boot-b", None]),
)


def build(spec: tuple, i: int) -> FaultEvent:
    what, pci, at, boot = spec
    eid = f"p-{i}"
    if what == "fob":
        return fault(None, kind=FaultKind.GPU_FALLEN_OFF_BUS, pci=pci, at=at, boot_id=boot, event_id=eid)
    if what == "sym":
        ev = sympathetic(at=at)
        return ev.model_copy(update={"id": eid, "boot_id": boot})
    if what in ("hc+", "hc-"):
        ev = health("ecc", what == "hc+", boot or "boot-a", at=at)
        return ev.model_copy(update={"id": eid})
    detail = {"gpc": 0, "tpc": 0} if what == 13 else {}
    return fault(what, pci=pci, at=at, action=ACTIONS[what], detail=detail, boot_id=boot, event_id=eid)


@settings(max_examples=150)
@given(st.lists(event_spec, max_size=40), st.integers(min_value=0, max_value=40))
def test_restart_anywhere_gives_the_same_outputs(specs: list, cut: int) -> None:
    """A worker that restores the state from its changelog mid-stream decides exactly as one that did not."""
    agg = Aggregator()
    events = [build(s, i) for i, s in enumerate(specs)]
    _, straight = run(agg, events)
    state, first = run(agg, events[:cut])
    state = NodeState.from_bytes(state.to_bytes())
    _, second = run(agg, events[cut:], state)
    dump = [o.model_dump() for o in straight]
    assert dump == [o.model_dump() for o in first + second]


@settings(max_examples=150)
@given(st.lists(event_spec, max_size=40))
def test_invariants(specs: list) -> None:
    agg = Aggregator()
    events = [build(s, i) for i, s in enumerate(specs)]
    _, out = run(agg, events)
    # Each incident id is opened once, and its revisions strictly increase.
    revisions: dict[str, list[int]] = {}
    for inc in incidents(out):
        revisions.setdefault(inc.incident_id, []).append(inc.revision)
    for revs in revisions.values():
        assert revs[0] == 0 and revs == sorted(set(revs))
    # Xid 45 and sympathetic pod errors never lead an incident.
    for inc in incidents(out):
        assert not inc.signature.startswith("xid:45") and not inc.signature.startswith("pod_error")
    # Replaying the whole stream gives the same ids.
    _, replay = run(agg, [e.model_copy() for e in events])
    assert [o.incident_id for o in replay] == [o.incident_id for o in out]


@settings(max_examples=100)
@given(st.lists(st.floats(min_value=0, max_value=1e5, allow_nan=False), max_size=60))
def test_noise_only_streams_never_open_incidents(times: list[float]) -> None:
    agg = Aggregator()
    events = []
    for i, at in enumerate(times):
        events.append(sympathetic(at=at) if i % 2 else fault(45, at=at, action=Action.IGNORE))
    state, out = run(agg, events)
    assert out == [] and state.incidents == {}
    assert len(state.pending) <= agg.settings.max_pending_evidence


def test_ticks_expire_history_on_event_time_so_late_lines_keep_their_windows() -> None:
    agg = Aggregator()
    state, _ = run(agg, [sympathetic(at=0)])
    # Wall clock far past the log time (a backfill): the tick must not drop the evidence.
    state, _ = agg.tick(state, now=T0.timestamp() + 10 * 86400)
    state, out = run(agg, [fault(79, at=10)], state)
    assert len(out[0].evidence_ids) == 2
    # Event time moving past the window does expire it.
    state, _ = run(agg, [sympathetic(at=0)])
    state, out = run(agg, [fault(62, at=5000, action=Action.RESET_GPU)], state)
    assert len(out[0].evidence_ids) == 1 and len(state.pending) == 1
    state, _ = agg.tick(state, now=0.0)
    assert state.pending == []
