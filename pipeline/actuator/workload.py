"""The workload on a faulty node, from the objects alone. Pure: no API calls here.

Given the node's pods (and the ReplicaSets/Jobs they name, the node's ResourceSlices and the pods'
ResourceClaims, read by ``actions.notify_workload``), it says who owns each pod, which pods are on
the faulty GPU where DRA allocations make that knowable, and which pods are *affected*: they get a
Warning Event and the pod condition ``GPU_FAULT_CONDITION`` so a Job's ``podFailurePolicy`` can
decline to count their failure.

Affected pods:
- with DRA: a pod whose ResourceClaim allocation holds the device whose ``resource.kubernetes.io/pciBusID``
  attribute equals the incident's PCI address (``on_faulty_gpu`` True);
- otherwise (no PCI in the incident, no ResourceSlice device with that PCI, GPUs through the device
  plugin): every pod on the node that uses a GPU (an ``nvidia.com/`` resource or a resource claim),
  since which GPU it uses cannot be known (``on_faulty_gpu`` None);
- never: pods that use no GPU, pods whose DRA GPUs are all other devices of the faulty device's
  driver (``on_faulty_gpu`` False), and pods that already succeeded.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.actuator.dra import find_devices
from schemas.records import FaultKind, NodeIncident, WorkloadOwner, WorkloadPod, WorkloadSummary

GPU_FAULT_CONDITION = "xidflow.dev/GPUFault"
"""Pod condition type written on affected pods (a qualified name: the API server accepts it both as a
pod condition and in a Job's ``podFailurePolicy.rules[].onPodConditions[].type``)."""
EVENT_REASON = "GPUFault"
"""Reason of the Warning Event on each affected pod."""
"""The standard device attribute DRA drivers publish in their ResourceSlices."""
GPU_RESOURCE_PREFIXES = ("nvidia.com/",)
"""Extended resources (device plugin) that mean the pod uses a GPU: nvidia.com/gpu, nvidia.com/mig-*."""
MAX_PODS = 20
"""Pods listed in a record; the rest are counted in ``omitted`` (affected pods listed first)."""

DETAILS_KEY = "workload"
"""Where the step's result carries the summary; the audit moves it to ``RemediationRecord.workload``."""

Key = tuple[str, str, str]
"""(namespace, kind, name) of an object a pod's owner chain names."""
DeviceId = tuple[str, str, str]
"""(driver, pool, device) as a ResourceClaim allocation result and a ResourceSlice name a device."""

OWNER_PATHS: dict[str, tuple[str, str, str]] = {
    "ReplicaSet": ("apps", "v1", "replicasets"),
    "Job": ("batch", "v1", "jobs"),
}
"""Owner kinds worth one GET to find their own controller, and their REST path (group, version, plural).
Nothing else is read: a custom kind (JobSet, PyTorchJob, RayCluster, ...) is reported as named."""


@dataclass(frozen=True)
class OwnerRef:
    api_version: str
    kind: str
    name: str

    def owner(self) -> WorkloadOwner:
        return WorkloadOwner(kind=self.kind, name=self.name, api_version=self.api_version)


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def pod_key(pod: Mapping[str, Any]) -> tuple[str, str]:
    meta = _meta(pod)
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def controller_ref(obj: Mapping[str, Any]) -> OwnerRef | None:
    """The controlling ownerReference (``controller: true``), else the first one, else None."""
    refs = [r for r in _meta(obj).get("ownerReferences") or [] if r.get("kind") and r.get("name")]
    if not refs:
        return None
    ref = next((r for r in refs if r.get("controller")), refs[0])
    return OwnerRef(str(ref.get("apiVersion") or ""), str(ref["kind"]), str(ref["name"]))


def followed(ref: OwnerRef) -> bool:
    """Whether the owner is a built-in kind whose own owner is worth reading (ReplicaSet, Job)."""
    path = OWNER_PATHS.get(ref.kind)
    return path is not None and ref.api_version == f"{path[0]}/{path[1]}"


def owners_to_read(pods: Iterable[Mapping[str, Any]]) -> set[Key]:
    """The ReplicaSets and Jobs the pods name: read them to find their Deployment, JobSet, CronJob, ..."""
    keys: set[Key] = set()
    for pod in pods:
        ref = controller_ref(pod)
        if ref is not None and followed(ref):
            keys.add((pod_key(pod)[0], ref.kind, ref.name))
    return keys


def top_owner(pod: Mapping[str, Any], owners: Mapping[Key, Mapping[str, Any]]) -> WorkloadOwner | None:
    """The pod's top-level owner as ownerReferences say: the ReplicaSet's or Job's own controller when
    it has one (Deployment; JobSet, CronJob, a training operator's kind), else the first owner itself.
    An owner that could not be read (gone, forbidden) is reported as found."""
    ref = controller_ref(pod)
    if ref is None:
        return None
    if followed(ref):
        parent = owners.get((pod_key(pod)[0], ref.kind, ref.name))
        up = controller_ref(parent) if parent is not None else None
        if up is not None:
            return up.owner()
    return ref.owner()


def uses_gpu(pod: Mapping[str, Any]) -> bool:
    spec = pod.get("spec") or {}
    if spec.get("resourceClaims"):
        return True
    for container in (spec.get("containers") or []) + (spec.get("initContainers") or []):
        resources = container.get("resources") or {}
        for names in (resources.get("limits") or {}, resources.get("requests") or {}):
            if any(str(n).startswith(GPU_RESOURCE_PREFIXES) for n in names):
                return True
    return False


def devices_with_pci(slices: Iterable[Mapping[str, Any]], pci: str) -> set[DeviceId]:
    """The ResourceSlice devices whose ``resource.kubernetes.io/pciBusID`` attribute is ``pci``."""
    return {(d.driver, d.pool, d.device) for d in find_devices(slices, pci)}


def pod_claim_names(pod: Mapping[str, Any]) -> list[str]:
    """Names of the ResourceClaims the pod uses: generated ones from its status, direct ones from its spec."""
    names = [s["resourceClaimName"] for s in (pod.get("status") or {}).get("resourceClaimStatuses") or []
             if s.get("resourceClaimName")]
    names += [c["resourceClaimName"] for c in (pod.get("spec") or {}).get("resourceClaims") or []
              if c.get("resourceClaimName")]
    return list(dict.fromkeys(names))


def allocated_devices(claim: Mapping[str, Any]) -> set[DeviceId]:
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    return {(str(r.get("driver") or ""), str(r.get("pool") or ""), str(r.get("device") or "")) for r in results}


def pod_devices(pod: Mapping[str, Any], claims: Mapping[tuple[str, str], Mapping[str, Any]]) -> set[DeviceId]:
    """The DRA devices the pod's ResourceClaims (those in ``claims``) are allocated."""
    namespace = pod_key(pod)[0]
    mine: set[DeviceId] = set()
    for name in pod_claim_names(pod):
        claim = claims.get((namespace, name))
        if claim is not None:
            mine |= allocated_devices(claim)
    return mine


def on_faulty_gpu(
    pod: Mapping[str, Any], claims: Mapping[tuple[str, str], Mapping[str, Any]], faulty: set[DeviceId]
) -> bool | None:
    """True: an allocation of the pod holds the faulty device. False: the pod's devices of that driver
    are all others, and it takes no GPU through the device plugin. None: cannot be known."""
    if not faulty:
        return None
    mine = pod_devices(pod, claims)
    if mine & faulty:
        return True
    drivers = {d for d, _, _ in faulty}
    plugin = uses_gpu({"spec": {**(pod.get("spec") or {}), "resourceClaims": []}})
    if any(d in drivers for d, _, _ in mine) and not plugin:
        return False
    return None


def _affected(pod: Mapping[str, Any], gpu: bool, on_faulty: bool | None) -> bool:
    if (pod.get("status") or {}).get("phase") == "Succeeded":
        return False
    return on_faulty is True or (on_faulty is None and gpu)


def summarize(
    incident: NodeIncident,
    pods: list[Mapping[str, Any]],
    owners: Mapping[Key, Mapping[str, Any]],
    faulty: set[DeviceId],
    claims: Mapping[tuple[str, str], Mapping[str, Any]],
    unknown_reason: str | None,
    cap: int = MAX_PODS,
) -> tuple[WorkloadSummary, list[Mapping[str, Any]]]:
    """The record's summary and the affected pods (all of them, not capped).

    ``faulty`` holds the devices matching the incident's PCI address (empty: unknown, with
    ``unknown_reason`` saying why)."""
    entries: list[WorkloadPod] = []
    affected: list[Mapping[str, Any]] = []
    for pod in sorted(pods, key=pod_key):
        namespace, name = pod_key(pod)
        gpu = uses_gpu(pod)
        on_faulty = on_faulty_gpu(pod, claims, faulty)
        hit = _affected(pod, gpu, on_faulty)
        entries.append(
            WorkloadPod(
                namespace=namespace, name=name, owner=top_owner(pod, owners), uses_gpu=gpu,
                on_faulty_gpu=on_faulty, affected=hit,
            )
        )
        if hit:
            affected.append(pod)
    entries.sort(key=lambda p: not p.affected)  # stable: affected first, each group by namespace/name
    summary = WorkloadSummary(
        pci=incident.pci,
        gpu_attribution="dra" if faulty else "unknown",
        unknown_reason=None if faulty else unknown_reason,
        total=len(entries),
        affected=len(affected),
        omitted=max(0, len(entries) - cap),
        pods=entries[:cap],
    )
    return summary, affected


def fault_reason(incident: NodeIncident) -> str:
    """The pod condition's reason: the GPU fault by name (``Xid79``, ``SXid12``)."""
    code = "" if incident.code is None else str(incident.code)
    match incident.kind:
        case FaultKind.XID:
            return f"Xid{code}"
        case FaultKind.SXID:
            return f"SXid{code}"
        case FaultKind.GPU_FALLEN_OFF_BUS:
            return "Xid79"  # fallen off the bus counts as Xid 79, as in policy rules
        case FaultKind.HEALTH_CHECK:
            return "GPUHealthCheckFailed"
        case FaultKind.POD_ERROR:
            return "GPUPodError"
        case _:
            return "GPUFault"


def fault_message(incident: NodeIncident, on_faulty: bool | None, limit: int = 1024) -> str:
    """Text of the pod's Event and condition: the fault, the GPU, and how the pod is concerned."""
    what = f"{incident.kind.value} {incident.code}" if incident.code is not None else incident.kind.value
    where = f" on GPU {incident.pci}" if incident.pci else ""
    how = (
        "this pod is allocated the faulty GPU" if on_faulty
        else "this pod uses a GPU on the node; which one is not known"
    )
    text = f"GPU fault {what}{where} on node {incident.node} (incident {incident.incident_id}): {how}"
    return text[:limit]


def has_condition(pod: Mapping[str, Any], reason: str) -> bool:
    """The pod already carries our condition, True with this reason: writing it again changes nothing."""
    return any(
        c.get("type") == GPU_FAULT_CONDITION and c.get("status") == "True" and c.get("reason") == reason
        for c in (pod.get("status") or {}).get("conditions") or []
    )
