"""The repair case: one per node and fault class, in the node's ledger (``Ledger.repairs``). Pure.

A rule with a ``diagnose`` step (and optionally a ``repair`` block) makes its faults repair cases. The case
says where the node is in the loop and what was tried, so that any replica drives it on from the ledger
(level-triggered, like a flow) and an operator (``xidflow status``), a hand-off (``RepairRequest``) and the
demo read the same history:

    fault -> quarantine, drain, repair (reboot/resetGpu) -> diagnose
      pass -> ``returning``: the engine undoes the case's flows (back in service) -> ``returned``
      fail/timeout -> a repair that did not hold (``failed`` + 1):
        below ``maxFailedRepairs`` -> the repair again (a flow ``<case>-<n>``: the rule's repair steps, diagnose)
        at the limit -> ``hardware-inspection``: a flow of a condition and ``hardwareInspection`` (the hand-off)
    handed-off: nothing touches the node until the RepairRequest says Repaired or Replaced -> a gate flow
      (``diagnose``): pass -> back in service, ``failed`` back to 0; fail -> handed off again
    returned + a fault of the same class within ``window`` -> the repair did not hold: the case goes on
      (``failed`` + 1: the rule again, or hardware inspection at the limit), one case, not a new incident's

Every change here is idempotent (keyed by incident and revision, flow, Job name), because a ledger write
is recomputed on a 409 and replayed after a crash. Lists are capped: the ledger lives in an annotation.
The shape is a contract (docs/repair.md, tests/unit/test_repaircase.py).

One module (about 420 lines): every change of a case and every question asked of it read the same fields,
which docs/repair.md documents and tests/unit/test_repair_doc.py holds to this code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pipeline.actuator.ownership import Ledger

# Stages of a case (``stage``), in loop order.
REPAIRING = "repairing"
"""A flow of the case is quarantining, draining or repairing the node."""
DIAGNOSING = "diagnosing"
"""The gate flow runs the diagnostics Job after the external repair system's answer."""
RETURNING = "returning"
"""Diagnostics passed: the engine is removing what the case's flows applied (uncordon, taints, conditions)."""
RETURNED = "returned"
"""Back in service; a fault of the same class within ``window`` continues this case."""
INSPECTION = "hardware-inspection"
"""Repairs did not hold: the hand-off flow (condition, RepairRequest, Event) runs."""
HANDED_OFF = "handed-off"
"""Waiting for the external repair system's answer (``Repaired``/``Replaced``); xidflow does not touch the node."""
CLOSED = "closed"
"""Over: the window after the return passed, or a person took over (reset, uncordon)."""

STAGES = (REPAIRING, DIAGNOSING, RETURNING, RETURNED, INSPECTION, HANDED_OFF, CLOSED)
HOLDING = frozenset({REPAIRING, DIAGNOSING, INSPECTION, HANDED_OFF})
"""Stages in which the node stays out: an incident's recovery does not return it, the gate does."""
UNTOUCHED = frozenset({INSPECTION, HANDED_OFF})
"""Stages in which xidflow starts nothing new on the node (new faults are recorded in the case only)."""
ANSWERS = ("Repaired", "Replaced")
"""RepairRequest phases that hand the node back: the diagnostics gate runs again."""

INSPECTION_CONDITION = "GpuHardwareInspection"
"""The node condition a hand-off sets True (reason ``RepairsDidNotHold`` or ``DiagnosticsFailed``)."""
INSPECTION_STEPS: tuple[dict[str, Any], ...] = (
    {"name": "condition", "type": INSPECTION_CONDITION, "status": "True", "reason": "RepairsDidNotHold"},
    {"name": "hardwareInspection"},
)
"""What ``hardware-inspection`` adds to a node that is out already (``ActionSpec`` attributes by alias)."""
GATE_STEPS: tuple[dict[str, Any], ...] = ({"name": "diagnose"},)

# Caps of the lists a case keeps (the annotation must stay small).
MAX_FAULTS = 10
MAX_REPAIRS = 10
MAX_DIAGNOSTICS = 10
MAX_HISTORY = 30
LINE_CHARS = 200


@dataclass(frozen=True)
class Decision:
    """What an incident of a repair rule means for the node's case (``decide``)."""

    kind: Literal["new", "join", "relapse", "escalate"]
    """new: a case opens with this flow; join: the case is in progress, the fault is recorded, nothing starts;
    relapse: the repair did not hold, the rule runs again in the same case; escalate: it did not hold and the
    limit is reached, the flow is the hand-off."""
    fault_class: str
    case_id: str
    reason: str = ""
    failed: int = 0
    """``failed`` after this incident (relapse, escalate)."""


def case_of(ledger: Ledger, fault_class: str) -> dict[str, Any] | None:
    return ledger.repairs.get(fault_class)


def case_of_flow(ledger: Ledger, flow: str) -> tuple[str, dict[str, Any]] | None:
    """(fault class, case) of the case a flow belongs to, or None."""
    for cls, case in ledger.repairs.items():
        if flow in (case.get("flows") or ()):
            return cls, case
    return None


def revision_flow(incident_id: str, revision: int) -> str:
    """The flow of an incident's revision that came back in a repair case after the incident's own flow ended
    (the aggregation re-emits an open incident when its fault repeats): ``<incident>-rev<n>``."""
    return f"{incident_id}-rev{revision}"


def flow_of(ledger: Ledger, incident_id: str, revision: int) -> str:
    """The flow an incident's record drives: its revision's flow when a case recorded one, else its own id."""
    alias = revision_flow(incident_id, revision)
    return alias if alias in ledger.flows else incident_id


def is_open(case: Mapping[str, Any] | None) -> bool:
    return case is not None and case.get("stage") not in (CLOSED, None)


def decide(ledger: Ledger, fault_class: str, incident_id: str, now: float, window: float, limit: int) -> Decision:
    """The case an incident of a repair rule joins, opens or continues (pure; ``window``/``limit`` from the rule).

    ``window`` and ``limit`` of a running case are the ones it was opened with (a policy edit does not change
    a case under way); a new case takes the rule's.
    """
    case = case_of(ledger, fault_class)
    if not is_open(case):
        return Decision("new", fault_class, incident_id)
    assert case is not None
    case_id = str(case["case"])
    stage = case.get("stage")
    if stage != RETURNED:
        return Decision("join", fault_class, case_id, f"repair case {case_id} is {stage}")
    window = float((case.get("policy") or {}).get("window", window))
    limit = int((case.get("policy") or {}).get("maxFailedRepairs", limit))
    returned = float(case.get("returned") or 0)
    if now - returned > window:
        return Decision("new", fault_class, incident_id)  # the last repair held for the whole window
    failed = int(case.get("failed") or 0) + 1
    held = f"{fault_class} came back {now - returned:.0f}s after the return (window {window:g}s)"
    if failed >= limit:
        reason = f"{held}: {failed} repairs did not hold (limit {limit}); hardware inspection"
        return Decision("escalate", fault_class, case_id, reason, failed)
    return Decision("relapse", fault_class, case_id, f"{held}: repair {failed + 1} of case {case_id}", failed)


def fault_entry(record: Mapping[str, Any], now: float) -> dict[str, Any]:
    """What a case keeps of an incident (a ``NodeIncident`` as JSON)."""
    return {
        "incident": record.get("incident_id"),
        "rev": int(record.get("revision") or 0),
        "at": now,
        "kind": record.get("kind"),
        "code": record.get("code"),
        "pci": record.get("pci"),
        "signature": record.get("signature"),
        "count": record.get("count"),
        "first_seen": record.get("first_seen"),
        "last_seen": record.get("last_seen"),
        "evidence": list(record.get("evidence_ids") or [])[:5],
        "line": str(record.get("line") or "")[:LINE_CHARS],
    }


def _note(case: dict[str, Any], stage: str, now: float, note: str) -> None:
    case["stage"] = stage
    case["updated"] = now
    history = case.setdefault("history", [])
    history.append({"at": now, "stage": stage, "note": note[:300]})
    del history[: max(0, len(history) - MAX_HISTORY)]


def _add_fault(case: dict[str, Any], record: Mapping[str, Any], now: float) -> bool:
    faults = case.setdefault("faults", [])
    key = (record.get("incident_id"), int(record.get("revision") or 0))
    if any((f.get("incident"), int(f.get("rev") or 0)) == key for f in faults):
        return False
    faults.append(fault_entry(record, now))
    if len(faults) > MAX_FAULTS:  # the first fault (what opened the case) and the latest ones
        del faults[1 : len(faults) - MAX_FAULTS + 1]
    return True


def apply_decision(
    ledger: Ledger,
    decision: Decision,
    flow: str | None,
    record: Mapping[str, Any],
    now: float,
    rule: str = "",
    policy: Mapping[str, Any] | None = None,
    again: list[dict[str, Any]] | None = None,
) -> bool:
    """Record an incident in its case (idempotent); ``flow`` is the incident's flow (None for ``join``). True when
    the ledger changed.

    ``policy`` (window, maxFailedRepairs, webhookUrl) and ``again`` (the rule's repair steps and diagnose, run
    again after a failed diagnostics) are kept when a case opens.
    """
    cls = decision.fault_class
    case = case_of(ledger, cls)
    changed = False
    if decision.kind == "new" and (not is_open(case) or (case or {}).get("stage") == RETURNED):
        if case is not None and case.get("case") == decision.case_id:
            pass  # opened by this very incident before (a recomputed write)
        else:
            case = ledger.repairs[cls] = {
                "case": decision.case_id, "class": cls, "opened": now, "rule": rule,
                "policy": dict(policy or {}), "again": list(again or []), "rec": dict(record),
                "faults": [], "repairs": [], "diagnostics": [], "failed": 0, "returned": None,
                "flows": [], "seq": 0, "handoffs": 0, "history": [],
            }
            _note(case, REPAIRING, now, f"opened by {record.get('signature')} (rule {rule})")
            changed = True
    if case is None:
        return changed
    if _add_fault(case, record, now):
        case["updated"] = now
        changed = True
    if flow is not None and flow not in case.setdefault("flows", []):
        case["flows"].append(flow)
        changed = True
        if decision.kind == "relapse":
            case["failed"] = decision.failed
            _note(case, REPAIRING, now, decision.reason)
        elif decision.kind == "escalate":
            case["failed"] = decision.failed
            _note(case, INSPECTION, now, decision.reason)
    return changed


def seen(ledger: Ledger, fault_class: str, incident_id: str, revision: int) -> bool:
    """The incident (this revision) is in the class's case already: a redelivery, not a new fault."""
    case = case_of(ledger, fault_class)
    return case is not None and any(
        (f.get("incident"), int(f.get("rev") or 0)) == (incident_id, revision) for f in case.get("faults") or []
    )


def note_repair(ledger: Ledger, flow: str, action: str, outcome: str, now: float) -> None:
    """A repair step of a case's flow is done (reboot, resetGpu): recorded once per flow and step."""
    found = case_of_flow(ledger, flow)
    if found is None:
        return
    repairs = found[1].setdefault("repairs", [])
    if any(r.get("flow") == flow and r.get("action") == action for r in repairs):
        return
    repairs.append({"action": action, "flow": flow, "at": now, "outcome": outcome})
    del repairs[: max(0, len(repairs) - MAX_REPAIRS)]


def _next_flow(ledger: Ledger, case: dict[str, Any], steps: list[dict[str, Any]], now: float, label: str) -> str:
    """Open the case's next flow (``<case>-<n>``) from the case's own record: any replica drives it from here."""
    case["seq"] = int(case.get("seq") or 0) + 1
    key = f"{case['case']}-{case['seq']}"
    plan = {"rec": case.get("rec") or {}, "rule": f"{case.get('rule') or 'repair'} ({label})", "esc": False,
            "steps": [dict(s) for s in steps]}
    ledger.open_flow(key, plan, now)
    case.setdefault("flows", []).append(key)
    return key


def record_diagnostics(
    ledger: Ledger, flow: str, job: str, verdict: str, message: str, result: Mapping[str, Any], now: float
) -> None:
    """The gate's verdict (``pass``, ``fail``, ``timeout``) and what follows, in the write that records it (once
    per Job)."""
    found = case_of_flow(ledger, flow)
    if found is None:
        return
    _, case = found
    diagnostics = case.setdefault("diagnostics", [])
    if any(d.get("job") == job for d in diagnostics):
        return
    diagnostics.append({"job": job, "flow": flow, "verdict": verdict, "at": now, "message": message[:300],
                        "result": dict(result)})
    del diagnostics[: max(0, len(diagnostics) - MAX_DIAGNOSTICS)]
    answered = bool((case.get("handoff") or {}).get("answer"))
    if verdict == "pass":
        if answered:  # repaired or replaced hardware: its history starts again
            case["failed"] = 0
        _note(case, RETURNING, now, f"diagnostics passed ({job})")
        return
    limit = int((case.get("policy") or {}).get("maxFailedRepairs", 2))
    case["failed"] = int(case.get("failed") or 0) + 1
    why = f"diagnostics {verdict} ({job}); {case['failed']} repairs did not hold (limit {limit})"
    if not answered and case.get("again") and case["failed"] < limit:
        key = _next_flow(ledger, case, list(case["again"]), now, f"repair {case['failed'] + 1}")
        _note(case, REPAIRING, now, f"{why}: the repair again ({key})")
        return
    steps = [dict(s) for s in INSPECTION_STEPS]
    steps[0]["reason"] = "DiagnosticsFailed" if answered or not case.get("again") else "RepairsDidNotHold"
    key = _next_flow(ledger, case, steps, now, "hardware inspection")
    _note(case, INSPECTION, now, f"{why}: hardware inspection ({key})")


def record_handoff(ledger: Ledger, flow: str, name: str, via: str, now: float) -> None:
    """The RepairRequest ``name`` was made: the node is the external repair system's until it answers."""
    found = case_of_flow(ledger, flow)
    if found is None:
        return
    _, case = found
    if (case.get("handoff") or {}).get("name") == name:
        return
    case["handoffs"] = int(case.get("handoffs") or 0) + 1
    case["handoff"] = {"name": name, "at": now, "via": via, "answer": None}
    _note(case, HANDED_OFF, now, f"handed off as RepairRequest {name} ({via})")


def handoff_name(node: str, case: Mapping[str, Any]) -> str:
    """The RepairRequest's name for the case's next hand-off: readable (the node first) and deterministic."""
    return f"{node[:200]}-{str(case['case'])[:8]}-{int(case.get('handoffs') or 0) + 1}"


def record_answer(ledger: Ledger, fault_class: str, answer: str, by: str, now: float) -> str | None:
    """The external repair system answered (``Repaired``/``Replaced``): open the gate flow (once per hand-off);
    its key, or None when there is nothing to do."""
    case = case_of(ledger, fault_class)
    if case is None or case.get("stage") != HANDED_OFF or answer not in ANSWERS:
        return None
    handoff = case.setdefault("handoff", {})
    handoff.update(answer=answer, answered=now, by=by)
    key = _next_flow(ledger, case, [dict(s) for s in GATE_STEPS], now, f"diagnostics after {answer.lower()}")
    _note(case, DIAGNOSING, now, f"RepairRequest {handoff.get('name')} says {answer}: diagnostics again ({key})")
    return key


def record_returned(ledger: Ledger, fault_class: str, now: float) -> None:
    """What the case's flows applied is gone: the node is back in service."""
    case = case_of(ledger, fault_class)
    if case is None or case.get("stage") != RETURNING:
        return
    case["returned"] = now
    _note(case, RETURNED, now, "back in service")


def close(ledger: Ledger, fault_class: str, now: float, why: str) -> None:
    case = case_of(ledger, fault_class)
    if case is None or case.get("stage") == CLOSED:
        return
    case["resolution"] = why
    _note(case, CLOSED, now, why)


def holds(ledger: Ledger, flow: str) -> str | None:
    """Why an incident's recovery must not return the node (the case decides), or None."""
    found = case_of_flow(ledger, flow)
    if found is None:
        return None
    cls, case = found
    stage = case.get("stage")
    if stage in HOLDING:
        return f"repair case {case.get('case')} ({cls}) is {stage}: the diagnostics gate returns the node"
    return None


def untouched(ledger: Ledger) -> str | None:
    """Why nothing new may start on the node (a case is in hardware inspection or handed off), or None."""
    for cls, case in ledger.repairs.items():
        if case.get("stage") in UNTOUCHED:
            name = (case.get("handoff") or {}).get("name")
            where = f" as RepairRequest {name}" if name and case.get("stage") == HANDED_OFF else ""
            return f"repair case {case.get('case')} ({cls}) is {case.get('stage')}{where}"
    return None


def needs_driving(ledger: Ledger) -> bool:
    """A case the engine moves on by itself: a return to service to finish, or a hand-off whose answer may be in."""
    return any(case.get("stage") in (RETURNING, HANDED_OFF) for case in ledger.repairs.values())


# -- what an operator and the demo read ------------------------------------------------------------------
def summary(ledger: Ledger, now: float) -> list[dict[str, Any]]:
    """Every case of the node, newest first, as ``xidflow status -o json`` and the demo show it (pure)."""
    out = []
    for cls, case in ledger.repairs.items():
        policy = case.get("policy") or {}
        returned = case.get("returned")
        out.append({
            "case": case.get("case"),
            "fault_class": cls,
            "stage": case.get("stage"),
            "rule": case.get("rule"),
            "failed_repairs": int(case.get("failed") or 0),
            "max_failed_repairs": int(policy.get("maxFailedRepairs", 2)),
            "window_seconds": float(policy.get("window", 86400)),
            "opened": case.get("opened"),
            "returned": returned,
            "in_service_for_seconds": round(now - float(returned), 1) if returned and case.get("stage") == RETURNED
            else None,
            "faults": [{k: f.get(k) for k in ("incident", "rev", "at", "code", "signature")}
                       for f in case.get("faults") or []],
            "repairs": list(case.get("repairs") or []),
            "diagnostics": [{k: d.get(k) for k in ("job", "verdict", "at", "message")}
                            for d in case.get("diagnostics") or []],
            "handoff": dict(case.get("handoff") or {}) or None,
            "history": list(case.get("history") or []),
            "resolution": case.get("resolution"),
        })
    return sorted(out, key=lambda c: -float(c.get("opened") or 0))


def loop_position(ledger: Ledger) -> str | None:
    """Where the node is in the repair loop, in a few words (``xidflow status``'s column), or None without a case."""
    cases = [c for c in ledger.repairs.values() if c.get("stage") != CLOSED] or list(ledger.repairs.values())
    if not cases:
        return None
    case = max(cases, key=lambda c: float(c.get("updated") or c.get("opened") or 0))
    policy = case.get("policy") or {}
    tried = f"{int(case.get('failed') or 0)}/{int(policy.get('maxFailedRepairs', 2))} failed"
    return f"{case.get('stage')} ({case.get('class')}, {tried})"


def describe(node: Mapping[str, Any], now: float | None = None) -> dict[str, Any]:
    """A Node object's repair loop, for ``xidflow status`` and the demo (pure): where it is (``position``, None
    without a case) and each case's history (``summary``)."""
    import time

    ledger = Ledger.from_annotations((node.get("metadata") or {}).get("annotations"))
    return {
        "node": (node.get("metadata") or {}).get("name"),
        "position": loop_position(ledger),
        "cases": summary(ledger, time.time() if now is None else now),
    }
