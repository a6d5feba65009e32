"""Runs the demo: a fleet, a worker, actuator replicas, the scripted scenario, a live view, a verdict.

Everything is real: every node runs a real Fluent Bit on the shipped configuration (one process per
node, like the DaemonSet; see :mod:`pipeline.demo.shipping`) that tails the node's kernel log and
container logs into Kafka, its kubernetes filter asking the API server with a ServiceAccount token;
one node's kernel lines go through a real Loki and ``xidflow loki-tail`` instead (the path of
Konduktor's Loki-based controller). The worker parses and aggregates them, the actuators act on a real
control plane: the fleet (:mod:`pipeline.demo.fleet`) is KWOK's nodes running a StatefulSet and a
Deployment with PDBs, so the scheduler places the pods, KWOK runs them, the disruption controller keeps
the budgets, and after xidflow's drains the StatefulSet and ReplicaSet controllers re-create the evicted
pods and the scheduler places them; the demo watches where they go (:mod:`pipeline.demo.observed`).
The demo only plays what the machines do: their kernels and container runtimes (they write the log
files, a container's log appears when its pod runs on the node), the node's reboot daemon (it answers
the actuator's reboot-request annotation: ``machines.reboot``, a new boot id) and the node probe (its
health-check records go to Kafka directly, as the probe's own producer sends them).

One module (about 560 lines): the demo is one script from start to verdict; its parts (the fleet, what
Kubernetes did, the shippers, the scenario, the view) live in their own modules beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from kubernetes import client, watch
from kubernetes.client.rest import ApiException
from rich.console import Console
from rich.live import Live

from pipeline.actuator.kube import Kube
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import LAST_ACTION_ANNOTATION, LEDGER_ANNOTATION, REBOOT_REQUEST_ANNOTATION
from pipeline.demo import view
from pipeline.demo.fleet import STANDBY_LABEL, Fleet, pods_by_node
from pipeline.demo.observed import HEALTHY, Budgets, PodMoves
from pipeline.demo.scenario import LOKI_NODE_INDEX, REBOOT_NODE_INDEXES, STEPS, Emit, Step
from pipeline.demo.shipping import (
    FLUENT_BIT_VERSION,
    FluentBitAccess,
    NodeShipper,
    fresh_folder,
    rdkafka_credentials,
    start_all,
    stop_all,
)
from pipeline.ingest.probe import read_boot_id
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from pipeline.localinfra.fluentbit_run import Render
from pipeline.localinfra.loki import DEFAULT_TENANT, LokiServer, push_lines
from pipeline.runtime.settings import TopicNames
from schemas.records import HealthCheckResult, RemediationRecord

POLICY_FILE = Path(__file__).with_name("policies.yaml")
HEALTH_CHECKS = ("driver", "gpu_count", "nvlink", "ecc", "remapped_rows")


@dataclass
class Verdict:
    step: str
    node: str
    expected: str
    observed: str
    ok: bool
    why: str = ""


@dataclass
class DemoRun:
    bootstrap: str
    kubeconfig: str
    console: Console
    workdir: Path
    nodes: int = 8
    actuators: int = 2
    settle_seconds: float = 4.0
    step_timeout: float = 90.0
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    audit: deque = field(default_factory=lambda: deque(maxlen=14))
    audit_count: int = 0
    verdicts: list[Verdict] = field(default_factory=list)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    phase: str = "starting"
    loki_url: str | None = None  # LOKI_URL, else a local Loki started in workdir
    loki_org_id: str | None = None
    loki_server: LokiServer | None = None
    loki_lines: int = 0
    details: bool = False  # after the run, the fleet and the audit trail with every column (-o wide)
    last_states: dict[str, dict[str, Any]] = field(default_factory=dict)
    shippers: dict[str, NodeShipper] = field(default_factory=dict)  # node -> its Fluent Bit
    fluent_bit_access: FluentBitAccess | None = None
    rebooted: set[str] = field(default_factory=set)
    shipped: dict[str, int] = field(default_factory=lambda: {"kernel": 0, "pod": 0, "pod_with_metadata": 0})
    moves: PodMoves = field(default_factory=PodMoves)  # the pods Kubernetes moved
    budgets: Budgets = field(default_factory=Budgets)  # every PDB status the disruption controller wrote
    pods: list[dict[str, Any]] = field(default_factory=list)  # the workloads' pods at the last look
    evicted: list[tuple[str, str]] = field(default_factory=list)  # (node, pod) xidflow's drains evicted (audit)
    answering: list[str] = field(default_factory=list)  # nodes whose Fluent Bit answers its health endpoint

    def __post_init__(self) -> None:
        self.kube = Kube.from_config(self.kubeconfig, 8)
        self.api = self.kube.api_client
        self.topics = TopicNames(prefix=f"demo-{self.run_id}.")
        # The nodes run on this machine: they first boot on its boot id, which Fluent Bit's Lua filter stamps.
        self.fleet = Fleet(self.kube, self.run_id, first_boot_id=read_boot_id())
        self.namespace = f"xidflow-demo-{self.run_id}"
        self.workdir.mkdir(parents=True, exist_ok=True)

    # -- processes ----------------------------------------------------------------------------
    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "KAFKA_BOOTSTRAP_SERVERS": self.bootstrap,
            "KUBECONFIG": self.kubeconfig,
            "XIDFLOW_TOPIC_PREFIX": self.topics.prefix,
            "XIDFLOW_METRICS_PORT": "0",
            "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": self.fleet.selector,
            "XIDFLOW_ACTUATOR_GROUP_ID": f"xidflow-actuator-demo-{self.run_id}",
            "XIDFLOW_ACTUATOR_NAMESPACE": self.namespace,
            "XIDFLOW_ACTUATOR_POLICY_SOURCE": "file",
            "XIDFLOW_ACTUATOR_POLICY_FILE": str(POLICY_FILE),
            "XIDFLOW_ACTUATOR_STANDBY_LABEL": STANDBY_LABEL,
        })
        return env

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", *args], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=self._env(), start_new_session=True,
        )

    @property
    def loki_node(self) -> str:
        return self.fleet.nodes[LOKI_NODE_INDEX - 1]

    def start_loki(self) -> None:
        """Loki (the environment's, else a local single binary) and the bridge that tails it into Kafka."""
        self.loki_url = self.loki_url or os.environ.get("LOKI_URL")
        if self.loki_url:
            self.loki_org_id = self.loki_org_id or os.environ.get("LOKI_ORG_ID")
        else:
            self.loki_server = LokiServer(self.workdir / "loki", log=lambda m: self.console.print(f"[dim]loki:[/] {m}"))
            self.loki_server.start()
            self.loki_url, self.loki_org_id = self.loki_server.url, DEFAULT_TENANT
        args = ["loki-tail", "--loki-url", self.loki_url, "--query", f'{{job="kmsg", demo="{self.run_id}"}}',
                "--topic", self.topics.name("logs_kernel"), "--bootstrap", self.bootstrap,
                "--start-ns", str(time.time_ns() - 10**9)]
        if self.loki_org_id:
            args += ["--org-id", self.loki_org_id]
        self._spawn("loki-tail", *args)

    def start_fluent_bits(self) -> None:
        """One Fluent Bit per node on the shipped configuration, its kubernetes filter with a real token."""
        folder = fresh_folder(self.workdir / "fluent-bit")
        log = lambda m: self.console.print(f"[dim]fluent-bit:[/] {m}")  # noqa: E731
        self.fluent_bit_access = FluentBitAccess(self.api, self.namespace, f"xidflow-demo-{self.run_id}",
                                                 folder / "access", log=log)
        kube = self.fluent_bit_access.create()
        rdkafka = rdkafka_credentials()
        for node in self.fleet.nodes + self.fleet.standby:
            render = Render(root=folder / node, kernel_source="file-kmsg", kernel_topic=self.topics.name("logs_kernel"),
                            pods_topic=self.topics.name("logs_pods"), kube=kube, rdkafka=rdkafka)
            self.shippers[node] = NodeShipper(folder / node, node, self.bootstrap, render, log=log)
        self.container_logs()
        start_all(self.shippers.values(), started=lambda s: self.answering.append(s.node))

    def container_logs(self) -> None:
        """The container runtime's part: a running pod's container log appears on its node (empty until it logs)."""
        for pod in self.pods:
            node, meta = (pod.get("spec") or {}).get("nodeName"), pod["metadata"]
            shipper = self.shippers.get(node or "")
            if shipper is not None and (meta["namespace"], meta["name"]) not in shipper.container_files:
                shipper.add_container_logs(meta["namespace"], [meta["name"]], f"{self.run_id}/{meta['uid']}")

    def start_processes(self) -> None:
        # The Fluent Bits come up while Loki, the worker and the actuators start (each waits for its health).
        with ThreadPoolExecutor(max_workers=1) as pool:
            fluent_bits = pool.submit(self.start_fluent_bits)
            self.start_loki()
            self._spawn("worker", "worker", "--bootstrap", self.bootstrap, "--app-id", f"xidflow-demo-{self.run_id}",
                        "--partitions", "4", "--loglevel", "warning")
            for i in range(1, self.actuators + 1):
                self._spawn(f"actuator-{i}", "actuator", "--kubeconfig", self.kubeconfig)
            fluent_bits.result()

    def processes_started(self) -> str:
        """How far ``start_processes`` is."""
        loki = "Loki ready" if self.loki_url else "Loki starting"
        return f"{len(self.answering)}/{len(self.fleet.nodes + self.fleet.standby)} Fluent Bits answering, {loki}"

    def check_processes(self) -> None:
        for node, shipper in self.shippers.items():
            if not shipper.fluent_bit.alive():
                proc = shipper.fluent_bit.proc
                raise RuntimeError(f"Fluent Bit of {node} exited with {proc.returncode if proc else None} "
                                   f"(log: {shipper.fluent_bit.log_file}):\n{shipper.fluent_bit.log_tail(30)}")
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                if name == "loki-tail":
                    tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-2500:]
                    raise RuntimeError(f"the Loki bridge (xidflow loki-tail) exited with {proc.returncode}:\n{tail}")
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-2500:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def stop_processes(self) -> None:
        # The Fluent Bits stop (each flushes what it read; a few seconds) while the other processes do.
        with ThreadPoolExecutor(max_workers=1) as pool:
            fluent_bits = pool.submit(stop_all, list(self.shippers.values()))
            for proc in self.procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 15)
            for proc in self.procs.values():
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, 9)
            fluent_bits.result()

    # -- Kafka ----------------------------------------------------------------------------------
    async def create_topics(self) -> None:
        names = ["logs_kernel", "logs_pods", "health_checks", "deadletter", "fault_events", "incidents",
                 "remediation_audit", "remediation_requests"]
        await ensure_topics(self.bootstrap, [self.topics.name(n) for n in names], partitions=4)

    async def follow_audit(self) -> None:
        consumer = kafka_clients.consumer(self.topics.name("remediation_audit"), bootstrap=self.bootstrap,
                                    auto_offset_reset="earliest")
        await consumer.start()
        try:
            async for msg in consumer:
                with contextlib.suppress(Exception):
                    rec = RemediationRecord.from_bytes(msg.value)
                    self.audit.append(rec)
                    self.audit_count += 1
                    if rec.action == "drain":  # the pods it evicted through the Eviction API: "<namespace>/<pod>"
                        self.evicted += [(rec.node, p.split("/", 1)[-1]) for p in rec.details.get("evicted") or []]
        finally:
            await consumer.stop()

    async def follow_shipped(self) -> None:
        """What the Fluent Bits delivered: kernel records, and pod records with the API server's metadata."""
        consumer = kafka_clients.consumer(self.topics.name("logs_kernel"), self.topics.name("logs_pods"),
                                          bootstrap=self.bootstrap, auto_offset_reset="earliest")
        await consumer.start()
        pods_topic = self.topics.name("logs_pods")
        try:
            async for msg in consumer:
                with contextlib.suppress(Exception):
                    rec = orjson.loads(msg.value)
                    if msg.topic != pods_topic:
                        self.shipped["kernel"] += "sequence" in rec and "boot_id" in rec
                        continue
                    self.shipped["pod"] += 1
                    kube = rec.get("kubernetes") or {}
                    # host and pod_id come only from the pod object on the API server, never from the file name.
                    resolved = bool(kube.get("pod_id")) and kube.get("host") == rec.get("node")
                    self.shipped["pod_with_metadata"] += resolved
        finally:
            await consumer.stop()

    async def push_to_loki(self, node: str, e: Emit) -> None:
        """The Konduktor path: the node's kernel lines are pushed to Loki; loki-tail brings them to Kafka."""
        base = time.time_ns()
        lines = [line for _ in range(e.repeat) for line in e.lines]
        values = [(base + i, line) for i, line in enumerate(lines)]
        labels = {"job": "kmsg", "demo": self.run_id, "node": node, "source": "kernel"}
        await asyncio.to_thread(push_lines, self.loki_url, labels, values, tenant=self.loki_org_id)
        self.loki_lines += len(values)

    def emit(self, e: Emit) -> NodeShipper | None:
        """Write one emit's lines where the node's shipper reads them; returns that Fluent Bit (None: Loki)."""
        node = self.fleet.nodes[e.node_index - 1]
        lines = [line for _ in range(e.repeat) for line in e.lines]
        shipper = self.shippers[node]
        if e.source == "kernel":
            if node in self.rebooted:
                # Its Fluent Bit would stamp the boot id of this machine, not the node's new one.
                raise RuntimeError(f"the scenario logs kernel lines on {node} after its simulated reboot")
            shipper.write_kernel(lines)
            return shipper
        pods = pods_by_node(self.pods, [node])[node]  # the pods running there now, oldest first
        if not pods:
            raise RuntimeError(f"the scenario logs pod lines on {node}, where no pod of the workloads runs")
        shipper.write_pod(self.fleet.namespace, pods[e.pod_index % len(pods)], lines)
        return shipper

    async def wait_shipped(self, shippers: set[NodeShipper]) -> None:
        """Until Kafka acknowledged every line written to these nodes (Fluent Bit's output counters)."""
        deadline = time.monotonic() + self.step_timeout
        pending = set(shippers)
        while pending:
            self.check_processes()
            for shipper in list(pending):
                with contextlib.suppress(OSError, ValueError):
                    if await asyncio.to_thread(shipper.fluent_bit.output_records) >= shipper.written:
                        pending.discard(shipper)
            if pending and time.monotonic() > deadline:
                first = next(iter(pending))
                raise RuntimeError(f"Fluent Bit of {', '.join(sorted(p.node for p in pending))} did not deliver its "
                                   f"lines within {self.step_timeout:.0f}s:\n{first.fluent_bit.log_tail(30)}")
            if pending:
                await asyncio.sleep(0.2)

    async def send_health(self, producer: AIOKafkaProducer, node: str, boot_id: str) -> None:
        for check in HEALTH_CHECKS:
            rec = HealthCheckResult(node=node, check=check, passed=True, message="ok", boot_id=boot_id)
            await producer.send_and_wait(self.topics.name("health_checks"), rec.to_bytes(), key=node.encode())

    # -- cluster view -----------------------------------------------------------------------------
    async def node_states(self) -> dict[str, dict[str, Any]]:
        """One look at the cluster: the fleet's nodes and the workloads' pods (what moved since the last look)."""
        nodes, self.pods = await asyncio.gather(self.kube.list_nodes(self.fleet.selector), self.fleet.pods())
        out: dict[str, dict[str, Any]] = {}
        for n in nodes:
            nv = NodeView.from_object(n)
            ann = nv.annotations
            taints = [f"{t.get('key')}={t.get('value') or ''}:{t.get('effect')}" for t in nv.taints
                      if not str(t.get("key", "")).startswith("node.kubernetes.io/")]
            out[nv.name] = {
                "unschedulable": nv.unschedulable,
                "state": view.node_state(nv, STANDBY_LABEL),
                "taints": taints,
                "last": ann.get(LAST_ACTION_ANNOTATION, ""),
                "owned": LEDGER_ANNOTATION in ann,
                "reboot": REBOOT_REQUEST_ANNOTATION in ann,
                "object": n,  # what the screen shows (pipeline.demo.view)
            }
        self.moves.observe(self.pods, {name: s["state"] for name, s in out.items()}, time.time())
        self.container_logs()
        return out

    def snapshot(self, states: dict[str, dict[str, Any]]) -> view.Snapshot:
        names = self.fleet.nodes + self.fleet.standby
        via = {name: self.lines_via(name) for name in names}
        return view.Snapshot(
            title=f"GPU fleet, demo {self.run_id}: {self.phase}",
            nodes=[s["object"] for s in states.values() if "object" in s], standby_label=STANDBY_LABEL,
            order=names, kernel_paths=via, pods=pods_by_node(self.pods, names), moves=list(self.moves.moves),
            audit=list(self.audit), audit_count=self.audit_count, audit_topic=self.topics.name("remediation_audit"))

    def render(self, states: dict[str, dict[str, Any]]) -> view.Lines:
        self.last_states = states
        return view.live_view(self.snapshot(states))

    def lines_via(self, name: str) -> str:
        shipper = self.shippers.get(name)
        via = f"Fluent Bit (pid {shipper.pid}) -> Kafka" if shipper else "-"
        return f"kernel: Loki -> loki-tail -> Kafka; pods: {via}" if name == self.loki_node else via

    # -- the scenario -----------------------------------------------------------------------------
    async def wait_for(self, live: Live, cond, within: float) -> tuple[bool, dict]:  # noqa: ANN001
        deadline = time.monotonic() + within
        states: dict = {}
        while time.monotonic() < deadline:
            self.check_processes()
            states = await self.node_states()
            live.update(self.render(states))
            if cond(states):
                return True, states
            await asyncio.sleep(0.5)
        return False, states

    async def run_step(self, live: Live, step: Step) -> None:
        self.phase = step.title
        written: set[NodeShipper] = set()
        for e in step.emits:
            if e.source == "kernel" and e.node_index == LOKI_NODE_INDEX:
                await self.push_to_loki(self.fleet.nodes[e.node_index - 1], e)
            else:
                written.add(await asyncio.to_thread(self.emit, e))
        await self.wait_shipped(written)
        quarantine = {self.fleet.nodes[i - 1] for i, exp in step.expect.items() if exp == "quarantined"}
        standby = self.fleet.standby if step.standby_in_service else []

        def done(s: dict) -> bool:
            return all(s.get(n, {}).get("unschedulable") for n in quarantine) and not any(
                s.get(n, {}).get("unschedulable", True) for n in standby)

        await self.wait_for(live, done, self.step_timeout)
        # Nodes that must stay in service: keep watching a few seconds after the others acted.
        _, states = await self.wait_for(live, lambda s: False, self.settle_seconds)
        for idx, exp in step.expect.items():
            node = self.fleet.nodes[idx - 1]
            s = states.get(node, {})
            observed = "quarantined" if s.get("unschedulable") else "schedulable"
            self.verdicts.append(Verdict(step.title, node, exp, observed, observed == exp, step.why))
        for node in standby:
            up = not states.get(node, {}).get("unschedulable", True)
            self.verdicts.append(Verdict(step.title, node, "standby in service", "in service" if up else "cordoned",
                                         up, "the warm-standby policy brings a matching standby node into service"))

    async def reboot_and_recover(self, live: Live, producer: AIOKafkaProducer) -> None:
        """Each node's reboot daemon answers its reboot request (every one: the reboot step of the other node's
        flow times out otherwise); then each must pass its diagnostics and come back into service."""
        nodes = [self.fleet.nodes[i - 1] for i in REBOOT_NODE_INDEXES]
        asked: dict[str, bool] = {}
        for node in nodes:
            self.phase = f"reboot of {node}"
            asked[node], _ = await self.wait_for(live, lambda s, n=node: s.get(n, {}).get("reboot"), self.step_timeout)
            # The node's reboot daemon: the machine reboots (a new boot id; KWOK reports the node Ready again) and
            # its probe reports passing checks.
            boot_id = await self.fleet.reboot(node)
            self.rebooted.add(node)
            await self.send_health(producer, node, boot_id)
        for node in nodes:
            self.phase = f"recovery of {node}"
            ok, _ = await self.wait_for(live, lambda s, n=node: not s.get(n, {}).get("unschedulable")
                                        and not s.get(n, {}).get("taints"), self.step_timeout)
            self.verdicts.append(Verdict(
                "Reboot and recovery", node, "recovered", "recovered" if ok else "still quarantined", ok,
                "drained, reboot requested through the annotation hook" + ("" if asked[node] else " (request not seen)")
                + ", new boot id with passing checks, the diagnostics Job passed, then xidflow removed only what it"
                " applied"))

    @contextlib.asynccontextmanager
    async def timed(self, label: str, doing: str, how_far: Callable[[], str] | None = None,
                    every: float = 5.0) -> AsyncIterator[None]:
        """A set-up step: what it does, then every ``every`` seconds how far it is (``how_far``), then how long
        it took. The step runs on the loop or on a thread (``asyncio.to_thread``): the loop says how far."""
        self.console.print(f"{label}: {doing} ...")
        started = time.monotonic()

        async def tick() -> None:
            while True:
                await asyncio.sleep(every)
                far = how_far() if how_far is not None else "still at it"
                self.console.print(f"{label}: {far} ({time.monotonic() - started:.0f}s)")

        ticker = asyncio.create_task(tick())
        try:
            yield
        finally:
            ticker.cancel()
        self.console.print(f"{label}: done in {time.monotonic() - started:.1f}s")

    async def create_fleet(self) -> None:
        """The fleet as a user makes one: KWOK's nodes, then the workloads and PDBs (see pipeline.demo.fleet)."""
        async with self.timed("fleet", f"registering {self.nodes} GPU nodes and 1 standby; KWOK makes them Ready"):
            await self.fleet.create_nodes(self.nodes, 1)
        doing = (f"{', '.join(f'{w.kind} {w.name} ({w.what})' for w in self.fleet.workloads)}, {self.nodes} pods "
                 "each with a PDB; the scheduler places them, KWOK runs them")
        seen = ["nothing yet"]
        async with self.timed("workloads", doing, lambda: seen[0]):
            await self.fleet.create_workloads(progress=lambda far: seen.__setitem__(0, far))
        await self.node_states()  # the first look: where the scheduler put every pod
        placed = pods_by_node(self.pods, self.fleet.nodes + self.fleet.standby)
        self.console.print("fleet: " + ", ".join(f"{node} runs {' '.join(pods) or 'nothing'}"
                                                 for node, pods in placed.items()))

    async def run(self) -> bool:
        con = self.console
        con.print(f"[bold]xidflow demo[/] run [cyan]{self.run_id}[/]: Kafka {self.bootstrap}, "
                  f"kubeconfig {self.kubeconfig}")
        await self.create_topics()
        await self.kube._call(self.kube.core.create_namespace, {"metadata": {"name": self.namespace}})
        await self.create_fleet()
        stop_watching = threading.Event()
        budgets = threading.Thread(target=self.watch_budgets, args=(stop_watching,), name="demo-pdb-watch", daemon=True)
        budgets.start()
        doing = (f"starting {self.nodes + 1} Fluent Bit {FLUENT_BIT_VERSION} processes, Loki and its bridge, 1 worker "
                 f"and {self.actuators} actuator replicas")
        async with self.timed("processes", doing, self.processes_started):
            await asyncio.to_thread(self.start_processes)
        con.print(f"started {len(self.shippers)} Fluent Bit {FLUENT_BIT_VERSION} processes (one per node, "
                  f"deploy/fluent-bit/fluent-bit.yaml), 1 worker and {self.actuators} actuator replicas "
                  f"(logs in {self.workdir})")
        con.print("Fluent Bit path: each node's kernel lines (/dev/kmsg record format) and pod lines (CRI container "
                  "logs) are tailed by the node's Fluent Bit, pod lines resolved by its kubernetes filter "
                  "(ServiceAccount token), and travel Fluent Bit -> Kafka")
        con.print(f"Konduktor path: kernel lines of [bold]{self.loki_node}[/] are pushed to Loki ({self.loki_url}, "
                  f"tenant {self.loki_org_id or '-'}) and travel Loki -> xidflow loki-tail -> Kafka")
        audit_task = asyncio.create_task(self.follow_audit())
        shipped_task = asyncio.create_task(self.follow_shipped())
        producer = kafka_clients.producer(bootstrap=self.bootstrap, acks="all", linger_ms=5)
        await producer.start()
        try:
            # The probe DaemonSet reports every node healthy on its current boot before anything breaks.
            for node in self.fleet.nodes:
                await self.send_health(producer, node, self.fleet.boot_ids[node])
            with Live(self.render({}), console=con, refresh_per_second=4, transient=False) as live:
                for step in STEPS:
                    await self.run_step(live, step)
                await self.reboot_and_recover(live, producer)
                await self.check_moves(live)
                self.check_budgets()
                await self.check_fluent_bit_records(live)
                self.phase = "done"
                live.update(self.render(await self.node_states()))
        finally:
            stop_watching.set()
            await producer.stop()
            audit_task.cancel()
            shipped_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await shipped_task
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await audit_task
            if self.kube.http is not None:  # this loop's connections (cleanup runs on a loop of its own)
                await self.kube.http.aclose()
        return self.summary()

    def watch_budgets(self, stop: threading.Event) -> None:
        """Every status the disruption controller writes to the workloads' PDBs (a watch, on its own thread)."""
        policy = client.PolicyV1Api(self.api)
        namespace, version = self.fleet.namespace, ""
        while not stop.is_set():
            try:
                if not version:
                    listed = policy.list_namespaced_pod_disruption_budget(namespace, _preload_content=False)
                    page = orjson.loads(listed.data)
                    for pdb in page.get("items") or []:
                        self.budgets.observe(pdb)
                    version = page["metadata"]["resourceVersion"]
                # Short watches, each from where the last ended: no status is missed, and stop is seen at once.
                for event in watch.Watch().stream(policy.list_namespaced_pod_disruption_budget, namespace,
                                                  resource_version=version, timeout_seconds=2):
                    pdb = event["raw_object"]
                    version = (pdb.get("metadata") or {}).get("resourceVersion") or version
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self.budgets.observe(pdb)
            except ApiException as exc:
                version = "" if exc.status == 410 else version  # too old: list again
                stop.wait(0.5)
            except Exception:  # noqa: BLE001 - an API server that blinked: watch again from the same version
                stop.wait(0.5)

    async def check_moves(self, live: Live) -> None:
        """Every pod xidflow's drains evicted was re-created by its controller and runs where the scheduler put it:
        on a node in service when it was placed, never on a quarantined one; the controllers count every replica
        ready again."""
        self.phase = "evicted pods re-created and placed by Kubernetes"

        def judged() -> tuple[list[tuple[str, str]], list[Any]]:
            moved = {(m.source, m.evicted): m for m in self.moves.moves}
            evicted = list(dict.fromkeys(self.evicted))
            return [e for e in evicted if e not in moved], [moved[e] for e in evicted if e in moved]

        def settled(_: dict) -> bool:
            lost, moves = judged()
            return bool(moves) and not lost and all(m.running for m in moves)

        await self.wait_for(live, settled, self.step_timeout)
        lost, moves = judged()
        ready = await self.fleet.ready()
        pending = [m for m in moves if not m.running]
        misplaced = [m for m in moves if m.running and m.target_state != HEALTHY]
        short = [f"{kind} {name} {n}/{want}" for (kind, name), (n, want) in ready.items() if n < want]
        problems = ([f"{len(lost)} not followed"] if lost else []) + ([f"{len(pending)} pending"] if pending else []) \
            + ([f"{len(misplaced)} misplaced"] if misplaced else []) + ([f"{len(short)} short"] if short else [])
        ok = bool(moves) and not problems
        observed = "none evicted" if not self.evicted else ", ".join(problems) or "on healthy nodes"
        where = "; ".join(f"{m.evicted} {m.source} -> {m.pod + ' ' if m.pod != m.evicted else ''}"
                          f"{m.target or '(unplaced)'} ({m.target_state or m.status})" for m in moves)
        counts = ", ".join(f"{kind} {name} {n}/{want} ready" for (kind, name), (n, want) in ready.items())
        self.verdicts.append(Verdict(
            "Drained pods re-created by Kubernetes", f"{len(moves) + len(lost)} pods", "on healthy nodes", observed, ok,
            "xidflow's drains evicted them through the Eviction API; their StatefulSet and ReplicaSet controllers "
            f"re-created them and the scheduler placed them, never on a quarantined node: {where or 'none'}; "
            f"the controllers report {counts}"))

    def check_budgets(self) -> None:
        """The PDBs held: the disruption controller never reported fewer healthy pods than it desired."""
        names = [w.name for w in self.fleet.workloads]
        budgets = [self.budgets.by_name.get(n) for n in names]
        ok = all(b is not None and b.respected for b in budgets)
        seen = "; ".join(f"{n}: lowest {b.lowest_healthy} healthy of {b.desired_then} desired ({b.statuses} statuses)"
                         if b else f"{n}: no status seen" for n, b in zip(names, budgets, strict=True))
        self.verdicts.append(Verdict(
            "PDBs kept by the disruption controller", f"{len(names)} PDBs", "respected",
            "respected" if ok else "broken", ok,
            "every status the disruption controller wrote, watched from the start (the Eviction API refuses an "
            f"eviction the status does not allow): {seen}"))

    async def check_fluent_bit_records(self, live: Live) -> None:
        """Every line the demo wrote to a node's logs reached Kafka through Fluent Bit, pod lines with the
        metadata the kubernetes filter read from the API server."""
        kernel = sum(s.sequence for s in self.shippers.values())
        pod = sum(s.written - s.sequence for s in self.shippers.values())
        ok, _ = await self.wait_for(live, lambda _: self.shipped["kernel"] >= kernel
                                    and self.shipped["pod_with_metadata"] >= pod, self.step_timeout)
        # Short cells (the report's columns are never cut); the counts go in the reason below them.
        self.verdicts.append(Verdict(
            "Shipped by Fluent Bit", f"{len(self.shippers)} nodes", f"{kernel + pod} records",
            f"{self.shipped['kernel'] + self.shipped['pod']} records", ok,
            f"each node's Fluent Bit tailed its kernel log ({kernel} lines written, {self.shipped['kernel']} on "
            f"Kafka) and container logs ({pod} lines written, {self.shipped['pod']} on Kafka, "
            f"{self.shipped['pod_with_metadata']} with the pod metadata the kubernetes filter read from the API "
            "server) with the shipped configuration"))

    def summary(self) -> bool:
        if self.details:
            self.console.print(view.details(self.snapshot(self.last_states)), soft_wrap=True)
        self.console.print(view.report(self.verdicts))
        ok = all(v.ok for v in self.verdicts)
        self.console.print(f"Konduktor path: {self.loki_lines} kernel lines of {self.loki_node} went through Loki "
                           f"-> xidflow loki-tail -> Kafka")
        self.console.print(view.result_line(self.verdicts, self.audit_count, self.topics.name("remediation_audit")))
        return ok

    def cleanup(self) -> None:
        self.console.print("cleanup: stopping the demo's processes, deleting its workloads and nodes ...")
        started = time.monotonic()
        self.stop_processes()
        if self.fluent_bit_access is not None:
            with contextlib.suppress(Exception):
                self.fluent_bit_access.delete()
        if self.loki_server is not None:
            self.loki_server.stop()
        with contextlib.suppress(Exception):
            asyncio.run(self._delete_cluster_objects())
        self.console.print(f"cleanup: done in {time.monotonic() - started:.1f}s")

    async def _delete_cluster_objects(self) -> None:
        try:
            await self.fleet.delete()
            with contextlib.suppress(Exception):
                await self.kube._call(self.kube.core.delete_namespace, self.namespace)
        finally:
            await self.kube.aclose()
