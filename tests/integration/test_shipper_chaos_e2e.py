"""The whole pipeline with the real shippers in front of it, under SIGKILL, counted per node as an operator would.

``test_chaos_e2e`` feeds every record shape through a plain producer; this one runs the programs users run:
one real Fluent Bit per node on the shipped configuration (kernel file in /dev/kmsg's record form, the pods'
CRI logs resolved by the ``kubernetes`` filter with the chart's RBAC), a real Loki with ``xidflow loki-tail``,
rsyslogd with omkafka (lz4, no Kafka key), the probe's health-check records, and plain producers in the three
other codecs (gzip, snappy, zstd; a ``node`` header instead of a key, a raw CRI line on the pods topic). One
``xidflow worker`` and two ``xidflow actuator`` replicas run with the built-in policy plus a drain for Xid 79.

1. First burst (SXid with continuations, three-line fallen-off-bus, codecs, a node with only benign lines and
   NCCL storms): as the first taint appears, the worker's working child and one actuator are SIGKILLed.
2. The whole worker process is SIGKILLed; lines arrive through every shipper while it is dead (their
   arrival on the raw topics is proven before it comes back); then the worker restarts with its static id.
3. The killed actuator rejoins mid-burst (a rebalance while incidents flow); once a drain is under way the
   other replica is SIGKILLed and comes straight back.

At the end, when every group has committed everything, each node is counted: one quarantine taint where a
fault quarantines, one node Event, one ``GPUFault`` Event per pod, no pod evicted twice, one incident id,
and nothing at all (no taint, no Event, no dead letter) where the lines were benign. No timing is asserted:
the waits are generous bounds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from kubernetes import client, config

from pipeline.actuator.app import actuator_topics
from pipeline.actuator.testing import create_nodes, node_events, object_events, wait_until
from pipeline.app import worker_topics
from pipeline.demo.shipping import FluentBitAccess, NodeShipper
from pipeline.ingest.probe import read_boot_id
from pipeline.kafka.admin import ensure_topics
from pipeline.localinfra.fluentbit_run import Render
from pipeline.localinfra.loki import DEFAULT_TENANT, LokiServer, push_lines
from pipeline.localinfra.rsyslog import RsyslogDist
from schemas.records import HealthCheckResult, Outcome
from tests.integration.test_actuator_effects import Env
from tests.integration.test_actuator_failover import TAINT_KEY, Replicas, write_policy
from tests.integration.test_fluent_bit_kernel import fluent_bit  # noqa: F401 - the module's fixture
from tests.integration.test_pipeline import PARTITIONS, REPO, Pipeline, Worker, wait_ready
from tests.integration.test_rsyslog import Rsyslogd
from tests.integration.workloads import ensure_ns, pods_on, trainers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

PODS = ("trainer-0", "trainer-1")
BOOT_ID = read_boot_id()  # the shipped Lua filter stamps this machine's boot id on kernel records

XID79 = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
OFF_BUS_ONE_LINE = "NVRM: GPU 0000:4e:00.0: GPU has fallen off the bus."
OFF_BUS_THREE_LINES = (
    "NVRM: The NVIDIA GPU 0000:3b:00.0",
    "NVRM: (PCI ID: 10de:2330) installed in this system has",
    "NVRM: fallen off the bus and is not responding to commands.",
)
SXID_24007 = (
    "nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 28 sourcetrack TCEN0 crumbstore ECC DBE "
    "Error (First)",
    "nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 24007, Severity 1 Engine instance 28 Sub-engine instance 00",
    "nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 24007, Data {0x00000000, 0x00000000, 0x00000000, 0x00000000, "
    "0x00000000, 0x00000000, 0x00000000, 0x00000000}",
)
XID48 = "NVRM: Xid (PCI:0000:b7:00): 48, pid=2331, name=python, An uncorrectable double bit error"
XID119 = ("NVRM: Xid (PCI:0000:18:00): 119, pid=1826, name=python3, Timeout after 6s of waiting for RPC response "
          "from GPU0 GSP!")
XID74 = ("NVRM: Xid (PCI:0000:ca:00): 74, pid=3341, name=python3, NVLink: fatal error detected on link 14(0x0, 0x0, "
         "0x10000, 0x0, 0x0, 0x0, 0x0)")
XID62 = "NVRM: Xid (0000:03:00): 62, Channel 00000001"
XID13 = ("NVRM: Xid (PCI:0000:1b:00): 13, pid=48213, name=python3, Graphics Exception: ESR 0x504648=0x1000a "
         "(GPC 3, TPC 1, SM 0)")
XID45 = "NVRM: Xid (PCI:0000:9a:00): 45, pid=48213, name=python3, Ch 00000010"
NCCL_TIMEOUT = (
    "[rank40]:[E1121 23:11:05.123456 ProcessGroupNCCL.cpp:616] [Rank 40] Watchdog caught collective operation "
    "timeout: WorkNCCL(SeqNum=2411, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran "
    "for 600046 milliseconds before timing out."
)
NCCL_SYSTEM = ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp"
               ":1970, unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5")
BENIGN_KERNEL = (
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024",
    "NVRM: GPU at PCI:0000:9a:00: GPU-6d6a8d4c-2a1b-7c3e-9f10-1b2c3d4e5f60",
    "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 12028, Non-fatal, Link 47 egress non-posted PRIV error (First)",
    "usb 1-1: new high-speed USB device number 2 using xhci_hcd",
)

# role -> what must happen to the node (None: nothing at all), with the shipper that carries its lines
QUARANTINE, WARN_ONLY, NOTHING = "quarantine", "warning-event", "nothing"


def _cri(line: str) -> str:
    now = time.time_ns()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now // 10**9)) + f".{now % 10**9:09d}Z stderr F {line}"


def _child_of(pid: int) -> int:
    """The working child the ``xidflow worker`` supervisor forked (the process itself when it runs unsupervised)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(children[0]) if children else pid


async def _group_lag(bootstrap: str, group: str, topics: list[str]) -> int:
    """Records of ``topics`` the group has not committed yet."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await admin.start()
    await reader.start()
    try:
        committed = await admin.list_consumer_group_offsets(group)
        await reader.topics()
        tps = [TopicPartition(t, p) for t in topics for p in sorted(reader.partitions_for_topic(t) or ())]
        ends = await reader.end_offsets(tps)
        begins = await reader.beginning_offsets(tps)
        lag = 0
        for tp in tps:
            meta = committed.get(tp)
            done = meta.offset if meta is not None and meta.offset >= 0 else begins[tp]
            lag += max(0, ends[tp] - done)
        return lag
    finally:
        await reader.stop()
        await admin.close()


async def _raw_holds(bootstrap: str, topic: str, needles: list[bytes]) -> set[bytes]:
    """Which of ``needles`` occur in some record of ``topic`` now (read from the beginning, no group)."""
    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    await reader.start()
    found: set[bytes] = set()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        reader.assign(tps)
        await reader.seek_to_beginning(*tps)
        ends = await reader.end_offsets(tps)
        pending = [tp for tp in tps if await reader.position(tp) < ends[tp]]
        while pending:
            for records in (await reader.getmany(*pending, timeout_ms=500)).values():
                for r in records:
                    found |= {n for n in needles if n in (r.value or b"") or n == r.key
                              or any(v == n for _, v in r.headers or ())}
            pending = [tp for tp in pending if await reader.position(tp) < ends[tp]]
    finally:
        await reader.stop()
    return found


class LokiTail:
    """``xidflow loki-tail`` as a process (Konduktor's path: Loki to the raw kernel topic)."""

    def __init__(self, url: str, run: str, topic: str, bootstrap: str, log: Path, start_ns: int) -> None:
        self.log = log
        out = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "loki-tail", "--loki-url", url, "--query",
             f'{{job="kmsg", run="{run}"}}', "--topic", topic, "--bootstrap", bootstrap, "--org-id", DEFAULT_TENANT,
             "--start-ns", str(start_ns)],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        out.close()

    def alive(self) -> None:
        assert self.proc.poll() is None, f"loki-tail exited:\n{self.log.read_text(errors='replace')[-3000:]}"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def test_real_shippers_through_sigkilled_worker_and_actuators_count_per_node(  # noqa: PLR0915
    fluent_bit: Path, loki: LokiServer, rsyslog: RsyslogDist,  # noqa: F811
    kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str], tmp_path: Path,
) -> None:
    env = Env(kafka_bootstrap, kubeconfig, unique)
    run = uuid.uuid4().hex[:6]
    app_id = unique("shipchaos")
    topics = env.topics
    raw = [topics.name(t) for t in ("logs_kernel", "logs_pods", "health_checks")]
    await ensure_topics(kafka_bootstrap, worker_topics(app_id, topics), PARTITIONS)
    await ensure_topics(kafka_bootstrap, actuator_topics(topics), PARTITIONS)
    await ensure_ns(env.kube, env.namespace)
    work = unique("work")
    await ensure_ns(env.kube, work)

    # node role -> (expected effect, has pods, drained by the Xid 79 rule)
    plan: dict[str, tuple[str, bool, bool]] = {
        "fb-sxid": (QUARANTINE, True, False),       # Fluent Bit, burst 1: SXid 24007 Fatal + continuations
        "fb-offbus3": (QUARANTINE, True, True),     # Fluent Bit, burst 1: three-line fallen off the bus
        "fb-benign": (NOTHING, True, False),        # Fluent Bit, both bursts: benign kernel lines, Xid 45, NCCL storm
        "fb-xid79-dead": (QUARANTINE, True, True),  # Fluent Bit, worker dead: Xid 79 storm + off-bus + NCCL
        "gzip-text": (QUARANTINE, False, False),    # producer gzip, burst 1: plain text keyed, old-driver Xid 62
        "snappy-header": (QUARANTINE, False, False),  # producer snappy, burst 1: plain text, node header, no key
        "loki": (QUARANTINE, False, False),         # Loki + loki-tail, worker dead: Xid 48
        "rsyslog": (QUARANTINE, True, True),        # rsyslogd omkafka lz4, worker dead: Xid 79, no key
        "probe": (QUARANTINE, False, False),        # HealthCheckResult gpu_count failed, worker dead
        "zstd-kmsg": (QUARANTINE, False, False),    # producer zstd, worker dead: Fluent Bit kmsg JSON, Xid 119
        "lz4-app": (WARN_ONLY, False, False),       # producer lz4, worker dead: Xid 13 (RESTART_APP)
        "cri-benign": (NOTHING, False, False),      # producer, worker dead: raw CRI lines (NCCL, a printed Xid)
    }
    names = {role: f"{role}-{run}" for role in plan}
    await create_nodes(env.kube, names.values(), env.fleet_label, boot_id=BOOT_ID, gpu=True)
    env.nodes += list(names.values())
    for role, (_, with_pods, _) in plan.items():
        if with_pods:
            pods = await trainers(env.kube, work, names[role], len(PODS), gpus=4)
            assert pods == [f"{names[role]}-{p}" for p in PODS]
    drain = "[{name: quarantine}, {name: drain, gracePeriodCap: 0, timeout: 600}]"
    policy = write_policy(tmp_path / "policy.yaml", drain)
    reps = Replicas(env, kubeconfig, policy, extra={"XIDFLOW_ACTUATOR_RESYNC_SECONDS": "30"})
    worker_env = {"XIDFLOW_GROUP_INSTANCE_ID": f"worker-{run}", "XIDFLOW_METRICS_PORT": "0",
                  "XIDFLOW_WORKER_TICK_INTERVAL_S": "10",
                  "XIDFLOW_AGG_QUIET_PERIOD_S": "900", "XIDFLOW_AGG_SUMMARY_INTERVAL_S": "1"}

    def start_worker() -> Worker:  # the same static member each time, as a restarted pod
        return Worker(kafka_bootstrap, app_id, topics.prefix, tmp_path, extra_env=worker_env).start()

    # The shippers.
    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    api = client.ApiClient(cfg)
    access = FluentBitAccess(api, env.namespace, f"xf-{run}", tmp_path / "fb-access", log=print)
    kube_settings = await asyncio.to_thread(access.create)
    shippers: dict[str, NodeShipper] = {}
    for role in ("fb-sxid", "fb-offbus3", "fb-benign", "fb-xid79-dead"):
        render = Render(root=tmp_path / role, kernel_source="file-kmsg", kernel_topic=topics.name("logs_kernel"),
                        pods_topic=topics.name("logs_pods"), kube=kube_settings)
        shipper = NodeShipper(tmp_path / role, names[role], kafka_bootstrap, render, log=print)
        shipper.add_container_logs(work, [f"{names[role]}-{p}" for p in PODS], run)
        shippers[role] = shipper
    rsyslogd = Rsyslogd(rsyslog, tmp_path / "rsyslog", names["rsyslog"], kafka_bootstrap, topics.name("logs_kernel"),
                        None, codec="lz4")
    bridge: LokiTail | None = None
    worker = start_worker()
    producers: dict[str, AIOKafkaProducer] = {}
    try:
        for s in shippers.values():
            await asyncio.to_thread(s.fluent_bit.start, 60.0)
        rsyslogd.start()
        loki_start = time.time_ns() - 10**9

        def start_bridge() -> LokiTail:  # the same arguments each time, as a restarted container
            return LokiTail(loki.url, run, topics.name("logs_kernel"), kafka_bootstrap, tmp_path / "loki-tail.log",
                            loki_start)

        bridge = start_bridge()
        for codec in ("gzip", "snappy", "lz4", "zstd"):
            producers[codec] = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", compression_type=codec)
            await producers[codec].start()
        for name in ("act-a", "act-b"):
            reps.start(name, tmp_path)

        def alive() -> None:
            reps.alive()
            bridge.alive() if bridge else None
            assert rsyslogd.proc and rsyslogd.proc.poll() is None, rsyslogd.output()
            for s in shippers.values():
                assert s.fluent_bit.alive(), s.fluent_bit.log_tail()

        async def taints(node: str) -> list[dict[str, Any]]:
            return [t for t in (await env.node(node))["spec"].get("taints") or [] if t["key"] == TAINT_KEY]

        async def any_tainted(roles: list[str]) -> bool:
            alive()
            return any([bool(await taints(names[r])) for r in roles])

        async with Pipeline(kafka_bootstrap, topics.prefix) as pipe:
            await wait_ready(pipe, worker, within_s=180)

            # 1. First burst, through Fluent Bit and two codecs.
            shippers["fb-sxid"].write_kernel([BENIGN_KERNEL[3], *SXID_24007])
            shippers["fb-offbus3"].write_kernel(OFF_BUS_THREE_LINES)
            shippers["fb-benign"].write_kernel([*BENIGN_KERNEL, XID45])
            for pod in PODS:
                shippers["fb-benign"].write_pod(work, f"{names['fb-benign']}-{pod}", [NCCL_TIMEOUT, NCCL_SYSTEM] * 10)
            await producers["gzip"].send_and_wait(topics.name("logs_kernel"), f"[ 8812.402113] {XID62}".encode(),
                                                  key=names["gzip-text"].encode())
            await producers["snappy"].send_and_wait(topics.name("logs_kernel"), XID74.encode(),
                                                    headers=[("node", names["snappy-header"].encode())])
            burst1 = ["fb-sxid", "fb-offbus3", "gzip-text", "snappy-header"]
            await wait_until(lambda: any_tainted(burst1), 180, poll=0.05, what="a first taint of burst 1")
            os.kill(_child_of(worker.proc.pid), signal.SIGKILL)  # type: ignore[union-attr]  # OOM-killed child
            reps.kill("act-a")

            # 2. The whole worker dies; lines arrive through every shipper while it is dead.
            worker.kill()
            shippers["fb-xid79-dead"].write_kernel([XID79] * 40 + [OFF_BUS_ONE_LINE])
            for pod in PODS:
                shippers["fb-xid79-dead"].write_pod(work, f"{names['fb-xid79-dead']}-{pod}", [NCCL_TIMEOUT] * 5)
            shippers["fb-benign"].write_kernel([BENIGN_KERNEL[0], BENIGN_KERNEL[1]])
            rsyslogd.write(f"[538441.007373] {BENIGN_KERNEL[3]}", f"[538441.107373] {XID79}")
            await asyncio.to_thread(push_lines, loki.url, {"job": "kmsg", "run": run, "node": names["loki"]},
                                    [(time.time_ns(), XID48)], tenant=DEFAULT_TENANT)
            result = HealthCheckResult(node=names["probe"], check="gpu_count", passed=False, boot_id=BOOT_ID,
                                       message="expected 8 GPUs, found 7")
            await producers["lz4"].send_and_wait(topics.name("health_checks"), result.to_bytes(),
                                                 key=names["probe"].encode())
            kmsg = {"priority": 3, "sequence": 9912, "sec": 8812, "usec": 402113, "msg": XID119,
                    "hostname": names["zstd-kmsg"], "boot_id": BOOT_ID}
            await producers["zstd"].send_and_wait(topics.name("logs_kernel"), orjson.dumps(kmsg),
                                                  key=names["zstd-kmsg"].encode())
            await producers["lz4"].send_and_wait(topics.name("logs_kernel"), XID13.encode(),
                                                 key=names["lz4-app"].encode())
            for line in (NCCL_TIMEOUT, NCCL_SYSTEM):
                await producers["gzip"].send_and_wait(topics.name("logs_pods"), _cri(line).encode(),
                                                      key=names["cri-benign"].encode())
            # A pod that prints dmesg output, its container log shipped raw onto the kernel topic: the workload's
            # text, not the kernel's.
            await producers["gzip"].send_and_wait(topics.name("logs_kernel"), _cri(XID79).encode(),
                                                  key=names["cri-benign"].encode())
            # Proven on the raw topics before the worker comes back.
            dead_lines = [names[r].encode() for r in ("fb-xid79-dead", "rsyslog", "loki")]

            async def arrived() -> bool:
                alive()
                return await _raw_holds(kafka_bootstrap, topics.name("logs_kernel"), dead_lines) == set(dead_lines)

            await wait_until(arrived, 120, poll=0.5, what="the lines sent while the worker was dead, on the topic")
            # The shippers are SIGKILLed too and come back: whatever they send again must change nothing.
            for role in ("fb-xid79-dead", "fb-benign"):
                shippers[role].fluent_bit.kill()
                await asyncio.to_thread(shippers[role].fluent_bit.start, 60.0)
            bridge.kill()
            bridge = start_bridge()
            worker = start_worker()

            # 3. The killed actuator rejoins mid-burst; the other dies during a drain and comes straight back.
            burst2 = ["fb-xid79-dead", "loki", "rsyslog", "probe", "zstd-kmsg"]
            await wait_until(lambda: any_tainted(burst2), 180, poll=0.05, what="a first taint of burst 2")
            reps.start("act-a", tmp_path)

            async def draining() -> bool:  # a drain under way, or (a fast machine) one already done
                alive()
                for role in ("fb-xid79-dead", "rsyslog", "fb-offbus3"):
                    for flow in (await env.ledger(names[role])).flows.values():
                        if "drain" in (flow.get("claims") or {}) or "drain" in (flow.get("done") or {}):
                            return True
                return False

            await wait_until(draining, 180, poll=0.05, what="a drain under way")
            reps.kill("act-b")
            reps.start("act-b", tmp_path)

            quarantined = [r for r, (want, _, _) in plan.items() if want == QUARANTINE]

            async def settled() -> bool:
                alive()
                assert worker.alive(), worker.log_tail()
                for role in quarantined:
                    flows = (await env.ledger(names[role])).flows
                    if not flows or not all("fin" in f for f in flows.values()):
                        return False
                if not await node_events(env.kube, names["lz4-app"]):
                    return False
                lags = [await _group_lag(kafka_bootstrap, f"{app_id}-parse", raw),
                        await _group_lag(kafka_bootstrap, app_id, [topics.name("fault_events")]),
                        await _group_lag(kafka_bootstrap, reps.group, [topics.name("incidents")])]
                return lags == [0, 0, 0]

            await wait_until(settled, 300, poll=1.0, what="every flow finished and every group caught up")
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                await pipe.poll()
            incidents = {r: {i["incident_id"] for i in pipe.incidents(n) if i.get("type") == "incident"}
                         for r, n in names.items()}
            dead = [d for d in pipe.seen["deadletter"] if any(n in str(d) for n in names.values())]
            # Every fault event names one of this run's nodes (or the readiness probe's): a shipper's
            # header read as a host would show up here as a node nobody has.
            stray = [e for e in pipe.seen["fault_events"]
                     if e.get("node") not in names.values() and not str(e.get("node")).startswith("warmup-")]
            cri_events = [e.get("kind") for e in pipe.seen["fault_events"] if e.get("node") == names["cri-benign"]]

        audit = await env.audit()
        report, problems = [], []
        for role, (want, with_pods, drained) in plan.items():
            node = names[role]
            obj = await env.node(node)
            node_taints = await taints(node)
            reasons = [e["reason"] for e in await node_events(env.kube, node)]
            pod_events: dict[str, list[str]] = {}
            for pod in (f"{node}-{p}" for p in PODS) if with_pods else ():
                pod_events[pod] = [e["reason"] for e in await object_events(env.kube, work, pod)]
            evicted = Counter(p for r in audit if r.node == node and r.action == "drain"
                              and r.outcome == Outcome.APPLIED for p in r.details.get("evicted", []))
            left = await pods_on(env.kube, node)
            report.append(f"{role}: taints={len(node_taints)} unschedulable={bool(obj['spec'].get('unschedulable'))} "
                          f"events={reasons} incidents={len(incidents[role])} pods={pod_events} evicted="
                          f"{dict(evicted)} left={left}")
            if want == QUARANTINE:
                ok = (len(node_taints) == 1 and len(reasons) == 1 and len(incidents[role]) == 1
                      and all(r.count("GPUFault") == 1 for r in pod_events.values()))
                if drained:  # a replica SIGKILLed after its evictions and before its audit leaves them unaudited
                    ok = ok and not left and all(c == 1 for c in evicted.values())
            elif want == WARN_ONLY:
                ok = not node_taints and not obj["spec"].get("unschedulable") and len(reasons) == 1
            else:
                ok = (not node_taints and not obj["spec"].get("unschedulable") and not reasons
                      and not any(pod_events.values()))
            if not ok:
                problems.append(f"{want} expected -> {report[-1]}")
        print("\n".join(report))
        assert not problems, "\n".join(problems)
        assert dead == [], dead
        assert stray == [], [(e.get("node"), e.get("kind"), e.get("raw")) for e in stray]
        assert cri_events and set(cri_events) == {"pod_error"}, cri_events
    finally:
        for p in producers.values():
            await p.stop()
        reps.stop()
        worker.stop()
        if bridge:
            bridge.stop()
        rsyslogd.stop()
        for s in shippers.values():
            s.fluent_bit.stop()
        await asyncio.to_thread(access.delete)
        await env.close()
        try:
            await env.kube._call(env.kube.core.delete_namespace, work)
        except Exception:  # noqa: BLE001 - best effort
            pass
        if keep := os.environ.get("CHAOS_LOGDIR"):  # the processes' logs, kept after the session
            await asyncio.to_thread(_copy_logs, tmp_path, Path(keep))


def _copy_logs(src: Path, dst: Path) -> None:
    for log in [*src.glob("*.log"), *src.glob("*/fluent-bit.log"), src / "rsyslog" / "rsyslogd.out"]:
        if log.exists():
            (dst / f"{log.parent.name}-{log.name}").write_bytes(log.read_bytes())
