"""The repair loop on the session's control plane and broker (docs/repair.md): the diagnostics gate's Job run by
the Job controller and ended by KWOK as the machine's program says, a repair again after a failed diagnostics,
escalation to hardware inspection, the RepairRequest hand-off and its answer, a flapping node as one case,
repair budgets per node group, the breaker's absolute bound.

The machines are simulated (``pipeline.actuator.machines``): a reboot Job that ran reboots its machine with a new
boot id; a held diagnostics Job's pod passes or fails when the test says (``finish_diagnostics``). Everything
else is the real control plane's: the Job controller runs the hook Jobs and judges them, the scheduler and the
disruption controller the drained workload, the API server validates the RepairRequest against its CRD.

``XIDFLOW_REPAIR_TIMELINE=<file>`` writes the whole loop of ``test_the_whole_loop_...`` as an operator reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.actuator import repaircase, repairrequest
from pipeline.actuator.actions.diagnose import HOOK_LABEL
from pipeline.actuator.app import Actuator, actuator_topics
from pipeline.actuator.effects import DEFAULT_DIAGNOSTICS_JOB
from pipeline.actuator.machines import finish_diagnostics, held_job, reboot_when_asked
from pipeline.actuator.policy import load_yaml_text
from pipeline.actuator.testing import (
    make_incident,
    node_events,
    publish,
    read_topic,
    wait_until,
    webhook_receiver,
)
from pipeline.kafka.admin import ensure_topics
from pipeline.runtime.settings import KafkaSettings
from schemas.records import Outcome
from tests.integration.test_actuator_effects import Env, outcomes
from tests.integration.test_actuator_policy_crd import install_crds
from tests.integration.workloads import deployment, ensure_ns, pods_on, wait_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CLS = "GpuFellOffBus"
TAINT = "nvidia.com/gpu-fault"


@pytest.fixture
async def env(kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]) -> AsyncIterator[Env]:
    world = Env(kafka_bootstrap, kubeconfig, unique)
    await ensure_topics(kafka_bootstrap, actuator_topics(world.topics), partitions=2)
    await install_crds(world.kube)
    await ensure_ns(world.kube, world.namespace)
    yield world
    for obj in await world.kube.list_cluster_objects(repairrequest.GROUP, repairrequest.VERSION, repairrequest.PLURAL):
        if obj["spec"]["nodeName"] in world.nodes:
            with contextlib.suppress(Exception):
                await world.kube.delete_cluster_object(repairrequest.GROUP, repairrequest.VERSION,
                                                       repairrequest.PLURAL, obj["metadata"]["name"])
    await world.close()


def loop_policy(actions: str, repair: str = "{window: 3600, maxFailedRepairs: 2}", extra: str = "") -> Any:
    return load_yaml_text(
        "kind: RescuePolicy\nmetadata: {name: loop}\nspec:\n"
        f"  rules:\n  - {{name: gpu-lost, priority: 10, codes: [79], actions: {actions}, repair: {repair}}}\n"
        + extra
    )


REBOOT_AND_DIAGNOSE = ("[{name: quarantine}, {name: drain, gracePeriodCap: 0, timeout: 30},"
                       " {name: reboot, hook: job, timeout: 60}, {name: diagnose, timeout: 120}]")


def held_diagnostics(tmp_path: Path) -> str:
    """The built-in diagnostics Job whose pod runs until the machine's program says pass or fail."""
    path = tmp_path / "diagnostics-job.yaml"
    path.write_text(yaml.safe_dump(held_job(DEFAULT_DIAGNOSTICS_JOB)))
    return str(path)


async def diagnostics_jobs(env: Env, node: str) -> list[dict[str, Any]]:
    page = await env.kube._call(env.kube.batch.list_namespaced_job, env.namespace,
                                label_selector=f"{HOOK_LABEL}=diagnostics")
    jobs = [j for j in page.get("items") or [] if j["spec"]["template"]["spec"].get("nodeName") == node]
    return sorted(jobs, key=lambda j: j["metadata"]["creationTimestamp"] + j["metadata"]["name"])


async def next_diagnostics(env: Env, node: str, seen: int, limit_s: float = 120) -> str:
    """The name of the node's next diagnostics Job, once the actuator created it."""
    found: list[str] = []

    async def created() -> bool:
        jobs = await diagnostics_jobs(env, node)
        found[:] = [j["metadata"]["name"] for j in jobs]
        return len(jobs) > seen

    await wait_until(created, limit_s, poll=0.2, what=f"diagnostics Job {seen + 1} on {node}")
    return found[seen]


async def the_case(env: Env, node: str) -> dict[str, Any]:
    return (await env.ledger(node)).repairs.get(CLS) or {}


async def stage_is(env: Env, node: str, stage: str, limit_s: float = 120) -> dict[str, Any]:
    async def reached() -> bool:
        return (await the_case(env, node)).get("stage") == stage

    await wait_until(reached, limit_s, poll=0.2, what=f"repair case of {node} {stage}")
    return await the_case(env, node)


async def in_service(env: Env, node: str) -> dict[str, Any]:
    obj = await env.node(node)
    assert not obj["spec"].get("unschedulable"), "the node is still cordoned"
    assert not [t for t in obj["spec"].get("taints") or [] if t["key"] == TAINT], "xidflow's taint is still there"
    return obj


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return next((c for c in obj["status"].get("conditions") or [] if c["type"] == ctype), None)


@contextlib.asynccontextmanager
async def machine(env: Env, node: str) -> AsyncIterator[None]:
    """The node's machine reboots when a reboot Job ran on it (boot-2, boot-3, ...)."""
    boots = (f"boot-{i}" for i in itertools.count(2))
    task = asyncio.create_task(reboot_when_asked(env.kube, env.namespace, node, boots))
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_gate_returns_the_node_only_when_the_diagnostics_job_passes(env: Env) -> None:
    (node,) = await env.make_nodes(1)
    ns = env.unique("work")
    await ensure_ns(env.kube, ns)
    try:
        names = await deployment(env.kube, ns, "train", node, 2, {"app": "train"})
        act = await env.actuator(loop_policy(REBOOT_AND_DIAGNOSE))
        async with machine(env, node):
            await act.engine.handle(make_incident(node, "inc-gate"))
        # The built-in Job (DCGM level 2): KWOK ran its pod and ended it with exit 0, the Job controller says Complete.
        (job,) = await diagnostics_jobs(env, node)
        done = await wait_job(env.kube, env.namespace, job["metadata"]["name"], "Complete")
        assert done["status"]["succeeded"] == 1
        assert job["spec"]["activeDeadlineSeconds"] == 120 and job["spec"]["template"]["spec"]["nodeName"] == node
        assert "dcgmi diag -r 2" in job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
        obj = await in_service(env, node)
        assert condition(obj, CLS)["status"] == "False"
        assert not set(names) & set(await pods_on(env.kube, node))  # drained before the reboot
        case = await the_case(env, node)
        assert case["stage"] == repaircase.RETURNED and case["failed"] == 0 and case["returned"]
        assert [d["verdict"] for d in case["diagnostics"]] == ["pass"]
        assert [r["action"] for r in case["repairs"]] == ["reboot"]
        steps = [a for a, _ in outcomes(await env.audit(), node)]
        # the order an operator reads: out, drained, rebooted, diagnosed, and only then back
        assert steps.index("drain") < steps.index("reboot") < steps.index("diagnose") < steps.index("return-to-service")
        # a redelivered incident runs nothing again: no second diagnostics Job, the node stays in service
        await act.engine.handle(make_incident(node, "inc-gate"))
        assert len(await diagnostics_jobs(env, node)) == 1
        await in_service(env, node)
    finally:
        await env.kube._call(env.kube.core.delete_namespace, ns)


async def test_an_incident_recovery_does_not_return_a_node_before_the_gate(env: Env, tmp_path: Path) -> None:
    from schemas.records import NodeRecovered

    (node,) = await env.make_nodes(1)
    act = await env.actuator(loop_policy("[{name: quarantine}, {name: diagnose, timeout: 120}]"),
                             diagnostics_job_template=held_diagnostics(tmp_path))
    handling = asyncio.create_task(act.engine.handle(make_incident(node, "inc-held")))
    job = await next_diagnostics(env, node, 0)
    # The aggregation closes the incident (a quiet period, a reboot's checks) while the diagnostics still run.
    other = await env.actuator(loop_policy("[{name: quarantine}, {name: diagnose, timeout: 120}]"), worker="w2")
    await other.engine.handle(NodeRecovered(incident_id="inc-held", node=node, reason="reboot"))
    assert (await env.node(node))["spec"]["unschedulable"] is True
    undo = [r for r in await env.audit() if r.node == node and r.action == "undo"][-1]
    assert undo.outcome == Outcome.SKIPPED and "the diagnostics gate returns the node" in undo.reason
    await finish_diagnostics(env.kube, env.namespace, job, passed=True)
    await asyncio.wait_for(handling, 60)
    await in_service(env, node)


async def test_a_failed_diagnostics_repairs_again_and_a_pass_returns_the_node(env: Env, tmp_path: Path) -> None:
    (node,) = await env.make_nodes(1)
    act = await env.actuator(loop_policy(REBOOT_AND_DIAGNOSE), diagnostics_job_template=held_diagnostics(tmp_path))
    async with machine(env, node):
        handling = asyncio.create_task(act.engine.handle(make_incident(node, "inc-again")))
        first = await next_diagnostics(env, node, 0)
        result = {"result": "fail", "level": 2, "exitCode": 226,
                  "tests": [{"name": "Memory", "result": "fail", "gpu": 3, "message": "DBE"}]}
        await finish_diagnostics(env.kube, env.namespace, first, passed=False, result=result, exit_code=226)
        second = await next_diagnostics(env, node, 1)
        assert (await env.node(node))["spec"]["unschedulable"] is True  # still out between the two
        await finish_diagnostics(env.kube, env.namespace, second, passed=True)
        await asyncio.wait_for(handling, 120)
    await in_service(env, node)
    case = await the_case(env, node)
    assert case["stage"] == repaircase.RETURNED and case["failed"] == 1
    assert [d["verdict"] for d in case["diagnostics"]] == ["fail", "pass"]
    assert case["diagnostics"][0]["result"]["tests"][0]["gpu"] == 3  # the result format, from the termination message
    assert [(r["action"], r["flow"]) for r in case["repairs"]] == [("reboot", "inc-again"), ("reboot", "inc-again-1")]
    assert (await env.node(node))["status"]["nodeInfo"]["bootID"] == "boot-3"  # two reboots
    failed = [r for r in await env.audit() if r.node == node and r.action == "diagnose"][0]
    assert failed.outcome == Outcome.FAILED and failed.details["verdict"] == "fail"
    assert failed.details["result"]["exitCode"] == 226


async def test_a_diagnostics_timeout_escalates_and_the_webhook_gets_the_cloudevent(env: Env, tmp_path: Path) -> None:
    from aiohttp import web

    (node,) = await env.make_nodes(1)
    received: list[tuple[str, dict[str, Any]]] = []

    async def receive(request: web.Request) -> web.Response:
        received.append((request.headers["Content-Type"], await request.json()))
        return web.json_response({}, status=202)

    async with webhook_receiver("/repairs", receive) as url:
        policy = loop_policy("[{name: quarantine}, {name: diagnose, timeout: 3}]",
                             f"{{maxFailedRepairs: 1, handoff: {{webhookUrl: '{url}'}}}}")
        act = await env.actuator(policy, diagnostics_job_template=held_diagnostics(tmp_path))
        await act.engine.handle(make_incident(node, "inc-slow"))
    (job,) = await diagnostics_jobs(env, node)
    failed = await wait_job(env.kube, env.namespace, job["metadata"]["name"], "Failed")
    assert any(c.get("reason") == "DeadlineExceeded" for c in failed["status"]["conditions"])  # the Job controller's
    case = await the_case(env, node)
    assert case["stage"] == repaircase.HANDED_OFF and [d["verdict"] for d in case["diagnostics"]] == ["timeout"]
    name = case["handoff"]["name"]
    request = await env.kube.get_cluster_object(repairrequest.GROUP, repairrequest.VERSION, repairrequest.PLURAL, name)
    assert request["spec"]["nodeName"] == node and request["spec"]["diagnostics"][0]["verdict"] == "timeout"
    ((content_type, event),) = received
    assert content_type == "application/cloudevents+json" and event["type"] == repairrequest.EVENT_TYPE
    assert event["id"] == name and event["subject"] == node and event["data"]["spec"]["caseId"] == "inc-slow"
    obj = await env.node(node)
    assert obj["spec"]["unschedulable"] is True
    inspection = condition(obj, repaircase.INSPECTION_CONDITION)
    assert inspection["status"] == "True" and inspection["reason"] == "DiagnosticsFailed"
    assert any(e["reason"] == "HardwareInspection" and name in e["message"] for e in await node_events(env.kube, node))


async def test_the_whole_loop_fault_repairs_escalation_hand_off_replaced_and_back(env: Env, tmp_path: Path) -> None:
    """One node's whole loop with a consuming actuator (the reconciler and the RepairRequest watch running)."""
    (node,) = await env.make_nodes(1, {"topology.kubernetes.io/rack": "r7"})
    ns = env.unique("work")
    await ensure_ns(env.kube, ns)
    policy_text = (
        "kind: RescuePolicy\nmetadata: {name: gpu-repair}\nspec:\n"
        "  repairBudgets: [{label: topology.kubernetes.io/rack, maxNodes: 2}]\n"
        "  rules:\n"
        "  - name: gpu-lost\n    priority: 50\n    codes: [79]\n"
        "    actions:\n"
        "      - {name: quarantine}\n"
        "      - {name: drain, gracePeriodCap: 0, timeout: 60}\n"
        "      - {name: reboot, hook: job, timeout: 120}\n"
        "      - {name: diagnose, timeout: 300}\n"
        "    repair: {window: 86400, maxFailedRepairs: 2}\n"
    )
    settings = env.settings(worker_id="actuator-0", diagnostics_job_template=held_diagnostics(tmp_path),
                            resync_seconds=2)
    act = Actuator(settings, KafkaSettings(KAFKA_BOOTSTRAP_SERVERS=env.bootstrap), env.topics, env.kubeconfig,
                   load_yaml_text(policy_text))
    env.actuators.append(act)
    await act.start()
    consumer = asyncio.create_task(act.run())
    timeline: list[tuple[float, str]] = []
    start = time.time()

    def note(what: str) -> None:
        timeline.append((time.time(), what))

    try:
        await deployment(env.kube, ns, "train", node, 2, {"app": "train"}, gpus=4)
        async with machine(env, node):
            note("Xid 79 on 0000:4e:00.0 (incident inc-loop published)")
            await publish(env.bootstrap, env.topics.name("incidents"), [make_incident(node, "inc-loop")])
            first = await next_diagnostics(env, node, 0)
            await finish_diagnostics(env.kube, env.namespace, first, passed=False, exit_code=226,
                                     result={"result": "fail", "level": 2, "exitCode": 226,
                                             "tests": [{"name": "Memory", "result": "fail", "gpu": 3}]})
            note(f"machine: diagnostics {first} fail (exit 226, Memory test on GPU 3)")
            second = await next_diagnostics(env, node, 1)
            await finish_diagnostics(env.kube, env.namespace, second, passed=False, exit_code=226)
            note(f"machine: diagnostics {second} fail (exit 226)")
            case = await stage_is(env, node, repaircase.HANDED_OFF)
            name = case["handoff"]["name"]
            # A fault meanwhile: recorded in the case, the node untouched.
            await publish(env.bootstrap, env.topics.name("incidents"), [make_incident(node, "inc-loop-late")])
            note("Xid 79 again while handed off (incident inc-loop-late published)")

            async def recorded() -> bool:
                return any(f["incident"] == "inc-loop-late" for f in (await the_case(env, node))["faults"])

            await wait_until(recorded, 60, what="late fault recorded in the case")
            assert not [j for j in await diagnostics_jobs(env, node)][2:]
            # The repair system replaces the GPU baseboard and says so in the request's status.
            await env.kube._call(
                env.kube.custom.patch_cluster_custom_object_status, repairrequest.GROUP, repairrequest.VERSION,
                repairrequest.PLURAL, name,
                {"status": {"phase": "Replaced", "updatedBy": "rma-bot", "message": "baseboard swapped"}},
            )
            note(f"repair system: RepairRequest {name} status.phase=Replaced")
            third = await next_diagnostics(env, node, 2)
            await finish_diagnostics(env.kube, env.namespace, third, passed=True)
            note(f"machine: diagnostics {third} pass")
            await stage_is(env, node, repaircase.RETURNED)
        obj = await in_service(env, node)
        assert condition(obj, CLS)["status"] == "False"
        assert condition(obj, repaircase.INSPECTION_CONDITION)["status"] == "False"
        case = await the_case(env, node)
        assert case["case"] == "inc-loop" and case["failed"] == 0
        assert [d["verdict"] for d in case["diagnostics"]] == ["fail", "fail", "pass"]
        assert [r["action"] for r in case["repairs"]] == ["reboot", "reboot"]
        assert [f["incident"] for f in case["faults"]] == ["inc-loop", "inc-loop-late"]
        request = await env.kube.get_cluster_object(repairrequest.GROUP, repairrequest.VERSION,
                                                    repairrequest.PLURAL, name)
        spec = request["spec"]
        assert spec["failedRepairs"] == 2 and [r["action"] for r in spec["repairsTried"]] == ["reboot", "reboot"]
        assert [d["verdict"] for d in spec["diagnostics"]] == ["fail", "fail"]
        assert spec["faults"][0]["evidenceIds"] == [] and spec["faults"][0]["line"].startswith("NVRM: Xid")
        audit = [r for r in await env.audit() if r.node == node]
        rows = [(r.finished_at.timestamp(), f"{r.action} {r.outcome.value}: {r.reason}") for r in audit
                if r.action not in ("resume",)]
        from pipeline.commands.status import history_rows, node_rows

        (row,) = node_rows([await env.node(node)])
        shown = await xidflow_status(env, node)
        assert "returned (GpuFellOffBus, 0/2 failed)" in shown and "handed off as RepairRequest" in shown
        lines = _timeline(start, sorted(timeline + rows), policy_text, history_rows(row), row["repair"]) + shown
        if path := os.environ.get("XIDFLOW_REPAIR_TIMELINE"):
            await asyncio.to_thread(Path(path).write_text, lines)
        print(lines)
    finally:
        act.consumer._stopping.set()
        await asyncio.gather(consumer, return_exceptions=True)
        await env.kube._call(env.kube.core.delete_namespace, ns)


async def xidflow_status(env: Env, node: str) -> str:
    """``xidflow status NODE`` as an operator runs it (its own client, the cluster's API server)."""
    from click.testing import CliRunner

    from pipeline.cli import cli

    runner = CliRunner(env={"KUBECONFIG": env.kubeconfig, "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": env.selector,
                            "XIDFLOW_ACTUATOR_NAMESPACE": env.namespace, "COLUMNS": "400",
                            "XIDFLOW_REPAIR_TIMELINE": None})  # the test's own variable, no setting of the CLI
    result = await asyncio.to_thread(runner.invoke, cli, ["status", node], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return f"$ xidflow status {node}\n{result.output}"


def _timeline(start: float, events: list[tuple[float, str]], policy: str, history: list[dict[str, Any]],
              position: str | None) -> str:
    out = ["The policy:", *("    " + line for line in policy.splitlines()), "",
           "What happened (seconds from the fault; audit records of the actuator, and what the test did as the",
           "machine and the repair system):"]
    out += [f"  +{at - start:7.2f}s  {what[:150]}" for at, what in events]
    out += ["", "xidflow status NODE, its repair history:"]
    out += [f"  +{float(h['at']) - start:7.2f}s  {h['stage']:<20} {h['note']}" for h in history]
    out += [f"  now: {position}", ""]
    return "\n".join(out)


async def test_a_flapping_node_is_one_repair_case_until_the_limit_hands_it_off(env: Env) -> None:
    (node,) = await env.make_nodes(1)
    act = await env.actuator(loop_policy("[{name: quarantine}, {name: reboot, hook: job, timeout: 60},"
                                         " {name: diagnose, timeout: 60}]"))
    async with machine(env, node):
        for i in range(2):  # out, back, out within the window, back
            await act.engine.handle(make_incident(node, f"inc-flap-{i}"))
            await in_service(env, node)
        case = await the_case(env, node)
        assert case["case"] == "inc-flap-0" and case["failed"] == 1 and case["stage"] == repaircase.RETURNED
        await act.engine.handle(make_incident(node, "inc-flap-2"))  # out a third time: the limit (2) is reached
    case = await the_case(env, node)
    assert case["case"] == "inc-flap-0" and case["stage"] == repaircase.HANDED_OFF and case["failed"] == 2
    assert [f["incident"] for f in case["faults"]] == ["inc-flap-0", "inc-flap-1", "inc-flap-2"]
    assert [r["action"] for r in case["repairs"]] == ["reboot", "reboot"]  # no third reboot
    obj = await env.node(node)
    assert obj["spec"]["unschedulable"] is True
    assert condition(obj, repaircase.INSPECTION_CONDITION)["reason"] == "RepairsDidNotHold"
    request = await env.kube.get_cluster_object(repairrequest.GROUP, repairrequest.VERSION, repairrequest.PLURAL,
                                                case["handoff"]["name"])
    assert [f["incidentId"] for f in request["spec"]["faults"]] == ["inc-flap-0", "inc-flap-1", "inc-flap-2"]
    decide = [r for r in await env.audit() if r.node == node and r.action == "decide"][-1]
    assert "2 repairs did not hold (limit 2)" in decide.details["escalation"]
    shown = await xidflow_status(env, node)
    assert "handed-off (GpuFellOffBus, 2/2 failed)" in shown
    assert shown.count("returned") >= 2 and "came back" in shown


async def test_a_repair_budget_holds_the_second_node_of_a_rack_until_the_first_is_done(
    env: Env, tmp_path: Path
) -> None:
    a, b = await env.make_nodes(2, {"topology.kubernetes.io/rack": env.unique("rack")[:63]})
    rack = (await env.node(a))["metadata"]["labels"]["topology.kubernetes.io/rack"]
    policy = loop_policy("[{name: cordon}, {name: drain, timeout: 30}, {name: diagnose, timeout: 120}]",
                         extra="  repairBudgets: [{label: topology.kubernetes.io/rack, maxNodes: 1}]\n")
    act = await env.actuator(policy, diagnostics_job_template=held_diagnostics(tmp_path))
    first = asyncio.create_task(act.engine.handle(make_incident(a, "inc-budget-a")))
    job_a = await next_diagnostics(env, a, 0)  # a is in its diagnostics: it holds the rack's one slot
    second = asyncio.create_task(act.engine.handle(make_incident(b, "inc-budget-b")))
    await asyncio.sleep(3)
    assert not (await env.ledger(b)).is_done("inc-budget-b", "drain")
    assert await act.budgets.holders(f"topology.kubernetes.io/rack={rack}") == [a]
    await finish_diagnostics(env.kube, env.namespace, job_a, passed=True)
    await asyncio.wait_for(first, 60)
    job_b = await next_diagnostics(env, b, 0)
    assert (await env.ledger(b)).is_done("inc-budget-b", "drain")
    await finish_diagnostics(env.kube, env.namespace, job_b, passed=True)
    await asyncio.wait_for(second, 60)
    drain_b = [r for r in await env.audit() if r.node == b and r.action == "drain"][0]
    assert drain_b.details["repair_budget"] == [f"topology.kubernetes.io/rack={rack}"]
    assert drain_b.details["budget_waited_s"] > 2
    assert await act.budgets.holders(f"topology.kubernetes.io/rack={rack}") == []


async def test_the_breaker_trips_at_its_absolute_bound(env: Env) -> None:
    names = await env.make_nodes(3)
    act = await env.actuator(breaker_max_nodes=2)  # share 1.0 (the Env's): the bound alone decides
    for i, name in enumerate(names):
        await act.engine.handle(make_incident(name, f"inc-bound-{i}"))
    cordoned = [bool((await env.node(n))["spec"].get("unschedulable")) for n in names]
    assert cordoned == [True, True, False]
    status = await act.breaker.status()
    assert status["tripped"] and "limit 2 nodes" in status["reason"] and status["max_nodes"] == 2


async def test_audit_records_carry_the_cloudevents_kafka_binding(env: Env) -> None:
    import orjson

    (node,) = await env.make_nodes(1)
    act = await env.actuator()
    await act.engine.handle(make_incident(node, "inc-ce"))
    mine = [m for m in await read_topic(env.bootstrap, env.topics.name("remediation_audit")) if m.key == node.encode()]
    assert len(mine) >= 5  # decide, cordon, taint, condition, event, ...
    for message in mine:
        headers = dict(message.headers)
        assert headers["ce_specversion"] == b"1.0" and headers["ce_type"] == b"dev.xidflow.remediation.v1"
        assert headers["ce_source"] == b"/xidflow/actuator" and headers["ce_subject"] == node.encode()
        assert headers["content-type"] == b"application/json" and headers["ce_time"].endswith(b"Z")
        assert headers["ce_id"] == orjson.loads(message.value)["record_id"].encode()
