"""The pure part of notifyWorkload: owners from ownerReferences, DRA allocations matched to the PCI id."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pipeline.actuator import dra, workload
from pipeline.actuator.actions import ACTION_NAMES
from pipeline.actuator.testing import make_incident
from schemas.records import FaultKind

GPU = {"limits": {"nvidia.com/gpu": "8"}}


def ref(kind: str, name: str, api: str, controller: bool = True) -> dict[str, Any]:
    return {"apiVersion": api, "kind": kind, "name": name, "uid": f"uid-{name}", "controller": controller}


def pod(name: str, *owners: dict[str, Any], ns: str = "team", resources: dict | None = None,
        claims: list[str] = (), phase: str = "Running") -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeName": "gpu-1", "containers": [{"name": "c", "resources": resources or {}}]}
    if claims:
        spec["resourceClaims"] = [{"name": f"gpu{i}", "resourceClaimTemplateName": "t"} for i, _ in enumerate(claims)]
    status = {"phase": phase,
              "resourceClaimStatuses": [{"name": f"gpu{i}", "resourceClaimName": c} for i, c in enumerate(claims)]}
    return {"metadata": {"namespace": ns, "name": name, "ownerReferences": list(owners)}, "spec": spec,
            "status": status}


def owned_by(kind: str, name: str, api: str) -> dict[str, Any]:
    return {"metadata": {"ownerReferences": [ref(kind, name, api)]}}


def slice_(driver: str, pool: str, devices: dict[str, str], v1beta1: bool = False) -> dict[str, Any]:
    def dev(name: str, pci: str) -> dict[str, Any]:
        attrs = {dra.PCI_ATTRIBUTE: {"string": pci}, "index": {"int": 0}}
        return {"name": name, "basic": {"attributes": attrs}} if v1beta1 else {"name": name, "attributes": attrs}

    return {"spec": {"driver": driver, "pool": {"name": pool}, "nodeName": "gpu-1",
                     "devices": [dev(n, p) for n, p in devices.items()]}}


def claim(*devices: tuple[str, str, str]) -> dict[str, Any]:
    results = [{"request": "gpu", "driver": d, "pool": p, "device": n} for d, p, n in devices]
    return {"status": {"allocation": {"devices": {"results": results}}}}


def test_owners_are_followed_one_step_through_replicasets_and_jobs_only() -> None:
    pods = [
        pod("web-1", ref("ReplicaSet", "web-5d8f", "apps/v1"), resources=GPU),
        pod("train-0", ref("Job", "train-worker-0", "batch/v1"), resources=GPU),
        pod("nightly", ref("Job", "nightly-2911", "batch/v1")),
        pod("ptj-master-0", ref("PyTorchJob", "ptj", "kubeflow.org/v1")),
        pod("bare"),
        pod("orphan-rs", ref("ReplicaSet", "gone", "apps/v1")),
    ]
    assert workload.owners_to_read(pods) == {
        ("team", "ReplicaSet", "web-5d8f"), ("team", "Job", "train-worker-0"), ("team", "Job", "nightly-2911"),
        ("team", "ReplicaSet", "gone"),
    }
    read = {
        ("team", "ReplicaSet", "web-5d8f"): owned_by("Deployment", "web", "apps/v1"),
        ("team", "Job", "train-worker-0"): owned_by("JobSet", "train", "jobset.x-k8s.io/v1alpha2"),
        ("team", "Job", "nightly-2911"): owned_by("CronJob", "nightly", "batch/v1"),
    }
    tops = {workload.pod_key(p)[1]: workload.top_owner(p, read) for p in pods}
    assert {k: (o.kind, o.name) if o else None for k, o in tops.items()} == {
        "web-1": ("Deployment", "web"),
        "train-0": ("JobSet", "train"),
        "nightly": ("CronJob", "nightly"),
        "ptj-master-0": ("PyTorchJob", "ptj"),  # a custom kind is reported as named, never read
        "bare": None,
        "orphan-rs": ("ReplicaSet", "gone"),  # could not be read: reported as found
    }
    # a Job with no owner of its own is the top
    assert workload.top_owner(pods[1], {("team", "Job", "train-worker-0"): {"metadata": {}}}).kind == "Job"


def test_the_controller_reference_wins_over_other_owners() -> None:
    p = pod("p", ref("ConfigMap", "cm", "v1", controller=False), ref("RayCluster", "rc", "ray.io/v1"))
    assert workload.controller_ref(p) == workload.OwnerRef("ray.io/v1", "RayCluster", "rc")
    # a look-alike kind from another group is not followed
    assert not workload.followed(workload.OwnerRef("example.com/v1", "Job", "j"))


def test_devices_are_matched_by_the_standard_pci_attribute_in_either_api_version() -> None:
    slices = [slice_("gpu.nvidia.com", "gpu-1", {"gpu-0": "0000:4E:00.0", "gpu-1": "0000:4f:00.0"}),
              slice_("gpu.nvidia.com", "gpu-1b", {"gpu-7": "0000:4e:00.0"}, v1beta1=True),
              slice_("nic.example.com", "gpu-1", {"nic-0": "0000:10:00.0"})]
    assert workload.devices_with_pci(slices, "0000:4e:00.0") == {
        ("gpu.nvidia.com", "gpu-1", "gpu-0"), ("gpu.nvidia.com", "gpu-1b", "gpu-7")}
    assert workload.devices_with_pci(slices, "4e:00.0") == workload.devices_with_pci(slices, "0000:4e:00.0")
    assert workload.devices_with_pci(slices, "0000:99:00.0") == set()


def test_on_faulty_gpu_is_true_false_or_unknown_and_never_guessed() -> None:
    faulty = {("gpu.nvidia.com", "gpu-1", "gpu-0")}
    claims = {("team", "c-bad"): claim(("gpu.nvidia.com", "gpu-1", "gpu-0")),
              ("team", "c-good"): claim(("gpu.nvidia.com", "gpu-1", "gpu-3")),
              ("team", "c-nic"): claim(("nic.example.com", "gpu-1", "nic-0"))}
    assert workload.on_faulty_gpu(pod("a", claims=["c-bad"]), claims, faulty) is True
    assert workload.on_faulty_gpu(pod("b", claims=["c-good"]), claims, faulty) is False
    assert workload.on_faulty_gpu(pod("c", claims=["c-nic"]), claims, faulty) is None  # no GPU claim seen
    assert workload.on_faulty_gpu(pod("d", resources=GPU), claims, faulty) is None  # device plugin: unknown
    assert workload.on_faulty_gpu(pod("e", claims=["c-good"], resources=GPU), claims, faulty) is None
    assert workload.on_faulty_gpu(pod("f", claims=["unread"]), claims, faulty) is None
    assert workload.on_faulty_gpu(pod("a", claims=["c-bad"]), claims, set()) is None  # faulty GPU unknown


def test_summary_lists_affected_pods_first_caps_the_list_and_counts_the_rest() -> None:
    incident = make_incident("gpu-1", "inc-1")
    faulty = {("gpu.nvidia.com", "gpu-1", "gpu-0")}
    claims = {("team", "c-bad"): claim(("gpu.nvidia.com", "gpu-1", "gpu-0")),
              ("team", "c-good"): claim(("gpu.nvidia.com", "gpu-1", "gpu-3"))}
    pods = [pod(f"cpu-{i}") for i in range(5)] + [
        pod("z-on-bad", claims=["c-bad"]), pod("y-on-good", claims=["c-good"]), pod("x-plugin", resources=GPU),
        pod("w-done", resources=GPU, phase="Succeeded")]
    summary, affected = workload.summarize(incident, pods, {}, faulty, claims, None, cap=3)
    assert [workload.pod_key(p)[1] for p in affected] == ["x-plugin", "z-on-bad"]
    assert summary.gpu_attribution == "dra" and summary.unknown_reason is None and summary.pci == "0000:4e:00.0"
    assert (summary.total, summary.affected, summary.omitted) == (9, 2, 6)
    assert [(p.name, p.on_faulty_gpu, p.affected) for p in summary.pods] == [
        ("x-plugin", None, True), ("z-on-bad", True, True), ("cpu-0", None, False)]

    unknown, affected = workload.summarize(incident, pods, {}, set(), claims, "the incident names no PCI address")
    assert unknown.gpu_attribution == "unknown" and unknown.unknown_reason == "the incident names no PCI address"
    # unknown GPU: every running pod that uses a GPU is affected, CPU-only and finished pods are not
    assert sorted(workload.pod_key(p)[1] for p in affected) == ["x-plugin", "y-on-good", "z-on-bad"]


def test_condition_reason_names_the_fault_and_existing_condition_is_seen() -> None:
    assert workload.fault_reason(make_incident("n", "i", code=79)) == "Xid79"
    assert workload.fault_reason(make_incident("n", "i", code=48)) == "Xid48"
    assert workload.fault_reason(make_incident("n", "i", code=24007, kind=FaultKind.SXID)) == "SXid24007"
    assert workload.fault_reason(make_incident("n", "i", kind=FaultKind.GPU_FALLEN_OFF_BUS)) == "Xid79"
    p = pod("p")
    assert not workload.has_condition(p, "Xid79")
    p["status"]["conditions"] = [{"type": workload.GPU_FAULT_CONDITION, "status": "True", "reason": "Xid79"}]
    assert workload.has_condition(p, "Xid79") and not workload.has_condition(p, "Xid48")
    msg = workload.fault_message(make_incident("gpu-1", "inc-1"), True)
    assert "xid 79" in msg and "0000:4e:00.0" in msg and "allocated the faulty GPU" in msg


def test_the_rescuepolicy_crd_accepts_every_registered_action() -> None:
    root = Path(__file__).resolve().parents[2]
    for path in (root / "deploy" / "crds" / "rescuepolicies.xidflow.dev.yaml",
                 root / "deploy" / "helm" / "xidflow" / "crds" / "rescuepolicies.xidflow.dev.yaml"):
        text = path.read_text()
        crd = yaml.safe_load(text)
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        rules = schema["properties"]["spec"]["properties"]["rules"]["items"]
        enum = rules["properties"]["actions"]["items"]["properties"]["name"]["enum"]
        assert set(enum) == set(ACTION_NAMES), path
