"""Chart and Strimzi manifests agree on co-partitioning; worker and actuator get stable group identities."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.unit.test_deploy_chart import container, env_of, one, render

ROOT = Path(__file__).resolve().parents[2]


def test_chart_partitions_match_strimzi_fault_events() -> None:
    topics = {
        d["metadata"]["name"]: d
        for d in yaml.safe_load_all((ROOT / "deploy" / "strimzi" / "topics.yaml").read_text())
        if d
    }
    env = env_of(container(one(render(), "Deployment", "-worker")))
    assert int(env["XIDFLOW_WORKER_PARTITIONS"]) == topics["gpu.fault.events"]["spec"]["partitions"]


def test_worker_and_actuator_are_static_members_named_after_their_pod() -> None:
    docs = render()
    for suffix in ("-worker", "-actuator"):
        env = env_of(container(one(docs, "Deployment", suffix)))
        assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        session = float(env["XIDFLOW_GROUP_SESSION_TIMEOUT_S"])
        assert float(env["XIDFLOW_GROUP_HEARTBEAT_INTERVAL_S"]) * 3 <= session
        assert float(env["XIDFLOW_GROUP_MAX_POLL_INTERVAL_S"]) >= session
        assert env["XIDFLOW_GROUP_LEAVE_ON_SHUTDOWN"] == "true"
