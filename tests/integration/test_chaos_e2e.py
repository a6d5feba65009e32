"""The whole pipeline under SIGKILL: every documented shipper shape in, real processes killed mid-burst.

One ``xidflow worker`` and three ``xidflow actuator`` replicas run as processes on the real broker and
API server. Each GPU node (two pods on it) gets one fatal kernel line, and each shipper shape the README
promises carries the lines of two nodes. While the burst is being processed:

- the worker is SIGKILLed half a second into it and restarted at once (the same static member);
- as the first taint appears, the worker and one actuator are SIGKILLed, and restarted a second later;
- another actuator is SIGKILLed once a drain is under way, and stays dead; then the shippers send the
  whole burst again, as a restarted shipper replays what it had sent.

Counted per node at the end, as an operator would: one taint, one Event on the node, one ``GPUFault``
Event per pod, every pod evicted once and gone, the flow finished, one incident id, no dead letter.
No timing is asserted: the waits are generous bounds.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

from pipeline.actuator.app import actuator_topics
from pipeline.actuator.testing import node_events, object_events, wait_until
from pipeline.app import worker_topics
from pipeline.kafka.admin import ensure_topics
from schemas.records import LogRecord, Outcome, Source
from tests.integration.test_actuator_effects import Env
from tests.integration.test_actuator_failover import TAINT_KEY, Replicas, write_policy
from tests.integration.test_pipeline import PARTITIONS, Pipeline, Worker, wait_ready
from tests.integration.workloads import ensure_ns, pods_on, trainers

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

NODES_PER_SHAPE = 2
PODS = ("trainer-0", "trainer-1")
XID79 = "NVRM: Xid (PCI:0000:{bus}:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
FALLEN = (
    r"NVRM: The NVIDIA GPU 0000:{bus}:00.0\x0aNVRM: (PCI ID: 10de:2330) installed in this system has\x0a"
    r"NVRM: fallen off the bus and is not responding to commands."
)


def _iso(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}Z"


def _otlp(node: str, line: str, at: float) -> dict[str, Any]:
    attrs = [{"key": "k8s.node.name", "value": {"stringValue": node}}]
    record = {"timeUnixNano": str(int(at * 1e9)), "observedTimeUnixNano": str(int(at * 1e9)),
              "severityNumber": 17, "body": {"stringValue": line}}
    return {"resourceLogs": [{"resource": {"attributes": attrs},
                              "scopeLogs": [{"scope": {"name": "journald"}, "logRecords": [record]}]}]}


def _filebeat(node: str, line: str, at: float) -> dict[str, Any]:
    return {"@timestamp": _iso(at), "@metadata": {"beat": "filebeat", "type": "_doc", "version": "8.17.0"},
            "message": line, "log": {"offset": 1042, "file": {"path": "/var/log/kern.log"}},
            "input": {"type": "filestream"}, "host": {"name": node},
            "agent": {"type": "filebeat", "version": "8.17.0", "name": node}, "ecs": {"version": "8.0.0"}}


# shape -> (raw topic, record builder (node, line, log time) -> bytes, key the producer sets)
SHAPES: dict[str, tuple[str, Callable[[str, str, float], bytes], bool]] = {
    "fluentbit-kmsg": ("logs_kernel", lambda n, line, at: orjson.dumps(
        {"priority": 3, "sequence": 812, "sec": 5, "usec": 0, "msg": line, "hostname": n, "@timestamp": at}), True),
    "fluentbit-kmsg-array": ("logs_kernel", lambda n, line, at: orjson.dumps(
        [at, {"priority": 3, "sequence": 813, "sec": 6, "usec": 0, "msg": line, "hostname": n}]), True),
    "fluentbit-systemd": ("logs_kernel", lambda n, line, at: orjson.dumps(
        {"MESSAGE": line.replace(r"\x0a", "\n"), "_HOSTNAME": n, "_TRANSPORT": "kernel",
         "__REALTIME_TIMESTAMP": str(int(at * 1e6))}), True),
    "fluentbit-tail": ("logs_kernel", lambda n, line, at: orjson.dumps(
        {"log": line, "time": at, "hostname": n}), True),
    "loki-push": ("logs_kernel", lambda n, line, at: orjson.dumps(
        {"streams": [{"stream": {"node": n, "source": "kernel"}, "values": [[str(int(at * 1e9)), line]]}]}), True),
    "loki-tail-bridge": ("logs_kernel", lambda n, line, at: orjson.dumps(  # what `xidflow loki-tail` produces
        {"streams": [{"stream": {"job": "node-journal", "hostname": n}, "values": [[str(int(at * 1e9)), line]]}]}),
        True),
    "otlp-json": ("logs_kernel", lambda n, line, at: orjson.dumps(_otlp(n, line, at)), False),
    "filebeat": ("logs_kernel", lambda n, line, at: orjson.dumps(_filebeat(n, line, at)), False),
    "rsyslog-text": ("logs_kernel", lambda n, line, at: (
        time.strftime("%b %d %H:%M:%S", time.gmtime(at)) + f" {n} kernel: {line.replace(chr(92) + 'x0a', '#012')}"
    ).encode(), False),
    "rfc5424": ("logs_kernel", lambda n, line, at: (
        f"<3>1 {_iso(at)} {n} kernel - - - {line}").encode(), False),
    "plain-text": ("logs_kernel", lambda n, line, at: line.encode(), True),
    "logrecord-wire": ("logs_kernel", lambda n, line, at: LogRecord(  # any producer, in our own format
        node=n, source=Source.KERNEL, ts=datetime.fromtimestamp(at, UTC), line=line.replace(r"\x0a", "\n"),
        shipper="custom").to_bytes(), True),
}


async def taints(env: Env, node: str) -> list[dict[str, Any]]:
    return [t for t in (await env.node(node))["spec"].get("taints") or [] if t["key"] == TAINT_KEY]


async def test_every_shape_through_sigkilled_workers_and_actuators_doubles_and_loses_nothing(
    kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    env = Env(kafka_bootstrap, kubeconfig, unique)
    app_id = unique("chaos")
    await ensure_topics(kafka_bootstrap, worker_topics(app_id, env.topics), PARTITIONS)
    await ensure_topics(kafka_bootstrap, actuator_topics(env.topics), PARTITIONS)
    await ensure_ns(env.kube, env.namespace)
    work = unique("work")
    await ensure_ns(env.kube, work)
    nodes = await env.make_nodes(len(SHAPES) * NODES_PER_SHAPE)
    shape_of = dict(zip(nodes, [s for s in SHAPES for _ in range(NODES_PER_SHAPE)], strict=True))
    for node in nodes:
        assert await trainers(env.kube, work, node, len(PODS), gpus=4) == [f"{node}-{p}" for p in PODS]
    actions = "[{name: quarantine}, {name: drain, gracePeriodCap: 0, timeout: 600}]"
    policy = write_policy(tmp_path / "policy.yaml", actions)
    reps = Replicas(env, kubeconfig, policy)
    worker_env = {"XIDFLOW_GROUP_INSTANCE_ID": f"worker-{uuid.uuid4().hex[:6]}"}

    def start_worker() -> Worker:  # the same static member each time, as a restarted pod
        return Worker(kafka_bootstrap, app_id, env.topics.prefix, tmp_path, extra_env=worker_env).start()

    worker = start_worker()
    try:
        for name in ("act-a", "act-b", "act-c"):
            reps.start(name, tmp_path)
        async with Pipeline(kafka_bootstrap, env.topics.prefix) as pipe:
            await wait_ready(pipe, worker, within_s=180)
            assert pipe.producer is not None
            now = time.time()
            burst = []
            for i, node in enumerate(nodes):
                topic, build, keyed = SHAPES[shape_of[node]]
                line = (FALLEN if i % 2 else XID79).format(bus=f"{0x10 + i:02x}")
                value = build(node, line, now + i * 0.001)
                burst.append((pipe.topics.name(topic), value, node.encode() if keyed else None))

            async def send_burst() -> None:
                assert pipe.producer is not None
                await asyncio.gather(*[await pipe.producer.send(t, v, key=k) for t, v, k in burst])

            await send_burst()

            # The worker dies half a second into the burst and comes back as the same static member.
            await asyncio.sleep(0.5)
            worker.kill()
            worker = start_worker()

            async def tainted(count: int) -> bool:
                reps.alive()
                assert worker.alive(), worker.log_tail()
                return sum([bool(await taints(env, n)) for n in nodes]) >= count

            # As the first taint appears the worker dies again (incidents still going out) and so does
            # an actuator; both are back a second later.
            await wait_until(lambda: tainted(1), 180, poll=0.05, what="a first taint")
            reps.kill("act-a")
            worker.kill()
            await asyncio.sleep(1)
            reps.start("act-a", tmp_path)
            worker = start_worker()

            async def draining() -> bool:
                reps.alive()
                for n in nodes:
                    for flow in (await env.ledger(n)).flows.values():
                        if "drain" in (flow.get("claims") or {}):
                            return True
                return False

            # Another dies in the middle of a drain and stays dead: the others take its partitions.
            await wait_until(draining, 180, poll=0.05, what="a drain under way")
            reps.kill("act-b")
            # A shipper replays everything it sent (a restarted Fluent Bit re-reads /dev/kmsg): nothing new.
            await send_burst()

            async def all_finished() -> bool:
                reps.alive()
                assert worker.alive(), worker.log_tail()
                for n in nodes:
                    node_flows = (await env.ledger(n)).flows
                    if not node_flows or not all("fin" in f for f in node_flows.values()):
                        return False
                return True

            await wait_until(all_finished, 300, poll=0.5, what="every node's flow finished")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                await pipe.poll()
            incidents = {n: {i["incident_id"] for i in pipe.incidents(n) if i.get("type") == "incident"} for n in nodes}
            dead = [d for d in pipe.seen["deadletter"] if any(n in str(d) for n in nodes)]

        audit = await env.audit()
        problems: list[str] = []
        for node in nodes:
            label = f"{node} ({shape_of[node]})"
            if len(incidents[node]) != 1:
                problems.append(f"{label}: incident ids {sorted(incidents[node])}")
            if len(await taints(env, node)) != 1:
                problems.append(f"{label}: taints {await taints(env, node)}")
            events = [e["reason"] for e in await node_events(env.kube, node)]
            if len(events) != 1:
                problems.append(f"{label}: node Events {events}")
            if await pods_on(env.kube, node):
                problems.append(f"{label}: pods left {await pods_on(env.kube, node)}")
            node_flows = (await env.ledger(node)).flows
            if [f.get("status") for f in node_flows.values()] != ["done"]:
                problems.append(f"{label}: flows {node_flows}")
            evicted = Counter(p for r in audit if r.node == node and r.action == "drain"
                              and r.outcome == Outcome.APPLIED for p in r.details.get("evicted", []))
            if any(count > 1 for count in evicted.values()):
                problems.append(f"{label}: evicted twice {evicted}")
            for pod in (f"{node}-{p}" for p in PODS):
                reasons = [e["reason"] for e in await object_events(env.kube, work, pod)]
                if reasons.count("GPUFault") != 1:
                    problems.append(f"{label}: pod {pod} Events {reasons}")
        assert not problems, "\n".join(problems)
        assert dead == [], dead
    finally:
        reps.stop()
        worker.stop()
        await env.close()
        try:
            await env.kube._call(env.kube.core.delete_namespace, work)
        except Exception:  # noqa: BLE001 - best effort
            pass
        if keep := os.environ.get("CHAOS_LOGDIR"):  # the processes' logs, kept after the session
            await asyncio.to_thread(_copy_logs, tmp_path, Path(keep))


def _copy_logs(src: Path, dst: Path) -> None:
    for log in src.glob("*.log"):
        (dst / log.name).write_bytes(log.read_bytes())

