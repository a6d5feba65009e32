"""Checkpoint before a drain: which faults allow it, what the pods are asked, when the wait ends. Pure.

A drain with ``checkpointGrace`` first asks every GPU pod it would evict to save a checkpoint, then
evicts when each has answered or the grace is over, whichever comes first
(``pipeline.actuator.actions.drain`` does the I/O). The contract with the workload is two pod
conditions:

- ``xidflow.dev/CheckpointRequested`` (``REQUESTED``), written by the actuator through ``pods/status``:
  status ``True``, reason ``GPUFaultDrainPending``, ``lastTransitionTime`` the moment of the request,
  and a message naming the fault and the deadline (RFC 3339, UTC). The same write resets a
  ``CheckpointDone`` left from an earlier request to ``False``.
- ``xidflow.dev/CheckpointDone`` (``DONE``), written by the workload on its own pod once its checkpoint
  is saved: status ``True`` (any reason). It counts only while the request it answers is current.

The wait is level-triggered: the moment of the request and the deadline are kept in the node's
ledger (flow value ``checkpoint:<step>``) before any pod is asked, so a replica that takes over a
drain whose holder died waits for the same deadline, never a new grace; a request already on a pod
(``lastTransitionTime`` not before that moment) is never written again.

Only faults where the GPU still runs may wait: a GPU that fell off the bus, a fault the catalog
answers with a node reboot (Xid 79, Xid 154 with a reboot recovery action, fabric SXids, ...) or a
missing GPU leaves nothing to checkpoint on. ``rule_error`` refuses such a rule when the policy is
loaded (for the codes and kinds it names); ``gpu_lost`` catches the incident itself at run time (a
rule without codes, Xid 154's recovery action, an escalation), and the drain then starts at once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pipeline.detection.catalog import Catalog
from schemas.records import Action, FaultKind, NodeIncident

REQUESTED = "xidflow.dev/CheckpointRequested"
"""Pod condition the actuator sets True to ask the workload for a checkpoint."""
DONE = "xidflow.dev/CheckpointDone"
"""Pod condition the workload sets True on its own pod once the checkpoint is saved."""
REQUEST_REASON = "GPUFaultDrainPending"
RESET_REASON = "CheckpointRequested"
"""Reason of the ``CheckpointDone=False`` the actuator writes with a new request (an old answer is void)."""
EVENT_REASON = "CheckpointRequested"
"""Reason of the Warning Event on each pod asked."""
LEDGER_VALUE = "checkpoint"
"""Flow value of the ledger holding ``{"at": <epoch>, "until": <epoch>}`` (``checkpoint:<step key>``)."""

LOST_PROBLEMS = frozenset({"fell_off_bus", "count"})
"""The catalog's problem classes that mean a GPU is gone (fallen off the bus, missing)."""

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*$")
_UNIT = {"s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
MAX_GRACE_SECONDS = 86400.0
"""A day: a longer wait is a node kept in service with a fault, not a checkpoint."""


def parse_grace(value: Any) -> float:
    """Seconds from a number or a duration (``300``, ``"300s"``, ``"5m"``, ``"1h"``); ValueError if neither."""
    if isinstance(value, bool):
        raise ValueError("a number of seconds or a duration (300s, 5m)")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ValueError(f"{value!r} is not a duration (seconds, or a number and s, m or h: 300s, 5m)")
        seconds = float(m.group(1)) * _UNIT[m.group(2)]
    if not 0 < seconds <= MAX_GRACE_SECONDS:
        raise ValueError(f"must be more than 0 and at most {MAX_GRACE_SECONDS:g}s, got {seconds:g}s")
    return seconds


# -- which faults may wait ---------------------------------------------------------------------------
def _xid_lost(code: int, catalog: Catalog) -> str | None:
    if catalog.workflow(code) == "gpu_lost" or catalog.problem("xid", code) in LOST_PROBLEMS:
        return f"Xid {code}: the catalog says the GPU is lost"
    cls = catalog.xid(code)
    if cls.action == Action.REBOOT_NODE:
        return f"Xid {code}: the catalog's action is REBOOT_NODE (the GPU does not run until the node reboots)"
    return None


def rule_error(codes: Iterable[int], kinds: Iterable[FaultKind], catalog: Catalog) -> str | None:
    """Why a rule matching these codes and kinds may not wait for a checkpoint (None: it may).

    Judged on what the rule names; what it leaves open (no codes, Xid 154 whose recovery action is in
    the line) is judged per incident by ``gpu_lost``.
    """
    kinds = tuple(kinds)
    if FaultKind.GPU_FALLEN_OFF_BUS in kinds:
        return "kind gpu_fallen_off_bus: the GPU is lost, nothing can checkpoint on it"
    for code in codes:
        if not kinds or FaultKind.XID in kinds:
            why = _xid_lost(code, catalog)
            if why:
                return why
        if (not kinds or FaultKind.SXID in kinds) and code in catalog.sxid_codes():
            if catalog.sxid(code).action == Action.REBOOT_NODE:
                return f"SXid {code}: the catalog's action is REBOOT_NODE (the NVLink fabric is down)"
    return None


def gpu_lost(incident: NodeIncident, catalog: Catalog) -> str | None:
    """Why this incident leaves no GPU to checkpoint on (None: the GPU still runs)."""
    if incident.kind == FaultKind.GPU_FALLEN_OFF_BUS:
        return "the GPU fell off the bus"
    if incident.kind == FaultKind.XID and incident.code is not None:
        why = _xid_lost(incident.code, catalog)
        if why:
            return why
    if incident.kind == FaultKind.HEALTH_CHECK:
        check = incident.signature.split(":", 2)[1] if incident.signature.count(":") >= 1 else ""
        if catalog.health_problem(check) in LOST_PROBLEMS:
            return f"health check {check}: a GPU is missing"
    for sig in incident.signatures:
        kind, _, rest = sig.partition(":")
        code = rest.split(":", 1)[0]
        if kind == FaultKind.GPU_FALLEN_OFF_BUS.value:
            return "the GPU fell off the bus (evidence of the incident)"
        if kind == FaultKind.XID.value and code.isdigit() and catalog.workflow(int(code)) == "gpu_lost":
            return f"Xid {code} in the incident's evidence: the GPU is lost"
    if incident.action == Action.REBOOT_NODE:
        # Xid 154 with a reboot recovery action, a fabric SXid, an escalation: the node must reboot.
        return "the incident's action is REBOOT_NODE (the GPU does not run until the node reboots)"
    return None


# -- the wait ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Wait:
    """One checkpoint wait as the ledger keeps it: when the pods were asked, until when they may answer."""

    at: float
    until: float

    @classmethod
    def start(cls, now: float, grace: float) -> Wait:
        return cls(at=now, until=now + grace)

    @classmethod
    def from_value(cls, value: Any) -> Wait | None:
        if not isinstance(value, Mapping) or "at" not in value or "until" not in value:
            return None
        return cls(at=float(value["at"]), until=float(value["until"]))

    def value(self) -> dict[str, float]:
        return {"at": round(self.at, 3), "until": round(self.until, 3)}

    def remaining(self, now: float) -> float:
        return max(0.0, self.until - now)


def ledger_name(step_key: str) -> str:
    return f"{LEDGER_VALUE}:{step_key}"


def rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _epoch(text: Any) -> float | None:
    if not text:
        return None
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _condition(pod: Mapping[str, Any], condition_type: str) -> Mapping[str, Any] | None:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == condition_type:
            return cond
    return None


def requested(pod: Mapping[str, Any], wait: Wait) -> bool:
    """The pod carries this wait's request (True, set no earlier than the second the wait began)."""
    cond = _condition(pod, REQUESTED)
    if cond is None or cond.get("status") != "True":
        return False
    at = _epoch(cond.get("lastTransitionTime"))
    return at is not None and at >= int(wait.at)  # RFC 3339 as written keeps whole seconds


def answered(pod: Mapping[str, Any], wait: Wait) -> bool:
    """The workload reported its checkpoint saved for this wait's request."""
    done = _condition(pod, DONE)
    return requested(pod, wait) and done is not None and done.get("status") == "True"


def request_message(incident: NodeIncident | None, node: str, wait: Wait) -> str:
    what = "a GPU fault"
    if incident is not None:
        code = f" {incident.code}" if incident.code is not None else ""
        what = f"GPU fault {incident.kind.value}{code}"
    return (
        f"{what} on node {node}: the pod will be evicted at {rfc3339(wait.until)} or as soon as it sets "
        f"{DONE}=True after saving a checkpoint (deadline {rfc3339(wait.until)})"
    )


def request_patch(pod: Mapping[str, Any], message: str, now: float) -> dict[str, Any]:
    """The pods/status strategic merge patch asking for a checkpoint (conditions merge by type).

    An answer left from an earlier request is reset to False in the same write, so only an answer
    to this request ends the wait.
    """
    stamp = rfc3339(now)
    conditions: list[dict[str, Any]] = [
        {"type": REQUESTED, "status": "True", "reason": REQUEST_REASON, "message": message[:1024],
         "lastTransitionTime": stamp, "lastProbeTime": None},
    ]
    done = _condition(pod, DONE)
    if done is not None and done.get("status") == "True":
        conditions.append({"type": DONE, "status": "False", "reason": RESET_REASON,
                           "message": "a new checkpoint request is pending", "lastTransitionTime": stamp,
                           "lastProbeTime": None})
    return {"status": {"conditions": conditions}}


def pod_name(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace')}/{meta.get('name')}"


@dataclass(frozen=True)
class Progress:
    """Where a wait stands over the pods it concerns."""

    to_ask: tuple[str, ...]
    """Pods without this wait's request yet."""
    pending: tuple[str, ...]
    """Asked, not answered."""
    answered: tuple[str, ...]

    @property
    def over(self) -> bool:
        return not self.to_ask and not self.pending


def progress(pods: Iterable[Mapping[str, Any]], wait: Wait, unaskable: frozenset[str] = frozenset()) -> Progress:
    """``pods``: the GPU pods the drain would evict (gone or finished ones are not waited for).

    ``unaskable``: pods the request could not be written to (forbidden): nobody can answer, so they
    are not waited for.
    """
    to_ask: list[str] = []
    pending: list[str] = []
    done: list[str] = []
    for pod in pods:
        name = pod_name(pod)
        if name in unaskable:
            continue
        if answered(pod, wait):
            done.append(name)
        elif requested(pod, wait):
            pending.append(name)
        else:
            to_ask.append(name)
    return Progress(tuple(sorted(to_ask)), tuple(sorted(pending)), tuple(sorted(done)))
