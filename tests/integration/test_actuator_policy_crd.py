"""RescuePolicy / WarmStandbyPolicy CRDs on the real API server: schema validation, loading, acting."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from pipeline.actuator.kube import AlreadyExists, Invalid, Kube
from pipeline.actuator.policystore import PolicyStore
from pipeline.actuator.testing import make_incident
from pipeline.kafka_admin import ensure_topics
from tests.integration.test_actuator_effects import Env, outcomes

# A hang (an unbounded retry against a broken API server) fails in minutes, with its stack, not at 600 s.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CRD_DIR = Path(__file__).resolve().parents[2] / "deploy" / "crds"
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
