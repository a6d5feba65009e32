"""The level-triggered half of the actuator: every owned node's open flow is driven to its end.

A replica owns the nodes whose key the Kafka default partitioner (murmur2) puts into the incident
partitions assigned to it: the consumer group is the controller's sharding. A list+watch on the GPU
nodes (informer style, with a periodic resync) keeps a cache of them; a node is looked at when it
changes, when partitions are assigned, at every resync and when a lease another replica held on it
runs out. Looking at a node means: a person's uncordon cancels the flows that owned the cordon, and
every open flow nobody else is driving is resumed from its ledger.

Only a node that may need work is looked at by a resync or an assignment: each watch event says
whether its node has an open flow, a cordon of ours a person removed, or lacks xidflow's conditions
(``Reconciler.attention``). A healthy node needs nothing, so a resync or a rebalance costs the nodes
with work, not the fleet (at 10,000 nodes the walk over every node held the event loop 0.2-0.35 s, a
burst's records waiting behind it, every 10 s and at every rebalance). Objects are read into views on
the watch's thread, so a list of the whole fleet does not hold the loop either.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import orjson
from aiokafka.partitioner import murmur2
from kubernetes.watch.watch import iter_resp_lines

from pipeline.actuator import repaircase
from pipeline.actuator.baseline_conditions import BaselineConditions
from pipeline.actuator.breaker_rules import quarantined_by_xidflow
from pipeline.actuator.engine import Engine
from pipeline.actuator.kube import Kube, unreachable
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import CORDON, Ledger
from pipeline.runtime.reachability import API_SERVER
from pipeline.runtime.startmarks import mark

log = logging.getLogger("xidflow.actuator.reconciler")


def partition_of(node: str, partitions: int) -> int:
    """The partition Kafka's default partitioner gives a record keyed by the node name."""
    return (murmur2(node.encode()) & 0x7FFFFFFF) % partitions


def needs_attention(view: NodeView, ledger: Ledger | None = None) -> bool:
    """An open flow to drive, a repair case that waits on xidflow (a return to finish, a hand-off's answer to
    look for), or a cordon of ours a person removed (``ledger``: the view's, already parsed)."""
    ledger = ledger if ledger is not None else view.ledger
    if ledger.open_flows() or (ledger.repairs and repaircase.needs_driving(ledger)):
        return True
    return not view.unschedulable and bool(ledger.owners(CORDON))


@dataclass(frozen=True)
class Seen:
    """A Node as the watch read it: its view, and what the reconciler indexes it by."""

    view: NodeView
    quarantined: bool
    """xidflow's quarantine is on it (``breaker_rules.quarantined_by_xidflow``)."""
    attention: bool
    """It may need this replica's work (``Reconciler.attention``)."""


class NodeWatch:
    """List+watch of Nodes on a thread of its own; every event is handed to the event loop.

    ``read`` turns a Node object into what is posted, on this thread: the list's 10,000 objects are
    not parsed on the event loop. ``post`` gets ``("LIST", [read(o) for o in items])`` or ``(type, read(o))``.
    """

    def __init__(self, kube: Kube, selector: str, post: Callable[[str, Any], None],
                 read: Callable[[dict[str, Any]], Any] = lambda o: o) -> None:
        self.kube, self.selector, self.post, self.read = kube, selector, post, read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xidflow-node-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        nodes = self.kube.open_nodes  # not the generated CoreV1Api: a restarted replica lists at once
        while not self._stop.is_set():
            try:
                page = nodes((5, 60), label_selector=self.selector)
                API_SERVER.reachable()
                try:
                    listed = orjson.loads(page.data)
                finally:
                    page.release_conn()
                rv = listed["metadata"]["resourceVersion"]
                self.post("LIST", [self.read(o) for o in listed.get("items") or []])
                while not self._stop.is_set():
                    resp = nodes(
                        (5, 45),
                        label_selector=self.selector,
                        watch=True,
                        resource_version=rv,
                        allow_watch_bookmarks=True,
                        timeout_seconds=30,
                    )
                    try:
                        for line in iter_resp_lines(resp):
                            if self._stop.is_set():
                                return
                            event = orjson.loads(line)
                            obj = event.get("object") or {}
                            if event.get("type") == "ERROR":
                                raise _Expired(obj.get("message", "watch error"))
                            rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                            if event.get("type") != "BOOKMARK":
                                self.post(event["type"], self.read(obj))
                    finally:
                        resp.release_conn()
            except _Expired as exc:
                log.info("node watch expired (%s); listing again", exc)
            except Exception as exc:  # noqa: BLE001 - the watch must outlive API server restarts
                if unreachable(exc):  # the outage is logged as such (reachability.API_SERVER), not each retry
                    API_SERVER.failed(f"node watch: {type(exc).__name__}: {exc}")
                else:
                    log.warning("node watch failed: %s; listing again shortly", exc)
                self._stop.wait(1.0)


class _Expired(Exception):
    pass


SWEEP_CHUNK = 256
"""Nodes looked at between two yields to the event loop in a sweep (the first install's sweep covers the
whole fleet: every node lacks xidflow's conditions)."""


class Reconciler:
    """Drives the open flows of the nodes this replica owns."""

    def __init__(self, engine: Engine, kube: Kube, node_selector: str, resync_seconds: float) -> None:
        self.engine, self.kube = engine, kube
        self.resync_seconds = resync_seconds
        self.partitions: set[int] = set()
        self.partition_count = 0
        self._partition_of: dict[str, int] = {}
        """node -> its partition for ``partition_count``: murmur2 is pure Python, and every resync asks
        for every node of the fleet (at 10,000 nodes most of a resync's CPU was hashing the same names)."""
        self.nodes: dict[str, NodeView] = {}
        self.quarantined: set[str] = set()
        """Nodes of ``nodes`` carrying xidflow's quarantine (``breaker_rules.quarantined_by_xidflow``), per event."""
        self.attention: set[str] = set()
        """Nodes of ``nodes`` that may need work, kept per event: an open flow, a cordon of ours a person
        removed (``needs_attention``), or xidflow's conditions to add (``BaselineConditions.needed``). Any
        other node needs nothing whoever owns it; resyncs and assignments look at these only."""
        self._hashed_for = 0
        """The partition count ``_partition_of`` holds partitions for."""
        self.synced = False
        """The watch has listed once: ``nodes`` is the fleet."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch = NodeWatch(kube, node_selector, self._post, self._read)
        self._resync: asyncio.Task[None] | None = None
        self._sweep_task: asyncio.Task[None] | None = None
        self.resumed = 0
        self.baseline = BaselineConditions(kube, engine.settings, owns=self.owns, current=lambda n: self.nodes.get(n))

    # -- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._watch.start()
        self._resync = asyncio.create_task(self._resync_loop())

    async def stop(self) -> None:
        self._watch.stop()
        for timer in self._timers.values():
            timer.cancel()
        tasks = [t for t in (self._resync, self._sweep_task, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.baseline.stop()

    # -- ownership ----------------------------------------------------------------------------------------
    def assign(self, partitions: set[int], partition_count: int) -> None:
        """The incident partitions this replica now owns: pick up every node of them with work to do.

        Called with nothing at every revocation: then nothing is owned and nothing is looked at, and the
        nodes' partitions are kept (a rebalance does not change the partition count, so the next
        assignment hashes no name again)."""
        if partition_count and partition_count != self._hashed_for:
            self._partition_of.clear()
            self._hashed_for = partition_count
        self.partitions, self.partition_count = set(partitions), partition_count
        if self.partitions:
            self._sweep_soon()

    def owns(self, node: str) -> bool:
        if not self.partition_count:
            return False
        partition = self._partition_of.get(node)
        if partition is None:
            partition = self._partition_of[node] = partition_of(node, self.partition_count)
        return partition in self.partitions

    # -- events -------------------------------------------------------------------------------------------
    def _read(self, obj: dict[str, Any]) -> Seen:
        """A Node object as the reconciler indexes it. Pure (the watch's thread calls it)."""
        view = NodeView.from_object(obj)
        ledger = view.ledger  # parsed once for both questions (each event of both replicas paid it twice)
        return Seen(view, quarantined_by_xidflow(obj, ledger),
                    needs_attention(view, ledger) or self.baseline.needed(view))

    def _post(self, kind: str, seen: Seen | list[Seen]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_event, kind, seen)

    def _on_event(self, kind: str, seen: Seen | list[Seen]) -> None:
        if isinstance(seen, list):  # LIST: the whole fleet, replacing what was known
            mark("nodes_listed")
            self.nodes = {s.view.name: s.view for s in seen}
            self.quarantined = {s.view.name for s in seen if s.quarantined}
            self.attention = {s.view.name for s in seen if s.attention}
            self.synced = True
            self._sweep_soon()
            return
        name = seen.view.name
        if kind == "DELETED":
            self.nodes.pop(name, None)
            self.quarantined.discard(name)
            self.attention.discard(name)
            self._partition_of.pop(name, None)
            return
        self.nodes[name] = seen.view
        _mark(self.quarantined, name, seen.quarantined)
        _mark(self.attention, name, seen.attention)
        if seen.attention:
            self._consider(name)

    def fleet_snapshot(self) -> tuple[int, frozenset[str], Collection[str]] | None:
        """(GPU nodes, those xidflow quarantined, their names: a live view) from the watch; None before the first
        list (the breaker's cache)."""
        return (len(self.nodes), frozenset(self.quarantined), self.nodes.keys()) if self.synced else None

    def look_at(self, node: str) -> None:
        """Something outside the Node changed for it (a RepairRequest's answer): look at it now, when ours."""
        if self._loop is not None and self.synced:
            self._consider(node)

    def group_size(self, label: str, value: str) -> int | None:
        """GPU nodes labelled ``label=value`` (a repair budget's group), from the watch; None before it listed."""
        if not self.synced:
            return None
        return sum(1 for view in self.nodes.values() if view.labels.get(label) == value)

    def with_work(self) -> dict[str, NodeView]:
        """The nodes of ``attention`` (every node with an open flow among them), for the fleet gauges."""
        return {n: v for n in self.attention if (v := self.nodes.get(n)) is not None}

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resync_seconds)
            await self._sweep()

    def _sweep_soon(self) -> None:
        """Look at every node with work soon, once: a sweep still running for an older ownership is replaced."""
        if self._sweep_task is not None and not self._sweep_task.done():
            self._sweep_task.cancel()
        self._sweep_task = asyncio.create_task(self._sweep())

    async def _sweep(self) -> None:
        """``_consider`` every node of ``attention``, yielding to the event loop between chunks."""
        names = list(self.attention)
        for start in range(0, len(names), SWEEP_CHUNK):
            for name in names[start:start + SWEEP_CHUNK]:
                self._consider(name)
            await asyncio.sleep(0)

    def _consider(self, name: str) -> None:
        view = self.nodes.get(name)
        if view is None or not self.owns(name):
            return
        self.baseline.consider(view)  # xidflow's own conditions present, False while healthy
        if not needs_attention(view):
            return
        if not view.unschedulable and view.ledger.owners(CORDON):
            # A person uncordoned: cancel at once, even while a flow of the node runs here.
            asyncio.ensure_future(self._notice(view))
        if self.engine.busy(name):
            return  # driven in this process right now; its end is looked at by the resync
        if name in self._tasks:
            self._again.add(name)
            return
        self._tasks[name] = asyncio.create_task(self._drive(name))

    async def _notice(self, view: NodeView) -> None:
        try:
            await self.engine.notice(view)
        except Exception as exc:  # noqa: BLE001 - the next event or resync tries again
            if not unreachable(exc):
                log.warning("manual uncordon of %s not recorded yet: %s", view.name, exc)

    async def _drive(self, name: str) -> None:
        try:
            while True:
                self._again.discard(name)
                try:
                    retry_at = await self.engine.resume(name)
                except Exception as exc:  # noqa: BLE001 - looked at again on the next event or resync
                    if not unreachable(exc):  # an outage is logged once, as such (reachability.API_SERVER)
                        log.warning("resuming the flows of %s failed: %s", name, exc)
                    retry_at = time.time() + 1
                self.resumed += 1
                if retry_at is not None:
                    self._wake_at(name, retry_at)
                if name not in self._again:
                    return
        finally:
            self._tasks.pop(name, None)

    def _wake_at(self, name: str, at: float) -> None:
        """Look at the node again just after another replica's lease on it runs out."""
        old = self._timers.pop(name, None)
        if old is not None:
            old.cancel()
        assert self._loop is not None
        delay = max(0.0, at - time.time()) + 0.2
        self._timers[name] = self._loop.call_later(delay, self._timer_fired, name)

    def _timer_fired(self, name: str) -> None:
        self._timers.pop(name, None)
        self._consider(name)


def _mark(members: set[str], name: str, member: bool) -> None:
    if member:
        members.add(name)
    else:
        members.discard(name)
