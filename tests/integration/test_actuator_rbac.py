"""The actuator with exactly the ServiceAccount, ClusterRole and Role shipped in deploy/rbac/actuator.yaml:
it works, and it gets 403 reading Secrets or deleting Nodes (the API server runs with RBAC)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from pipeline.actuator.app import Actuator
from pipeline.actuator.kube import Forbidden, Kube
from pipeline.actuator.testing import make_incident, node_events
from pipeline.runtime.settings import KafkaSettings
from schemas.records import Outcome
from tests.integration.test_actuator_effects import Env, outcomes
from tests.integration.workloads import job_body, wait_running

# A hang (an unbounded retry against a broken API server) fails in minutes, with its stack, not at 600 s.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

RBAC_FILE = Path(__file__).resolve().parents[2] / "deploy" / "rbac" / "actuator.yaml"



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
        # A GPU pod of a Job: notifyWorkload reads the Job and writes the pod's Event and condition as the SA.
        # Its pod is the Job controller's, placed on the node by the scheduler, kept running by KWOK.
        await env.kube.create_job(env.namespace, job_body(env.namespace, "train", name, {"job": "train"},
                                                          complete=False, gpus=1))
        await wait_running(env.kube, env.namespace, {"job": "train"}, 1, name)
        await act.engine.handle(make_incident(name, "inc-rbac"))
        node = await env.node(name)
        assert node["spec"]["unschedulable"] is True
        assert any(t["key"] == "nvidia.com/gpu-fault" for t in node["spec"]["taints"])
        assert len(await node_events(env.kube, name)) == 1
        audit = outcomes(await env.audit(), name)
        assert ("cordon", "applied") in audit and ("condition", "applied") in audit
        assert ("notifyWorkload", "applied") in audit
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


# -- every role, asked with SubjectAccessReviews: what it must do is allowed, everything else denied ----------
CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "xidflow"
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


async def can(kube: Kube, namespace: str, sa: str, verb: str, resource: str, *, group: str = "",
              ns: str | None = None, name: str | None = None, subresource: str | None = None) -> bool:
    attributes: dict[str, Any] = {"verb": verb, "resource": resource, "group": group}
    for key, value in (("namespace", ns), ("name", name), ("subresource", subresource)):
        if value is not None:
            attributes[key] = value
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": f"system:serviceaccount:{namespace}:{sa}",
            "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"],
            "resourceAttributes": attributes,
        },
    }
    answer = await kube._call(client.AuthorizationV1Api(kube.api_client).create_subject_access_review, review)
    return bool(answer["status"].get("allowed"))


def actuator_must(home: str, force: list[str]) -> list[tuple[str, str, dict[str, Any]]]:
    """What the actuator needs (from the effects, the policy watch, the breaker, drains, plans and hooks)."""
    must = [
        (verb, "nodes", {}) for verb in ("get", "list", "watch", "patch")
    ] + [
        ("patch", "nodes", {"subresource": "status"}),
        ("get", "pods", {"ns": "kube-system"}),
        ("list", "pods", {}),
        ("create", "pods", {"ns": "kube-system", "subresource": "eviction"}),
        ("create", "pods", {"ns": "default", "subresource": "eviction"}),
        ("create", "events", {"ns": "default"}),
        ("create", "events", {"ns": home}),
        ("list", "rescuepolicies", {"group": "xidflow.dev"}),
        ("watch", "warmstandbypolicies", {"group": "xidflow.dev"}),
        ("patch", "rescuepolicies", {"group": "xidflow.dev", "subresource": "status", "name": "p"}),
        ("patch", "warmstandbypolicies", {"group": "xidflow.dev", "subresource": "status", "name": "p"}),
        ("get", "customresourcedefinitions", {"group": "apiextensions.k8s.io", "name": "rescuepolicies.xidflow.dev"}),
        ("create", "configmaps", {"ns": home}),
        ("create", "jobs", {"group": "batch", "ns": home}),
        ("get", "jobs", {"group": "batch", "ns": home, "name": "xidflow-reboot-x"}),
        # notifyWorkload: pod condition, pod owners, DRA attribution
        ("patch", "pods", {"ns": "default", "subresource": "status", "name": "p"}),
        ("get", "replicasets", {"group": "apps", "ns": "default", "name": "r"}),
        ("get", "jobs", {"group": "batch", "ns": "default", "name": "j"}),
        ("get", "resourceclaims", {"group": "resource.k8s.io", "ns": "default", "name": "c"}),
        ("list", "resourceslices", {"group": "resource.k8s.io"}),
    ]
    for configmap in ("xidflow-breaker", "xidflow-drains", "xidflow-shared-parts", "xidflow-rescue-plans"):
        must += [(verb, "configmaps", {"ns": home, "name": configmap}) for verb in ("get", "update")]
    must += [("delete", "pods", {"ns": ns, "name": "p"}) for ns in force]
    # taintDevice: the node's DRA ResourceSlices, xidflow's DeviceTaintRules
    must += [(verb, "resourceslices", {"group": "resource.k8s.io"}) for verb in ("get", "list")]
    must += [(verb, "devicetaintrules", {"group": "resource.k8s.io"}) for verb in ("get", "list", "create", "delete")]
    return must


def actuator_must_not(home: str) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        ("delete", "pods", {"ns": "kube-system", "name": "p"}),
        ("delete", "pods", {"ns": "default", "name": "p"}),
        ("delete", "pods", {"ns": home, "name": "p"}),
        ("deletecollection", "pods", {"ns": "default"}),
        ("create", "pods", {"ns": home}),
        ("create", "pods", {"ns": "default", "subresource": "exec", "name": "p"}),
        ("get", "secrets", {"ns": home, "name": "xidflow-api-tokens"}),
        ("list", "secrets", {}),
        ("create", "serviceaccounts", {"ns": home, "subresource": "token", "name": "xidflow-node-ops"}),
        ("delete", "nodes", {"name": "n"}),
        ("update", "nodes", {"name": "n"}),  # every node write is a patch (issue 37)
        ("get", "configmaps", {"ns": home, "name": "something-else"}),
        ("update", "configmaps", {"ns": "kube-system", "name": "xidflow-breaker"}),
        ("delete", "configmaps", {"ns": home, "name": "xidflow-breaker"}),
        ("create", "jobs", {"group": "batch", "ns": "kube-system"}),
        ("delete", "jobs", {"group": "batch", "ns": home, "name": "j"}),
        ("create", "daemonsets", {"group": "apps", "ns": home}),
        ("update", "rescuepolicies", {"group": "xidflow.dev", "name": "p"}),
        ("delete", "rescuepolicies", {"group": "xidflow.dev", "name": "p"}),
        ("get", "customresourcedefinitions", {"group": "apiextensions.k8s.io", "name": "other.example.com"}),
        ("create", "rolebindings", {"group": "rbac.authorization.k8s.io", "ns": home}),
        ("escalate", "clusterroles", {"group": "rbac.authorization.k8s.io"}),
        ("impersonate", "serviceaccounts", {"ns": home}),
        ("delete", "events", {"ns": "default", "name": "e"}),
        ("create", "resourceslices", {"group": "resource.k8s.io"}),
        ("delete", "resourceslices", {"group": "resource.k8s.io", "name": "s"}),
        ("update", "devicetaintrules", {"group": "resource.k8s.io", "name": "r"}),
        ("patch", "devicetaintrules", {"group": "resource.k8s.io", "subresource": "status", "name": "r"}),
        ("create", "resourceclaims", {"group": "resource.k8s.io", "ns": home}),
    ]


HOOK_MUST_NOT = [
    ("get", "nodes", {}),
    ("list", "pods", {}),
    ("get", "secrets", {"ns": "kube-system", "name": "s"}),
    ("get", "configmaps", {"ns": "default", "name": "c"}),
    ("create", "events", {"ns": "default"}),
    ("create", "pods", {"ns": "default", "subresource": "eviction"}),
]


async def check_roles(kube: Kube, home: str, actuator_sa: str, hook_sa: str, force: list[str], other: str) -> None:
    failures = []
    for verb, resource, kw in actuator_must(home, force):
        if not await can(kube, home, actuator_sa, verb, resource, **kw):
            failures.append(f"actuator denied {verb} {resource} {kw}")
    for verb, resource, kw in actuator_must_not(home) + [("delete", "pods", {"ns": other, "name": "p"})]:
        if await can(kube, home, actuator_sa, verb, resource, **kw):
            failures.append(f"actuator allowed {verb} {resource} {kw}")
    for verb, resource, kw in HOOK_MUST_NOT:
        if await can(kube, home, hook_sa, verb, resource, **kw):
            failures.append(f"hook Jobs allowed {verb} {resource} {kw}")
    assert not failures, "\n".join(failures)


async def test_every_chart_role_allows_what_it_must_and_nothing_else(env: Env) -> None:
    from pipeline.localinfra.helm import helm_template

    home, force, other = env.unique("rel-ns"), env.unique("batch"), env.unique("other")
    release = env.unique("r")[:20].rstrip("-")
    for ns in (home, force, other):
        await env.kube._call(env.kube.core.create_namespace, {"metadata": {"name": ns}})
    text = helm_template(CHART, release=release, namespace=home, values_files=(),
                         set_values={"actuator.forceDeleteNamespaces[0]": force}, log=lambda _m: None)
    docs = [d for d in yaml.safe_load_all(text) if d and d["kind"] in RBAC_KINDS]
    cluster_names = [d["metadata"]["name"] for d in docs if d["kind"] == "ClusterRole"]
    try:
        await apply_docs(env.kube, docs)
        accounts = {d["metadata"]["name"].rsplit("-", 1)[-1]: d for d in docs if d["kind"] == "ServiceAccount"}
        actuator_sa, hook_sa = accounts["actuator"], accounts["ops"]
        assert hook_sa["automountServiceAccountToken"] is False
        await check_roles(env.kube, home, actuator_sa["metadata"]["name"], hook_sa["metadata"]["name"], [force], other)
    finally:
        for name in cluster_names:
            await delete_cluster_rbac(env.kube, name)
        for ns in (home, force, other):
            await env.kube._call(env.kube.core.delete_namespace, ns)


async def test_every_standalone_role_allows_what_it_must_and_nothing_else(env: Env) -> None:
    cluster_name = env.unique("xidflow-actuator")
    home, other = env.unique("home"), env.unique("other")
    docs = shipped_rbac(home, cluster_name)
    await env.kube._call(env.kube.core.create_namespace, {"metadata": {"name": other}})
    try:
        await apply_docs(env.kube, docs)
        names = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
        assert names == {"xidflow-actuator", "xidflow-node-ops"}
        await check_roles(env.kube, home, "xidflow-actuator", "xidflow-node-ops", [], other)
    finally:
        await delete_cluster_rbac(env.kube, cluster_name)
        for ns in (home, other):
            await env.kube._call(env.kube.core.delete_namespace, ns)
