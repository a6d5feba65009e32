"""Is the worker making progress? The answer behind ``/healthz`` (pure: callers pass the clock).

"Process alive" is not liveness: a parse stage that restarts on the same record forever, or an
aggregation agent whose loop is blocked, answers ``/metrics`` happily while nothing is detected. Each
stage registers a ``Component`` and reports:

- ``beat(now)``: its loop went round (it is not blocked);
- ``busy(now)``: it has input waiting (records fetched, or lag behind the end of its partitions);
- ``progressed(now)``: its position moved (offsets committed or read), or it is idle with nothing to do.

- ``fault(key, reason)`` / ``clear(key)``: something it cannot get past by itself (a partition held at
  a record batch it cannot decode, ``pipeline.kafka.undecodable``) makes it unhealthy at once, whatever else moves.

A component is stalled when it has not beaten for ``stall_after_s``, or when it has had input waiting
and no progress for ``stall_after_s``: a restart can help, so ``/livez`` (the liveness probe) is red.
A fault is not a stall: a restart cannot install a codec library, and restarting would stop the
partitions that still flow, so a fault turns only ``/healthz`` red (the readiness probe: the pod shows
not ready, the alert fires) and ``/livez`` stays green while the process otherwise progresses.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class Component:
    name: str
    stall_after_s: float
    last_beat: float
    last_progress: float
    backlog: bool = False
    note: str = ""
    faults: dict[str, str] = field(default_factory=dict)

    def fault(self, key: str, reason: str) -> None:
        """Stalled until ``clear(key)``: a condition only an operator fixes (the reason says what to do)."""
        self.faults[key] = reason

    def clear(self, key: str) -> None:
        self.faults.pop(key, None)

    def beat(self, now: float | None = None) -> None:
        self.last_beat = time.monotonic() if now is None else now

    def busy(self, now: float | None = None) -> None:
        """Input is waiting; progress is due within ``stall_after_s``."""
        if not self.backlog:
            # Waiting starts now: progress is measured from the moment input appeared.
            self.last_progress = max(self.last_progress, (time.monotonic() if now is None else now))
            self.backlog = True

    def progressed(self, now: float | None = None, idle: bool = False) -> None:
        now = time.monotonic() if now is None else now
        self.last_beat = max(self.last_beat, now)
        self.last_progress = now
        if idle:
            self.backlog = False
        self.note = ""

    def stalled(self, now: float, faults: bool = True) -> str | None:
        """Why this component is stalled (or, with ``faults``, also unhealthy), or None."""
        if faults and self.faults:
            return f"{self.name}: " + "; ".join(self.faults.values())
        if now - self.last_beat > self.stall_after_s:
            return f"{self.name}: loop has not run for {now - self.last_beat:.0f}s"
        if self.backlog and now - self.last_progress > self.stall_after_s:
            extra = f" ({self.note})" if self.note else ""
            return f"{self.name}: input waiting, no progress for {now - self.last_progress:.0f}s{extra}"
        return None


@dataclass
class Liveness:
    components: dict[str, Component] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def component(self, name: str, stall_after_s: float, now: float | None = None) -> Component:
        """Register (or re-register) a component; it starts out fresh."""
        now = time.monotonic() if now is None else now
        with self._lock:
            comp = Component(name, stall_after_s, now, now)
            self.components[name] = comp
            return comp

    def remove(self, name: str) -> None:
        with self._lock:
            self.components.pop(name, None)

    def check(self, now: float | None = None, faults: bool = True) -> tuple[bool, list[str]]:
        """(ok, reasons); reasons name every stalled component, and with ``faults`` every faulted one."""
        now = time.monotonic() if now is None else now
        with self._lock:
            reasons = [r for c in self.components.values() if (r := c.stalled(now, faults))]
        return not reasons, reasons


LIVENESS = Liveness()
"""The process's registry, served at ``/healthz`` by ``pipeline.runtime.metrics.serve_metrics``."""
