"""``xidflow probe``'s loop producing HealthCheckResult records to real Kafka, keyed by node.

NVML is the injected stand-in from the unit tests (this machine has no GPU); Kafka is real.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from pipeline.commands.probe import EXIT_CHECK_FAILED, probe_loop
from pipeline.ingest.probe import read_boot_id
from schemas.records import HealthCheckResult, Severity
from tests.unit.test_probe import FakeNvml, hgx

pytestmark = pytest.mark.integration


async def consume_all(bootstrap: str, topic: str) -> list[tuple[bytes | None, HealthCheckResult]]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in range(2)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        out: list[tuple[bytes | None, HealthCheckResult]] = []

        async def behind() -> bool:
            return any([await consumer.position(tp) < ends[tp] for tp in partitions])

        while await behind():
            for records in (await consumer.getmany(*partitions, timeout_ms=1000)).values():
                out.extend((r.key, HealthCheckResult.from_bytes(r.value)) for r in records)
        return out
    finally:
        await consumer.stop()


async def make_topic(bootstrap: str, name: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=2, replication_factor=1)])
    finally:
        await admin.close()


async def test_probe_once_produces_every_result_keyed_by_node(kafka_bootstrap: str, unique) -> None:
    topic, node = unique("health"), unique("gpu-node")
    await make_topic(kafka_bootstrap, topic)
    gpus = hgx(4)
    gpus[1].remapped = (0, 3, 1, 0)  # a pending row remap: reset needed
    nvml = FakeNvml(gpus)
    code = await probe_loop(
        nvml,
        node=node,
        expected_gpus=4,
        expected_nvlinks=None,
        interval_s=60,
        once=True,
        topic=topic,
        bootstrap_servers=kafka_bootstrap,
        driver_timeout_s=5,
        stop=asyncio.Event(),
    )
    assert code == EXIT_CHECK_FAILED
    assert nvml.shutdowns == 1
    got = await consume_all(kafka_bootstrap, topic)
    assert {key for key, _ in got} == {node.encode()}
    results = [r for _, r in got]
    assert len(results) == 2 + 3 * 4  # driver, gpu_count, then nvlink/ecc/remapped_rows per GPU
    assert [(r.check, r.gpu_index, r.severity) for r in results if not r.passed] == [
        ("remapped_rows", 1, Severity.ERROR)
    ]
    assert {r.node for r in results} == {node}
    assert {r.boot_id for r in results} == {read_boot_id()} != {None}


async def test_probe_loop_runs_rounds_until_stopped(kafka_bootstrap: str, unique) -> None:
    topic, node = unique("health"), unique("gpu-node")
    await make_topic(kafka_bootstrap, topic)
    stop = asyncio.Event()
    task = asyncio.create_task(
        probe_loop(
            FakeNvml(hgx(1)),
            node=node,
            expected_gpus=1,
            expected_nvlinks=None,
            interval_s=0.2,
            once=False,
            topic=topic,
            bootstrap_servers=kafka_bootstrap,
            driver_timeout_s=5,
            stop=stop,
        )
    )
    per_round = 2 + 3
    for _ in range(300):
        if len(await consume_all(kafka_bootstrap, topic)) >= 2 * per_round:
            break
        if task.done():
            task.result()
        await asyncio.sleep(0.2)
    stop.set()
    assert await asyncio.wait_for(task, 30) == 0
    results = [r for _, r in await consume_all(kafka_bootstrap, topic)]
    assert len(results) % per_round == 0 and len(results) >= 2 * per_round
    assert all(r.passed for r in results)
