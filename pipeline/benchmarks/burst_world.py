"""The world a burst scenario runs in: a topic prefix, fake GPU nodes, real worker and actuator processes.

``World`` creates the topics and nodes, starts ``xidflow worker`` and ``xidflow actuator`` processes
(``Proc``: one process, supervised or not, with its logs), waits for them to be in their groups and
tears everything down; ``IncidentTail`` reads its incidents as they become readable. The scenarios
that disturb it live in ``pipeline.benchmarks.burst``; what they watch in
``pipeline.benchmarks.burst_watch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka.errors import KafkaError

from pipeline.actuator.kube import Kube
from pipeline.actuator.testing import create_nodes, delete_nodes
from pipeline.benchmarks import procstat
from pipeline.benchmarks.burst_watch import FATAL_LINE, TAINT_KEY, ConditionWatch, NodeWatch, condition_types, kmsg
from pipeline.benchmarks.cost import NAMES
from pipeline.benchmarks.procstat import ProcSample
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka import upstream
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.fetch_watchdog import IDLE_FETCH_MAX_WAIT_MS
from pipeline.kafka.membership import GroupView, describe_group
from pipeline.runtime.settings import TopicNames

SUBJECT_PYTHON_ENV = "XIDFLOW_BENCH_PYTHON"
"""The Python interpreter that runs the measured ``xidflow worker`` and ``xidflow actuator`` processes (default:
the bench's own). Another checkout's virtual environment measures that checkout's pipeline with this bench's
scenarios, windows and keys, on the same machine in the same sitting (an older commit against this one)."""


def subject_python() -> str:
    return os.environ.get(SUBJECT_PYTHON_ENV) or sys.executable


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
            # From the log's folder, not the bench's: ``-m`` puts the working directory first on the path, and
            # the code measured is the interpreter's own checkout (``subject_python``).
            self.proc = await asyncio.create_subprocess_exec(
                subject_python(), "-m", "pipeline.cli", *self.args, env=self.env, stdout=out, stderr=out,
                cwd=self.log.parent,
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
        self.infra: dict[str, int] = {}
        """The local infrastructure's processes (``infra_pids``: API server, etcd, Kafka), name -> pid."""
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
        from pipeline.actuator.app import actuator_topics
        from pipeline.app import worker_topics

        await ensure_topics(self.bootstrap, worker_topics(self.app_id, self.topics), self.partitions)
        await ensure_topics(self.bootstrap, actuator_topics(self.topics), self.partitions)
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
        self.infra = infra_pids(self.kubeconfig)
        # The supervised child's figures (``Proc.work_pid``): the supervisor itself only waits.
        self.steady = {n: procstat.read(p.work_pid()) for n, p in self.procs.items()
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
        lacking = {n["metadata"]["name"] for n in page.get("items") or [] if not wanted <= condition_types(n)}
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
        await self.kube.aclose()


def infra_pids(kubeconfig: str) -> dict[str, int]:
    """The control plane (API server, etcd, controller-manager, scheduler, KWOK) and the Kafka broker (``kafka``)
    of a bench run's local infrastructure (name -> pid).

    Found by the run's directory in their command lines (the kubeconfig lies in it); an API server
    started elsewhere gives nothing, and the figures then lack them."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(kubeconfig)))
    out: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if root.encode() in b" ".join(argv):
                name = os.path.basename(argv[0].decode(errors="replace"))
                out.setdefault(NAMES.get(name, name), int(entry))
    return out


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
        # Idle (nothing buffered), one long poll of every partition instead of 20 short ones a second: each
        # short poll that expires empty costs the broker CPU (about 70-100 ms a second for this tail alone on
        # the 2-core machine), and the tail runs through both cost windows. The first record still ends it.
        upstream.long_poll_when_idle(consumer, IDLE_FETCH_MAX_WAIT_MS)
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


PROFILE_ENV = "XIDFLOW_BENCH_PROFILE_DIR"
"""When set (and ``py-spy`` is on PATH): the burst's processes are sampled by ``py-spy record`` (raw collapsed
stacks, ``<dir>/<label>-<process>.txt``): the burst's worker and actuators over its cost window, the scale
section's actuators from each burst's start until its last taint."""


def profile(world: World, label: str, actuators_only: bool = False) -> list[subprocess.Popen[bytes]]:
    """``py-spy record`` on each working process of the world (``PROFILE_ENV``); nothing when not asked for."""
    where, spy = os.environ.get(PROFILE_ENV), shutil.which("py-spy")
    if not where or not spy:
        return []
    os.makedirs(where, exist_ok=True)
    pids = {n: p.work_pid() for n, p in world.procs.items()
            if p.proc is not None and p.alive() and (n.startswith("actuator") or not actuators_only)}
    return [subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", "100", "--format", "raw", "--nonblocking",
                              "--output", os.path.join(where, f"{label}-{name}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pid in pids.items()]


async def stop_profile(spies: list[subprocess.Popen[bytes]]) -> None:
    for spy in spies:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for spy in spies:
        await asyncio.to_thread(spy.wait, 30)
