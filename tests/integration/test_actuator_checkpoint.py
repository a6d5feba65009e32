"""Checkpoint-aware drain (``checkpointGrace``) on the session's control plane: the training pods are a
StatefulSet's (placed by the scheduler, run by KWOK), and the job's side of each pod, which KWOK does not run, is
a real process (tests/integration/checkpoint_job.py, built on the shipped example
deploy/examples/checkpoint_on_drain.py).

Three cases: the job answers in time (evicted right after its answer, long before the grace), the job
never answers (evicted at the grace), and the ``xidflow actuator`` replica waiting is SIGKILLed: the
survivor waits for the same deadline (kept in the node's ledger), asks nobody twice and evicts at it.

``XIDFLOW_CHECKPOINT_TIMINGS=<file>`` appends each case's timings (one JSON line) for the report;
nothing here asserts on a duration beyond what the behaviour means (before the grace / not before it).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from pipeline.actuator import checkpoint
from pipeline.actuator.policy import load_yaml_text
from pipeline.actuator.testing import make_incident, publish, wait_until
from schemas.records import Action, Outcome
from tests.integration.test_actuator_effects import Env
from tests.integration.test_actuator_failover import (
    LEASE_SECONDS,
    Replicas,
    claim_holder,
    wait_finished,
    write_policy,
)
from tests.integration.workloads import deployment, ensure_ns, pods_on, statefulset

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

JOB = Path(__file__).resolve().parent / "checkpoint_job.py"
CODE = 48  # double-bit ECC: RESET_GPU, the GPU still runs


@pytest.fixture
def env(consuming_env: Env) -> Env:
    return consuming_env


def incident(node: str, flow: str, code: int = CODE, action: Action = Action.RESET_GPU) -> Any:
    return make_incident(node, flow, code=code, action=action)


class Job:
    """The job's process on one pod: its JSON lines, read as they come."""

    def __init__(self, kubeconfig: str, namespace: str, pod: str, log: Path, *flags: str) -> None:
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, str(JOB), namespace, pod, *flags],
            env={**os.environ, "KUBECONFIG": kubeconfig},
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )

    def moments(self) -> dict[str, float]:
        found: dict[str, float] = {}
        for line in self.log.read_text().splitlines():
            if line.startswith("{"):
                entry = json.loads(line)
                found.setdefault(entry["event"], entry["t"])
        return found

    async def wait_for(self, moment: str, limit: float = 60) -> float:
        async def seen() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"job exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            return moment in self.moments()

        await wait_until(seen, limit, poll=0.1, what=f"job {moment}")
        return self.moments()[moment]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # our own child, by its pid
            self.proc.wait(10)


@contextmanager
def jobs(*started: Job) -> Iterator[tuple[Job, ...]]:
    try:
        yield started
    finally:
        for job in started:
            job.stop()


async def gpu_pods(env: Env, node: str, name: str, replicas: int) -> str:
    """A StatefulSet ``name`` of one-GPU pods (``<name>-0`` ...) on the node; its namespace."""
    ns = env.unique("train")
    await ensure_ns(env.kube, ns)
    await statefulset(env.kube, ns, name, node, replicas, {"app": "train"}, gpus=1)
    return ns


async def checkpoint_events(env: Env, ns: str) -> list[dict[str, Any]]:
    page = await env.kube._call(env.kube.core.list_namespaced_event, ns)
    return [e for e in page.get("items") or [] if e.get("reason") == checkpoint.EVENT_REASON]


async def drain_record(env: Env, node: str) -> Any:
    records = [r for r in await env.audit() if r.node == node and r.action == "drain"]
    assert records, "no drain audit record"
    return records[-1]


def record_timings(case: str, **values: float) -> None:
    if path := os.environ.get("XIDFLOW_CHECKPOINT_TIMINGS"):
        with Path(path).open("a") as fh:
            fh.write(json.dumps({"case": case, **{k: round(v, 2) for k, v in values.items()}}) + "\n")


async def evicted_when(env: Env, node: str, limit: float) -> float:
    async def empty() -> bool:
        return await pods_on(env.kube, node) == []

    await wait_until(empty, limit, poll=0.1, what="pods evicted")
    return time.time()


async def test_a_job_that_answers_is_evicted_after_its_answer_well_before_the_grace(
    env: Env, kubeconfig: str, tmp_path: Path
) -> None:
    (node,) = await env.make_nodes(1)
    ns = await gpu_pods(env, node, "trainer", 2)
    # A pod without a GPU is drained as usual and never asked.
    (web,) = await deployment(env.kube, ns, "web", node, 1, {"app": "web"})
    grace = 60.0
    act = await env.actuator(
        load_yaml_text(
            "kind: RescuePolicy\nmetadata: {name: t}\nspec:\n  rules:\n"
            f"  - {{priority: 10, codes: [{CODE}], actions: [{{name: cordon}}, "
            f"{{name: drain, gracePeriodCap: 0, timeout: 30, checkpointGrace: {grace:g}s}}]}}\n"
        )
    )
    with jobs(
        Job(kubeconfig, ns, "trainer-0", tmp_path / "j0.log", "--save-seconds", "1"),
        Job(kubeconfig, ns, "trainer-1", tmp_path / "j1.log", "--save-seconds", "2"),
    ) as (j0, j1):
        await j0.wait_for("ready")
        await j1.wait_for("ready")
        started = time.time()
        await act.engine.handle(incident(node, "inc-ckpt-answer"))
        ended = time.time()
        assert await pods_on(env.kube, node) == []
        answered = max(j0.moments()["answered"], j1.moments()["answered"])
        requested = min(j0.moments()["requested"], j1.moments()["requested"])
    assert "GPU fault xid 48" in j0.log.read_text()  # the request's message, as the job read it
    record = await drain_record(env, node)
    assert record.outcome == Outcome.APPLIED, record.reason
    details = record.details["checkpoint"]
    assert details["result"] == "answered", details
    assert sorted(details["answered"]) == [f"{ns}/trainer-0", f"{ns}/trainer-1"]
    assert sorted(record.details["evicted"]) == sorted([f"{ns}/trainer-0", f"{ns}/trainer-1", f"{ns}/{web}"])
    # Evicted after the last answer, long before the deadline.
    assert answered <= ended and ended - started < grace / 2
    events = await checkpoint_events(env, ns)
    assert sorted(e["involvedObject"]["name"] for e in events) == ["trainer-0", "trainer-1"]
    assert all(e["type"] == "Warning" for e in events)
    # A redelivery neither asks again nor evicts again.
    await act.engine.handle(incident(node, "inc-ckpt-answer"))
    assert len(await checkpoint_events(env, ns)) == 2
    record_timings("answers", request_to_answer_s=answered - requested, answer_to_drained_s=ended - answered,
                   incident_to_drained_s=ended - started, grace_s=grace)


async def test_a_job_that_never_answers_is_evicted_at_the_grace(env: Env, kubeconfig: str, tmp_path: Path) -> None:
    (node,) = await env.make_nodes(1)
    ns = await gpu_pods(env, node, "silent", 1)
    grace = 5.0
    act = await env.actuator(
        load_yaml_text(
            "kind: RescuePolicy\nmetadata: {name: t}\nspec:\n  rules:\n"
            f"  - {{priority: 10, codes: [{CODE}], actions: [{{name: cordon}}, "
            f"{{name: drain, gracePeriodCap: 0, timeout: 30, checkpointGrace: {grace:g}}}]}}\n"
        )
    )
    with jobs(Job(kubeconfig, ns, "silent-0", tmp_path / "j.log", "--never")) as (job,):
        await job.wait_for("ready")
        started = time.time()
        await act.engine.handle(incident(node, "inc-ckpt-silent"))
        ended = time.time()
        requested = await job.wait_for("requested")
    assert await pods_on(env.kube, node) == []
    record = await drain_record(env, node)
    details = record.details["checkpoint"]
    assert record.outcome == Outcome.APPLIED and details["result"] == "grace-expired", details
    assert details["unanswered"] == [f"{ns}/silent-0"] and details["answered"] == []
    assert "grace 5s expired" in record.reason
    ledger = await env.ledger(node)
    wait = checkpoint.Wait.from_value(ledger.flow_value("inc-ckpt-silent", checkpoint.ledger_name("drain")))
    assert wait is not None and wait.until - wait.at == pytest.approx(grace, abs=0.01)
    assert ended >= wait.until  # not one moment before the deadline
    record_timings("never-answers", request_to_drained_s=ended - requested, incident_to_drained_s=ended - started,
                   grace_s=grace)


async def test_a_replica_killed_mid_wait_is_replaced_by_one_that_keeps_the_deadline(
    env: Env, kubeconfig: str, tmp_path: Path
) -> None:
    (node,) = await env.make_nodes(1)
    ns = await gpu_pods(env, node, "long", 1)
    grace = 24.0
    policy = write_policy(
        tmp_path / "p.yaml",
        f"[{{name: cordon}}, {{name: drain, gracePeriodCap: 0, timeout: 60, checkpointGrace: {grace:g}}}]",
    )
    policy.write_text(policy.read_text().replace("codes: [79]", f"codes: [{CODE}]"))
    reps = Replicas(env, kubeconfig, policy)
    flow = "inc-ckpt-kill"
    with jobs(Job(kubeconfig, ns, "long-0", tmp_path / "j.log", "--never")) as (job,):
        try:
            for worker in ("rep-a", "rep-b"):
                reps.start(worker, tmp_path)
            await job.wait_for("ready")
            await publish(env.bootstrap, env.topics.name("incidents"), [incident(node, flow)])
            requested = await job.wait_for("requested", 90)
            kept = (await env.ledger(node)).flow_value(flow, checkpoint.ledger_name("drain"))
            first = checkpoint.Wait.from_value(kept)
            assert first is not None
            dead = await claim_holder(env, node, flow, "drain")
            assert dead is not None
            await asyncio.sleep(LEASE_SECONDS / 2)  # inside the wait, the lease renewed meanwhile
            assert await claim_holder(env, node, flow, "drain") == dead
            assert await pods_on(env.kube, node) == ["long-0"]
            reps.kill(dead)
            killed = time.time()
            survivor = next(w for w in reps.procs if w != dead)

            async def retaken() -> bool:
                reps.alive()
                return await claim_holder(env, node, flow, "drain") == survivor

            await wait_until(retaken, 90, poll=0.1, what="drain retaken")
            retaken_at = time.time()
            drained = await evicted_when(env, node, grace + 90)
            entry = await wait_finished(env, reps, node, flow)  # its audit record written
            assert entry["status"] == "done" and entry["log"]["drain"]["by"] == survivor
        finally:
            reps.stop()
    # The survivor waited for the deadline the dead replica recorded, not a new grace from its takeover.
    ledger = await env.ledger(node)
    assert checkpoint.Wait.from_value(ledger.flow_value(flow, checkpoint.ledger_name("drain"))) == first
    assert drained >= first.until
    assert drained < retaken_at + grace  # a fresh grace from the takeover would have ended later
    record = await drain_record(env, node)
    assert record.worker_id == survivor and record.details["retaken_from"] == dead
    details = record.details["checkpoint"]
    assert details["result"] == "grace-expired"
    assert details["requested_at"] == checkpoint.rfc3339(first.at)
    assert details["deadline"] == checkpoint.rfc3339(first.until)
    # Asked once: one Event, and the request the survivor found was the dead replica's.
    assert len(await checkpoint_events(env, ns)) == 1
    assert list(job.moments()) == ["ready", "requested"]
    record_timings("replica-killed", request_to_kill_s=killed - requested, kill_to_retaken_s=retaken_at - killed,
                   request_to_drained_s=drained - requested, deadline_to_drained_s=drained - first.until,
                   grace_s=grace, lease_s=LEASE_SECONDS)


async def test_a_lost_gpu_under_a_rule_with_grace_is_drained_at_once_with_the_reason(env: Env) -> None:
    (node,) = await env.make_nodes(1)
    ns = await gpu_pods(env, node, "trainer", 1)
    # A rule without codes may carry the option (its faults are judged per incident): Xid 79 arrives.
    act = await env.actuator(
        load_yaml_text(
            "kind: RescuePolicy\nmetadata: {name: t}\nspec:\n  rules:\n"
            "  - {priority: 10, actions: [{name: cordon}, {name: drain, gracePeriodCap: 0, timeout: 30, "
            "checkpointGrace: 600}]}\n"
        )
    )
    await act.engine.handle(incident(node, "inc-ckpt-lost", code=79, action=Action.REBOOT_NODE))
    assert await pods_on(env.kube, node) == []
    record = await drain_record(env, node)
    assert record.outcome == Outcome.APPLIED
    assert record.details["checkpoint"]["result"] == "gpu-lost" and "Xid 79" in record.details["checkpoint"]["reason"]
    assert record.reason.startswith("no checkpoint wait (Xid 79")
    assert await checkpoint_events(env, ns) == []  # nobody was asked
    assert (await env.ledger(node)).flow_value("inc-ckpt-lost", checkpoint.ledger_name("drain")) is None


async def test_a_policy_object_asking_a_grace_for_xid_79_is_refused_and_changes_nothing(env: Env) -> None:
    from pipeline.actuator.app import Actuator
    from pipeline.runtime.settings import KafkaSettings
    from tests.integration.test_actuator_policy_crd import (
        GROUP,
        VERSION,
        _status_for,
        accepted,
        install_crds,
        replace_spec,
        wait_for,
    )

    await install_crds(env.kube)
    name = env.unique("ckpt")
    rule = {"name": f"{name}-r", "priority": 50, "codes": [CODE, 79],
            "actions": [{"name": "cordon"}, {"name": "drain", "gracePeriodCap": 0}]}
    body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "RescuePolicy",
            "metadata": {"name": name, "labels": {"xidflow.test/fleet": env.tag}}, "spec": {"rules": [rule]}}
    await env.kube._call(env.kube.custom.create_cluster_custom_object, GROUP, VERSION, "rescuepolicies", body)
    try:
        act = Actuator(
            env.settings(worker_id="w1", policy_source="crd", policy_label_selector=f"xidflow.test/fleet={env.tag}",
                         policy_refresh_seconds=3600),
            KafkaSettings(KAFKA_BOOTSTRAP_SERVERS=env.bootstrap), env.topics, env.kubeconfig,
        )
        await act.start(consume=False)
        env.actuators.append(act)
        await wait_for(lambda: _status_for(env, name, generation=1, status="True"), "generation 1 accepted")
        # Valid for the CRD schema and the admission policy; the catalog says Xid 79 loses the GPU.
        graced = {**rule, "actions": [{"name": "cordon"}, {"name": "drain", "gracePeriodCap": 0,
                                                           "checkpointGrace": "5m"}]}
        await replace_spec(env, name, {"rules": [graced]})
        refused = await wait_for(lambda: _status_for(env, name, generation=2, status="False"), "generation 2 refused")
        message = accepted(refused)["message"]  # type: ignore[index]
        assert "spec.rules[0].actions[1].checkpointGrace: not allowed" in message and "Xid 79" in message
        assert refused["status"]["inForceGeneration"] == 1
        [kept] = act.policies.current.rules
        assert kept.actions[1].checkpoint_grace is None  # generation 1 is what runs
    finally:
        await env.kube._call(env.kube.custom.delete_cluster_custom_object, GROUP, VERSION, "rescuepolicies", name)
