"""Drain (PDB honoured, DaemonSet/mirror/excluded pods left alone, force only when allowed),
reboot hooks with bootID completion, GPU reset Job, warm standby, attempt cap - real kube-apiserver."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pipeline.actuator.kube import Kube
from pipeline.actuator.ownership import REBOOT_REQUEST_ANNOTATION
from pipeline.actuator.policy import load_yaml_text
from pipeline.actuator.testing import make_incident, set_node_ready, wait_until
from schemas.records import Outcome
from tests.integration.test_actuator_effects import Env, outcomes

# A hang (an unbounded retry against a broken API server) fails in minutes, with its stack, not at 600 s.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]



def policy(actions: str, code: int = 79) -> Any:
    return load_yaml_text(
        "kind: RescuePolicy\nmetadata: {name: t}\nspec:\n  rules:\n"
        f"  - {{priority: 10, codes: [{code}], actions: {actions}}}\n"
    )


async def make_pods(
    kube: Kube, namespace: str, node: str, names: list[str], labels: dict[str, str], gpus: int = 0, **meta: Any
) -> None:
    """Pods bound to the node, Running and Ready (set through the status subresource: no kubelet here).

    ``gpus``: each pod's ``nvidia.com/gpu`` limit (a pod using a GPU is one a GPU fault affects).
    """
    container: dict[str, Any] = {"name": "c", "image": "busybox"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    for name in names:
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels, **meta},
            "spec": {
                "nodeName": node,
                "terminationGracePeriodSeconds": 30,
                "containers": [container],
            },
        }
        await kube._call(kube.core.create_namespaced_pod, namespace, body)
        status = {
            "status": {
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}],
                "containerStatuses": [
                    {
                        "name": "c",
                        "ready": True,
                        "restartCount": 0,
                        "image": "busybox",
                        "imageID": "",
                        "state": {"running": {}},
                    }
                ],
            }
        }
        await kube._call(kube.core.patch_namespaced_pod_status, name, namespace, status)


async def ensure_ns(kube: Kube, name: str) -> None:
    await kube._call(kube.core.create_namespace, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


async def pods_on(kube: Kube, node: str) -> list[str]:
    return sorted(p["metadata"]["name"] for p in await kube.list_pods_on_node(node))


async def test_drain_evicts_and_leaves_daemonset_mirror_and_excluded_pods(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    work, system = env.unique("work"), env.unique("sys")
    for ns in (work, system):
        await ensure_ns(env.kube, ns)
    env_ns = [work, system]
    try:
        await make_pods(env.kube, work, name, ["a", "b"], {"app": "x"})
        ds_owner = [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "ds", "uid": "u1", "controller": True}]
        await make_pods(env.kube, work, name, ["ds-pod"], {"app": "ds"}, ownerReferences=ds_owner)
        await make_pods(
            env.kube, work, name, ["mirror"], {"app": "m"}, annotations={"kubernetes.io/config.mirror": "x"}
        )
        await make_pods(env.kube, system, name, ["sys"], {"app": "s"})
        act = await env.actuator(
            policy(
                f"[{{name: cordon}}, {{name: drain, gracePeriodCap: 0, timeout: 20, excludedNamespaces: [{system}]}}]"
            )
        )
        await act.engine.handle(make_incident(name, "inc-drain"))
        assert await pods_on(env.kube, name) == ["ds-pod", "mirror", "sys"]
        audit = outcomes(await env.audit(), name)
        assert ("drain", "applied") in audit
        # a redelivery starts no second eviction wave
        await make_pods(env.kube, work, name, ["late"], {"app": "x"})
        await act.engine.handle(make_incident(name, "inc-drain"))
        assert "late" in await pods_on(env.kube, name)
    finally:
        for ns in env_ns:
            await env.kube._call(env.kube.core.delete_namespace, ns)


async def test_pdb_blocked_drain_backs_off_and_fails_then_force_when_allowed(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    ns = env.unique("pdb")
    await ensure_ns(env.kube, ns)
    try:
        await make_pods(env.kube, ns, name, ["p1", "p2"], {"app": "guarded"})
        from kubernetes import client

        policy_api = client.PolicyV1Api(env.kube.api_client)
        pdb = {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "guard", "namespace": ns},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}},
        }
        created = await env.kube._call(policy_api.create_namespaced_pod_disruption_budget, ns, pdb)
        # There is no disruption controller here: write the status it would compute for two healthy
        # pods and minAvailable 1. The API server's eviction handler then allows exactly one eviction.
        status = {
            "status": {
                "observedGeneration": created["metadata"]["generation"],
                "currentHealthy": 2,
                "desiredHealthy": 1,
                "expectedPods": 2,
                "disruptionsAllowed": 1,
            }
        }
        await env.kube._call(policy_api.patch_namespaced_pod_disruption_budget_status, "guard", ns, status)
        act = await env.actuator(policy("[{name: cordon}, {name: drain, gracePeriodCap: 0, timeout: 2}]"))
        await act.engine.handle(make_incident(name, "inc-pdb"))
        left = await pods_on(env.kube, name)
        assert len(left) == 1  # one eviction allowed, the other refused with 429 until the timeout
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
    await asyncio.sleep(delay)
    await set_node_ready(kube, node, new_boot, ready=False)
    await asyncio.sleep(0.3)
    await set_node_ready(kube, node, new_boot, ready=True)


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


async def test_gpu_reset_job_hook(env: Env) -> None:
    (name,) = await env.make_nodes(1)
    act = await env.actuator(policy("[{name: cordon}, {name: resetGpu}]", code=48))
    await act.engine.handle(make_incident(name, "inc-reset", code=48))
    await act.engine.handle(make_incident(name, "inc-reset", code=48))
    reset = [r for r in await env.audit() if r.node == name and r.action == "resetGpu"]
    assert [r.outcome for r in reset] == [Outcome.APPLIED, Outcome.ALREADY_APPLIED]
    job = await env.kube.get_job(env.namespace, reset[0].details["job"])
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

    app = web.Application()
    app.router.add_post("/reboot", receive)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        act = await env.actuator(
            policy(
                "[{name: cordon}, {name: reboot, hook: webhook, timeout: 20,"
                f" webhookUrl: 'http://127.0.0.1:{port}/reboot'}}]"
            )
        )
        await act.engine.handle(make_incident(name, "inc-wh"))
        await act.engine.handle(make_incident(name, "inc-wh"))  # redelivered: no second call
    finally:
        await runner.cleanup()
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
        await make_pods(env.kube, ns, name, ["a", "b", "c"], {"app": "x"})
        rule = "[{name: cordon}, {name: drain, gracePeriodCap: 0, timeout: 10}, {name: reboot, hook: job, timeout: 1}]"
        one = await env.actuator(policy(rule), worker="replica-a")
        two = await env.actuator(policy(rule), worker="replica-b")
        incident = make_incident(name, "inc-2long")
        await asyncio.gather(one.engine.handle(incident), two.engine.handle(incident))
        audit = [r for r in await env.audit() if r.node == name]
        drains = [r for r in audit if r.action == "drain" and r.outcome == Outcome.APPLIED]
        assert len(drains) == 1 and sorted(drains[0].details["evicted"]) == [f"{ns}/a", f"{ns}/b", f"{ns}/c"]
        jobs = await env.kube._call(
            env.kube.batch.list_namespaced_job, env.namespace, label_selector="xidflow.dev/flow=inc-2long"
        )
        assert len(jobs["items"]) == 1
    finally:
        await env.kube._call(env.kube.core.delete_namespace, ns)
