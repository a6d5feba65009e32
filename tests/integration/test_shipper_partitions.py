"""Where the real shippers put a node's lines, against what the project assumes of them.

The shipped Fluent Bit configuration and rsyslog recipe key every record by node and name librdkafka's
``murmur2_random`` partitioner, so that a node's lines land on the partition Kafka's default partitioner
(murmur2, which aiokafka uses for ``xidflow loki-tail``, the probe and every stage) gives that node. That is
a claim about what librdkafka will do, so it is asked of the real programs: each record's key is its node and
its partition is the one aiokafka's ``DefaultPartitioner`` computes for that key.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from pipeline.kafka.admin import ensure_topics
from pipeline.localinfra.fluentbit_run import FluentBit, Render
from pipeline.runtime.settings import TopicNames

pytestmark = pytest.mark.integration

PARTITIONS = 12
XID_79 = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


async def records_by_partition(bootstrap: str, topic: str, want: int, within_s: float = 60.0
                               ) -> dict[int, list[tuple[bytes | None, bytes]]]:
    """(key, value) of every record on ``topic`` by partition, once at least ``want`` have arrived."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        out: dict[int, list[tuple[bytes | None, bytes]]] = defaultdict(list)
        deadline = asyncio.get_running_loop().time() + within_s
        while sum(len(v) for v in out.values()) < want:
            assert asyncio.get_running_loop().time() < deadline, f"{sum(len(v) for v in out.values())} of {want}"
            for tp, batch in (await consumer.getmany(*parts, timeout_ms=500)).items():
                out[tp.partition] += [(r.key, r.value) for r in batch]
        return out
    finally:
        await consumer.stop()


def kafka_partition(key: bytes) -> int:
    every = list(range(PARTITIONS))
    return DefaultPartitioner()(key, every, every)


async def test_fluent_bit_puts_each_nodes_lines_where_kafkas_default_partitioner_does(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    topics = TopicNames(prefix=f"t-fbpart-{uuid.uuid4().hex[:6]}-")
    kernel_topic = topics.name("logs_kernel")
    await ensure_topics(kafka_bootstrap, [kernel_topic, topics.name("logs_pods")], PARTITIONS)
    # Enough nodes that a partitioner other than murmur2 (librdkafka's default hashes keys with CRC32) would
    # put some of them elsewhere.
    nodes = [f"gpu-part-{n}-{uuid.uuid4().hex[:4]}" for n in range(8)]
    assert len({kafka_partition(n.encode()) for n in nodes}) > 1
    daemons = []
    try:
        for node in nodes:
            root = tmp_path / node
            fb = FluentBit(root, node, kafka_bootstrap, Render(root=root, kernel_topic=kernel_topic,
                                                               pods_topic=topics.name("logs_pods")))
            fb.write("kern.log", f"[  538441.007373] {XID_79}")
            daemons.append(fb.start())
        got = await records_by_partition(kafka_bootstrap, kernel_topic, want=len(nodes))
    finally:
        for fb in daemons:
            fb.stop()
    seen = set()
    for partition, records in got.items():
        for key, value in records:
            node = orjson.loads(value)["node"]
            assert key == node.encode(), (key, node)
            assert partition == kafka_partition(key), f"{node}: Fluent Bit put it on {partition}, " \
                f"Kafka's default partitioner on {kafka_partition(key)}"
            seen.add(node)
    assert seen == set(nodes)
