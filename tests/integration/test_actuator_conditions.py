"""Node conditions on the real kube-apiserver: xidflow's own present as False on every owned GPU node,
transitions that move lastTransitionTime only on a status change, a well-known condition other tools act
on (AcceleratedHardwareReady) set by policy and restored on recovery, and Xid 79 under GpuFellOffBus."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from pipeline.actuator.app import Actuator
from pipeline.actuator.policy import PolicySet, load_yaml_text
from pipeline.actuator.problems import OWN_CONDITION_TYPES
from pipeline.actuator.testing import make_incident
from pipeline.kafka.admin import ensure_topics
from schemas.records import Action, FaultKind, NodeRecovered
from tests.integration.test_actuator_effects import Env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

AHR = "AcceleratedHardwareReady"
OLD = "2021-01-01T00:00:00Z"


@pytest.fixture
async def env(kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]) -> AsyncIterator[Env]:
    world = Env(kafka_bootstrap, kubeconfig, unique)
    await ensure_topics(kafka_bootstrap, [world.topics.name("remediation_audit")], partitions=1)
    yield world
    for act in world.actuators:
        await act.reconciler.stop()
    await world.close()


def conds(node: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (node.get("status") or {}).get("conditions") or []}


async def wait_for(check: Callable[[], Any], what: str, limit: float = 60.0) -> Any:
    deadline = asyncio.get_running_loop().time() + limit
    while True:
        got = await check()
        if got:
            return got
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def reconciling(env: Env, policies: PolicySet | None = None, **overrides: Any) -> Actuator:
    """An actuator whose reconciler watches the fleet and owns every node (one partition, assigned)."""
    act = await env.actuator(policies, resync_seconds=0.5, **overrides)
    act.reconciler.start()
    act.reconciler.assign({0}, 1)
    return act


async def with_baseline(env: Env, name: str) -> dict[str, dict[str, Any]]:
    async def ready() -> dict[str, dict[str, Any]] | None:
        have = conds(await env.node(name))
        return have if OWN_CONDITION_TYPES <= have.keys() else None

    return await wait_for(ready, f"xidflow's conditions on {name}")


async def set_transition(env: Env, name: str, ctype: str, when: str) -> None:
    """Pretend the condition's last transition was long ago, so a write in the same second still shows."""
    current = conds(await env.node(name))[ctype]
    await env.kube.patch_node_status(name, {"status": {"conditions": [{**current, "lastTransitionTime": when}]}})


async def test_every_owned_gpu_node_gets_xidflow_conditions_as_false_once(env: Env) -> None:
    nodes = await env.make_nodes(3)
    (opted,) = await env.make_nodes(1, {"xidflow.dev/opt-out": "true"})
    act = await reconciling(env)
    for name in nodes:
        have = await with_baseline(env, name)
        for ctype in OWN_CONDITION_TYPES:
            assert have[ctype]["status"] == "False", (name, have[ctype])
            assert have[ctype]["reason"] and have[ctype]["lastTransitionTime"]
        assert have["GpuXid"]["reason"] == "NoGpuXid" and have["GpuFellOffBus"]["reason"] == "NoGpuFellOffBus"
        assert have["Ready"]["status"] == "True"  # the kubelet's conditions are left alone
    assert act.reconciler.baseline.written == len(nodes)  # one status patch per node

    async def no_work() -> bool:  # the watch saw the conditions: no resync or rebalance looks at them again
        return not act.reconciler.attention & {*nodes, opted}

    await wait_for(no_work, "the nodes to leave the reconciler's attention")
    versions = {n: (await env.node(n))["metadata"]["resourceVersion"] for n in nodes}
    await asyncio.sleep(2)  # several resyncs and watch events later: nothing is written again
    assert {n: (await env.node(n))["metadata"]["resourceVersion"] for n in nodes} == versions
    assert act.reconciler.baseline.written == len(nodes)
    assert not OWN_CONDITION_TYPES & conds(await env.node(opted)).keys()  # opted out: untouched


async def test_dry_run_writes_no_baseline(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    act = await reconciling(env, dry_run=True)
    await wait_for(lambda: _seen(act, name), "the reconciler to see the node")
    await asyncio.sleep(1)  # a couple of resyncs
    assert act.reconciler.baseline.written == 0
    assert not OWN_CONDITION_TYPES & conds(await env.node(name)).keys()


async def _seen(act: Actuator, name: str) -> bool:
    return name in act.reconciler.nodes


async def test_a_fault_flips_its_condition_and_a_repeat_keeps_the_transition_time(env: Env) -> None:
    policies = load_yaml_text(
        "kind: RescuePolicy\nmetadata: {name: ecc}\nspec:\n  rules:\n"
        "  - {name: remap, priority: 5, codes: [64], actions: [{name: condition, reason: RowRemapFailure}]}\n"
    )
    (name,) = await env.make_nodes(1)
    act = await reconciling(env, policies)
    await with_baseline(env, name)
    await set_transition(env, name, "GpuEcc", OLD)

    await act.engine.handle(make_incident(name, "inc-48", code=48, action=Action.RESET_GPU))
    ecc = conds(await env.node(name))["GpuEcc"]
    assert (ecc["status"], ecc["reason"]) == ("True", "XidError")
    assert ecc["lastTransitionTime"] != OLD  # the status changed: a new transition

    await set_transition(env, name, "GpuEcc", OLD)
    await act.engine.handle(make_incident(name, "inc-48b", code=48, action=Action.RESET_GPU))  # the same again
    assert conds(await env.node(name))["GpuEcc"]["lastTransitionTime"] == OLD
    await act.engine.handle(make_incident(name, "inc-64", code=64, action=Action.RESET_GPU))  # new reason, still True
    ecc = conds(await env.node(name))["GpuEcc"]
    assert (ecc["status"], ecc["reason"]) == ("True", "RowRemapFailure")
    assert ecc["lastTransitionTime"] == OLD  # status unchanged: the transition time stays
    assert conds(await env.node(name))["GpuXid"]["status"] == "False"  # other conditions untouched


async def test_xid79_and_fallen_off_bus_show_under_gpu_fell_off_bus(env: Env) -> None:
    first, second = await env.make_nodes(2)
    act = await reconciling(env)
    await with_baseline(env, first)
    await with_baseline(env, second)
    await act.engine.handle(make_incident(first, "inc-79"))
    await act.engine.handle(make_incident(second, "inc-bus", kind=FaultKind.GPU_FALLEN_OFF_BUS))
    for name in (first, second):
        have = conds(await env.node(name))
        assert have["GpuFellOffBus"]["status"] == "True", have["GpuFellOffBus"]
        assert have["GpuCount"]["status"] == "False" and have["GpuXid"]["status"] == "False"


REPLACE = load_yaml_text(
    "kind: RescuePolicy\nmetadata: {name: replace}\nspec:\n  rules:\n"
    "  - name: replace\n    priority: 10\n    codes: [79]\n    actions:\n    - {name: quarantine}\n"
    f"    - {{name: condition, type: {AHR}, status: 'False', reason: GpuHardwareFault}}\n"
)


async def test_policy_sets_accelerated_hardware_ready_false_and_recovery_restores_it(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    act = await reconciling(env, REPLACE)
    await with_baseline(env, name)
    assert AHR not in conds(await env.node(name))  # not one of xidflow's own: no baseline for it

    await act.engine.handle(make_incident(name, "inc-r"))
    have = conds(await env.node(name))
    assert (have[AHR]["status"], have[AHR]["reason"]) == ("False", "GpuHardwareFault")
    assert have["GpuFellOffBus"]["status"] == "True"
    assert (await env.ledger(name)).owners(f"condition:{AHR}=False") == ["inc-r"]

    await act.engine.handle(NodeRecovered(incident_id="inc-r", node=name, reason="quiet"))
    have = conds(await env.node(name))
    assert (have[AHR]["status"], have[AHR]["reason"]) == ("True", "XidflowRecovered")
    assert (have["GpuFellOffBus"]["status"], have["GpuFellOffBus"]["reason"]) == ("False", "XidflowRecovered")
    assert (await env.ledger(name)).owned == {}


async def test_a_condition_another_tool_set_is_never_restored_by_xidflow(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    # The EKS node monitoring agent (say) already reports the hardware as not ready.
    theirs = {"type": AHR, "status": "False", "reason": "DCGMError", "message": "agent", "lastTransitionTime": OLD}
    await env.kube.patch_node_status(name, {"status": {"conditions": [theirs]}})
    act = await env.actuator(REPLACE)
    await act.engine.handle(make_incident(name, "inc-t"))
    assert conds(await env.node(name))[AHR]["reason"] == "DCGMError"  # not rewritten, not owned
    assert not (await env.ledger(name)).owners(f"condition:{AHR}=False")
    await act.engine.handle(NodeRecovered(incident_id="inc-t", node=name, reason="quiet"))
    left = conds(await env.node(name))[AHR]
    assert (left["status"], left["reason"], left["lastTransitionTime"]) == ("False", "DCGMError", OLD)
