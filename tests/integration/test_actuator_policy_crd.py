"""RescuePolicy / WarmStandbyPolicy CRDs on the real API server: schema and admission-policy validation,
loading, watching, the last valid version kept in force, status and Warning Events, acting."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from pipeline.actuator.app import Actuator
from pipeline.actuator.kube import AlreadyExists, Invalid, Kube
from pipeline.actuator.policystore import PolicyStore
from pipeline.actuator.testing import make_incident
from pipeline.kafka.admin import ensure_topics
from pipeline.runtime.settings import KafkaSettings
from tests.integration.test_actuator_effects import Env, outcomes

# A hang (an unbounded retry against a broken API server) fails in minutes, with its stack, not at 600 s.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = ROOT / "deploy" / "crds"
ADMISSION_FILE = CRD_DIR / "admission" / "rescuepolicy-validation.yaml"
EXAMPLES = ROOT / "deploy" / "examples" / "policies.yaml"
GROUP, VERSION = "xidflow.dev", "v1alpha1"


async def install_crds(kube: Kube) -> None:
    """Create our CRDs, or update them to the shipped version (they are this project's own objects)."""
    ext = client.ApiextensionsV1Api(kube.api_client)
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        name = crd["metadata"]["name"]
        try:
            await kube._call(ext.create_custom_resource_definition, crd)
        except AlreadyExists:
            current = await kube._call(ext.read_custom_resource_definition, name)
            crd["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            await kube._call(ext.replace_custom_resource_definition, name, crd)
        for _ in range(100):
            got = await kube._call(ext.read_custom_resource_definition, name)
            conds = (got.get("status") or {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                break
            await asyncio.sleep(0.1)


@pytest.fixture
async def env(kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]) -> AsyncIterator[Env]:
    world = Env(kafka_bootstrap, kubeconfig, unique)
    await ensure_topics(kafka_bootstrap, [world.topics.name("remediation_audit")], partitions=1)
    await install_crds(world.kube)
    world.created_policies: list[tuple[str, str]] = []  # type: ignore[misc]
    yield world
    for plural, name in world.created_policies:  # type: ignore[attr-defined]
        try:
            await world.kube._call(world.kube.custom.delete_cluster_custom_object, GROUP, VERSION, plural, name)
        except Exception:  # noqa: BLE001 - best-effort cleanup of this test's objects
            pass
    await world.close()


async def create_policy(env: Env, kind: str, plural: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": kind,
        "metadata": {"name": name, "labels": {"xidflow.test/fleet": env.tag}},
        "spec": spec,
    }
    created = await env.kube._call(env.kube.custom.create_cluster_custom_object, GROUP, VERSION, plural, body)
    env.created_policies.append((plural, name))  # type: ignore[attr-defined]
    return created


async def test_api_server_rejects_an_invalid_rescue_policy_naming_the_field(env: Env) -> None:
    with pytest.raises(Invalid) as err:
        await create_policy(
            env, "RescuePolicy", "rescuepolicies", env.unique("bad"), {"rules": [{"actions": [{"name": "dance"}]}]}
        )
    assert "spec.rules[0].actions[0].name" in err.value.message
    with pytest.raises(Invalid) as err:
        await create_policy(
            env, "RescuePolicy", "rescuepolicies", env.unique("bad"), {"rules": [{"priority": -2, "actions": []}]}
        )
    assert "spec.rules[0].priority" in err.value.message
    with pytest.raises(Invalid) as err:
        await create_policy(env, "WarmStandbyPolicy", "warmstandbypolicies", env.unique("bad"), {"originLabels": {}})
    assert "spec.targetLabels" in err.value.message or "spec.originLabels" in err.value.message


async def test_policies_load_from_crds_and_drive_the_actuator(env: Env) -> None:
    good = env.unique("good")
    await create_policy(
        env,
        "RescuePolicy",
        "rescuepolicies",
        good,
        {"rules": [{"name": f"{good}-r", "priority": 7, "codes": [31], "actions": [{"name": "cordon"}]}]},
    )
    # Valid for the CRD schema but not for our own check (drain takes no hook): loaded without it, reported.
    odd = env.unique("odd")
    await create_policy(
        env, "RescuePolicy", "rescuepolicies", odd, {"rules": [{"actions": [{"name": "drain", "hook": "job"}]}]}
    )
    await create_policy(
        env,
        "WarmStandbyPolicy",
        "warmstandbypolicies",
        env.unique("ws"),
        {"originLabels": {"a": "b"}, "targetLabels": {"c": "d"}},
    )
    settings = env.settings(policy_source="auto", policy_label_selector=f"xidflow.test/fleet={env.tag}")
    store = PolicyStore(env.kube, settings)
    policies = await store.refresh()
    assert store.source == "crd"
    assert [r.name for r in policies.rules] == [f"{good}-r"]
    assert any(f"RescuePolicy/{odd} spec.rules[0].actions[0].hook" in e for e in store.errors)
    assert policies.standby_targets({"a": "b"}) == [{"c": "d"}]

    (name,) = await env.make_nodes(1)
    act = await env.actuator(policy_source="crd", policy_label_selector=f"xidflow.test/fleet={env.tag}")
    await act.policies.refresh()
    from schemas.records import Action

    await act.engine.handle(make_incident(name, "inc-crd", code=31, action=Action.RESTART_APP))
    assert (await env.node(name))["spec"]["unschedulable"] is True  # the CRD rule cordons Xid 31
    assert outcomes(await env.audit(), name)[0] == ("decide", "applied")


# -- a bad update keeps the last valid version in force, says so in status and an Event ----------------------
async def read_policy(env: Env, name: str) -> dict[str, Any]:
    return await env.kube._call(env.kube.custom.get_cluster_custom_object, GROUP, VERSION, "rescuepolicies", name)


async def replace_spec(env: Env, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    current = await read_policy(env, name)
    current["spec"] = spec
    return await env.kube._call(
        env.kube.custom.replace_cluster_custom_object, GROUP, VERSION, "rescuepolicies", name, current
    )


async def wait_for(check: Callable[[], Any], what: str, limit: float = 30.0) -> Any:
    """Poll ``check`` (async) until it returns something truthy; fail naming ``what`` after ``limit`` s."""
    deadline = asyncio.get_running_loop().time() + limit
    while True:
        got = await check()
        if got:
            return got
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def accepted(policy: dict[str, Any]) -> dict[str, Any] | None:
    conditions = (policy.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c.get("type") == "Accepted"), None)


async def test_a_bad_update_keeps_the_last_valid_version_in_force(env: Env) -> None:
    name = env.unique("event-only")
    rule = f"{name}-r"
    event_only = {"rules": [{"name": rule, "priority": 50, "codes": [79], "actions": [{"name": "event"}]}]}
    await create_policy(env, "RescuePolicy", "rescuepolicies", name, event_only)
    (node,) = await env.make_nodes(1)
    # An hour between polls: whatever the actuator sees below, it saw by watch.
    act = Actuator(
        env.settings(
            worker_id="w1",
            policy_source="crd",
            policy_label_selector=f"xidflow.test/fleet={env.tag}",
            policy_refresh_seconds=3600,
        ),
        KafkaSettings(KAFKA_BOOTSTRAP_SERVERS=env.bootstrap),
        env.topics,
        env.kubeconfig,
    )
    await act.start(consume=False)  # lists the policies, then watches them
    env.actuators.append(act)
    assert act.policies.watching
    first = await wait_for(
        lambda: _status_for(env, name, generation=1, status="True"), "generation 1 to be accepted"
    )
    assert first["status"]["inForceGeneration"] == 1

    # Valid for the CRD schema (no admission policy bound to these objects), not for xidflow: drain takes no hook.
    await replace_spec(env, name, {"rules": [{"name": rule, "priority": 50, "codes": [79],
                                             "actions": [{"name": "drain", "hook": "job"}]}]})
    refused = await wait_for(lambda: _status_for(env, name, generation=2, status="False"), "generation 2 refused")
    condition = accepted(refused)
    assert condition is not None and condition["reason"] == "InvalidPolicy"
    assert "spec.rules[0].actions[0].hook" in condition["message"]
    assert "generation 1 stays in force" in condition["message"]
    assert refused["status"]["observedGeneration"] == 2 and refused["status"]["inForceGeneration"] == 1
    events = await env.kube._call(
        env.kube.core.list_namespaced_event, "default", field_selector=f"involvedObject.name={name}"
    )
    warnings = [e for e in events["items"] if e["reason"] == "InvalidPolicy"]
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning"
    assert warnings[0]["involvedObject"]["kind"] == "RescuePolicy"
    assert "actions[0].hook" in warnings[0]["message"]

    # The node meant for "event only" gets an Event and is NOT cordoned (no fall back to quarantine).
    assert [r.name for r in act.policies.current.rules] == [rule]
    await act.engine.handle(make_incident(node, "inc-keep"))
    assert not (await env.node(node))["spec"].get("unschedulable")
    decide = [r for r in await env.audit() if r.node == node and r.action == "decide"][0]
    assert decide.details["rule"] == rule and decide.details["steps"] == ["event"]

    # A replica started now (after the bad update) also keeps generation 1, from the object's status.
    fresh = PolicyStore(env.kube, act.settings)
    await fresh.refresh()
    assert [(r.name, [a.name for a in r.actions]) for r in fresh.current.rules] == [(rule, ["event"])]
    assert any("actions[0].hook" in e for e in fresh.errors)

    # A valid edit is in force by watch, without any record or poll.
    act.policies.changed.clear()
    edited_at = asyncio.get_running_loop().time()
    await replace_spec(env, name, {"rules": [{"name": rule, "priority": 50, "codes": [79],
                                             "actions": [{"name": "cordon"}]}]})
    await wait_for(
        lambda: _in_force(act.policies, rule, ["cordon"]), "the valid edit to be in force by watch"
    )
    # A figure, not an assertion (timing belongs in benchmarks): how long the edit took to be in force.
    print(f"policy edit in force by watch after {asyncio.get_running_loop().time() - edited_at:.3f}s")
    await wait_for(lambda: _status_for(env, name, generation=3, status="True"), "generation 3 accepted")
    await act.engine.handle(make_incident(node, "inc-new"))
    assert (await env.node(node))["spec"]["unschedulable"] is True


async def _status_for(env: Env, name: str, *, generation: int, status: str) -> dict[str, Any] | None:
    policy = await read_policy(env, name)
    condition = accepted(policy)
    ok = (
        condition is not None
        and condition.get("status") == status
        and condition.get("observedGeneration") == generation
        and (policy.get("status") or {}).get("observedGeneration") == generation
    )
    return policy if ok else None


async def _in_force(store: PolicyStore, rule: str, actions: list[str]) -> bool:
    return any(r.name == rule and [a.name for a in r.actions] == actions for r in store.current.rules)


# -- the ValidatingAdmissionPolicy shipped with the CRDs ---------------------------------------------------
BAD_FOR_ADMISSION = [
    ([{"name": "drain", "hook": "job"}], "only valid for reboot"),
    ([{"name": "cordon", "key": "x"}], "only valid for the quarantine, taint and taintDevice actions"),
    ([{"name": "cordon", "timeout": 5}], "timeout: only valid for drain"),
    ([{"name": "reboot", "jobTemplate": {"spec": {}}}], "jobTemplate: not allowed"),
    ([{"name": "drain", "forceAfter": 30}], "forceNamespaces: required with forceAfter"),
    ([{"name": "drain", "forceAfter": 30, "forceNamespaces": ["Not_A_Namespace"]}], "must be a namespace name"),
    ([{"name": "taint", "key": "bad key!"}], "not a valid taint key"),
    ([{"name": "event", "gracePeriodCap": 3}], "only valid for drain"),
    ([{"name": "cordon", "type": "GpuHealthy", "status": "False"}], "only valid for the condition action"),
    ([{"name": "condition", "type": "AcceleratedHardwareReady"}], "status: required with type"),
    ([{"name": "condition", "status": "False"}], "status: required with type"),
    ([{"name": "condition", "type": "Ready", "status": "False"}], "written by the kubelet"),
    ([{"name": "condition", "type": "GpuXid", "status": "False"}], "are True on a fault"),
    ([{"name": "cordon", "maxTaintedDevices": 2}], "maxTaintedDevices: only valid for taintDevice"),
    ([{"name": "taintDevice", "effect": "PreferNoSchedule"}], "a device taint is None, NoSchedule or NoExecute"),
    ([{"name": "taint", "effect": "None"}], "None (a device taint's dry run) is only for taintDevice"),
    ([{"name": "quarantine", "effect": "None"}], "None (a device taint's dry run) is only for taintDevice"),
    ([{"name": "cordon", "scope": "gpu"}], "scope are only valid for drain"),
    ([{"name": "quarantine", "checkpointGrace": 60}], "checkpointGrace: only valid for drain, and quarantine"),
    ([{"name": "quarantine", "perGpu": True, "effect": "NoExecute", "checkpointGrace": 60}],
     "per-GPU quarantine has no drain"),
    ([{"name": "cordon", "perGpu": True}], "perGpu: only valid for quarantine"),
    ([{"name": "quarantine", "maxTaintedDevices": 2}], "maxTaintedDevices: only valid for taintDevice"),
]


@pytest.fixture
async def admission(env: Env) -> AsyncIterator[str]:
    """The shipped admission policy, bound only to this test's objects (the API server is shared)."""
    api = client.AdmissionregistrationV1Api(env.kube.api_client)
    groups = await env.kube._call(client.ApisApi(env.kube.api_client).get_api_versions)
    assert any(g["name"] == "admissionregistration.k8s.io" and any(v["version"] == "v1" for v in g["versions"])
               for g in groups["groups"]), "the API server does not serve admissionregistration.k8s.io/v1"
    policy_doc, binding_doc = [d for d in yaml.safe_load_all(ADMISSION_FILE.read_text()) if d]
    assert policy_doc["kind"] == "ValidatingAdmissionPolicy"
    assert binding_doc["kind"] == "ValidatingAdmissionPolicyBinding"
    name = env.unique("rp-validation")
    policy_doc["metadata"]["name"] = binding_doc["metadata"]["name"] = binding_doc["spec"]["policyName"] = name
    binding_doc["spec"]["matchResources"] = {"objectSelector": {"matchLabels": {"xidflow.test/fleet": env.tag}}}
    await env.kube._call(api.create_validating_admission_policy, policy_doc)
    await env.kube._call(api.create_validating_admission_policy_binding, binding_doc)
    try:
        # Type-checked and in force once it refuses a known-bad object (it takes the API server a moment).
        async def refuses() -> bool:
            try:
                await create_policy(env, "RescuePolicy", "rescuepolicies", env.unique("probe"),
                                    {"rules": [{"actions": [{"name": "drain", "hook": "job"}]}]})
            except Invalid:
                return True
            return False

        await wait_for(refuses, "the admission policy to be enforced", limit=60)
        current = await env.kube._call(api.read_validating_admission_policy, name)
        type_warnings = ((current.get("status") or {}).get("typeChecking") or {}).get("expressionWarnings")
        assert not type_warnings, type_warnings
        yield name
    finally:
        await env.kube._call(api.delete_validating_admission_policy_binding, name)
        await env.kube._call(api.delete_validating_admission_policy, name)


@pytest.mark.parametrize(("actions", "message"), BAD_FOR_ADMISSION)
async def test_admission_policy_refuses_what_xidflow_refuses_before_storage(
    env: Env, admission: str, actions: list[dict[str, Any]], message: str
) -> None:
    from pipeline.actuator.policy import PolicyError, parse_document

    spec = {"rules": [{"name": "r", "actions": actions}]}
    with pytest.raises(PolicyError):  # the admission policy refuses nothing xidflow would accept
        parse_document({"kind": "RescuePolicy", "metadata": {"name": "x"}, "spec": spec})
    with pytest.raises(Invalid) as err:
        await create_policy(env, "RescuePolicy", "rescuepolicies", env.unique("bad"), spec)
    assert message in err.value.message
    assert admission in err.value.message


async def test_admission_policy_refuses_duplicate_rule_names_and_bad_updates(env: Env, admission: str) -> None:
    dup = {"rules": [{"name": "same", "actions": [{"name": "event"}]},
                     {"name": "same", "actions": [{"name": "cordon"}]}]}
    with pytest.raises(Invalid, match="rule names must be unique"):
        await create_policy(env, "RescuePolicy", "rescuepolicies", env.unique("dup"), dup)
    name = env.unique("ok")
    await create_policy(env, "RescuePolicy", "rescuepolicies", name, {"rules": [{"actions": [{"name": "event"}]}]})
    with pytest.raises(Invalid, match="only valid for reboot"):
        await replace_spec(env, name, {"rules": [{"actions": [{"name": "drain", "hook": "job"}]}]})
    assert (await read_policy(env, name))["metadata"]["generation"] == 1  # the bad update was never stored


async def test_admission_policy_accepts_the_shipped_examples(env: Env, admission: str) -> None:
    docs = [d for d in yaml.safe_load_all(EXAMPLES.read_text()) if d and d.get("kind") == "RescuePolicy"]
    assert docs
    for doc in docs:
        await create_policy(env, "RescuePolicy", "rescuepolicies", env.unique(doc["metadata"]["name"]), doc["spec"])
