"""The breaker counts the GPU nodes quarantined now, not only the quarantines since a reset."""

from __future__ import annotations

from typing import Any

from pipeline.actuator.breaker_rules import decide_admissions, quarantined_by_xidflow
from pipeline.actuator.ownership import CORDON, LEDGER_ANNOTATION, Ledger, taint_effect_key

NOW = 1_700_000_000.0


def node(name: str, *, cordoned: bool = False, taint: bool = False, owned: tuple[str, ...] = ()) -> dict[str, Any]:
    ledger = Ledger()
    for effect in owned:
        ledger.own(effect, "inc-1")
    spec: dict[str, Any] = {"unschedulable": cordoned}
    if taint:
        spec["taints"] = [{"key": "nvidia.com/gpu-fault", "effect": "NoSchedule"}]
    return {"metadata": {"name": name, "annotations": {LEDGER_ANNOTATION: ledger.to_annotation()}}, "spec": spec}


TAINT = taint_effect_key("nvidia.com/gpu-fault", "NoSchedule")


def test_only_xidflows_own_effects_in_place_count_as_quarantined() -> None:
    assert quarantined_by_xidflow(node("a", cordoned=True, owned=(CORDON,)))
    assert quarantined_by_xidflow(node("b", taint=True, owned=(TAINT,)))
    assert not quarantined_by_xidflow(node("c", cordoned=True))  # a person's cordon, or an idle standby
    assert not quarantined_by_xidflow(node("d", owned=(CORDON, TAINT)))  # a person undid both
    assert not quarantined_by_xidflow({"metadata": {"name": "e"}})


def test_after_a_reset_the_nodes_still_quarantined_count() -> None:
    """The issue's case: 10 of 20 quarantined, tripped, reset: the next one trips again (not 14 of 20)."""
    quarantined = frozenset(f"n{i}" for i in range(10))
    state: dict[str, Any] = {"tripped": False, "admitted": {}}  # what a reset used to leave behind
    decisions = decide_admissions(state, [f"n{i}" for i in range(10, 14)], 20, 0.5, 300, NOW, quarantined)
    assert [d.allowed for d in decisions.values()] == [False, False, False, False]
    assert decisions["n10"].tripped_now and "11 of 20" in state["reason"] and "10 quarantined now" in state["reason"]


def test_quarantined_nodes_are_admitted_again_for_free_and_new_ones_count_with_them() -> None:
    quarantined = frozenset({"a", "b"})
    state: dict[str, Any] = {}
    got = decide_admissions(state, ["a", "c"], 6, 0.5, 300, NOW, quarantined)
    assert got["a"].allowed and got["c"].allowed  # a already counted; c makes 3 of 6
    got = decide_admissions(state, ["d"], 6, 0.5, 300, NOW + 1, quarantined)
    assert not got["d"].allowed and got["d"].tripped_now  # 4 of 6


def test_a_node_admitted_in_the_window_and_seen_quarantined_counts_once() -> None:
    state: dict[str, Any] = {"admitted": {"a": NOW}}
    got = decide_admissions(state, ["b"], 4, 0.5, 300, NOW + 1, frozenset({"a"}))
    assert got["b"].allowed  # a (both admitted and quarantined) + b = 2 of 4


def test_a_large_batch_trips_at_exactly_the_limit() -> None:
    """One batch of many nodes on a large fleet (the counted set grows as nodes are admitted, once)."""
    quarantined = frozenset(f"q{i}" for i in range(3000))
    state: dict[str, Any] = {"admitted": {"old": NOW - 10, "expired": NOW - 1000}}
    batch = ["q0", *(f"n{i}" for i in range(2500))]  # one of them quarantined already
    decisions = decide_admissions(state, batch, 10_000, 0.5, 300, NOW, quarantined)
    allowed = [n for n, d in decisions.items() if d.allowed]
    # 3000 quarantined + "old" admitted in the window: 1999 new nodes fit under 5000 of 10,000.
    assert len(allowed) == 1 + 1999 and decisions["q0"].allowed
    assert decisions["n1999"].tripped_now and "5001 of 10000" in state["reason"]
    assert set(state["admitted"]) == {"old", *(f"n{i}" for i in range(1999))}


def test_nodes_admitted_outside_the_fleet_selector_do_not_count() -> None:
    """Issue 37: after the fleet selector changed, the nodes admitted under the old one filled the share."""
    state: dict[str, Any] = {"admitted": {"old-1": NOW - 10, "old-2": NOW - 5}}
    fleet = {"a", "b", "c", "d"}
    got = decide_admissions(state, ["a"], 4, 0.5, 300, NOW, members=fleet)
    assert got["a"].allowed  # a alone counts: 1 of 4 (with the old ones it was 3 of 4, a trip)
    assert set(state["admitted"]) == {"old-1", "old-2", "a"}  # kept in the window: the selector may change back
    got = decide_admissions(state, ["b", "c"], 4, 0.5, 300, NOW + 1, members=fleet)
    assert got["b"].allowed and not got["c"].allowed and got["c"].tripped_now
    assert "3 of 4" in state["reason"] and "2 admitted within" in state["reason"]  # a and b, not the old ones
    # Members unknown (no list yet): every admission in the window counts, as before.
    assert not decide_admissions({"admitted": {"x": NOW, "y": NOW}}, ["a"], 4, 0.5, 300, NOW)["a"].allowed
