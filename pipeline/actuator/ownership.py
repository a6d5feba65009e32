"""The ledger: what xidflow applied to a Node, by flow (incident id or request id) and action.

It lives in one Node annotation (``xidflow.dev/ledger``, compact JSON) so that the record of an
effect and the effect itself can be written in the same conditional update (resourceVersion):
either both land or neither. Pure: parse, query and change; ``kube``/``engine`` do the writing.

Shape::

    {"v": 1,
     "owned":    {"cordon": ["<flow>"], "taint:<key>:<effect>": ["<flow>"], "condition:GpuXid": ["<flow>"]},
     "flows":    {"<flow>": {"at": <epoch>, "done": {"<step>": <epoch>},
                             "claims": {"<step>": {"by": "<worker>", "at": <epoch>}},
                             "cancelled": "<reason>" | null, "boot_id": "<before reboot>" | null,
                             "plan": {"rec": <the record>, "rule": ..., "esc": bool, "steps": [<ActionSpec>]},
                             "fin": <epoch> (the flow ended: every step ran, or it stopped),
                             "log": {"<step>": {"by": "<worker>", "at": <epoch>, "outcome": ..., "reason": ...,
                                                "details": {...}}}}},
     "attempts": [<epoch>, ...],
     "repairs":  {"<fault class>": <repair case, pipeline.actuator.repaircase>}}

A flow with a ``plan`` and no ``fin`` is open: whichever replica owns the node's partition drives it
to the end from here, without its record (level-triggered). A claim is a lease: its holder renews
``at`` while the step runs, and a claim not renewed within the lease period is retaken.

``owned`` is what undo may remove: an effect xidflow found already in place (a human's cordon) is
never recorded there, so it is never undone.

Every field is a contract (tools and people read the annotation): ``LEDGER_FIELDS``, ``OWNED_KEYS`` and
``FLOW_FIELDS`` say what each means, ``docs/node-ledger.md`` is generated from them
(``pipeline.runtime.contractdocs``), and ``set_flow_value`` refuses a field they do not name.

``repairs`` holds one repair case per fault class (``GpuFellOffBus``, ``GpuEcc``, ...) for rules with a
``repair`` block: the faults, the repairs tried, the diagnostics run, the hand-off, and where the node is
in the loop (``pipeline.actuator.repaircase``, documented in docs/repair.md).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

LEDGER_ANNOTATION = "xidflow.dev/ledger"
LAST_ACTION_ANNOTATION = "xidflow.dev/last-action"
REBOOT_REQUEST_ANNOTATION = "xidflow.dev/reboot-requested"
STANDBY_FOR_ANNOTATION = "xidflow.dev/standby-for"

CORDON = "cordon"

LEDGER_FIELDS: dict[str, str] = {
    "v": "Format version: 1.",
    "owned": "Effect key (`OWNED_KEYS`) -> the flows that need it, oldest first. What undo may remove: an effect "
    "xidflow found in place (a person's cordon) is never here.",
    "flows": "Flow key (an incident id, `req:<request id>` for a rescue request, `<case>-<n>` and `<incident>-rev<n>` "
    "for a repair case's own flows) -> its entry (`FLOW_FIELDS`). "
    "At most `XIDFLOW_ACTUATOR_LEDGER_MAX_FLOWS` (20); the oldest finished flows that own nothing are forgotten.",
    "attempts": "When each disruptive flow (drain, reboot, resetGpu) started (epoch seconds), within the attempt "
    "window: the attempt cap counts them.",
    "repairs": "Fault class (`GpuFellOffBus`, `GpuEcc`, ...) -> its repair case, for rules with the repair loop: the "
    "faults, the repairs tried, the diagnostics run, the hand-off and where the node is in the loop "
    "(docs/repair.md). Absent on nodes without a case.",
}
"""The ledger's top-level fields."""

OWNED_KEYS: dict[str, str] = {
    "cordon": "The node's cordon (`spec.unschedulable`).",
    "taint:<key>:<effect>": "A node taint, by key and effect (its value may change between incidents).",
    "condition:<type>": "A node condition xidflow set `True` (its own types: GpuXid, GpuEcc, ...).",
    "condition:<type>=<status>": "A condition a policy set to another status (`AcceleratedHardwareReady=False`); "
    "undo puts back the opposite, only while it still says what xidflow wrote.",
    "devicetaintrule:<name>": "A DeviceTaintRule xidflow created for one GPU (taintDevice); undo deletes it.",
}
"""The forms of an ``owned`` key."""

FLOW_FIELDS: dict[str, str] = {
    "at": "When the flow was first recorded (epoch seconds).",
    "done": "Step key (`drain`, `reboot`, `taint#2`, ...) -> when the step finished (epoch seconds).",
    "claims": "Step key -> `{by: <worker id>, at: <epoch>}`: the lease of a long step (drain, reboot, resetGpu, "
    "enableWarmStandby). Its holder renews `at` every third of `XIDFLOW_ACTUATOR_CLAIM_TIMEOUT_SECONDS`; a claim "
    "not renewed for that long is retaken by the replica that owns the node.",
    "cancelled": "Why the flow was ended by a person's act (`manual-uncordon`, ...), else null.",
    "plan": "While the flow is open: `{rec: <the NodeIncident or rescue request>, rule: <policy rule>, esc: "
    "<escalated to CONTACT_SUPPORT>, steps: [<policy action>, ...]}`. Any replica drives the flow to its end from it.",
    "rev": "Revision of the incident the plan was made from (an escalation replaces the plan).",
    "fin": "When the flow ended (epoch seconds): every step ran, or one stopped it. The plan is dropped then.",
    "status": "How the flow ended: `done`, why a step stopped it (`failed`, `cancelled`, ...), or `shared-part` (the "
    "shared-part rule took the node over).",
    "log": "Step key -> `{by: <worker id>, at: <epoch>, outcome: <audit outcome>, reason: <text>, details: "
    "{...}}`: who applied the step and with what result (the audit record's, lists cut to a few items), so "
    "the audit stays complete when the replica that applied it dies.",
    "boot_id_before": "reboot: the node's bootID when the reboot was claimed; the step waits for another one "
    "(a replica that resumes it waits for the same reboot instead of asking for a second).",
    "hook_taint": "reboot (Job hook) and resetGpu: true when the step put xidflow's taint on the node itself (the "
    "hook-jobs admission policy admits a Job only on a node carrying it); `uncordonAfter` removes it again.",
    "standby": "enableWarmStandby: the standby node made schedulable for this flow.",
    "part": "The shared part (`<label>=<value>`) this node's flow blames (the shared-part rule).",
    "recovered": "Why the flow was undone (the NodeRecovered reason, or `manual` for `xidflow reset`).",
}
"""Every field of a flow entry (``flows.<flow key>``)."""

FLOW_FIELD_PREFIXES: dict[str, str] = {
    "checkpoint:<step key>": "drain with `checkpointGrace`: `{at: <epoch>, until: <epoch>}`, when the GPU pods "
    "were asked for a checkpoint and the deadline after which each is evicted anyway. Recorded before any pod "
    "is asked, so a replica that takes the drain over keeps the same deadline.",
}
"""Flow fields named after a step (the part before ``<`` is the prefix)."""

SHARED_PART_TAINT_PREFIX = "xidflow.dev/shared-"
"""Taint keys of the shared-part rule (``pipeline.actuator.sharedparts``): the part is blamed, not the node,
so the circuit breaker does not count a node for carrying one."""


_FLOW_PREFIXES = tuple(key.split("<", 1)[0] for key in FLOW_FIELD_PREFIXES)


def is_shared_part_effect(effect: str) -> bool:
    return effect.startswith(f"taint:{SHARED_PART_TAINT_PREFIX}")


def taint_effect_key(key: str, effect: str) -> str:
    # Kubernetes identifies a taint by key and effect; the value may change between incidents.
    return f"taint:{key}:{effect}"


def condition_effect_key(condition_type: str) -> str:
    return f"condition:{condition_type}"


def request_flow_key(request_id: str) -> str:
    """Flow key of a third-party rescue request: never equal to an incident id."""
    return f"req:{request_id}"


@dataclass
class Ledger:
    owned: dict[str, list[str]] = field(default_factory=dict)
    flows: dict[str, dict[str, Any]] = field(default_factory=dict)
    attempts: list[float] = field(default_factory=list)
    repairs: dict[str, dict[str, Any]] = field(default_factory=dict)

    # -- (de)serialisation -------------------------------------------------------------------
    @classmethod
    def from_annotations(cls, annotations: Mapping[str, str] | None) -> Ledger:
        raw = (annotations or {}).get(LEDGER_ANNOTATION)
        if not raw:
            return cls()
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            # A hand-edited, broken ledger must not wedge the node; start over (audited by caller).
            return cls()
        return cls(
            owned={k: list(v) for k, v in (data.get("owned") or {}).items()},
            flows={k: dict(v) for k, v in (data.get("flows") or {}).items()},
            attempts=[float(t) for t in data.get("attempts") or []],
            repairs={k: dict(v) for k, v in (data.get("repairs") or {}).items() if isinstance(v, dict)},
        )

    def to_annotation(self) -> str:
        body: dict[str, Any] = {"v": 1, "owned": self.owned, "flows": self.flows, "attempts": self.attempts}
        if self.repairs:  # absent on nodes without a repair case: the annotation of most nodes is unchanged
            body["repairs"] = self.repairs
        return orjson.dumps(body, option=orjson.OPT_SORT_KEYS).decode()

    def copy(self) -> Ledger:
        return Ledger(copy.deepcopy(self.owned), copy.deepcopy(self.flows), list(self.attempts),
                      copy.deepcopy(self.repairs))

    # -- flows and steps ---------------------------------------------------------------------
    def flow(self, flow_key: str, now: float) -> dict[str, Any]:
        return self.flows.setdefault(flow_key, {"at": now, "done": {}, "claims": {}, "cancelled": None})

    def is_done(self, flow_key: str, step: str) -> bool:
        return step in (self.flows.get(flow_key) or {}).get("done", {})

    def mark_done(self, flow_key: str, step: str, now: float) -> None:
        flow = self.flow(flow_key, now)
        flow.setdefault("done", {})[step] = now
        flow.setdefault("claims", {}).pop(step, None)

    def claim_of(self, flow_key: str, step: str) -> dict[str, Any] | None:
        return (self.flows.get(flow_key) or {}).get("claims", {}).get(step)

    def renew(self, flow_key: str, step: str, worker: str, now: float) -> bool:
        """Extend our lease on the step; False when the claim is no longer ours (retaken or released)."""
        claim = self.claim_of(flow_key, step)
        if not claim or claim.get("by") != worker:
            return False
        claim["at"] = now
        return True

    def claim_holder(self, flow_key: str, step: str, now: float, timeout: float) -> str | None:
        """Worker holding a live claim on the step, or None when it is free or the claim is stale."""
        claim = (self.flows.get(flow_key) or {}).get("claims", {}).get(step)
        if not claim or now - float(claim.get("at", 0)) > timeout:
            return None
        return str(claim.get("by"))

    def claim(self, flow_key: str, step: str, worker: str, now: float) -> None:
        self.flow(flow_key, now).setdefault("claims", {})[step] = {"by": worker, "at": now}

    def release(self, flow_key: str, step: str) -> None:
        (self.flows.get(flow_key) or {}).get("claims", {}).pop(step, None)

    def cancelled(self, flow_key: str) -> str | None:
        return (self.flows.get(flow_key) or {}).get("cancelled")

    def cancel(self, flow_key: str, reason: str, now: float) -> None:
        self.flow(flow_key, now)["cancelled"] = reason

    def set_flow_value(self, flow_key: str, name: str, value: Any, now: float) -> None:
        """Record one of ``FLOW_FIELDS`` (or a ``FLOW_FIELD_PREFIXES`` one): an undocumented field is refused."""
        if name not in FLOW_FIELDS and not name.startswith(_FLOW_PREFIXES):
            raise ValueError(f"ledger field {name!r} is not in ownership.FLOW_FIELDS (docs/node-ledger.md)")
        self.flow(flow_key, now)[name] = value

    def flow_value(self, flow_key: str, name: str) -> Any:
        return (self.flows.get(flow_key) or {}).get(name)

    # -- open flows (level-triggered state) ---------------------------------------------------------
    def open_flow(self, flow_key: str, plan: dict[str, Any], now: float, rev: int = 0, replace: bool = False) -> bool:
        """Record what the flow must go through; False when it was recorded before (kept as it was).

        ``replace`` records a newer revision of the flow's record (an escalated incident): the new
        plan replaces the old one and a finished flow is open again.
        """
        flow = self.flow(flow_key, now)
        if "plan" in flow or "fin" in flow:
            if not replace or (flow.get("plan") == plan and "fin" not in flow):
                return False
        flow["plan"] = plan
        flow["rev"] = rev
        flow.pop("fin", None)
        flow.pop("status", None)
        return True

    def revision(self, flow_key: str) -> int:
        """Revision of the record the flow was last planned from (0 when unknown)."""
        return int((self.flows.get(flow_key) or {}).get("rev") or 0)

    def is_open(self, flow_key: str) -> bool:
        flow = self.flows.get(flow_key) or {}
        return "plan" in flow and "fin" not in flow

    def open_flows(self) -> list[str]:
        """Flows recorded and not finished, oldest first."""
        keys = [k for k in self.flows if self.is_open(k)]
        return sorted(keys, key=lambda k: float(self.flows[k].get("at", 0)))

    def stored_plan(self, flow_key: str) -> dict[str, Any] | None:
        return (self.flows.get(flow_key) or {}).get("plan")

    def finish(self, flow_key: str, status: str, now: float) -> None:
        """The flow ended; its record and plan are dropped (what it owns stays recorded for undo)."""
        flow = self.flow(flow_key, now)
        flow["fin"] = now
        flow["status"] = status
        flow.pop("plan", None)

    def is_finished(self, flow_key: str) -> bool:
        return "fin" in (self.flows.get(flow_key) or {})

    def done_at(self, flow_key: str, step: str) -> float | None:
        at = (self.flows.get(flow_key) or {}).get("done", {}).get(step)
        return None if at is None else float(at)

    def record_applied(self, flow_key: str, step: str, entry: dict[str, Any], now: float) -> None:
        """Who applied the step and with what result: the audit stays complete if the applier dies."""
        self.flow(flow_key, now).setdefault("log", {})[step] = entry

    def applied(self, flow_key: str, step: str) -> dict[str, Any] | None:
        return (self.flows.get(flow_key) or {}).get("log", {}).get(step)

    def prune(self, max_flows: int) -> None:
        """Forget the oldest finished flows that own nothing, keeping at most ``max_flows``."""
        owning = {f for owners in self.owned.values() for f in owners}
        owning |= {k for k in self.flows if self.is_open(k)}
        if len(self.flows) <= max_flows:
            return
        by_age = sorted(self.flows, key=lambda k: float(self.flows[k].get("at", 0)))
        for key in by_age:
            if len(self.flows) <= max_flows:
                break
            if key not in owning:
                del self.flows[key]

    # -- ownership -----------------------------------------------------------------------------
    def owners(self, effect: str) -> list[str]:
        return list(self.owned.get(effect, []))

    def own(self, effect: str, flow_key: str) -> None:
        owners = self.owned.setdefault(effect, [])
        if flow_key not in owners:
            owners.append(flow_key)

    def disown(self, effect: str, flow_key: str) -> bool:
        """Drop one owner; True when nobody owns the effect any more (the caller may remove it)."""
        owners = self.owned.get(effect, [])
        if flow_key in owners:
            owners.remove(flow_key)
        if not owners:
            self.owned.pop(effect, None)
            return True
        return False

    def effects_owned_by(self, flow_key: str) -> list[str]:
        return sorted(e for e, owners in self.owned.items() if flow_key in owners)

    def reconcile_manual_uncordon(self, unschedulable: bool, now: float) -> list[str]:
        """A node xidflow cordoned that is schedulable again was uncordoned by a person.

        That cancels every flow owning the cordon (no re-cordon on redelivery, no drain or reboot
        after it) and drops the cordon from ``owned``. Returns the cancelled flow keys.
        """
        owners = self.owned.get(CORDON, [])
        if unschedulable or not owners:
            return []
        for flow_key in owners:
            self.cancel(flow_key, "manual-uncordon", now)
        self.owned.pop(CORDON, None)
        if self.repairs:  # a person took the node back: the repair cases of those flows are over
            from pipeline.actuator import repaircase

            for cls, case in self.repairs.items():
                if set(case.get("flows") or ()) & set(owners):
                    repaircase.close(self, cls, now, "manual-uncordon: a person took the node back")
        return list(owners)

    # -- attempt cap ---------------------------------------------------------------------------
    def attempts_within(self, window: float, now: float) -> int:
        return sum(1 for t in self.attempts if now - t <= window)

    def record_attempt(self, now: float, window: float) -> None:
        self.attempts = [t for t in self.attempts if now - t <= window] + [now]


def flow_summary(ledger: Ledger) -> dict[str, list[str]]:
    """flow key -> effects it still owns, for ``xidflow status``."""
    return {f: ledger.effects_owned_by(f) for f in ledger.flows if ledger.effects_owned_by(f)}
