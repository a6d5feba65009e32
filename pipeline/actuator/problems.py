"""Problem class of an incident: which NodeCondition, Event reason and taint value describe it.

Node-repair tools (Karpenter node repair, draino-style controllers) watch conditions by type, so
the classes are coarse and stable: GpuXid, GpuSXid, GpuEcc, GpuNvlink, GpuCount.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from schemas.records import FaultKind, NodeIncident


class ProblemClass(StrEnum):
    XID = "GpuXid"
    SXID = "GpuSXid"
    ECC = "GpuEcc"
    NVLINK = "GpuNvlink"
    COUNT = "GpuCount"


# Xids whose documented cause is memory (ECC, row remapping, page retirement).
ECC_XIDS = frozenset({48, 63, 64, 92, 94, 95, 140})
# NVLink errors: Xid 74 and the NVLink5 family.
NVLINK_XIDS = frozenset({74, *range(144, 151)})
# A GPU that is gone from the bus lowers the node's GPU count.
COUNT_XIDS = frozenset({79})


@dataclass(frozen=True)
class Problem:
    condition_type: ProblemClass
    event_reason: str
    taint_value: str


def classify_incident(incident: NodeIncident) -> Problem:
    """The condition type, Event reason and taint value for an incident."""
    code = incident.code
    sig = incident.signature.lower()
    if incident.kind == FaultKind.SXID:
        return Problem(ProblemClass.SXID, "SXidError", f"sxid-{code}" if code is not None else "sxid")
    if incident.kind == FaultKind.GPU_FALLEN_OFF_BUS:
        return Problem(ProblemClass.COUNT, "GpuFallenOffBus", "fallen-off-bus")
    if incident.kind == FaultKind.HEALTH_CHECK:
        if "gpu_count" in sig:
            cls = ProblemClass.COUNT
        elif "nvlink" in sig:
            cls = ProblemClass.NVLINK
        elif "ecc" in sig or "remapped" in sig:
            cls = ProblemClass.ECC
        else:
            cls = ProblemClass.XID
        return Problem(cls, "GpuHealthCheckFailed", "health-check")
    if incident.kind == FaultKind.POD_ERROR:
        cls = ProblemClass.XID
        if "ecc" in sig:
            cls = ProblemClass.ECC
        elif "nvlink" in sig:
            cls = ProblemClass.NVLINK
        return Problem(cls, "GpuPodError", "pod-error")
    if incident.kind == FaultKind.KERNEL_SEGFAULT:
        return Problem(ProblemClass.XID, "GpuKernelSegfault", "segfault")
    if code in ECC_XIDS:
        cls = ProblemClass.ECC
    elif code in NVLINK_XIDS:
        cls = ProblemClass.NVLINK
    elif code in COUNT_XIDS:
        cls = ProblemClass.COUNT
    else:
        cls = ProblemClass.XID
    return Problem(cls, "XidError", f"xid-{code}" if code is not None else "xid")


def event_message(incident: NodeIncident, limit: int = 1024) -> str:
    """Human text of the Warning Event: code, PCI address, count and the first log line."""
    what = f"{incident.kind.value} {incident.code}" if incident.code is not None else incident.kind.value
    parts = [what]
    if incident.pci:
        parts.append(f"PCI {incident.pci}")
    if incident.gpu_uuid:
        parts.append(incident.gpu_uuid)
    parts.append(f"count {incident.count}")
    parts.append(f"action {incident.action.value}")
    head = ", ".join(parts)
    msg = f"{head}: {incident.line.strip()}" if incident.line else head
    return msg[:limit]
