"""Kernel line to taint, end to end, under a burst and through failover and rolling restarts.

Each scenario builds its own world (topic prefix, worker app id, actuator group, N fresh fake GPU
nodes in the API server) and runs real processes: ``xidflow worker`` (parse stage + aggregation)
and two ``xidflow actuator`` replicas, each a static group member (``XIDFLOW_GROUP_INSTANCE_ID``).
One fatal kernel line (Xid 79, as Fluent Bit's kmsg input writes it) per node goes to the raw kernel
topic; a watch on the nodes sees each node's quarantine taint appear. Latency = the moment the watch
saw the taint - the moment the line was handed to the producer (same clock, same process).

- ``burst``: every node's line at once, nothing disturbed.
- ``failover_actuator``: the same burst; the working process of one of the two actuator replicas is
  SIGKILLed right after the burst is produced: the child of ``xidflow actuator``'s warm supervisor
  (``pipeline.runtime.supervisor``), which forks a replacement at once with the same identity.
- ``failover_worker``: the same with the worker's working child SIGKILLed.
- ``failover_actuator_process`` / ``failover_worker_process``: the whole ``xidflow`` process (the
  supervisor, and its child with it) SIGKILLed and started again at once with the same identity,
  what the kubelet does to a crashed container (same pod, same name): the cost of a process start.
- ``failover_lost_actuator`` / ``failover_lost_worker``: a replica SIGKILLed that never comes back
  (pod deleted without a goodbye, node lost): the other replica (two workers in the worker case)
  takes its partitions once the broker expires its session (``_session_timeout_s``, reported), so
  the figure is bounded by that timeout plus the rebalance (``_takeover_s``: kill to the survivors
  holding every partition).
- ``rolling``: two workers and two actuators; lines are paced over the time it takes to restart
  each process in turn with SIGTERM (each waits for the previous one to be back in its groups).

Not a test: it returns numbers (``pipeline.benchmarks.pipeline`` puts them under stable keys).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiokafka.errors import KafkaError

from pipeline.actuator.kube import Kube
from pipeline.actuator.testing import create_nodes, delete_nodes
from pipeline.benchmarks import procstat
from pipeline.benchmarks.procstat import ProcSample
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.membership import GroupView, describe_group
from pipeline.runtime.settings import TopicNames

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


@dataclass
class Proc:
    """One ``xidflow`` process of a scenario, restartable with the same identity."""

    name: str
    args: list[str]
    env: dict[str, str]
    log: Path
    proc: asyncio.subprocess.Process | None = None
    lost: bool = False
    """Killed for good (the lost-replica scenarios): no longer expected to run or to hold partitions."""

    def work_pid(self) -> int:
        """The pid that does the work: the supervisor's child (``pipeline.runtime.supervisor``), else the process."""
        from pipeline.runtime.supervisor import child_pids

        assert self.proc is not None
        children = child_pids(self.proc.pid)
        return children[0] if children else self.proc.pid

    async def start(self) -> None:
        out = self.log.open("ab")
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "pipeline.cli", *self.args, env=self.env, stdout=out, stderr=out
            )
        finally:
            out.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def signal(self, sig: signal.Signals, wait_s: float = 60) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(sig)
        try:
            await asyncio.wait_for(self.proc.wait(), wait_s)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""


class IncidentTail:
    """A consumer on the incidents topic from its end (a task): when each node's incident became readable.

    The incidents' own timestamps say when the worker handed them to its producer, not when a consumer
    could read them: a profile of the 500-node burst showed both actuators receiving most incidents in
    one lump 400-600 ms after those timestamps. This tail puts that delay in the worker's share
    (``<prefix>_delivery_*``) instead of the actuator's.
    """

    def __init__(self, world: World) -> None:
        self.world = world
        self.seen: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        from aiokafka import TopicPartition

        consumer = kafka_clients.consumer(
            bootstrap=self.world.bootstrap, enable_auto_commit=False, group_id=None, fetch_max_wait_ms=50
        )
        await consumer.start()
        tps = [TopicPartition(self.world.topics.name("incidents"), p) for p in range(self.world.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)
        for tp in tps:
            await consumer.position(tp)  # resolved now, before the clock starts
        self._task = asyncio.create_task(self._run(consumer))

    async def _run(self, consumer: Any) -> None:
        try:
            while True:
                batches = await consumer.getmany(timeout_ms=100)
                now = time.time()
                for records in batches.values():
                    for rec in records:
                        if rec.key:
                            self.seen.setdefault(rec.key.decode(), now)
        finally:
            await consumer.stop()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, KafkaError):
                await self._task


class NodeWatch:
    """A watch on the scenario's nodes (a thread): when each node's quarantine taint was first seen."""

    def __init__(self, kube: Kube, selector: str, resource_version: str) -> None:
        self.kube, self.selector, self.rv = kube, selector, resource_version
        self.tainted: dict[str, float] = {}
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
        taints = (obj.get("spec") or {}).get("taints") or []
        if name and name not in self.tainted and any(t.get("key") == TAINT_KEY for t in taints):
            self.tainted[name] = now

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


def _condition_types(node: dict[str, Any]) -> set[str]:
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
        if event.get("type") in ("ADDED", "MODIFIED") and self.wanted <= _condition_types(obj):
            self.lacking.discard(meta.get("name"))


@dataclass
class World:
    """One scenario's topics, nodes, processes and clock."""

    bootstrap: str
    kubeconfig: str
    nodes: int
    partitions: int
    workers: int = 1
    actuators: int = 2
    fleet: int = 0
    """GPU nodes in the fleet, the ``nodes`` that get a line included (fewer: ``nodes``)."""
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    procs: dict[str, Proc] = field(default_factory=dict)
    logdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="xidflow-bench-")))
    progress: Callable[[str, float, float], None] = lambda t, d, n: None

    def __post_init__(self) -> None:
        self.topics = TopicNames(prefix=f"b{self.tag}.")
        self.app_id = f"bench-{self.tag}"
        self.actuator_group = f"bench-act-{self.tag}"
        self.selector = f"xidflow.bench/burst={self.tag}"
        self.namespace = f"xidflow-bench-{self.tag}"
        self.names = [f"b{self.tag}-{i:05d}" for i in range(self.nodes)]
        self.warm = [f"b{self.tag}-warm-{i}" for i in range(4)]
        self.idle = [f"b{self.tag}-i{i:05d}" for i in range(max(0, self.fleet - self.nodes))]
        self.timings: dict[str, float] = {}
        """Setup, in seconds: ``create_s`` (the fleet), then from the processes' start ``members_s``
        (every group Stable) and ``steady_s`` (every node carries xidflow's own conditions)."""
        self.others: list[str] = []
        """Nodes a hook made in this world outside its fleet (deleted with it)."""
        self.steady: dict[str, ProcSample] = {}
        """Each actuator's memory and CPU read at the moment the fleet reached steady state."""
        self.kube = Kube.from_config(self.kubeconfig, 32)
        env = {
            **os.environ,
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "KUBECONFIG": self.kubeconfig,
            "XIDFLOW_TOPIC_PREFIX": self.topics.prefix,
            "XIDFLOW_METRICS_PORT": "0",
            "XIDFLOW_PARSE_POLL_TIMEOUT_MS": "5",
            "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": self.selector,
            "XIDFLOW_ACTUATOR_NAMESPACE": self.namespace,
            "XIDFLOW_ACTUATOR_GROUP_ID": self.actuator_group,
            "XIDFLOW_ACTUATOR_POLICY_SOURCE": "file",
            "XIDFLOW_ACTUATOR_BREAKER_MAX_SHARE": "1.0",
            "XIDFLOW_ACTUATOR_TAINT_KEY": TAINT_KEY,
        }
        env.pop("POD_NAME", None)
        for i in range(self.workers):
            name = f"worker-{i}"
            args = ["worker", "--app-id", self.app_id, "--partitions", str(self.partitions), "--loglevel", "info"]
            self.procs[name] = Proc(name, args, {**env, "XIDFLOW_GROUP_INSTANCE_ID": name}, self.logdir / f"{name}.log")
        for i in range(self.actuators):
            name = f"actuator-{i}"
            args = ["actuator", "--no-api", "--log-level", "WARNING"]
            self.procs[name] = Proc(name, args, {**env, "XIDFLOW_GROUP_INSTANCE_ID": name}, self.logdir / f"{name}.log")

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if not proc.alive() and not proc.lost:
                code = proc.proc.returncode if proc.proc else None
                raise RuntimeError(f"{name} exited ({code}), log {proc.log}: {proc.tail()}")

    def groups(self, proc: str) -> list[str]:
        """The consumer groups a process is a member of."""
        return [self.app_id, f"{self.app_id}-parse"] if proc.startswith("worker") else [self.actuator_group]

    async def setup(self) -> None:
        from pipeline.app import worker_topics

        await ensure_topics(self.bootstrap, worker_topics(self.app_id, self.topics), self.partitions)
        names = ("incidents", "remediation_requests", "remediation_audit", "deadletter")
        await ensure_topics(self.bootstrap, [self.topics.name(n) for n in names], self.partitions)
        fleet = [*self.names, *self.idle, *self.warm]
        start = time.monotonic()
        await create_nodes(self.kube, fleet, {"xidflow.bench/burst": self.tag}, gpu=True,
                           progress=lambda n: self.progress("create nodes", n, len(fleet)))
        self.timings["create_s"] = round(time.monotonic() - start, 2)
        start = time.monotonic()
        for proc in self.procs.values():
            await proc.start()
        await self.wait_members(list(self.procs))
        self.timings["members_s"] = round(time.monotonic() - start, 2)
        await self.wait_baseline()
        self.timings["steady_s"] = round(time.monotonic() - start, 2)
        self.steady = {n: procstat.read(p.proc.pid) for n, p in self.procs.items()
                       if n.startswith("actuator") and p.proc is not None}

    async def wait_baseline(self, limit_s: float = 600) -> None:
        """Until every node carries xidflow's own conditions (False): the fleet's steady state.

        A new actuator adds them to every GPU node it owns; timing a burst during that would measure the
        first start of xidflow on a fleet, not a fault on a fleet it already watches. One list, then a
        watch from its version (not a list every moment: at 10,000 nodes that would load the API server
        and this machine as much as the actuators being measured).
        """
        from pipeline.actuator.problems import ProblemClass

        wanted = {str(c) for c in ProblemClass}
        page = await self.kube._call(self.kube.core.list_node, label_selector=self.selector)
        lacking = {n["metadata"]["name"] for n in page.get("items") or [] if not wanted <= _condition_types(n)}
        watch = ConditionWatch(self.kube, self.selector, page["metadata"]["resourceVersion"], wanted, lacking)
        watch.start()
        deadline = time.monotonic() + limit_s
        try:
            while watch.lacking:
                self.check_alive()
                self.progress("steady state", self.fleet_size - len(watch.lacking), self.fleet_size)
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{len(watch.lacking)} nodes still lack xidflow's conditions after {limit_s:.0f}s"
                    )
                await asyncio.sleep(0.1)
        finally:
            watch.stop()

    async def wait_conditions(self, names: list[str], limit_s: float = 180) -> float | None:
        """Until each of ``names`` carries a problem condition that is True (its flow's last write): seconds
        waited, None if not within ``limit_s`` (the run goes on; the key says so)."""
        from pipeline.actuator.problems import ProblemClass

        own = {str(c) for c in ProblemClass}
        lacking = set(names)
        start = time.monotonic()
        while lacking and time.monotonic() - start < limit_s:
            page = await self.kube._call(self.kube.core.list_node, label_selector=self.selector)
            for node in page.get("items") or []:
                conditions = (node.get("status") or {}).get("conditions") or []
                if any(c.get("type") in own and c.get("status") == "True" for c in conditions):
                    lacking.discard(node["metadata"]["name"])
            if lacking:
                await asyncio.sleep(0.5)
        return None if lacking else round(time.monotonic() - start, 2)

    @property
    def fleet_size(self) -> int:
        return len(self.names) + len(self.idle) + len(self.warm)

    async def member_ids(self, proc: str) -> dict[str, str | None]:
        """group -> the broker's member id for this process's static membership (None: not a member)."""
        out: dict[str, str | None] = {}
        for g in self.groups(proc):
            member = (await describe_group(self.bootstrap, g)).member(proc)
            out[g] = member.member_id if member else None
        return out

    async def wait_members(
        self, procs: list[str], limit_s: float = 180, replaced: dict[str, str | None] | None = None
    ) -> None:
        """Until every group of these processes is Stable with each of them holding partitions.

        ``replaced``: group -> a member id that no longer counts (the process was restarted since).
        """
        deadline = time.monotonic() + limit_s
        wanted: dict[str, set[str]] = {}
        for p in (p for p, proc in self.procs.items() if not proc.lost):
            for g in self.groups(p):
                wanted.setdefault(g, set()).add(p)
        groups = {g for p in procs for g in self.groups(p)}
        while True:
            for p in procs:
                if not self.procs[p].alive():
                    raise RuntimeError(f"{p} exited: {self.procs[p].tail()}")
            views: list[GroupView] = []
            with contextlib.suppress(KafkaError):
                views = [await describe_group(self.bootstrap, g) for g in sorted(groups)]
            stale = set((replaced or {}).values())
            if views and all(v.state == "Stable" and self._holding(v, wanted[v.group], stale) for v in views):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"groups did not settle within {limit_s:.0f}s: {views}")
            await asyncio.sleep(0.2)

    async def wait_assigned(self, groups: list[str], limit_s: float = 300) -> None:
        """Until no member of these groups is a lost process (its session expired, the rebalance done)."""
        lost = {n for n, p in self.procs.items() if p.lost}
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            views: list[GroupView] = []
            with contextlib.suppress(KafkaError):
                views = [await describe_group(self.bootstrap, g) for g in groups]
            if views and all(v.state == "Stable" and not any(v.member(n) for n in lost) for v in views):
                return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"the lost member still holds partitions of {groups} after {limit_s:.0f}s")

    def _holding(self, view: GroupView, procs: set[str], stale: set[str | None]) -> bool:
        """Every running one of ``procs`` is a member of the group with partitions assigned."""
        members = [view.member(p) for p in procs if self.procs[p].alive()]
        return all(m is not None and m.partitions and m.member_id not in stale for m in members)

    async def warm_up(self, producer: Any) -> None:
        """One line per warm node through the whole path, so no join or first-call cost is timed."""
        rv = await self.resource_version()
        watch = NodeWatch(self.kube, self.selector, rv)
        watch.start()
        try:
            topic = self.topics.name("logs_kernel")
            for i, node in enumerate(self.warm):
                await producer.send_and_wait(topic, kmsg(FATAL_LINE, node, i), key=node.encode())
            deadline = time.monotonic() + 120
            while not all(n in watch.tainted for n in self.warm):
                if time.monotonic() > deadline:
                    raise RuntimeError("warm-up: the pipeline did not taint its warm-up nodes within 120 s")
                await asyncio.sleep(0.1)
        finally:
            watch.stop()

    async def resource_version(self) -> str:
        page = await self.kube._call(self.kube.core.list_node, label_selector=self.selector, limit=1)
        return page["metadata"]["resourceVersion"]

    async def teardown(self) -> None:
        for proc in self.procs.values():
            await proc.signal(signal.SIGTERM, 30)
        with contextlib.suppress(Exception):
            await delete_nodes(self.kube, [*self.names, *self.idle, *self.warm, *self.others])
        with contextlib.suppress(Exception):
            await self.kube._call(self.kube.core.delete_namespace, self.namespace)
        self.kube.close()


Disruption = Callable[[World], Awaitable[dict[str, Any]]]


async def run_scenario(
    bootstrap: str,
    kubeconfig: str,
    nodes: int,
    prefix: str,
    partitions: int = 8,
    workers: int = 1,
    disrupt: Disruption | None = None,
    pace_until_done: bool = False,
    progress: Callable[[str, float, float], None] = lambda t, d, n: None,
    baseline: bool = False,
    fleet: int = 0,
    before: Disruption | None = None,
    after: Disruption | None = None,
) -> dict[str, Any]:
    """Run one scenario; return its figures under ``<prefix>_*`` keys.

    ``disrupt`` runs right after the burst is handed to the producer (or, with ``pace_until_done``,
    while lines are paced out, one node at a time, until it returns). ``baseline``: afterwards, with the
    scenario's processes still up (idle), a bare client writes the same taints to N other nodes
    (``bare_client_baseline``). ``fleet``: GPU nodes in the world (at least ``nodes``; the others get no
    line). ``before`` runs at steady state after the warm-up, before the clock starts; ``after`` once
    every taint was seen; their figures are added.
    """
    world = World(bootstrap, kubeconfig, nodes, partitions, workers=workers, fleet=fleet, progress=progress)
    producer = kafka_clients.producer(bootstrap, acks=1, linger_ms=5)
    sent: dict[str, float] = {}
    extra: dict[str, Any] = {}
    watch: NodeWatch | None = None
    tail: IncidentTail | None = None
    try:
        progress(f"{prefix}: setup", 0, 1)
        await world.setup()
        await producer.start()
        await world.warm_up(producer)
        progress(f"{prefix}: setup", 1, 1)
        if before is not None:
            extra.update(await before(world))
        watch = NodeWatch(world.kube, world.selector, await world.resource_version())
        watch.start()
        tail = IncidentTail(world)
        await tail.start()
        await asyncio.sleep(0.3)  # the watch is established before the clock starts
        topic = world.topics.name("logs_kernel")
        cpu_before = cpu_seconds(world)
        if not pace_until_done:
            futures = []
            for i, node in enumerate(world.names):
                sent[node] = time.time()
                futures.append(await producer.send(topic, kmsg(FATAL_LINE, node, i), key=node.encode()))
            disruption = asyncio.ensure_future(disrupt(world)) if disrupt else None
            await asyncio.gather(*futures)
            if disruption is not None:
                extra.update(await disruption)
        else:
            assert disrupt is not None
            disruption = asyncio.ensure_future(disrupt(world))
            for i, node in enumerate(world.names):
                if disruption.done():
                    break
                sent[node] = time.time()
                await producer.send(topic, kmsg(FATAL_LINE, node, i), key=node.encode())
                await asyncio.sleep(PACE_S)
            extra.update(await disruption)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not all(n in watch.tainted for n in sent):
            world.check_alive()
            progress(prefix, sum(n in watch.tainted for n in sent), len(sent))
            await asyncio.sleep(0.2)
        progress(prefix, sum(n in watch.tainted for n in sent), len(sent))
        extra[f"{prefix}_cpu_s"] = cpu_spent(cpu_before, cpu_seconds(world))
        latencies = [(watch.tainted[n] - t) * 1000 for n, t in sent.items() if n in watch.tainted]
        stages = stage_split(
            prefix, sent, await incident_times(world), watch.tainted, await incident_times(world, "fault_events"),
            delivered=tail.seen,
        )
        if after is not None:
            extra.update(await after(world))
        out = {**summarize(prefix, latencies, len(sent)), **stages, **extra}
        if baseline:
            progress(f"{prefix}: bare client", 0, 1)
            # The actuators write Events and conditions after the taints: a baseline timed while they
            # still do would share the API server with them and flatter the ratio.
            out[f"{prefix}_settled_s"] = await world.wait_conditions(list(sent))
            out.update(await bare_client_baseline(world, prefix, out.get(f"{prefix}_p99_ms")))
            progress(f"{prefix}: bare client", 1, 1)
        return out
    finally:
        if watch is not None:
            watch.stop()
        if tail is not None:
            await tail.stop()
        await producer.stop()
        await world.teardown()


def cpu_seconds(world: World) -> dict[str, tuple[int, float]]:
    """Each running process of the world (and the bench itself) -> (pid, CPU seconds used so far)."""
    out = {"bench": (os.getpid(), sum(os.times()[:2]))}
    for name, proc in world.procs.items():
        if proc.alive() and proc.proc is not None:
            # The supervised child does the work; the supervisor itself only waits for it.
            with contextlib.suppress(OSError):
                pid = proc.work_pid()
                out[name] = (pid, procstat.read(pid).cpu_s)
    return out


def cpu_spent(before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]]) -> dict[str, float]:
    """CPU seconds each process used between two readings (a restarted one, another pid, is left out). Pure.

    On this 2-core machine the pipeline's own processes share the cores with the API server they wait
    for: what they use during a burst is time the API server does not get.
    """
    return {
        name: round(cpu - before[name][1], 2)
        for name, (pid, cpu) in after.items()
        if name in before and before[name][0] == pid
    }


async def bare_client_baseline(world: World, prefix: str, p99_ms: float | None) -> dict[str, Any]:
    """The API server's own time for the scenario's N taints, measured in the same run.

    A bare client (``pipeline.benchmarks.storm.raw_quarantine_rate``: per node the read and the
    conditional cordon + taint patch the actuator makes) quarantines N fresh nodes outside the
    actuators' selector, with the concurrency of all the scenario's actuators together, once the
    actuators are done with the burst (``World.wait_conditions``; ``<prefix>_settled_s``). Keys:
    ``<prefix>_raw_ms`` (its time for the N writes), ``<prefix>_raw_nodes_per_s`` and
    ``<prefix>_vs_raw_ratio`` = the scenario's p99 / ``<prefix>_raw_ms`` (1.0: the pipeline adds
    nothing to the API server's own time).
    """
    from pipeline.actuator.settings import ActuatorSettings
    from pipeline.benchmarks.storm import raw_quarantine_rate

    concurrency = ActuatorSettings().api_concurrency * world.actuators
    names = [f"b{world.tag}-raw-{i:05d}" for i in range(world.nodes)]
    await create_nodes(world.kube, names, {"xidflow.bench/burst-raw": world.tag})
    kube = Kube.from_config(world.kubeconfig, concurrency)
    cpu_before = cpu_seconds(world)
    try:
        rate = await raw_quarantine_rate(kube, names, TAINT_KEY, concurrency)
        cpu = cpu_spent(cpu_before, cpu_seconds(world))
    finally:
        kube.close()
        with contextlib.suppress(Exception):
            await delete_nodes(world.kube, names)
    raw_ms = world.nodes / rate * 1000
    out: dict[str, Any] = {
        f"{prefix}_raw_ms": round(raw_ms, 1),
        f"{prefix}_raw_nodes_per_s": round(rate, 1),
        f"{prefix}_raw_concurrency": concurrency,
        f"{prefix}_raw_cpu_s": cpu,
    }
    if p99_ms is not None:
        out[f"{prefix}_vs_raw_ratio"] = round(p99_ms / raw_ms, 3)
    return out


async def incident_times(world: World, name: str = "incidents", limit_s: float = 30) -> dict[str, float]:
    """node -> when the worker produced the node's first record on topic ``name`` (its timestamp, seconds).

    ``incidents``: the aggregation's output; ``fault_events``: the parse stage's.
    """
    from aiokafka import TopicPartition

    topic = world.topics.name(name)
    consumer = kafka_clients.consumer(
        bootstrap=world.bootstrap, auto_offset_reset="earliest", enable_auto_commit=False, group_id=None
    )
    await consumer.start()
    first: dict[str, float] = {}
    try:
        tps = [TopicPartition(topic, p) for p in range(world.partitions)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and any([await consumer.position(tp) < end for tp, end in ends.items()]):
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for rec in records:
                    node = rec.key.decode() if rec.key else ""
                    first.setdefault(node, rec.timestamp / 1000)
    finally:
        await consumer.stop()
    return first


def stage_split(
    prefix: str,
    sent: dict[str, float],
    incident: dict[str, float],
    tainted: dict[str, float],
    fault: dict[str, float] | None = None,
    delivered: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Where the time went: line -> incident produced (worker), incident -> taint seen (actuator + API).

    With ``fault`` (node -> its fault event's timestamp) the worker's share is split too: line -> fault
    event produced (``parse``), fault event -> incident produced (``aggregate``). With ``delivered``
    (node -> when a consumer could first read its incident): line -> incident readable (``delivery``;
    the worker's share as a consumer sees it) and incident readable -> taint seen (``apply``; the
    actuators' and the API server's share).
    """
    fault, delivered = fault or {}, delivered or {}
    worker = sorted((incident[n] - t) * 1000 for n, t in sent.items() if n in incident)
    actuator = sorted((tainted[n] - incident[n]) * 1000 for n in sent if n in incident and n in tainted)
    parse = sorted((fault[n] - t) * 1000 for n, t in sent.items() if n in fault)
    aggregate = sorted((incident[n] - fault[n]) * 1000 for n in sent if n in fault and n in incident)
    out: dict[str, Any] = {}
    delivery = sorted((delivered[n] - t) * 1000 for n, t in sent.items() if n in delivered)
    apply = sorted((tainted[n] - delivered[n]) * 1000 for n in sent if n in delivered and n in tainted)
    stages = (("worker", worker), ("actuator", actuator), ("parse", parse), ("aggregate", aggregate),
              ("delivery", delivery), ("apply", apply))
    for name, values in stages:
        if values:
            out[f"{prefix}_{name}_p50_ms"] = round(percentile(values, 0.50), 1)
            out[f"{prefix}_{name}_p99_ms"] = round(percentile(values, 0.99), 1)
    return out


async def kill_and_restart(world: World, proc: str, delay_s: float = 0.1, child: bool = True) -> dict[str, Any]:
    """SIGKILL one replica mid-burst; seconds until it is back in its groups with the same identity.

    ``child``: kill the process that does the work (the supervisor forks its replacement); else the
    whole ``xidflow`` process, started again at once (a container restart).
    """
    await asyncio.sleep(delay_s)
    p = world.procs[proc]
    before = await world.member_ids(proc)
    victim = p.work_pid() if child else None
    start = time.monotonic()
    if victim is not None and p.proc is not None and victim != p.proc.pid:
        os.kill(victim, signal.SIGKILL)
    else:
        await p.signal(signal.SIGKILL)
        await p.start()
    await world.wait_members([proc], replaced=before)
    return {"restart_s": round(time.monotonic() - start, 2)}


async def lose(world: World, proc: str, delay_s: float = 0.1) -> dict[str, Any]:
    """SIGKILL one replica mid-burst for good (its supervised child dies with it); the survivors take over.

    ``takeover_s``: kill to every group Stable with the survivors holding the partitions; with
    ``session_timeout_s`` (the broker expires the dead member only after it) it bounds the figure.
    """
    from pipeline.runtime.settings import ConsumerGroupSettings

    await asyncio.sleep(delay_s)
    p = world.procs[proc]
    start = time.monotonic()
    p.lost = True
    await p.signal(signal.SIGKILL)
    survivors = [n for n, q in world.procs.items() if not q.lost and set(world.groups(n)) & set(world.groups(proc))]
    await world.wait_members(survivors, limit_s=300)
    await world.wait_assigned(world.groups(proc))
    return {"takeover_s": round(time.monotonic() - start, 2),
            "session_timeout_s": ConsumerGroupSettings().session_timeout_s}


async def rolling_restart(world: World) -> dict[str, Any]:
    """SIGTERM and restart each process in turn, each back in its groups before the next."""
    await asyncio.sleep(1.0)
    took: dict[str, dict[str, float]] = {}
    for name, proc in world.procs.items():
        before = await world.member_ids(name)
        start = time.monotonic()
        await proc.signal(signal.SIGTERM)
        stopped = time.monotonic()
        await proc.start()
        await world.wait_members(list(world.procs), replaced=before)
        # Profile: how long the orderly stop took, and the new process until every group is settled.
        took[name] = {"stop_s": round(stopped - start, 2), "back_s": round(time.monotonic() - stopped, 2)}
    await asyncio.sleep(1.0)
    return {"rolling_restart_s": took}


async def burst(bootstrap: str, kubeconfig: str, nodes: int, progress: Any = None) -> dict[str, Any]:
    kw = {"progress": progress} if progress else {}
    return await run_scenario(bootstrap, kubeconfig, nodes, "burst", baseline=True, **kw)


async def failover(bootstrap: str, kubeconfig: str, nodes: int, progress: Any = None) -> dict[str, Any]:
    kw = {"progress": progress} if progress else {}

    def scenario(prefix: str, disruption: Callable[[World], Awaitable[dict[str, Any]]]) -> Disruption:
        async def run(world: World) -> dict[str, Any]:
            return {f"{prefix}_{k}": v for k, v in (await disruption(world)).items()}

        return run

    out: dict[str, Any] = {}
    runs: list[tuple[str, Disruption, int]] = [
        ("failover_actuator", scenario("failover_actuator", lambda w: kill_and_restart(w, "actuator-1")), 1),
        ("failover_worker", scenario("failover_worker", lambda w: kill_and_restart(w, "worker-0")), 1),
        ("failover_actuator_process", scenario(
            "failover_actuator_process", lambda w: kill_and_restart(w, "actuator-1", child=False)), 1),
        ("failover_worker_process", scenario(
            "failover_worker_process", lambda w: kill_and_restart(w, "worker-0", child=False)), 1),
        ("failover_lost_actuator", scenario("failover_lost_actuator", lambda w: lose(w, "actuator-1")), 1),
        # Two workers: someone must be there to take the lost one's partitions.
        ("failover_lost_worker", scenario("failover_lost_worker", lambda w: lose(w, "worker-1")), 2),
    ]
    for prefix, disrupt, workers in runs:
        out.update(await run_scenario(bootstrap, kubeconfig, nodes, prefix, workers=workers, disrupt=disrupt, **kw))
    return out


async def rolling(bootstrap: str, kubeconfig: str, nodes: int, progress: Any = None) -> dict[str, Any]:
    kw = {"progress": progress} if progress else {}
    return await run_scenario(
        bootstrap, kubeconfig, nodes, "rolling", workers=2, disrupt=rolling_restart, pace_until_done=True, **kw
    )
