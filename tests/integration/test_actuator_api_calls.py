"""How many kube-apiserver calls quarantining one node costs, counted on the session's control plane.

The count, not a time: a regression that adds a read or a second ledger write to the hot path fails
here, whatever the machine's speed.

Three calls per node. The node lifecycle controller answers xidflow's cordon by tainting the node
``node.kubernetes.io/unschedulable`` (TaintNodesByCondition), between xidflow's node patch and its status
patch. That status patch is conditional (it carries the ledger) and starts from the newest view of the node
the actuator has (``NodeWriter``): the watch's, once it delivered the controller's taint. Only where the
controller wrote after the watch's view and before the status patch is the patch refused (409) and sent
again, from the watch's newer view (a read only where the watch has not delivered it yet): at most one
status patch more per node, never the read and the resend on every node that starting from xidflow's own
last write cost (five calls a node).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from pipeline.actuator.app import Actuator
from pipeline.actuator.kube import Kube
from pipeline.actuator.ownership import Ledger, condition_effect_key
from pipeline.actuator.policy import PolicySet
from pipeline.actuator.settings import ActuatorSettings
from pipeline.actuator.testing import create_nodes, delete_nodes, make_incident, node_events
from pipeline.kafka.admin import ensure_topics
from pipeline.runtime.settings import KafkaSettings, TopicNames
from tests.integration.workloads import cordon_answered

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def count_calls(kube: Kube) -> collections.Counter[str]:
    """Wrap the one door every API call of ``kube`` goes through; count calls by client method name."""
    counts: collections.Counter[str] = collections.Counter()
    real = kube._call

    async def counted(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        counts[fn.__name__] += 1
        return await real(fn, *args, **kwargs)

    kube._call = counted  # type: ignore[method-assign]
    return counts


@pytest.fixture
async def world(kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]) -> AsyncIterator[dict[str, Any]]:
    tag = unique("fleet")
    topics = TopicNames(prefix=unique("t") + ".")
    await ensure_topics(kafka_bootstrap, [topics.name("remediation_audit")], partitions=1)
    kube = Kube.from_config(kubeconfig, 8)
    names = [unique("gpu") for _ in range(11)]
    await create_nodes(kube, names, {"xidflow.test/fleet": tag})
    settings = ActuatorSettings(
        gpu_node_selector=f"xidflow.test/fleet={tag}",
        namespace=unique("ns"),
        group_id=unique("g"),
        policy_source="file",
        breaker_max_share=1.0,
        worker_id="w1",
    )
    act = Actuator(settings, KafkaSettings(KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap), topics, kubeconfig, PolicySet())
    await act.start(consume=False)
    act.reconciler.start()  # its node watch is the cache writes start from (it owns no partition here)
    versions = {n: (await kube.get_node(n))["metadata"]["resourceVersion"] for n in names}
    for _ in range(600):  # the watch has delivered every node as it is now
        seen = act.reconciler.nodes
        if all(n in seen and seen[n].resource_version == rv for n, rv in versions.items()):
            break
        await asyncio.sleep(0.05)
    yield {"act": act, "nodes": names, "kube": kube}
    await act.reconciler.stop()
    await act.stop()
    await delete_nodes(kube, names)
    kube.close()


NODE_CALLS = ("read_node", "patch_node", "patch_node_status", "create_namespaced_event")


def node_calls(counts: collections.Counter[str]) -> dict[str, int]:
    return {k: counts[k] for k in NODE_CALLS if counts[k]}


def quarantine_calls(nodes: int, retried: int, reads: int) -> dict[str, int]:
    """Quarantining ``nodes`` nodes: cordon + taint + flow record in one patch, the Event, the condition + done
    marks in one status patch; for each of ``retried`` of them the status patch sent again because the node
    lifecycle controller's taint came in between, ``reads`` of them after a read."""
    calls = {"patch_node": nodes, "create_namespaced_event": nodes, "patch_node_status": nodes + retried,
             "read_node": reads}
    return {k: v for k, v in calls.items() if v}


def retries(counts: collections.Counter[str], nodes: int) -> tuple[int, int]:
    """(status patches sent again, reads) of a quarantine of ``nodes`` nodes, as counted."""
    return counts["patch_node_status"] - nodes, counts["read_node"]


async def test_quarantining_a_node_costs_three_calls(world: dict[str, Any]) -> None:
    """Cordon + taint + flow record in one patch, the Event, the condition + done marks in one status patch."""
    act: Actuator = world["act"]
    first, second = world["nodes"][:2]
    await act.engine.handle(make_incident(first, "inc-warm"))  # the breaker's first ConfigMap write, policies
    counts = count_calls(act.engine.kube)
    await act.engine.handle(make_incident(second, "inc-count"))
    print("calls for one quarantined node:", dict(counts))
    await cordon_answered(world["kube"], second)  # the other writer of a cordoned node has written
    node = await world["kube"].get_node(second)
    assert node["spec"]["unschedulable"] is True
    assert any(t["key"] == "nvidia.com/gpu-fault" for t in node["spec"].get("taints") or [])
    retried, reads = retries(counts, 1)
    assert reads <= retried <= 1 and node_calls(counts) == quarantine_calls(1, retried, reads), dict(counts)
    # The breaker's admission (no reserved block by default): one conditional write from the ConfigMap as
    # its last write left it, no read.
    assert counts["replace_namespaced_config_map"] == 1 and counts["read_namespaced_config_map"] == 0
    ledger = Ledger.from_annotations(node["metadata"].get("annotations"))
    assert ledger.is_finished("inc-count") and ledger.owners(condition_effect_key("GpuFellOffBus")) == ["inc-count"]
    assert any(c["type"] == "GpuFellOffBus" and c["status"] == "True" for c in node["status"]["conditions"])
    assert len(await node_events(world["kube"], second)) == 1

    for _ in range(600):  # the watch has delivered our last write: decisions start from it
        if act.reconciler.nodes[second].resource_version == node["metadata"]["resourceVersion"]:
            break
        await asyncio.sleep(0.05)
    counts.clear()
    await act.engine.handle(make_incident(second, "inc-count"))  # a redelivery: everything is recorded
    assert node_calls(counts) == {}
    assert len(await node_events(world["kube"], second)) == 1


async def test_a_burst_costs_three_calls_per_node(world: dict[str, Any]) -> None:
    """Nodes handled at once (as in a storm) cost the same per node: no read, no conflict, no retry."""
    act: Actuator = world["act"]
    await act.engine.handle(make_incident(world["nodes"][0], "inc-warm"))
    burst = world["nodes"][3:]
    counts = count_calls(act.engine.kube)
    await asyncio.gather(*(act.engine.handle(make_incident(n, f"inc-{n}")) for n in burst))
    n = len(burst)
    retried, reads = retries(counts, n)
    print(f"calls for {n} quarantined nodes: {dict(counts)} ({retried} status patches sent again, {reads} reads)")
    assert reads <= retried <= n and node_calls(counts) == quarantine_calls(n, retried, reads), dict(counts)
    for node in burst:
        await cordon_answered(world["kube"], node)


async def test_the_status_write_after_a_cordon_starts_from_the_lifecycle_controllers_answer(
    world: dict[str, Any],
) -> None:
    """Deterministically what a burst does: the status write goes once the controller's taint is out and the
    watch has delivered it. It starts from that view, not from the response to xidflow's own cordon that the
    flow holds: one status patch, no conflict, no read."""
    from pipeline.actuator.effects import NodeChange

    act: Actuator = world["act"]
    node = world["nodes"][1]
    writer = act.engine.writer

    def cordon(view: Any, ledger: Any) -> tuple[NodeChange, None]:
        return NodeChange(spec={"unschedulable": True}), None

    def condition(view: Any, ledger: Any) -> tuple[NodeChange, None]:
        return NodeChange(status={"conditions": [{"type": "GpuFellOffBus", "status": "False",
                                                  "reason": "Test", "message": "a status write"}]}), None

    _, cordoned = await writer.update(node, cordon, "test cordon")
    await cordon_answered(world["kube"], node)
    answered = (await world["kube"].get_node(node))["metadata"]["resourceVersion"]
    for _ in range(600):  # the watch has delivered the controller's taint
        if act.reconciler.nodes[node].resource_version == answered:
            break
        await asyncio.sleep(0.05)
    assert cordoned is not None and cordoned.resource_version != answered
    counts = count_calls(act.engine.kube)
    await writer.update(node, condition, "test condition", cordoned)  # as a flow passes its last write's view
    assert node_calls(counts) == {"patch_node_status": 1}, dict(counts)
    after = await world["kube"].get_node(node)
    assert after["spec"]["unschedulable"] is True
    assert any(c["type"] == "GpuFellOffBus" and c["reason"] == "Test" for c in after["status"]["conditions"])
