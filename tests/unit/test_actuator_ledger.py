"""Ledger, node-object effects, breaker decisions, drain candidates and offset tracking (all pure)."""

from __future__ import annotations

import random
from typing import Any

from aiokafka import TopicPartition
from hypothesis import given
from hypothesis import strategies as st

from pipeline.actuator.actions.drain import drain_candidates
from pipeline.actuator.breaker_rules import decide_admissions, take_drain_slot
from pipeline.actuator.consumer import OffsetTracker, UndecodableRecord, decode_record
from pipeline.actuator.effects import (
    choose_standby,
    cordon_change,
    remove_taints_change,
    render_job,
    taint_change,
    uncordon_change,
)
from pipeline.actuator.ownership import LEDGER_ANNOTATION, Ledger
from pipeline.actuator.plan import NodeView

NOW = 1_700_000_000.0


def view(unschedulable: bool = False, taints: list[dict[str, str]] | None = None, name: str = "n") -> NodeView:
    return NodeView.from_object(
        {"metadata": {"name": name, "labels": {}}, "spec": {"unschedulable": unschedulable, "taints": taints or []}}
    )


def test_ledger_round_trips_through_the_annotation() -> None:
    ledger = Ledger()
    ledger.own("cordon", "i1")
    ledger.mark_done("i1", "cordon", NOW)
    ledger.claim("i1", "drain", "w1", NOW)
    ledger.record_attempt(NOW, 100)
    again = Ledger.from_annotations({LEDGER_ANNOTATION: ledger.to_annotation()})
    assert again.owners("cordon") == ["i1"] and again.is_done("i1", "cordon")
    assert again.claim_holder("i1", "drain", NOW + 1, timeout=60) == "w1"
    assert again.claim_holder("i1", "drain", NOW + 61, timeout=60) is None  # stale claims are retaken
    assert again.attempts == [NOW]


def test_broken_ledger_annotation_starts_over() -> None:
    assert Ledger.from_annotations({LEDGER_ANNOTATION: "{not json"}).flows == {}


def test_prune_keeps_flows_that_still_own_effects() -> None:
    ledger = Ledger()
    for i in range(10):
        ledger.flow(f"f{i}", NOW + i)
    ledger.own("cordon", "f0")
    ledger.prune(3)
    assert "f0" in ledger.flows and len(ledger.flows) == 3


def test_cordon_on_a_human_cordoned_node_is_not_owned() -> None:
    ledger = Ledger()
    change = cordon_change(view(unschedulable=True), ledger, "i1")
    assert change.spec == {} and "not owned" in change.note and ledger.owners("cordon") == []


def test_cordon_and_uncordon_ownership() -> None:
    ledger = Ledger()
    assert cordon_change(view(), ledger, "i1").spec == {"unschedulable": True}
    assert cordon_change(view(unschedulable=True), ledger, "i2").spec == {}
    assert ledger.owners("cordon") == ["i1", "i2"]
    # i1 is done but i2 still needs the cordon
    assert uncordon_change(view(unschedulable=True), ledger, "i1").spec == {}
    assert uncordon_change(view(unschedulable=True), ledger, "i2").spec == {"unschedulable": False}
    human = Ledger()
    assert "not made by xidflow" in uncordon_change(view(unschedulable=True), human, "i1").note


def test_manual_uncordon_cancels_the_owning_flows() -> None:
    ledger = Ledger()
    ledger.own("cordon", "i1")
    assert ledger.reconcile_manual_uncordon(unschedulable=True, now=NOW) == []
    assert ledger.reconcile_manual_uncordon(unschedulable=False, now=NOW) == ["i1"]
    assert ledger.cancelled("i1") == "manual-uncordon" and ledger.owners("cordon") == []


def test_taint_is_added_once_and_foreign_taints_are_not_owned() -> None:
    ledger = Ledger()
    change = taint_change(view(), ledger, "i1", "k", "v", "NoSchedule")
    assert [t["key"] for t in change.spec["taints"]] == ["k"]
    present = [{"key": "k", "value": "x", "effect": "NoSchedule"}]
    other = Ledger()
    assert taint_change(view(taints=present), other, "i1", "k", "v", "NoSchedule").spec == {}
    assert other.owners("taint:k:NoSchedule") == []
    kept = remove_taints_change(view(taints=present + [{"key": "z", "effect": "NoExecute"}]), [("k", "NoSchedule")])
    assert kept.spec == {"taints": [{"key": "z", "effect": "NoExecute"}]}


def pod(name: str, ns: str = "a", **meta: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, **meta}, "status": {"phase": "Running"}}


def test_drain_leaves_daemonset_mirror_excluded_and_finished_pods() -> None:
    pods = [
        pod("web"),
        pod("ds", ownerReferences=[{"kind": "DaemonSet", "name": "x"}]),
        pod("mirror", annotations={"kubernetes.io/config.mirror": "abc"}),
        pod("sys", ns="kube-system"),
        {**pod("done"), "status": {"phase": "Succeeded"}},
    ]
    evict, alone = drain_candidates(pods, {"kube-system"})
    assert [p["metadata"]["name"] for p in evict] == ["web"]
    assert sorted(alone) == ["a/ds", "a/mirror", "kube-system/sys"]


def test_breaker_trips_at_the_threshold_and_stays_open() -> None:
    state: dict[str, Any] = {}
    got = decide_admissions(state, ["a", "b"], fleet_size=4, max_share=0.5, window=300, now=NOW)
    assert all(d.allowed for d in got.values())
    again = decide_admissions(state, ["a"], 4, 0.5, 300, NOW + 1)  # already counted: free
    assert again["a"].allowed
    third = decide_admissions(state, ["c"], 4, 0.5, 300, NOW + 2)
    assert not third["c"].allowed and third["c"].tripped_now and state["tripped"]
    assert not decide_admissions(state, ["a"], 4, 0.5, 300, NOW + 3)["a"].allowed  # open until reset


def test_breaker_window_forgets_old_quarantines() -> None:
    state: dict[str, Any] = {}
    decide_admissions(state, ["a", "b"], 4, 0.5, 300, NOW)
    assert decide_admissions(state, ["c"], 4, 0.5, 300, NOW + 301)["c"].allowed


@given(st.integers(1, 60), st.floats(0.05, 1.0), st.integers(1, 80))
def test_breaker_never_admits_more_than_the_share(fleet: int, share: float, arrivals: int) -> None:
    state: dict[str, Any] = {}
    nodes = [f"n{i}" for i in range(arrivals)]
    allowed = [n for n, d in decide_admissions(state, nodes, fleet, share, 300, NOW).items() if d.allowed]
    assert len(allowed) <= int(share * fleet + 1e-9)


def test_drain_slots_cap_and_stale_release() -> None:
    state: dict[str, Any] = {}
    assert take_drain_slot(state, "a", "w", 2, 60, NOW)
    assert take_drain_slot(state, "b", "w", 2, 60, NOW)
    assert not take_drain_slot(state, "c", "w", 2, 60, NOW)
    assert take_drain_slot(state, "a", "w", 2, 60, NOW)  # re-entrant
    assert take_drain_slot(state, "c", "w", 2, 60, NOW + 61)  # holders vanished


def test_offsets_commit_only_below_the_lowest_pending() -> None:
    tp = TopicPartition("t", 0)
    tracker = OffsetTracker()
    for offset in (5, 6, 7):
        tracker.started(tp, offset)
    tracker.done(tp, 6)
    tracker.done(tp, 7)
    assert tracker.committable() == {tp: 5}
    tracker.mark_committed({tp: 5})
    assert tracker.committable() == {}
    tracker.done(tp, 5)
    assert tracker.committable() == {tp: 8}


@given(st.permutations(list(range(20))))
def test_committed_offset_never_passes_an_unfinished_record(order: list[int]) -> None:
    tp = TopicPartition("t", 1)
    tracker = OffsetTracker()
    for offset in range(20):
        tracker.started(tp, offset)
    finished: set[int] = set()
    for offset in order:
        tracker.done(tp, offset)
        finished.add(offset)
        nxt = tracker.committable().get(tp)
        if nxt is not None:
            assert set(range(nxt)) <= finished


def test_decode_discriminates_by_type_and_rejects_garbage() -> None:
    recovered = b'{"type": "recovered", "incident_id": "i", "node": "n", "reason": "quiet"}'
    assert type(decode_record("incidents", recovered)).__name__ == "NodeRecovered"
    cases = {b"": "empty", b"nope": "invalid_json", b"[]": "unknown_shape", b'{"type": "other"}': "unknown_shape",
             b'{"type": "incident"}': "invalid_record"}
    for bad, code in cases.items():
        try:
            decode_record("incidents", bad)
        except UndecodableRecord as exc:  # a ValueError with the dead letter's code (the metric label)
            assert exc.code.value == code, (bad, exc.code)
            continue
        raise AssertionError(f"accepted {bad!r}")


def test_standby_choice_prefers_matching_cordoned_nodes() -> None:
    def n(name: str, unschedulable: bool, **labels: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "labels": labels}, "spec": {"unschedulable": unschedulable}}

    nodes = [n("busy", False, pool="spare"), n("m1", True, pool="spare"), n("m2", True, pool="spare"), n("x", True)]
    picks = {choose_standby(nodes, [{"pool": "spare"}], random.Random(i)) for i in range(30)}
    assert picks == {"m1", "m2"}
    assert choose_standby(nodes, [{"pool": "nothing"}], random.Random(0)) in {"m1", "m2", "x"}
    assert choose_standby([n("busy", False)], [], random.Random(0)) is None


def test_hook_job_is_pinned_to_the_node_with_a_deterministic_name() -> None:
    job = render_job("spec: {template: {spec: {containers: [{name: c, image: i}]}}}", "j1", "ns", "gpu-1", {"a": "b"})
    assert job["metadata"] == {"name": "j1", "namespace": "ns", "labels": {"a": "b"}}
    assert job["spec"]["template"]["spec"]["nodeName"] == "gpu-1"
    assert job["kind"] == "Job"


async def test_priority_limiter_serves_quarantine_calls_first() -> None:
    import asyncio

    from pipeline.actuator.kube import PriorityLimiter

    limiter = PriorityLimiter(1)
    await limiter.acquire(1)  # the only slot is busy
    order: list[str] = []

    async def worker(name: str, priority: int) -> None:
        await limiter.acquire(priority)
        order.append(name)
        limiter.release()

    tasks = [asyncio.create_task(worker(n, p)) for n, p in (("event-1", 1), ("event-2", 1), ("cordon", 0))]
    await asyncio.sleep(0)
    limiter.release()
    await asyncio.gather(*tasks)
    assert order == ["cordon", "event-1", "event-2"]


async def test_breaker_calls_have_a_slot_of_their_own_when_every_slot_is_busy() -> None:
    import asyncio

    from pipeline.actuator.kube import PriorityLimiter

    limiter = PriorityLimiter(1, reserve=1)
    assert await limiter.acquire(0) is False  # a taint holds the only regular slot
    assert await asyncio.wait_for(limiter.acquire(-1), 1) is True  # the admission does not wait for it
    second = asyncio.create_task(limiter.acquire(-1))  # the reserve is one slot: a second one queues
    taint = asyncio.create_task(limiter.acquire(0))
    await asyncio.sleep(0.01)
    assert not second.done() and not taint.done()
    limiter.release(reserved=True)  # the reserved slot goes to the queued admission, never to the taint
    assert await asyncio.wait_for(second, 1) is True
    limiter.release(reserved=True)
    await asyncio.sleep(0.01)
    assert not taint.done()  # nobody else asks for the reserve: it is kept
    limiter.release()  # the regular slot
    assert await asyncio.wait_for(taint, 1) is False
    assert await asyncio.wait_for(limiter.acquire(-1), 1) is True  # the reserve is free again


async def test_other_calls_wait_while_nodes_are_taken_out_of_scheduling_but_not_for_ever() -> None:
    import asyncio

    from pipeline.actuator.kube import PriorityLimiter

    limiter = PriorityLimiter(4, hold_s=30)
    limiter.urgency(1)  # a flow is quarantining a node
    event = asyncio.create_task(limiter.acquire(1))
    await asyncio.sleep(0.01)
    assert not event.done()  # a free slot, yet the Event waits: the taints go first
    await asyncio.wait_for(limiter.acquire(0), 1)  # the quarantine's own calls are never held
    limiter.urgency(-1)
    await asyncio.wait_for(event, 1)

    bounded = PriorityLimiter(4, hold_s=0.05)
    bounded.urgency(1)  # a quarantine that never ends (an API server refusing it) holds others only briefly
    await asyncio.wait_for(bounded.acquire(1), 1)


async def test_held_calls_wait_for_a_calm_moment_between_waves_of_quarantines() -> None:
    import asyncio

    from pipeline.actuator.kube import PriorityLimiter

    limiter = PriorityLimiter(4, hold_s=30, calm_after_s=0.2)
    limiter.urgency(1)  # the first wave of a burst
    event = asyncio.create_task(limiter.acquire(1))
    limiter.urgency(-1)  # its last quarantine is done; the next wave is still being fetched
    await asyncio.sleep(0.1)
    assert not event.done()  # released now, it would take a slot and the API server from the next wave
    limiter.urgency(1)  # the next wave starts within the calm period
    await asyncio.sleep(0.15)
    assert not event.done()
    limiter.urgency(-1)
    await asyncio.wait_for(event, 1)  # no quarantine for the calm period: the held calls go


async def test_held_calls_wait_as_long_as_quarantines_make_progress() -> None:
    import asyncio

    from pipeline.actuator.kube import PriorityLimiter

    limiter = PriorityLimiter(4, hold_s=0.2, calm_after_s=0, max_hold_s=30)
    limiter.urgency(1)
    event = asyncio.create_task(limiter.acquire(1))
    for _ in range(4):  # a burst longer than hold_s whose quarantines keep ending and starting
        await asyncio.sleep(0.1)
        limiter.urgency(1)
        limiter.urgency(-1)
    assert not event.done()  # 0.4 s held: the taints still go first
    await asyncio.wait_for(event, 1)  # no progress for hold_s (a quarantine stuck on the API server): it goes

    capped = PriorityLimiter(4, hold_s=0.2, calm_after_s=0, max_hold_s=0.3)
    capped.urgency(1)
    call = asyncio.create_task(capped.acquire(1))
    for _ in range(3):
        await asyncio.sleep(0.1)
        capped.urgency(1)
    await asyncio.sleep(0.1)
    assert call.done()  # quarantines that never stop coming do not starve the others
