"""Which nodes a tick is due for: the aggregation's timer without decoding every node state.

The timer (``agents.aggregate``) asks for a tick of every node whose state a tick may change
(``NodeState.tick_due``). It used to decode every state in the table to find them, every
``tick_interval_s`` (about 90 ms per 2,000 nodes, inside a burst when it landed there). The index
keeps each node's due time instead, noted when the aggregation writes the node's state; states the
table took from its changelog (recovery after an assignment, a restart) are not known until the
timer decodes them once (``restored``). A state reaches the table in only those two ways, so the
index asks for exactly the ticks the full scan asked for, once the due time has come. The ticks
themselves are records on the ticks topic, applied like any other event: nothing about them depends
on the index surviving a restart. Pure: no Faust, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pipeline.aggregate.state import NodeState


class TickIndex:
    """Node key -> the wall time from which a tick is due, for the nodes a tick may change."""

    def __init__(self, quiet_period_s: float) -> None:
        self.quiet_period_s = quiet_period_s
        self._due: dict[bytes, float] = {}
        self._unknown: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._due)

    def note(self, key: bytes, state: NodeState | None) -> None:
        """The node's state as just written (None: it has none)."""
        self._unknown.discard(key)
        due = state.tick_due(self.quiet_period_s) if state is not None else None
        if due is None:
            self._due.pop(key, None)
        else:
            self._due[key] = due

    def restored(self, keys: Iterable[bytes]) -> None:
        """States the table took without the aggregation writing them: decoded by ``settle``."""
        self._unknown.update(keys)

    def settle(self, stored: Callable[[bytes], bytes | None]) -> int:
        """Decode the restored states (``stored(key)``: the table's value) once; returns how many."""
        unknown, self._unknown = self._unknown, set()
        for key in unknown:
            value = stored(key)
            self.note(key, NodeState.from_bytes(value) if value is not None else None)
        return len(unknown)

    def due(self, now: float) -> list[bytes]:
        """The nodes a tick is due for at wall time ``now``."""
        return [key for key, at in self._due.items() if at <= now]
