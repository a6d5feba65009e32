"""Static group membership and co-partitioning, with real ``xidflow worker``/``xidflow actuator`` processes.

A SIGKILLed process restarted with the same identity is given its partitions back as the same static
member (the broker's group description names its group.instance.id), in the same generation (no
rebalance), without waiting for its session to expire: the sessions here are 300 s and the restarted
member is back long before. An orderly stop (SIGTERM) leaves the group, so the group is empty at once
instead of after 300 s. A worker whose fault-event and ticks topics disagree on partitions refuses to start.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from aiokafka.errors import KafkaError

from pipeline.actuator.app import actuator_topics
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.membership import GroupView, describe_group
from pipeline.runtime.settings import TopicNames

SESSION_S = "300"  # far longer than any wait below: a member back in time did not wait for expiry


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], env=env, stdout=out, stderr=out)


def _wait_group(
    bootstrap: str, group: str, ok: Callable[[GroupView], bool], proc: subprocess.Popen | None, log: Path
) -> GroupView:
    deadline = time.monotonic() + 120
    view = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited {proc.returncode}: {log.read_text(errors='replace')[-3000:]}")
        try:
            view = asyncio.run(describe_group(bootstrap, group))
        except KafkaError:  # a fresh broker creates its offsets topic (the coordinators) on first use
            time.sleep(0.5)
            continue
        if ok(view):
            return view
        time.sleep(0.5)
    raise AssertionError(f"group {group} never reached the expected state; last: {view}")


def _static_member(instance: str) -> Callable[[GroupView], bool]:
    def ok(view: GroupView) -> bool:
        member = view.member(instance)
        return view.state == "Stable" and len(view.members) == 1 and member is not None and bool(member.partitions)

    return ok


def _kill_restart_then_term(
    bootstrap: str, groups: list[str], args: list[str], env: dict[str, str], instance: str, log: Path
) -> None:
    proc = _spawn(args, env, log)
    try:
        before = {g: _wait_group(bootstrap, g, _static_member(instance), proc, log).member(instance) for g in groups}
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        for g in groups:  # a crash leaves nothing: the broker keeps the static member
            kept = asyncio.run(describe_group(bootstrap, g)).member(instance)
            assert kept is not None and kept.member_id == before[g].member_id
        proc = _spawn(args, env, log)
        for g in groups:
            after = _wait_group(
                bootstrap,
                g,
                lambda v, g=g: _static_member(instance)(v) and v.member(instance).member_id != before[g].member_id,
                proc,
                log,
            ).member(instance)
            assert after is not None and after.partitions == before[g].partitions
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log.read_text(errors="replace")[-3000:]
        for g in groups:  # an orderly stop left the group at once, 300 s before the session would expire
            view = asyncio.run(describe_group(bootstrap, g))
            assert view.members == () and view.state == "Empty", view
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_worker_takes_its_partitions_back_as_the_same_static_member(
    kafka_bootstrap: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    app_id = unique("sw")
    topics = TopicNames(prefix=unique("t") + ".")
    env = {
        **os.environ,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "XIDFLOW_TOPIC_PREFIX": topics.prefix,
        "XIDFLOW_GROUP_INSTANCE_ID": "worker-0",
        "XIDFLOW_GROUP_SESSION_TIMEOUT_S": SESSION_S,
    }
    args = ["worker", "--app-id", app_id, "--partitions", "2", "--loglevel", "info"]
    log = tmp_path / "worker.log"
    _kill_restart_then_term(kafka_bootstrap, [app_id, f"{app_id}-parse"], args, env, "worker-0", log)
    # No rebalance at all (KIP-345): the restarted member was handed the same generation it left, so the
    # group's other members (none here; the bench's failover_worker_rebalances with two) never paused.
    text = log.read_text(errors="replace")
    for group in (app_id, f"{app_id}-parse"):
        generations = re.findall(rf"Joined group '{re.escape(group)}' \(generation (\d+)\)", text)
        assert len(generations) == 2 and len(set(generations)) == 1, (group, generations)


def test_actuator_takes_its_partitions_back_as_the_same_static_member(
    kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    topics = TopicNames(prefix=unique("t") + ".")
    asyncio.run(ensure_topics(kafka_bootstrap, actuator_topics(topics), 2))
    group = unique("ag")
    env = {
        **os.environ,
        "KUBECONFIG": kubeconfig,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "XIDFLOW_TOPIC_PREFIX": topics.prefix,
        "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": f"xidflow.test/fleet={unique('fleet')}",
        "XIDFLOW_ACTUATOR_NAMESPACE": unique("ns"),
        "XIDFLOW_ACTUATOR_GROUP_ID": group,
        "XIDFLOW_ACTUATOR_POLICY_SOURCE": "file",
        "XIDFLOW_GROUP_INSTANCE_ID": "actuator-0",
        "XIDFLOW_GROUP_SESSION_TIMEOUT_S": SESSION_S,
    }
    args = ["actuator", "--no-api", "--log-level", "WARNING"]
    _kill_restart_then_term(kafka_bootstrap, [group], args, env, "actuator-0", tmp_path / "actuator.log")


def test_worker_refuses_topics_that_are_not_copartitioned(
    kafka_bootstrap: str, unique: Callable[[str], str]
) -> None:
    app_id = unique("cp")
    topics = TopicNames(prefix=unique("t") + ".")
    fault_events, ticks = topics.name("fault_events"), f"{app_id}-ticks"
    asyncio.run(ensure_topics(kafka_bootstrap, [fault_events], 3))
    asyncio.run(ensure_topics(kafka_bootstrap, [ticks], 2))
    env = {**os.environ, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap, "XIDFLOW_TOPIC_PREFIX": topics.prefix}
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "worker", "--app-id", app_id, "--partitions", "3"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert f"{fault_events}=3" in done.stderr and f"{ticks}=2" in done.stderr, done.stderr
    assert "co-partitioned" in done.stderr
