"""Reserved headroom keeps the breaker's guarantee: a model of replicas over the pure ``settle``.

Each model replica does what ``Breaker`` does: admits from its unused slots without a write while its
reservation is valid (half a TTL after its last write), and writes the breaker's state with ``settle``.
A write is split in two steps (``begin`` takes the snapshot ``Breaker._write`` takes, ``commit``
applies ``settle`` to the state as it is then, what a retried conditional write does), so admissions
from the block while a write is in flight, interleaved writes of other replicas, deaths and lapsed
reservations are all explored. The watch is modelled by the nodes a dead replica admitted becoming
"quarantined" (its taints landed before the others may count its reservation lapsed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.actuator.breaker_rules import breaker_cap, decide_admissions, settle

TTL = 20.0
WINDOW = 1e9  # the model's nodes never leave the window: the guarantee is checked on every admission ever


@dataclass
class Replica:
    holder: str
    slots: int = 0
    valid_until: float = 0.0
    used: dict[str, float] = field(default_factory=dict)
    tripped: bool = False
    inflight: tuple[list[str], dict[str, float], int, int] | None = None


@dataclass
class Model:
    fleet: int
    share: float
    block: int
    state: dict[str, Any] = field(default_factory=dict)
    now: float = 1_000.0
    admitted: set[str] = field(default_factory=set)  # every node any replica let into quarantine
    quarantined: set[str] = field(default_factory=set)  # what the watches show
    trips: int = 0
    waits: int = 0

    def local(self, r: Replica, node: str) -> None:
        if r.tripped or self.now >= r.valid_until or (r.slots <= 0 and node not in r.used):
            return
        if node not in r.used:
            r.slots -= 1
            r.used[node] = self.now
        self.admitted.add(node)

    def begin(self, r: Replica, nodes: list[str], release: bool) -> None:
        if r.inflight is not None:
            return
        if release:
            r.slots = 0
        keep = r.slots if self.now < r.valid_until and not r.tripped else 0
        r.inflight = (
            list(dict.fromkeys(nodes)),
            dict(r.used),
            keep,
            0 if release else self.block,
        )  # deduped as Breaker does

    def commit(self, r: Replica) -> None:
        if r.inflight is None:
            return
        nodes, used, keep, want = r.inflight
        r.inflight = None
        out = settle(
            self.state,
            r.holder,
            nodes,
            used,
            keep,
            want,
            self.fleet,
            self.share,
            WINDOW,
            self.now,
            TTL,
            frozenset(self.quarantined),
        )
        for node, decision in out.decisions.items():
            if decision.allowed:
                self.admitted.add(node)
            self.waits += decision.waiting
        if any(d.tripped_now for d in out.decisions.values()):
            self.trips += 1
            # It trips on real nodes only: the limit was really reached, not merely reserved.
            assert len(self.admitted) >= breaker_cap(self.fleet, self.share)
        for node, at in used.items():
            if r.used.get(node) == at:
                del r.used[node]
        r.slots = (r.slots if out.kept else 0) + out.granted
        if r.slots:
            r.valid_until = out.at + TTL / 2
        r.tripped = out.tripped

    def tick(self, replicas: list[Replica], seconds: float) -> None:
        # The taints of nodes admitted from a reservation land, and the watches show them, before the clock
        # moves on: within the half TTL by which a replica stops admitting from a reservation before it lapses.
        for r in replicas:
            self.quarantined |= set(r.used)
        self.now += seconds

    def die(self, r: Replica, write_lands: bool) -> Replica:
        """SIGKILL: a write already sent may still land; its unwritten admissions are quarantined (seen)."""
        if write_lands:
            self.commit(r)
        self.quarantined |= set(r.used)
        return Replica(f"{r.holder}'")  # its successor: a new process, a new holder

    def check(self) -> None:
        assert len(self.admitted) <= breaker_cap(self.fleet, self.share), (len(self.admitted), self.fleet)


step = st.one_of(
    st.tuples(st.just("local"), st.integers(0, 2), st.integers(0, 40)),
    st.tuples(st.just("begin"), st.integers(0, 2), st.lists(st.integers(0, 40), max_size=5), st.booleans()),
    st.tuples(st.just("commit"), st.integers(0, 2)),
    st.tuples(st.just("tick"), st.floats(0, 15)),
    st.tuples(st.just("die"), st.integers(0, 2), st.booleans()),
)


@settings(max_examples=400)
@given(
    fleet=st.integers(1, 40),
    share=st.sampled_from([0.1, 0.29, 0.5, 0.75, 1.0]),
    block=st.integers(1, 16),
    steps=st.lists(step, max_size=80),
)
def test_reserved_headroom_never_lets_more_than_the_limit_in(
    fleet: int, share: float, block: int, steps: list[tuple[Any, ...]]
) -> None:
    model = Model(fleet, share, block)
    replicas = [Replica(f"r{i}") for i in range(3)]
    for op, *args in steps:
        if op == "tick":
            model.tick(replicas, args[0])
        elif op == "die":
            replicas[args[0]] = model.die(replicas[args[0]], args[1])
        elif op == "local":
            model.local(replicas[args[0]], f"n{args[1]}")
        elif op == "begin":
            model.begin(replicas[args[0]], [f"n{i}" for i in args[1]], args[2])
        else:
            model.commit(replicas[args[0]])
        model.check()


def test_a_lapsed_reservation_frees_its_headroom() -> None:
    """A replica SIGKILLed while holding slots blocks the others for one TTL at most."""
    state: dict[str, Any] = {}
    first = settle(state, "dead", ["a"], {}, 0, 8, 10, 1.0, 300, 0.0, TTL)
    assert first.decisions["a"].allowed and first.granted == 4  # half of the 9 slots left
    got = settle(state, "b", [], {}, 0, 8, 10, 1.0, 300, 1.0, TTL)
    assert got.granted == 4  # an even share of the 9 not counted, between two holders
    blocked = settle(state, "c", ["x", "y"], {}, 0, 8, 10, 1.0, 300, 2.0, TTL)
    assert blocked.decisions["x"].allowed and blocked.decisions["y"].waiting and blocked.granted == 0
    later = settle(state, "c", ["y"], {}, 0, 8, 10, 1.0, 300, TTL + 1.5, TTL)
    assert later.decisions["y"].allowed and "dead" not in state["reserved"]  # lapsed: its 4 slots are free


def test_headroom_held_by_another_replica_waits_instead_of_tripping() -> None:
    state: dict[str, Any] = {"reserved": {"other": {"n": 2, "at": 0.0}}}
    got = settle(state, "me", ["a", "b", "c"], {}, 0, 8, 4, 1.0, 300, 1.0, TTL)
    assert got.decisions["a"].allowed and got.decisions["b"].allowed
    assert got.decisions["c"].waiting and not got.decisions["c"].tripped_now and not state.get("tripped")
    # The other replica admitted both of its slots and wrote them: c now really crosses the limit.
    settle(state, "other", [], {"x": 1.5, "y": 1.5}, 0, 0, 4, 1.0, 300, 2.0, TTL)
    assert "other" not in state["reserved"]
    got = settle(state, "me", ["c"], {}, 0, 8, 4, 1.0, 300, 3.0, TTL)
    assert got.decisions["c"].tripped_now and "5 of 4" in state["reason"]


def test_nodes_admitted_from_a_reservation_enter_the_window_and_count_once() -> None:
    state: dict[str, Any] = {}
    settle(state, "me", [], {}, 0, 4, 10, 0.5, 300, 0.0, TTL)
    assert state["reserved"]["me"]["n"] == 2  # half of the 5 slots
    got = settle(state, "me", [], {"a": 0.5, "b": 0.6}, 0, 4, 10, 0.5, 300, 1.0, TTL, frozenset({"a"}))
    assert set(state["admitted"]) == {"a", "b"} and got.kept and got.granted == 1  # 5 - 2 counted = 3 left
    assert state["reserved"]["me"] == {"n": 1, "at": 1.0}
    settle(state, "me", [], {}, 0, 0, 10, 0.5, 300, 2.0, TTL)  # handed back
    assert state["reserved"] == {}


def test_the_cap_matches_the_admission_rule_for_every_share() -> None:
    for fleet in range(1, 120):
        for share in (0.01, 0.07, 0.1, 0.29, 0.33, 0.5, 0.57, 1.0):
            cap = breaker_cap(fleet, share)
            state: dict[str, Any] = {}
            got = decide_admissions(state, [f"n{i}" for i in range(cap + 1)], fleet, share, 300, 0.0)
            assert sum(d.allowed for d in got.values()) == cap
