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
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
from aiokafka.errors import for_code
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Boolean, Bytes, Int16, Int32, Schema, String

log = logging.getLogger("xidflow.group")


def leave_on_close(consumer: AIOKafkaConsumer | None) -> None:
    """Make ``consumer.stop()`` send LeaveGroup even though the consumer is a static member.

    aiokafka's coordinator skips the LeaveGroup only while it has a group instance id; the id is no
    longer needed once the consumer is closing (it was used to join). A consumer that never joined
    a group is left alone.
    """
    coordinator: Any = getattr(consumer, "_coordinator", None)
    if coordinator is None or getattr(coordinator, "_group_instance_id", None) is None:
        return
    log.info("leaving group %s as static member %s", coordinator.group_id, coordinator._group_instance_id)
    coordinator._group_instance_id = None


def faust_consumer(app: Any) -> AIOKafkaConsumer | None:
    """The aiokafka consumer behind a started Faust app's consumer (None before it started)."""
    thread = getattr(getattr(app, "_consumer", None), "_thread", None)
    return getattr(thread, "_consumer", None)


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


class _DescribeGroupsResponseV4(Response):
    API_KEY = 15
    API_VERSION = 4
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "groups",
            Array(
                ("error_code", Int16),
                ("group", String("utf-8")),
                ("state", String("utf-8")),
                ("protocol_type", String("utf-8")),
                ("protocol", String("utf-8")),
                (
                    "members",
                    Array(
                        ("member_id", String("utf-8")),
                        ("group_instance_id", String("utf-8")),
                        ("client_id", String("utf-8")),
                        ("client_host", String("utf-8")),
                        ("member_metadata", Bytes),
                        ("member_assignment", Bytes),
                    ),
                ),
                ("authorized_operations", Int32),
            ),
        ),
    )


class _DescribeGroupsRequestV4(RequestStruct):
    API_KEY = 15
    API_VERSION = 4
    RESPONSE_TYPE = _DescribeGroupsResponseV4
    SCHEMA = Schema(("groups", Array(String("utf-8"))), ("include_authorized_operations", Boolean))


class _DescribeGroups(Request[_DescribeGroupsRequestV4]):
    """aiokafka describes groups up to v3, which lacks the members' group.instance.id (added in v4)."""

    API_KEY = 15

    def __init__(self, groups: list[str]) -> None:
        self._groups = groups

    def build(self, request_struct_class: type[_DescribeGroupsRequestV4]) -> _DescribeGroupsRequestV4:
        return request_struct_class(self._groups, False)


def _partitions(assignment: bytes | None) -> tuple[tuple[str, int], ...]:
    if not assignment:
        return ()
    decoded = ConsumerProtocolMemberAssignment.decode(assignment)
    return tuple(sorted((t, p) for t, parts in decoded.assignment for p in parts))


async def describe_group(bootstrap: str, group: str) -> GroupView:
    """The group's state and members, each with its group.instance.id and assigned partitions."""
    from pipeline import kafka_clients

    admin = kafka_clients.admin(bootstrap)
    await admin.start()
    try:
        node = await admin.find_coordinator(group)
        response = await admin._send_request(_DescribeGroups([group]), node)
    finally:
        await admin.close()
    for error_code, name, state, _ptype, _proto, members, _ops in response.groups:
        if name != group:
            continue
        if error_code:
            # e.g. NOT_COORDINATOR while a fresh broker loads its offsets topic: a KafkaError, retryable
            raise for_code(error_code)(f"describe group {group}")
        return GroupView(
            group=name,
            state=state,
            members=tuple(
                Member(member_id=m[0], instance_id=m[1], client_id=m[2], partitions=_partitions(m[5]))
                for m in members
            ),
        )
    raise RuntimeError(f"describe group {group}: not in the answer")
