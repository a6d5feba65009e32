"""notifyWorkload on the session's control plane: pods placed on a KWOK node by the scheduler, owned by a
Deployment (through its ReplicaSet), a Job owned by a JobSet, and a PyTorchJob; DRA claims allocated by the
scheduler from a ResourceSlice published as the NVIDIA DRA driver publishes it; the example Job with a
podFailurePolicy on the GPU-fault condition.

JobSet and PyTorchJob are kinds this API server does not serve (their operators are not installed): the
objects they would create (a Job, a pod) are created here with their owner reference, as those operators
do, and the garbage collector leaves them alone (it cannot resolve the owner's kind).

Left for a test with a Job that fails: that the Job controller ignores the failure of a pod carrying the
condition. These prove the API server accepts the condition on the pod and the policy on the Job, and that
the condition is written where the policy looks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from pipeline.actuator.dra import PCI_ATTRIBUTE
from pipeline.actuator.kube import Invalid, Kube
from pipeline.actuator.machines import ensure_nvidia_device_classes, hostname, nvidia_gpu_device
from pipeline.actuator.ownership import LEDGER_ANNOTATION
from pipeline.actuator.testing import make_incident, object_events
from pipeline.actuator.workload import EVENT_REASON, GPU_FAULT_CONDITION
from pipeline.kafka.admin import ensure_topics
from schemas.records import Outcome, RemediationRecord
from tests.integration.test_actuator_effects import Env
from tests.integration.workloads import HOSTNAME, deployment, job_body, wait_running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

EXAMPLE_JOB = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "gpu-job-pod-failure-policy.yaml"
GPU = {"limits": {"nvidia.com/gpu": "1"}}
DRIVER = "gpu.nvidia.com"


@pytest.fixture
async def env(kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]) -> AsyncIterator[Env]:
    world = Env(kafka_bootstrap, kubeconfig, unique)
    await ensure_topics(kafka_bootstrap, [world.topics.name("remediation_audit")], partitions=1)
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": world.namespace}}
    await world.kube._call(world.kube.core.create_namespace, namespace)
    yield world
    await world.close()


def foreign(api: str, kind: str, name: str) -> dict[str, Any]:
    """An owner of a kind this API server does not know (a CRD's object): named, never read."""
    return {"apiVersion": api, "kind": kind, "name": name, "uid": f"00000000-0000-0000-0000-{name[:12]:0>12}",
            "controller": True}


async def create(kube: Kube, group: str, version: str, namespace: str, plural: str, body: dict[str, Any]) -> dict:
    return await kube._call(kube.custom.create_namespaced_custom_object, group, version, namespace, plural, body)


async def make_pod(kube: Kube, ns: str, node: str, name: str, owners: list[dict[str, Any]],
                   resources: dict[str, Any] | None = None, claims: list[str] = ()) -> None:
    """A pod created directly (by a person, or an operator of a kind with ``owners``), placed on ``node`` by the
    scheduler (its node selector) and run by KWOK; returns once it runs."""
    spec: dict[str, Any] = {"nodeSelector": {HOSTNAME: hostname(node)}, "restartPolicy": "Never",
                            "containers": [{"name": "c", "image": "busybox", "resources": resources or {}}]}
    if claims:
        spec["resourceClaims"] = [{"name": f"gpu{i}", "resourceClaimName": c} for i, c in enumerate(claims)]
        spec["containers"][0]["resources"] = {"claims": [{"name": f"gpu{i}"} for i in range(len(claims))]}
    labels = {"xidflow.test/pod": name}
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns, "labels": labels, "ownerReferences": owners}, "spec": spec}
    await kube._call(kube.core.create_namespaced_pod, ns, body)
    await wait_running(kube, ns, labels, 1, node)


async def pod_events(kube: Kube, ns: str, pod: str) -> list[dict[str, Any]]:
    """xidflow's Events about the pod (the scheduler writes its own: ``Scheduled``)."""
    return await object_events(kube, ns, pod)


async def gpu_condition(kube: Kube, ns: str, pod: str) -> dict[str, Any] | None:
    conditions = ((await kube.get_pod(ns, pod)).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == GPU_FAULT_CONDITION), None)


def workload_records(records: list[RemediationRecord], node: str) -> list[RemediationRecord]:
    return [r for r in records if r.node == node and r.action == "notifyWorkload"]


async def test_quarantine_names_pods_and_owners_and_tells_each_gpu_pod_once(env: Env) -> None:
    (node,) = await env.make_nodes(1)
    ns, kube = env.namespace, env.kube
    (web,) = await deployment(kube, ns, "web", node, 1, {"app": "web"}, gpus=1)
    train = job_body(ns, "train-worker-0", node, {"job": "train-worker-0"}, complete=False, gpus=1)
    train["metadata"]["ownerReferences"] = [foreign("jobset.x-k8s.io/v1alpha2", "JobSet", "train")]
    await kube.create_job(ns, train)
    (worker,) = await wait_running(kube, ns, {"job": "train-worker-0"}, 1, node)
    await make_pod(kube, ns, node, "ptj-master-0", [foreign("kubeflow.org/v1", "PyTorchJob", "ptj")], GPU)
    await make_pod(kube, ns, node, "cpu-sidecar", [])  # uses no GPU: listed, not told

    act = await env.actuator()
    incident = make_incident(node, "inc-w")
    await act.engine.handle(incident)

    [record] = workload_records(await env.audit(), node)
    assert record.outcome == Outcome.APPLIED and "workload" not in record.details
    work = record.workload
    assert work is not None and (work.total, work.affected, work.omitted) == (4, 3, 0)
    assert work.gpu_attribution == "unknown" and "device plugin" in (work.unknown_reason or "")
    found = {p.name: ((p.owner.kind, p.owner.name) if p.owner else None, p.on_faulty_gpu, p.affected)
             for p in work.pods}
    assert found == {
        web: (("Deployment", "web"), None, True),
        worker: (("JobSet", "train"), None, True),
        "ptj-master-0": (("PyTorchJob", "ptj"), None, True),
        "cpu-sidecar": (None, None, False),
    }
    for pod in (web, worker, "ptj-master-0"):
        [event] = await pod_events(kube, ns, pod)
        assert event["type"] == "Warning" and event["reason"] == EVENT_REASON
        assert event["involvedObject"]["kind"] == "Pod" and "xid 79" in event["message"]
        cond = await gpu_condition(kube, ns, pod)
        assert cond and cond["status"] == "True" and cond["reason"] == "Xid79"
    assert await pod_events(kube, ns, "cpu-sidecar") == []
    assert await gpu_condition(kube, ns, "cpu-sidecar") is None

    # Redelivery: the ledger says done; the record still names the workload, nothing is written again.
    await act.engine.handle(incident)
    # And with the ledger gone (a replica died between the effects and the done mark): deterministic
    # Event names and the condition already present leave the pods as they were.
    await kube.patch_node(node, {"metadata": {"annotations": {LEDGER_ANNOTATION: None}}})
    rv = (await kube.get_pod(ns, "ptj-master-0"))["metadata"]["resourceVersion"]
    await act.engine.handle(incident)
    for pod in (web, worker, "ptj-master-0"):
        assert len(await pod_events(kube, ns, pod)) == 1
    assert (await kube.get_pod(ns, "ptj-master-0"))["metadata"]["resourceVersion"] == rv
    again = workload_records(await env.audit(), node)
    assert [r.outcome for r in again] == [Outcome.APPLIED, Outcome.ALREADY_APPLIED, Outcome.ALREADY_APPLIED]
    assert all(r.workload is not None and r.workload.affected == 3 for r in again)


async def dra_served(kube: Kube) -> bool:
    groups = await kube._call(client.ApisApi(kube.api_client).get_api_versions)
    return any(g["name"] == "resource.k8s.io" and any(v["version"] == "v1" for v in g["versions"])
               for g in (groups or {}).get("groups", []))


async def test_with_dra_only_the_pod_holding_the_faulty_gpu_is_told(env: Env) -> None:
    kube, ns = env.kube, env.namespace
    # resource.k8s.io/v1 is served by default since Kubernetes 1.34 (DRA GA): no feature gate needed.
    assert await dra_served(kube), "the local kube-apiserver does not serve resource.k8s.io/v1"
    (node,) = await env.make_nodes(1)
    pool = env.unique("pool")
    await ensure_nvidia_device_classes(kube)
    slice_body = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{node}-gpus"},
        "spec": {"driver": DRIVER, "nodeName": node, "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
                 "devices": [nvidia_gpu_device(node, i, pci)
                             for i, pci in enumerate(["0000:4e:00.0", "0000:4f:00.0"])]},
    }
    await kube._call(kube.custom.create_cluster_custom_object, "resource.k8s.io", "v1", "resourceslices", slice_body)
    try:
        domain, attribute = PCI_ATTRIBUTE.split("/")
        for claim, pci in (("claim-bad", "0000:4e:00.0"), ("claim-good", "0000:4f:00.0")):
            # The user asks for a GPU at that PCI address; the scheduler allocates it when it places the pod.
            cel = f'device.attributes["{domain}"].{attribute} == "{pci}"'
            await create(kube, "resource.k8s.io", "v1", ns, "resourceclaims", {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": claim},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": DRIVER, "selectors": [{"cel": {"expression": cel}}]}}]}}})
        await make_pod(kube, ns, node, "on-bad", [], claims=["claim-bad"])
        await make_pod(kube, ns, node, "on-good", [], claims=["claim-good"])
        for claim, device in (("claim-bad", "gpu-0"), ("claim-good", "gpu-1")):
            allocated = await kube.get_namespaced_object("resource.k8s.io", "v1", ns, "resourceclaims", claim)
            results = allocated["status"]["allocation"]["devices"]["results"]
            assert [(r["driver"], r["pool"], r["device"]) for r in results] == [(DRIVER, pool, device)]

        act = await env.actuator()
        await act.engine.handle(make_incident(node, "inc-dra"))  # Xid 79 on PCI 0000:4e:00.0

        [record] = workload_records(await env.audit(), node)
        work = record.workload
        assert work is not None and work.gpu_attribution == "dra" and work.unknown_reason is None
        assert {p.name: (p.on_faulty_gpu, p.affected) for p in work.pods} == {
            "on-bad": (True, True), "on-good": (False, False)}
        assert len(await pod_events(kube, ns, "on-bad")) == 1 and await pod_events(kube, ns, "on-good") == []
        cond = await gpu_condition(kube, ns, "on-bad")
        assert cond and cond["reason"] == "Xid79" and "allocated the faulty GPU" in cond["message"]
        assert await gpu_condition(kube, ns, "on-good") is None
    finally:
        await kube._call(kube.custom.delete_cluster_custom_object, "resource.k8s.io", "v1", "resourceslices",
                         f"{node}-gpus")


async def test_the_example_job_and_its_pod_failure_policy_are_accepted(env: Env) -> None:
    kube, ns = env.kube, env.namespace
    node = (await env.make_nodes(1))[0]
    job = yaml.safe_load(EXAMPLE_JOB.read_text())
    # Its 8-GPU pod runs on this test's node (KWOK completes it), not on another test's.
    job["spec"]["template"]["spec"]["nodeSelector"] = {HOSTNAME: hostname(node)}
    created = await kube._call(kube.batch.create_namespaced_job, ns, job)
    rules = created["spec"]["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "Ignore"
    assert rules[0]["onPodConditions"] == [{"type": GPU_FAULT_CONDITION, "status": "True"}]
    # The API server does validate these types (so the acceptance above means something):
    bad = yaml.safe_load(EXAMPLE_JOB.read_text())
    bad["metadata"]["name"] = "bad-type"
    bad["spec"]["podFailurePolicy"]["rules"][0]["onPodConditions"][0]["type"] = "xidflow.dev/GPU Fault!"
    with pytest.raises(Invalid, match="onPodConditions"):
        await kube._call(kube.batch.create_namespaced_job, ns, bad)
    # ... and the same type is accepted as a pod condition through pods/status.
    await make_pod(kube, ns, node, "p", [])
    cond = {"type": GPU_FAULT_CONDITION, "status": "True", "reason": "Xid48", "message": "m"}
    await kube.patch_pod_status(ns, "p", {"status": {"conditions": [cond]}})
    assert (await gpu_condition(kube, ns, "p") or {}).get("reason") == "Xid48"
    with pytest.raises(Invalid, match="conditions"):
        await kube.patch_pod_status(ns, "p", {"status": {"conditions": [{**cond, "type": "xidflow.dev/GPU Fault!"}]}})
