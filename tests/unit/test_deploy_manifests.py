"""Strimzi examples, the Grafana dashboard and the metrics contract in deploy/README.md.

The Strimzi kinds (Kafka, KafkaNodePool, KafkaTopic) have no CRDs on a bare kube-apiserver, so they
are checked here as parsed YAML against the shape Strimzi's v1beta2 API expects (not by a server).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from pipeline.runtime import metrics
from pipeline.runtime.settings import TopicNames

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

CONTRACT = {
    "xidflow_lines_total", "xidflow_fault_events_total", "xidflow_incidents_total",
    "xidflow_remediations_total", "xidflow_consumer_lag", "xidflow_breaker_open",
    "xidflow_e2e_latency_seconds", "xidflow_deadletters_total",
}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.fixture(scope="module")
def topics() -> dict[str, dict]:
    docs = _docs(DEPLOY / "strimzi" / "topics.yaml")
    assert all(d["apiVersion"] == "kafka.strimzi.io/v1beta2" and d["kind"] == "KafkaTopic" for d in docs)
    return {d["metadata"]["name"]: d for d in docs}


def test_kafka_cluster_is_kraft_with_a_node_pool() -> None:
    docs = {d["kind"]: d for d in _docs(DEPLOY / "strimzi" / "kafka.yaml")}
    assert set(docs) == {"Kafka", "KafkaNodePool"}
    kafka, pool = docs["Kafka"], docs["KafkaNodePool"]
    assert kafka["apiVersion"] == pool["apiVersion"] == "kafka.strimzi.io/v1beta2"
    assert pool["metadata"]["labels"]["strimzi.io/cluster"] == kafka["metadata"]["name"]
    assert set(pool["spec"]["roles"]) == {"controller", "broker"}
    assert pool["spec"]["replicas"] >= 3
    assert "zookeeper" not in kafka["spec"]
    assert kafka["metadata"]["annotations"]["strimzi.io/kraft"] == "enabled"
    cfg = kafka["spec"]["kafka"]["config"]
    assert cfg["min.insync.replicas"] < cfg["default.replication.factor"]
    assert {"name", "port", "type", "tls"} <= kafka["spec"]["kafka"]["listeners"][0].keys()
    assert "topicOperator" in kafka["spec"]["entityOperator"]
    volumes = pool["spec"]["storage"]["volumes"]
    assert [v for v in volumes if v.get("kraftMetadata") == "shared"]


def test_kafka_listeners_all_authenticate_and_authorization_is_on() -> None:
    kafka = {d["kind"]: d for d in _docs(DEPLOY / "strimzi" / "kafka.yaml")}["Kafka"]["spec"]["kafka"]
    assert kafka["authorization"]["type"] == "simple"
    assert all(lst["tls"] and lst.get("authentication") for lst in kafka["listeners"])
    assert "scram-sha-512" in {lst["authentication"]["type"] for lst in kafka["listeners"]}
    users = _docs(DEPLOY / "strimzi" / "users.yaml")
    assert {u["metadata"]["labels"]["strimzi.io/cluster"] for u in users} == {"xidflow"}


def test_every_default_topic_is_declared(topics: dict[str, dict]) -> None:
    names = TopicNames()
    expected = {getattr(names, f) for f in TopicNames.model_fields if f != "prefix"}
    assert set(topics) == expected
    for name, t in topics.items():
        assert DNS1123_SUBDOMAIN.fullmatch(name)
        assert t["metadata"]["labels"]["strimzi.io/cluster"] == "xidflow"
        assert t["spec"]["partitions"] >= 1 and t["spec"]["replicas"] == 3
        for key, value in t["spec"]["config"].items():
            assert isinstance(value, (str, int)), (name, key)


def _days(t: dict) -> float:
    return int(t["spec"]["config"]["retention.ms"]) / 86_400_000


def test_partitions_retention_and_compaction_per_topic(topics: dict[str, dict]) -> None:
    kernel, pods = topics["gpu.logs.kernel"], topics["gpu.logs.pods"]
    events, incidents = topics["gpu.fault.events"], topics["gpu.node.incidents"]
    audit, dead = topics["gpu.remediation.audit"], topics["gpu.logs.deadletter"]
    requests = topics["gpu.remediation.requests"]
    # raw logs: the widest, shortest lived, plain delete
    for raw in (kernel, pods):
        assert raw["spec"]["partitions"] == max(t["spec"]["partitions"] for t in topics.values())
        assert raw["spec"]["config"]["cleanup.policy"] == "delete"
        assert _days(raw) <= 1
    # fault events: days
    assert 1 < _days(events) <= 14
    # incidents: keyed by node but never compacted (a node may have several open incidents)
    assert incidents["spec"]["config"]["cleanup.policy"] == "delete"
    # audit and dead letters: long retention, never compacted
    assert _days(audit) >= 90 and audit["spec"]["config"]["cleanup.policy"] == "delete"
    assert _days(dead) >= 30 and dead["spec"]["config"]["cleanup.policy"] == "delete"
    assert _days(audit) >= _days(incidents) >= _days(events) >= _days(kernel)
    assert _days(requests) >= 1


def test_metrics_contract_matches_the_code() -> None:
    defined = {
        m._name + ("_total" if m._type == "counter" else "")
        for m in vars(metrics).values()
        if hasattr(m, "_name") and hasattr(m, "_type")
    }
    assert CONTRACT <= defined, f"pipeline/runtime/metrics.py lacks {CONTRACT - defined}"


def test_readme_documents_every_metric() -> None:
    readme = (DEPLOY / "README.md").read_text()
    documented = set(re.findall(r"`(xidflow_[a-z0-9_]+)`", readme))
    assert CONTRACT <= documented


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "xidflow.json").read_text())


def test_dashboard_shape(dashboard: dict) -> None:
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace"} <= variables
    for p in dashboard["panels"]:
        assert p["datasource"]["uid"] == "${datasource}"
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        assert p["targets"], p["title"]


def test_dashboard_queries_every_contract_metric(dashboard: dict) -> None:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(xidflow_[a-z0-9_]+?)(?:_bucket|_sum|_count)?\{", e)}
    assert CONTRACT <= used, f"no panel for {CONTRACT - used}"
    for e in exprs:
        assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
        # counters are always read through rate()/increase()
        for counter in re.findall(r"\b(xidflow_\w+_total)\{", e):
            assert re.search(rf"(rate|increase)\({counter}\{{", e), e
    labels = {
        "xidflow_fault_events_total": "kind", "xidflow_incidents_total": "action",
        "xidflow_deadletters_total": "reason", "xidflow_consumer_lag": "topic",
    }
    for metric, label in labels.items():
        assert any(metric in e and re.search(rf"by \([^)]*\b{label}\b", e) for e in exprs), metric
    assert any("xidflow_remediations_total" in e and "by (action, outcome)" in e for e in exprs)
    assert any("histogram_quantile" in e and "xidflow_e2e_latency_seconds_bucket" in e for e in exprs)
