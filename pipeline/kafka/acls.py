"""Who may do what on xidflow's topics: the one ACL table behind the Strimzi KafkaUsers and the local secured broker.

One principal per component, each with the least it needs:

- ``shipper`` (Fluent Bit, rsyslog, any node shipper) writes the raw log topics, nothing else;
- ``loki-tail`` (the Loki bridge) also reads them back (its resume scan) and writes its dead letters;
- ``probe`` writes health-check results;
- ``worker`` reads the raw topics, writes fault events, incidents and dead letters, and owns its
  internal topics (``<app id>-*``: ticks, table changelog, Faust's assignor topic) and groups;
- ``actuator`` reads incidents, fabric signals and rescue requests, writes the audit trail and its dead letters;
- ``api`` (the decision API) is the only principal that writes ``gpu.remediation.requests``;
- ``reader`` (dashboards, downstream consumers) reads the output topics and writes nothing.

``deploy/strimzi/users.yaml`` is rendered from this table (``python -m pipeline.kafka.acls``) and a
unit test fails when it drifts; ``pipeline.localinfra.kafka`` applies the same bindings to the local
SASL_SSL broker.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.runtime.settings import TopicNames


@dataclass(frozen=True, order=True)
class Acl:
    """One allow binding: ``operation`` on a resource (Kafka's own names: Read, Write, Describe, ...)."""

    resource_type: str  # topic | group | cluster
    name: str
    pattern: str  # literal | prefix
    operation: str


@dataclass(frozen=True)
class Principal:
    component: str
    user: str
    purpose: str
    acls: tuple[Acl, ...]


def _topics(names: list[str], *ops: str, pattern: str = "literal") -> list[Acl]:
    return [Acl("topic", n, pattern, op) for n in names for op in ops]


def _group(name: str, pattern: str = "literal") -> list[Acl]:
    return [Acl("group", name, pattern, "Read"), Acl("group", name, pattern, "Describe")]


def principals(topics: TopicNames | None = None, app_id: str = "xidflow",
               actuator_group: str = "xidflow-actuator", reader_group_prefix: str = "xidflow-reader",
               user_prefix: str = "xidflow-") -> list[Principal]:
    """The ACL table. ``Describe`` comes with every Read/Write (metadata); ``Write`` covers idempotent produce."""
    t = topics or TopicNames()
    n = t.name
    rw = ("Write", "Describe")
    ro = ("Read", "Describe")
    table = [
        Principal("shipper", "shipper", "Fluent Bit and other node shippers: write raw log lines",
                  tuple(_topics([n("logs_kernel"), n("logs_pods")], *rw))),
        # One central process that already sees every line through Loki: reading them back costs no
        # secrecy, and a restarted bridge finds where it was by scanning its own records on the topic.
        Principal("loki-tail", "loki-tail", "The Loki bridge: write raw log lines, read them back to resume, "
                  "write its dead letters", tuple(
                      _topics([n("logs_kernel"), n("logs_pods")], "Read", "Write", "Describe")
                      + _topics([n("deadletter")], *rw))),
        Principal("probe", "probe", "Node health probe: write health-check results",
                  tuple(_topics([n("health_checks")], *rw))),
        Principal("worker", "worker", "Parse + aggregation worker (Faust)", tuple(
            _topics(t.raw_inputs, *ro)
            + _topics([n("fault_events")], "Read", "Write", "Describe", "Create")
            + _topics([n("incidents"), n("fabric_signals"), n("deadletter")], "Write", "Describe", "Create")
            # Faust's own topics: ticks, the node-state changelog, the assignor topic.
            + _topics([f"{app_id}-"], "Read", "Write", "Describe", "Create", "DescribeConfigs", pattern="prefix")
            + _group(app_id) + _group(f"{app_id}-parse")
        )),
        Principal("actuator", "actuator", "Actuator: act on incidents and rescue requests, write the audit", tuple(
            _topics([n("incidents"), n("fabric_signals"), n("remediation_requests")], *ro)
            + _topics([n("remediation_audit"), n("deadletter")], *rw)
            + _group(actuator_group)
        )),
        # It also audits the requests it refuses (an Idempotency-Key reused with another body).
        Principal("api", "api", "Decision API: the only writer of rescue requests",
                  tuple(_topics([n("remediation_requests"), n("remediation_audit")], *rw))),
        Principal("reader", "reader", "Dashboards and downstream consumers: read outputs only", tuple(
            _topics([n("fault_events"), n("incidents"), n("remediation_audit"), n("deadletter")], *ro)
            + _group(reader_group_prefix, pattern="prefix")
        )),
    ]
    return [Principal(p.component, user_prefix + p.user, p.purpose, p.acls) for p in table]


# -- Strimzi ---------------------------------------------------------------------------------
def strimzi_users(cluster: str = "xidflow", topics: TopicNames | None = None) -> list[dict]:
    """KafkaUser resources (SCRAM-SHA-512, simple authorization) for ``principals()``."""
    out = []
    for p in principals(topics):
        grouped: dict[tuple[str, str, str], list[str]] = {}
        for acl in p.acls:
            grouped.setdefault((acl.resource_type, acl.name, acl.pattern), []).append(acl.operation)
        acls = []
        for (rtype, name, pattern), ops in grouped.items():
            resource: dict = {"type": rtype}
            if rtype != "cluster":
                resource.update(name=name, patternType=pattern)
            acls.append({"resource": resource, "operations": ops, "host": "*"})
        out.append({
            "apiVersion": "kafka.strimzi.io/v1beta2",
            "kind": "KafkaUser",
            "metadata": {"name": p.user, "labels": {
                "strimzi.io/cluster": cluster, "app.kubernetes.io/part-of": "xidflow",
                "xidflow.dev/component": p.component}},
            "spec": {"authentication": {"type": "scram-sha-512"},
                     "authorization": {"type": "simple", "acls": acls}},
        })
    return out


HEADER = """\
# GENERATED from pipeline/kafka/acls.py (python -m pipeline.kafka.acls); a unit test fails when stale.
# One KafkaUser per xidflow component (SCRAM-SHA-512) with least-privilege ACLs; the local secured
# broker (`xidflow local up --kafka-security sasl_ssl`) applies the same table. The User Operator
# writes each password into a Secret named like the user (key "password"); point the chart at it
# (kafka.sasl.existingSecret per component, see deploy/README.md). With XIDFLOW_TOPIC_PREFIX,
# regenerate with the prefix set.
"""

OUT = Path(__file__).resolve().parents[2] / "deploy" / "strimzi" / "users.yaml"


def render_users() -> str:
    users = strimzi_users(topics=TopicNames(prefix=""))
    return HEADER + "".join("---\n" + yaml.safe_dump(u, sort_keys=False) for u in users)


def strimzi_bindings(docs: list[dict]) -> dict[str, set[Acl]]:
    """The ACLs a set of KafkaUser resources grants, per user, as ``Acl`` values (for comparison)."""
    out: dict[str, set[Acl]] = {}
    for d in docs:
        acls = out.setdefault(d["metadata"]["name"], set())
        for rule in d["spec"]["authorization"]["acls"]:
            r = rule["resource"]
            for op in rule["operations"]:
                acls.add(Acl(r["type"], r.get("name", "kafka-cluster"), r.get("patternType", "literal"), op))
    return out


def kafka_acls_commands(bootstrap: str = "$BOOTSTRAP", command_config: str = "admin.properties") -> list[str]:
    """The table as ``kafka-acls.sh`` commands, for clusters without Strimzi (MSK SCRAM, self-managed)."""
    out = []
    for p in principals():
        for a in p.acls:
            flag = {"topic": "--topic", "group": "--group"}.get(a.resource_type, "--cluster")
            resource = f"{flag} {a.name}" if flag != "--cluster" else flag
            out.append(f"kafka-acls.sh --bootstrap-server {bootstrap} --command-config {command_config} --add "
                       f"--allow-principal User:{p.user} --operation {a.operation} {resource} "
                       f"--resource-pattern-type {'prefixed' if a.pattern == 'prefix' else 'literal'}")
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["kafka-acls"]:
        print("\n".join(kafka_acls_commands()))
    else:
        OUT.write_text(render_users())
        print(f"wrote {OUT}", file=sys.stderr)
