"""Helpers for integration tests and benchmarks against a real API server and a real Kafka.

Fake GPU nodes are Node objects created through the API (as KWOK does): there is no kubelet, so
their Ready condition and bootID are set through the status subresource.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from aiokafka import TopicPartition

from pipeline.actuator.kube import AlreadyExists, Kube, NotFound
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka import upstream
from schemas.records import Action, FaultKind, NodeIncident, RemediationRecord, Severity

XID79_LINE = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


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


GPU_LABELS = {
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.count": "8",
}
"""What GPU feature discovery puts on an 8-GPU node (the demo fleet's labels)."""
GPU_CAPACITY = {"nvidia.com/gpu": "8", "cpu": "96", "memory": "1048576Mi", "pods": "110"}
GPU_ALLOCATABLE = {"nvidia.com/gpu": "8", "cpu": "94", "memory": "1000000Mi", "pods": "110"}


def node_status(boot_id: str, ready: bool = True, gpu: bool = False, now: str | None = None) -> dict[str, Any]:
    """The status a kubelet reports: Ready, the boot id, and with ``gpu`` 8 GPUs of capacity. Pure."""
    now = now or datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    status: dict[str, Any] = {
        "conditions": [
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "reason": "KubeletReady" if ready else "KubeletNotReady",
                "message": "set by xidflow tests",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
        ],
        "nodeInfo": {
            "bootID": boot_id,
            "machineID": "m",
            "systemUUID": "s",
            "kernelVersion": "k",
            "osImage": "o",
            "containerRuntimeVersion": "c",
            "kubeletVersion": "v1.0.0",
            "kubeProxyVersion": "v1.0.0",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }
    if gpu:
        status["capacity"], status["allocatable"] = dict(GPU_CAPACITY), dict(GPU_ALLOCATABLE)
    return status


def node_object(name: str, labels: dict[str, str], boot_id: str = "boot-1", gpu: bool = False) -> dict[str, Any]:
    """A Node as a kubelet (or KWOK) registers it: labels and status in the create call. Pure."""
    gpu_labels = {**GPU_LABELS, "kubernetes.io/hostname": name} if gpu else {}
    all_labels = {**gpu_labels, **labels}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": all_labels},
        "status": node_status(boot_id, gpu=gpu),
    }


async def set_node_ready(kube: Kube, name: str, boot_id: str, ready: bool = True) -> None:
    await kube.patch_node_status(name, {"status": node_status(boot_id, ready)})


async def create_nodes(
    kube: Kube,
    names: Iterable[str],
    labels: dict[str, str],
    boot_id: str = "boot-1",
    parallel: int = 32,
    gpu: bool = False,
    progress: Callable[[int], None] | None = None,
    body: Callable[[str], dict[str, Any]] | None = None,
) -> None:
    """Create Ready nodes, one call each with their status (as a kubelet registers, and KWOK creates).

    A node that exists already is reported Ready with ``boot_id``. ``gpu``: GPU labels and capacity.
    ``progress(n)`` is called with the count of nodes done so far, every 100 nodes and at the end.
    ``body(name)``: the Node to create instead of ``node_object``'s (e.g. one made like another node).
    """
    sem = asyncio.Semaphore(parallel)
    done = 0

    async def one(name: str) -> None:
        nonlocal done
        async with sem:
            try:
                node = body(name) if body is not None else node_object(name, labels, boot_id, gpu)
                await kube._call(kube.core.create_node, node)
            except AlreadyExists:
                await set_node_ready(kube, name, boot_id)
        done += 1
        if progress is not None and done % 100 == 0:
            progress(done)

    await asyncio.gather(*(one(n) for n in names))
    if progress is not None:
        progress(done)


async def delete_nodes(kube: Kube, names: Iterable[str], parallel: int = 32) -> None:
    sem = asyncio.Semaphore(parallel)

    async def one(name: str) -> None:
        async with sem:
            try:
                await kube._call(kube.core.delete_node, name)
            except NotFound:
                pass

    await asyncio.gather(*(one(n) for n in names))


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
        out: list[RemediationRecord] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            positions = [await consumer.position(tp) for tp in tps]
            if all(pos >= end[tp] for pos, tp in zip(positions, tps, strict=True)):
                break
            batch = await consumer.getmany(timeout_ms=int(settle_s * 1000))
            for messages in batch.values():
                out += [RemediationRecord.from_bytes(m.value) for m in messages]
        return out
    finally:
        await consumer.stop()


async def wait_until(
    predicate: Callable[[], Awaitable[bool]], limit_s: float = 30, poll: float = 0.1, what: str = "condition"
) -> None:
    deadline = time.monotonic() + limit_s
    while not await predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} not reached within {limit_s:g}s")
        await asyncio.sleep(poll)


async def node_events(kube: Kube, node: str) -> list[dict[str, Any]]:
    page = await kube._call(kube.core.list_namespaced_event, "default", field_selector=f"involvedObject.name={node}")
    return page.get("items") or []
