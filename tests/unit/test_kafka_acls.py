"""One ACL table: the Strimzi KafkaUsers and the local secured broker grant exactly the same, least, rights."""

from __future__ import annotations

import yaml

from pipeline.kafka import acls as kafka_acls
from pipeline.kafka.acls import Acl, principals, strimzi_bindings
from pipeline.localinfra.kafka import acl_spec_lines
from pipeline.runtime.settings import TopicNames

T = TopicNames(prefix="")


def table() -> dict[str, set[Acl]]:
    return {p.user: set(p.acls) for p in principals(T)}


def writes(user: str) -> set[str]:
    return {a.name for a in table()[user] if a.resource_type == "topic" and a.operation == "Write"}


def reads(user: str) -> set[str]:
    return {a.name for a in table()[user] if a.resource_type == "topic" and a.operation == "Read"}


def test_strimzi_users_yaml_is_rendered_from_the_table() -> None:
    assert kafka_acls.OUT.read_text() == kafka_acls.render_users(), "run: python -m pipeline.kafka.acls"


def test_strimzi_users_and_the_local_broker_grant_the_same_acls() -> None:
    docs = [d for d in yaml.safe_load_all(kafka_acls.OUT.read_text()) if d]
    assert all(d["kind"] == "KafkaUser" and d["spec"]["authentication"]["type"] == "scram-sha-512" for d in docs)
    assert strimzi_bindings(docs) == table()
    local: dict[str, set[Acl]] = {}
    back = {"LITERAL": "literal", "PREFIXED": "prefix"}
    for line in acl_spec_lines():
        principal, rtype, pattern, name, op = line.split("\t")
        camel = "".join(w.capitalize() for w in op.split("_"))
        local.setdefault(principal.removeprefix("User:"), set()).add(Acl(rtype.lower(), name, back[pattern], camel))
    assert local == table()


def test_least_privilege_matrix() -> None:
    requests, incidents = T.name("remediation_requests"), T.name("incidents")
    writers_of_requests = [p.user for p in principals(T) if requests in writes(p.user)]
    assert writers_of_requests == ["xidflow-api"]
    assert writes("xidflow-shipper") == {T.name("logs_kernel"), T.name("logs_pods")}
    assert reads("xidflow-shipper") == set()  # a node's shipper cannot read the other nodes' lines
    # The Loki bridge already sees every line through Loki; it reads its topic back to resume.
    assert reads("xidflow-loki-tail") == {T.name("logs_kernel"), T.name("logs_pods")}
    assert writes("xidflow-loki-tail") == {T.name("logs_kernel"), T.name("logs_pods"), T.name("deadletter")}
    assert writes("xidflow-probe") == {T.name("health_checks")}
    assert reads("xidflow-worker") == set(T.raw_inputs) | {T.name("fault_events"), "xidflow-"}
    signals = T.name("fabric_signals")  # the shared-part correlation's input: worker writes, actuator reads
    assert writes("xidflow-worker") == {T.name("fault_events"), incidents, signals, T.name("deadletter"), "xidflow-"}
    assert reads("xidflow-actuator") == {incidents, signals, requests}
    assert writes("xidflow-actuator") == {T.name("remediation_audit"), T.name("deadletter")}
    assert writes("xidflow-reader") == set()
    # Nobody but the admin may alter ACLs or the cluster.
    assert not [a for p in principals(T) for a in p.acls if a.resource_type == "cluster" or a.operation == "Alter"]
