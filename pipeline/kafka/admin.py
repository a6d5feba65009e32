"""Kafka administration shared by the worker, the actuator, the demo, the benchmarks and the tests."""

from __future__ import annotations

import logging

from aiokafka.admin import NewTopic

from pipeline.kafka import clients as kafka_clients
from pipeline.runtime.settings import KafkaSettings

log = logging.getLogger("xidflow.kafka_admin")


async def ensure_topics(bootstrap: str, names: list[str], partitions: int, replication_factor: int = 1,
                        settings: KafkaSettings | None = None) -> int:
    """Create missing topics; return the partition count of the first one (existing or created).

    The broker's auto-creation would make one-partition topics, which would break the node-keyed
    co-partitioning of fault events and the node-state changelog.
    """
    admin = kafka_clients.admin(bootstrap=bootstrap, settings=settings)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [n for n in dict.fromkeys(names) if n not in existing]
        if missing:
            try:
                await admin.create_topics(
                    [NewTopic(n, num_partitions=partitions, replication_factor=replication_factor) for n in missing]
                )
            except Exception as exc:  # noqa: BLE001 - a concurrent worker may have created them first
                log.info("create_topics: %s", exc)
        described = await admin.describe_topics([names[0]])
        for topic in described:
            if topic.get("topic") == names[0] and topic.get("partitions"):
                return len(topic["partitions"])
        return partitions
    finally:
        await admin.close()
