"""A faulty node that also stops answering, on the real control plane: the node lifecycle controller taints it
``node.kubernetes.io/unreachable`` and its taint eviction controller deletes pods on its own; xidflow, which gets
the fault through Kafka, quarantines and drains the node next to that, never counts those taints or deletions as
its own, never removes them, and does not leave a reboot Job behind to reboot the machine a second time when it
comes back (README, "A node that stops answering").

A machine goes silent when KWOK stops answering for its node (``machines.stop_heartbeats``); the session's grace
period is ``NODE_MONITOR_GRACE_S``. Timings are printed (``-s``) for the record.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.actuator.actions.reboot import NOT_STARTED
from pipeline.actuator.kube import Kube
from pipeline.actuator.machines import UNREADY_TAINTS, reboot, resume_heartbeats, stop_heartbeats, wait_nodes_usable
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import Ledger
from pipeline.actuator.policy import PolicySet
from pipeline.actuator.testing import make_incident, wait_until
from schemas.records import NodeRecovered, Outcome
from tests.conftest import NODE_MONITOR_GRACE_S
from tests.integration.test_actuator_controllers import (
    TAINT_KEY,
    consuming,
    rule,
    send,
    since,
    step_record,
    taint_keys,
)
from tests.integration.test_actuator_effects import Env
from tests.integration.workloads import Timeline, deployment, ensure_ns, list_pods, wait_running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

UNREACHABLE = "node.kubernetes.io/unreachable"
LIFECYCLE_TAINTS = {(UNREACHABLE, "NoSchedule"), (UNREACHABLE, "NoExecute")}
SHORT_TOLERATION = [{"key": UNREACHABLE, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 1}]
"""A pod that leaves an unreachable node after 1 s (the API server gives every other pod 300 s)."""


@pytest.fixture
def env(consuming_env: Env) -> Env:
    return consuming_env


async def silent(kube: Kube, node: str) -> float:
    """Stop the machine; returns when the lifecycle controller has tainted its node unreachable (NoExecute).

    The node lifecycle controller does that only while another node of the cluster is Ready: with every node
    silent it blames its own connection ("master disruption mode": no ``NoExecute`` taint, and those there are
    removed), so a test keeps a healthy node beside the silent one, as any cluster has."""
    answering = [n for n in await kube.list_nodes() if n["metadata"]["name"] != node and NodeView.from_object(n).ready]
    assert answering, f"no Ready node beside {node}: the node lifecycle controller would not taint it unreachable"
    stopped = time.time()
    await stop_heartbeats(kube, node)

    async def tainted() -> bool:
        return LIFECYCLE_TAINTS <= taint_keys(await kube.get_node(node))

    await wait_until(tainted, NODE_MONITOR_GRACE_S + 60, poll=0.5, what=f"{node} tainted unreachable")
    return stopped


def xidflows(ledger: Ledger) -> set[str]:
    return set(ledger.owned)


async def test_a_hung_faulty_node_is_quarantined_drained_and_power_cycled_without_a_second_reboot(env: Env) -> None:
    (sick,) = await env.make_nodes(1)
    ns = env.unique("work")
    await ensure_ns(env.kube, ns)
    web, train = {"app": "web"}, {"app": "train"}
    (web_pod,) = await deployment(env.kube, ns, "web", None, 1, web, node_selector=env.fleet_label,
                                  tolerations=SHORT_TOLERATION)
    (train_pod,) = await deployment(env.kube, ns, "train", None, 1, train, gpus=8, node_selector=env.fleet_label)
    (healthy,) = await env.make_nodes(1)
    async with Timeline(env.kube, ns) as timeline:
        # The machine hangs (the fault line was shipped just before): Kubernetes' part first.
        stopped = await silent(env.kube, sick)
        marked = time.time()

        async def web_deleted_by_kubernetes() -> bool:
            return any(s.name == web_pod and s.deleting for s in timeline.states)

        await wait_until(web_deleted_by_kubernetes, 30, poll=0.2, what="the taint eviction controller's deletion")
        (web_moved,) = await wait_running(env.kube, ns, web, 1, healthy)
        # The fault reaches the actuator through Kafka.
        await consuming(env, rule("[{name: quarantine}, {name: drain, timeout: 60}, "
                                  "{name: reboot, hook: job, timeout: 240}]"))
        start = await send(env, make_incident(sick, "inc-hung"))
        drain = await step_record(env, sick, "drain")
        node = await env.node(sick)
        # xidflow's marks next to Kubernetes' ones, and only its own in its ledger.
        assert node["spec"]["unschedulable"] is True
        assert taint_keys(node) >= LIFECYCLE_TAINTS | {(TAINT_KEY, "NoSchedule")}
        ledger = Ledger.from_annotations(node["metadata"].get("annotations"))
        assert not [k for k in xidflows(ledger) if "node.kubernetes.io" in k], ledger.owned
        ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "Unknown"  # the lifecycle controller's, untouched
        # The drain evicted what it found running, left what Kubernetes deleted, waited for nobody's kubelet.
        assert drain.outcome == Outcome.APPLIED, drain.reason
        assert drain.details["evicted"] == [f"{ns}/{train_pod}"]
        assert sorted(drain.details["stranded"]) == sorted([f"{ns}/{train_pod}", f"{ns}/{web_pod}"])
        assert "left terminating on the unreachable node" in drain.reason
        (train_moved,) = await wait_running(env.kube, ns, train, 1, healthy)
        # The reboot: no Job on a node whose kubelet is gone; the step waits for a new boot.
        await asyncio.sleep(3)
        jobs = await env.kube._call(env.kube.batch.list_namespaced_job, env.namespace,
                                    label_selector="xidflow.dev/flow=inc-hung")
        assert jobs["items"] == []
        # Someone power-cycles the machine: it boots with a new boot id and its kubelet answers again.
        cycled = time.time()
        await reboot(env.kube, sick, "boot-2", wait=False)
        await resume_heartbeats(env.kube, sick)
        await wait_nodes_usable(env.kube, [sick], 60)
        back = time.time()
        step = await step_record(env, sick, "reboot")
        assert step.outcome == Outcome.APPLIED and step.details["boot_id_after"] == "boot-2", step.reason
        assert step.details["job_not_started"] == NOT_STARTED

        async def stranded_ended() -> bool:
            left = {p["metadata"]["name"] for p in await list_pods(env.kube, ns, {})}
            return not left & {web_pod, train_pod}

        await wait_until(stranded_ended, 30, poll=0.2, what="the returning kubelet ending the stranded pods")
        ended = time.time()
        node = await env.node(sick)
        assert not taint_keys(node) & LIFECYCLE_TAINTS  # lifted by the lifecycle controller, not by xidflow
        assert (TAINT_KEY, "NoSchedule") in taint_keys(node) and node["spec"]["unschedulable"] is True
        # The worker saw the new boot and passing checks: the recovery returns the node.
        await send(env, NodeRecovered(incident_id="inc-hung", node=sick, reason="reboot", boot_id="boot-2"))
        await step_record(env, sick, "undo")
        node = await env.node(sick)
        assert not node["spec"].get("unschedulable") and (TAINT_KEY, "NoSchedule") not in taint_keys(node)
        jobs = await env.kube._call(env.kube.batch.list_namespaced_job, env.namespace,
                                    label_selector="xidflow.dev/flow=inc-hung")
        assert jobs["items"] == []  # nothing left to reboot the machine again
    evicted_at = timeline.first(lambda s: s.deleting)
    web_reason = timeline.first(lambda s: "DisruptionTarget" in s.conditions)[web_pod].conditions["DisruptionTarget"]
    assert web_reason == ("True", "DeletionByTaintManager")
    print(f"\nhung node {sick}: silent at 0s, tainted unreachable at {since(marked, stopped)}; "
          f"taint eviction controller deleted {web_pod} at {since(evicted_at[web_pod].at, stopped)} "
          f"({web_reason[1]}), replaced by {web_moved} on {healthy}")
    print(f"  Xid 79 published at {since(start, stopped)}; drain {drain.outcome.value} at "
          f"{since(drain.finished_at.timestamp(), stopped)}: {drain.reason}; {train_pod} evicted at "
          f"{since(evicted_at[train_pod].at, stopped)}, replaced by {train_moved} on {healthy}")
    print(f"  power cycle at {since(cycled, stopped)}, Ready with boot-2 at {since(back, stopped)}, reboot step "
          f"applied at {since(step.finished_at.timestamp(), stopped)} (no Job created); stranded pods ended at "
          f"{since(ended, stopped)}")


async def test_a_partition_that_heals_gets_its_reboot_job_once_the_kubelet_answers(env: Env) -> None:
    sick, _healthy = await env.make_nodes(2)
    stopped = await silent(env.kube, sick)
    await consuming(env, rule("[{name: quarantine}, {name: reboot, hook: job, timeout: 240}]"))
    await send(env, make_incident(sick, "inc-partition"))
    await step_record(env, sick, "notifyWorkload", outcomes=tuple(Outcome))
    await asyncio.sleep(3)
    listed = await env.kube._call(env.kube.batch.list_namespaced_job, env.namespace,
                                  label_selector="xidflow.dev/flow=inc-partition")
    assert listed["items"] == []  # not while the node is unreachable
    healed = time.time()
    await resume_heartbeats(env.kube, sick)  # the same machine, same boot: the network came back
    jobs: list[dict[str, Any]] = []

    async def job_done() -> bool:
        page = await env.kube._call(env.kube.batch.list_namespaced_job, env.namespace,
                                    label_selector="xidflow.dev/flow=inc-partition")
        jobs[:] = page["items"]
        return bool(jobs) and bool((jobs[0].get("status") or {}).get("succeeded"))

    await wait_until(job_done, 90, poll=0.2, what="the reboot Job, created once the kubelet answers, completed")
    created = jobs[0]["metadata"]["creationTimestamp"]
    await reboot(env.kube, sick, "boot-2")  # the Job's command reboots the machine
    step = await step_record(env, sick, "reboot")
    assert step.outcome == Outcome.APPLIED and step.details["boot_id_after"] == "boot-2", step.reason
    assert "job_not_started" not in step.details and step.details["job"] == jobs[0]["metadata"]["name"]
    print(f"\npartition of {sick}: silent at 0s, healed at {since(healed, stopped)}, reboot Job created {created}, "
          f"step applied at {since(step.finished_at.timestamp(), stopped)}")


async def test_reset_of_an_unreachable_node_removes_only_what_xidflow_applied(env: Env) -> None:
    sick, _healthy = await env.make_nodes(2)
    await silent(env.kube, sick)
    await consuming(env, PolicySet())  # the default quarantine
    await send(env, make_incident(sick, "inc-reset-silent"))
    await step_record(env, sick, "notifyWorkload", outcomes=tuple(Outcome))
    before = await env.node(sick)
    assert taint_keys(before) >= LIFECYCLE_TAINTS | {(TAINT_KEY, "NoSchedule")}
    cli = Path(sys.executable).with_name("xidflow")
    proc = await asyncio.create_subprocess_exec(
        str(cli), "reset", "--node", sick,
        env={"KUBECONFIG": env.kubeconfig, "KAFKA_BOOTSTRAP_SERVERS": env.bootstrap,
             "XIDFLOW_TOPIC_PREFIX": env.topics.prefix, "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": env.selector,
             "XIDFLOW_ACTUATOR_NAMESPACE": env.namespace, "PATH": str(cli.parent)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    assert proc.returncode == 0, out.decode()
    assert f"{sick}: inc-reset-silent" in out.decode()
    after = await env.node(sick)
    assert not after["spec"].get("unschedulable")
    assert taint_keys(after) & {(TAINT_KEY, "NoSchedule")} == set()
    assert LIFECYCLE_TAINTS <= taint_keys(after)  # Kubernetes' taints stay: the machine is still silent
    ready = next(c for c in after["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "Unknown"
    assert Ledger.from_annotations(after["metadata"].get("annotations")).owned == {}
    await resume_heartbeats(env.kube, sick)
    await wait_nodes_usable(env.kube, [sick], 60)  # the lifecycle controller lifts its own taints
    assert not taint_keys(await env.node(sick)) & {(k, e) for k in UNREADY_TAINTS for e in ("NoSchedule", "NoExecute")}
