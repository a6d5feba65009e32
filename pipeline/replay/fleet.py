"""The simulated fleet: the actuator's decisions in dry-run on in-memory nodes, at record time.

``pipeline.replay.run.simulate`` hands it incidents, recoveries and fabric signals; it plans with the
actuator's own ``plan_incident``/``plan_recovery_for``, admits through the circuit breaker's
``decide_admissions``, applies node-object actions through their own pure ``change``, and writes
what it did into the ``pipeline.replay.outcome.Simulation``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pipeline.actuator.actions import Kind, StepContext
from pipeline.actuator.breaker_rules import decide_admissions, quarantined_by_xidflow
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import LEDGER_ANNOTATION, Ledger
from pipeline.actuator.plan import Plan, plan_incident, plan_recovery_for
from pipeline.aggregate.sharedparts import PartState, observe, part_key
from pipeline.replay.config import ReplayConfig
from pipeline.replay.outcome import Simulation, Taken, Trip
from pipeline.replay.window import iso
from schemas.records import FabricSignal, NodeIncident, NodeRecovered


@dataclass
class _Node:
    view: NodeView
    ledger: Ledger

    def current(self) -> NodeView:
        annotations = {**self.view.annotations, LEDGER_ANNOTATION: self.ledger.to_annotation()}
        return dataclasses.replace(self.view, annotations=annotations)

    def as_object(self) -> dict[str, Any]:
        return {
            "metadata": {"name": self.view.name, "annotations": {LEDGER_ANNOTATION: self.ledger.to_annotation()}},
            "spec": {"unschedulable": self.view.unschedulable, "taints": [dict(t) for t in self.view.taints]},
        }


class ReplayActuator:
    """The actuator's decisions in dry-run, on simulated nodes, at record time."""

    def __init__(self, config: ReplayConfig, sim: Simulation, fleet_size: int) -> None:
        self.config, self.sim, self.fleet_size = config, sim, fleet_size
        self.settings = config.actuator.model_copy(update={"dry_run": False})
        self.nodes: dict[str, _Node] = {}
        self.breaker: dict[str, Any] = {}
        self.trip: Trip | None = None
        self._quarantined: set[str] = set()

    def node(self, name: str) -> _Node:
        found = self.nodes.get(name)
        if found is None:
            labels = dict(self.config.fleet_labels.get(name) or {})
            view = NodeView(name=name, labels=labels, annotations={}, unschedulable=False, taints=(), ready=True,
                            boot_id="", resource_version="")
            found = self.nodes[name] = _Node(view, Ledger())
        return found

    def quarantined(self) -> frozenset[str]:
        """Nodes xidflow has quarantined now (what the breaker reads from the cluster)."""
        return frozenset(self._quarantined)

    def _note(self, node: _Node) -> None:
        if quarantined_by_xidflow(node.as_object()):
            self._quarantined.add(node.view.name)
        else:
            self._quarantined.discard(node.view.name)

    def incident(self, incident: NodeIncident, now: float) -> None:
        self.sim.incidents += 1
        node = self.node(incident.node)
        flow = incident.incident_id
        known = flow in node.ledger.flows
        if known and incident.revision <= node.ledger.revision(flow):
            return  # a redelivery: the engine keeps the plan it recorded
        plan = plan_incident(incident, self.config.policies, node.current(), self.settings, now)
        fault = incident.signature
        if plan.skip_reason:
            self.sim.skipped.append({"node": incident.node, "incident": flow, "at": iso(now),
                                     "reason": plan.skip_reason})
            return
        ledger = node.ledger
        ledger.open_flow(flow, {"rule": plan.rule}, now, rev=incident.revision, replace=True)
        if plan.new_attempt:
            ledger.record_attempt(now, self.settings.attempt_window_seconds)
        refused: str | None = None
        for step in plan.steps:
            if ledger.is_done(flow, step.key):
                continue
            if refused is None and step.quarantining and node.view.name not in self._quarantined:
                refused = self._admit(node.view.name, incident, now)
            if refused is not None and not step.action.allowed_when_breaker_open:
                continue
            self._apply(node, plan, step, incident, now)
            self.sim.taken.append(Taken(
                node=incident.node, action=step.name, at=now, incident=flow, rule=plan.rule, gpu=incident.pci,
                fault=fault, quarantining=step.quarantining,
            ))
        if refused is None:
            ledger.finish(flow, "done", now)

    def _admit(self, node: str, incident: NodeIncident, now: float) -> str | None:
        s = self.settings
        decision = decide_admissions(
            self.breaker, [node], self.fleet_size, s.breaker_max_share, s.breaker_window_seconds, now,
            self.quarantined(), max_nodes=s.breaker_max_nodes,
        )[node]
        if decision.allowed:
            return None
        if decision.tripped_now:
            self.trip = Trip(at=now, tripped_by=node, reason=str(self.breaker.get("reason", "")))
            self.sim.trips.append(self.trip)
        if self.trip is not None:
            self.trip.refusals += 1
            if node not in self.trip.refused:
                self.trip.refused.append(node)
        self.sim.refused.append({"node": node, "incident": incident.incident_id, "at": iso(now),
                                 "reason": decision.reason})
        return decision.reason

    def _apply(self, node: _Node, plan: Plan, step: Any, incident: NodeIncident, now: float) -> None:
        """Record the step as the effector would: a node change through the action's own pure ``change``."""
        ledger, flow = node.ledger, plan.flow_key
        action = step.action
        if action.kind == Kind.NODE and action.change is not None:
            ctx = StepContext(kube=None, writer=None, settings=self.settings, worker="replay", plan=plan,  # type: ignore[arg-type]
                              view=node.current(), incident=incident, drains=None, policies=None)  # type: ignore[arg-type]
            change = action.change(node.current(), ledger, step, ctx)
            spec = change.spec
            node.view = dataclasses.replace(
                node.view,
                unschedulable=spec.get("unschedulable", node.view.unschedulable),
                taints=tuple(spec.get("taints", node.view.taints)),
            )
        elif step.effect:
            ledger.own(step.effect, flow)
        ledger.mark_done(flow, step.key, now)
        self._note(node)

    def fabric(self, signal: FabricSignal, now: float) -> None:
        """A fabric signal, as the actuator's shared-part correlation takes it (the node's labels, the policy)."""
        labels = self.node(signal.node).view.labels
        for rule in self.config.policies.shared_parts:
            value = labels.get(rule.label)
            if not value:
                continue
            key = part_key(rule.label, str(value))
            part = self.sim.parts.setdefault(key, PartState(label=rule.label, value=str(value)))
            observe(part, signal, part=rule.part, min_nodes=rule.min_nodes, window_s=rule.window, rule=rule.part,
                    now=datetime.fromtimestamp(now, UTC))

    def recovered(self, recovered: NodeRecovered, now: float) -> None:
        node = self.nodes.get(recovered.node)
        if node is None:
            return
        undo = plan_recovery_for(recovered.incident_id, node.current())
        if not undo.disown:
            return
        ledger = node.ledger
        for effect in undo.disown:
            ledger.disown(effect, recovered.incident_id)
        remove = set(undo.remove_taints)
        node.view = dataclasses.replace(
            node.view,
            unschedulable=False if undo.uncordon else node.view.unschedulable,
            taints=tuple(t for t in node.view.taints if (t.get("key"), t.get("effect")) not in remove),
        )
        self._note(node)
        self.sim.recovered.append({"node": recovered.node, "incident": recovered.incident_id, "at": iso(now),
                                   "reason": recovered.reason})
