"""The warm supervisor on the real pipeline: the working child of ``xidflow worker`` and of an
``xidflow actuator`` replica is SIGKILLed mid-burst; the supervisor forks a replacement that rejoins
as the same static member. Every node ends with exactly one incident, one taint and one Event
(nothing lost, nothing doubled), the supervisors themselves never stopped, and a SIGKILL of a
supervisor leaves no orphan child working with its identity. No timing is asserted (the bench's
``failover_*`` figures measure it).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline.actuator.app import actuator_topics
from pipeline.actuator.testing import node_events, wait_until
from pipeline.app import worker_topics
from pipeline.kafka.admin import ensure_topics
from pipeline.localinfra.procs import free_port
from pipeline.runtime.supervisor import child_pids
from tests.integration.test_actuator_effects import Env
from tests.integration.test_actuator_failover import TAINT_KEY, Replicas, write_policy
from tests.integration.test_pipeline import PARTITIONS, T0, XID, Pipeline, Worker, kmsg, wait_ready
from tests.integration.workloads import ensure_ns
from tests.processes import gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

NODES = 40
X79 = XID.format(bus="4e", code=79, text="GPU has fallen off the bus.")


def _child(pid: int, within_s: float = 60) -> int:
    """The supervisor's working child (it exists once the supervisor forked it)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if children := child_pids(pid):
            return children[0]
        time.sleep(0.05)
    raise AssertionError(f"supervisor {pid} has no child after {within_s:.0f}s")


async def _replaced(pid: int, old: int, within_s: float = 60) -> int:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        children = [c for c in child_pids(pid) if c != old]
        if children:
            return children[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"supervisor {pid} did not replace child {old} within {within_s:.0f}s")


async def _taints(env: Env, node: str) -> list[dict[str, Any]]:
    return [t for t in (await env.node(node))["spec"].get("taints") or [] if t["key"] == TAINT_KEY]


async def test_children_sigkilled_mid_burst_are_replaced_and_nothing_is_lost_or_doubled(
    kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    env = Env(kafka_bootstrap, kubeconfig, unique)
    app_id = unique("sup")
    await ensure_topics(kafka_bootstrap, worker_topics(app_id, env.topics), PARTITIONS)
    await ensure_topics(kafka_bootstrap, actuator_topics(env.topics), PARTITIONS)
    await ensure_ns(env.kube, env.namespace)
    nodes = await env.make_nodes(NODES)
    reps = Replicas(env, kubeconfig, write_policy(tmp_path / "policy.yaml", "[{name: quarantine}]"))
    worker = Worker(kafka_bootstrap, app_id, env.topics.prefix, tmp_path,
                    extra_env={"XIDFLOW_GROUP_INSTANCE_ID": f"worker-{uuid.uuid4().hex[:6]}"}).start()
    try:
        for name in ("act-a", "act-b"):
            reps.start(name, tmp_path)
        async with Pipeline(kafka_bootstrap, env.topics.prefix) as pipe:
            await wait_ready(pipe, worker, within_s=180)
            assert pipe.producer is not None and worker.proc is not None
            topic = pipe.topics.name("logs_kernel")
            supervisors = {"worker": worker.proc.pid, **{n: p.pid for n, p in reps.procs.items()}}
            first = {name: _child(pid) for name, pid in supervisors.items()}

            half = NODES // 2
            sent = [await pipe.producer.send(topic, kmsg(n, X79, T0 + i), key=n.encode())
                    for i, n in enumerate(nodes[:half])]
            # Mid-burst: the worker's and one replica's working children die; their supervisors stay.
            await asyncio.sleep(0.3)
            for name in ("worker", "act-a"):
                os.kill(first[name], signal.SIGKILL)
            sent += [await pipe.producer.send(topic, kmsg(n, X79, T0 + half + i), key=n.encode())
                     for i, n in enumerate(nodes[half:])]
            await asyncio.gather(*sent)
            second = {name: await _replaced(supervisors[name], first[name]) for name in ("worker", "act-a")}

            async def all_tainted() -> bool:
                reps.alive()
                assert worker.alive(), worker.log_tail()
                return all([bool(await _taints(env, n)) for n in nodes])

            await wait_until(all_tainted, 300, poll=0.5, what="every node tainted")
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                await pipe.poll()
            incidents = {n: {i["incident_id"] for i in pipe.incidents(n) if i.get("type") == "incident"} for n in nodes}

        problems: list[str] = []
        for node in nodes:
            if len(incidents[node]) != 1:
                problems.append(f"{node}: incident ids {sorted(incidents[node])}")
            if len(await _taints(env, node)) != 1:
                problems.append(f"{node}: taints {await _taints(env, node)}")
            events = [e["reason"] for e in await node_events(env.kube, node)]
            if len(events) != 1:
                problems.append(f"{node}: node Events {events}")
        assert not problems, "\n".join(problems)
        # The supervisors never stopped: the same pids, each with its replacement child.
        assert worker.proc.pid == supervisors["worker"] and worker.alive()
        assert reps.procs["act-a"].pid == supervisors["act-a"] and reps.procs["act-a"].poll() is None
        for name in ("worker", "act-a"):
            assert child_pids(supervisors[name]) == [second[name]]
            assert "supervisor: child killed by SIGKILL" in _log(worker.log_path if name == "worker"
                                                                  else reps.logs[name])

        # A SIGKILL of the supervisor (the kubelet's, an operator's) takes its child with it.
        reps.kill("act-a")
        worker.kill()
        for name in ("worker", "act-a"):
            assert gone(second[name]), f"{name}'s child {second[name]} outlived its SIGKILLed supervisor"
    finally:
        reps.stop()
        worker.stop()
        await env.close()


def _log(path: Path) -> str:
    return path.read_text(errors="replace")


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def _serving(port: int, path: str, ok: Callable[[int, str], bool], within_s: float = 120) -> str:
    deadline = time.monotonic() + within_s
    last: tuple[int, str] = (0, "")
    while time.monotonic() < deadline:
        last = _get(port, path)
        if ok(*last):
            return last[1]
        time.sleep(0.2)
    raise AssertionError(f"{path} on {port} never answered as expected; last: {last}")


def test_metrics_and_health_ports_are_served_again_by_the_replacement_child(
    kafka_bootstrap: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    metrics_port, health_port = free_port(), free_port()
    app_id = unique("supports")
    worker = Worker(kafka_bootstrap, app_id, unique("t") + ".", tmp_path, extra_env={
        "XIDFLOW_GROUP_INSTANCE_ID": "worker-0",
        "XIDFLOW_METRICS_PORT": str(metrics_port),
        "XIDFLOW_HEALTH_PORT": str(health_port),
    }).start()
    try:
        assert worker.proc is not None
        restarts = "xidflow_supervisor_restarts_total 0.0"
        _serving(metrics_port, "/metrics", lambda code, body: code == 200 and restarts in body)
        _serving(health_port, "/livez", lambda code, body: code == 200)
        first = _child(worker.proc.pid)
        os.kill(first, signal.SIGKILL)
        # The ports are the child's: the replacement binds them again and counts itself.
        restarted = "xidflow_supervisor_restarts_total 1.0"
        _serving(metrics_port, "/metrics", lambda code, body: code == 200 and restarted in body)
        _serving(metrics_port, "/healthz", lambda code, body: code == 200)
        _serving(health_port, "/livez", lambda code, body: code == 200)
        assert worker.alive() and child_pids(worker.proc.pid) not in ([], [first])
    finally:
        worker.stop()
