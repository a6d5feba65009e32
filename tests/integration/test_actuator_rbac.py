"""The actuator with exactly the ServiceAccount, ClusterRole and Role shipped in deploy/rbac/actuator.yaml:
it works, and it gets 403 reading Secrets or deleting Nodes (the API server runs with RBAC)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from pipeline.actuator.app import Actuator
from pipeline.actuator.kube import Forbidden, Kube
from pipeline.actuator.testing import make_incident, node_events
from pipeline.kafka_admin import ensure_topics
from pipeline.settings import KafkaSettings
from schemas.records import Outcome
from tests.integration.test_actuator_effects import Env, outcomes

# A hang (an unbounded retry against a broken API server) fails in minutes, with its stack, not at 600 s.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

RBAC_FILE = Path(__file__).resolve().parents[2] / "deploy" / "rbac" / "actuator.yaml"


@pytest.fixture
async def env(kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]) -> AsyncIterator[Env]:
    world = Env(kafka_bootstrap, kubeconfig, unique)
    await ensure_topics(kafka_bootstrap, [world.topics.name("remediation_audit")], partitions=1)
    yield world
    await world.close()


def shipped_rbac(namespace: str, cluster_name: str) -> list[dict[str, Any]]:
    """The shipped documents, moved to the test's namespace and cluster-scoped names (nothing else changed)."""
    docs = [d for d in yaml.safe_load_all(RBAC_FILE.read_text()) if d]
    out = []
    for doc in docs:
        meta = doc["metadata"]
        if doc["kind"] == "Namespace":
            meta["name"] = namespace
        if "namespace" in meta:
            meta["namespace"] = namespace
        if doc["kind"] in ("ClusterRole", "ClusterRoleBinding"):
            meta["name"] = cluster_name
        if doc["kind"] == "ClusterRoleBinding":
            doc["roleRef"]["name"] = cluster_name
        for subject in doc.get("subjects", []):
            subject["namespace"] = namespace
        out.append(doc)
    return out


async def apply_docs(kube: Kube, docs: list[dict[str, Any]]) -> list[tuple[str, str, str | None]]:
    rbac = client.RbacAuthorizationV1Api(kube.api_client)
    made: list[tuple[str, str, str | None]] = []
    for doc in docs:
        kind, name, ns = doc["kind"], doc["metadata"]["name"], doc["metadata"].get("namespace")
        create = {
            "Namespace": lambda d: kube._call(kube.core.create_namespace, d),
            "ServiceAccount": lambda d, ns=ns: kube._call(kube.core.create_namespaced_service_account, ns, d),
            "ClusterRole": lambda d: kube._call(rbac.create_cluster_role, d),
            "ClusterRoleBinding": lambda d: kube._call(rbac.create_cluster_role_binding, d),
            "Role": lambda d, ns=ns: kube._call(rbac.create_namespaced_role, ns, d),
            "RoleBinding": lambda d, ns=ns: kube._call(rbac.create_namespaced_role_binding, ns, d),
        }[kind]
        await create(doc)
        made.append((kind, name, ns))
    return made


async def delete_cluster_rbac(kube: Kube, name: str) -> None:
    rbac = client.RbacAuthorizationV1Api(kube.api_client)
    for fn in (rbac.delete_cluster_role_binding, rbac.delete_cluster_role):
        try:
            await kube._call(fn, name)
        except Exception:  # noqa: BLE001 - best-effort cleanup of what this test made
            pass


async def service_account_kube(admin: Kube, kubeconfig: str, namespace: str, sa: str) -> Kube:
    token = await admin._call(
        admin.core.create_namespaced_service_account_token,
        sa,
        namespace,
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"expirationSeconds": 3600}},
    )
    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    # Only the server address and its CA come from the admin kubeconfig; the identity is the token.
    cfg.cert_file = cfg.key_file = None
    cfg.api_key = {"authorization": f"Bearer {token['status']['token']}"}
    cfg.api_key_prefix = {}
    return Kube(client.ApiClient(cfg), 8)


async def test_actuator_works_with_shipped_rbac_and_nothing_more(env: Env, kubeconfig: str) -> None:
    (name,) = await env.make_nodes(1)
    cluster_name = env.unique("xidflow-actuator")
    docs = shipped_rbac(env.namespace, cluster_name)
    try:
        await apply_docs(env.kube, docs)
        sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
        sa_kube = await service_account_kube(env.kube, kubeconfig, env.namespace, sa)
        act = Actuator(
            env.settings(worker_id="sa", policy_source="auto"),
            KafkaSettings(KAFKA_BOOTSTRAP_SERVERS=env.bootstrap),
            env.topics,
            kubeconfig,
        )
        act.kube.close()
        act.kube = sa_kube
        act.engine.kube = act.breaker.kube = act.drains.kube = act.policies.kube = sa_kube
        await act.start(consume=False)  # namespace check, CRD detection and policy listing as the SA
        env.actuators.append(act)
        await act.engine.handle(make_incident(name, "inc-rbac"))
        node = await env.node(name)
        assert node["spec"]["unschedulable"] is True
        assert any(t["key"] == "nvidia.com/gpu-fault" for t in node["spec"]["taints"])
        assert len(await node_events(env.kube, name)) == 1
        audit = outcomes(await env.audit(), name)
        assert ("cordon", "applied") in audit and ("condition", "applied") in audit
        assert await act.breaker.status()  # breaker ConfigMap readable with the Role

        secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "stringData": {"k": "v"}}
        await env.kube._call(env.kube.core.create_namespaced_secret, env.namespace, secret)
        with pytest.raises(Forbidden):
            await sa_kube._call(sa_kube.core.read_namespaced_secret, "s", env.namespace)
        with pytest.raises(Forbidden):
            await sa_kube._call(sa_kube.core.list_secret_for_all_namespaces)
        with pytest.raises(Forbidden):
            await sa_kube._call(sa_kube.core.delete_node, name)
        assert (await env.node(name))["metadata"]["name"] == name
        decide = [r for r in await env.audit() if r.node == name and r.action == "decide"]
        assert decide and decide[0].outcome == Outcome.APPLIED
    finally:
        await delete_cluster_rbac(env.kube, cluster_name)
