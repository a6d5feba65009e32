"""Co-partitioning of the worker's state: fault events, ticks and the node-state changelog.

The aggregation keeps a node's state in the changelog partition of the record it processed
(``pipeline.app.NodeStateTable``), so ``gpu.fault.events``, the ticks topic and the changelog must
have the same partition count: with different counts a node's state would be restored to a worker
that does not receive the node's events. The worker checks at start and refuses to run otherwise.

``mismatch`` is the pure rule; ``prepare`` is the I/O: it creates the missing co-partitioned topics
with the fault-event topic's count (the changelog is left to Faust, which creates it with the
table's count), then checks what the broker has.
"""

from __future__ import annotations

from pipeline.kafka import clients as kafka_clients


def ticks_topic_name(app_id: str) -> str:
    """The worker's own topic of quiet-period ticks (created by ``xidflow worker``; ``pipeline.app`` declares it)."""
    return f"{app_id}-ticks"


NODE_STATE_TABLE = "node-state"


def changelog_topic_name(app_id: str) -> str:
    """The node-state table's changelog topic (Faust's ``<app id>-<table>-changelog``)."""
    return f"{app_id}-{NODE_STATE_TABLE}-changelog"


class CopartitionError(Exception):
    """The co-partitioned topics have different partition counts."""


def copartitioned_topics(app_id: str, fault_events: str) -> list[str]:
    """Topics that must share a partition count, the authoritative one (fault events) first."""
    return [fault_events, ticks_topic_name(app_id), changelog_topic_name(app_id)]


def mismatch(counts: dict[str, int | None]) -> str | None:
    """The error for topics (name -> partition count, None: not created yet) that disagree, else None."""
    present = {name: n for name, n in counts.items() if n is not None}
    if len(set(present.values())) <= 1:
        return None
    listed = ", ".join(f"{name}={n}" for name, n in present.items())
    return (
        f"topics are not co-partitioned: {listed} partitions. The node-state table keeps a node's state in "
        "the changelog partition of its fault events, so these topics must have the same partition count; "
        "give them the count of the first (add partitions, or delete and recreate the worker's own topics)."
    )


def target_partitions(counts: dict[str, int | None], configured: int) -> int:
    """The count new co-partitioned topics get: the first existing one's (fault events first), else ``configured``."""
    for n in counts.values():
        if n is not None:
            return n
    return configured


async def partition_counts(bootstrap: str, names: list[str]) -> dict[str, int | None]:
    """Partition count per topic as the broker has it (None where the topic does not exist)."""
    admin = kafka_clients.admin(bootstrap)
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        counts: dict[str, int | None] = dict.fromkeys(names)
        wanted = [n for n in names if n in existing]
        if wanted:
            for topic in await admin.describe_topics(wanted):
                if topic.get("topic") in counts and topic.get("partitions"):
                    counts[topic["topic"]] = len(topic["partitions"])
        return counts
    finally:
        await admin.close()


async def prepare(bootstrap: str, names: list[str], partitions: int, replication_factor: int = 1) -> int:
    """Create the missing co-partitioned topics but the changelog (last), check, return the shared count.

    Raises ``CopartitionError`` naming the topics and their counts when they disagree.
    """
    from pipeline.kafka.admin import ensure_topics

    counts = await partition_counts(bootstrap, names)
    target = target_partitions(counts, partitions)
    missing = [n for n in names[:-1] if counts[n] is None]
    if missing:
        await ensure_topics(bootstrap, missing, target, replication_factor)
        counts = await partition_counts(bootstrap, names)
    error = mismatch(counts)
    if error:
        raise CopartitionError(error)
    return target_partitions(counts, partitions)
