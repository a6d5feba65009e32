"""Drain (PDB honoured, DaemonSet/mirror/excluded pods left alone, force only when allowed),
reboot hooks with bootID completion, GPU reset Job, warm standby, attempt cap - on the session's control plane:
the pods are Deployments' and DaemonSets' (placed by the scheduler, run by KWOK), the PDB's status is the
disruption controller's, the hook Jobs are run by the Job controller."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pipeline.actuator.kube import Kube
from pipeline.actuator.ownership import REBOOT_REQUEST_ANNOTATION
from pipeline.actuator.policy import load_yaml_text
from pipeline.actuator.testing import make_incident, reboot, wait_until, webhook_receiver
from schemas.records import Outcome
from tests.integration.test_actuator_effects import Env, outcomes
from tests.integration.workloads import (
    UNSCHEDULABLE_TOLERATION,
    daemonset,
    deployment,
    ensure_ns,
    mirror_pod,
    pdb,
    pods_on,
    wait_job,
)

# A hang (an unbounded retry against a broken API server) fails in minutes, with its stack, not at 600 s.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]



def policy(actions: str, code: int = 79) -> Any:
    return load_yaml_text(
        "kind: RescuePolicy\nmetadata: {name: t}\nspec:\n  rules:\n"
        f"  - {{priority: 10, codes: [{code}], actions: {actions}}}\n"
    )


async def test_drain_evicts_and_leaves_daemonset_mirror_and_excluded_pods(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    work, system = env.unique("work"), env.unique("sys")
    for ns in (work, system):
        await ensure_ns(env.kube, ns)
    env_ns = [work, system]
    try:
        evictable = await deployment(env.kube, work, "x", name, 2, {"app": "x"})
        ds_pod = await daemonset(env.kube, work, "ds", name, {"app": "ds"})
        mirror = await mirror_pod(env.kube, work, "mirror", name, {"app": "m"})
        sys_pods = await deployment(env.kube, system, "s", name, 1, {"app": "s"})
        act = await env.actuator(
            policy(
                f"[{{name: cordon}}, {{name: drain, gracePeriodCap: 0, timeout: 20, excludedNamespaces: [{system}]}}]"
            )
        )
        await act.engine.handle(make_incident(name, "inc-drain"))
        assert await pods_on(env.kube, name) == sorted([ds_pod, mirror, *sys_pods])
        drain = [r for r in await env.audit() if r.node == name and r.action == "drain"]
        assert drain[-1].outcome == Outcome.APPLIED
        assert sorted(drain[-1].details["evicted"]) == [f"{work}/{p}" for p in evictable]
        # a redelivery starts no second eviction wave: a pod placed on the cordoned node since (it tolerates
        # the cordon) stays
        late = await deployment(env.kube, work, "late", name, 1, {"app": "late"},
                                tolerations=[UNSCHEDULABLE_TOLERATION])
        await act.engine.handle(make_incident(name, "inc-drain"))
        assert set(late) <= set(await pods_on(env.kube, name))
    finally:
        for ns in env_ns:
            await env.kube._call(env.kube.core.delete_namespace, ns)


async def test_pdb_blocked_drain_backs_off_and_fails_then_force_when_allowed(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    ns = env.unique("pdb")
    await ensure_ns(env.kube, ns)
    try:
        await deployment(env.kube, ns, "guarded", name, 2, {"app": "guarded"})
        # The disruption controller's status for two healthy pods and minAvailable 1: one disruption allowed.
        status = await pdb(env.kube, ns, "guard", {"app": "guarded"}, min_available=1)
        assert status["disruptionsAllowed"] == 1
        act = await env.actuator(policy("[{name: cordon}, {name: drain, gracePeriodCap: 0, timeout: 2}]"))
        await act.engine.handle(make_incident(name, "inc-pdb"))
        left = await pods_on(env.kube, name)
        # one eviction allowed, the other refused with 429 until the timeout: the replacement of the evicted
        # pod cannot run on the cordoned node, so the budget stays spent
        assert len(left) == 1
        drain = [r for r in await env.audit() if r.node == name and r.action == "drain"]
        assert drain[-1].outcome == Outcome.FAILED and "timed out" in drain[-1].reason
        assert drain[-1].details["blocked"] == [f"{ns}/{left[0]}"]
        assert len(drain[-1].details["evicted"]) == 1
        assert ("drain", "failed") in outcomes(await env.audit(), name)

        forcing = await env.actuator(
            policy("[{name: cordon}, {name: drain, gracePeriodCap: 0, timeout: 10, forceAfter: 0.5, forceNamespaces: ["
                   + ns + "]}]"), worker="w2"
        )
        await forcing.engine.handle(make_incident(name, "inc-pdb-force"))
        assert await pods_on(env.kube, name) == []
        forced = [r for r in await env.audit() if r.node == name and r.action == "drain"][-1]
        assert forced.outcome == Outcome.APPLIED and forced.details["forced"] == [f"{ns}/{left[0]}"]
    finally:
        await env.kube._call(env.kube.core.delete_namespace, ns)


async def reboot_node_later(kube: Kube, node: str, delay: float, new_boot: str) -> None:
    """The machine reboots after ``delay``: its node comes back with ``new_boot`` (see machines.reboot)."""
    await asyncio.sleep(delay)
    await reboot(kube, node, new_boot)


async def test_reboot_by_annotation_waits_for_new_boot_id_then_uncordons(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    act = await env.actuator(
        policy("[{name: cordon}, {name: reboot, hook: annotation, timeout: 20, uncordonAfter: true}]")
    )

    async def external_daemon() -> None:
        async def requested() -> bool:
            return (await env.node(name))["metadata"].get("annotations", {}).get(REBOOT_REQUEST_ANNOTATION) == "inc-rb"

        await wait_until(requested, 15, what="reboot annotation")
        await reboot_node_later(env.kube, name, 0.2, "boot-2")

    daemon = asyncio.create_task(external_daemon())
    await act.engine.handle(make_incident(name, "inc-rb"))
    await daemon
    node = await env.node(name)
    assert not node["spec"].get("unschedulable")
    assert REBOOT_REQUEST_ANNOTATION not in node["metadata"].get("annotations", {})
    reboot = [r for r in await env.audit() if r.node == name and r.action == "reboot"][-1]
    assert reboot.outcome == Outcome.APPLIED and reboot.details["boot_id_after"] == "boot-2"
    # redelivery: no second reboot request
    await act.engine.handle(make_incident(name, "inc-rb"))
    assert REBOOT_REQUEST_ANNOTATION not in (await env.node(name))["metadata"].get("annotations", {})
    assert ("reboot", "already-applied") in outcomes(await env.audit(), name)


async def test_reboot_job_hook_and_timeout_without_new_boot(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    act = await env.actuator(policy("[{name: cordon}, {name: reboot, hook: job, timeout: 1}]"))
    await act.engine.handle(make_incident(name, "inc-job"))
    reboot = [r for r in await env.audit() if r.node == name and r.action == "reboot"][-1]
    assert reboot.outcome == Outcome.FAILED and "new bootID" in reboot.reason
    job = await env.kube.get_job(env.namespace, reboot.details["job"])
    pod_spec = job["spec"]["template"]["spec"]
    assert pod_spec["nodeName"] == name and pod_spec["containers"][0]["securityContext"]["privileged"] is True
    assert (await env.node(name))["spec"]["unschedulable"] is True  # failed reboot leaves it quarantined
    # The Job controller ran its pod on the node and KWOK completed it; the machine did not reboot, so no new
    # bootID came: the reboot failed although its Job succeeded.
    assert (await wait_job(env.kube, env.namespace, reboot.details["job"], "Complete"))["status"]["succeeded"] == 1


async def test_gpu_reset_job_hook(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    act = await env.actuator(policy("[{name: cordon}, {name: resetGpu}]", code=48))
    await act.engine.handle(make_incident(name, "inc-reset", code=48))
    await act.engine.handle(make_incident(name, "inc-reset", code=48))
    reset = [r for r in await env.audit() if r.node == name and r.action == "resetGpu"]
    assert [r.outcome for r in reset] == [Outcome.APPLIED, Outcome.ALREADY_APPLIED]
    job = await wait_job(env.kube, env.namespace, reset[0].details["job"], "Complete")  # the Job controller's word
    env_vars = job["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "XIDFLOW_GPU_PCI", "value": "0000:4e:00.0"} in env_vars


async def test_warm_standby_uncordons_a_matching_standby(env: Env) -> None:
    (origin,) = await env.make_nodes(1, {"pool": "train"})
    spares = await env.make_nodes(2, {"xidflow.dev/standby": "true", "pool": "spare"})
    (other,) = await env.make_nodes(1, {"xidflow.dev/standby": "true", "pool": "elsewhere"})
    for spare in [*spares, other]:
        await env.kube.patch_node(spare, {"spec": {"unschedulable": True}})
    policies = load_yaml_text(
        "kind: RescuePolicy\nmetadata: {name: t}\nspec:\n  rules:\n"
        "  - {priority: 10, codes: [79], actions: [{name: cordon}, {name: enableWarmStandby}]}\n---\n"
        "kind: WarmStandbyPolicy\nmetadata: {name: w}\n"
        "spec: {originLabels: {pool: train}, targetLabels: {pool: spare}}\n"
    )
    # the fleet selector keeps the choice inside this test's nodes
    act = await env.actuator(policies, standby_label="xidflow.dev/standby")
    await act.engine.handle(make_incident(origin, "inc-ws"))
    states = {n: bool((await env.node(n))["spec"].get("unschedulable")) for n in [*spares, other]}
    assert states[other] is True
    assert sorted(states[s] for s in spares) == [False, True]
    chosen = [s for s in spares if not states[s]][0]
    assert (await env.node(chosen))["metadata"]["annotations"]["xidflow.dev/standby-for"] == f"{origin}/inc-ws"


async def test_attempt_cap_escalates_to_contact_support(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    act = await env.actuator(
        policy("[{name: cordon}, {name: drain, gracePeriodCap: 0, timeout: 5}, {name: unCordon}]"), attempt_cap=2
    )
    for i in range(3):
        await act.engine.handle(make_incident(name, f"inc-cap-{i}"))
    decides = [r for r in await env.audit() if r.node == name and r.action == "decide"]
    assert [("CONTACT_SUPPORT" in r.reason) for r in decides] == [False, False, True]
    assert (await env.node(name))["spec"]["unschedulable"] is True  # escalation keeps it out, no uncordon


async def test_reboot_by_webhook_sends_once_per_flow_and_detects_the_new_boot(env: Env) -> None:
    from aiohttp import web

    (name,) = await env.make_nodes(1)
    calls: list[tuple[str, dict[str, Any]]] = []

    async def receive(request: web.Request) -> web.Response:
        calls.append((request.headers["Idempotency-Key"], await request.json()))
        asyncio.get_running_loop().create_task(reboot_node_later(env.kube, name, 0.2, "boot-w"))
        return web.json_response({"ok": True}, status=202)

    async with webhook_receiver("/reboot", receive) as url:
        act = await env.actuator(
            policy(f"[{{name: cordon}}, {{name: reboot, hook: webhook, timeout: 20, webhookUrl: '{url}'}}]")
        )
        await act.engine.handle(make_incident(name, "inc-wh"))
        await act.engine.handle(make_incident(name, "inc-wh"))  # redelivered: no second call
    assert [key for key, _ in calls] == ["inc-wh"]
    assert calls[0][1]["node"] == name and calls[0][1]["bootId"] == "boot-1"
    reboot = [r for r in await env.audit() if r.node == name and r.action == "reboot"]
    assert [r.outcome for r in reboot] == [Outcome.APPLIED, Outcome.ALREADY_APPLIED]
    assert reboot[0].details["boot_id_after"] == "boot-w"


async def test_cluster_wide_drain_limit_holds_a_second_drain_until_the_first_ends(env: Env) -> None:
    from pipeline.actuator.breaker import DrainSlots

    await env.kube._call(
        env.kube.core.create_namespace, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": env.namespace}}
    )
    replica_a = DrainSlots(env.kube, env.namespace, "xidflow-drains", limit=1, stale_after=600)
    replica_b = DrainSlots(env.kube, env.namespace, "xidflow-drains", limit=1, stale_after=600)
    await replica_a.acquire("node-a", "a")
    second = asyncio.create_task(replica_b.acquire("node-b", "b", poll=0.1))
    await asyncio.sleep(0.5)
    assert not second.done() and set(await replica_b.holders()) == {"node-a"}
    await replica_a.release("node-a")
    await asyncio.wait_for(second, 10)
    assert set(await replica_a.holders()) == {"node-b"}


async def test_two_replicas_start_one_drain_and_one_reboot_request(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    ns = env.unique("work")
    await ensure_ns(env.kube, ns)
    try:
        names = await deployment(env.kube, ns, "x", name, 3, {"app": "x"})
        rule = "[{name: cordon}, {name: drain, gracePeriodCap: 0, timeout: 10}, {name: reboot, hook: job, timeout: 1}]"
        one = await env.actuator(policy(rule), worker="replica-a")
        two = await env.actuator(policy(rule), worker="replica-b")
        incident = make_incident(name, "inc-2long")
        await asyncio.gather(one.engine.handle(incident), two.engine.handle(incident))
        audit = [r for r in await env.audit() if r.node == name]
        drains = [r for r in audit if r.action == "drain" and r.outcome == Outcome.APPLIED]
        assert len(drains) == 1 and sorted(drains[0].details["evicted"]) == [f"{ns}/{p}" for p in names]
        jobs = await env.kube._call(
            env.kube.batch.list_namespaced_job, env.namespace, label_selector="xidflow.dev/flow=inc-2long"
        )
        assert len(jobs["items"]) == 1
    finally:
        await env.kube._call(env.kube.core.delete_namespace, ns)
