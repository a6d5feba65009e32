"""Safety rails shared by every replica: the quarantine circuit breaker and cluster-wide drain slots.

Both keep their state in a ConfigMap written with its resourceVersion (optimistic concurrency), so
all replicas see one breaker and one drain budget. The decisions are pure functions over that
state; ``Breaker`` batches concurrent admissions into one read-modify-write so that a storm of
incidents costs a few ConfigMap writes, not one per node.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from pipeline.actuator.kube import API_PRIORITY, AlreadyExists, Conflict, Kube, KubeUnavailable, NotFound
from pipeline.actuator.ownership import CORDON, Ledger, is_shared_part_effect, taint_effect_key
from pipeline.runtime import metrics

T = TypeVar("T")
STATE_KEY = "state"
MANAGED_LABEL = {"app.kubernetes.io/managed-by": "xidflow"}


async def update_json_configmap(
    kube: Kube,
    namespace: str,
    name: str,
    mutate: Callable[[dict[str, Any]], T],
    attempts: int = 100,
    seen: dict[str, Any] | None = None,
) -> T:
    """Read-modify-write of the JSON in a ConfigMap; retried on 409 with fresh state.

    ``mutate`` changes the state in place and returns a result; it may run several times.
    ``seen`` keeps the ConfigMap as this caller last wrote it (under ``"cm"``): a write starts from it
    instead of reading first, conditional on its resourceVersion, so a writer nobody else interleaves
    with pays one call, not two; a 409 reads it fresh. A decision that writes nothing is always taken
    on a fresh read (nothing else would check it).
    """
    cached = seen.pop("cm", None) if seen is not None else None
    for _ in range(attempts):
        fresh = cached is None
        if cached is not None:
            cm, cached = cached, None
        else:
            try:
                cm = await kube.get_configmap(namespace, name)
            except NotFound:
                cm = None
        raw = ((cm or {}).get("data") or {}).get(STATE_KEY) or "{}"
        state = orjson.loads(raw)
        result = mutate(state)
        new_raw = orjson.dumps(state, option=orjson.OPT_SORT_KEYS).decode()
        if cm is not None and new_raw == raw:
            if not fresh:
                continue  # unchanged by our last write's view: decide on a fresh read
            if seen is not None:
                seen["cm"] = cm
            return result
        try:
            if cm is None:
                body = {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": name, "namespace": namespace, "labels": MANAGED_LABEL},
                    "data": {STATE_KEY: new_raw},
                }
                written = await kube.create_configmap(namespace, body)
            else:
                cm["data"] = {**(cm.get("data") or {}), STATE_KEY: new_raw}
                written = await kube.replace_configmap(namespace, name, cm)
        except (Conflict, AlreadyExists):
            if fresh:
                await asyncio.sleep(random.uniform(0.005, 0.05))
            continue
        if seen is not None and written:
            seen["cm"] = written
        return result
    raise KubeUnavailable(f"ConfigMap {namespace}/{name}: gave up after {attempts} conflicting writes")


async def read_json_configmap(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    try:
        cm = await kube.get_configmap(namespace, name)
    except NotFound:
        return {}
    return orjson.loads(((cm.get("data") or {}).get(STATE_KEY)) or "{}")


# -- breaker -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Admission:
    allowed: bool
    reason: str = ""
    tripped_now: bool = False


def quarantined_by_xidflow(node: Mapping[str, Any]) -> bool:
    """Whether xidflow's own cordon or taint is on this Node now (its ledger owns it and it is in place).

    A person's cordon is not xidflow's quarantine, and neither is an idle warm-standby node, nor a
    shared-part taint (the part behind the node is blamed, not the node: ``pipeline.aggregate.sharedparts``).
    """
    meta, spec = node.get("metadata") or {}, node.get("spec") or {}
    ledger = Ledger.from_annotations(meta.get("annotations"))
    if spec.get("unschedulable") and ledger.owners(CORDON):
        return True
    present = {taint_effect_key(str(t.get("key")), str(t.get("effect"))) for t in spec.get("taints") or []}
    return any(ledger.owners(effect) for effect in present if not is_shared_part_effect(effect))


def admitted_within(state: Mapping[str, Any], window: float, now: float) -> dict[str, float]:
    """Nodes the breaker admitted into quarantine within the window (node -> when). Pure."""
    return {n: t for n, t in (state.get("admitted") or {}).items() if now - float(t) <= window}


def decide_admissions(
    state: dict[str, Any],
    nodes: list[str],
    fleet_size: int,
    max_share: float,
    window: float,
    now: float,
    quarantined_now: frozenset[str] = frozenset(),
) -> dict[str, Admission]:
    """Admit nodes into quarantine while the share quarantined stays <= max_share.

    The share counts every GPU node quarantined now (``quarantined_now``, read from the cluster) and
    every node admitted within the window (quarantines the cluster read may not show yet). A node
    already counted is admitted again for free (the cordon, the taint and a redelivery count once).
    The first node that would cross the threshold trips the breaker; only a person resets it, and
    a reset forgets the trip, not the nodes that are still quarantined.
    """
    admitted = admitted_within(state, window, now)
    state["admitted"] = admitted
    fleet = max(fleet_size, 1)
    out: dict[str, Admission] = {}
    # One set, grown as nodes are admitted: a fresh union per node made a burst of b nodes on a fleet
    # with q quarantined cost b x q (seconds for a large burst on a large fleet).
    counted = set(admitted) | quarantined_now
    for node in nodes:
        if state.get("tripped"):
            out[node] = Admission(False, f"breaker open: {state.get('reason', '')}")
        elif node in counted:
            out[node] = Admission(True)
        elif (len(counted) + 1) / fleet > max_share:
            state["tripped"] = True
            state["tripped_at"] = now
            state["reason"] = (
                f"quarantining {node} would put {len(counted) + 1} of {fleet} GPU nodes "
                f"({(len(counted) + 1) / fleet:.0%}) in quarantine ({len(quarantined_now)} quarantined now, "
                f"{len(admitted)} admitted within {window:g}s); limit {max_share:.0%}"
            )
            state["tripped_by"] = node
            out[node] = Admission(False, f"breaker tripped: {state['reason']}", tripped_now=True)
        else:
            admitted[node] = now
            counted.add(node)
            out[node] = Admission(True)
    return out


class Breaker:
    """The circuit breaker on the share of GPU nodes quarantined within a window."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        fleet_selector: str,
        max_share: float,
        window: float,
        fleet_cache_seconds: float = 10,
        on_trip: Callable[[Admission, str], Awaitable[None]] | None = None,
    ) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.fleet_selector, self.max_share, self.window = fleet_selector, max_share, window
        self.fleet_cache_seconds = fleet_cache_seconds
        self.on_trip = on_trip
        self._fleet: tuple[float, int, frozenset[str]] | None = None
        self.cache: Callable[[], tuple[int, frozenset[str]] | None] | None = None
        """(GPU nodes, those quarantined by xidflow) kept by a list+watch of the same selector (the
        actuator's reconciler), None until it has listed. Admissions count the fleet from it instead of
        listing every node again: at 10,000 nodes that list is 20 pages parsed on the event loop, in the
        middle of the burst that asked. ``fresh`` reads (status, reset) still list."""
        self._pending: list[tuple[str, asyncio.Future[Admission]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._seen: dict[str, Any] = {}  # the breaker's ConfigMap as our last write left it

    async def fleet_snapshot(self, fresh: bool = False) -> tuple[int, frozenset[str]]:
        """GPU nodes in the fleet, and those xidflow has quarantined now (cached ``fleet_cache_seconds``)."""
        now = time.monotonic()
        cached = None if fresh or self.cache is None else self.cache()
        if cached is not None:
            return cached
        if fresh or self._fleet is None or now - self._fleet[0] > self.fleet_cache_seconds:
            nodes = await self.kube.list_nodes(self.fleet_selector)
            quarantined = frozenset(n["metadata"]["name"] for n in nodes if quarantined_by_xidflow(n))
            self._fleet = (now, len(nodes), quarantined)
        return self._fleet[1], self._fleet[2]

    async def fleet_size(self) -> int:
        return (await self.fleet_snapshot())[0]

    async def admit(self, node: str) -> Admission:
        fut: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        self._pending.append((node, fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await fut

    async def _flush(self) -> None:
        # Every quarantine of the batch waits for this read-modify-write: it goes ahead of the taints
        # already queued (priority 0), or each batch of admissions waits behind the previous batch's taints.
        API_PRIORITY.set(-1)
        while self._pending:
            batch, self._pending = self._pending, []
            nodes = list(dict.fromkeys(n for n, _ in batch))
            try:
                fleet, quarantined = await self.fleet_snapshot()
                decisions = await update_json_configmap(
                    self.kube,
                    self.namespace,
                    self.name,
                    lambda s, nodes=nodes, fleet=fleet, quarantined=quarantined: decide_admissions(
                        s, nodes, fleet, self.max_share, self.window, time.time(), quarantined
                    ),
                    seen=self._seen,
                )
            except Exception as exc:  # every waiter must learn of the failure, none may hang
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            metrics.BREAKER_OPEN.set(0 if all(d.allowed for d in decisions.values()) else 1)
            for node, decision in decisions.items():
                if decision.tripped_now and self.on_trip is not None:
                    await self.on_trip(decision, node)
            for node, fut in batch:
                if not fut.done():
                    fut.set_result(decisions[node])

    async def status(self) -> dict[str, Any]:
        state = await read_json_configmap(self.kube, self.namespace, self.name)
        now = time.time()
        admitted = admitted_within(state, self.window, now)
        fleet, quarantined = await self.fleet_snapshot(fresh=True)
        metrics.BREAKER_OPEN.set(1 if state.get("tripped") else 0)
        return {
            "tripped": bool(state.get("tripped")),
            "reason": state.get("reason", ""),
            "tripped_at": state.get("tripped_at"),
            "quarantined_in_window": len(admitted),
            "quarantined_now": len(quarantined),
            "counted": len(admitted.keys() | quarantined),
            "fleet_size": fleet,
            "max_share": self.max_share,
            "window_seconds": self.window,
            "reset_by": state.get("reset_by"),
            "reset_at": state.get("reset_at"),
        }

    async def reset(self, by: str) -> bool:
        """Close the breaker. True when it was open.

        The nodes quarantined now stay counted: the window restarts with them (read fresh from the
        cluster, so a replica whose fleet cache is a few seconds old cannot admit past the limit).
        """
        _, quarantined = await self.fleet_snapshot(fresh=True)

        def mutate(state: dict[str, Any]) -> bool:
            was = bool(state.get("tripped"))
            now = time.time()
            state.update(
                {
                    "tripped": False,
                    "reason": "",
                    "admitted": {node: now for node in sorted(quarantined)},
                    "reset_by": by,
                    "reset_at": now,
                }
            )
            state.pop("tripped_at", None)
            return was

        return await update_json_configmap(self.kube, self.namespace, self.name, mutate)


# -- drain slots -------------------------------------------------------------------------------------------
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


class DrainSlots:
    """A cluster-wide cap on nodes draining at once."""

    def __init__(self, kube: Kube, namespace: str, name: str, limit: int, stale_after: float) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.limit, self.stale_after = limit, stale_after

    async def acquire(self, node: str, worker: str, poll: float = 1.0) -> None:
        while True:
            taken = await update_json_configmap(
                self.kube,
                self.namespace,
                self.name,
                lambda s: take_drain_slot(s, node, worker, self.limit, self.stale_after, time.time()),
            )
            if taken:
                return
            # Another replica's drain must finish; its slot lives in the API server, not in this process.
            await asyncio.sleep(poll * random.uniform(0.5, 1.5))

    async def renew(self, node: str, worker: str) -> None:
        """Keep our slot fresh while the drain runs; a slot nobody renews is free after ``stale_after``."""

        def mutate(state: dict[str, Any]) -> None:
            slot = (state.get("slots") or {}).get(node)
            if slot and slot.get("by") == worker:
                slot["at"] = time.time()

        await update_json_configmap(self.kube, self.namespace, self.name, mutate)

    async def release(self, node: str) -> None:
        def mutate(state: dict[str, Any]) -> None:
            (state.get("slots") or {}).pop(node, None)

        await update_json_configmap(self.kube, self.namespace, self.name, mutate)

    async def holders(self) -> dict[str, Any]:
        return (await read_json_configmap(self.kube, self.namespace, self.name)).get("slots") or {}
