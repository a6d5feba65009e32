"""Redeliveries change nothing, but a record the consumer dropped and read again after later ones is
applied: the position check never mistakes a never-applied event for a replay."""

from __future__ import annotations

from pipeline.aggregate.aggregator import Aggregator
from pipeline.aggregate.settings import AggregationSettings
from pipeline.aggregate.state import NodeState
from tests.unit.test_aggregation import NODE, fault


def opened(out: list) -> set[str]:
    return {r.pci for r in out if getattr(r, "revision", None) == 0}


def test_a_record_read_again_after_later_ones_of_its_node_is_applied() -> None:
    agg = Aggregator()
    state = agg.new_state(NODE)
    state, out = agg.step(state, fault(79, pci="0000:01:00.0"), 0.0, position=(2, 10))
    assert opened(out) == {"0000:01:00.0"}
    # offset 11 was dropped by the consumer; 12 (same node, another GPU) is applied first
    state, out = agg.step(state, fault(79, pci="0000:03:00.0"), 0.0, position=(2, 12))
    assert opened(out) == {"0000:03:00.0"}
    state, out = agg.step(state, fault(79, pci="0000:02:00.0"), 0.0, position=(2, 11))  # the re-read
    assert opened(out) == {"0000:02:00.0"}
    assert state.position == (2, 12)


def test_replays_of_applied_records_change_nothing_also_beyond_the_id_window() -> None:
    agg = Aggregator(AggregationSettings(recent_ids=4))
    state = agg.new_state(NODE)
    events = [fault(79, pci=f"0000:{i:02x}:00.0") for i in range(10)]
    for i, ev in enumerate(events):
        state, _ = agg.step(state, ev, 0.0, position=(1, 100 + i))
    snapshot = state.model_copy(deep=True)
    for i, ev in enumerate(events):  # replay from the committed offset after a crash
        state, out = agg.step(state, ev, 0.0, position=(1, 100 + i))
        assert out == []
    assert state == snapshot
    # an old offset whose event id was forgotten is still a replay
    state, out = agg.step(state, fault(79, pci="0000:ee:00.0"), 0.0, position=(1, 101))
    assert out == []


def test_state_of_an_older_version_keeps_skipping_what_is_at_or_before_its_position() -> None:
    agg = Aggregator()
    state = agg.new_state(NODE)
    state, _ = agg.step(state, fault(79, pci="0000:01:00.0"), 0.0, position=(0, 5))
    old = NodeState.model_validate({**state.model_dump(), "recent_offsets": [], "forgotten_offset": None})
    old, out = agg.step(old, fault(79, pci="0000:02:00.0"), 0.0, position=(0, 4))
    assert out == []
    old, out = agg.step(old, fault(79, pci="0000:03:00.0"), 0.0, position=(0, 6))
    assert opened(out) == {"0000:03:00.0"}
