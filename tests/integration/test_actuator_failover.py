"""Every flow finishes: real ``xidflow actuator`` processes on real Kafka and a real kube-apiserver.

The replica holding a long step's lease is SIGKILLed in the middle of it (a drain blocked by a
PodDisruptionBudget, a reboot, a GPU reset); the surviving replica takes the partition over, retakes
the lapsed lease and finishes the flow. Evictions, Events, taints and hook Jobs are counted: none is
doubled, and the drain slot is released. A person's uncordon and a RescuePolicy edit are seen by
watch while replicas run.

``XIDFLOW_FAILOVER_RUNS=10`` repeats the drain kill test. Set ``XIDFLOW_FAILOVER_TIMINGS=<file>`` to
append the time from SIGKILL to the step resumed on the survivor (one JSON line per run), for the
report; nothing here asserts on a duration. The leases are short here (6 s) unless
``XIDFLOW_FAILOVER_LEASE_SECONDS`` says otherwise.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from pipeline.actuator.configmap_state import read_json_configmap
from pipeline.actuator.effects import DEFAULT_DIAGNOSTICS_JOB, DEFAULT_RESET_JOB
from pipeline.actuator.machines import held_job
from pipeline.actuator.testing import make_incident, node_events, publish, reboot, wait_until
from pipeline.localinfra.kwok import POD_COMPLETE_LABEL
from schemas.records import Outcome
from tests.integration.test_actuator_effects import Env
from tests.integration.workloads import deployment, ensure_ns, pdb, pods_on, set_pdb_min_available

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Short leases keep the test quick; XIDFLOW_FAILOVER_LEASE_SECONDS=15 measures with the default.
LEASE_SECONDS = float(os.environ.get("XIDFLOW_FAILOVER_LEASE_SECONDS", "6"))
TAINT_KEY = "nvidia.com/gpu-fault"


@pytest.fixture
def env(consuming_env: Env) -> Env:
    return consuming_env


class Replicas:
    """``python -m pipeline.cli actuator`` processes of one consumer group."""

    def __init__(self, env: Env, kubeconfig: str, policy_file: Path, extra: dict[str, str] | None = None) -> None:
        self.env = env
        self.group = env.unique("g")
        self.base = {
            **os.environ,
            "KUBECONFIG": kubeconfig,
            "KAFKA_BOOTSTRAP_SERVERS": env.bootstrap,
            "XIDFLOW_TOPIC_PREFIX": env.topics.prefix,
            "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": env.selector,
            "XIDFLOW_ACTUATOR_NAMESPACE": env.namespace,
            "XIDFLOW_ACTUATOR_GROUP_ID": self.group,
            "XIDFLOW_ACTUATOR_POLICY_SOURCE": "file",
            "XIDFLOW_ACTUATOR_POLICY_FILE": str(policy_file),
            "XIDFLOW_ACTUATOR_BREAKER_MAX_SHARE": "1.0",
            "XIDFLOW_ACTUATOR_CLAIM_TIMEOUT_SECONDS": str(LEASE_SECONDS),
            "XIDFLOW_ACTUATOR_RESYNC_SECONDS": "2",
            "XIDFLOW_METRICS_PORT": "0",
            **(extra or {}),
        }
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    def start(self, worker: str, log_dir: Path) -> None:
        if keep := os.environ.get("XIDFLOW_FAILOVER_LOGDIR"):  # replica logs kept after the session
            log_dir = Path(keep) / self.group
            log_dir.mkdir(parents=True, exist_ok=True)
        self.logs[worker] = log_dir / f"{worker}.log"
        out = self.logs[worker].open("ab")  # a restarted replica's log follows its first life
        self.procs[worker] = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "actuator", "--no-api", "--log-level", "INFO"],
            env={**self.base, "XIDFLOW_ACTUATOR_WORKER_ID": worker},
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def kill(self, worker: str) -> None:
        os.kill(self.procs[worker].pid, signal.SIGKILL)
        self.procs[worker].wait(10)

    def alive(self) -> None:
        for worker, proc in self.procs.items():
            if proc.poll() is not None and proc.returncode != -signal.SIGKILL:
                raise AssertionError(f"{worker} exited {proc.returncode}:\n{self.logs[worker].read_text()[-4000:]}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def write_policy(path: Path, actions: str) -> Path:
    path.write_text(
        "kind: RescuePolicy\nmetadata: {name: failover}\nspec:\n  rules:\n"
        f"  - {{priority: 10, codes: [79], actions: {actions}}}\n"
    )
    return path


async def flow_entry(env: Env, node: str, flow: str) -> dict[str, Any]:
    return (await env.ledger(node)).flows.get(flow) or {}


async def claim_holder(env: Env, node: str, flow: str, step: str) -> str | None:
    claim = (await flow_entry(env, node, flow)).get("claims", {}).get(step)
    return claim.get("by") if claim else None


async def kill_the_holder(env: Env, reps: Replicas, node: str, flow: str, step: str) -> tuple[str, str, float]:
    """Wait for a replica to claim the step, SIGKILL it; (dead, survivor, when killed)."""

    async def claimed() -> bool:
        reps.alive()
        return await claim_holder(env, node, flow, step) is not None

    await wait_until(claimed, 90, poll=0.1, what=f"{step} claimed")
    dead = await claim_holder(env, node, flow, step)
    assert dead is not None
    await asyncio.sleep(LEASE_SECONDS / 2)  # well inside the step, with the lease renewed at least once
    assert await claim_holder(env, node, flow, step) == dead
    reps.kill(dead)
    killed = time.monotonic()
    survivor = next(w for w in reps.procs if w != dead)
    return dead, survivor, killed


async def wait_resumed(
    env: Env, reps: Replicas, node: str, flow: str, step: str, survivor: str, killed: float
) -> float:
    async def retaken() -> bool:
        reps.alive()
        entry = await flow_entry(env, node, flow)
        return (entry.get("claims", {}).get(step) or {}).get("by") == survivor or step in entry.get("done", {})

    await wait_until(retaken, 120, poll=0.1, what=f"{step} retaken by {survivor}")
    seconds = time.monotonic() - killed
    if path := os.environ.get("XIDFLOW_FAILOVER_TIMINGS"):
        line = orjson.dumps({"step": step, "sigkill_to_resumed_s": round(seconds, 2)}) + b"\n"
        await asyncio.to_thread(_append, Path(path), line)
    return seconds


def _append(path: Path, line: bytes) -> None:
    with path.open("ab") as fh:
        fh.write(line)


async def applied(env: Env, node: str, action: str) -> list[Any]:
    return [r for r in await env.audit() if r.node == node and r.action == action and r.outcome == Outcome.APPLIED]


async def wait_finished(env: Env, reps: Replicas, node: str, flow: str) -> dict[str, Any]:
    async def finished() -> bool:
        reps.alive()
        return "fin" in await flow_entry(env, node, flow)

    await wait_until(finished, 120, poll=0.2, what="flow finished")
    return await flow_entry(env, node, flow)


async def assert_nothing_doubled(env: Env, node: str) -> None:
    events = await node_events(env.kube, node)
    assert len(events) == 1, [e["metadata"]["name"] for e in events]
    taints = [t for t in (await env.node(node))["spec"].get("taints", []) if t["key"] == TAINT_KEY]
    assert len(taints) == 1


GUARDED = 3


async def set_pdb(env: Env, ns: str, allowed: int) -> None:
    """The budget's owner lets ``allowed`` of the guarded pods go; the disruption controller says so."""
    status = await set_pdb_min_available(env.kube, ns, "guard", GUARDED - allowed)
    assert status["disruptionsAllowed"] == allowed, status


async def guarded_pods(env: Env, node: str) -> tuple[str, list[str]]:
    """A Deployment's three pods on the node behind a PDB that allows no disruption yet (minAvailable 3, as the
    disruption controller computes it); the namespace and the pods' names."""
    ns = env.unique("work")
    await ensure_ns(env.kube, ns)
    names = await deployment(env.kube, ns, "guarded", node, GUARDED, {"app": "guarded"})
    status = await pdb(env.kube, ns, "guard", {"app": "guarded"}, min_available=GUARDED)
    assert status["disruptionsAllowed"] == 0, status
    return ns, names


@pytest.mark.parametrize("run", range(int(os.environ.get("XIDFLOW_FAILOVER_RUNS", "1"))))
async def test_survivor_finishes_a_drain_whose_replica_was_killed(
    env: Env, kubeconfig: str, tmp_path: Path, run: int
) -> None:
    (node,) = await env.make_nodes(1)
    ns, names = await guarded_pods(env, node)
    policy = write_policy(tmp_path / "p.yaml", "[{name: quarantine}, {name: drain, gracePeriodCap: 0, timeout: 600}]")
    reps = Replicas(env, kubeconfig, policy)
    try:
        for worker in ("rep-a", "rep-b"):
            reps.start(worker, tmp_path)
        await publish(env.bootstrap, env.topics.name("incidents"), [make_incident(node, "inc-kill-drain")])
        dead, survivor, killed = await kill_the_holder(env, reps, node, "inc-kill-drain", "drain")
        slots = await read_json_configmap(env.kube, env.namespace, "xidflow-drains")
        assert (slots.get("slots") or {}).get(node, {}).get("by") == dead
        await wait_resumed(env, reps, node, "inc-kill-drain", "drain", survivor, killed)
        await set_pdb(env, ns, GUARDED)  # the budget allows the evictions now
        entry = await wait_finished(env, reps, node, "inc-kill-drain")
        assert entry["status"] == "done" and entry["log"]["drain"]["by"] == survivor
        assert await pods_on(env.kube, node) == []
        await assert_nothing_doubled(env, node)
        assert (await env.node(node))["spec"]["unschedulable"] is True
        drains = await applied(env, node, "drain")
        assert len(drains) == 1 and sorted(drains[0].details["evicted"]) == [f"{ns}/{p}" for p in names]
        assert drains[0].details["retaken_from"] == dead and drains[0].worker_id == survivor
        slots = await read_json_configmap(env.kube, env.namespace, "xidflow-drains")
        assert node not in (slots.get("slots") or {})
    finally:
        reps.stop()
        await env.kube._call(env.kube.core.delete_namespace, ns)


async def test_survivor_finishes_a_reboot_whose_replica_was_killed(env: Env, kubeconfig: str, tmp_path: Path) -> None:
    (node,) = await env.make_nodes(1)
    policy = write_policy(tmp_path / "p.yaml", "[{name: quarantine}, {name: reboot, hook: job, timeout: 600}]")
    reps = Replicas(env, kubeconfig, policy)
    try:
        for worker in ("rep-a", "rep-b"):
            reps.start(worker, tmp_path)
        await publish(env.bootstrap, env.topics.name("incidents"), [make_incident(node, "inc-kill-reboot")])
        dead, survivor, killed = await kill_the_holder(env, reps, node, "inc-kill-reboot", "reboot")
        await wait_resumed(env, reps, node, "inc-kill-reboot", "reboot", survivor, killed)
        await reboot(env.kube, node, "boot-2")  # the machine comes back with a new bootID
        entry = await wait_finished(env, reps, node, "inc-kill-reboot")
        assert entry["status"] == "done" and entry["log"]["reboot"]["by"] == survivor
        assert entry["boot_id_before"] == "boot-1"
        jobs = await env.kube._call(
            env.kube.batch.list_namespaced_job, env.namespace, label_selector="xidflow.dev/flow=inc-kill-reboot"
        )
        assert len(jobs["items"]) == 1  # one reboot asked for, not two
        await assert_nothing_doubled(env, node)
        reboots = await applied(env, node, "reboot")
        assert len(reboots) == 1 and reboots[0].details["boot_id_after"] == "boot-2"
    finally:
        reps.stop()


def held_template(path: Path, template: str) -> Path:
    """A built-in hook Job whose pod KWOK keeps running (the reset, the diagnostics take as long as the test says)."""
    path.write_text(yaml.safe_dump(held_job(template)))
    return path


async def finish_job_pod(env: Env, job: str) -> None:
    """The reset finishes: the Job's pod is let go, KWOK completes it and the Job controller marks the Job
    Complete."""
    page = await env.kube._call(env.kube.core.list_namespaced_pod, env.namespace, label_selector=f"job-name={job}")
    (pod,) = page["items"]
    await env.kube._call(env.kube.core.patch_namespaced_pod, pod["metadata"]["name"], env.namespace,
                         {"metadata": {"labels": {POD_COMPLETE_LABEL: None}}})


HELD_HOOKS = {
    "resetGpu": ("XIDFLOW_ACTUATOR_RESET_JOB_TEMPLATE", DEFAULT_RESET_JOB),
    "diagnose": ("XIDFLOW_ACTUATOR_DIAGNOSTICS_JOB_TEMPLATE", DEFAULT_DIAGNOSTICS_JOB),
}
"""Steps that run a hook Job and wait for it: the setting of its template, the built-in template."""


@pytest.mark.parametrize("step", sorted(HELD_HOOKS))
async def test_survivor_finishes_a_hook_job_whose_replica_was_killed(
    env: Env, kubeconfig: str, tmp_path: Path, step: str
) -> None:
    (node,) = await env.make_nodes(1)
    flow = f"inc-kill-{step.lower()}"
    policy = write_policy(tmp_path / "p.yaml", f"[{{name: quarantine}}, {{name: {step}, timeout: 600}}]")
    setting, template = HELD_HOOKS[step]
    reps = Replicas(env, kubeconfig, policy, {setting: str(held_template(tmp_path / "job.yaml", template))})
    try:
        for worker in ("rep-a", "rep-b"):
            reps.start(worker, tmp_path)
        await publish(env.bootstrap, env.topics.name("incidents"), [make_incident(node, flow)])
        dead, survivor, killed = await kill_the_holder(env, reps, node, flow, step)
        await wait_resumed(env, reps, node, flow, step, survivor, killed)
        jobs = await env.kube._call(env.kube.batch.list_namespaced_job, env.namespace,
                                    label_selector=f"xidflow.dev/flow={flow}")
        assert len(jobs["items"]) == 1  # the survivor follows the dead replica's Job, makes no second one
        await finish_job_pod(env, jobs["items"][0]["metadata"]["name"])  # the reset, the diagnostics pass
        entry = await wait_finished(env, reps, node, flow)
        assert entry["status"] == "done" and entry["log"][step]["by"] == survivor
        if step == "diagnose":  # the gate passed: the node returns, once

            async def back() -> bool:
                reps.alive()
                return not (await env.node(node))["spec"].get("unschedulable")

            await wait_until(back, 60, what="back in service after the gate's pass")
            case = (await env.ledger(node)).repairs["GpuFellOffBus"]
            assert case["stage"] == "returned" and [d["verdict"] for d in case["diagnostics"]] == ["pass"]
            assert len(await node_events(env.kube, node)) == 1
        else:
            await assert_nothing_doubled(env, node)
    finally:
        reps.stop()


async def test_manual_uncordon_during_a_drain_stops_it_and_frees_the_slot(
    env: Env, kubeconfig: str, tmp_path: Path
) -> None:
    (node,) = await env.make_nodes(1)
    ns, _names = await guarded_pods(env, node)
    policy = write_policy(
        tmp_path / "p.yaml", "[{name: cordon}, {name: drain, gracePeriodCap: 0, timeout: 600}, {name: reboot}]"
    )
    reps = Replicas(env, kubeconfig, policy)
    try:
        reps.start("rep-a", tmp_path)
        await publish(env.bootstrap, env.topics.name("incidents"), [make_incident(node, "inc-uncordon")])

        async def draining() -> bool:
            reps.alive()
            return await claim_holder(env, node, "inc-uncordon", "drain") is not None

        await wait_until(draining, 90, poll=0.1, what="drain claimed")
        await env.kube.patch_node(node, {"spec": {"unschedulable": False}})  # a person uncordons
        entry = await wait_finished(env, reps, node, "inc-uncordon")
        assert entry["cancelled"] == "manual-uncordon" and entry["status"] == "cancelled"
        assert not entry.get("claims") and "reboot" not in entry.get("done", {})
        slots = await read_json_configmap(env.kube, env.namespace, "xidflow-drains")
        assert node not in (slots.get("slots") or {})
        await set_pdb(env, ns, GUARDED)
        await asyncio.sleep(1)
        assert len(await pods_on(env.kube, node)) == GUARDED  # no eviction after the person took over
        assert not (await env.node(node))["spec"].get("unschedulable")
    finally:
        reps.stop()
        await env.kube._call(env.kube.core.delete_namespace, ns)


async def test_a_rescue_policy_edit_takes_effect_while_replicas_run(env: Env, kubeconfig: str, tmp_path: Path) -> None:
    from tests.integration.test_actuator_policy_crd import GROUP, VERSION, install_crds

    await install_crds(env.kube)
    name = env.unique("live")
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RescuePolicy",
        "metadata": {"name": name, "labels": {"xidflow.test/fleet": env.tag}},
        "spec": {"rules": [{"name": f"{name}-r", "priority": 9, "codes": [79], "actions": [{"name": "event"}]}]},
    }
    custom = env.kube.custom
    await env.kube._call(custom.create_cluster_custom_object, GROUP, VERSION, "rescuepolicies", body)
    first, second = await env.make_nodes(2)
    reps = Replicas(
        env,
        kubeconfig,
        tmp_path / "unused.yaml",
        {
            "XIDFLOW_ACTUATOR_POLICY_SOURCE": "crd",
            "XIDFLOW_ACTUATOR_POLICY_FILE": "",
            "XIDFLOW_ACTUATOR_POLICY_LABEL_SELECTOR": f"xidflow.test/fleet={env.tag}",
            "XIDFLOW_ACTUATOR_POLICY_REFRESH_SECONDS": "1",
        },
    )
    try:
        reps.start("rep-a", tmp_path)
        await publish(env.bootstrap, env.topics.name("incidents"), [make_incident(first, "inc-pol-1")])

        async def evented() -> bool:
            reps.alive()
            return len(await node_events(env.kube, first)) == 1

        await wait_until(evented, 90, what="event under the first policy")
        assert not (await env.node(first))["spec"].get("unschedulable")  # the rule only raises an Event

        current = await env.kube._call(custom.get_cluster_custom_object, GROUP, VERSION, "rescuepolicies", name)
        current["spec"]["rules"][0]["actions"] = [{"name": "cordon"}, {"name": "event"}]
        await env.kube._call(custom.replace_cluster_custom_object, GROUP, VERSION, "rescuepolicies", name, current)
        await asyncio.sleep(2)
        await publish(env.bootstrap, env.topics.name("incidents"), [make_incident(second, "inc-pol-2")])

        async def cordoned() -> bool:
            reps.alive()
            return bool((await env.node(second))["spec"].get("unschedulable"))

        await wait_until(cordoned, 60, what="the edited policy cordons")
    finally:
        reps.stop()
        try:
            await env.kube._call(custom.delete_cluster_custom_object, GROUP, VERSION, "rescuepolicies", name)
        except Exception:  # noqa: BLE001 - best-effort cleanup of this test's object
            pass
