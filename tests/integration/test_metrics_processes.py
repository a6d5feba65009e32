"""Metric hygiene on the real thing: consumer lag read from a real broker, a real worker and a real
actuator process scraped over HTTP (each exports only its own series), and the quarantined-nodes gauge
after a real quarantine on the real API server. Eventual waits only; nothing asserts on a duration."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiokafka import TopicPartition
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.actuator.app import actuator_topics
from pipeline.actuator.testing import make_incident, publish, wait_until
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.lag import LagMonitor
from pipeline.runtime import metrics
from tests.integration.test_actuator_effects import Env
from tests.integration.workloads import ensure_ns

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
WAIT_S = 240  # generous: a loaded 2-core machine starts a worker slowly

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse(text: str) -> Samples:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    found = [v for (n, lab), v in samples.items()
             if n == name and all(dict(lab).get(k) == x for k, x in labels.items())]
    return sum(found) if found else None


def names(samples: Samples) -> set[str]:
    return {n for n, _ in samples if n.startswith("xidflow_")}


def exported_names(component: str) -> set[str]:
    """Sample names of the component's metrics (what its registry would show with every series present)."""
    out = set()
    for m in metrics.COMPONENT_METRICS[component]:
        if m._type == "counter":
            out.add(m._name + "_total")
        elif m._type == "histogram":
            out |= {m._name + "_bucket", m._name + "_sum", m._name + "_count"}
        else:
            out.add(m._name)
    return out


# -- a stalled consumer's lag grows on the timer ------------------------------------------------------
async def test_a_stalled_groups_lag_grows_and_is_exported_without_any_batch(
    kafka_bootstrap: str, unique: Callable[[str], str]
) -> None:
    topic, stalled, never = unique("lag-topic"), unique("stalled"), unique("never")
    await ensure_topics(kafka_bootstrap, [topic], partitions=2)

    async def produce(count: int, tag: str) -> None:
        producer = kafka_clients.producer(bootstrap=kafka_bootstrap, acks="all")
        await producer.start()
        try:
            await asyncio.gather(*[await producer.send(topic, b"x", key=f"{tag}-{i}".encode()) for i in range(count)])
        finally:
            await producer.stop()

    await produce(10, "a")
    # A member of the group reads what is there, commits it, then stops polling (stalled, still connected).
    consumer = kafka_clients.consumer(topic, bootstrap=kafka_bootstrap, group_id=stalled,
                                      enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    monitor = LagMonitor({stalled: [topic], never: [topic]}, kafka_bootstrap, interval_s=0.5)
    registry = metrics.build_registry(metrics.WORKER)
    try:
        read = 0
        deadline = time.monotonic() + WAIT_S
        while read < 10:
            assert time.monotonic() < deadline, f"read {read} of 10 records"
            batch = await consumer.getmany(timeout_ms=1000)
            read += sum(len(v) for v in batch.values())
        await consumer.commit()
        monitor.start()

        def exported(group: str) -> float | None:
            return value(parse(generate_latest(registry).decode()), "xidflow_consumer_lag", group=group, topic=topic)

        async def lag_is(group: str, expected: float) -> bool:
            return exported(group) == expected

        await wait_until(lambda: lag_is(stalled, 0), WAIT_S, 0.2, "the stalled group's lag at 0 after its commit")
        await wait_until(lambda: lag_is(never, 10), WAIT_S, 0.2, "a group that never committed: lag from the start")
        for total in (25, 40):  # the consumer polls nothing in between: only the monitor's timer reads
            await produce(15, f"b{total}")
            await wait_until(lambda total=total: lag_is(stalled, total - 10), WAIT_S, 0.2, f"lag {total - 10}")
        assert exported(never) == 40
        assert {dict(lab)["partition"] for (n, lab) in parse(generate_latest(registry).decode())
                if n == "xidflow_consumer_lag" and dict(lab)["group"] == stalled} == {"0", "1"}
        assert (await consumer.committed(TopicPartition(topic, 0))) is not None  # nothing moved the commit
    finally:
        await monitor.stop()
        await consumer.stop()


# -- real processes -----------------------------------------------------------------------------------
@pytest.fixture
async def env(kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]) -> AsyncIterator[Env]:
    world = Env(kafka_bootstrap, kubeconfig, unique)
    await ensure_topics(kafka_bootstrap, actuator_topics(world.topics), partitions=2)
    await ensure_ns(world.kube, world.namespace)
    yield world
    await world.close()


class Process:
    def __init__(self, name: str, args: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name, self.log = name, log_dir / f"{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, env=env,
                                         stdout=out, stderr=subprocess.STDOUT)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


async def scrape(proc: Process, port: int) -> Samples | None:
    assert proc.proc.poll() is None, f"{proc.name} exited {proc.proc.returncode}:\n{proc.tail()}"

    def get() -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                return resp.read().decode()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None

    text = await asyncio.to_thread(get)
    return parse(text) if text is not None else None


async def eventually(proc: Process, port: int, check: Callable[[Samples], bool], what: str) -> Samples:
    """Scrape until ``check`` holds (generous limit); the last scrape."""
    deadline = time.monotonic() + WAIT_S
    while True:
        samples = await scrape(proc, port)
        if samples is not None and check(samples):
            return samples
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not seen on {proc.name}'s /metrics; log:\n{proc.tail()}")
        await asyncio.sleep(1)


def actuator_env(env: Env, kubeconfig: str, group: str, policy: Path, port: int) -> dict[str, str]:
    return {
        **os.environ, "KAFKA_BOOTSTRAP_SERVERS": env.bootstrap, "XIDFLOW_TOPIC_PREFIX": env.topics.prefix,
        "XIDFLOW_METRICS_ADDR": "127.0.0.1", "XIDFLOW_METRICS_REFRESH_S": "1", "XIDFLOW_HEALTH_PORT": "0",
        "XIDFLOW_METRICS_PORT": str(port), "KUBECONFIG": kubeconfig,
        "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": env.selector, "XIDFLOW_ACTUATOR_NAMESPACE": env.namespace,
        "XIDFLOW_ACTUATOR_GROUP_ID": group, "XIDFLOW_ACTUATOR_POLICY_SOURCE": "file",
        "XIDFLOW_ACTUATOR_POLICY_FILE": str(policy), "XIDFLOW_ACTUATOR_BREAKER_MAX_SHARE": "1.0",
        "XIDFLOW_ACTUATOR_RESYNC_SECONDS": "2",
    }


async def test_worker_and_actuator_export_their_own_metrics_and_the_quarantine_gauge(
    env: Env, kubeconfig: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    app_id = unique("app")
    worker_port, actuator_port = free_port(), free_port()
    policy = tmp_path / "policy.yaml"
    policy.write_text("kind: RescuePolicy\nmetadata: {name: metrics}\nspec:\n  rules:\n"
                      "  - {priority: 10, codes: [79], actions: [{name: cordon}]}\n")
    group = unique("g")
    common = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": env.bootstrap, "XIDFLOW_TOPIC_PREFIX": env.topics.prefix,
              "XIDFLOW_METRICS_ADDR": "127.0.0.1", "XIDFLOW_METRICS_REFRESH_S": "1", "XIDFLOW_HEALTH_PORT": "0"}
    worker = Process("worker", ["worker", "--bootstrap", env.bootstrap, "--app-id", app_id, "--partitions", "2",
                                "--log-level", "warning"],
                     {**common, "XIDFLOW_METRICS_PORT": str(worker_port)}, tmp_path)
    actuator = Process("actuator", ["actuator", "--no-api", "--log-level", "warning"],
                       actuator_env(env, kubeconfig, group, policy, actuator_port), tmp_path)
    try:
        nodes = await env.make_nodes(3)
        incidents = env.topics.name("incidents")

        # The actuator: its group's lag on its topics, read from the broker before any record arrives.
        act = await eventually(actuator, actuator_port, lambda s: value(
            s, "xidflow_consumer_lag", group=group, topic=incidents) is not None
            and value(s, "xidflow_gpu_nodes") == 3, "the actuator's consumer lag and fleet")
        assert value(act, "xidflow_consumer_lag", group=group, topic=env.topics.name("remediation_requests")) == 0
        assert value(act, "xidflow_quarantined_nodes") == 0
        # counters exist from the start, at 0, for every known label value
        assert value(act, "xidflow_remediations_total", action="cordon", outcome="applied") == 0
        assert value(act, "xidflow_remediations_total", action="drain", outcome="failed") == 0
        assert value(act, "xidflow_flow_oldest_step_age_seconds", action="drain") == 0

        # The worker: both of its groups (Faust's aggregation and the parse stage).
        wrk = await eventually(worker, worker_port, lambda s: value(
            s, "xidflow_consumer_lag", group=app_id, topic=env.topics.name("fault_events")) is not None
            and value(s, "xidflow_consumer_lag", group=f"{app_id}-parse", topic=env.topics.name("logs_kernel"))
            is not None, "the worker's consumer lag of both groups")
        assert value(wrk, "xidflow_lines_total", source=env.topics.name("logs_kernel")) == 0
        assert value(wrk, "xidflow_deadletters_total", stage="parse", reason="unknown_shape") == 0

        # Each process exports only its own metrics.
        worker_only = exported_names(metrics.WORKER) - exported_names(metrics.ACTUATOR)
        actuator_only = exported_names(metrics.ACTUATOR) - exported_names(metrics.WORKER)
        assert names(wrk) <= exported_names(metrics.WORKER) and not names(wrk) & actuator_only, names(wrk)
        assert names(act) <= exported_names(metrics.ACTUATOR) and not names(act) & worker_only, names(act)
        assert {"xidflow_lines_total", "xidflow_incidents_total"} <= names(wrk)
        assert {"xidflow_remediations_total", "xidflow_quarantined_nodes", "xidflow_breaker_window_share"} <= names(act)

        # A real quarantine (cordon) of one node: the gauge follows the API server.
        await publish(env.bootstrap, incidents, [make_incident(nodes[0], unique("inc"))])
        # One refresh sets the fleet gauges, then reads the breaker's ConfigMap and sets its own: a scrape in
        # between sees the node quarantined and the breaker's window not yet (the API server was slow to answer).
        act = await eventually(actuator, actuator_port, lambda s: value(s, "xidflow_quarantined_nodes") == 1
                               and value(s, "xidflow_breaker_window_nodes") == 1
                               and (value(s, "xidflow_remediations_total", action="cordon", outcome="applied")
                                    or 0) >= 1, "one node quarantined")
        assert value(act, "xidflow_breaker_window_share") == pytest.approx(1 / 3)
        assert (await env.node(nodes[0]))["spec"].get("unschedulable") is True
        # the record was committed: the actuator's group is not behind on the incidents topic
        await eventually(actuator, actuator_port, lambda s: value(
            s, "xidflow_consumer_lag", group=group, topic=incidents) == 0, "the incident committed")

        # A record the actuator cannot read: a dead letter, counted by its own counter with its code.
        assert value(act, "xidflow_deadletters_total", stage="actuator", reason="invalid_json") == 0
        producer = kafka_clients.producer(env.bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(incidents, b"{not json", key=nodes[2].encode())
        finally:
            await producer.stop()
        act = await eventually(actuator, actuator_port, lambda s: value(
            s, "xidflow_deadletters_total", stage="actuator", reason="invalid_json") == 1, "the actuator's dead letter")
        assert "dead letter from" in actuator.tail() and "(actuator, invalid_json)" in actuator.tail()

        # A person's cordon of another node is not xidflow's quarantine.
        await env.kube._call(env.kube.core.patch_node, nodes[1], {"spec": {"unschedulable": True}})
        await asyncio.sleep(3)  # a few refreshes (1 s): the gauge must not count it
        act = await eventually(actuator, actuator_port, lambda s: value(s, "xidflow_quarantined_nodes") is not None,
                               "the gauge")
        assert value(act, "xidflow_quarantined_nodes") == 1
    finally:
        actuator.stop()
        worker.stop()


async def test_an_open_drain_step_is_exported_with_its_age_and_timeout(
    env: Env, kubeconfig: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    """A drain held by a PodDisruptionBudget: its step stays open, and the gauges the "flow stuck past its
    timeout" alert compares show it (age growing, the policy's timeout); when it finishes they drop to 0."""
    from tests.integration.test_actuator_failover import GUARDED, guarded_pods, set_pdb

    (node,) = await env.make_nodes(1)
    ns, _pods = await guarded_pods(env, node)
    policy = tmp_path / "policy.yaml"
    policy.write_text("kind: RescuePolicy\nmetadata: {name: metrics}\nspec:\n  rules:\n"
                      "  - {priority: 10, codes: [79], actions: [{name: cordon}, "
                      "{name: drain, gracePeriodCap: 0, timeout: 600}]}\n")
    port = free_port()
    actuator = Process("actuator", ["actuator", "--no-api", "--log-level", "warning"],
                       actuator_env(env, kubeconfig, unique("g"), policy, port), tmp_path)
    try:
        await eventually(actuator, port, lambda s: value(s, "xidflow_gpu_nodes") == 1, "the fleet")
        await publish(env.bootstrap, env.topics.name("incidents"), [make_incident(node, unique("inc"))])
        first = await eventually(actuator, port, lambda s: value(s, "xidflow_flow_open_steps", action="drain") == 1
                                 and (value(s, "xidflow_flow_oldest_step_age_seconds", action="drain") or 0) > 0,
                                 "the open drain step")
        assert value(first, "xidflow_flow_oldest_step_timeout_seconds", action="drain") == 600
        assert value(first, "xidflow_flow_open_steps", action="cordon") == 0
        age = value(first, "xidflow_flow_oldest_step_age_seconds", action="drain") or 0
        await eventually(actuator, port, lambda s: (value(s, "xidflow_flow_oldest_step_age_seconds", action="drain")
                                                   or 0) > age, "the drain step's age growing")
        await set_pdb(env, ns, GUARDED)  # the budget allows the evictions: the drain finishes
        done = await eventually(actuator, port, lambda s: value(s, "xidflow_flow_open_steps", action="drain") == 0,
                                "the drain step closed")
        assert value(done, "xidflow_flow_oldest_step_age_seconds", action="drain") == 0
        assert value(done, "xidflow_flow_oldest_step_timeout_seconds", action="drain") == 0
    finally:
        actuator.stop()
