"""What the burst benchmarks look at: the fatal line they send, the watches that see its effects, the statistics.

``NodeWatch`` sees each node's quarantine taint appear (the latency's end), ``ConditionWatch`` its
conditions (when the actuators have settled), ``GroupWatch`` the consumer groups' rebalances (where a
failover's or a rolling restart's time goes). Used by ``pipeline.benchmarks.burst`` (the scenarios),
``pipeline.benchmarks.burst_world`` (the processes they run, and ``IncidentTail``) and the storm and
scale benches.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import orjson

from pipeline.actuator.kube import Kube
from pipeline.actuator.nodeview import CORDON_ANSWER_TAINT as UNSCHEDULABLE_TAINT

FATAL_LINE = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
TAINT_KEY = "nvidia.com/gpu-fault"
SLOW_MS = 5000.0
PACE_S = 0.15
"""Seconds between two paced lines in the rolling scenario (its N nodes last N x 0.15 seconds)."""


def kmsg(line: str, node: str, seq: int) -> bytes:
    """A Fluent Bit kmsg-input record as its Kafka output writes it (format json)."""
    return orjson.dumps(
        {"priority": 2, "sequence": seq, "sec": 1000 + seq, "usec": 0, "msg": line, "hostname": node,
         "@timestamp": time.time()}
    )


def percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def summarize(prefix: str, latencies_ms: list[float], expected: int) -> dict[str, Any]:
    """``<prefix>_p50_ms``, ``_p99_ms``, ``_max_ms``, ``_samples``, ``_missing``, ``_over_5s``."""
    values = sorted(latencies_ms)
    out: dict[str, Any] = {
        f"{prefix}_samples": len(values),
        f"{prefix}_missing": expected - len(values),
        f"{prefix}_over_5s": sum(v > SLOW_MS for v in values) + (expected - len(values)),
    }
    if values:
        out.update(
            {
                f"{prefix}_p50_ms": round(percentile(values, 0.50), 1),
                f"{prefix}_p99_ms": round(percentile(values, 0.99), 1),
                f"{prefix}_max_ms": round(values[-1], 1),
            }
        )
    return out


class NodeWatch:
    """A watch on the scenario's nodes (a thread): when each node's quarantine taint was first seen.

    Also when each node was first seen ``settled`` (an own problem condition True: its flow's last write)
    and ``answered`` (the node lifecycle controller's ``node.kubernetes.io/unschedulable`` taint, its
    answer to the cordon): the cost windows end once both are there for every node, so the work a
    quarantine causes after its taint, the cluster's included, is counted in them.
    """

    def __init__(self, kube: Kube, selector: str, resource_version: str) -> None:
        from pipeline.actuator.problems import OWN_CONDITION_TYPES

        self.kube, self.selector, self.rv = kube, selector, resource_version
        self.tainted: dict[str, float] = {}
        self.settled: dict[str, float] = {}
        self.answered: dict[str, float] = {}
        self._own = OWN_CONDITION_TYPES
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-node-watch", daemon=True)
        self._resp: Any = None

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._resp = self.kube.core.list_node(
                    watch=True,
                    label_selector=self.selector,
                    resource_version=self.rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=300,
                    _preload_content=False,
                )
                buffer = b""
                for chunk in self._resp.stream(65536, decode_content=True):
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    now = time.time()
                    for line in lines:
                        if line.strip():
                            self._event(orjson.loads(line), now)
                    if self._stop.is_set():
                        return
            except Exception:  # noqa: BLE001 - a dropped watch is resumed from the last version
                if self._stop.is_set():
                    return
                time.sleep(0.1)

    def _event(self, event: dict[str, Any], now: float) -> None:
        obj = event.get("object") or {}
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.rv = meta["resourceVersion"]
        if event.get("type") not in ("ADDED", "MODIFIED"):
            return
        name = meta.get("name")
        if not name:
            return
        taints = (obj.get("spec") or {}).get("taints") or []
        if name not in self.tainted and any(t.get("key") == TAINT_KEY for t in taints):
            self.tainted[name] = now
        if name not in self.answered and any(t.get("key") == UNSCHEDULABLE_TAINT for t in taints):
            self.answered[name] = now
        if name not in self.settled:
            conditions = (obj.get("status") or {}).get("conditions") or []
            if any(c.get("type") in self._own and c.get("status") == "True" for c in conditions):
                self.settled[name] = now

    def done(self, names: list[str], settled: bool = True) -> bool:
        """Every one of ``names`` tainted, answered by the lifecycle controller and (``settled``) settled."""
        return all(n in self.tainted and n in self.answered and (not settled or n in self.settled) for n in names)

    def stop(self) -> None:
        """Stop at once. Closing the response waits until the reading thread's read returns: on a quiet
        watch that is the next bookmark, up to a minute later, and the caller's event loop stood still
        meanwhile (py-spy: the scale bench's steady state read 65 s at 10,000 nodes, 30 s of it here).
        So the close happens on a thread of its own."""
        self._stop.set()
        if self._resp is not None:
            threading.Thread(target=_close_quietly, args=(self._resp,), name="bench-watch-close", daemon=True).start()


def _close_quietly(resp: Any) -> None:
    with contextlib.suppress(Exception):
        resp.close()


def condition_types(node: dict[str, Any]) -> set[str]:
    return {c.get("type") for c in (node.get("status") or {}).get("conditions") or []}


class ConditionWatch(NodeWatch):
    """A watch that removes a node from ``lacking`` once it carries every ``wanted`` condition type."""

    def __init__(self, kube: Kube, selector: str, resource_version: str, wanted: set[str], lacking: set[str]) -> None:
        super().__init__(kube, selector, resource_version)
        self.wanted, self.lacking = wanted, lacking

    def _event(self, event: dict[str, Any], now: float) -> None:
        obj = event.get("object") or {}
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.rv = meta["resourceVersion"]
        if event.get("type") in ("ADDED", "MODIFIED") and self.wanted <= condition_types(obj):
            self.lacking.discard(meta.get("name"))


@dataclass(frozen=True)
class GroupSample:
    """One look at a consumer group: when (``time.time()``), its state, who held partitions."""

    at: float
    group: str
    state: str
    holders: frozenset[str]
    """group.instance.id of each member with partitions assigned."""


def unsettled_windows(samples: list[GroupSample]) -> list[tuple[str, float, float]]:
    """(group, first look not Stable, first look Stable again) for each rebalance the looks saw. Pure.

    The span is the rebalance as the group's members live it: from the coordinator starting it (a
    LeaveGroup, a JoinGroup, a session expired) through the members learning of it at their next
    heartbeat, rejoining and syncing. A rebalance still open at the last look is left out.
    """
    out: list[tuple[str, float, float]] = []
    opened: dict[str, float] = {}
    for s in sorted(samples, key=lambda s: s.at):
        if s.state != "Stable":
            opened.setdefault(s.group, s.at)
        elif s.group in opened:
            out.append((s.group, opened.pop(s.group), s.at))
    return out


def first_unsettled(
    samples: list[GroupSample], groups: list[str], after: float, member: str | None = None
) -> float | None:
    """When the first of ``groups`` was first seen rebalancing, or without ``member`` holding partitions,
    after ``after`` (None: never). Pure.

    After a member's SIGTERM: when its LeaveGroup reached the coordinator, i.e. how long its orderly
    stop kept its partitions before handing them over. A rebalance shorter than the watch's look can be
    missed; the member gone from the holders is seen all the same.
    """
    return min((s.at for s in samples if s.group in groups and s.at > after
                and (s.state != "Stable" or (member is not None and member not in s.holders))), default=None)


def takeover_split(samples: list[GroupSample], lost: str, killed_at: float) -> dict[str, float]:
    """Where a lost member's takeover time went, in seconds from the kill (its groups' looks). Pure.

    ``expired_s``: until the last of its groups was seen rebalancing without it (the coordinator
    expired its session: the session timeout after its last heartbeat, plus the coordinator's own
    check); ``rebalanced_s``: until the last of them was Stable again with the survivors holding every
    partition (the survivors' next heartbeat, their rejoin and sync). Empty when the looks never saw it.
    """
    expired: dict[str, float] = {}
    settled: dict[str, float] = {}
    for s in sorted(samples, key=lambda s: s.at):
        if s.at < killed_at:
            continue
        gone = lost not in s.holders
        if s.group not in expired and (s.state != "Stable" or gone):
            expired[s.group] = s.at
        if s.group in expired and s.group not in settled and s.state == "Stable" and gone and s.holders:
            settled[s.group] = s.at
    if not expired or set(settled) != set(expired):
        return {}
    return {"expired_s": round(max(expired.values()) - killed_at, 2),
            "rebalanced_s": round(max(settled.values()) - killed_at, 2)}


class GroupWatch:
    """Looks at consumer groups every ``interval_s`` (a task, one admin client): ``samples``.

    A rebalance lasts from tens of milliseconds to a heartbeat interval; a fresh client per look (a
    connection and a metadata round trip) would blur it.
    """

    def __init__(self, bootstrap: str, groups: list[str], interval_s: float = 0.05) -> None:
        self.bootstrap, self.groups, self.interval_s = bootstrap, groups, interval_s
        self.samples: list[GroupSample] = []
        self._task: asyncio.Task[None] | None = None
        self._rounds = 0
        self._round_done = asyncio.Event()

    async def _reached(self, rounds: int) -> None:
        while self._rounds < rounds and self._task is not None and not self._task.done():
            self._round_done.clear()
            await self._round_done.wait()

    async def start(self) -> None:
        from pipeline.kafka import clients as kafka_clients

        admin = kafka_clients.admin(self.bootstrap)
        await admin.start()
        self._task = asyncio.create_task(self._run(admin))

    async def _run(self, admin: Any) -> None:
        from aiokafka.errors import KafkaError

        from pipeline.kafka.membership import describe_group

        coordinators: dict[str, int] = {}
        try:
            while True:
                for group in self.groups:
                    before = time.time()
                    # A failed look (a coordinator moving, a request timing out under load) is skipped,
                    # and the coordinator looked up again.
                    try:
                        if group not in coordinators:
                            coordinators[group] = await admin.find_coordinator(group)
                        view = await describe_group(self.bootstrap, group, admin, coordinators[group])
                    except (KafkaError, RuntimeError, OSError):
                        coordinators.pop(group, None)
                    else:
                        holders = frozenset(m.instance_id for m in view.members if m.partitions and m.instance_id)
                        # The answer describes some moment of the round trip: its middle.
                        self.samples.append(GroupSample((before + time.time()) / 2, group, view.state, holders))
                self._rounds += 1
                self._round_done.set()
                await asyncio.sleep(self.interval_s)
        finally:
            self._round_done.set()
            await admin.close()

    async def stop(self, limit_s: float = 5.0) -> list[GroupSample]:
        """Stop once a whole round of looks begun after this call is done (within ``limit_s``): the caller
        saw something happen with a look of its own, and the watch's figures must include it."""
        target = self._rounds + 2  # the round under way may have begun before this call
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._reached(target), limit_s)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.samples
