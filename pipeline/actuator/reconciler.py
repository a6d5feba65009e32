"""The level-triggered half of the actuator: every owned node's open flow is driven to its end.

A replica owns the nodes whose key the Kafka default partitioner (murmur2) puts into the incident
partitions assigned to it: the consumer group is the controller's sharding. A list+watch on the GPU
nodes (informer style, with a periodic resync) keeps a cache of them; a node is looked at when it
changes, when partitions are assigned, at every resync and when a lease another replica held on it
runs out. Looking at a node means: a person's uncordon cancels the flows that owned the cordon, and
every open flow nobody else is driving is resumed from its ledger.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
from aiokafka.partitioner import murmur2
from kubernetes.watch.watch import iter_resp_lines

from pipeline.actuator.baseline_conditions import BaselineConditions
from pipeline.actuator.breaker import quarantined_by_xidflow
from pipeline.actuator.engine import Engine
from pipeline.actuator.kube import Kube
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import CORDON

log = logging.getLogger("xidflow.actuator.reconciler")


def partition_of(node: str, partitions: int) -> int:
    """The partition Kafka's default partitioner gives a record keyed by the node name."""
    return (murmur2(node.encode()) & 0x7FFFFFFF) % partitions


def needs_attention(view: NodeView) -> bool:
    """An open flow to drive, or a cordon of ours a person removed."""
    ledger = view.ledger
    if ledger.open_flows():
        return True
    return not view.unschedulable and bool(ledger.owners(CORDON))


class NodeWatch:
    """List+watch of Nodes on a thread of its own; every event is handed to the event loop."""

    def __init__(self, kube: Kube, selector: str, post: Callable[[str, dict[str, Any]], None]) -> None:
        self.kube, self.selector, self.post = kube, selector, post
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="xidflow-node-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        core = self.kube.core
        while not self._stop.is_set():
            try:
                page = core.list_node(label_selector=self.selector, _preload_content=False, _request_timeout=(5, 60))
                listed = orjson.loads(page.data)
                rv = listed["metadata"]["resourceVersion"]
                self.post("LIST", listed)
                while not self._stop.is_set():
                    resp = core.list_node(
                        label_selector=self.selector,
                        watch=True,
                        resource_version=rv,
                        allow_watch_bookmarks=True,
                        timeout_seconds=30,
                        _preload_content=False,
                        _request_timeout=(5, 45),
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
                                self.post(event["type"], obj)
                    finally:
                        resp.release_conn()
            except _Expired as exc:
                log.info("node watch expired (%s); listing again", exc)
            except Exception as exc:  # noqa: BLE001 - the watch must outlive API server restarts
                log.warning("node watch failed: %s; listing again shortly", exc)
                self._stop.wait(1.0)


class _Expired(Exception):
    pass


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
        """Nodes of ``nodes`` carrying xidflow's quarantine (``breaker.quarantined_by_xidflow``), kept per event."""
        self.synced = False
        """The watch has listed once: ``nodes`` is the fleet."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._again: set[str] = set()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watch = NodeWatch(kube, node_selector, self._post)
        self._resync: asyncio.Task[None] | None = None
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
        tasks = [t for t in (self._resync, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.baseline.stop()

    # -- ownership ----------------------------------------------------------------------------------------
    def assign(self, partitions: set[int], partition_count: int) -> None:
        """The incident partitions this replica now owns: pick up every node of them with an open flow."""
        if partition_count != self.partition_count:
            self._partition_of.clear()
        self.partitions, self.partition_count = set(partitions), partition_count
        for name in list(self.nodes):
            self._consider(name)

    def owns(self, node: str) -> bool:
        if not self.partition_count:
            return False
        partition = self._partition_of.get(node)
        if partition is None:
            partition = self._partition_of[node] = partition_of(node, self.partition_count)
        return partition in self.partitions

    # -- events -------------------------------------------------------------------------------------------
    def _post(self, kind: str, obj: dict[str, Any]) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_event, kind, obj)

    def _on_event(self, kind: str, obj: dict[str, Any]) -> None:
        if kind == "LIST":
            items = obj.get("items") or []
            self.nodes = {v.name: v for v in (NodeView.from_object(o) for o in items)}
            self.quarantined = {o["metadata"]["name"] for o in items if quarantined_by_xidflow(o)}
            self.synced = True
            for name in list(self.nodes):
                self._consider(name)
            return
        view = NodeView.from_object(obj)
        if kind == "DELETED":
            self.nodes.pop(view.name, None)
            self.quarantined.discard(view.name)
            self._partition_of.pop(view.name, None)
            return
        self.nodes[view.name] = view
        if quarantined_by_xidflow(obj):
            self.quarantined.add(view.name)
        else:
            self.quarantined.discard(view.name)
        self._consider(view.name)

    def fleet_snapshot(self) -> tuple[int, frozenset[str]] | None:
        """(GPU nodes, those xidflow quarantined) from the watch; None before the first list (the breaker's cache)."""
        return (len(self.nodes), frozenset(self.quarantined)) if self.synced else None

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resync_seconds)
            for name in list(self.nodes):
                self._consider(name)

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
            log.warning("manual uncordon of %s not recorded yet: %s", view.name, exc)

    async def _drive(self, name: str) -> None:
        try:
            while True:
                self._again.discard(name)
                try:
                    retry_at = await self.engine.resume(name)
                except Exception as exc:  # noqa: BLE001 - looked at again on the next event or resync
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
