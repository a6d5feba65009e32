"""A restarted ``xidflow actuator`` or ``xidflow worker`` runs no garbage collection before its fork.

Everything a service's start builds (modules, classes, pydantic models, settings) lives as long as the
process, so the cyclic collector's passes over it during the start free nothing; under CPython's
default thresholds they were dozens of young collections, CPU spent before a restarted container's
partitions flow again (issue 22, ``failover_*_process``), and the supervisor's full collection before
it froze what its children share was one more. The command pauses the collector for its start
(``pipeline.cli``), the supervisor freezes without collecting, and the service turns the collector on
again (``pipeline.runtime.gcpolicy.tune``).

Each service runs here for real against the broker (and the API server), in a fresh interpreter
whose ``gc.callbacks`` write every collection down; the start timeline (``pipeline.runtime.startmarks``)
says where the fork was. Not a timing: a list of collections.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.actuator.app import actuator_topics
from pipeline.app import worker_topics
from pipeline.kafka.admin import ensure_topics
from pipeline.localinfra import procs
from pipeline.runtime import startmarks
from pipeline.runtime.settings import TopicNames
from tests.integration.test_actuator_effects import Env
from tests.integration.test_actuator_failover import write_policy
from tests.integration.test_pipeline import PARTITIONS, WORKER_ENV
from tests.integration.workloads import ensure_ns

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# The command line as ``xidflow`` runs it, with every collection (its process, its generation) appended to a file.
HOOK = textwrap.dedent(
    """
    import gc, os, sys, time
    out = open(sys.argv[1], "a", buffering=1)
    gc.callbacks.append(
        lambda phase, info: phase == "start" and out.write(f"{os.getpid()} {time.time():.6f} {info['generation']}\\n")
    )
    sys.argv = ["xidflow", *sys.argv[2:]]
    from pipeline.cli import main
    main()
    """
)


def _marks(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _has(marks: list[dict], name: str) -> bool:
    return any(m["mark"] == name for m in marks)


def _run_until(args: list[str], env: dict[str, str], tmp_path: Path, until: Callable[[list[dict]], bool]) -> tuple:
    """Start the command; once the timeline satisfies ``until``, stop it. (marks, collections, log)."""
    timeline, collections, log = tmp_path / "start.jsonl", tmp_path / "gc.txt", tmp_path / "service.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOOK, str(collections), *args],
            env={**env, startmarks.ENV: str(timeline)}, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180
        while not until(_marks(timeline)):
            assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
            assert time.monotonic() < deadline, f"never got there:\n{log.read_text(errors='replace')[-3000:]}"
            time.sleep(0.1)
    finally:
        procs.terminate(proc)
    rows = [line.split() for line in collections.read_text().splitlines()] if collections.exists() else []
    return _marks(timeline), [(int(pid), float(t), int(gen)) for pid, t, gen in rows], log


def _before_fork(marks: list[dict], collections: list[tuple[int, float, int]]) -> list[int]:
    """The generations collected in the supervisor from its command line's parsing to its fork.

    Not before: the interpreter's start and ``import click`` (``cli``) run before the command is known, a
    few young collections of small heaps that a command line like ``xidflow classify`` keeps needing."""
    cli, fork = (next(m for m in marks if m["mark"] == name) for name in ("cli", "fork"))
    return [gen for pid, t, gen in collections if pid == fork["pid"] and cli["t"] <= t <= fork["t"]]


async def test_the_actuator_start_collects_nothing_before_its_fork(
    kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    env = Env(kafka_bootstrap, kubeconfig, unique)
    try:
        await ensure_topics(kafka_bootstrap, actuator_topics(env.topics), PARTITIONS)
        await ensure_ns(env.kube, env.namespace)
        policy = write_policy(tmp_path / "policy.yaml", "[{name: quarantine}]")
        variables = {
            **os.environ, "KUBECONFIG": kubeconfig, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
            "XIDFLOW_TOPIC_PREFIX": env.topics.prefix, "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": env.selector,
            "XIDFLOW_ACTUATOR_NAMESPACE": env.namespace, "XIDFLOW_ACTUATOR_GROUP_ID": unique("g"),
            "XIDFLOW_ACTUATOR_POLICY_SOURCE": "file", "XIDFLOW_ACTUATOR_POLICY_FILE": str(policy),
            "XIDFLOW_METRICS_PORT": "0", "XIDFLOW_GROUP_INSTANCE_ID": unique("act"),
        }
        # Until its child holds its partitions: the replica started, and works, with the collector's new policy.
        marks, collections, _ = await asyncio.to_thread(
            _run_until, ["actuator", "--no-api"], variables, tmp_path, lambda ms: _has(ms, "assigned")
        )
    finally:
        await env.kube.aclose()
    assert _before_fork(marks, collections) == []


async def test_the_worker_start_collects_nothing_before_its_fork(
    kafka_bootstrap: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    app_id, prefix = unique("gcw"), unique("t") + "."
    await ensure_topics(kafka_bootstrap, worker_topics(app_id, TopicNames(prefix=prefix)), PARTITIONS)
    variables = {**os.environ, **WORKER_ENV, "XIDFLOW_TOPIC_PREFIX": prefix, "XIDFLOW_GROUP_INSTANCE_ID": unique("w")}
    args = ["worker", "--bootstrap", kafka_bootstrap, "--app-id", app_id, "--partitions", str(PARTITIONS)]
    marks, collections, log = await asyncio.to_thread(
        _run_until, args, variables, tmp_path, lambda ms: _has(ms, "fork")
    )
    assert _before_fork(marks, collections) == [], log.read_text(errors="replace")[-2000:]
