"""The session's control plane is a cluster's: the scheduler places pods, KWOK runs them on the nodes it manages,
the disruption controller keeps PDB status, the Job controller follows Job pods that KWOK ends, and the node
lifecycle controller judges heartbeats. Each test watches one of them do its part (nothing here writes a status
that one of them owns)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client

from pipeline.actuator.kube import Kube, TooManyRequests
from pipeline.actuator.machines import (
    UNREADY_TAINTS,
    boot_id_of,
    create_nodes,
    delete_nodes,
    node_usable,
    reboot,
    resume_heartbeats,
    stop_heartbeats,
)
from pipeline.localinfra.kwok import POD_COMPLETE_LABEL
from tests.conftest import NODE_MONITOR_GRACE_S
from tests.integration.workloads import (
    deployment,
    ensure_ns,
    job,
    list_pods,
    pdb,
    pods_on,
    wait_job,
    wait_running,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


class World:
    def __init__(self, kube: Kube, unique: Callable[[str], str]) -> None:
        self.kube, self.unique = kube, unique
        self.fleet = {"xidflow.test/fleet": unique("fleet")}
        self.namespace = unique("ns")
        self.nodes: list[str] = []

    async def make_nodes(self, count: int) -> list[str]:
        names = [self.unique("gpu") for _ in range(count)]
        self.nodes += names
        await create_nodes(self.kube, names, self.fleet, gpu=True)
        return names


@pytest.fixture
async def world(kubeconfig: str, unique: Callable[[str], str]) -> AsyncIterator[World]:
    kube = Kube.from_config(kubeconfig, 8)
    w = World(kube, unique)
    await ensure_ns(kube, w.namespace)
    yield w
    await delete_nodes(kube, w.nodes)
    await kube._call(kube.core.delete_namespace, w.namespace)
    kube.close()


async def test_a_deployment_is_scheduled_and_run_by_kwok_on_its_nodes(world: World) -> None:
    nodes = await world.make_nodes(2)
    apps = client.AppsV1Api(world.kube.api_client)
    labels = {"app": "train"}
    body = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "train"},
            "spec": {"replicas": 2, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": {
                         "nodeSelector": world.fleet,
                         "containers": [{"name": "c", "image": "busybox",
                                         "resources": {"limits": {"nvidia.com/gpu": "8"}}}]}}}}
    started = time.monotonic()
    await world.kube._call(apps.create_namespaced_deployment, world.namespace, body)
    names = await wait_running(world.kube, world.namespace, labels, 2)
    took = time.monotonic() - started
    pods = {p["metadata"]["name"]: p for p in await list_pods(world.kube, world.namespace, labels)}
    # The scheduler spread them: each needs all 8 GPUs of a node (the capacity the machine registered).
    assert sorted(pods[n]["spec"]["nodeName"] for n in names) == sorted(nodes)
    for name in names:
        status = pods[name]["status"]
        assert status["podIP"].startswith("10.244.")  # KWOK's pod range: KWOK ran it
        assert {c["type"]: c["status"] for c in status["conditions"]}["PodScheduled"] == "True"
    for node in nodes:
        lease = await world.kube._call(client.CoordinationV1Api(world.kube.api_client).read_namespaced_lease,
                                       node, "kube-node-lease")
        assert lease["spec"]["holderIdentity"]  # KWOK renews the node's Lease, as a kubelet does
    print(f"deployment of 2 GPU pods scheduled and running in {took:.1f}s")


async def test_a_pdbs_status_is_the_disruption_controllers_and_the_eviction_api_obeys_it(world: World) -> None:
    (node,) = await world.make_nodes(1)
    labels = {"app": "guarded"}
    names = await deployment(world.kube, world.namespace, "guarded", node, 2, labels)
    status = await pdb(world.kube, world.namespace, "guard", labels, min_available=1)
    assert (status["currentHealthy"], status["desiredHealthy"], status["expectedPods"]) == (2, 1, 2)
    assert status["disruptionsAllowed"] == 1
    await world.kube.patch_node(node, {"spec": {"unschedulable": True}})  # replacements cannot land here
    await world.kube.evict_pod(world.namespace, names[0], None)

    async def budget_spent() -> dict[str, Any]:
        policy = client.PolicyV1Api(world.kube.api_client)
        deadline = time.monotonic() + 60
        while True:
            found = await world.kube._call(policy.read_namespaced_pod_disruption_budget, "guard", world.namespace)
            if (found.get("status") or {}).get("disruptionsAllowed") == 0:
                return found["status"]
            assert time.monotonic() < deadline, found.get("status")
            await asyncio.sleep(0.2)

    spent = await budget_spent()
    assert spent["currentHealthy"] == 1
    with pytest.raises(TooManyRequests):  # the API server's eviction handler reads the controller's status
        await world.kube.evict_pod(world.namespace, names[1], None)
    assert await pods_on(world.kube, node) == [names[1]]
    # The ReplicaSet replaced the evicted pod; the scheduler keeps it off the cordoned node: Pending, unbound.
    pending = [p for p in await list_pods(world.kube, world.namespace, labels) if p["metadata"]["name"] not in names]
    assert len(pending) == 1 and not pending[0]["spec"].get("nodeName")
    assert pending[0]["status"]["phase"] == "Pending"


async def test_a_node_whose_machine_goes_silent_becomes_unreachable_and_comes_back(world: World) -> None:
    """Taking a node away from KWOK is a machine that stopped answering: nothing renews its Lease. The node
    lifecycle controller marks it Unknown and taints it unreachable after its grace period
    (``NODE_MONITOR_GRACE_S`` in this session); the node left with KWOK stays Ready and untainted."""
    silent, healthy = await world.make_nodes(2)
    await stop_heartbeats(world.kube, silent)
    stopped = time.monotonic()

    async def unreachable() -> dict[str, Any]:
        deadline = stopped + NODE_MONITOR_GRACE_S + 60
        while True:
            node = await world.kube.get_node(silent)
            taints = {(t["key"], t["effect"]) for t in node["spec"].get("taints") or []}
            if ("node.kubernetes.io/unreachable", "NoExecute") in taints:
                return node
            assert time.monotonic() < deadline, node["spec"].get("taints")
            await asyncio.sleep(0.5)

    node = await unreachable()
    took = time.monotonic() - stopped
    assert took >= NODE_MONITOR_GRACE_S - 1  # not before the grace period
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "Unknown" and ready["reason"] == "NodeStatusUnknown"
    assert {(t["key"], t["effect"]) for t in node["spec"]["taints"]} >= {
        ("node.kubernetes.io/unreachable", "NoSchedule"), ("node.kubernetes.io/unreachable", "NoExecute")}
    assert node_usable(await world.kube.get_node(healthy))
    await resume_heartbeats(world.kube, silent)

    async def back() -> None:
        deadline = time.monotonic() + 60
        while not node_usable(await world.kube.get_node(silent)):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.5)

    await back()
    taints = (await world.kube.get_node(silent))["spec"].get("taints") or []
    assert not [t for t in taints if t["key"] in UNREADY_TAINTS]
    print(f"silent node unreachable after {took:.1f}s (grace {NODE_MONITOR_GRACE_S}s)")


async def test_jobs_are_run_by_the_job_controller_and_ended_by_kwok_as_their_pods_ask(world: World) -> None:
    (node,) = await world.make_nodes(1)
    ns, kube = world.namespace, world.kube
    await job(kube, ns, "done", node, {"job": "done"})
    await job(kube, ns, "keeps-running", node, {"job": "keeps"}, complete=False)
    await job(kube, ns, "fails", node, {"job": "fails"}, fail=True)
    done = await wait_job(kube, ns, "done", "Complete")
    assert done["status"]["succeeded"] == 1
    failed = await wait_job(kube, ns, "fails", "Failed")
    assert failed["status"]["failed"] == 1
    # The pod labelled to keep running is Running, its Job active, after its siblings have ended.
    (running,) = await wait_running(kube, ns, {"job": "keeps"}, 1, node)
    keeps = await kube.get_job(ns, "keeps-running")
    assert keeps["status"].get("active") == 1 and not keeps["status"].get("succeeded")
    # Lifting the label lets KWOK complete it (the job finished its work): the Job controller marks it Complete.
    await kube._call(kube.core.patch_namespaced_pod, running, ns, {"metadata": {"labels": {POD_COMPLETE_LABEL: None}}})
    assert (await wait_job(kube, ns, "keeps-running", "Complete"))["status"]["succeeded"] == 1


async def test_a_reboot_is_a_new_boot_id_that_kwok_keeps_and_our_conditions_survive(world: World) -> None:
    (node,) = await world.make_nodes(1)
    assert boot_id_of(await world.kube.get_node(node)) == "boot-1"  # what the machine registered, kept by KWOK
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    ours = {"type": "GpuFellOffBus", "status": "True", "reason": "XidError", "message": "xid 79",
            "lastTransitionTime": now, "lastHeartbeatTime": now}
    await world.kube.patch_node_status(node, {"status": {"conditions": [ours]}})
    await reboot(world.kube, node, "boot-2")
    after = await world.kube.get_node(node)
    assert boot_id_of(after) == "boot-2" and node_usable(after)
    conditions = {c["type"]: c for c in after["status"]["conditions"]}
    assert conditions["Ready"]["reason"] == "KubeletReady"  # KWOK's node-initialize made it Ready again
    assert conditions["GpuFellOffBus"]["status"] == "True"  # merged by type: another writer's condition stays
