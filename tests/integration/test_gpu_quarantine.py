"""Per-GPU quarantine against the real control plane: the scheduler allocates DRA claims from ResourceSlices published
as NVIDIA's DRA driver publishes them (``machines.nvidia_dra_slice``: ``gpu.nvidia.com``, ``pciBusID``, full GPUs
and MIG devices, the driver's DeviceClasses), KWOK runs the pods, and what happens to them after a device taint is
what the device-taint eviction controller, the disruption controller and the Eviction API do.

Four cases, one per effect the policy can ask for:

- the default (``quarantine`` with ``perGpu``): a ``NoSchedule`` taint and xidflow's own drain of the pods holding
  the GPU: the holder is asked for a checkpoint, a PodDisruptionBudget holds its eviction back until it allows it,
  the pods on the node's other GPUs are never touched, and the replacement's new claim lands on another GPU;
- ``effect: NoExecute``: Kubernetes' device-taint eviction controller deletes the holder itself, past a budget that
  allows no disruption, and leaves the others (the delay from the rule to the delete is printed);
- ``effect: None``: a dry run: nothing is evicted or kept off, and the rule's status says what NoExecute would do;
- a MIG GPU: NVIDIA's driver publishes no GPU-instance id, so the whole GPU's MIG devices are tainted and only the
  pods on them leave; their replacements cannot be placed while it is tainted.

Who evicted a pod is read from the ``DisruptionTarget`` condition Kubernetes writes before it goes:
``EvictionByEvictionAPI`` (xidflow's drain) or ``DeletionByDeviceTaintManager`` (the controller).
``XIDFLOW_GPU_QUARANTINE_TIMINGS=<file>`` appends each case's timings (one JSON line) for the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from pipeline.actuator import claims, workload
from pipeline.actuator.actions import taint_device as td
from pipeline.actuator.machines import (
    H100_PCI,
    MIG_1G_10GB,
    ensure_nvidia_device_classes,
    nvidia_dra_slice,
)
from pipeline.actuator.policy import PolicySet, load_yaml_text
from pipeline.actuator.testing import wait_until
from schemas.records import Outcome
from tests.integration.test_actuator_checkpoint import Job, jobs
from tests.integration.test_actuator_device_taint import gpu_incident
from tests.integration.test_actuator_effects import Env
from tests.integration.workloads import (
    deployment,
    ensure_ns,
    list_pods,
    pdb,
    set_pdb_min_available,
    statefulset,
    wait_running,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CODE = 48  # double-bit ECC: the catalog scopes it to the GPU, and the GPU still runs (a checkpoint is worth asking)
RESOURCE = ("resource.k8s.io", "v1")
BY_XIDFLOW = "EvictionByEvictionAPI"
BY_DEVICE_TAINT_CONTROLLER = "DeletionByDeviceTaintManager"


@pytest.fixture
async def slices(env: Env) -> AsyncIterator[list[str]]:
    """The test's namespace and the driver's DeviceClasses (shared by the session); the test's ResourceSlices and
    DeviceTaintRules are removed at its end (they are cluster-scoped)."""
    await ensure_ns(env.kube, env.namespace)
    await ensure_nvidia_device_classes(env.kube)
    published: list[str] = []
    yield published
    for node in env.nodes:
        rules = await td.node_rules(env.kube, node) or []
        await td.delete_rules(env.kube, [r["metadata"]["name"] for r in rules])
    for name in published:
        with contextlib.suppress(Exception):
            await env.kube.delete_cluster_object(*RESOURCE, "resourceslices", name)


def policy(action: str) -> PolicySet:
    return load_yaml_text(
        "kind: RescuePolicy\nmetadata: {name: per-gpu}\nspec:\n  rules:\n"
        f"  - {{name: per-gpu, priority: 10, codes: [{CODE}], actions: [{action}]}}\n"
    )


async def dra_node(
    env: Env, slices: list[str], mig: dict[int, list[tuple[Any, int]]] | None = None
) -> tuple[str, dict[str, str]]:
    """A KWOK node of eight H100s whose DRA driver published them; (node, device name -> PCI address)."""
    (node,) = await env.make_nodes(1)
    body = nvidia_dra_slice(node, mig=mig)
    await env.kube.create_cluster_object(*RESOURCE, "resourceslices", body)
    slices.append(body["metadata"]["name"])
    return node, {d["name"]: d["attributes"]["resource.kubernetes.io/pciBusID"]["string"]
                  for d in body["spec"]["devices"]}


async def claim_template(env: Env, name: str, device_class: str, pci: str | None = None) -> None:
    """A ResourceClaimTemplate of one device of ``device_class`` (at ``pci`` when given), as a user writes it."""
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if pci:
        exactly["selectors"] = [{"cel": {"expression": f"device.attributes['resource.kubernetes.io'].pciBusID == "
                                                        f"'{pci}'"}}]
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": name},
            "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}}}
    await env.kube._call(env.kube.custom.create_namespaced_custom_object, *RESOURCE, env.namespace,
                         "resourceclaimtemplates", body)


async def held(env: Env, labels: dict[str, str] | None = None) -> dict[str, tuple[str, set[str]]]:
    """Pod name -> (uid, the devices its claims were allocated), for the running pods of the namespace."""
    pods = [p for p in await list_pods(env.kube, env.namespace, labels or {})
            if not p["metadata"].get("deletionTimestamp")]
    found = await claims.read_claims(env.kube, pods)
    return {p["metadata"]["name"]: (p["metadata"]["uid"], {d for _, _, d in workload.pod_devices(p, found)})
            for p in pods}


async def victim_and_neighbours(env: Env, node: str, neighbours: int) -> tuple[str, dict[str, Any], str]:
    """A one-replica Deployment ``victim`` and ``neighbours`` replicas of ``neighbour``, one GPU claim each, on the
    node; (the victim pod, what every pod holds, the victim's device)."""
    ns, kube = env.namespace, env.kube
    await claim_template(env, "one-gpu", "gpu.nvidia.com")
    (victim,) = await deployment(kube, ns, "victim", node, 1, {"app": "victim"}, claim_templates=("one-gpu",))
    await deployment(kube, ns, "neighbour", node, neighbours, {"app": "neighbour"}, claim_templates=("one-gpu",))
    before = await held(env)
    (device,) = before[victim][1]
    return victim, before, device


class Watch:
    """What happened to the node's pods and the DeviceTaintRules, each change with the moment it was seen."""

    def __init__(self, env: Env, node: str) -> None:
        self.env, self.node = env, node
        self.pods: list[tuple[float, str, dict[str, Any]]] = []
        self.rules: list[tuple[float, str, dict[str, Any]]] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Watch:
        page = await self.env.kube.list_pods_on_node_page(self.node)
        rv = page["metadata"]["resourceVersion"]
        self.tasks.append(asyncio.ensure_future(self._follow(self.env.kube.watch_pods_on_node(self.node, rv, 600),
                                                             self.pods)))
        rules = await self.env.kube.list_cluster_objects_page(td.GROUP, td.RULE_VERSION, td.RULES)
        events = self.env.kube.watch_cluster_objects(td.GROUP, td.RULE_VERSION, td.RULES,
                                                     rules["metadata"]["resourceVersion"], timeout_seconds=600)
        self.tasks.append(asyncio.ensure_future(self._follow(events, self.rules)))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    @staticmethod
    async def _follow(events: AsyncIterator[dict[str, Any]], into: list[tuple[float, str, dict[str, Any]]]) -> None:
        async with contextlib.aclosing(events) as stream:
            async for event in stream:
                if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                    into.append((time.monotonic(), event["type"], event["object"]))

    def gone_at(self, uid: str) -> float | None:
        """When the pod was first seen going (a deletion timestamp) or gone."""
        for at, kind, pod in self.pods:
            if pod["metadata"]["uid"] == uid and (kind == "DELETED" or pod["metadata"].get("deletionTimestamp")):
                return at
        return None

    def disrupted_by(self, uid: str) -> str | None:
        """The reason of the DisruptionTarget condition Kubernetes wrote on the pod before it went."""
        for _, _, pod in self.pods:
            if pod["metadata"]["uid"] == uid:
                for cond in (pod.get("status") or {}).get("conditions") or []:
                    if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
                        return cond.get("reason")
        return None

    def rule_added_at(self) -> float | None:
        node = td.node_label_value(self.node)
        return next((at for at, kind, rule in self.rules
                     if kind == "ADDED" and rule["metadata"].get("labels", {}).get(td.NODE_LABEL) == node), None)


def record_timings(case: str, **values: float) -> None:
    print(f"[{case}] " + ", ".join(f"{k}={v:.3f}" for k, v in values.items()))
    if path := os.environ.get("XIDFLOW_GPU_QUARANTINE_TIMINGS"):
        with Path(path).open("a") as fh:
            fh.write(json.dumps({"case": case, **{k: round(v, 3) for k, v in values.items()}}) + "\n")


async def rules_of(env: Env, node: str) -> list[dict[str, Any]]:
    rules = await td.node_rules(env.kube, node)
    assert rules is not None, "the local API server must serve DeviceTaintRule (pipeline/localinfra)"
    return rules


def steps_of(records: list[Any], node: str) -> list[str]:
    return [r.action for r in records if r.node == node and r.action not in ("decide", "resume")]


def record_of(records: list[Any], node: str, action: str) -> Any:
    found = [r for r in records if r.node == node and r.action == action]
    assert found, f"no {action} record for {node}: {[(r.action, r.outcome) for r in records if r.node == node]}"
    return found[-1]


async def test_by_default_the_gpu_is_kept_free_and_its_pods_leave_through_xidflows_drain(
    env: Env, slices: list[str], kubeconfig: str, tmp_path: Path
) -> None:
    node, pcis = await dra_node(env, slices)
    ns, kube = env.namespace, env.kube
    await claim_template(env, "one-gpu", "gpu.nvidia.com")
    await statefulset(kube, ns, "trainer", node, 2, {"app": "trainer"}, claim_templates=("one-gpu",))
    await deployment(kube, ns, "other", node, 1, {"app": "other"}, claim_templates=("one-gpu",))
    await deployment(kube, ns, "web", node, 1, {"app": "web"})
    before = await held(env)
    victim_uid, (device,) = before["trainer-1"]
    # A budget that allows no disruption of the trainers: the drain must wait for it.
    assert (await pdb(kube, ns, "trainer", {"app": "trainer"}, min_available=2))["disruptionsAllowed"] == 0
    act = await env.actuator(policy("{name: quarantine, perGpu: true, checkpointGrace: 60s}"))
    async with Watch(env, node) as watch:
        with jobs(Job(kubeconfig, ns, "trainer-0", tmp_path / "j0.log", "--save-seconds", "1"),
                  Job(kubeconfig, ns, "trainer-1", tmp_path / "j1.log", "--save-seconds", "1")) as (j0, j1):
            await j0.wait_for("ready")
            await j1.wait_for("ready")
            started = time.monotonic()
            handling = asyncio.ensure_future(act.engine.handle(gpu_incident(node, "inc-gpu", pcis[device], CODE)))
            await j1.wait_for("answered")
            answered = time.monotonic()
            (rule,) = await rules_of(env, node)
            assert rule["spec"]["taint"]["effect"] == "NoSchedule"
            assert rule["spec"]["deviceSelector"] == {"driver": "gpu.nvidia.com", "pool": node, "device": device}
            # The checkpoint is saved; the budget still allows nothing: the holder stays, the drain keeps asking.
            await asyncio.sleep(4)
            assert not handling.done() and watch.gone_at(victim_uid) is None
            await set_pdb_min_available(kube, ns, "trainer", 1)
            relaxed = time.monotonic()
            await asyncio.wait_for(handling, 90)
            assert "requested" not in j0.moments(), "the trainer on another GPU was asked for a checkpoint"
        gone = watch.gone_at(victim_uid)
        assert gone is not None and gone > relaxed
        assert watch.disrupted_by(victim_uid) == BY_XIDFLOW
        records = await env.audit()
        drain = record_of(records, node, "drain")
        assert drain.outcome == Outcome.APPLIED, drain.reason
        assert drain.details["evicted"] == [f"{ns}/trainer-1"]
        assert drain.details["holders"] == [f"{ns}/trainer-1"]
        assert drain.details["checkpoint"]["result"] == "answered"
        assert drain.details["gpu_devices"] == [f"gpu.nvidia.com/{node}/{device}"]
        # The pods on the node's other GPUs and the pod without a GPU were never touched.
        after = await held(env)
        for name in ("trainer-0", *[n for n in before if n.startswith(("other-", "web-"))]):
            assert after[name][0] == before[name][0], f"{name} was replaced"
            assert watch.gone_at(before[name][0]) is None
        # The StatefulSet's new trainer-1 got a new claim, allocated by the scheduler on another GPU of the node.
        await wait_running(kube, ns, {"app": "trainer"}, 2, node)
        new_uid, (new_device,) = (await held(env, {"app": "trainer"}))["trainer-1"]
        assert new_uid != victim_uid and new_device != device
        assert not (await env.node(node))["spec"].get("unschedulable")
    record_timings("default", incident_to_answer_s=answered - started, budget_relaxed_to_evicted_s=gone - relaxed,
                   incident_to_evicted_s=gone - started)


async def test_no_execute_is_a_direct_delete_by_kubernetes_past_the_budget(env: Env, slices: list[str]) -> None:
    node, pcis = await dra_node(env, slices)
    ns, kube = env.namespace, env.kube
    victim, before, device = await victim_and_neighbours(env, node, 2)
    victim_uid = before[victim][0]
    assert (await pdb(kube, ns, "victim", {"app": "victim"}, min_available=1))["disruptionsAllowed"] == 0
    act = await env.actuator(policy("{name: quarantine, perGpu: true, effect: NoExecute}"))
    async with Watch(env, node) as watch:
        started = time.monotonic()
        await act.engine.handle(gpu_incident(node, "inc-noexec", pcis[device], CODE))
        async def deleted() -> bool:
            return watch.gone_at(victim_uid) is not None

        await wait_until(deleted, 30, poll=0.05, what="the holder deleted")
        gone = watch.gone_at(victim_uid)
        added = watch.rule_added_at()
        assert gone is not None and added is not None
        assert watch.disrupted_by(victim_uid) == BY_DEVICE_TAINT_CONTROLLER
        # No drain step: the plan leaves it to Kubernetes, and nobody asked the Eviction API.
        assert "drain" not in steps_of(await env.audit(), node)
        await wait_running(kube, ns, {"app": "victim"}, 1, node)
        after = await held(env)
        for name in (n for n in before if n.startswith("neighbour-")):
            assert after[name][0] == before[name][0] and watch.gone_at(before[name][0]) is None
        (replacement,) = [n for n in after if n.startswith("victim-")]
        assert device not in after[replacement][1]  # NoExecute keeps new claims off the GPU too
    (rule,) = await rules_of(env, node)
    assert rule["spec"]["taint"]["effect"] == "NoExecute"
    record_timings("no-execute", rule_to_deleted_s=gone - added, incident_to_deleted_s=gone - started)


async def test_effect_none_is_a_dry_run_that_the_rules_status_explains(env: Env, slices: list[str]) -> None:
    node, pcis = await dra_node(env, slices)
    ns, kube = env.namespace, env.kube
    victim, before, device = await victim_and_neighbours(env, node, 1)
    act = await env.actuator(policy("{name: quarantine, perGpu: true, effect: None}"))
    async with Watch(env, node) as watch:
        await act.engine.handle(gpu_incident(node, "inc-dry", pcis[device], CODE))
        (rule,) = await rules_of(env, node)
        assert rule["spec"]["taint"]["effect"] == "None"

        seen: list[dict[str, Any]] = []

        async def explained() -> bool:
            found = await env.kube.get_cluster_object(td.GROUP, td.RULE_VERSION, td.RULES, rule["metadata"]["name"])
            seen[:] = [c for c in (found.get("status") or {}).get("conditions") or []
                       if c["type"] == "EvictionInProgress"]
            return bool(seen)

        await wait_until(explained, 60, poll=0.2, what="the dry run's status")
        (condition,) = seen
        print(f"DeviceTaintRule status: {condition['reason']}: {condition['message']}")
        assert condition["reason"] == "NoEffect" and condition["status"] == "False"
        assert "1 allocated device selected" in condition["message"]
        assert "1 pod would be evicted in 1 namespace if the effect was NoExecute" in condition["message"]
        await asyncio.sleep(2)  # the controller has looked at the pods; nothing may happen to them
        assert await held(env) == before
        assert not watch.gone_at(before[victim][0])
    records = await env.audit()
    assert "drain" not in steps_of(records, node)
    assert "dry run" in record_of(records, node, "taintDevice").reason
    assert not (await env.node(node))["spec"].get("unschedulable")
    # Nothing is kept off the GPU either: once its holder is gone, a claim asking for that very GPU gets it.
    apps = client.AppsV1Api(kube.api_client)
    await kube._call(apps.patch_namespaced_deployment, "victim", ns, {"spec": {"replicas": 0}})
    await wait_until(lambda: _no_pods(env, {"app": "victim"}), 30, what="the holder gone")
    await claim_template(env, "that-gpu", "gpu.nvidia.com", pcis[device])
    (pinned,) = await deployment(kube, ns, "pinned", node, 1, {"app": "pinned"}, claim_templates=("that-gpu",))
    assert (await held(env, {"app": "pinned"}))[pinned][1] == {device}


async def _no_pods(env: Env, labels: dict[str, str]) -> bool:
    return not await list_pods(env.kube, env.namespace, labels)


async def test_a_mig_fault_takes_the_whole_gpus_mig_devices_and_only_their_pods(env: Env, slices: list[str]) -> None:
    faulty, other = 3, 5
    mig = {faulty: [(MIG_1G_10GB, start) for start in range(7)], other: [(MIG_1G_10GB, 0), (MIG_1G_10GB, 1)]}
    node, _ = await dra_node(env, slices, mig)
    ns, kube = env.namespace, env.kube
    await claim_template(env, "mig-here", "mig.nvidia.com", H100_PCI[faulty])
    await claim_template(env, "mig-there", "mig.nvidia.com", H100_PCI[other])
    await claim_template(env, "one-gpu", "gpu.nvidia.com")
    await deployment(kube, ns, "here", node, 2, {"app": "here"}, claim_templates=("mig-here",))
    await deployment(kube, ns, "there", node, 1, {"app": "there"}, claim_templates=("mig-there",))
    await deployment(kube, ns, "full", node, 1, {"app": "full"}, claim_templates=("one-gpu",))
    before = await held(env)
    on_faulty = sorted(n for n, (_, devices) in before.items()
                       if devices and all(d.startswith(f"gpu-{faulty}-mig-") for d in devices))
    assert len(on_faulty) == 2 and all(n.startswith("here-") for n in on_faulty)
    act = await env.actuator(policy("{name: quarantine, perGpu: true}"))
    incident = gpu_incident(node, "inc-mig", H100_PCI[faulty], CODE).model_copy(update={"gpu_instance": 1})
    async with Watch(env, node) as watch:
        await act.engine.handle(incident)
        rules = await rules_of(env, node)
        # NVIDIA's driver publishes no GPU-instance id on its MIG devices: the GPU's seven MIG devices are tainted.
        assert sorted(r["spec"]["deviceSelector"]["device"] for r in rules) == sorted(
            f"gpu-{faulty}-mig-1g10gb-19-{start}" for start in range(7))
        records = await env.audit()
        assert "no device publishes gpuInstanceId=1: the whole GPU" in record_of(records, node, "taintDevice").reason
        drain = record_of(records, node, "drain")
        assert sorted(drain.details["evicted"]) == [f"{ns}/{n}" for n in on_faulty]
        for name in on_faulty:
            assert watch.disrupted_by(before[name][0]) == BY_XIDFLOW
        after = await held(env)
        for name in (n for n in before if not n.startswith("here-")):
            assert after[name][0] == before[name][0], f"{name} was replaced"

    # The replacements' claims can only be met by the tainted GPU: the scheduler leaves them unplaced.
    async def unplaceable() -> bool:
        pods = [p for p in await list_pods(kube, ns, {"app": "here"}) if not p["metadata"].get("deletionTimestamp")]
        return len(pods) == 2 and all(
            any(c["type"] == "PodScheduled" and c["status"] == "False" and c.get("reason") == "Unschedulable"
                for c in (p.get("status") or {}).get("conditions") or []) for p in pods)

    await wait_until(unplaceable, 60, poll=0.5, what="the replacements reported unschedulable")
