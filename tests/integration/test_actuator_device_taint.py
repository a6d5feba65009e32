"""Per-GPU quarantine (taintDevice) on the real kube-apiserver with DRA device taints enabled.

The test publishes ResourceSlices as a DRA GPU driver would (eight GPUs with their
``resource.kubernetes.io/pciBusID``); incidents go through the engine as the actuator runs them.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from pipeline.actuator import dra
from pipeline.actuator.actions import taint_device as td
from pipeline.actuator.policy import PolicySet, load_yaml_text
from pipeline.actuator.testing import make_incident
from schemas.records import Action, NodeIncident, NodeRecovered
from tests.integration.test_actuator_effects import Env
from tests.unit.test_taint_device import EIGHT, gpu_slice

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

FAULTY = "0000:4e:00.0"  # make_incident's PCI address: gpu-3 of EIGHT



def per_gpu_policy(**attrs: Any) -> PolicySet:
    extra = "".join(f", {k}: {v}" for k, v in attrs.items())
    return load_yaml_text(
        "kind: RescuePolicy\nmetadata: {name: per-gpu}\nspec:\n  rules:\n"
        f"  - {{name: per-gpu, priority: 10, actions: [{{name: taintDevice, effect: NoExecute{extra}}},"
        " {name: event}]}\n"
    )


def gpu_incident(node: str, iid: str, pci: str = FAULTY, code: int = 48) -> NodeIncident:
    return make_incident(node, iid, code=code, action=Action.RESET_GPU).model_copy(
        update={"pci": pci, "signature": f"xid:{code}:{pci}"}
    )


async def publish_slices(env: Env, node: str) -> str:
    body = gpu_slice(node, EIGHT)
    body["metadata"]["name"] = env.unique("slice")
    await env.kube.create_cluster_object(dra.GROUP, dra.SLICE_VERSION, dra.SLICES, body)
    return body["metadata"]["name"]


async def rules_of(env: Env, node: str) -> list[dict[str, Any]]:
    rules = await td.node_rules(env.kube, node)
    assert rules is not None, "the local API server must serve DeviceTaintRule (pipeline/localinfra)"
    return rules


async def cleanup(env: Env, slices: list[str], rules: list[str]) -> None:
    for name in slices:
        await env.kube.delete_cluster_object(dra.GROUP, dra.SLICE_VERSION, dra.SLICES, name)
    await td.delete_rules(env.kube, rules)


def step_reasons(records: list[Any], node: str, action: str) -> list[str]:
    return [r.reason for r in records if r.node == node and r.action == action]


async def test_the_api_server_serves_device_taint_rules_and_resource_slices(env: Env) -> None:
    from kubernetes import client

    v1beta2 = await env.kube._call(client.ResourceV1beta2Api(env.kube.api_client).get_api_resources)
    v1 = await env.kube._call(client.ResourceV1Api(env.kube.api_client).get_api_resources)
    assert "devicetaintrules" in {r["name"] for r in v1beta2["resources"]}
    assert "resourceslices" in {r["name"] for r in v1["resources"]}


async def test_a_gpu_fault_taints_that_one_gpu_and_not_the_node(env: Env) -> None:
    (node,) = await env.make_nodes(1)
    slices = [await publish_slices(env, node)]
    # Another tool's rule on this node's GPU 0: never counted, never deleted by xidflow.
    foreign = env.unique("foreign")
    await env.kube.create_cluster_object(td.GROUP, td.RULE_VERSION, td.RULES, {
        "apiVersion": "resource.k8s.io/v1beta2", "kind": "DeviceTaintRule", "metadata": {"name": foreign},
        "spec": {"deviceSelector": {"driver": "gpu.nvidia.com", "pool": node, "device": "gpu-0"},
                 "taint": {"key": "example.com/maintenance", "effect": "NoSchedule"}},
    })
    act = await env.actuator(per_gpu_policy())
    try:
        incident = gpu_incident(node, "inc-dev")
        await act.engine.handle(incident)
        rules = await rules_of(env, node)
        assert len(rules) == 1
        rule = await env.kube.get_cluster_object(td.GROUP, td.RULE_VERSION, td.RULES, rules[0]["metadata"]["name"])
        # What `kubectl get devicetaintrules -o yaml` shows for it:
        print("\n--- DeviceTaintRule as read from the API server ---\n" + yaml.safe_dump(rule, sort_keys=False))
        assert rule["spec"]["deviceSelector"] == {"driver": "gpu.nvidia.com", "pool": node, "device": "gpu-3"}
        assert rule["spec"]["taint"]["effect"] == "NoExecute" and rule["spec"]["taint"]["value"] == "xid-48"
        assert rule["metadata"]["annotations"][td.PCI_ANNOTATION] == FAULTY
        n = await env.node(node)
        assert not n["spec"].get("unschedulable")
        assert not [t for t in n["spec"].get("taints") or [] if t["key"] == "nvidia.com/gpu-fault"]
        assert (await env.ledger(node)).owners(td.effect_key(rule["metadata"]["name"])) == ["inc-dev"]

        await act.engine.handle(incident)  # redelivery: nothing more
        assert [r["metadata"]["name"] for r in await rules_of(env, node)] == [rule["metadata"]["name"]]
        records = await env.audit()
        assert any("tainted" in r for r in step_reasons(records, node, "taintDevice"))

        await act.engine.handle(NodeRecovered(incident_id="inc-dev", node=node, reason="quiet"))
        assert await rules_of(env, node) == []
        survivor = await env.kube.get_cluster_object(td.GROUP, td.RULE_VERSION, td.RULES, foreign)
        assert survivor["metadata"]["name"] == foreign
    finally:
        await cleanup(env, slices, [foreign])


async def test_a_node_scoped_fault_cordons_the_node(env: Env) -> None:
    (node,) = await env.make_nodes(1)
    slices = [await publish_slices(env, node)]
    act = await env.actuator(per_gpu_policy())
    try:
        await act.engine.handle(make_incident(node, "inc-79"))  # Xid 79: fallen off the bus
        n = await env.node(node)
        assert n["spec"]["unschedulable"] is True
        assert [t for t in n["spec"]["taints"] if t["key"] == "nvidia.com/gpu-fault"]
        assert await rules_of(env, node) == []
        (reason,) = step_reasons(await env.audit(), node, "taintDevice")
        assert "scope node" in reason
        await act.engine.handle(NodeRecovered(incident_id="inc-79", node=node, reason="quiet"))
        assert not (await env.node(node))["spec"].get("unschedulable")
    finally:
        await cleanup(env, slices, [])


async def test_more_tainted_gpus_than_the_cap_cordon_the_node(env: Env) -> None:
    (node,) = await env.make_nodes(1)
    slices = [await publish_slices(env, node)]
    act = await env.actuator(per_gpu_policy(maxTaintedDevices=1))
    try:
        await act.engine.handle(gpu_incident(node, "inc-a", EIGHT[0]))
        assert not (await env.node(node))["spec"].get("unschedulable")
        await act.engine.handle(gpu_incident(node, "inc-b", EIGHT[1]))
        assert len(await rules_of(env, node)) == 2
        assert (await env.node(node))["spec"]["unschedulable"] is True
        assert any("maxTaintedDevices=1" in r for r in step_reasons(await env.audit(), node, "taintDevice"))
        for iid in ("inc-a", "inc-b"):
            await act.engine.handle(NodeRecovered(incident_id=iid, node=node, reason="quiet"))
        assert await rules_of(env, node) == []
        assert not (await env.node(node))["spec"].get("unschedulable")
    finally:
        await cleanup(env, slices, [])


async def test_without_resource_slices_it_falls_back_to_the_node_cordon(env: Env) -> None:
    (node,) = await env.make_nodes(1)
    act = await env.actuator(per_gpu_policy())
    await act.engine.handle(gpu_incident(node, "inc-nodra"))
    n = await env.node(node)
    assert n["spec"]["unschedulable"] is True
    assert [t for t in n["spec"]["taints"] if t["key"] == "nvidia.com/gpu-fault"]
    assert await rules_of(env, node) == []
    (reason,) = step_reasons(await env.audit(), node, "taintDevice")
    assert "no ResourceSlice" in reason and "node quarantine" in reason


async def test_the_shipped_rbac_is_enough_for_taint_device(env: Env, kubeconfig: str) -> None:
    """As the actuator's ServiceAccount with deploy/rbac/actuator.yaml and nothing more."""
    from pipeline.actuator.app import Actuator
    from pipeline.runtime.settings import KafkaSettings
    from tests.integration.test_actuator_rbac import (
        apply_docs,
        delete_cluster_rbac,
        service_account_kube,
        shipped_rbac,
    )

    (node,) = await env.make_nodes(1)
    slices = [await publish_slices(env, node)]
    cluster_name = env.unique("xidflow-actuator")
    docs = shipped_rbac(env.namespace, cluster_name)
    try:
        await apply_docs(env.kube, docs)
        sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
        sa_kube = await service_account_kube(env.kube, kubeconfig, env.namespace, sa)
        act = Actuator(env.settings(worker_id="sa"), KafkaSettings(KAFKA_BOOTSTRAP_SERVERS=env.bootstrap),
                       env.topics, kubeconfig, per_gpu_policy())
        act.kube.close()
        act.kube = sa_kube
        act.engine.kube = act.breaker.kube = act.drains.kube = act.policies.kube = sa_kube
        await act.start(consume=False)
        env.actuators.append(act)
        await act.engine.handle(gpu_incident(node, "inc-sa"))
        assert len(await rules_of(env, node)) == 1
        assert not (await env.node(node))["spec"].get("unschedulable")
        await act.engine.handle(NodeRecovered(incident_id="inc-sa", node=node, reason="quiet"))
        assert await rules_of(env, node) == []
    finally:
        await delete_cluster_rbac(env.kube, cluster_name)
        await cleanup(env, slices, [])


async def test_quarantine_per_gpu_follows_the_catalog(env: Env) -> None:
    """A catch-all ``quarantine`` with ``perGpu``: the GPU for a GPU fault, nothing for an application error."""
    (node,) = await env.make_nodes(1)
    slices = [await publish_slices(env, node)]
    policy = load_yaml_text(
        "kind: RescuePolicy\nmetadata: {name: q}\nspec:\n  rules:\n"
        "  - {name: q, priority: 10, actions: [{name: quarantine, perGpu: true}]}\n"
    )
    act = await env.actuator(policy)
    try:
        await act.engine.handle(make_incident(node, "inc-13", code=13, action=Action.RESTART_APP))
        assert await rules_of(env, node) == []
        await act.engine.handle(gpu_incident(node, "inc-48"))
        (rule,) = await rules_of(env, node)
        assert rule["spec"]["deviceSelector"]["device"] == "gpu-3"
        assert rule["spec"]["taint"]["effect"] == "NoSchedule"
        n = await env.node(node)
        assert not n["spec"].get("unschedulable")
        assert [c for c in n["status"]["conditions"] if c["type"] == "GpuEcc" and c["status"] == "True"]
    finally:
        await cleanup(env, slices, [])
