"""The co-partitioning rule of the worker's state topics (pure part of pipeline.aggregate.copartition)."""

from __future__ import annotations

from pipeline.aggregate.copartition import copartitioned_topics, mismatch, target_partitions


def test_the_three_topics_fault_events_first() -> None:
    assert copartitioned_topics("xf", "p.gpu.fault.events") == [
        "p.gpu.fault.events",
        "xf-ticks",
        "xf-node-state-changelog",
    ]


def test_equal_counts_and_missing_topics_are_fine() -> None:
    assert mismatch({"a": 24, "b": 24, "c": 24}) is None
    assert mismatch({"a": 24, "b": None, "c": None}) is None
    assert mismatch({"a": None, "b": None, "c": None}) is None


def test_a_mismatch_names_every_topic_and_count() -> None:
    error = mismatch({"gpu.fault.events": 24, "xidflow-ticks": 12, "xidflow-node-state-changelog": None})
    assert error is not None
    assert "gpu.fault.events=24" in error and "xidflow-ticks=12" in error
    assert "changelog" not in error.split("partitions.")[0]  # a topic not created yet is not listed


def test_new_topics_take_the_first_existing_count() -> None:
    assert target_partitions({"a": 24, "b": None}, 12) == 24
    assert target_partitions({"a": None, "b": 6}, 12) == 6
    assert target_partitions({"a": None, "b": None}, 12) == 12
