"""The demo's workloads are what a user submits; placing them is the scheduler's (tests/integration/test_demo.py)."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.demo import fleet
from pipeline.demo.fleet import DEMO_LABEL, WORKLOADS, pdb_body, pods_by_node, workload_body


def test_each_workload_spreads_over_the_demos_nodes_counting_only_nodes_it_may_land_on() -> None:
    for w in WORKLOADS:
        body = workload_body(w, "run1", 8)
        assert body["kind"] == w.kind and body["spec"]["replicas"] == 8
        spec = body["spec"]["template"]["spec"]
        assert spec["nodeSelector"] == {DEMO_LABEL: "run1"}  # never another run's or another test's node
        (spread,) = spec["topologySpreadConstraints"]
        # A cordoned or quarantined node is no domain: else it would count as an empty node, and the drained
        # pods' replacements could only go there, where they cannot (Pending).
        assert spread["nodeTaintsPolicy"] == "Honor" and spread["whenUnsatisfiable"] == "DoNotSchedule"
        assert spread["labelSelector"] == {"matchLabels": w.labels} == body["spec"]["selector"]
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(w.gpus)
        assert w.gpus * 2 * len(WORKLOADS) <= 8  # a node's 8 GPUs hold its own pods and a drained node's
        assert pdb_body(w)["spec"] == {"maxUnavailable": w.max_unavailable, "selector": {"matchLabels": w.labels}}
    assert {w.kind for w in WORKLOADS} == {"StatefulSet", "Deployment"}


def test_pods_by_node_lists_the_running_pods_oldest_first() -> None:
    def pod(name: str, node: str, created: str, phase: str = "Running", deleting: bool = False) -> dict:
        meta = {"name": name, "creationTimestamp": created} | ({"deletionTimestamp": created} if deleting else {})
        return {"metadata": meta, "spec": {"nodeName": node},
                "status": {"phase": phase, "conditions": [{"type": "Ready", "status": "True"}]}}

    pods = [pod("new", "a", "2026-11-28T13:00:05Z"), pod("old", "a", "2026-11-28T13:00:00Z"),
            pod("pending", "a", "2026-11-28T13:00:01Z", phase="Pending"),
            pod("leaving", "b", "2026-11-28T13:00:00Z", deleting=True), pod("elsewhere", "z", "2026-11-28T13:00:00Z")]
    assert pods_by_node(pods, ["a", "b"]) == {"a": ["old", "new"], "b": []}


def test_the_demo_plays_no_controller_scheduler_or_kubelet() -> None:
    """Issue 35: nothing in pipeline/demo binds a pod, reports its status, finalises a deleted pod, writes a PDB's
    status or a node's (a machine's reboot is pipeline/actuator/machines.py's). The real programs do that."""
    writes = re.compile(r"patch_namespaced_pod_status|replace_namespaced_pod_status|create_namespaced_pod_binding"
                        r"|disruption_budget_status|patch_node_status|replace_node_status|delete_namespaced_pod\b"
                        r"|grace_period_seconds\s*=\s*0|[\"']nodeName[\"']\s*:|node_name\s*=")
    found = [f"{path.name}:{n}: {line.strip()}" for path in Path(fleet.__file__).parent.glob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1) if writes.search(line)]
    assert found == []
