"""The chart at the level of the node-problem-detector / NVSentinel charts: a values schema, node-critical
node agents, liveness from the event loop, a NetworkPolicy option, `helm test`, actuator topology spread,
logging in values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.localinfra.helm import helm_template
from pipeline.localinfra.install import InstallError

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "xidflow"
ALL_ENABLED = CHART / "ci" / "all-enabled-values.yaml"


def render(*values_files: Path, **set_values: object) -> list[dict[str, Any]]:
    text = helm_template(CHART, release="rel", namespace="xf", values_files=values_files, set_values=set_values,
                         log=lambda _m: None)
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"].removeprefix("rel-xidflow-"): d for d in docs if d["kind"] == kind}


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def default_docs() -> list[dict]:
    return render()


@pytest.fixture(scope="module")
def all_docs() -> list[dict]:
    return render(ALL_ENABLED)


def test_schema_accepts_default_and_ci_values_and_what_overlays_add(tmp_path: Path) -> None:
    # helm validates the values against values.schema.json on every render: these renders are the check.
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["type"] == "object" and schema["additionalProperties"] is True
    render()
    render(ALL_ENABLED)
    overlay = tmp_path / "overlay.yaml"  # values other changes add: new blocks, extra keys in components
    overlay.write_text("extraVolumes: []\nkafka: {security: {protocol: SASL_SSL}}\nworker: {extraEnv: []}\n")
    render(ALL_ENABLED, overlay)


@pytest.mark.parametrize(("key", "value", "where"), [
    ("actuator.breaker.maxShare", 2, "/actuator/breaker/maxShare"),
    ("logLevel", "loud", "/logLevel"),
    ("worker.replicas", -1, "/worker/replicas"),
    ("actuator.taint.effect", "Sometimes", "/actuator/taint/effect"),
])
def test_helm_refuses_values_the_schema_rejects(key: str, value: object, where: str) -> None:
    with pytest.raises(InstallError, match=where):
        render(**{key: value})


def test_node_agents_are_node_critical_by_default(default_docs: list[dict]) -> None:
    daemonsets = by_kind(default_docs, "DaemonSet")
    assert set(daemonsets) == {"probe", "fluent-bit"}
    for ds in daemonsets.values():
        assert pod_spec(ds)["priorityClassName"] == "system-node-critical"
    for name, deploy in by_kind(default_docs, "Deployment").items():
        assert "priorityClassName" not in pod_spec(deploy), name


def test_liveness_is_answered_by_the_event_loop(all_docs: list[dict]) -> None:
    workloads = {**by_kind(all_docs, "Deployment"), "probe": by_kind(all_docs, "DaemonSet")["probe"]}
    assert set(workloads) == {"worker", "actuator", "loki-tail", "probe"}
    for name, w in workloads.items():
        (c,) = pod_spec(w)["containers"]
        assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "health"}, name
        assert {"name": "health", "containerPort": 9401, "protocol": "TCP"} in c["ports"], name
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["XIDFLOW_HEALTH_PORT"] == "9401"
        assert env["XIDFLOW_LOG_LEVEL"] == "debug" and env["XIDFLOW_LOG_FORMAT"] == "json", name
    (probe,) = pod_spec(workloads["probe"])["containers"]
    assert {"name": "XIDFLOW_HEALTH_MAX_LAG_S", "value": "120"} in probe["env"]


def test_network_policy_is_an_option(default_docs: list[dict], all_docs: list[dict]) -> None:
    assert not by_kind(default_docs, "NetworkPolicy")
    policies = by_kind(all_docs, "NetworkPolicy")
    assert set(policies) == {"worker", "actuator", "loki-tail"}
    deployments = by_kind(all_docs, "Deployment")
    for name, np in policies.items():
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        assert np["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        assert np["spec"]["policyTypes"] == ["Ingress"]
        ports = {p["port"] for rule in np["spec"]["ingress"] for p in rule["ports"]}
        (c,) = pod_spec(deployments[name])["containers"]
        assert ports <= {p["name"] for p in c["ports"]}
        assert ports == ({"metrics", "health", "http"} if name == "actuator" else {"metrics", "health"})
        metrics_rule = next(r for r in np["spec"]["ingress"] if r["ports"][0]["port"] == "metrics")
        assert metrics_rule["from"][0]["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": "monitoring"}


def test_helm_test_pod_checks_the_api_and_kafka(default_docs: list[dict]) -> None:
    (pod,) = [d for d in default_docs if d["kind"] == "Pod"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    script = pod["spec"]["containers"][0]["args"][0]
    assert "http://rel-xidflow-api:8080/healthz" in script and "xidflow-kafka-bootstrap.kafka.svc:9092" in script
    compile(script, "helm-test", "exec")  # the test is valid Python
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True


def test_actuator_spreads_across_zones(default_docs: list[dict]) -> None:
    spec = pod_spec(by_kind(default_docs, "Deployment")["actuator"])
    (tsc,) = spec["topologySpreadConstraints"]
    assert tsc["topologyKey"] == "topology.kubernetes.io/zone" and tsc["whenUnsatisfiable"] == "ScheduleAnyway"
    assert tsc["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "actuator"
    custom = render(**{"actuator.topologySpreadConstraints[0].maxSkew": 2,
                       "actuator.topologySpreadConstraints[0].topologyKey": "kubernetes.io/hostname",
                       "actuator.topologySpreadConstraints[0].whenUnsatisfiable": "DoNotSchedule"})
    (tsc,) = pod_spec(by_kind(custom, "Deployment")["actuator"])["topologySpreadConstraints"]
    assert tsc == {"maxSkew": 2, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule"}
