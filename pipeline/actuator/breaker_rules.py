"""The breaker's and the drain slots' decisions: pure functions over the state their ConfigMaps hold.

``pipeline.actuator.breaker`` reads and writes that state (``configmap_state``); here is what a write
decides: which nodes may be quarantined, when the breaker trips, how much headroom a replica may reserve
(``settle``), and who holds a drain slot. ``xidflow replay`` runs ``decide_admissions`` over history.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.actuator.ownership import CORDON, Ledger, is_shared_part_effect, taint_effect_key

RESERVED_KEY = "reserved"
"""In the breaker's state: holder -> {"n": slots, "at": when written}; see ``settle``."""
WAITING_KEY = "waiting"
"""In the breaker's state: holder -> when it last had a node wait for headroom others hold (``settle``)."""


@dataclass(frozen=True)
class Admission:
    allowed: bool
    reason: str = ""
    tripped_now: bool = False
    waiting: bool = False
    """Not decided: the headroom left is held by other replicas' reservations (ask again shortly)."""


def quarantined_by_xidflow(node: Mapping[str, Any], ledger: Ledger | None = None) -> bool:
    """Whether xidflow's own cordon or taint is on this Node now (its ledger owns it and it is in place).

    A person's cordon is not xidflow's quarantine, and neither is an idle warm-standby node, nor a
    shared-part taint (the part behind the node is blamed, not the node: ``pipeline.aggregate.sharedparts``).
    """
    meta, spec = node.get("metadata") or {}, node.get("spec") or {}
    if ledger is None:  # else the caller parsed the node's ledger already
        ledger = Ledger.from_annotations(meta.get("annotations"))
    if spec.get("unschedulable") and ledger.owners(CORDON):
        return True
    present = {taint_effect_key(str(t.get("key")), str(t.get("effect"))) for t in spec.get("taints") or []}
    return any(ledger.owners(effect) for effect in present if not is_shared_part_effect(effect))


def admitted_within(state: Mapping[str, Any], window: float, now: float) -> dict[str, float]:
    """Nodes the breaker admitted into quarantine within the window (node -> when). Pure."""
    return {n: t for n, t in (state.get("admitted") or {}).items() if now - float(t) <= window}


def in_fleet(admitted: Mapping[str, float], members: Collection[str] | None) -> set[str]:
    """The admitted nodes that are in the fleet now (all of them when its members are not known). Pure.

    The share counts GPU nodes of the fleet selector only: a node admitted before the selector changed, or
    one that left the fleet since (relabelled, deleted), is not one of them any more; it stays in the window
    (the selector may change back) but is not counted against the fleet's share."""
    return set(admitted) if members is None else {n for n in admitted if n in members}


def decide_admissions(
    state: dict[str, Any],
    nodes: list[str],
    fleet_size: int,
    max_share: float,
    window: float,
    now: float,
    quarantined_now: frozenset[str] = frozenset(),
    held: int = 0,
    members: Collection[str] | None = None,
    max_nodes: int = 0,
) -> dict[str, Admission]:
    """Admit nodes into quarantine while the share quarantined stays <= max_share (and, with ``max_nodes``, their
    count <= max_nodes: the absolute bound next to the share; 0 for none).

    The share counts every GPU node quarantined now (``quarantined_now``, read from the cluster) and
    every node admitted within the window (quarantines the cluster read may not show yet). A node
    already counted is admitted again for free (the cordon, the taint and a redelivery count once).
    The first node that would cross the threshold trips the breaker; only a person resets it, and
    a reset forgets the trip, not the nodes that are still quarantined.

    ``held``: slots other replicas reserved and may still fill. A node that fits under the limit only
    without them is not refused and does not trip: it waits (``Admission.waiting``) until they are
    used (counted then), handed back or expired. The trip is decided on real nodes only.

    ``members``: the fleet's nodes (the selector's) when known; admissions in the window of nodes outside it
    are not counted (``in_fleet``).
    """
    admitted = admitted_within(state, window, now)
    state["admitted"] = admitted
    fleet = max(fleet_size, 1)
    out: dict[str, Admission] = {}
    # One set, grown as nodes are admitted: a fresh union per node made a burst of b nodes on a fleet
    # with q quarantined cost b x q (seconds for a large burst on a large fleet).
    counted = in_fleet(admitted, members) | quarantined_now
    cap = breaker_cap(fleet_size, max_share, max_nodes)
    for node in nodes:
        if state.get("tripped"):
            out[node] = Admission(False, f"breaker open: {state.get('reason', '')}")
        elif node in counted:
            out[node] = Admission(True)
        elif len(counted) + 1 > cap:
            over_share = (len(counted) + 1) / fleet > max_share
            limit = f"limit {max_share:.0%}" if over_share else f"limit {max_nodes} nodes"
            state["tripped"] = True
            state["tripped_at"] = now
            state["reason"] = (
                f"quarantining {node} would put {len(counted) + 1} of {fleet} GPU nodes "
                f"({(len(counted) + 1) / fleet:.0%}) in quarantine ({len(quarantined_now)} quarantined now, "
                f"{len(in_fleet(admitted, members))} admitted within {window:g}s); {limit}"
            )
            state["tripped_by"] = node
            out[node] = Admission(False, f"breaker tripped: {state['reason']}", tripped_now=True)
        elif len(counted) + 1 + held > cap:
            out[node] = Admission(False, f"{held} slots of the breaker's headroom held by other replicas", waiting=True)
        else:
            admitted[node] = now
            counted.add(node)
            out[node] = Admission(True)
    return out


def breaker_cap(fleet_size: int, max_share: float, max_nodes: int = 0) -> int:
    """The most GPU nodes the breaker lets count at once: the largest k with k / fleet <= max_share, and at most
    ``max_nodes`` when it is set (not 0). Pure.

    The float comparison of the share (a product rounded down would differ from it by one node for shares
    such as 0.29).
    """
    fleet = max(fleet_size, 1)
    k = int(max_share * fleet)
    while (k + 1) / fleet <= max_share:
        k += 1
    while k > 0 and k / fleet > max_share:
        k -= 1
    return min(k, max_nodes) if max_nodes > 0 else k


def live_reservations(state: Mapping[str, Any], now: float, ttl: float) -> dict[str, dict[str, float]]:
    """Reservations renewed within ``ttl`` (holder -> {"n", "at"}); older ones belong to a dead replica. Pure."""
    return {
        h: r
        for h, r in (state.get(RESERVED_KEY) or {}).items()
        if now - float(r.get("at", 0)) <= ttl and int(r.get("n", 0)) > 0
    }


@dataclass(frozen=True)
class Settlement:
    """What one replica's write of the breaker's state decided (``settle``)."""

    decisions: dict[str, Admission]
    kept: bool
    """The replica's reservation was still live: the part of it it kept stays its own."""
    granted: int
    """Slots added to the replica's reservation by this write."""
    at: float
    """When the reservation was written (it lapses ``ttl`` later unless written again)."""
    tripped: bool
    contended: bool = False
    """Another replica has nodes waiting for headroom held in reservations: hand ours back."""


def settle(
    state: dict[str, Any],
    holder: str,
    nodes: list[str],
    used: Mapping[str, float],
    keep: int,
    want: int,
    fleet_size: int,
    max_share: float,
    window: float,
    now: float,
    ttl: float,
    quarantined_now: frozenset[str] = frozenset(),
    members: Collection[str] | None = None,
    max_nodes: int = 0,
) -> Settlement:
    """One replica's read-modify-write of the breaker: its admissions from its block, a batch, its new block. Pure.

    ``used``: nodes the replica admitted from its reservation since its last write; they enter the window
    here (until now the reservation counted them). ``keep``: the unused slots it goes on admitting from
    while this write is in flight (0 to hand them back); its reservation becomes ``keep`` plus a grant of
    up to ``want - keep``, never more than half the headroom left, so the other replicas always find some.
    ``nodes`` are decided by ``decide_admissions`` with every other live reservation held.

    Invariant (``tests/unit/test_breaker_reservations.py``): the nodes counted plus every live
    reservation never exceed ``breaker_cap``; a reservation is only ever filled by its holder.
    """
    reserved = live_reservations(state, now, ttl)
    own = reserved.pop(holder, None)
    kept = own is not None
    keep = min(keep, int(own["n"])) if own is not None else 0
    admitted = admitted_within(state, window, now)
    for node, at in used.items():
        admitted[node] = max(float(at), float(admitted.get(node, at)))
    state["admitted"] = admitted
    held = sum(int(r["n"]) for r in reserved.values())
    decisions = decide_admissions(state, nodes, fleet_size, max_share, window, now, quarantined_now, held + keep,
                                  members, max_nodes)
    tripped = bool(state.get("tripped"))
    counted = len(in_fleet(state["admitted"], members) | quarantined_now)
    free = breaker_cap(fleet_size, max_share, max_nodes) - counted - held - keep
    others_wait = any(h != holder and now - float(at) <= ttl for h, at in (state.get(WAITING_KEY) or {}).items())
    # An even share of what is not counted yet among the holders (at least two: an actuator runs with a
    # standby replica), so that two replicas splitting a burst both admit their half from their blocks.
    share = (breaker_cap(fleet_size, max_share, max_nodes) - counted) // max(2, len(reserved) + 1)
    granted = 0 if tripped or others_wait else max(0, min(want - keep, free, share - keep))
    if keep + granted > 0:
        reserved[holder] = {"n": keep + granted, "at": now}
    state[RESERVED_KEY] = dict(sorted(reserved.items()))
    # Who waits for held headroom: the holders see it in their next write and hand theirs back.
    waiting = {h: at for h, at in (state.get(WAITING_KEY) or {}).items() if now - float(at) <= ttl and h != holder}
    if any(d.waiting for d in decisions.values()):
        # Kept, not refreshed, while it waits: a retry that changes nothing writes nothing (a read), so it
        # never invalidates the write of the holder that is handing its slots back.
        previous = (state.get(WAITING_KEY) or {}).get(holder)
        waiting[holder] = previous if previous is not None and now - float(previous) <= ttl / 4 else now
    state[WAITING_KEY] = dict(sorted(waiting.items()))
    contended = any(h != holder for h in waiting)
    return Settlement(decisions, kept, granted, now, tripped, contended)


def take_drain_slot(state: dict[str, Any], node: str, worker: str, limit: int, stale_after: float, now: float) -> bool:
    slots = {n: s for n, s in (state.get("slots") or {}).items() if now - float(s.get("at", 0)) <= stale_after}
    state["slots"] = slots
    if node in slots:
        slots[node] = {"by": worker, "at": now}
        return True
    if len(slots) >= limit:
        return False
    slots[node] = {"by": worker, "at": now}
    return True


def take_group_slots(
    state: dict[str, Any], node: str, worker: str, caps: Mapping[str, int], stale_after: float, now: float
) -> str | None:
    """Take a repair slot in each of the node's groups, all or none (pure); None when taken, else a full group.

    ``state["groups"]``: ``"<label>=<value>"`` -> node -> ``{"by", "at"}``. A slot nobody renewed for
    ``stale_after`` seconds is free (its replica died); a node holding a slot already keeps it (a resumed step).
    """
    groups: dict[str, dict[str, Any]] = state.setdefault("groups", {})
    for key in list(groups):
        groups[key] = {n: s for n, s in groups[key].items() if now - float(s.get("at", 0)) <= stale_after}
        if not groups[key]:
            del groups[key]
    for key, cap in sorted(caps.items()):
        holders = groups.get(key, {})
        if node not in holders and len(holders) >= cap:
            return key
    for key in caps:
        groups.setdefault(key, {})[node] = {"by": worker, "at": now}
    return None


def group_holders(state: Mapping[str, Any], key: str) -> list[str]:
    """Nodes holding a slot of the group ``key`` (pure)."""
    return sorted((state.get("groups") or {}).get(key) or {})
