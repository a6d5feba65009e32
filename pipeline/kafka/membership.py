"""Leaving a consumer group on an orderly shutdown, also as a static member (KIP-345).

aiokafka (like the Java client) sends no LeaveGroup when a member with a ``group_instance_id``
closes: the broker keeps the membership until the session times out, so that a member restarting
in place takes its partitions back without a rebalance. That is right after a crash and wrong for a
rolling restart or a scale-down, where the partitions should move to the other members at once.

xidflow's choice (``ConsumerGroupSettings.leave_on_shutdown``): an orderly shutdown (SIGTERM, SIGINT,
``stop()``) leaves; a crash (SIGKILL, OOM kill, lost node) sends nothing, so the restarted process,
with the same pod name, finds its membership and its partitions waiting. ``leave_on_close`` makes the
consumer's own close send the LeaveGroup (by member id, after its heartbeats stopped, so it cannot
rejoin in between); the broker removes the static member with it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import for_code

from pipeline.kafka import upstream

log = logging.getLogger("xidflow.group")


def leave_on_close(consumer: AIOKafkaConsumer | None) -> None:
    """Make ``consumer.stop()`` send LeaveGroup even though the consumer is a static member.

    A consumer that never joined a group, or a dynamic member (which leaves anyway), is left alone.
    """
    dropped = upstream.drop_static_identity(consumer)
    if dropped is not None:
        log.info("leaving group %s as static member %s", *dropped)


def faust_consumer(app: Any) -> AIOKafkaConsumer | None:
    """The aiokafka consumer behind a started Faust app's consumer (None before it started)."""
    return upstream.faust_aiokafka_consumer(app)


@dataclass(frozen=True)
class Member:
    member_id: str
    instance_id: str | None  # group.instance.id of a static member, None for a dynamic one
    client_id: str
    partitions: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class GroupView:
    """A consumer group as the broker's coordinator describes it (DescribeGroups v4)."""

    group: str
    state: str  # Stable, PreparingRebalance, CompletingRebalance, Empty, Dead
    members: tuple[Member, ...]

    def member(self, instance_id: str) -> Member | None:
        return next((m for m in self.members if m.instance_id == instance_id), None)


async def describe_group(
    bootstrap: str, group: str, admin: AIOKafkaAdminClient | None = None, coordinator: int | None = None
) -> GroupView:
    """The group's state and members, each with its group.instance.id and assigned partitions.

    ``admin``: a started admin client to ask with (left open), and ``coordinator`` the group's
    coordinator if known (else it is looked up); without a client one is made for the question, which
    costs a connection and a metadata round trip: too coarse for a watch that samples a rebalance every
    few tens of milliseconds (``pipeline.benchmarks.burst_watch.GroupWatch``).
    """
    if admin is not None:
        node = coordinator if coordinator is not None else await admin.find_coordinator(group)
        return _group_view(group, await upstream.describe_groups(admin, group, node))
    from pipeline.kafka import clients as kafka_clients
    own = kafka_clients.admin(bootstrap)
    await own.start()
    try:
        groups = await upstream.describe_groups(own, group, await own.find_coordinator(group))
    finally:
        await own.close()
    return _group_view(group, groups)


def _group_view(group: str, groups: list[Any]) -> GroupView:
    for error_code, name, state, _ptype, _proto, members, _ops in groups:
        if name != group:
            continue
        if error_code:
            # e.g. NOT_COORDINATOR while a fresh broker loads its offsets topic: a KafkaError, retryable
            raise for_code(error_code)(f"describe group {group}")
        return GroupView(
            group=name,
            state=state,
            members=tuple(
                Member(member_id=m[0], instance_id=m[1], client_id=m[2], partitions=upstream.assigned_partitions(m[5]))
                for m in members
            ),
        )
    raise RuntimeError(f"describe group {group}: not in the answer")
