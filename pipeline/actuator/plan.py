"""From an incident (or a rescue request, or a recovery) to an ordered list of steps. Pure.

The engine executes the steps; here we only decide: which rule applies, what ``quarantine``
expands to, whether the node opted out, whether a person cancelled the flow, whether the attempt
cap escalates the incident to CONTACT_SUPPORT, and what undo may remove.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.actuator import actions, repaircase
from pipeline.actuator.actions import Kind
from pipeline.actuator.actions.taint_device import EFFECT_PREFIX as DEVICE_RULE_EFFECT_PREFIX
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import CORDON, Ledger, request_flow_key
from pipeline.actuator.policy import ActionSpec, PolicySet, Rule
from pipeline.actuator.problems import Problem, classify_incident
from pipeline.actuator.settings import ActuatorSettings
from pipeline.aggregate.sharedparts import blamed_on_part
from pipeline.detection.catalog import Catalog
from schemas.records import Action, NodeIncident, NodeRecovered, RescueActionRequest

__all__ = [
    "NodeView",
    "Plan",
    "Step",
    "UndoPlan",
    "expand_actions",
    "group_steps",
    "plan_from_ledger",
    "plan_incident",
    "plan_recovery",
    "plan_recovery_for",
    "plan_request",
]

# Steps that take the node out of scheduling: they go through the circuit breaker.
QUARANTINING = actions.names(quarantining=True)
# Steps that disrupt workloads or hardware: they count against the per-node attempt cap.
DISRUPTIVE = actions.names(disruptive=True)
# Under CONTACT_SUPPORT escalation a person takes over: no automated reboot/reset/uncordon.
ESCALATION_DROPS = actions.names(dropped_on_escalation=True)


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
    def action(self) -> actions.ActionDef:
        return actions.get(self.spec.name)

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
    case: repaircase.Decision | None = None
    """The repair case the incident opens, joins or continues (a rule with the repair loop), recorded with the
    flow's first write (``join``: by itself, nothing else is written)."""
    case_policy: dict[str, Any] = field(default_factory=dict)
    """What a new case keeps of the rule's ``repair`` block (window, maxFailedRepairs, webhookUrl)."""
    case_again: tuple[dict[str, Any], ...] = ()
    """The rule's repair steps and diagnose, run again after a failed diagnostics."""


# Repair steps (reboot, resetGpu): a retry of a case runs the rule from the first one on.
REPAIRS = actions.names(repairs=True)


def _keyed_steps(specs: list[ActionSpec], settings: ActuatorSettings, problem: Problem | None) -> tuple[Step, ...]:
    seen: dict[str, int] = {}
    steps: list[Step] = []
    for spec in specs:
        seen[spec.name] = seen.get(spec.name, 0) + 1
        key = spec.name if seen[spec.name] == 1 else f"{spec.name}#{seen[spec.name]}"
        owner = actions.get(spec.name).effect_key
        effect = owner(spec, settings, problem) if owner else None
        steps.append(Step(key=key, spec=spec, effect=effect))
    return tuple(steps)


def expand_actions(rule: Rule, incident: NodeIncident) -> list[ActionSpec]:
    """``quarantine`` is cordon + taint + condition + event when the catalog says so, condition + event for
    ALERT, event only for RESTART_APP, nothing for IGNORE."""
    out: list[ActionSpec] = []
    for spec in rule.actions:
        expand = actions.get(spec.name).expand
        # A macro names its actions as plain data (the actions package sits below this module): validate here.
        out += [ActionSpec(name=name, **attrs) for name, attrs in expand(spec, incident)] if expand else [spec]
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
    """The steps for one incident on one node, in order.

    The flow is the incident's id, or, for a revision of an incident that comes back in a repair case after
    its flow ended (``repaircase.revision_flow``), a flow of that revision: its repair runs again.
    """
    ledger = node.ledger
    problem = classify_incident(incident)
    rule = policies.select(incident.kind, incident.code, node.labels)
    flow_key = repaircase.flow_of(ledger, incident.incident_id, incident.revision)
    base = {"flow_key": flow_key, "node": node.name, "rule": rule.name, "problem": problem}
    if node.opted_out(settings.opt_out_label):
        return Plan(**base, skip_reason=f"opt-out label {settings.opt_out_label}=true")
    if settings.manual_only:
        return Plan(**base, skip_reason="manual-only mode: automatic policies are off")
    cancelled = ledger.cancelled(flow_key)
    if cancelled:
        return Plan(**base, skip_reason=f"cancelled: {cancelled}")
    if not node.unschedulable and flow_key in ledger.owners(CORDON):
        return Plan(**base, skip_reason="cancelled: manual-uncordon")
    part = open_part(ledger)
    if part and flow_key not in ledger.flows and blamed_on_part(
        incident.kind, incident.code, incident.signature, Catalog.configured()
    ):
        # The part behind the node is blamed already (pipeline.actuator.sharedparts): its rule applies, not
        # the node's quarantine. Only a new flow: one the node's rule already started goes on.
        return Plan(**base, skip_reason=f"blamed on shared part {part}")

    loop = rule.repair_loop
    held = repaircase.untouched(ledger)
    cls = str(problem.condition_type)
    if held and not _in_case(ledger, flow_key):
        # Handed off (or being handed off): the external repair system has the node. A fault of the case's
        # class is recorded in the case (its evidence travels with the next hand-off); nothing starts.
        join = repaircase.Decision("join", cls, incident.incident_id) if repaircase.case_of(ledger, cls) else None
        return Plan(**base, skip_reason=f"{held}: xidflow does not touch the node", case=join)
    decision: repaircase.Decision | None = None
    if loop is not None and repaircase.seen(ledger, cls, incident.incident_id, incident.revision):
        if not _in_case(ledger, flow_key):  # a redelivery of a fault that joined the case: it started nothing
            case_id = (repaircase.case_of(ledger, cls) or {}).get("case")
            return Plan(**base, skip_reason=f"recorded in repair case {case_id} already")
    elif loop is not None:
        decision = repaircase.decide(ledger, cls, incident.incident_id, now, loop.window, loop.max_failed_repairs)
        if decision.kind == "join":
            return Plan(**base, skip_reason=f"{decision.reason} (fault recorded in the case)", case=decision)
        if decision.kind in ("relapse", "escalate") and flow_key in ledger.flows:
            # The incident's flow ended with an earlier repair: this revision is a flow of its own in the case.
            flow_key = base["flow_key"] = repaircase.revision_flow(incident.incident_id, incident.revision)
    specs = expand_actions(rule, incident)
    case_fields: dict[str, Any] = {}
    if loop is not None:
        first = next((i for i, s in enumerate(specs) if s.name in REPAIRS), None)
        again = specs[first:] if first is not None else []  # no repair to run again: a failed gate hands off
        case_fields = {
            "case": decision,
            "case_policy": {"window": loop.window, "maxFailedRepairs": loop.max_failed_repairs,
                            **({"webhookUrl": loop.handoff.webhook_url} if loop.handoff.webhook_url else {})},
            "case_again": tuple(s.model_dump(mode="json", by_alias=True, exclude_defaults=True) for s in again),
        }
    if decision is not None and decision.kind == "escalate":
        # Repairs did not hold: the node goes out (the rule's quarantine and drain), and to hardware inspection.
        specs = [s for s in specs if s.name not in ESCALATION_DROPS] + [
            ActionSpec.model_validate(step) for step in repaircase.INSPECTION_STEPS
        ]
        case_fields["details"] = {"escalation": decision.reason}
    escalated = incident.action == Action.CONTACT_SUPPORT and any(s.name in ESCALATION_DROPS for s in specs)
    is_new_flow = flow_key not in ledger.flows
    disruptive = any(s.name in DISRUPTIVE for s in specs)
    over_cap = (
        is_new_flow
        and disruptive
        and ledger.attempts_within(settings.attempt_window_seconds, now) >= settings.attempt_cap
    )
    details: dict[str, Any] = case_fields.pop("details", {})
    if over_cap or escalated:
        specs = _escalate(specs)
        if loop is not None and not any(s.name == "hardwareInspection" for s in specs):
            # A rule with the repair loop hands the node off instead of leaving it to a person unannounced.
            specs += [ActionSpec.model_validate(step) for step in repaircase.INSPECTION_STEPS]
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
        **case_fields,
    )


def _in_case(ledger: Ledger, flow: str) -> bool:
    return repaircase.case_of_flow(ledger, flow) is not None


def open_part(ledger: Ledger) -> str | None:
    """``label=value`` of a shared part blamed on this node whose effects are still on it (owned), else None."""
    for flow, rec in ledger.flows.items():
        if rec.get("part") and ledger.effects_owned_by(flow):
            return str(rec["part"])
    return None


def plan_request(request: RescueActionRequest, node: NodeView, settings: ActuatorSettings) -> Plan:
    """The steps of a third-party rescue request (``RescueActionRequest``), in the order given."""
    flow_key = request_flow_key(request.request_id)
    base = {"flow_key": flow_key, "node": node.name, "rule": "rescue-request"}
    if node.opted_out(settings.opt_out_label):
        return Plan(**base, skip_reason=f"opt-out label {settings.opt_out_label}=true")
    cancelled = node.ledger.cancelled(flow_key)
    if cancelled:
        return Plan(**base, skip_reason=f"cancelled: {cancelled}")
    held = repaircase.untouched(node.ledger)
    if held and flow_key not in node.ledger.flows:
        return Plan(**base, skip_reason=f"{held}: xidflow does not touch the node")
    specs = [ActionSpec(name=a.name, waittime=float(a.waittime)) for a in request.actions]
    return Plan(**base, steps=_keyed_steps(specs, settings, None), details={"xid": request.xid})


def stored(plan: Plan, record: NodeIncident | RescueActionRequest) -> dict[str, Any]:
    """What the ledger keeps of an open flow, so any replica can drive it to the end without its record."""
    return {
        "rec": record.model_dump(mode="json"),
        "rule": plan.rule,
        "esc": plan.escalated,
        "steps": [s.spec.model_dump(mode="json", by_alias=True, exclude_defaults=True) for s in plan.steps],
    }


def plan_from_ledger(
    node: NodeView, flow_key: str, settings: ActuatorSettings
) -> tuple[Plan, NodeIncident | RescueActionRequest] | None:
    """The plan of an open flow as recorded when it started (policy edits since do not change it)."""
    from schemas.records import ACTUATOR_INPUT

    kept = node.ledger.stored_plan(flow_key)
    if not kept:
        return None
    record = ACTUATOR_INPUT.validate_python(kept["rec"])
    if isinstance(record, NodeRecovered):
        return None
    problem = classify_incident(record) if isinstance(record, NodeIncident) else None
    specs = [ActionSpec.model_validate(s) for s in kept.get("steps") or []]
    plan = Plan(
        flow_key=flow_key,
        node=node.name,
        rule=str(kept.get("rule", "")),
        steps=_keyed_steps(specs, settings, problem),
        escalated=bool(kept.get("esc")),
        problem=problem,
    )
    return plan, record


def group_steps(steps: tuple[Step, ...]) -> list[list[Step]]:
    """Consecutive node-write steps together, consecutive instant steps together, long steps alone.

    A step with a wait after it closes its group so the wait falls where the policy put it.
    """
    groups: list[list[Step]] = []
    for step in steps:
        kind = step.action.kind
        last = groups[-1] if groups else None
        groupable = kind in (Kind.NODE, Kind.INSTANT)
        if groupable and last and last[0].action.kind == kind and not last[-1].spec.waittime:
            last.append(step)
        else:
            groups.append([step])
    return groups


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
    delete_device_rules: tuple[str, ...] = ()
    """Names of xidflow's DeviceTaintRules to delete (taintDevice)."""


def plan_recovery(recovered: NodeRecovered, node: NodeView) -> UndoPlan:
    """What to remove when an incident recovers: only what this flow applied and nobody else owns."""
    return plan_recovery_for(recovered.incident_id, node)


def plan_recovery_for(flow: str, node: NodeView) -> UndoPlan:
    ledger = node.ledger
    uncordon = False
    taints: list[tuple[str, str]] = []
    conditions: list[str] = []
    rules: list[str] = []
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
        elif effect.startswith(DEVICE_RULE_EFFECT_PREFIX):
            rules.append(effect.removeprefix(DEVICE_RULE_EFFECT_PREFIX))
    return UndoPlan(flow, node.name, uncordon, tuple(taints), tuple(conditions), tuple(mine), tuple(rules))
