"""The bench's broker counters (``pipeline.benchmarks.kafkameter``) read from the session's real broker.

``KafkaMeter.java`` names JMX MBeans of the broker; a name the broker does not have reads as nothing, and the
cost keys would say the pipeline asked nothing of Kafka. So: attach to the real broker, produce known
records, and the broker's own counts must have moved by at least what was sent (other tests of the session
share the broker, so at least, not exactly).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pipeline.benchmarks import kafkameter
from pipeline.benchmarks.burst_world import infra_pids
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def test_the_meter_reads_the_brokers_own_request_and_byte_counts(
    kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str],
) -> None:
    pid = infra_pids(kubeconfig).get("kafka")
    assert pid is not None, "the session's broker was not started by this session (endpoints from the environment)"
    topic = unique("meter")
    await ensure_topics(kafka_bootstrap, [topic], partitions=1)
    meter = kafkameter.KafkaMeter(pid)
    assert await meter.start(), "could not attach to the broker's JVM"
    producer = kafka_clients.producer(bootstrap=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        before = await meter.read()
        value, sends = b"x" * 10_000, 5
        for _ in range(sends):
            await producer.send_and_wait(topic, value)  # one Produce request each
        after = await meter.read()
    finally:
        await producer.stop()
        await meter.stop()
    assert before is not None and after is not None
    d = kafkameter.delta(before, after, sends)
    assert d["requests"].get("Produce", 0) >= sends, d
    assert d["bytes_in"] >= sends * len(value), d  # record bytes, as the broker counts them
    assert d["net_in"] >= d["bytes_in"] and d["net_out"] > 0, d  # whole requests and responses on its sockets
    assert d["requests_total"] >= d["requests"]["Produce"]
