"""Runs the demo: a fleet, a worker, actuator replicas, the scripted scenario, a live view, a verdict.

Everything is real: records go through Kafka in Fluent Bit's shapes (one node's kernel lines through
a real Loki and ``xidflow loki-tail``, the path of Konduktor's Loki-based controller), the worker
parses and aggregates them, the actuators act on a real API server. The demo only plays the parts a cluster
would: kubelets (node status, a reboot is a new boot id), the node's reboot daemon (it answers the
actuator's reboot-request annotation) and the node probe (passing health checks after the reboot).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiokafka import AIOKafkaProducer
from kubernetes import client, config
from rich.console import Console
from rich.live import Live

from pipeline import kafka_clients
from pipeline.actuator.ownership import LAST_ACTION_ANNOTATION, LEDGER_ANNOTATION, REBOOT_REQUEST_ANNOTATION
from pipeline.demo import view
from pipeline.demo.fleet import STANDBY_LABEL, Fleet
from pipeline.demo.scenario import LOKI_NODE_INDEX, REBOOT_NODE_INDEX, STEPS, Emit, Step
from pipeline.kafka_admin import ensure_topics
from pipeline.localinfra.loki import DEFAULT_TENANT, LokiServer, push_lines
from pipeline.settings import TopicNames
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

    def __post_init__(self) -> None:
        cfg = client.Configuration()
        config.load_kube_config(config_file=self.kubeconfig, client_configuration=cfg)
        self.api = client.ApiClient(cfg)
        self.core = client.CoreV1Api(self.api)
        self.topics = TopicNames(prefix=f"demo-{self.run_id}.")
        self.fleet = Fleet(self.api, self.run_id)
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

    def start_processes(self) -> None:
        self.start_loki()
        self._spawn("worker", "worker", "--bootstrap", self.bootstrap, "--app-id", f"xidflow-demo-{self.run_id}",
                    "--partitions", "4", "--loglevel", "warning")
        for i in range(1, self.actuators + 1):
            self._spawn(f"actuator-{i}", "actuator", "--kubeconfig", self.kubeconfig)

    def check_processes(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                if name == "loki-tail":
                    tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-2500:]
                    raise RuntimeError(f"the Loki bridge (xidflow loki-tail) exited with {proc.returncode}:\n{tail}")
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-2500:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def stop_processes(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)

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

    def _kernel_record(self, node: str, line: str, seq: int) -> bytes:
        now = time.time()
        return orjson.dumps({"priority": 3, "sequence": seq, "sec": int(now) % 100000, "usec": 0, "msg": line,
                             "node": node, "@timestamp": now})

    def _pod_record(self, node: str, line: str, pod: str) -> bytes:
        return orjson.dumps({"log": line, "stream": "stderr", "time": time.strftime("%Y-%m-%dT%H:%M:%S.000Z",
                                                                                  time.gmtime()),
                             "kubernetes": {"host": node, "pod_name": pod, "namespace_name": self.fleet.namespace,
                                            "container_name": "trainer"}})

    async def push_to_loki(self, node: str, e: Emit) -> None:
        """The Konduktor path: the node's kernel lines are pushed to Loki; loki-tail brings them to Kafka."""
        base = time.time_ns()
        lines = [line for _ in range(e.repeat) for line in e.lines]
        values = [(base + i, line) for i, line in enumerate(lines)]
        labels = {"job": "kmsg", "demo": self.run_id, "node": node, "source": "kernel"}
        await asyncio.to_thread(push_lines, self.loki_url, labels, values, tenant=self.loki_org_id)
        self.loki_lines += len(values)

    async def emit(self, producer: AIOKafkaProducer, e: Emit) -> None:
        node = self.fleet.nodes[e.node_index - 1]
        if e.source == "kernel" and e.node_index == LOKI_NODE_INDEX:
            await self.push_to_loki(node, e)
            return
        pods = self.fleet.pods_by_node().get(node) or [f"llm-{e.node_index:02d}-0"]
        seq = 0
        for _ in range(e.repeat):
            for line in e.lines:
                seq += 1
                if e.source == "kernel":
                    value, topic = self._kernel_record(node, line, seq), self.topics.name("logs_kernel")
                else:
                    value, topic = self._pod_record(node, line, pods[e.pod_index % len(pods)]), \
                        self.topics.name("logs_pods")
                await producer.send(topic, value, key=node.encode())
        await producer.flush()

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
        via = {name: "Loki -> loki-tail -> Kafka" if name == self.loki_node else "Fluent Bit -> Kafka"
               for name in self.fleet.nodes + self.fleet.standby}
        return view.Snapshot(
            title=f"GPU fleet, demo {self.run_id}: {self.phase}",
            nodes=[s["object"] for s in states.values() if "object" in s], standby_label=STANDBY_LABEL,
            order=self.fleet.nodes + self.fleet.standby, kernel_paths=via, audit=list(self.audit),
            audit_count=self.audit_count, audit_topic=self.topics.name("remediation_audit"))

    def render(self, states: dict[str, dict[str, Any]]) -> view.Lines:
        self.last_states = states
        return view.live_view(self.snapshot(states))

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

    async def run_step(self, live: Live, producer: AIOKafkaProducer, step: Step) -> None:
        self.phase = step.title
        for e in step.emits:
            await self.emit(producer, e)
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
        self.start_processes()
        con.print(f"started 1 worker and {self.actuators} actuator replicas (logs in {self.workdir})")
        con.print(f"Konduktor path: kernel lines of [bold]{self.loki_node}[/] are pushed to Loki ({self.loki_url}, "
                  f"tenant {self.loki_org_id or '-'}) and travel Loki -> xidflow loki-tail -> Kafka; "
                  "the other nodes ship with Fluent Bit's record shapes")
        audit_task = asyncio.create_task(self.follow_audit())
        pdb_task = asyncio.create_task(self._keep_pdb_status())
        producer = kafka_clients.producer(bootstrap=self.bootstrap, acks="all", linger_ms=5)
        await producer.start()
        try:
            # The probe DaemonSet reports every node healthy on its current boot before anything breaks.
            for node in self.fleet.nodes:
                await self.send_health(producer, node, self.fleet.boot_ids[node])
            with Live(self.render({}), console=con, refresh_per_second=4, transient=False) as live:
                for step in STEPS:
                    await self.run_step(live, producer, step)
                await self.reboot_and_recover(live, producer)
                self.phase = "done"
                live.update(self.render(await asyncio.to_thread(self.node_states)))
        finally:
            await producer.stop()
            audit_task.cancel()
            pdb_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await audit_task
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pdb_task
        return self.summary()

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
        if self.loki_server is not None:
            self.loki_server.stop()
        with contextlib.suppress(Exception):
            self.fleet.delete()
        with contextlib.suppress(Exception):
            self.core.delete_namespace(self.namespace)
