"""What the real controllers do with xidflow's effects, end to end: each incident goes through Kafka to an actuator
that consumes it, and the test watches what Kubernetes does next (which pods moved where, and when).

- a drain through the Eviction API against a PDB kept by the disruption controller: the ReplicaSet controller
  replaces each evicted pod, the scheduler places it on a healthy node (never on the quarantined one: the cordon
  and xidflow's taint each hold), and the budget is never broken;
- DaemonSet pods: the drain leaves them; after a deletion the DaemonSet controller puts back only the pod of a
  DaemonSet that tolerates xidflow's taint (it tolerates the cordon by itself), and every pod after the recovery;
- the GPU-reset and reboot Jobs: run by the Job controller, their pods ended by KWOK, followed by xidflow to the
  Job's end, a failed one included;
- a Job with ``podFailurePolicy``: an evicted pod ends Failed with ``DisruptionTarget`` and xidflow's
  ``xidflow.dev/GPUFault``, and the Job does not count it (a Job without the policy does);
- the checkpoint-aware drain answered by a real Job's pod, as the shipped example Job, with its own
  ServiceAccount's rights.

Timings are printed (``-s``) for the record; nothing asserts a duration beyond what a behaviour means.
"""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from pipeline.actuator.app import Actuator
from pipeline.actuator.effects import DEFAULT_REBOOT_JOB, DEFAULT_RESET_JOB
from pipeline.actuator.machines import reboot
from pipeline.actuator.policy import PolicySet, load_yaml_text
from pipeline.actuator.testing import make_incident, publish, wait_until
from pipeline.actuator.workload import GPU_FAULT_CONDITION
from pipeline.localinfra.kwok import POD_COMPLETE_LABEL, POD_FAIL_LABEL
from pipeline.runtime.settings import KafkaSettings
from schemas.records import Action, NodeRecovered, Outcome, RemediationRecord
from tests.integration.test_actuator_checkpoint import Job as CheckpointJob
from tests.integration.test_actuator_checkpoint import jobs
from tests.integration.test_actuator_effects import Env
from tests.integration.test_actuator_rbac import apply_docs
from tests.integration.workloads import (
    UNSCHEDULABLE_TOLERATION,
    Timeline,
    daemonset,
    deployment,
    ensure_ns,
    list_pods,
    pdb,
    pods_on,
    wait_job,
    wait_running,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"
TAINT_KEY = "nvidia.com/gpu-fault"
"""xidflow's quarantine taint (the actuator's default key)."""
TERMINAL = (Outcome.APPLIED, Outcome.FAILED, Outcome.ALREADY_APPLIED)


@pytest.fixture
def env(consuming_env: Env) -> Env:
    return consuming_env


# -- an actuator replica that consumes its topics (the path a record takes on a cluster) -----------------------
async def consuming(env: Env, policies: PolicySet, **overrides: Any) -> Actuator:
    """An actuator replica reading the incidents topic in this process, with its reconciler; ``Env.close`` stops it."""
    act = Actuator(env.settings(worker_id=env.unique("rep"), **overrides),
                   KafkaSettings(KAFKA_BOOTSTRAP_SERVERS=env.bootstrap), env.topics, env.kubeconfig, policies)
    await act.start()
    env.actuators.append(act)
    runner = asyncio.create_task(act.run())
    runner.add_done_callback(lambda t: t.cancelled() or t.exception())  # a crash shows in the test's waits
    return act


def rule(actions: str, codes: str = "[79]") -> PolicySet:
    return load_yaml_text(
        "kind: RescuePolicy\nmetadata: {name: t}\nspec:\n  rules:\n"
        f"  - {{priority: 10, codes: {codes}, actions: {actions}}}\n"
    )


async def send(env: Env, *records: Any) -> float:
    """Publish the records (incidents, recoveries) to the actuator's topic; when they were sent."""
    sent = time.time()
    await publish(env.bootstrap, env.topics.name("incidents"), records)
    return sent


async def step_record(env: Env, node: str, action: str, limit_s: float = 120,
                      outcomes: tuple[Outcome, ...] = TERMINAL) -> RemediationRecord:
    """The first audit record of ``action`` on the node with one of ``outcomes``, once it is on the topic."""
    found: list[RemediationRecord] = []

    async def there() -> bool:
        found[:] = [r for r in await env.audit() if r.node == node and r.action == action and r.outcome in outcomes]
        return bool(found)

    await wait_until(there, limit_s, poll=0.5, what=f"{action} audit record of {node}")
    return found[0]


def taint_keys(node: dict[str, Any]) -> set[tuple[str, str]]:
    return {(t["key"], t["effect"]) for t in node["spec"].get("taints") or []}


def since(t: float, start: float) -> str:
    return f"{t - start:+.1f}s"


# -- 1. a drain against a PDB: replacements on healthy nodes, the budget never broken -------------------------
async def test_a_drain_moves_replicas_to_healthy_nodes_one_budget_at_a_time(env: Env) -> None:
    (sick,) = await env.make_nodes(1)
    ns = env.unique("work")
    await ensure_ns(env.kube, ns)
    train, tolerant = {"app": "train"}, {"app": "tolerant"}
    # Placed by the scheduler among this test's nodes: while the sick node is the only one, every pod lands there.
    await deployment(env.kube, ns, "train", None, 3, train, gpus=1, node_selector=env.fleet_label)
    # A pod that tolerates the cordon (as system pods often do): only xidflow's taint keeps its replacement away.
    await deployment(env.kube, ns, "tolerant", None, 1, tolerant, node_selector=env.fleet_label,
                     tolerations=[UNSCHEDULABLE_TOLERATION])
    assert len(await pods_on(env.kube, sick)) == 4
    healthy = await env.make_nodes(2)
    budget = await pdb(env.kube, ns, "train", train, min_available=2)
    assert budget["disruptionsAllowed"] == 1  # the disruption controller's status: one pod of three may go
    await consuming(env, rule("[{name: quarantine}, {name: drain, timeout: 120}]"))
    async with Timeline(env.kube, ns) as timeline:
        start = await send(env, make_incident(sick, "inc-pdb-move"))
        drain = await step_record(env, sick, "drain")
        await wait_running(env.kube, ns, train, 3)
        await wait_running(env.kube, ns, tolerant, 1)
        await asyncio.sleep(1)  # the last events of the moves reach the timeline
    assert drain.outcome == Outcome.APPLIED, drain.reason
    assert len(drain.details["evicted"]) == 4
    node = await env.node(sick)
    assert node["spec"]["unschedulable"] is True and (TAINT_KEY, "NoSchedule") in taint_keys(node)
    evicted = timeline.first(lambda s: s.deleting)
    placed = timeline.first(lambda s: s.node is not None and s.at >= start and not s.deleting)
    running = timeline.first(lambda s: s.ready and s.at >= start and not s.deleting)
    # Every replacement went to a healthy node; nothing new was placed on the quarantined one.
    moved = {name: state.node for name, state in placed.items() if name not in evicted}
    assert sorted(moved.values()) and set(moved.values()) <= set(healthy), moved
    assert len(moved) == 4
    # The budget held at every change the watch saw: never fewer than minAvailable healthy pods.
    assert timeline.fewest_healthy(train, start) >= 2
    # ... so the evictions came one by one, each after the replacement of the one before was Ready.
    order = sorted((s.at, n) for n, s in evicted.items() if s.labels.get("app") == "train")
    ready_train = sorted(running[n].at for n in moved if running.get(n) and running[n].labels.get("app") == "train")
    for (at, _), before in zip(order[1:], ready_train, strict=False):
        assert at >= before
    cordon = await step_record(env, sick, "cordon")
    print(f"\ndrain with a PDB (minAvailable 2 of 3): incident published at 0s, cordoned and tainted at "
          f"{since(cordon.finished_at.timestamp(), start)}")
    for at, name in sorted((s.at, n) for n, s in evicted.items()):
        print(f"  evicted {name} from {sick} at {since(at, start)}")
    for name, where in sorted(moved.items(), key=lambda kv: running[kv[0]].at):
        print(f"  replacement {name} placed on {where} at {since(placed[name].at, start)}, "
              f"Running at {since(running[name].at, start)}")
    print(f"  drain audited {drain.outcome.value} at {since(drain.finished_at.timestamp(), start)}: {drain.reason}")


# -- 2. DaemonSet pods: left by the drain, put back only where they tolerate the taint -------------------------
async def test_daemonset_pods_stay_through_the_drain_and_come_back_where_they_tolerate_the_taint(env: Env) -> None:
    (sick,) = await env.make_nodes(1)
    ns = env.unique("agents")
    await ensure_ns(env.kube, ns)
    plain, probe = {"app": "node-agent"}, {"app": "probe"}
    # A node agent with the DaemonSet controller's default tolerations only, and one that also tolerates
    # xidflow's taint (as the chart's probe and Fluent Bit do).
    await daemonset(env.kube, ns, "node-agent", sick, plain)
    await daemonset(env.kube, ns, "probe", sick, probe, tolerations=[{"key": TAINT_KEY, "operator": "Exists"}])
    await deployment(env.kube, ns, "work", sick, 1, {"app": "work"})
    await consuming(env, rule("[{name: quarantine}, {name: drain, gracePeriodCap: 0, timeout: 60}]"))
    async with Timeline(env.kube, ns) as timeline:
        start = await send(env, make_incident(sick, "inc-ds"))
        drain = await step_record(env, sick, "drain")
        assert drain.outcome == Outcome.APPLIED
        on_node = await list_pods(env.kube, ns, {})
        kept = sorted(p["metadata"]["name"] for p in on_node if p["spec"].get("nodeName") == sick)
        assert sorted(drain.details["left_alone"]) == [f"{ns}/{n}" for n in kept] and len(kept) == 2
        # A pod of each DaemonSet is deleted (a rollout, a person, a crash that got it deleted).
        for pod in kept:
            await env.kube.delete_pod(ns, pod, 0)
        deleted = time.time()
        (back,) = await wait_running(env.kube, ns, probe, 1, sick)
        apps = client.AppsV1Api(env.kube.api_client)

        async def agent_not_wanted() -> bool:
            status = (await env.kube._call(apps.read_namespaced_daemon_set, "node-agent", ns)).get("status") or {}
            return status.get("desiredNumberScheduled") == 0 and not await list_pods(env.kube, ns, plain)

        await wait_until(agent_not_wanted, 60, poll=0.2, what="the DaemonSet controller's verdict on node-agent")
        # Recovery: xidflow lifts its cordon and taint; the DaemonSet controller puts the agent back.
        recovered = await send(env, NodeRecovered(incident_id="inc-ds", node=sick, reason="reboot"))
        (agent,) = await wait_running(env.kube, ns, plain, 1, sick)
        await asyncio.sleep(1)
    states = timeline.first(lambda s: s.ready and not s.deleting and s.at >= start)
    node = await env.node(sick)
    assert not node["spec"].get("unschedulable") and (TAINT_KEY, "NoSchedule") not in taint_keys(node)
    print(f"\nDaemonSet pods on {sick}: drain left {kept}; deleted at {since(deleted, start)}")
    print(f"  probe (tolerates {TAINT_KEY}) back as {back} at {since(states[back].at, start)}")
    print(f"  node-agent (default tolerations) not recreated while tainted; after the recovery at "
          f"{since(recovered, start)} back as {agent} at {since(states[agent].at, start)}")


async def test_a_cordon_alone_gets_a_deleted_daemonset_pod_back_at_once(env: Env) -> None:
    """Without xidflow's taint (a rule that only cordons) every DaemonSet comes back: its pods tolerate
    ``node.kubernetes.io/unschedulable`` by the DaemonSet controller's own default."""
    (sick,) = await env.make_nodes(1)
    ns = env.unique("agents")
    await ensure_ns(env.kube, ns)
    plain = {"app": "node-agent"}
    agent = await daemonset(env.kube, ns, "node-agent", sick, plain)
    await consuming(env, rule("[{name: cordon}, {name: drain, gracePeriodCap: 0, timeout: 60}]"))
    start = await send(env, make_incident(sick, "inc-ds-cordon"))
    drain = await step_record(env, sick, "drain")
    assert drain.outcome == Outcome.APPLIED and drain.details["left_alone"] == [f"{ns}/{agent}"]
    await env.kube.delete_pod(ns, agent, 0)
    deleted = time.time()

    async def replaced() -> bool:
        pods = await list_pods(env.kube, ns, plain)
        return any(p["metadata"]["name"] != agent and p["spec"].get("nodeName") == sick for p in pods)

    await wait_until(replaced, 60, poll=0.1, what="the DaemonSet controller's new pod on the cordoned node")
    (again,) = await wait_running(env.kube, ns, plain, 1, sick)
    assert (await env.node(sick))["spec"]["unschedulable"] is True
    print(f"\ncordon only ({sick}): node-agent {agent} deleted at {since(deleted, start)}, {again} back "
          f"{time.time() - deleted:.1f}s later on the cordoned node")


async def test_a_noexecute_quarantine_takes_intolerant_daemonset_pods_off_but_the_drain_does_not(env: Env) -> None:
    (sick,) = await env.make_nodes(1)
    ns = env.unique("agents")
    await ensure_ns(env.kube, ns)
    plain, probe = {"app": "node-agent"}, {"app": "probe"}
    agent = await daemonset(env.kube, ns, "node-agent", sick, plain)
    kept = await daemonset(env.kube, ns, "probe", sick, probe, tolerations=[{"key": TAINT_KEY, "operator": "Exists"}])
    await consuming(env, rule("[{name: cordon}, {name: taint, effect: NoExecute}, "
                              "{name: drain, gracePeriodCap: 0, timeout: 60}]"))
    async with Timeline(env.kube, ns) as timeline:
        start = await send(env, make_incident(sick, "inc-ds-ne"))
        drain = await step_record(env, sick, "drain")

        async def agent_gone() -> bool:
            return not await list_pods(env.kube, ns, plain)

        await wait_until(agent_gone, 60, poll=0.2, what="the node-agent pod's removal")
    assert drain.outcome == Outcome.APPLIED and drain.details["evicted"] == []
    assert await pods_on(env.kube, sick) == [kept]  # the probe tolerates the taint: it stays
    gone = timeline.latest()[agent]
    deleting = timeline.first(lambda s: s.deleting)[agent]
    taint = await step_record(env, sick, "taint")
    print(f"\nNoExecute quarantine of {sick}: tainted at {since(taint.finished_at.timestamp(), start)}; node-agent "
          f"{agent} deleted by Kubernetes (not the drain) at {since(deleting.at, start)}, reason "
          f"{gone.conditions.get('DisruptionTarget')}; probe {kept} stays")


# -- 3. the hook Jobs, run by the Job controller and followed to their end -------------------------------------
def hook_template(path: Path, default: str, **pod_labels: str) -> Path:
    """The shipped hook Job with pod labels for KWOK (keep running, fail): the operator's template file."""
    job = yaml.safe_load(default)
    job["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {}).update(pod_labels)
    path.write_text(yaml.safe_dump(job))
    return path


async def hook_job(env: Env, flow: str) -> dict[str, Any]:
    jobs = await env.kube._call(env.kube.batch.list_namespaced_job, env.namespace,
                                label_selector=f"xidflow.dev/flow={flow}")
    (job,) = jobs["items"]
    return job


def job_times(job: dict[str, Any]) -> str:
    status = job.get("status") or {}
    end = next((c for c in status.get("conditions") or [] if c["type"] in ("Complete", "Failed")), {})
    return (f"created {job['metadata']['creationTimestamp']}, started {status.get('startTime')}, "
            f"{end.get('type')} {end.get('reason') or ''} at {end.get('lastTransitionTime')}")


RESET_RULE = "[{name: quarantine}, {name: resetGpu}, {name: unCordon}]"
REBOOT_TIMEOUT = 120
REBOOT_RULE = f"[{{name: quarantine}}, {{name: reboot, hook: job, timeout: {REBOOT_TIMEOUT}, uncordonAfter: true}}]"


async def test_a_gpu_reset_job_is_followed_to_its_end_before_the_flow_goes_on(env: Env) -> None:
    (node,) = await env.make_nodes(1)
    await consuming(env, rule(RESET_RULE, codes="[48]"))
    start = await send(env, make_incident(node, "inc-reset-ok", code=48, action=Action.RESET_GPU))
    reset = await step_record(env, node, "resetGpu")
    assert reset.outcome == Outcome.APPLIED and reset.details["job_end"] == "Complete", reset.reason
    job = await wait_job(env.kube, env.namespace, reset.details["job"], "Complete")
    uncordon = await step_record(env, node, "unCordon")
    assert uncordon.outcome == Outcome.APPLIED  # the flow went on after the Job's end, not its start
    assert not (await env.node(node))["spec"].get("unschedulable")
    print(f"\nGPU reset Job on {node}: {job_times(job)}; step applied at "
          f"{since(reset.finished_at.timestamp(), start)}")


async def test_a_failed_gpu_reset_job_fails_the_step_and_leaves_the_node_out(env: Env, tmp_path: Path) -> None:
    (node,) = await env.make_nodes(1)
    # A reset that fails (a process still holds the GPU): KWOK fails the pod, the Job controller the Job.
    failing = hook_template(tmp_path / "reset.yaml", DEFAULT_RESET_JOB, **{POD_FAIL_LABEL: "true"})
    await consuming(env, rule(RESET_RULE, codes="[48]"), reset_job_template=str(failing))
    start = await send(env, make_incident(node, "inc-reset-bad", code=48, action=Action.RESET_GPU))
    reset = await step_record(env, node, "resetGpu")
    assert reset.outcome == Outcome.FAILED, reset.reason
    assert "BackoffLimitExceeded" in reset.reason and reset.details["job_end"].startswith("Failed")
    after = await step_record(env, node, "unCordon", outcomes=(Outcome.SKIPPED,))
    assert "flow stopped earlier" in after.reason
    state = await env.node(node)
    assert state["spec"]["unschedulable"] is True and (TAINT_KEY, "NoSchedule") in taint_keys(state)
    job = await wait_job(env.kube, env.namespace, reset.details["job"], "Failed")
    print(f"\nGPU reset Job on {node} failing: {job_times(job)}; step failed at "
          f"{since(reset.finished_at.timestamp(), start)}: {reset.reason}")


async def test_a_reboot_job_is_followed_until_the_machine_comes_back_with_a_new_boot_id(env: Env) -> None:
    (node,) = await env.make_nodes(1)
    await consuming(env, rule(REBOOT_RULE))
    start = await send(env, make_incident(node, "inc-reboot-ok"))

    async def job_pod_done() -> bool:
        try:
            job = await hook_job(env, "inc-reboot-ok")
        except ValueError:
            return False
        return bool((job.get("status") or {}).get("succeeded"))

    # The machine: once the Job's pod has run its command (KWOK completed it), the machine reboots.
    await wait_until(job_pod_done, 60, poll=0.2, what="the reboot Job's pod completed")
    ran = time.time()
    await reboot(env.kube, node, "boot-2")
    step = await step_record(env, node, "reboot")
    assert step.outcome == Outcome.APPLIED and step.details["boot_id_after"] == "boot-2", step.reason
    assert not (await env.node(node))["spec"].get("unschedulable")
    job = await hook_job(env, "inc-reboot-ok")
    print(f"\nreboot Job on {node}: {job_times(job)}; pod done at {since(ran, start)}; step applied at "
          f"{since(step.finished_at.timestamp(), start)} (boot-1 -> boot-2)")


async def test_a_failed_reboot_job_fails_the_step_at_once_not_at_the_timeout(env: Env, tmp_path: Path) -> None:
    (node,) = await env.make_nodes(1)
    failing = hook_template(tmp_path / "reboot.yaml", DEFAULT_REBOOT_JOB, **{POD_FAIL_LABEL: "true"})
    await consuming(env, rule(REBOOT_RULE), reboot_job_template=str(failing))
    start = await send(env, make_incident(node, "inc-reboot-bad"))
    step = await step_record(env, node, "reboot")
    took = step.finished_at.timestamp() - start
    assert step.outcome == Outcome.FAILED, step.reason
    assert "Failed: BackoffLimitExceeded" in step.reason and "exit code 1" in step.reason, step.reason
    assert "kept bootID boot-1" in step.reason
    assert took < REBOOT_TIMEOUT  # the Job's failure ended the wait, not the timeout
    assert (await env.node(node))["spec"]["unschedulable"] is True  # a failed reboot leaves the node out
    job = await hook_job(env, "inc-reboot-bad")
    print(f"\nreboot Job on {node} failing: {job_times(job)}; step failed {took:.1f}s after the incident "
          f"(timeout {REBOOT_TIMEOUT}s): {step.reason}")


# -- 4. a Job's podFailurePolicy and a real eviction --------------------------------------------------------
def example_job(path: Path, name: str, fleet: dict[str, str], gpus: int) -> dict[str, Any]:
    """A shipped example Job, named ``name``, placed among the test's nodes, its pod kept running by KWOK."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    job = copy.deepcopy(next(d for d in docs if d["kind"] == "Job"))
    job["metadata"]["name"] = name
    template = job["spec"]["template"]
    template.setdefault("metadata", {}).setdefault("labels", {}).update({POD_COMPLETE_LABEL: "false", "job": name})
    template["spec"]["nodeSelector"] = dict(fleet)
    template["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return job


def conditions_of(state: Any) -> dict[str, tuple[str, str]]:
    return {k: v for k, v in state.conditions.items() if k in ("DisruptionTarget", GPU_FAULT_CONDITION)}


async def test_a_jobs_pod_failure_policy_ignores_an_evicted_pod_that_carries_the_fault(env: Env) -> None:
    (sick,) = await env.make_nodes(1)
    ns = env.unique("train")
    await ensure_ns(env.kube, ns)
    guarded = example_job(EXAMPLES / "gpu-job-pod-failure-policy.yaml", "guarded", env.fleet_label, 4)
    bare = copy.deepcopy(guarded)
    bare["metadata"]["name"] = "bare"
    bare["spec"]["template"]["metadata"]["labels"]["job"] = "bare"
    bare["spec"].pop("podFailurePolicy")
    bare["spec"]["backoffLimit"] = 0
    for job in (guarded, bare):
        await env.kube._call(env.kube.batch.create_namespaced_job, ns, job)
    (first,) = await wait_running(env.kube, ns, {"job": "guarded"}, 1, sick)
    (doomed,) = await wait_running(env.kube, ns, {"job": "bare"}, 1, sick)
    (healthy,) = await env.make_nodes(1)
    await consuming(env, rule("[{name: quarantine}, {name: drain, timeout: 60}]", codes="[48]"))
    async with Timeline(env.kube, ns) as timeline:
        start = await send(env, make_incident(sick, "inc-pfp", code=48, action=Action.RESET_GPU))
        drain = await step_record(env, sick, "drain")
        (second,) = await wait_running(env.kube, ns, {"job": "guarded"}, 1, healthy)
        failed_bare = await wait_job(env.kube, ns, "bare", "Failed")
        await asyncio.sleep(1)
    assert drain.outcome == Outcome.APPLIED and sorted(drain.details["evicted"]) == sorted(
        [f"{ns}/{first}", f"{ns}/{doomed}"])
    ended = timeline.first(lambda s: s.phase == "Failed")
    # What the Job controller saw: the pod Failed with the eviction's condition and the fault xidflow attributed.
    assert conditions_of(ended[first]) == {"DisruptionTarget": ("True", "EvictionByEvictionAPI"),
                                           GPU_FAULT_CONDITION: ("True", "Xid48")}
    status = (await env.kube.get_job(ns, "guarded"))["status"]
    assert not status.get("failed") and status.get("active") == 1  # not counted against backoffLimit
    assert failed_bare["status"]["failed"] == 1  # the same eviction, counted where no policy says otherwise
    assert any(c["reason"] == "BackoffLimitExceeded" for c in failed_bare["status"]["conditions"])
    replaced = timeline.first(lambda s: s.name == second and s.ready)[second]
    print(f"\nJob with podFailurePolicy on {sick}: {first} evicted at "
          f"{since(timeline.first(lambda s: s.deleting)[first].at, start)}, Failed at {since(ended[first].at, start)} "
          f"with {conditions_of(ended[first])}; the Job counted failed={status.get('failed', 0)} and ran {second} on "
          f"{healthy} at {since(replaced.at, start)}; the Job without a policy: failed=1, BackoffLimitExceeded")


async def test_a_pod_that_fails_on_its_own_after_the_fault_is_ignored_by_the_gpu_fault_rule(env: Env) -> None:
    """The fault kills the program before any drain (the CUDA call after the Xid fails): the pod fails with the
    condition xidflow wrote, and the Job's rule on ``xidflow.dev/GPUFault`` alone keeps its retries."""
    (sick,) = await env.make_nodes(1)
    ns = env.unique("train")
    await ensure_ns(env.kube, ns)
    job = example_job(EXAMPLES / "gpu-job-pod-failure-policy.yaml", "crashes", env.fleet_label, 8)
    job["spec"]["podFailurePolicy"]["rules"] = job["spec"]["podFailurePolicy"]["rules"][:1]  # GPUFault only
    job["spec"]["backoffLimit"] = 0
    await env.kube._call(env.kube.batch.create_namespaced_job, ns, job)
    (pod,) = await wait_running(env.kube, ns, {"job": "crashes"}, 1, sick)
    (healthy,) = await env.make_nodes(1)
    await consuming(env, PolicySet())  # the default quarantine: no drain
    await send(env, make_incident(sick, "inc-crash", code=48, action=Action.RESET_GPU))
    told = await step_record(env, sick, "notifyWorkload")
    assert told.outcome == Outcome.APPLIED
    crash = {"metadata": {"labels": {POD_FAIL_LABEL: "true"}}}  # the program dies of the fault (KWOK fails the pod)
    await env.kube._call(env.kube.core.patch_namespaced_pod, pod, ns, crash)
    (second,) = await wait_running(env.kube, ns, {"job": "crashes"}, 1, healthy)
    status = (await env.kube.get_job(ns, "crashes"))["status"]
    assert not status.get("failed")  # backoffLimit 0, and the Job lives on
    print(f"\npod {pod} failed on its own after the fault: not counted, {second} runs on {healthy}")


# -- 5. the checkpoint-aware drain answered by a real Job's pod -------------------------------------------------
def token_kubeconfig(admin_kubeconfig: str, token: str, path: Path) -> Path:
    """A kubeconfig for the admin's server and CA with ``token`` as the identity (what a pod's account holds)."""
    config = yaml.safe_load(Path(admin_kubeconfig).read_text())
    config["users"] = [{"name": "pod", "user": {"token": token}}]
    config["contexts"][0]["context"]["user"] = "pod"
    path.write_text(yaml.safe_dump(config))
    return path


async def test_the_example_checkpoint_job_answers_and_is_evicted_then_resumes_elsewhere(
    env: Env, kubeconfig: str, tmp_path: Path
) -> None:
    (sick,) = await env.make_nodes(1)
    ns = env.unique("training")
    await ensure_ns(env.kube, ns)
    docs = [d for d in yaml.safe_load_all((EXAMPLES / "checkpoint-job.yaml").read_text()) if d]
    rbac = [copy.deepcopy(d) for d in docs if d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    for doc in rbac:
        doc["metadata"]["namespace"] = ns
        for subject in doc.get("subjects") or []:
            subject["namespace"] = ns
    await apply_docs(env.kube, rbac)
    job = example_job(EXAMPLES / "checkpoint-job.yaml", "gpu-training", env.fleet_label, 8)
    await env.kube._call(env.kube.batch.create_namespaced_job, ns, job)
    (pod,) = await wait_running(env.kube, ns, {"job": "gpu-training"}, 1, sick)
    (healthy,) = await env.make_nodes(1)
    # The job's side runs with the example's ServiceAccount and nothing more.
    token = await env.kube._call(env.kube.core.create_namespaced_service_account_token, "gpu-training", ns,
                                 {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                                  "spec": {"expirationSeconds": 3600}})
    as_pod = token_kubeconfig(kubeconfig, token["status"]["token"], tmp_path / "pod.kubeconfig")
    grace = 60
    with jobs(CheckpointJob(str(as_pod), ns, pod, tmp_path / "job.log", "--save-seconds", "2")) as (side,):
        await side.wait_for("ready")
        await consuming(env, rule(f"[{{name: quarantine}}, {{name: drain, timeout: 60, checkpointGrace: {grace}}}]",
                                  codes="[48]"))
        async with Timeline(env.kube, ns) as timeline:
            start = await send(env, make_incident(sick, "inc-ckpt-job", code=48, action=Action.RESET_GPU))
            drain = await step_record(env, sick, "drain", limit_s=grace + 60)
            (second,) = await wait_running(env.kube, ns, {"job": "gpu-training"}, 1, healthy)
            await asyncio.sleep(1)
        moments = side.moments()
    assert drain.outcome == Outcome.APPLIED, drain.reason
    assert drain.details["checkpoint"]["result"] == "answered" and drain.details["checkpoint"]["answered"] == [
        f"{ns}/{pod}"]
    evicted = timeline.first(lambda s: s.deleting)[pod]
    assert moments["answered"] <= evicted.at < start + grace  # after the answer, long before the deadline
    ended = timeline.first(lambda s: s.phase == "Failed")[pod]
    kinds = {k: v[0] for k, v in ended.conditions.items()}
    assert kinds["xidflow.dev/CheckpointRequested"] == "True" and kinds["xidflow.dev/CheckpointDone"] == "True"
    assert kinds["DisruptionTarget"] == "True"
    status = (await env.kube.get_job(ns, "gpu-training"))["status"]
    assert not status.get("failed") and status.get("active") == 1  # the example's rule: the eviction is not counted
    print(f"\ncheckpoint Job {pod} on {sick}: asked at {since(moments['requested'], start)}, answered at "
          f"{since(moments['answered'], start)}, evicted at {since(evicted.at, start)} (grace {grace}s), Failed at "
          f"{since(ended.at, start)}; {second} runs on {healthy} at "
          f"{since(timeline.first(lambda s: s.name == second and s.ready)[second].at, start)}; Job failed=0")

