"""An idle parse stage waits long for records (``parse_stage.poll_wait_ms``), on a real broker.

Idle (nothing on a clock), its ``getmany`` may wait longer than the configured poll: records must still
end that wait and be processed, each once, with their offsets committed, and ``stop()`` must end the
stage while it waits. No timing is asserted: what the wait saves is measured by the bench.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import orjson
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition

from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from pipeline.runtime.liveness import LIVENESS
from pipeline.runtime.settings import TopicNames
from tests.integration.test_pipeline import XID, kmsg

pytestmark = pytest.mark.integration

LINE = XID.format(bus="4e", code=79, text="GPU has fallen off the bus.")


async def test_an_idle_stage_takes_each_record_once_commits_it_and_stops_while_waiting(private_kafka) -> None:
    from pipeline.detection.parse_settings import ParseSettings
    from pipeline.detection.parse_stage import ParseStage

    bootstrap = private_kafka(1).bootstrap
    tag = uuid.uuid4().hex[:6]
    topics = TopicNames(prefix=f"t-idle-{tag}-")
    raw = topics.name("logs_kernel")
    await ensure_topics(bootstrap, [raw, topics.name("fault_events"), topics.name("deadletter")], 1)
    group = f"idle-{tag}"
    # The bench's poll: without the idle wait, 200 empty turns a second.
    stage = ParseStage(bootstrap, group, topics=topics, settings=ParseSettings(poll_timeout_ms=5), input_topics=[raw])
    task = asyncio.ensure_future(stage.run())
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    reader = kafka_clients.consumer(topics.name("fault_events"), bootstrap=bootstrap, auto_offset_reset="earliest")
    await producer.start()
    await reader.start()
    seen: list[str] = []

    async def until_seen(count: int) -> None:
        deadline = time.monotonic() + 60
        while len(seen) < count:
            assert not task.done(), task.exception() if task.done() else None
            assert time.monotonic() < deadline, seen
            for records in (await reader.getmany(timeout_ms=200)).values():
                seen.extend(orjson.loads(r.value)["node"] for r in records)

    nodes = [f"idle-{tag}-{i}" for i in range(3)]
    try:
        for i, node in enumerate(nodes):
            await producer.send_and_wait(raw, kmsg(node, LINE, time.time()), key=node.encode())
            await until_seen(i + 1)
            # The stage's settle is done: it is quiet now, and the next record finds it in its idle wait.
            while not stage._quiet():
                assert not task.done(), task.exception() if task.done() else None
                await asyncio.sleep(0.05)
            await asyncio.sleep(1)
        stage.stop()
        counters = await asyncio.wait_for(task, 30)
    finally:
        await producer.stop()
        await reader.stop()
        if not task.done():
            task.cancel()
        LIVENESS.remove(stage.live.name)
    assert seen == nodes
    assert counters.events == len(nodes)
    admin = kafka_clients.consumer(bootstrap=bootstrap, group_id=group, enable_auto_commit=False)
    await admin.start()
    try:
        tp = TopicPartition(raw, 0)
        assert await admin.committed(tp) == (await admin.end_offsets([tp]))[tp]
    finally:
        await admin.stop()
