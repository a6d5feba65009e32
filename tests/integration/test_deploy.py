"""The chart against a real kube-apiserver (RBAC mode): every rendered object passes server-side dry run.

- The CRDs from deploy/crds/ are installed for real (server-side apply, idempotent, never deleted:
  other tests use them), so RescuePolicy/WarmStandbyPolicy objects are validated by their schemas.
- Every object of ``helm template`` (defaults, and ci/all-enabled-values.yaml) and every document of
  deploy/examples/ is POSTed with ``dryRun=All`` and ``fieldValidation=Strict``: admission, schema and
  unknown-field checks run, nothing is stored.
- Kinds whose CRDs a bare API server lacks (Prometheus Operator ServiceMonitor) cannot be checked by
  the server; they are only shape-checked (tests/unit/test_deploy_chart.py), and listed here.
- The actuator's RBAC from the chart is created for real (unique names) and probed with
  SubjectAccessReviews: what it must be able to do, and that it cannot read Secrets or delete Nodes.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import ResourceNotFoundError

from pipeline.localinfra.helm import helm_template

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "xidflow"
ALL_ENABLED = CHART / "ci" / "all-enabled-values.yaml"
FIELD_MANAGER = "xidflow-deploy-test"
# Kinds from operators a bare API server does not have; checked for shape in the unit tests only.
EXTERNAL_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


@pytest.fixture(scope="module")
def dyn(k8s: client.ApiClient) -> DynamicClient:
    return DynamicClient(k8s)


@pytest.fixture(scope="module")
def crds(dyn: DynamicClient) -> list[str]:
    """Install (or update to) the CRDs of deploy/crds/ and wait until they are established."""
    api = dyn.resources.get(api_version="apiextensions.k8s.io/v1", kind="CustomResourceDefinition")
    names = []
    for path in sorted((ROOT / "deploy" / "crds").glob("*.yaml")):
        for doc in _docs(path.read_text()):
            api.server_side_apply(
                body=doc, name=doc["metadata"]["name"], field_manager=FIELD_MANAGER, force_conflicts=True
            )
            names.append(doc["metadata"]["name"])
    assert names, "deploy/crds/ has no CRDs"
    deadline = time.monotonic() + 30
    for name in names:
        while True:
            conds = {
                c["type"]: c["status"] for c in (api.get(name=name).to_dict().get("status") or {}).get("conditions", [])
            }
            if conds.get("Established") == "True":
                break
            assert time.monotonic() < deadline, f"CRD {name} not established: {conds}"
            time.sleep(0.2)
    dyn.resources.invalidate_cache()  # discovery must see the new kinds
    return names


@pytest.fixture
def namespace(k8s: client.ApiClient, unique) -> Iterator[str]:  # noqa: ANN001 - conftest fixture
    core = client.CoreV1Api(k8s)
    name = unique("deploy")
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


@pytest.fixture
def release() -> str:
    return "xf" + uuid.uuid4().hex[:10]


def dry_run(k8s: client.ApiClient, dyn: DynamicClient, obj: dict[str, Any], namespace: str) -> dict:
    """POST ``obj`` with dryRun=All and strict field validation; return the server's answer."""
    resource = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    path = resource.path(namespace=namespace if resource.namespaced else None)
    if resource.namespaced:
        assert obj["metadata"].get("namespace", namespace) == namespace, obj["metadata"]
    params = k8s.param_serialize(
        "POST",
        path,
        query_params=[("dryRun", "All"), ("fieldValidation", "Strict"), ("fieldManager", FIELD_MANAGER)],
        header_params={"Content-Type": "application/json", "Accept": "application/json"},
        body=obj,
        auth_settings=["BearerToken"],
    )
    response = k8s.call_api(*params)
    response.read()
    if not 200 <= response.status < 300:
        exc = ApiException(status=response.status, reason=response.reason)
        exc.body = response.data.decode("utf-8", "replace")
        raise exc
    return json.loads(response.data)


def dry_run_all(k8s: client.ApiClient, dyn: DynamicClient, docs: list[dict], namespace: str) -> list[str]:
    """Dry-run every document; return the ones the server could not check (external kinds)."""
    unchecked, failures = [], []
    for obj in docs:
        ident = f"{obj['kind']}/{obj['metadata']['name']}"
        try:
            answer = dry_run(k8s, dyn, obj, namespace)
        except ResourceNotFoundError:
            if (obj["apiVersion"], obj["kind"]) not in EXTERNAL_KINDS:
                failures.append(f"{ident}: the API server does not serve {obj['apiVersion']} {obj['kind']}")
            unchecked.append(ident)
            continue
        except ApiException as exc:
            failures.append(f"{ident}: {exc.status} {exc.body}")
            continue
        assert answer["kind"] == obj["kind"] and answer["metadata"]["name"] == obj["metadata"]["name"]
    assert not failures, "\n".join(failures)
    return unchecked


def test_default_chart_passes_server_side_dry_run(k8s, dyn, crds, namespace, release) -> None:  # noqa: ANN001
    docs = _docs(helm_template(CHART, release=release, namespace=namespace, log=lambda _m: None))
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "DaemonSet", "Service", "PodDisruptionBudget", "ClusterRole", "Role"} <= kinds
    assert dry_run_all(k8s, dyn, docs, namespace) == []
    # nothing was stored
    apps = client.AppsV1Api(k8s)
    assert apps.list_namespaced_deployment(namespace).items == []


def test_everything_enabled_passes_server_side_dry_run(k8s, dyn, crds, namespace, release) -> None:  # noqa: ANN001
    docs = _docs(
        helm_template(CHART, release=release, namespace=namespace, values_files=(ALL_ENABLED,), log=lambda _m: None)
    )
    kinds = {d["kind"] for d in docs}
    assert {"RescuePolicy", "WarmStandbyPolicy", "Secret", "ServiceMonitor"} <= kinds
    assert len([d for d in docs if d["kind"] == "Deployment"]) == 3  # worker, actuator, loki-tail
    unchecked = dry_run_all(k8s, dyn, docs, namespace)
    assert sorted(unchecked) == [f"PrometheusRule/{release}-xidflow", f"ServiceMonitor/{release}-xidflow"]


def test_secured_kafka_values_pass_server_side_dry_run(k8s, dyn, crds, namespace, release) -> None:  # noqa: ANN001
    values = CHART / "ci" / "kafka-security-values.yaml"
    docs = _docs(
        helm_template(CHART, release=release, namespace=namespace, values_files=(values,), log=lambda _m: None)
    )
    assert len([d for d in docs if d["kind"] == "Deployment"]) == 3  # worker, actuator, loki-tail
    assert dry_run_all(k8s, dyn, docs, namespace) == []


def test_examples_pass_server_side_dry_run(k8s, dyn, crds, namespace) -> None:  # noqa: ANN001
    paths = sorted((ROOT / "deploy" / "examples").glob("*.yaml"))
    assert paths
    for path in paths:
        docs = _docs(path.read_text())
        assert docs, path
        assert dry_run_all(k8s, dyn, docs, namespace) == []


def test_dry_run_rejects_what_is_wrong(k8s, dyn, crds, namespace, release) -> None:  # noqa: ANN001
    """The check above can fail: an unknown field and a policy that breaks its CRD schema are refused."""
    docs = _docs(helm_template(CHART, release=release, namespace=namespace, log=lambda _m: None))
    worker = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-worker"))
    worker["spec"]["template"]["spec"]["containers"][0]["enviroment"] = []
    with pytest.raises(ApiException) as err:
        dry_run(k8s, dyn, worker, namespace)
    assert err.value.status == 400 and "enviroment" in err.value.body
    bad_policy = {
        "apiVersion": "xidflow.dev/v1alpha1",
        "kind": "RescuePolicy",
        "metadata": {"name": f"{release}-bad"},
        "spec": {"rules": [{"priority": "high"}]},
    }
    with pytest.raises(ApiException) as err:
        dry_run(k8s, dyn, bad_policy, namespace)
    assert err.value.status == 422


def _can(
    k8s: client.ApiClient,
    user: str,
    verb: str,
    resource: str,
    *,
    group: str = "",
    namespace: str | None = None,
    name: str | None = None,
    subresource: str | None = None,
) -> bool:
    attrs: dict[str, Any] = {"verb": verb, "resource": resource, "group": group}
    if namespace:
        attrs["namespace"] = namespace
    if name:
        attrs["name"] = name
    if subresource:
        attrs["subresource"] = subresource
    review = client.AuthorizationV1Api(k8s).create_subject_access_review(
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {"user": user, "groups": ["system:serviceaccounts"], "resourceAttributes": attrs},
        }
    )
    return bool(review.status.allowed)


def test_actuator_rbac_is_least_privilege(k8s, dyn, namespace, release) -> None:  # noqa: ANN001
    docs = _docs(helm_template(CHART, release=release, namespace=namespace, log=lambda _m: None))
    rbac_kinds = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
    wanted = [d for d in docs if d["kind"] in rbac_kinds]
    created_cluster: list[tuple[str, str]] = []
    rbac = client.RbacAuthorizationV1Api(k8s)
    try:
        for obj in wanted:
            resource = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
            resource.create(body=obj, namespace=namespace if resource.namespaced else None)
            if not resource.namespaced:
                created_cluster.append((obj["kind"], obj["metadata"]["name"]))
        actuator = f"system:serviceaccount:{namespace}:{release}-xidflow-actuator"
        worker = f"system:serviceaccount:{namespace}:{release}-xidflow-worker"
        probe = f"system:serviceaccount:{namespace}:{release}-xidflow-probe"
        must = [
            ("patch", "nodes", {}),
            ("list", "nodes", {}),
            ("patch", "nodes", {"subresource": "status"}),
            ("create", "pods", {"subresource": "eviction", "namespace": "team-a"}),
            ("list", "pods", {}),
            ("create", "events", {"namespace": "default"}),
            ("list", "rescuepolicies", {"group": "xidflow.dev"}),
            ("watch", "warmstandbypolicies", {"group": "xidflow.dev"}),
            ("get", "configmaps", {"namespace": namespace, "name": "xidflow-breaker"}),
            ("update", "configmaps", {"namespace": namespace, "name": "xidflow-drains"}),
            ("create", "configmaps", {"namespace": namespace}),
            ("create", "jobs", {"group": "batch", "namespace": namespace}),
        ]
        deadline = time.monotonic() + 15  # the authorizer sees new bindings after its informers do
        for verb, resource, kw in must:
            while not _can(k8s, actuator, verb, resource, **kw):
                assert time.monotonic() < deadline, f"actuator cannot {verb} {resource} {kw}"
                time.sleep(0.2)
        must_not = [
            ("delete", "pods", {"namespace": "team-a"}),  # evictions only, unless actuator.forceDeleteNamespaces
            ("get", "secrets", {"namespace": namespace}),
            ("list", "secrets", {}),
            ("delete", "nodes", {}),
            ("create", "nodes", {}),
            ("update", "nodes", {}),  # every node write is a patch
            ("get", "configmaps", {"namespace": namespace, "name": "kube-root-ca.crt"}),
            ("update", "configmaps", {"namespace": "kube-system", "name": "xidflow-breaker"}),
            ("create", "jobs", {"group": "batch", "namespace": "default"}),
            ("create", "pods", {"namespace": "team-a"}),
            ("update", "rescuepolicies", {"group": "xidflow.dev"}),
            ("escalate", "clusterroles", {"group": "rbac.authorization.k8s.io"}),
        ]
        for verb, resource, kw in must_not:
            assert not _can(k8s, actuator, verb, resource, **kw), f"actuator may {verb} {resource} {kw}"
        for sa in (worker, probe):
            for verb, resource in (("list", "nodes"), ("get", "secrets"), ("list", "pods")):
                assert not _can(k8s, sa, verb, resource, namespace=namespace), f"{sa} may {verb} {resource}"
    finally:
        for kind, name in created_cluster:
            try:
                if kind == "ClusterRole":
                    rbac.delete_cluster_role(name)
                else:
                    rbac.delete_cluster_role_binding(name)
            except ApiException as exc:
                if exc.status != 404:
                    raise
