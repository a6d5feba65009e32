"""The replay's report, as data: per node, per action, the diff against the baseline, shared parts, trips.

Reads two ``pipeline.replay.outcome.Simulation``s (the candidate policy's and the baseline's);
``pipeline.commands.replay`` prints the result (``-o json|yaml``, or the table of its sections).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pipeline.actuator import actions
from pipeline.replay.outcome import Simulation, Taken
from pipeline.replay.window import Window, iso

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
