"""Policy what-if replay, the pure core: raw log records in, what a policy would have done out.

``xidflow replay`` (``pipeline.commands.replay``) reads the retained raw topics and hands the records
here. Nothing is re-implemented: the records go through the worker's own pure stages and the
actuator's own decisions, with the records' timestamps as the clock, so debounce, quiet periods,
attempt caps and the breaker window behave as they would have:

1. ``ParseCore`` (adapters, prefilter, ``Detector`` with the catalog) -> fault events;
2. ``Aggregator.step`` / ``Aggregator.tick`` (ticks every ``tick_interval_s`` of record time, as the
   worker's timer asks) -> incidents and recoveries;
3. ``plan_incident`` (policy selection, the ``quarantine`` macro, opt-out, attempt cap, escalation)
   -> steps; ``decide_admissions`` (the circuit breaker) before the first step that takes a node out
   of scheduling; ``plan_recovery_for`` on a recovery.
4. the aggregation's fabric signals -> ``pipeline.aggregate.sharedparts.observe`` per topology label value the
   policy names (``sharedParts``), with the cluster's node labels: the shared parts that would have
   been blamed instead of their nodes.

The actuator's effects are simulated on an in-memory Node per node (its ledger annotation, cordon and
taints): node-object actions (``Kind.NODE``) apply their own pure ``change``; every other action is
recorded as done and owns its ``effect_key``, as the effector records it. Actions are handled through
the registry (``pipeline.actuator.actions``), so a new action shows up without a change here.

Assumptions, stated in the report: every step succeeds at once (waits, drains and reboots take no
time); the fleet starts the window with nothing quarantined by xidflow; a tripped breaker stays open
(only a person resets it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from pipeline.actuator import actions
from pipeline.actuator.actions import Kind, StepContext
from pipeline.actuator.breaker import decide_admissions, quarantined_by_xidflow
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import LEDGER_ANNOTATION, Ledger
from pipeline.actuator.plan import Plan, plan_incident, plan_recovery_for
from pipeline.actuator.policy import PolicySet
from pipeline.actuator.settings import ActuatorSettings
from pipeline.aggregate.aggregator import Aggregator
from pipeline.aggregate.settings import AggregationSettings
from pipeline.aggregate.sharedparts import PartState, observe, part_key
from pipeline.aggregate.state import NodeState
from pipeline.detection.catalog import Catalog
from pipeline.detection.parse_core import ParseCore
from pipeline.detection.parse_settings import ParseSettings
from pipeline.runtime.settings import TopicNames
from schemas.records import FabricSignal, NodeIncident, NodeRecovered

DEFAULT_TICK_INTERVAL_S = 10.0
"""The worker's default ``XIDFLOW_WORKER_TICK_INTERVAL_S``."""


# -- input -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RawLog:
    """One record of a raw topic, as ``ParseCore`` reads it (aiokafka's ConsumerRecord has the same)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int
    """Milliseconds since the epoch (the record's Kafka timestamp): the replay's clock."""
    headers: Sequence[tuple[str, bytes]] = ()


@dataclass(frozen=True)
class Window:
    """Records with ``since <= timestamp < until`` (epoch seconds) are replayed."""

    since: float
    until: float

    def holds(self, ts_ms: int) -> bool:
        return self.since * 1000 <= ts_ms < self.until * 1000


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class WindowError(ValueError):
    """A --since/--until that is neither a duration nor a time; the message is one sentence."""


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``7d``, ``2w`` -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise WindowError(f"{text!r} is not a duration (a number and one of s, m, h, d, w: 90s, 30m, 12h, 7d)")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def parse_bound(text: str, now: float) -> float:
    """A duration ago (``7d``) or an ISO-8601 time (``2026-11-20T08:00:00Z``; UTC when no zone) -> epoch s."""
    if _DURATION.match(text):
        return now - parse_duration(text)
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise WindowError(
            f"{text!r} is neither a duration (7d, 12h, 30m) nor an ISO-8601 time (2026-11-20T08:00:00Z)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def make_window(since: str, until: str | None, now: float) -> Window:
    start = parse_bound(since, now)
    end = parse_bound(until, now) if until else now
    if end <= start:
        raise WindowError(f"--until ({iso(end)}) is not after --since ({iso(start)})")
    if start > now:
        raise WindowError(f"--since ({iso(start)}) is in the future")
    return Window(start, end)


def merged(partitions: Iterable[Sequence[RawLog]]) -> Iterator[RawLog]:
    """Records of several partitions in timestamp order; each partition keeps its own order (per node)."""
    return heapq.merge(*partitions, key=lambda r: r.timestamp)


# -- configuration -------------------------------------------------------------------------------------------
@dataclass
class ReplayConfig:
    """One policy's what-if: the policy, the catalog overrides file, and the worker/actuator settings."""

    policies: PolicySet
    catalog_overrides: str | None = None
    """A catalog overrides file for this run (None: the catalog in force, ``XIDFLOW_CATALOG_OVERRIDES``)."""
    actuator: ActuatorSettings = field(default_factory=ActuatorSettings)
    aggregation: AggregationSettings = field(default_factory=AggregationSettings)
    parse: ParseSettings = field(default_factory=ParseSettings)
    topics: TopicNames = field(default_factory=TopicNames)
    tick_interval_s: float = DEFAULT_TICK_INTERVAL_S
    fleet_labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Labels of the GPU nodes known (from the cluster): rules' node selectors and opt-out read them."""
    fleet_size: int | None = None
    """The breaker's denominator; None: the GPU nodes known, else the nodes seen in the history."""


@contextlib.contextmanager
def catalog_in_force(overrides: str | None) -> Iterator[Catalog]:
    """The catalog every stage uses for this run (``Catalog.configured``): the overrides file, if given.

    The worker and actuator reach the catalog through ``XIDFLOW_CATALOG_OVERRIDES`` (the detector, the
    aggregator, the actuator's problem mapping and policy matching all read it), so the run sets it for
    its duration instead of threading a second catalog through code that has one way to get it.
    """
    if overrides is None:
        yield Catalog.configured()
        return
    previous = os.environ.get("XIDFLOW_CATALOG_OVERRIDES")
    os.environ["XIDFLOW_CATALOG_OVERRIDES"] = os.path.abspath(overrides)
    try:
        yield Catalog.configured()
    finally:
        if previous is None:
            os.environ.pop("XIDFLOW_CATALOG_OVERRIDES", None)
        else:
            os.environ["XIDFLOW_CATALOG_OVERRIDES"] = previous


# -- output ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Taken:
    """One step that would have been applied."""

    node: str
    action: str
    at: float
    incident: str
    rule: str
    gpu: str | None
    fault: str
    quarantining: bool


@dataclass
class Trip:
    """The breaker tripping, and the nodes it then refused."""

    at: float
    tripped_by: str
    reason: str
    refused: list[str] = field(default_factory=list)
    refusals: int = 0


@dataclass
class Simulation:
    """What one policy would have done over the window."""

    taken: list[Taken] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    trips: list[Trip] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)
    recovered: list[dict[str, Any]] = field(default_factory=list)
    records: int = 0
    outside_window: int = 0
    events: int = 0
    dead_letters: int = 0
    incidents: int = 0
    fleet_size: int = 0
    fleet_source: str = ""
    first_ts: float | None = None
    last_ts: float | None = None
    parts: dict[str, PartState] = field(default_factory=dict)
    """Shared-part correlation by ``label=value`` (``pipeline.aggregate.sharedparts``)."""


# -- the simulated fleet -------------------------------------------------------------------------------------
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


class _Actuator:
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
            self.quarantined(),
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


# -- the run -----------------------------------------------------------------------------------------------------
def simulate(records: Iterable[RawLog], config: ReplayConfig, window: Window) -> Simulation:
    """Replay ``records`` (in timestamp order, each node's in offset order) through one policy."""
    from pipeline.detection.detector import Detector

    records = list(records)
    sim = Simulation()
    seen_nodes = {_node_of(r) for r in records if window.holds(r.timestamp)} - {None}
    if config.fleet_size:
        sim.fleet_size, sim.fleet_source = config.fleet_size, "given"
    elif config.fleet_labels:
        sim.fleet_size, sim.fleet_source = len(config.fleet_labels), "GPU nodes in the cluster"
    else:
        sim.fleet_size, sim.fleet_source = max(1, len(seen_nodes)), "nodes seen in the history"
    with catalog_in_force(config.catalog_overrides) as catalog:
        core = ParseCore(config.topics, config.parse, detector_factory=lambda: Detector(catalog))
        aggregator = Aggregator(config.aggregation, catalog)
        actuator = _Actuator(config, sim, sim.fleet_size)
        states: dict[str, NodeState] = {}
        next_tick: float | None = None
        now = window.since

        def apply(events: Iterable[Any], at: float) -> None:
            for event in events:
                sim.events += 1
                state = states.get(event.node) or aggregator.new_state(event.node)
                signals: list[FabricSignal] = []
                states[event.node], outputs = aggregator.step(state, event, at, signals=signals)
                route(outputs, at)
                for signal in signals:
                    actuator.fabric(signal, at)

        def route(outputs: Iterable[NodeIncident | NodeRecovered], at: float) -> None:
            for out in outputs:
                if isinstance(out, NodeIncident):
                    actuator.incident(out, at)
                else:
                    actuator.recovered(out, at)

        for rec in records:
            if not window.holds(rec.timestamp):
                sim.outside_window += 1
                continue
            sim.records += 1
            now = max(now, rec.timestamp / 1000)
            sim.first_ts = now if sim.first_ts is None else sim.first_ts
            sim.last_ts = now
            # The worker's timer: quiet periods are checked every tick_interval_s (here, of record time).
            if next_tick is None:
                next_tick = now + config.tick_interval_s
            while next_tick <= now:
                for name, state in list(states.items()):
                    if state.has_transient():
                        states[name], outputs = aggregator.tick(state, next_tick)
                        route(outputs, next_tick)
                next_tick += config.tick_interval_s
            result = core.process([rec], now, topic=rec.topic)
            sim.dead_letters += len(result.dead_letters)
            apply(result.events, now)
        apply(core.detector.flush(), now)  # what the detector still holds for folding
    return sim


def _node_of(rec: RawLog) -> str | None:
    return rec.key.decode("utf-8", "replace") if rec.key else None


# -- the report ---------------------------------------------------------------------------------------------
def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


ACTION_ORDER = {name: i for i, name in enumerate(actions.ACTION_NAMES)}


def _sorted_actions(names: Iterable[str]) -> list[str]:
    return sorted(set(names), key=lambda n: (ACTION_ORDER.get(n, len(ACTION_ORDER)), n))


def node_rows(sim: Simulation) -> list[dict[str, Any]]:
    """Per node: what would have been applied (actions in policy order), on which GPUs, by which rules."""
    by_node: dict[str, list[Taken]] = {}
    for t in sim.taken:
        by_node.setdefault(t.node, []).append(t)
    refused = {r["node"] for r in sim.refused}
    rows = []
    for node in sorted(by_node.keys() | refused):
        taken = by_node.get(node, [])
        rows.append({
            "node": node,
            "quarantined": any(t.quarantining for t in taken),
            "actions": _sorted_actions(t.action for t in taken),
            "gpus": sorted({t.gpu for t in taken if t.gpu}),
            "faults": sorted({t.fault for t in taken}),
            "rules": sorted({t.rule for t in taken}),
            "incidents": len({t.incident for t in taken}),
            "first": iso(min((t.at for t in taken), default=None)),
            "refused_by_breaker": node in refused,
            "recovered": sum(1 for r in sim.recovered if r["node"] == node),
        })
    return rows


def action_rows(sim: Simulation) -> list[dict[str, Any]]:
    """Per action: how many times it would have been applied and on how many distinct nodes."""
    counts: dict[str, list[Taken]] = {}
    for t in sim.taken:
        counts.setdefault(t.action, []).append(t)
    return [
        {"action": a, "applied": len(counts[a]), "nodes": len({t.node for t in counts[a]}),
         "gpus": len({(t.node, t.gpu) for t in counts[a] if t.gpu})}
        for a in _sorted_actions(counts)
    ]


def diff_rows(candidate: Simulation, baseline: Simulation) -> list[dict[str, Any]]:
    """(node, action) pairs one policy applies and the other does not, with the rules that decided."""
    def index(sim: Simulation) -> dict[tuple[str, str], list[Taken]]:
        out: dict[tuple[str, str], list[Taken]] = {}
        for t in sim.taken:
            out.setdefault((t.node, t.action), []).append(t)
        return out

    cand, base = index(candidate), index(baseline)
    cand_rules = _rules_by_node(candidate)
    base_rules = _rules_by_node(baseline)
    rows = []
    for node, action in sorted(cand.keys() ^ base.keys(),
                               key=lambda k: (k[0], ACTION_ORDER.get(k[1], len(ACTION_ORDER)), k[1])):
        added = (node, action) in cand
        taken = (cand if added else base)[(node, action)]
        rows.append({
            "node": node,
            "action": action,
            "change": "added" if added else "removed",
            "gpus": sorted({t.gpu for t in taken if t.gpu}),
            "candidate_rules": cand_rules.get(node, []),
            "baseline_rules": base_rules.get(node, []),
        })
    return rows


def _rules_by_node(sim: Simulation) -> dict[str, list[str]]:
    out: dict[str, set[str]] = {}
    for t in sim.taken:
        out.setdefault(t.node, set()).add(t.rule)
    return {k: sorted(v) for k, v in out.items()}


def part_rows(sim: Simulation) -> list[dict[str, Any]]:
    """Shared parts the policy would have blamed (one incident each) instead of quarantining their nodes."""
    rows = []
    for key, part in sorted(sim.parts.items()):
        inc = part.incident
        if inc is None:
            continue
        rows.append({"part": key, "name": inc.part, "nodes": list(inc.nodes), "faults": list(inc.fault_classes),
                     "opened": inc.opened_at.isoformat(timespec="seconds").replace("+00:00", "Z"),
                     "first_seen": iso(inc.first_seen.timestamp()), "incident": inc.incident_id})
    return rows


def trip_rows(sim: Simulation, policy: str) -> list[dict[str, Any]]:
    return [
        {"policy": policy, "at": iso(t.at), "tripped_by": t.tripped_by, "nodes_refused": len(t.refused),
         "refusals": t.refusals, "refused": list(t.refused), "reason": t.reason}
        for t in sim.trips
    ]


def report(
    candidate: Simulation,
    baseline: Simulation,
    *,
    window: Window,
    policy: str,
    baseline_source: str,
    catalog: str,
    topics: Sequence[str],
) -> dict[str, Any]:
    """The whole report, as data (``-o json|yaml`` prints it; the table shows its sections)."""
    return {
        "window": {"since": iso(window.since), "until": iso(window.until)},
        "topics": list(topics),
        "policy": policy,
        "baseline": baseline_source,
        "catalog": catalog,
        "fleet": {"size": candidate.fleet_size, "source": candidate.fleet_source},
        "history": {
            "records_replayed": candidate.records,
            "outside_window": candidate.outside_window,
            "first": iso(candidate.first_ts),
            "last": iso(candidate.last_ts),
            "fault_events": candidate.events,
            "dead_letters": candidate.dead_letters,
            "incident_records": candidate.incidents,
        },
        "nodes": node_rows(candidate),
        "actions": action_rows(candidate),
        "diff": diff_rows(candidate, baseline),
        "shared_parts": part_rows(candidate),
        "breaker_trips": trip_rows(candidate, "candidate") + trip_rows(baseline, "baseline"),
        "skipped": candidate.skipped,
        "assumptions": [
            "every step succeeds at once (policy waits, drains and reboots take no time)",
            "the fleet starts the window with no node quarantined by xidflow and a closed breaker",
            "a tripped breaker stays open for the rest of the window (only a person resets it)",
            "nothing was changed on the cluster and no consumer offsets were committed",
        ],
    }
