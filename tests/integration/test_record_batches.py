"""The aggregation's record batches land on the broker as ``send`` would have put them, record by record.

``pipeline.kafka.record_batches.RecordBatches`` replaces one ``send`` per incident with one record batch
per partition. On a real broker: each record is on the partition the producer's partitioner gives its
key, each partition's records are in the order they were added (across full batches, and around a
record too large for a batch, which goes alone as before), and every delivery is acknowledged.
"""

from __future__ import annotations

import uuid
from collections import defaultdict

import pytest
from aiokafka import TopicPartition
from aiokafka.partitioner import DefaultPartitioner

from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.partitioner import KeyPartitioner
from pipeline.kafka.record_batches import RecordBatches

pytestmark = pytest.mark.integration

PARTITIONS = 4
BATCH_BYTES = 16 << 10  # small, so that a partition fills several batches


async def test_records_land_per_key_partition_in_the_order_added(kafka_bootstrap: str) -> None:
    topic = f"t-recbatch-{uuid.uuid4().hex[:8]}"
    await ensure_topics(kafka_bootstrap, [topic], PARTITIONS)
    producer = kafka_clients.producer(bootstrap=kafka_bootstrap, acks="all", max_batch_size=BATCH_BYTES)
    await producer.start()
    added: list[tuple[bytes, bytes]] = []
    try:
        batches = RecordBatches(producer, KeyPartitioner(), BATCH_BYTES)
        for i in range(300):
            key = f"node-{i % 37:03d}".encode()
            value = f"{i:05d}".encode() + b"x" * 200
            if i == 150:
                value = f"{i:05d}".encode() + b"L" * (BATCH_BYTES + 1)  # too large for a batch: sent alone
            await batches.add(topic, key, value)
            added.append((key, value))
        deliveries = await batches.send_all()
        for delivery in deliveries:
            await delivery  # every batch (and the record sent alone) acknowledged
    finally:
        await producer.stop()

    consumer = kafka_clients.consumer(bootstrap=kafka_bootstrap, auto_offset_reset="earliest",
                                      enable_auto_commit=False, group_id=None)
    await consumer.start()
    got: dict[int, list[tuple[bytes, bytes]]] = defaultdict(list)
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        while sum(len(v) for v in got.values()) < len(added):
            for tp, records in (await consumer.getmany(timeout_ms=5000)).items():
                got[tp.partition] += [(r.key, r.value) for r in records]
    finally:
        await consumer.stop()

    # Where Kafka's default partitioner (``send``'s) puts each key, in the order added.
    default = DefaultPartitioner()
    expected: dict[int, list[tuple[bytes, bytes]]] = defaultdict(list)
    for key, value in added:
        expected[default(key, list(range(PARTITIONS)), list(range(PARTITIONS)))].append((key, value))
    assert dict(got) == dict(expected)
