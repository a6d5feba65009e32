"""The quarantine's API calls over aiohttp on the event loop, against the real API server.

They must behave as the official client's did (same bodies, same error types) and never take a call
thread: the thread hop and the client's per-call work were most of the actuator's CPU in a burst.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from kubernetes import config

from pipeline.actuator.kube import AlreadyExists, Conflict, Invalid, Kube, KubeUnavailable, NotFound
from pipeline.actuator.testing import create_nodes, delete_nodes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
async def kube(kubeconfig: str) -> AsyncIterator[Kube]:
    k = Kube.from_config(kubeconfig, 4)
    yield k
    await k.aclose()


def pool_calls(kube: Kube) -> list[str]:
    """Record every call handed to the Kube's call threads."""
    seen: list[str] = []
    submit = kube._pool.submit

    def spy(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        seen.append(getattr(getattr(fn, "func", fn), "__name__", repr(fn)))
        return submit(fn, *args, **kwargs)

    kube._pool.submit = spy  # type: ignore[method-assign]
    return seen


async def test_quarantine_calls_run_on_the_loop_with_the_clients_results_and_errors(
    kube: Kube, unique: Callable[[str], str]
) -> None:
    node = unique("gpu")
    namespace = unique("ns")
    await create_nodes(kube, [node], {"xidflow.test/http": "1"})
    await kube._call(kube.core.create_namespace, {"metadata": {"name": namespace}})
    threads = pool_calls(kube)
    try:
        read = await kube.get_node(node)
        assert read["metadata"]["name"] == node
        with pytest.raises(NotFound):
            await kube.get_node(unique("missing"))

        patched = await kube.patch_node(node, {
            "metadata": {"resourceVersion": read["metadata"]["resourceVersion"], "annotations": {"a": "b"}},
            "spec": {"unschedulable": True, "taints": [{"key": "xidflow.test/t", "effect": "NoSchedule"}]},
        })
        assert patched["spec"]["unschedulable"] is True
        assert patched["metadata"]["annotations"]["a"] == "b"
        with pytest.raises(Conflict):  # the read's resourceVersion is stale now
            await kube.patch_node(node, {"metadata": {"resourceVersion": read["metadata"]["resourceVersion"]}})
        with pytest.raises(Invalid):  # a taint without an effect: the API server refuses the request itself
            await kube.patch_node(node, {"spec": {"taints": [{"key": "xidflow.test/bad"}]}})

        condition = {"type": "XidflowHttpTest", "status": "True", "reason": "Test", "message": "m"}
        status = await kube.patch_node_status(node, {"status": {"conditions": [condition]}})
        types = {c["type"] for c in status["status"]["conditions"]}
        assert "XidflowHttpTest" in types and "Ready" in types  # merged by type, not replaced

        event = await kube.create_event(namespace, {
            "metadata": {"name": f"{node}.test"},
            "involvedObject": {"kind": "Pod", "name": "p", "namespace": namespace},
            "reason": "Test", "message": "m", "type": "Normal",
        })
        assert event["metadata"]["namespace"] == namespace
        with pytest.raises(AlreadyExists):
            await kube.create_event(namespace, {"metadata": {"name": f"{node}.test"},
                                                "involvedObject": {"kind": "Pod", "name": "p", "namespace": namespace}})

        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": namespace},
               "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]}}
        await kube._call(kube.core.create_namespaced_pod, namespace, pod)
        threads.clear()  # the pod's creation went through the official client: not a quarantine call
        assert [p["metadata"]["name"] for p in await kube.list_pods_on_node(node)] == ["p"]
        assert await kube.list_pods_on_node(unique("empty")) == []
        page = await kube.list_pods_on_node_page(node)  # where a checkpoint's pod watch starts
        assert [p["metadata"]["name"] for p in page["items"]] == ["p"] and page["metadata"]["resourceVersion"]

        cm = await kube.create_configmap(namespace, {"metadata": {"name": "state"}, "data": {"k": "1"}})
        assert (await kube.get_configmap(namespace, "state"))["data"] == {"k": "1"}
        newer = await kube.replace_configmap(namespace, "state", {**cm, "data": {"k": "2"}})
        assert newer["data"] == {"k": "2"}
        with pytest.raises(Conflict):  # written with the first version: another replica wrote since
            await kube.replace_configmap(namespace, "state", {**cm, "data": {"k": "3"}})
        assert threads == []  # none of them took a call thread
    finally:
        await kube._call(kube.core.delete_namespace, namespace)
        await delete_nodes(kube, [node])


async def test_an_unreachable_api_server_is_unavailable_not_a_crash(kubeconfig: str) -> None:
    api_client = config.new_client_from_config(config_file=kubeconfig)
    api_client.configuration.host = "https://127.0.0.1:9"  # discard port: nothing listens
    dead = Kube(api_client, 2)
    try:
        with pytest.raises(KubeUnavailable):
            await dead.get_node("any")
        with pytest.raises(KubeUnavailable):
            await dead.patch_node("any", {"spec": {"unschedulable": True}})
    finally:
        await dead.aclose()


async def test_an_eviction_whose_flow_was_cancelled_while_it_waited_for_its_thread_is_not_sent(
    kube: Kube, kubeconfig: str, unique: Callable[[str], str]
) -> None:
    """The first call of a generated API builds it (about a second of import, ``LazyApi``); a drain
    cancelled meanwhile (a person uncordoned the node) must not evict afterwards. CI caught it: the
    eviction went out after the test had relaxed the PodDisruptionBudget that had blocked it."""
    from kubernetes import client

    from pipeline.actuator.kube import LazyApi
    from tests.integration.workloads import statefulset

    node, namespace = unique("gpu"), unique("ns")
    await create_nodes(kube, [node], {"xidflow.test/http": "1"})
    await kube._call(kube.core.create_namespace, {"metadata": {"name": namespace}})
    (pod,) = await statefulset(kube, namespace, "p", node, 1, {"app": "train"})
    uid = (await kube.get_pod(namespace, pod))["metadata"]["uid"]

    def slow_build() -> Any:
        time.sleep(1.0)  # the generated module's import on a busy machine
        return client.CoreV1Api(kube.api_client)

    evicting = Kube.from_config(kubeconfig, 4)
    try:
        evicting.__dict__["core"] = LazyApi(slow_build)
        task = asyncio.ensure_future(evicting.evict_pod(namespace, pod, 0))
        await asyncio.sleep(0.3)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await asyncio.sleep(2.0)  # the build is over: an eviction still on its way would have landed
        pods = await kube.list_pods_on_node(node)
        assert [p["metadata"]["name"] for p in pods] == [pod]
        assert not pods[0]["metadata"].get("deletionTimestamp"), "evicted after the caller gave up"
        assert pods[0]["metadata"]["uid"] == uid  # the same pod, not the StatefulSet's replacement of an evicted one
    finally:
        await evicting.aclose()
        await delete_nodes(kube, [node])


def own_connections(kube: Kube) -> frozenset[int]:
    """This process's established connections to the API server, as socket inodes."""
    import os
    from urllib.parse import urlparse

    from pipeline.benchmarks.apimetrics import connections

    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                mine.add(int(target[8:-1]))
    return connections(urlparse(kube.api_client.configuration.host).port or 443) & mine


async def test_an_idle_kube_keeps_a_connection_per_call_slot_so_a_burst_opens_none(
    kubeconfig: str, unique: Callable[[str], str]
) -> None:
    # A burst after a quiet spell opened a new TLS connection per call slot, while the taints waited for
    # the API server's CPU: the slots' connections are opened before, and kept.
    node = unique("warm")
    registering = Kube.from_config(kubeconfig, 4)  # its calls open connections of its own, not the tested one's
    await create_nodes(registering, [node], {"xidflow.test/http": "1"})
    await registering.aclose()
    kube = Kube.from_config(kubeconfig, 4)
    before = own_connections(kube)
    warm = asyncio.create_task(kube.keep_warm(3600))
    try:
        for _ in range(300):
            if len(own_connections(kube) - before) >= 4:
                break
            await asyncio.sleep(0.1)
        opened = own_connections(kube)
        assert len(opened - before) >= 4
        await asyncio.gather(*(kube.get_node(node) for _ in range(4)))
        assert own_connections(kube) - opened == frozenset()
    finally:
        warm.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await warm
        await delete_nodes(kube, [node])
        await kube.aclose()
