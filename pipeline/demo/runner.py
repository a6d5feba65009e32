"""Runs the demo: a fleet, a worker, actuator replicas, the scripted scenario, a live view, a verdict.

Everything is real: every node runs a real Fluent Bit on the shipped configuration (one process per
node, like the DaemonSet; see :mod:`pipeline.demo.shipping`) that tails the node's kernel log and
container logs into Kafka, its kubernetes filter asking the API server with a ServiceAccount token;
one node's kernel lines go through a real Loki and ``xidflow loki-tail`` instead (the path of
Konduktor's Loki-based controller). The worker parses and aggregates them, the actuators act on a real
API server. The demo only plays the parts a cluster would: the nodes' kernels and container runtimes
(they write the log files), kubelets (node status, a reboot is a new boot id), the node's reboot daemon
(it answers the actuator's reboot-request annotation) and the node probe (its health-check records go to
Kafka directly, as the probe's own producer sends them).

One module (about 480 lines): the demo is one script from start to verdict; its parts (the fleet, the
shippers, the scenario, the view) live in their own modules beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from kubernetes import client, config
from rich.console import Console
from rich.live import Live

from pipeline.actuator.ownership import LAST_ACTION_ANNOTATION, LEDGER_ANNOTATION, REBOOT_REQUEST_ANNOTATION
from pipeline.demo import view
from pipeline.demo.fleet import STANDBY_LABEL, Fleet
from pipeline.demo.scenario import LOKI_NODE_INDEX, REBOOT_NODE_INDEX, STEPS, Emit, Step
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

    def __post_init__(self) -> None:
        cfg = client.Configuration()
        config.load_kube_config(config_file=self.kubeconfig, client_configuration=cfg)
        self.api = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api)
        self.topics = TopicNames(prefix=f"demo-{self.run_id}.")
        # The nodes run on this machine: they first boot on its boot id, which Fluent Bit's Lua filter stamps.
        self.fleet = Fleet(self.api, self.run_id, first_boot_id=read_boot_id())
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
        pods = self.fleet.pods_by_node()
        for node in self.fleet.nodes + self.fleet.standby:
            render = Render(root=folder / node, kernel_source="file-kmsg", kernel_topic=self.topics.name("logs_kernel"),
                            pods_topic=self.topics.name("logs_pods"), kube=kube, rdkafka=rdkafka)
            shipper = NodeShipper(folder / node, node, self.bootstrap, render, log=log)
            shipper.add_container_logs(self.fleet.namespace, pods.get(node, []), self.run_id)
            self.shippers[node] = shipper
        start_all(self.shippers.values())

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
                    self.audit.append(RemediationRecord.from_bytes(msg.value))
                    self.audit_count += 1
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
        pods = self.fleet.pods_by_node().get(node) or [pod for _, pod in shipper.container_files]
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
    def node_states(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for n in self.core.list_node(label_selector=self.fleet.selector).items:
            ann = n.metadata.annotations or {}
            taints = [f"{t.key}={t.value or ''}:{t.effect}" for t in (n.spec.taints or [])
                      if not t.key.startswith("node.kubernetes.io/")]
            conds = [c.type for c in (n.status.conditions or []) if c.type.startswith("Gpu") and c.status == "True"]
            out[n.metadata.name] = {
                "unschedulable": bool(n.spec.unschedulable),
                "standby": (n.metadata.labels or {}).get(STANDBY_LABEL) == "true",
                "taints": taints,
                "conditions": conds,
                "last": ann.get(LAST_ACTION_ANNOTATION, ""),
                "owned": LEDGER_ANNOTATION in ann,
                "reboot": REBOOT_REQUEST_ANNOTATION in ann,
                "boot": (n.status.node_info.boot_id if n.status.node_info else "")[:8],
                "object": self.api.sanitize_for_serialization(n),  # what the screen shows (pipeline.demo.view)
            }
        return out

    def snapshot(self, states: dict[str, dict[str, Any]]) -> view.Snapshot:
        via = {name: self.lines_via(name) for name in self.fleet.nodes + self.fleet.standby}
        return view.Snapshot(
            title=f"GPU fleet, demo {self.run_id}: {self.phase}",
            nodes=[s["object"] for s in states.values() if "object" in s], standby_label=STANDBY_LABEL,
            order=self.fleet.nodes + self.fleet.standby, kernel_paths=via, audit=list(self.audit),
            audit_count=self.audit_count, audit_topic=self.topics.name("remediation_audit"))

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
            states = await asyncio.to_thread(self.node_states)
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
        node = self.fleet.nodes[REBOOT_NODE_INDEX - 1]
        self.phase = f"reboot of {node}"
        asked, _ = await self.wait_for(live, lambda s: s.get(node, {}).get("reboot"), self.step_timeout)
        # The node's reboot daemon: reboots (new boot id) and its probe reports passing checks.
        boot_id = await asyncio.to_thread(self.fleet.reboot, node)
        self.rebooted.add(node)
        await self.send_health(producer, node, boot_id)
        self.phase = f"recovery of {node}"
        ok, states = await self.wait_for(live, lambda s: not s.get(node, {}).get("unschedulable")
                                         and not s.get(node, {}).get("taints"), self.step_timeout)
        self.verdicts.append(Verdict(
            "Reboot and recovery", node, "recovered", "recovered" if ok else "still quarantined", ok,
            "drained, reboot requested through the annotation hook" + ("" if asked else " (request not seen)")
            + ", new boot id with passing checks, then xidflow removed only what it applied"))

    async def run(self) -> bool:
        con = self.console
        con.print(f"[bold]xidflow demo[/] run [cyan]{self.run_id}[/]: Kafka {self.bootstrap}, "
                  f"kubeconfig {self.kubeconfig}")
        await self.create_topics()
        await asyncio.to_thread(self.core.create_namespace,
                                client.V1Namespace(metadata=client.V1ObjectMeta(name=self.namespace)))
        await asyncio.to_thread(self.fleet.create, self.nodes, 1)
        con.print(f"fleet: {len(self.fleet.nodes)} GPU nodes + {len(self.fleet.standby)} standby, "
                  f"{sum(len(p) for p in self.fleet.pods_by_node().values())} training pods with a PDB")
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
        pdb_task = asyncio.create_task(self._keep_pdb_status())
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
                await self.check_fluent_bit_records(live)
                self.phase = "done"
                live.update(self.render(await asyncio.to_thread(self.node_states)))
        finally:
            await producer.stop()
            audit_task.cancel()
            pdb_task.cancel()
            shipped_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await shipped_task
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await audit_task
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pdb_task
        return self.summary()

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

    async def _keep_pdb_status(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.fleet.finalize_terminating_pods)
                await asyncio.to_thread(self.fleet.sync_pdb)
            await asyncio.sleep(1)

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
        self.stop_processes()
        if self.fluent_bit_access is not None:
            with contextlib.suppress(Exception):
                self.fluent_bit_access.delete()
        if self.loki_server is not None:
            self.loki_server.stop()
        with contextlib.suppress(Exception):
            self.fleet.delete()
        with contextlib.suppress(Exception):
            self.core.delete_namespace(self.namespace)
