"""Problem class of an incident: which NodeCondition, Event reason and taint value describe it.

Node-repair tools (Karpenter node repair, draino-style controllers) watch conditions by type, so
the classes are coarse and stable: GpuXid, GpuSXid, GpuEcc, GpuNvlink, GpuCount, GpuFellOffBus. Each
is present on every GPU node, ``False`` with its healthy reason (``HEALTHY``) while no such fault is
open, as node-problem-detector's conditions are (``baseline_conditions``).

Which class a code belongs to is the catalog's ``problem`` column (``Catalog.problem``), read from
the configured catalog (built-in file plus ``XIDFLOW_CATALOG_OVERRIDES``): nothing about a code is
decided here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pipeline.detection.catalog import Catalog
from schemas.records import FaultKind, NodeIncident


class ProblemClass(StrEnum):
    XID = "GpuXid"
    SXID = "GpuSXid"
    ECC = "GpuEcc"
    NVLINK = "GpuNvlink"
    COUNT = "GpuCount"
    FELL_OFF_BUS = "GpuFellOffBus"


_CLASS_BY_PROBLEM = {
    "xid": ProblemClass.XID,
    "sxid": ProblemClass.SXID,
    "ecc": ProblemClass.ECC,
    "nvlink": ProblemClass.NVLINK,
    "count": ProblemClass.COUNT,
    "fell_off_bus": ProblemClass.FELL_OFF_BUS,
}

HEALTHY: dict[ProblemClass, tuple[str, str]] = {
    ProblemClass.XID: ("NoGpuXid", "xidflow has no open GPU Xid fault on this node"),
    ProblemClass.SXID: ("NoGpuSXid", "xidflow has no open NVSwitch SXid fault on this node"),
    ProblemClass.ECC: ("NoGpuEccError", "xidflow has no open GPU memory (ECC) fault on this node"),
    ProblemClass.NVLINK: ("NoGpuNvlinkError", "xidflow has no open NVLink fault on this node"),
    ProblemClass.COUNT: ("GpuCountAsExpected", "xidflow has no open missing-GPU fault on this node"),
    ProblemClass.FELL_OFF_BUS: ("NoGpuFellOffBus", "xidflow has no open fallen-off-the-bus fault on this node"),
}
"""Reason and message of each own condition while healthy (status False)."""
OWN_CONDITION_TYPES: frozenset[str] = frozenset(str(c) for c in ProblemClass)


@dataclass(frozen=True)
class Problem:
    condition_type: ProblemClass
    event_reason: str
    taint_value: str


def classify_incident(incident: NodeIncident, catalog: Catalog | None = None) -> Problem:
    """The condition type, Event reason and taint value for an incident."""
    catalog = catalog or Catalog.configured()
    code = incident.code
    sig = incident.signature.lower()
    if incident.kind == FaultKind.SXID:
        return Problem(ProblemClass.SXID, "SXidError", f"sxid-{code}" if code is not None else "sxid")
    if incident.kind == FaultKind.GPU_FALLEN_OFF_BUS:
        cls = _CLASS_BY_PROBLEM.get(catalog.problem(incident.kind.value, code), ProblemClass.XID)
        return Problem(cls, "GpuFallenOffBus", "fallen-off-bus")
    if incident.kind == FaultKind.HEALTH_CHECK:
        # signature: health_check:<check>:<gpu>
        check = incident.signature.split(":", 2)[1] if incident.signature.count(":") >= 1 else ""
        cls = _CLASS_BY_PROBLEM.get(catalog.health_problem(check), ProblemClass.XID)
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
    cls = _CLASS_BY_PROBLEM.get(catalog.problem("xid", code), ProblemClass.XID)
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
