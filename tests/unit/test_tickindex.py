"""Which nodes the aggregation's timer asks a tick for (``TickIndex``, ``NodeState.tick_due``): pure logic."""

from __future__ import annotations

import types

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.aggregate.aggregator import Aggregator
from pipeline.aggregate.settings import AggregationSettings
from pipeline.aggregate.tickindex import TickIndex
from schemas.records import Action, FaultKind, Source
from tests.unit.test_aggregation import fault, run

QUIET = 600.0


def _agg() -> Aggregator:
    return Aggregator(AggregationSettings(quiet_period_s=QUIET))


def test_a_quarantined_node_is_never_due_and_a_transient_one_once_its_quiet_period_ends() -> None:
    agg = _agg()
    state, _ = run(agg, [fault(79)], now=100.0)
    assert state.tick_due(QUIET) is None
    state, _ = run(agg, [fault(31, action=Action.RESTART_APP)], state, now=200.0)
    assert state.tick_due(QUIET) == 200.0 + QUIET
    state, out = agg.tick(state, 200.0 + QUIET)
    assert [r.reason for r in out] == ["quiet"] and state.tick_due(QUIET) is None


def test_a_transient_health_check_incident_keeps_its_node_due_at_every_tick() -> None:
    agg = _agg()
    check = fault(None, kind=FaultKind.HEALTH_CHECK, source=Source.PROBE, action=Action.RESTART_APP, pci=None,
                  detail={"check": "dcgm", "passed": False})
    state, out = run(agg, [check], now=100.0)
    assert out and state.tick_due(QUIET) == 0.0


@settings(max_examples=60)
@given(
    st.lists(st.tuples(st.sampled_from([31, 43, 79, 13]), st.sampled_from([Action.RESTART_APP, Action.RESET_GPU,
                                                                          Action.IGNORE]),
                       st.floats(0, 2000)), max_size=8),
    st.floats(0, 5000),
)
def test_no_tick_before_the_due_time_changes_anything(events: list, now: float) -> None:
    # The index asks for a tick only from ``tick_due`` on: a tick earlier must have nothing to do.
    agg = _agg()
    state = agg.new_state("n")
    for code, action, at in sorted(events, key=lambda e: e[2]):
        state, _ = agg.step(state, fault(code, action=action, at=at), at)
    due = state.tick_due(QUIET)
    if due is None:
        ticked, out = agg.tick(state.model_copy(deep=True), now)
        assert out == [] and ticked.incidents.keys() == state.incidents.keys()
        return
    # Due at the moment a tick first closes something: not a moment before, not later (a microsecond
    # of slack for the float sum; a tick that finds nothing leaves the node due for the next one).
    assert agg.tick(state.model_copy(deep=True), due - 0.01)[1] == []
    assert agg.tick(state.model_copy(deep=True), due + 1e-6)[1] != []


def test_the_index_answers_from_the_states_written_and_decodes_restored_ones_once() -> None:
    agg = _agg()
    transient, _ = run(agg, [fault(31, action=Action.RESTART_APP)], now=100.0)
    quarantined, _ = run(agg, [fault(79)], now=100.0)
    index = TickIndex(QUIET)
    index.note(b"a", transient, 0)
    index.note(b"b", quarantined, 0)
    assert index.due(100.0 + QUIET - 1) == [] and index.due(100.0 + QUIET) == [b"a"]
    index.note(b"a", None, 0)  # its state is gone
    assert index.due(1e12) == []

    store = {b"c": transient.to_bytes(), b"d": quarantined.to_bytes()}
    index.restored([(b"c", 1), (b"d", 1), (b"gone", 1)])
    decoded: list[bytes] = []

    def stored(key: bytes) -> bytes | None:
        decoded.append(key)
        return store.get(key)

    assert index.settle(stored) == 3 and index.due(1e12) == [b"c"]
    assert index.settle(stored) == 0 and sorted(decoded) == [b"c", b"d", b"gone"]  # once
    index.restored([(b"c", 1)])
    index.note(b"c", quarantined, 1)  # written after the recovery: the write is the newer state
    assert index.settle(stored) == 0 and index.due(1e12) == []


def test_a_partition_moved_away_takes_its_nodes_out_of_the_index() -> None:
    # A rebalance moves partition 1 away: its states stay in this process's table, frozen (the new owner
    # writes them), and a tick asked for them here would be asked for again at every timer run.
    agg = _agg()
    transient, _ = run(agg, [fault(31, action=Action.RESTART_APP)], now=100.0)
    index = TickIndex(QUIET)
    index.note(b"kept", transient, 0)
    index.note(b"moved", transient, 1)
    index.restored([(b"moved-restored", 1), (b"kept-restored", 0)])
    assert index.assigned({0, 2}) == 2
    assert index.settle(lambda key: transient.to_bytes()) == 1
    assert sorted(index.due(1e12)) == [b"kept", b"kept-restored"]
    # A batch of partition 1 fetched before the rebalance and written after it is not learnt again, nor
    # a restore of a partition that is not ours.
    index.note(b"late", transient, 1)
    index.restored([(b"standby", 1)])
    assert index.settle(lambda key: transient.to_bytes()) == 0 and b"late" not in index.due(1e12)
    # Assigned back (a later rebalance): learnt from its restore, as a new owner does.
    index.assigned({0, 1, 2})
    index.restored([(b"moved", 1)])
    assert index.settle(lambda key: transient.to_bytes()) == 1
    assert sorted(index.due(1e12)) == [b"kept", b"kept-restored", b"moved"]


def test_the_table_reports_the_keys_it_recovers_and_the_partitions_it_is_assigned() -> None:
    import asyncio

    from faust.types import TP

    from agents.worker import create_app

    xapp = create_app("127.0.0.1:1")
    seen: list[list[tuple[bytes, int]]] = []
    xapp.node_state.on_restored = seen.append

    def record(key: bytes, value: bytes | None, partition: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(key=key, value=value,
                                     message=types.SimpleNamespace(value=value, partition=partition))

    xapp.node_state.apply_changelog_batch(iter([record(b"a", b"{}", 0), record(b"b", None, 3)]))
    assert seen == [[(b"a", 0), (b"b", 3)]] and xapp.node_state.get(b"a") == b"{}"

    told: list[set[TP]] = []
    xapp.node_state.on_assigned = told.append
    assigned = {TP("events", 0), TP("events", 2)}
    asyncio.run(xapp.node_state.on_rebalance(assigned, {TP("events", 1)}, set(), 1))
    assert told == [assigned]
