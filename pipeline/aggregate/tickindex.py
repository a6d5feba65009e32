"""Which nodes a tick is due for: the aggregation's timer without decoding every node state.

The timer (``agents.aggregate``) asks for a tick of every node whose state a tick may change
(``NodeState.tick_due``). It used to decode every state in the table to find them, every
``tick_interval_s`` (about 90 ms per 2,000 nodes, inside a burst when it landed there). The index
keeps each node's due time instead, noted when the aggregation writes the node's state; states the
table took from its changelog (recovery after an assignment, a restart) are not known until the
timer decodes them once (``restored``). A state reaches the table in only those two ways, so the
index asks for exactly the ticks the full scan asked for, once the due time has come. The ticks
themselves are records on the ticks topic, applied like any other event: nothing about them depends
on the index surviving a restart.

The index is per process and a node's state belongs to a partition (events, ticks and changelog share
partition numbers, ``pipeline.aggregate.copartition``). When a rebalance moves a partition away, its
nodes' states stay behind in this process's table, frozen: the index must forget them (``assigned``), or
this process would ask for their ticks forever (a state it no longer writes never stops being due), on
top of the ticks of their new owner, which learns them from its restore. Pure: no Faust, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pipeline.aggregate.state import NodeState


class TickIndex:
    """Node key -> the wall time from which a tick is due, for the nodes a tick may change."""

    def __init__(self, quiet_period_s: float) -> None:
        self.quiet_period_s = quiet_period_s
        self._due: dict[bytes, float] = {}
        self._partition: dict[bytes, int] = {}  # of each node in _due
        self._unknown: dict[bytes, int] = {}  # restored, not decoded yet: key -> partition
        self._owned: set[int] | None = None  # None: no assignment told yet (every partition counts)

    def __len__(self) -> int:
        return len(self._due)

    def owns(self, partition: int) -> bool:
        return self._owned is None or partition in self._owned

    def note(self, key: bytes, state: NodeState | None, partition: int) -> None:
        """The node's state as just written to ``partition`` (None: it has none)."""
        self._unknown.pop(key, None)
        due = state.tick_due(self.quiet_period_s) if state is not None else None
        # A batch fetched before a rebalance may finish after it: a partition gone is not learnt again.
        if due is None or not self.owns(partition):
            self.forget(key)
        else:
            self._due[key] = due
            self._partition[key] = partition

    def forget(self, key: bytes) -> None:
        """The node has no state here any more."""
        self._due.pop(key, None)
        self._partition.pop(key, None)
        self._unknown.pop(key, None)

    def restored(self, entries: Iterable[tuple[bytes, int]]) -> None:
        """States (key, partition) the table took without the aggregation writing them: decoded by ``settle``."""
        for key, partition in entries:
            if self.owns(partition):
                self._unknown[key] = partition

    def assigned(self, partitions: Iterable[int]) -> int:
        """This process owns exactly ``partitions`` now: the nodes of any other are forgotten; returns how many."""
        self._owned = set(partitions)
        gone = [key for key, p in [*self._partition.items(), *self._unknown.items()] if p not in self._owned]
        for key in gone:
            self.forget(key)
        return len(gone)

    def settle(self, stored: Callable[[bytes], bytes | None]) -> int:
        """Decode the restored states (``stored(key)``: the table's value) once; returns how many."""
        unknown, self._unknown = self._unknown, {}
        for key, partition in unknown.items():
            value = stored(key)
            self.note(key, NodeState.from_bytes(value) if value is not None else None, partition)
        return len(unknown)

    def due(self, now: float) -> list[bytes]:
        """The nodes a tick is due for at wall time ``now``."""
        return [key for key, at in self._due.items() if at <= now]
