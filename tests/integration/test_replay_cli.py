"""``xidflow replay`` end to end on the real Kafka and API server: a produced history in several shipper
shapes (with lines older than --since, a storm that trips the breaker), the real CLI as a subprocess,
the report checked, and proof that it changed nothing: no consumer group, no committed offsets, the
API server's objects as they were."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from pipeline.actuator.testing import XIDFLOW_EVENT_SOURCE
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from tests.integration.test_actuator_effects import Env
from tests.integration.test_actuator_policy_crd import GROUP, VERSION, install_crds

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
X79 = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
X48 = ("NVRM: Xid (PCI:0000:1b:00): 48, pid=1234, name=python3, An uncorrectable double bit error (DBE) has "
       "been detected")
X13 = ("NVRM: Xid (PCI:0000:1b:00): 13, pid=48213, name=python3, Graphics Exception: ESR 0x504648=0x1000a "
       "(GPC 3, TPC 1, SM 0)")

CANDIDATE = {
    "apiVersion": f"{GROUP}/{VERSION}",
    "kind": "RescuePolicy",
    "metadata": {"name": "candidate"},
    "spec": {"rules": [
        {"name": "lost-gpu-reboot", "priority": 100, "codes": [79],
         "actions": [{"name": "quarantine"}, {"name": "drain"}, {"name": "reboot", "hook": "annotation"}]},
        {"name": "dbe-reset", "priority": 90, "codes": [48],
         "actions": [{"name": "quarantine"}, {"name": "resetGpu"}]},
    ]},
}


def kmsg(node: str, line: str, ts: float) -> bytes:
    """Fluent Bit kmsg input with the Kafka output's @timestamp."""
    return orjson.dumps({"priority": 3, "sequence": 1, "sec": 1, "usec": 0, "msg": line, "@timestamp": ts,
                         "node": node})


def loki_push(node: str, line: str, ts: float) -> bytes:
    """A Loki push body (the Konduktor path through ``xidflow loki-tail``)."""
    return orjson.dumps({"streams": [{"stream": {"node": node, "job": "kmsg"},
                                      "values": [[str(int(ts * 1e9)), line]]}]})


def pod_tail(node: str, line: str, ts: float) -> bytes:
    """Fluent Bit tail + kubernetes filter."""
    return orjson.dumps({"log": line, "stream": "stderr",
                         "time": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(ts)),
                         "kubernetes": {"host": node, "pod_name": "trainer-0", "namespace_name": "ml",
                                        "container_name": "trainer"}})


async def produce(bootstrap: str, records: list[tuple[str, str, bytes, float]]) -> None:
    producer = kafka_clients.producer(bootstrap=bootstrap, acks="all")
    await producer.start()
    try:
        for topic, node, value, ts in records:
            await producer.send(topic, value, key=node.encode(), timestamp_ms=int(ts * 1000))
        await producer.flush()
    finally:
        await producer.stop()


async def groups(bootstrap: str) -> set[str]:
    admin = kafka_clients.admin(bootstrap=bootstrap)
    await admin.start()
    try:
        return {g[0] for g in await admin.list_consumer_groups()}
    finally:
        await admin.close()


async def snapshot(env: Env, nodes: list[str]) -> dict[str, Any]:
    """resourceVersions of every object the replay could have touched (nodes, policies, the namespace; of Events,
    xidflow's)."""
    kube = env.kube
    out: dict[str, Any] = {}
    for node in nodes:
        obj = await kube._call(kube.core.read_node, node)
        out[f"node/{node}"] = obj["metadata"]["resourceVersion"]
    for plural in ("rescuepolicies", "warmstandbypolicies"):
        page = await kube.list_cluster_objects_page(GROUP, VERSION, plural, env.selector)
        for doc in page.get("items") or []:
            out[f"{plural}/{doc['metadata']['name']}"] = doc["metadata"]["resourceVersion"]
    listers = (("configmap", kube.core.list_namespaced_config_map), ("event", kube.core.list_namespaced_event),
               ("job", kube.batch.list_namespaced_job))
    for kind, lister in listers:
        for ns in (env.namespace, "default"):
            page = await kube._call(lister, ns)
            for item in page.get("items") or []:
                if kind == "event" and (item.get("source") or {}).get("component") != XIDFLOW_EVENT_SOURCE:
                    continue  # the cluster's (the node lifecycle controller's RegisteredNode ...), written when it may
                if any(n in str(item) for n in nodes) or ns == env.namespace:
                    out[f"{kind}/{ns}/{item['metadata']['name']}"] = item["metadata"]["resourceVersion"]
    return out


def test_replay_on_a_produced_history_reports_and_changes_nothing(
    kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    env = Env(kafka_bootstrap, kubeconfig, unique)
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    policy_name = unique("base")
    try:
        run(install_crds(env.kube))
        nodes = run(env.make_nodes(6))
        old, n1, n2, n3, n4, n5 = nodes
        # The policy in force: Xid 79 quarantines only (no drain, no reboot).
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RescuePolicy",
                "metadata": {"name": policy_name, "labels": env.fleet_label},
                "spec": {"rules": [{"name": "in-force-79", "priority": 100, "codes": [79],
                                    "actions": [{"name": "quarantine"}]}]}}
        run(env.kube._call(env.kube.custom.create_cluster_custom_object, GROUP, VERSION, "rescuepolicies", body))
        kernel, pods, health = (env.topics.name(n) for n in ("logs_kernel", "logs_pods", "health_checks"))
        run(ensure_topics(kafka_bootstrap, [kernel], partitions=3))
        run(ensure_topics(kafka_bootstrap, [pods, health], partitions=1))
        now = time.time()
        history = [
            # Older than --since 1d: must not count.
            (kernel, old, kmsg(old, X79, now - 3 * 86400), now - 3 * 86400),
            # Three shapes of kernel lines, hours apart: three quarantines (3 of 6 nodes: at the limit).
            (kernel, n1, kmsg(n1, X79, now - 7200), now - 7200),
            (kernel, n2, loki_push(n2, X48, now - 5400), now - 5400),
            (kernel, n3, X79.encode(), now - 3600),  # plain text, the node from the key
            # Pod lines alone open nothing; an application Xid is one Warning Event.
            (pods, n1, pod_tail(n1, "torch.distributed.DistBackendError: NCCL error in: x.cpp:1970, "
                                    "unhandled system error", now - 3000), now - 3000),
            (kernel, n5, kmsg(n5, X13, now - 2400), now - 2400),
        ]
        # A storm: Xid 79 on n4, then on n5 ten seconds later, 2,000 lines each: the breaker trips on n4.
        # (Records of different partitions with equal timestamps have no order, in the live system too.)
        for i in range(2000):
            for node, start in ((n4, now - 600), (n5, now - 590)):
                ts = start + i * 0.0005
                history.append((kernel, node, kmsg(node, X79, ts), ts))
        run(produce(kafka_bootstrap, history))

        groups_before = run(groups(kafka_bootstrap))
        objects_before = run(snapshot(env, nodes))
        policy = tmp_path / "candidate.yaml"
        policy.write_text(yaml.safe_dump(CANDIDATE))
        proc_env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
            "KUBECONFIG": kubeconfig,
            "XIDFLOW_TOPIC_PREFIX": env.topics.prefix,
            "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": env.selector,
            "XIDFLOW_ACTUATOR_POLICY_LABEL_SELECTOR": env.selector,
            "XIDFLOW_ACTUATOR_NAMESPACE": env.namespace,
        }

        def replay(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "pipeline.cli", "replay", "--policy", str(policy),
                                   "--since", "1d", *args], env=proc_env, capture_output=True, text=True, timeout=240)

        done = replay("-o", "json")
        assert done.returncode == 0, done.stderr
        rep = orjson.loads(done.stdout)
        assert rep["baseline"].startswith("RescuePolicy objects in the cluster") and policy_name in rep["baseline"]
        assert rep["fleet"] == {"size": 6, "source": "GPU nodes in the cluster"}
        assert rep["history"]["records_read"] == len(history) - 1  # the 3-day-old line is outside the window
        by_node = {r["node"]: r for r in rep["nodes"]}
        assert old not in by_node
        assert by_node[n1]["actions"] == ["cordon", "taint", "condition", "event", "notifyWorkload", "drain", "reboot"]
        assert by_node[n2]["actions"] == ["cordon", "taint", "condition", "event", "notifyWorkload", "resetGpu"]
        assert by_node[n2]["gpus"] == ["0000:1b:00.0"]
        assert by_node[n3]["rules"] == ["lost-gpu-reboot"] and by_node[n3]["quarantined"]
        assert by_node[n4]["refused_by_breaker"] and not by_node[n4]["quarantined"]
        assert by_node[n5]["refused_by_breaker"] and by_node[n5]["actions"] == ["event", "notifyWorkload"]
        diff = {(r["node"], r["action"], r["change"]) for r in rep["diff"]}
        assert diff == {(n1, "drain", "added"), (n1, "reboot", "added"), (n3, "drain", "added"),
                        (n3, "reboot", "added"), (n2, "resetGpu", "added")}
        trips = {t["policy"]: t for t in rep["breaker_trips"]}
        assert set(trips) == {"candidate", "baseline"}
        assert trips["candidate"]["tripped_by"] == n4 and trips["candidate"]["nodes_refused"] == 2
        assert sorted(trips["candidate"]["refused"]) == sorted([n4, n5])
        counts = {r["action"]: r["nodes"] for r in rep["actions"]}
        assert counts["cordon"] == 3 and counts["reboot"] == 2 and counts["resetGpu"] == 1

        table = replay()
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert any(line.startswith("Baseline: RescuePolicy objects in the cluster") for line in lines)
        header = next(line for line in lines if line.startswith("NODE "))
        assert header.split()[:5] == ["NODE", "QUARANTINED", "ACTIONS", "GPUS", "BREAKER"]
        assert any(line.split()[:2] == [n1, "yes"] for line in lines)
        assert any(line.split()[:3] == [n1, "reboot", "+"] for line in lines)
        assert any(line.split()[:3] == ["candidate", trips["candidate"]["at"], n4] for line in lines)

        # Nothing changed: no consumer group (so no committed offsets), the same objects, same versions.
        groups_after = run(groups(kafka_bootstrap))
        assert groups_after - groups_before == set()
        assert not any("replay" in g for g in groups_after)
        assert run(snapshot(env, nodes)) == objects_before
    finally:
        try:
            run(env.kube._call(env.kube.custom.delete_cluster_custom_object, GROUP, VERSION, "rescuepolicies",
                               policy_name))
        except Exception:  # noqa: BLE001 - best-effort cleanup
            pass
        run(env.close())
        loop.close()
