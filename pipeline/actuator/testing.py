"""Helpers for integration tests and benchmarks against a real control plane and a real Kafka.

Nodes are registered as KWOK's (KWOK is their kubelet); what the machines under them do (GPUs, boot
ids, reboots, kernel lines, going silent) is simulated in :mod:`pipeline.actuator.machines`, whose
helpers are re-exported here for the tests and benchmarks that import them from this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from aiokafka import TopicPartition

from pipeline.actuator.kube import Kube
from pipeline.actuator.machines import (
    GPU_ALLOCATABLE,
    GPU_CAPACITY,
    GPU_LABELS,
    XID79_LINE,
    create_nodes,
    delete_nodes,
    node_object,
    node_status,
    reboot,
    resume_heartbeats,
    set_node_ready,
    stop_heartbeats,
    wait_nodes_usable,
)
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka import upstream
from schemas.records import Action, FaultKind, NodeIncident, RemediationRecord, Severity

__all__ = [
    "GPU_ALLOCATABLE", "GPU_CAPACITY", "GPU_LABELS", "XID79_LINE", "XIDFLOW_EVENT_SOURCE", "create_nodes",
    "delete_nodes", "make_incident", "node_events", "node_object", "node_status", "object_events", "publish",
    "read_audit", "read_topic", "reboot", "resume_heartbeats", "set_node_ready", "stop_heartbeats",
    "wait_nodes_usable", "wait_until", "webhook_receiver",
]


def make_incident(
    node: str,
    incident_id: str,
    code: int = 79,
    action: Action = Action.REBOOT_NODE,
    kind: FaultKind = FaultKind.XID,
) -> NodeIncident:
    now = datetime.now(UTC)
    return NodeIncident(
        incident_id=incident_id,
        node=node,
        signature=f"{kind.value}:{code}:0000:4e:00.0",
        kind=kind,
        code=code,
        pci="0000:4e:00.0",
        first_seen=now,
        last_seen=now,
        severity=Severity.CRITICAL,
        action=action,
        quarantine=action.quarantines,
        line=XID79_LINE if code == 79 else f"NVRM: Xid (PCI:0000:4e:00): {code}, test",
    )


async def publish(bootstrap: str, topic: str, records: Iterable[Any]) -> None:
    producer = kafka_clients.producer(bootstrap=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        futures = [
            await producer.send(topic, r.to_bytes(), key=(getattr(r, "node", None) or r.node_name).encode())
            for r in records
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def read_audit(bootstrap: str, topic: str, settle_s: float = 1.0) -> list[RemediationRecord]:
    """Every record on the audit topic so far (no group: reads from the beginning)."""
    return [RemediationRecord.from_bytes(m.value) for m in await read_topic(bootstrap, topic, settle_s)]


async def read_topic(bootstrap: str, topic: str, settle_s: float = 1.0) -> list[Any]:
    """Every Kafka record on a topic so far, as the consumer gives them (headers too); no group, from the beginning."""
    consumer = kafka_clients.consumer(bootstrap=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        parts = consumer.partitions_for_topic(topic) or set()
        if not parts:
            await upstream.refresh_metadata(consumer)
            parts = consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in parts]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        out: list[Any] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            positions = [await consumer.position(tp) for tp in tps]
            if all(pos >= end[tp] for pos, tp in zip(positions, tps, strict=True)):
                break
            batch = await consumer.getmany(timeout_ms=int(settle_s * 1000))
            for messages in batch.values():
                out += messages
        return out
    finally:
        await consumer.stop()


@contextlib.asynccontextmanager
async def webhook_receiver(path: str, handler: Callable[[Any], Awaitable[Any]]) -> AsyncIterator[str]:
    """An HTTP server on loopback for a test's webhook (aiohttp ``handler`` for POST ``path``); yields its URL."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}{path}"
    finally:
        await runner.cleanup()


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], limit_s: float = 30, poll: float = 0.1, what: str = "condition"
) -> None:
    deadline = time.monotonic() + limit_s
    while not await predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached within {limit_s:g}s")
        await asyncio.sleep(poll)


XIDFLOW_EVENT_SOURCE = "xidflow-actuator"


async def object_events(kube: Kube, namespace: str, name: str) -> list[dict[str, Any]]:
    """The Events xidflow's actuator wrote about the object ``name`` in ``namespace``. The cluster writes its own
    about the same objects (the scheduler's ``Scheduled``, the node lifecycle controller's ``RegisteredNode``,
    KWOK's): those are not xidflow's effects."""
    selector = f"involvedObject.name={name},source={XIDFLOW_EVENT_SOURCE}"
    page = await kube._call(kube.core.list_namespaced_event, namespace, field_selector=selector)
    return page.get("items") or []


async def node_events(kube: Kube, node: str) -> list[dict[str, Any]]:
    """The Events xidflow's actuator wrote about the node (see ``object_events``)."""
    return await object_events(kube, "default", node)
