"""From an incident (or a rescue request, or a recovery) to an ordered list of steps. Pure.

The engine executes the steps; here we only decide: which rule applies, what ``quarantine``
expands to, whether the node opted out, whether a person cancelled the flow, whether the attempt
cap escalates the incident to CONTACT_SUPPORT, and what undo may remove.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.actuator.ownership import (
    CORDON,
    Ledger,
    condition_effect_key,
    request_flow_key,
    taint_effect_key,
)
from pipeline.actuator.policy import ActionSpec, PolicySet, Rule
from pipeline.actuator.problems import Problem, classify_incident
from pipeline.actuator.settings import ActuatorSettings
from schemas.records import Action, NodeIncident, NodeRecovered

# Steps that take the node out of scheduling: they go through the circuit breaker.
QUARANTINING = frozenset({"cordon", "taint"})
# Steps that disrupt workloads or hardware: they count against the per-node attempt cap.
DISRUPTIVE = frozenset({"drain", "reboot", "resetGpu"})
# Under CONTACT_SUPPORT escalation a person takes over: no automated reboot/reset/uncordon.
ESCALATION_DROPS = frozenset({"reboot", "resetGpu", "unCordon"})


@dataclass(frozen=True)
class NodeView:
    """What the planner needs to know about a Node, read from its JSON object."""

    name: str
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    unschedulable: bool
    taints: tuple[Mapping[str, Any], ...]
    ready: bool
    boot_id: str
    resource_version: str
    conditions: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def from_object(cls, node: Mapping[str, Any]) -> NodeView:
        meta = node.get("metadata") or {}
        spec = node.get("spec") or {}
        status = node.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
        return cls(
            name=meta.get("name", ""),
            labels=meta.get("labels") or {},
            annotations=meta.get("annotations") or {},
            unschedulable=bool(spec.get("unschedulable")),
            taints=tuple(spec.get("taints") or ()),
            ready=ready,
            boot_id=(status.get("nodeInfo") or {}).get("bootID", ""),
            resource_version=meta.get("resourceVersion", ""),
            conditions=tuple(status.get("conditions") or ()),
        )

    def condition(self, condition_type: str) -> Mapping[str, Any] | None:
        return next((c for c in self.conditions if c.get("type") == condition_type), None)

    @property
    def ledger(self) -> Ledger:
        return Ledger.from_annotations(self.annotations)

    def opted_out(self, opt_out_label: str) -> bool:
        return str(self.labels.get(opt_out_label, "")).lower() == "true"


@dataclass(frozen=True)
class Step:
    key: str
    """Unique within the flow: the action name, ``#2``, ``#3`` for repeats."""
    spec: ActionSpec
    effect: str | None = None
    """Ownership key of what the step leaves on the node (cordon, taint:..., condition:...)."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def quarantining(self) -> bool:
        return self.spec.name in QUARANTINING

    @property
    def disruptive(self) -> bool:
        return self.spec.name in DISRUPTIVE


@dataclass(frozen=True)
class Plan:
    flow_key: str
    node: str
    rule: str
    steps: tuple[Step, ...] = ()
    skip_reason: str | None = None
    """Set when nothing at all may happen (opt-out, cancelled by a person, manual-only mode)."""
    escalated: bool = False
    """The attempt cap turned this flow into CONTACT_SUPPORT."""
    new_attempt: bool = False
    """The engine records an attempt on the node when this flow starts."""
    problem: Problem | None = None
    details: dict[str, Any] = field(default_factory=dict)


def _keyed_steps(specs: list[ActionSpec], settings: ActuatorSettings, problem: Problem | None) -> tuple[Step, ...]:
    seen: dict[str, int] = {}
    steps: list[Step] = []
    for spec in specs:
        seen[spec.name] = seen.get(spec.name, 0) + 1
        key = spec.name if seen[spec.name] == 1 else f"{spec.name}#{seen[spec.name]}"
        effect: str | None = None
        if spec.name == "cordon":
            effect = CORDON
        elif spec.name == "taint":
            effect = taint_effect_key(spec.key or settings.taint_key, spec.effect or settings.taint_effect)
        elif spec.name == "condition" and problem is not None:
            effect = condition_effect_key(problem.condition_type)
        steps.append(Step(key=key, spec=spec, effect=effect))
    return tuple(steps)


def expand_actions(rule: Rule, incident: NodeIncident) -> list[ActionSpec]:
    """``quarantine`` is cordon + taint + condition + event when the catalog says so, condition + event for
    ALERT, event only for RESTART_APP, nothing for IGNORE."""
    out: list[ActionSpec] = []
    for spec in rule.actions:
        if spec.name != "quarantine":
            out.append(spec)
            continue
        if incident.quarantine or incident.action.quarantines:
            attrs = (("key", spec.key), ("value", spec.value), ("effect", spec.effect))
            taint = {k: v for k, v in attrs if v}
            out += [
                ActionSpec(name="cordon"),
                ActionSpec(name="taint", **taint),
                ActionSpec(name="condition"),
                ActionSpec(name="event"),
            ]
        elif incident.action is Action.ALERT:  # alert only: tell a person and repair tooling, keep serving
            out += [ActionSpec(name="condition"), ActionSpec(name="event")]
        elif incident.action is not Action.IGNORE:  # IGNORE: nothing on the node
            out.append(ActionSpec(name="event"))
    return out


def _escalate(specs: list[ActionSpec]) -> list[ActionSpec]:
    kept = [s for s in specs if s.name not in ESCALATION_DROPS]
    names = {s.name for s in kept}
    # CONTACT_SUPPORT always quarantines and tells the repair tooling, whatever the rule said.
    head = [ActionSpec(name=n) for n in ("cordon", "taint", "condition", "event") if n not in names]
    return head + kept


def plan_incident(
    incident: NodeIncident,
    policies: PolicySet,
    node: NodeView,
    settings: ActuatorSettings,
    now: float,
) -> Plan:
    """The steps for one incident on one node, in order."""
    ledger = node.ledger
    problem = classify_incident(incident)
    rule = policies.select(incident.kind, incident.code, node.labels)
    base = {"flow_key": incident.incident_id, "node": node.name, "rule": rule.name, "problem": problem}
    if node.opted_out(settings.opt_out_label):
        return Plan(**base, skip_reason=f"opt-out label {settings.opt_out_label}=true")
    if settings.manual_only:
        return Plan(**base, skip_reason="manual-only mode: automatic policies are off")
    cancelled = ledger.cancelled(incident.incident_id)
    if cancelled:
        return Plan(**base, skip_reason=f"cancelled: {cancelled}")
    if not node.unschedulable and incident.incident_id in ledger.owners(CORDON):
        return Plan(**base, skip_reason="cancelled: manual-uncordon")

    specs = expand_actions(rule, incident)
    escalated = incident.action == Action.CONTACT_SUPPORT and any(s.name in ESCALATION_DROPS for s in specs)
    is_new_flow = incident.incident_id not in ledger.flows
    disruptive = any(s.name in DISRUPTIVE for s in specs)
    over_cap = (
        is_new_flow
        and disruptive
        and ledger.attempts_within(settings.attempt_window_seconds, now) >= settings.attempt_cap
    )
    details: dict[str, Any] = {}
    if over_cap or escalated:
        specs = _escalate(specs)
        escalated = True
        details["escalation"] = (
            f"attempt cap {settings.attempt_cap} per {settings.attempt_window_seconds:g}s reached"
            if over_cap
            else "incident action is CONTACT_SUPPORT"
        )
    return Plan(
        **base,
        steps=_keyed_steps(specs, settings, problem),
        escalated=escalated,
        new_attempt=is_new_flow and disruptive and not over_cap,
        details=details,
    )


def plan_request(request: Any, node: NodeView, settings: ActuatorSettings) -> Plan:
    """The steps of a third-party rescue request (``RescueActionRequest``), in the order given."""
    flow_key = request_flow_key(request.request_id)
    base = {"flow_key": flow_key, "node": node.name, "rule": "rescue-request"}
    if node.opted_out(settings.opt_out_label):
        return Plan(**base, skip_reason=f"opt-out label {settings.opt_out_label}=true")
    cancelled = node.ledger.cancelled(flow_key)
    if cancelled:
        return Plan(**base, skip_reason=f"cancelled: {cancelled}")
    specs = [ActionSpec(name=a.name, waittime=float(a.waittime)) for a in request.actions]
    return Plan(**base, steps=_keyed_steps(specs, settings, None), details={"xid": request.xid})


@dataclass(frozen=True)
class UndoPlan:
    flow_key: str
    node: str
    uncordon: bool
    remove_taints: tuple[tuple[str, str], ...]
    """(key, effect) of taints to remove."""
    clear_conditions: tuple[str, ...]
    disown: tuple[str, ...]
    """Every effect key the flow stops owning (some stay because another flow still owns them)."""


def plan_recovery(recovered: NodeRecovered, node: NodeView) -> UndoPlan:
    """What to remove when an incident recovers: only what this flow applied and nobody else owns."""
    ledger = node.ledger
    flow = recovered.incident_id
    uncordon = False
    taints: list[tuple[str, str]] = []
    conditions: list[str] = []
    mine = ledger.effects_owned_by(flow)
    for effect in mine:
        if ledger.owners(effect) != [flow]:
            continue  # another open incident still needs it
        if effect == CORDON:
            uncordon = node.unschedulable
        elif effect.startswith("taint:"):
            _, rest = effect.split(":", 1)
            key, eff = rest.rsplit(":", 1)
            taints.append((key, eff))
        elif effect.startswith("condition:"):
            conditions.append(effect.split(":", 1)[1])
    return UndoPlan(flow, node.name, uncordon, tuple(taints), tuple(conditions), tuple(mine))
