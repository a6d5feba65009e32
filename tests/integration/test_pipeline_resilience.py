"""State survives: worker restart, a worker killed mid-stream, a broker restart mid-stream.

Checks are by ids: every node that got a fault line has exactly one incident id for it (nothing
lost, nothing doubled); a re-sent incident record with the same id and revision is at-least-once
delivery, not a new incident, and is allowed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from pipeline.app import worker_topics
from pipeline.kafka.admin import ensure_topics
from pipeline.runtime.settings import TopicNames
from tests.integration.test_pipeline import PARTITIONS, T0, XID, Pipeline, Worker, healthz, wait_ready

pytestmark = pytest.mark.integration

X79 = XID.format(bus="4e", code=79, text="GPU has fallen off the bus.")
X95 = XID.format(bus="4e", code=95, text="Uncontained ECC error")


def ids_by_node(pipe: Pipeline, nodes: list[str]) -> dict[str, set[str]]:
    return {
        n: {i["incident_id"] for i in pipe.incidents(n) if i.get("type") == "incident" and i.get("code") == 79}
        for n in nodes
    }


async def group_members(bootstrap: str, group: str) -> int:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        [response] = await admin.describe_consumer_groups([group])
        described = response.groups[0]
        return len(described[5]) if described[2] == "Stable" else 0
    finally:
        await admin.close()


async def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
        return {tp.partition: meta.offset for tp, meta in offsets.items() if tp.topic == topic}
    finally:
        await admin.close()


async def send_retrying(pipe: Pipeline, node: str, line: str, at: float, within_s: float = 120.0) -> None:
    """Produce, retrying through a broker outage (the producer's own retries end at its timeout)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            await pipe.kernel(node, line, at)
            return
        except KafkaError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def test_restarted_worker_remembers_open_incidents_and_does_not_re_emit(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"t-restart-{tag}-", f"t-restart-{tag}"
    node = f"n-restart-{tag}"
    await ensure_topics(kafka_bootstrap, worker_topics(app_id, TopicNames(prefix=prefix)), PARTITIONS)
    async with Pipeline(kafka_bootstrap, prefix) as pipe:
        first = Worker(kafka_bootstrap, app_id, prefix, tmp_path).start()
        try:
            await wait_ready(pipe, first)
            await pipe.kernel(node, X95, T0)
            await pipe.sentinel(node, T0 + 1)
        finally:
            first.stop()
        [opened] = pipe.rule_incidents(node)
        second = Worker(kafka_bootstrap, app_id, prefix, tmp_path).start()
        try:
            await wait_ready(pipe, second)
            # Same burst: remembered as a repeat. A second burst 2 minutes later (log time) is a
            # repeat of a sticky code: the remembered incident escalates, under its own id.
            await pipe.kernel(node, X95, T0 + 2)
            await pipe.kernel(node, X95, T0 + 120)
            await pipe.sentinel(node, T0 + 121)
            assert second.alive(), second.log_tail()
        finally:
            second.stop()
        incidents = pipe.rule_incidents(node)
    assert [(i["incident_id"], i["revision"]) for i in incidents] == [
        (opened["incident_id"], 0),
        (opened["incident_id"], 1),
    ]
    assert incidents[1]["action"] == "CONTACT_SUPPORT" and incidents[1]["count"] == 3


async def test_two_workers_one_killed_mid_stream_lose_nothing_and_double_nothing(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"t-kill-{tag}-", f"t-kill-{tag}"
    nodes = [f"n-kill-{tag}-{i}" for i in range(40)]
    await ensure_topics(kafka_bootstrap, worker_topics(app_id, TopicNames(prefix=prefix)), PARTITIONS)
    async with Pipeline(kafka_bootstrap, prefix) as pipe:
        survivor = Worker(kafka_bootstrap, app_id, prefix, tmp_path).start()
        victim = Worker(kafka_bootstrap, app_id, prefix, tmp_path).start()
        try:
            await wait_ready(pipe, survivor)
            # Both workers must own partitions of both stages before one is killed.
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                counts = [await group_members(kafka_bootstrap, g) for g in (app_id, f"{app_id}-parse")]
                if counts == [2, 2]:
                    break
                await asyncio.sleep(0.5)
            else:
                raise AssertionError(f"the two workers did not both join their groups: {counts}")
            for i, node in enumerate(nodes):
                await pipe.kernel(node, X79, T0 + i)
                if i == len(nodes) // 2:
                    victim.kill()  # SIGKILL: no commit, no goodbye
                await asyncio.sleep(0.05)
            for i, node in enumerate(nodes):  # repeats after the kill: must fold into the same ids
                await pipe.kernel(node, X79, T0 + i + 1)
            try:
                await pipe.wait_for(lambda: all(ids_by_node(pipe, nodes).values()), 120, "an incident for every node")
            except AssertionError as exc:
                missing = [n for n, v in ids_by_node(pipe, nodes).items() if not v]
                events = {n: [e["_at"] for e in pipe.seen["fault_events"] if e.get("node") == n] for n in missing}
                committed = await committed_offsets(kafka_bootstrap, app_id, pipe.topics.name("fault_events"))
                raise AssertionError(
                    f"{exc}; no incident for {missing}; their fault events (partition, offset): {events}; "
                    f"committed: {committed}"
                ) from None
            for node in nodes:
                await pipe.sentinel(node, T0 + 100, within_s=120)
            assert survivor.alive(), survivor.log_tail()
        finally:
            victim.stop()
            survivor.stop()
        ids = ids_by_node(pipe, nodes)
    assert {n: len(v) for n, v in ids.items()} == {n: 1 for n in nodes}
    for node in nodes:
        emitted = [(i["incident_id"], i["revision"]) for i in pipe.rule_incidents(node)]
        assert {rev for _, rev in emitted} == {0}, emitted  # repeats never escalated nor re-opened


async def test_broker_restart_mid_stream_loses_nothing(private_kafka: Callable[..., object], tmp_path: Path) -> None:
    cluster = private_kafka(brokers=1)
    bootstrap = cluster.bootstrap  # type: ignore[attr-defined]
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"t-broker-{tag}-", f"t-broker-{tag}"
    nodes = [f"n-broker-{tag}-{i}" for i in range(30)]
    await ensure_topics(bootstrap, worker_topics(app_id, TopicNames(prefix=prefix)), PARTITIONS)
    async with Pipeline(bootstrap, prefix) as pipe:
        worker = Worker(bootstrap, app_id, prefix, tmp_path).start()
        try:
            await wait_ready(pipe, worker)
            for i, node in enumerate(nodes):
                if i == len(nodes) // 2:
                    await asyncio.to_thread(cluster.restart)  # type: ignore[attr-defined]
                await send_retrying(pipe, node, X79, T0 + i)
            await pipe.wait_for(lambda: all(ids_by_node(pipe, nodes).values()), 180, "an incident for every node")
            assert worker.alive(), worker.log_tail()
        finally:
            worker.stop()
        ids = ids_by_node(pipe, nodes)
    assert {n: len(v) for n, v in ids.items()} == {n: 1 for n in nodes}


async def test_an_output_the_broker_refuses_is_a_dead_letter_not_a_restart_loop(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """The fault-event topic takes at most 100 kB and lines are kept up to 256 KiB: the broker refuses
    the oversized line's event. That event becomes one dead letter; the worker neither restarts nor
    stops detecting, and /healthz stays green."""
    from aiokafka.admin import NewTopic

    from pipeline.localinfra.procs import free_port

    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"t-refuse-{tag}-", f"t-refuse-{tag}"
    topics = TopicNames(prefix=prefix)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topics.name("fault_events"), num_partitions=PARTITIONS,
                                            replication_factor=1, topic_configs={"max.message.bytes": "100000"})])
    finally:
        await admin.close()
    await ensure_topics(kafka_bootstrap, worker_topics(app_id, topics), PARTITIONS)
    port = free_port()
    env = {"XIDFLOW_PARSE_MAX_LINE_CHARS": "262144", "XIDFLOW_PARSE_MAX_OUTPUT_BYTES": str(1 << 20),
           "XIDFLOW_METRICS_PORT": str(port)}
    worker = Worker(kafka_bootstrap, app_id, prefix, tmp_path, extra_env=env).start()
    huge = f"n-huge-{tag}"
    # The other node's event goes to the refused one's partition: the harder case, where an idempotent
    # producer's next batch after the refusal failed with OutOfOrderSequenceNumber (a stage restart).
    other = next(n for i in range(1000) if _partition(n := f"n-other-{tag}-{i}") == _partition(huge))
    try:
        async with Pipeline(kafka_bootstrap, prefix) as pipe:
            await wait_ready(pipe, worker)
            await pipe.kernel(huge, XID.format(bus="4e", code=79, text="fallen " + "y" * 600_000), T0)
            await pipe.kernel(other, X79, T0)
            await pipe.wait_for(lambda: bool(pipe.incidents(other)), 120, "the other node's incident")
            await pipe.wait_for(
                lambda: len([d for d in pipe.seen["deadletter"] if d.get("key") == huge]) >= 2, 120, "dead letters"
            )
            await pipe.kernel(other, X95, T0 + 1)
            await pipe.wait_for(lambda: any(i.get("code") == 95 for i in pipe.incidents(other)), 120, "second fault")
            await asyncio.sleep(2)
            await pipe.poll()
            letters = [d for d in pipe.seen["deadletter"] if d.get("key") == huge]
        assert sorted(d["code"] for d in letters) == ["output_failed", "truncated"], letters
        assert worker.alive(), worker.log_tail()
        assert "parse stage failed" not in worker.log_path.read_text(errors="replace")
        assert healthz(port) == 200
    finally:
        worker.stop()


def _partition(key: str) -> int:
    """The fault-event partition of a node (the producer's default partitioner, keyed by node)."""
    from aiokafka.partitioner import murmur2

    return (murmur2(key.encode()) & 0x7FFFFFFF) % PARTITIONS
