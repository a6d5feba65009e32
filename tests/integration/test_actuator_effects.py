"""Each action on the real kube-apiserver, through the engine, with audit records on real Kafka."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from pipeline.actuator.app import Actuator
from pipeline.actuator.kube import Kube
from pipeline.actuator.ownership import Ledger
from pipeline.actuator.policy import PolicySet, load_yaml_text
from pipeline.actuator.settings import ActuatorSettings
from pipeline.actuator.testing import (
    create_nodes,
    delete_nodes,
    make_incident,
    node_events,
    read_audit,
)
from pipeline.runtime.settings import KafkaSettings, TopicNames
from schemas.records import Action, NodeRecovered, Outcome
from tests.integration.workloads import cordon_answered

# A hang (an unbounded retry against a broken API server) fails in minutes, with its stack, not at 600 s.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


class Env:
    """One test's isolated world: a fleet label, nodes, a namespace, topics, actuators."""

    def __init__(self, kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]) -> None:
        self.bootstrap, self.kubeconfig, self.unique = kafka_bootstrap, kubeconfig, unique
        self.tag = unique("fleet")
        self.fleet_label = {"xidflow.test/fleet": self.tag}
        self.selector = f"xidflow.test/fleet={self.tag}"
        self.namespace = unique("ns")
        self.topics = TopicNames(prefix=unique("t") + ".")
        self.kube = Kube.from_config(kubeconfig, 16)
        self.nodes: list[str] = []
        self.actuators: list[Actuator] = []

    async def make_nodes(self, count: int, extra_labels: dict[str, str] | None = None) -> list[str]:
        """KWOK nodes of 8-GPU machines, Ready and schedulable when this returns."""
        names = [self.unique("gpu") for _ in range(count)]
        self.nodes += names
        await create_nodes(self.kube, names, {**self.fleet_label, **(extra_labels or {})}, gpu=True)
        return names

    def settings(self, **overrides: Any) -> ActuatorSettings:
        base: dict[str, Any] = {
            "gpu_node_selector": self.selector,
            "namespace": self.namespace,
            "group_id": self.unique("g"),
            "policy_source": "file",
            "breaker_max_share": 1.0,
            "retry_initial_seconds": 0.05,
        }
        return ActuatorSettings(**{**base, **overrides})

    async def actuator(self, policies: PolicySet | None = None, worker: str = "w1", **overrides: Any) -> Actuator:
        act = Actuator(
            self.settings(worker_id=worker, **overrides),
            KafkaSettings(KAFKA_BOOTSTRAP_SERVERS=self.bootstrap),
            self.topics,
            self.kubeconfig,
            policies or PolicySet(),
        )
        await act.start(consume=False)
        self.actuators.append(act)
        return act

    async def node(self, name: str) -> dict[str, Any]:
        return await self.kube.get_node(name)

    async def ledger(self, name: str) -> Ledger:
        return Ledger.from_annotations((await self.node(name))["metadata"].get("annotations"))

    async def audit(self) -> list[Any]:
        return await read_audit(self.bootstrap, self.topics.name("remediation_audit"))

    async def close(self) -> None:
        for act in self.actuators:
            await act.stop()
        await delete_nodes(self.kube, self.nodes)
        try:
            await self.kube._call(self.kube.core.delete_namespace, self.namespace)
        except Exception:  # noqa: BLE001 - namespace may never have been created
            pass
        self.kube.close()



def outcomes(records: list[Any], node: str) -> list[tuple[str, str]]:
    return [(r.action, r.outcome.value) for r in records if r.node == node]


async def test_default_quarantine_cordons_taints_sets_condition_and_event(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    act = await env.actuator()
    await act.engine.handle(make_incident(name, "inc-q"))
    node = await env.node(name)
    assert node["spec"]["unschedulable"] is True
    taint = [t for t in node["spec"]["taints"] if t["key"] == "nvidia.com/gpu-fault"]
    assert taint and taint[0]["effect"] == "NoSchedule" and taint[0]["value"] == "xid-79"
    cond = [c for c in node["status"]["conditions"] if c["type"] == "GpuFellOffBus"]
    assert cond and cond[0]["status"] == "True" and cond[0]["reason"] == "XidError"
    # the kubelet-style Ready condition survives: conditions are merged by type, not replaced
    assert any(c["type"] == "Ready" for c in node["status"]["conditions"])
    events = await node_events(env.kube, name)
    assert len(events) == 1 and events[0]["type"] == "Warning" and events[0]["reason"] == "XidError"
    assert "0000:4e:00.0" in events[0]["message"] and "79" in events[0]["message"]
    ledger = await env.ledger(name)
    assert ledger.owners("cordon") == ["inc-q"] and ledger.is_done("inc-q", "event")
    audit = outcomes(await env.audit(), name)
    assert ("decide", "applied") in audit and ("cordon", "applied") in audit and ("event", "applied") in audit


async def test_redelivered_incident_is_already_applied_with_no_second_event(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    act = await env.actuator()
    incident = make_incident(name, "inc-r")
    await act.engine.handle(incident)
    await cordon_answered(env.kube, name)  # the lifecycle controller's taint: the node's other writer
    rv = (await env.node(name))["metadata"]["resourceVersion"]
    await act.engine.handle(incident)
    await act.engine.handle(incident)
    assert len(await node_events(env.kube, name)) == 1
    assert (await env.node(name))["metadata"]["resourceVersion"] == rv  # nothing written again
    audit = outcomes(await env.audit(), name)
    assert audit.count(("cordon", "applied")) == 1
    assert audit.count(("cordon", "already-applied")) == 2
    assert audit.count(("event", "already-applied")) == 2


async def test_dry_run_mutates_nothing_and_audits_dry_run(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    before = await env.node(name)
    act = await env.actuator(dry_run=True)
    await act.engine.handle(make_incident(name, "inc-d"))
    after = await env.node(name)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert await node_events(env.kube, name) == []
    audit = outcomes(await env.audit(), name)
    assert audit and all(o == "dry-run" for _, o in audit)
    assert ("cordon", "dry-run") in audit


async def test_opt_out_label_is_respected(env: Env) -> None:
    (name,) = await env.make_nodes(1, {"xidflow.dev/opt-out": "true"})
    act = await env.actuator()
    await act.engine.handle(make_incident(name, "inc-o"))
    assert not (await env.node(name))["spec"].get("unschedulable")
    assert outcomes(await env.audit(), name) == [("decide", "skipped")]


async def test_noexecute_taint_from_policy(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    policies = load_yaml_text(
        "kind: RescuePolicy\nmetadata: {name: ne}\nspec:\n  rules:\n"
        "  - {priority: 5, codes: [48], actions: [{name: taint, key: example.com/ecc, effect: NoExecute}]}\n"
    )
    act = await env.actuator(policies)
    await act.engine.handle(make_incident(name, "inc-ne", code=48, action=Action.RESET_GPU))
    taints = (await env.node(name))["spec"]["taints"]
    assert {"key": "example.com/ecc", "effect": "NoExecute", "value": "xid-48"}.items() <= [
        t for t in taints if t["key"] == "example.com/ecc"
    ][0].items()
    assert not (await env.node(name))["spec"].get("unschedulable")  # the rule did not cordon


async def test_recovery_removes_only_what_xidflow_applied(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    act = await env.actuator()
    # Another tool's taint, present before the incident, must survive the undo.
    node = await env.node(name)
    foreign = [*node["spec"].get("taints", []), {"key": "other.io/maintenance", "effect": "NoSchedule"}]
    await env.kube.patch_node(name, {"spec": {"taints": foreign}})
    await act.engine.handle(make_incident(name, "inc-u"))
    await act.engine.handle(NodeRecovered(incident_id="inc-u", node=name, reason="quiet"))
    node = await env.node(name)
    assert not node["spec"].get("unschedulable")
    keys = {t["key"] for t in node["spec"].get("taints", [])}
    assert "other.io/maintenance" in keys and "nvidia.com/gpu-fault" not in keys
    cond = [c for c in node["status"]["conditions"] if c["type"] == "GpuFellOffBus"][0]
    assert cond["status"] == "False"
    assert (await env.ledger(name)).owned == {}
    # a second recovery finds nothing left to undo
    await act.engine.handle(NodeRecovered(incident_id="inc-u", node=name, reason="quiet"))
    assert ("undo", "already-applied") in outcomes(await env.audit(), name)


async def test_human_cordon_is_never_undone(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    await env.kube.patch_node(name, {"spec": {"unschedulable": True}})  # a person cordoned it first
    act = await env.actuator()
    await act.engine.handle(make_incident(name, "inc-h"))
    assert (await env.ledger(name)).owners("cordon") == []
    await act.engine.handle(NodeRecovered(incident_id="inc-h", node=name, reason="quiet"))
    assert (await env.node(name))["spec"]["unschedulable"] is True


async def test_manual_uncordon_cancels_the_flow(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    act = await env.actuator()
    incident = make_incident(name, "inc-m")
    await act.engine.handle(incident)
    await env.kube.patch_node(name, {"spec": {"unschedulable": False}})  # a person uncordons
    await act.engine.handle(incident)  # redelivery must not re-cordon
    assert not (await env.node(name))["spec"].get("unschedulable")
    ledger = await env.ledger(name)
    assert ledger.cancelled("inc-m") == "manual-uncordon"
    audit = outcomes(await env.audit(), name)
    assert ("cancel", "applied") in audit and audit[-1] == ("decide", "skipped")


async def test_concurrent_writer_is_not_clobbered_on_409(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    act = await env.actuator()
    other = Kube.from_config(env.kubeconfig, 2)
    real_patch = act.kube.patch_node
    interleaved: list[str] = []

    async def patch_after_another_writer(node: str, body: dict[str, Any]) -> dict[str, Any]:
        # Before our first conditional write lands, another client really writes the node.
        if not interleaved:
            interleaved.append("other")
            current = await other.get_node(node)
            taints = [*current["spec"].get("taints", []), {"key": "other.io/writer", "effect": "NoSchedule"}]
            await other.patch_node(
                node, {"metadata": {"labels": {"other.io/touched": "yes"}}, "spec": {"taints": taints}}
            )
        return await real_patch(node, body)

    act.kube.patch_node = patch_after_another_writer  # type: ignore[method-assign]
    try:
        await act.engine.handle(make_incident(name, "inc-c"))
    finally:
        other.close()
    node = await env.node(name)
    keys = {t["key"] for t in node["spec"]["taints"]}
    assert {"other.io/writer", "nvidia.com/gpu-fault"} <= keys
    assert node["metadata"]["labels"]["other.io/touched"] == "yes"
    assert node["spec"]["unschedulable"] is True


async def test_two_replicas_apply_each_effect_once(env: Env) -> None:
    names = await env.make_nodes(4)
    one = await env.actuator(worker="replica-a")
    two = await env.actuator(worker="replica-b")
    incidents = [make_incident(n, f"inc-2r-{i}") for i, n in enumerate(names)]
    await asyncio.gather(*(a.engine.handle(i) for i in incidents for a in (one, two)))
    audit = await env.audit()
    for name in names:
        assert len(await node_events(env.kube, name)) == 1
        applied = [r.action for r in audit if r.node == name and r.outcome == Outcome.APPLIED and r.action != "decide"]
        assert sorted(applied) == ["condition", "cordon", "event", "taint"], applied


async def test_manual_uncordon_during_a_flow_stops_its_later_steps(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    policies = load_yaml_text(
        "kind: RescuePolicy\nmetadata: {name: mu}\nspec:\n  rules:\n"
        "  - {priority: 5, codes: [79], actions: [{name: cordon, waittime: 1.5}, {name: reboot, hook: annotation}]}\n"
    )
    act = await env.actuator(policies)
    flow = asyncio.create_task(act.engine.handle(make_incident(name, "inc-mid")))

    async def cordoned() -> bool:
        return bool((await env.node(name))["spec"].get("unschedulable"))

    from pipeline.actuator.testing import wait_until

    await wait_until(cordoned, 10, what="cordon")
    await env.kube.patch_node(name, {"spec": {"unschedulable": False}})  # a person uncordons mid-flow
    await asyncio.wait_for(flow, 20)
    node = await env.node(name)
    assert "xidflow.dev/reboot-requested" not in node["metadata"].get("annotations", {})
    assert not node["spec"].get("unschedulable")
    assert ("reboot", "skipped") in outcomes(await env.audit(), name)


async def test_an_escalated_revision_of_an_incident_runs_its_new_steps_once(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    act = await env.actuator()
    first = make_incident(name, "inc-esc", code=31, action=Action.RESTART_APP).model_copy(update={"revision": 1})
    await act.engine.handle(first)
    assert not (await env.node(name))["spec"].get("unschedulable")  # RESTART_APP: an Event only
    escalated = make_incident(name, "inc-esc", code=31, action=Action.RESET_GPU).model_copy(update={"revision": 2})
    await act.engine.handle(escalated)
    await act.engine.handle(escalated)  # redelivered
    assert (await env.node(name))["spec"]["unschedulable"] is True
    assert len(await node_events(env.kube, name)) == 1
    ledger = await env.ledger(name)
    assert ledger.revision("inc-esc") == 2 and ledger.is_finished("inc-esc") and ledger.owners("cordon") == ["inc-esc"]
