"""Safety rails shared by every replica: the quarantine circuit breaker and cluster-wide drain slots.

Both keep their state in a ConfigMap written with its resourceVersion (optimistic concurrency), so
all replicas see one breaker and one drain budget. The decisions are pure functions over that
state; ``Breaker`` batches concurrent admissions into one read-modify-write so that a storm of
incidents costs a few ConfigMap writes, not one per node.

In a burst each replica also reserves a block of the breaker's headroom in that write (``settle``) and
admits from it without asking again, so two replicas do not queue every quarantine behind a
ConfigMap write that the other one keeps invalidating (409). The sum of the live reservations and the
nodes counted never exceeds the limit; a replica writes the nodes it admitted from its block into the
window on its next write (every ``sync_seconds`` while it holds one), hands back what it did not use
when the burst is over, and a reservation nobody renews (its replica was SIGKILLed) expires after
``reservation_ttl`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from pipeline.actuator.kube import API_PRIORITY, AlreadyExists, Conflict, Kube, KubeUnavailable, NotFound
from pipeline.actuator.ownership import CORDON, Ledger, is_shared_part_effect, taint_effect_key
from pipeline.runtime import metrics

T = TypeVar("T")
STATE_KEY = "state"
RESERVED_KEY = "reserved"
"""In the breaker's state: holder -> {"n": slots, "at": when written}; see ``settle``."""
WAITING_KEY = "waiting"
"""In the breaker's state: holder -> when it last had a node wait for headroom others hold (``settle``)."""
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
    waiting: bool = False
    """Not decided: the headroom left is held by other replicas' reservations (ask again shortly)."""


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
    held: int = 0,
) -> dict[str, Admission]:
    """Admit nodes into quarantine while the share quarantined stays <= max_share.

    The share counts every GPU node quarantined now (``quarantined_now``, read from the cluster) and
    every node admitted within the window (quarantines the cluster read may not show yet). A node
    already counted is admitted again for free (the cordon, the taint and a redelivery count once).
    The first node that would cross the threshold trips the breaker; only a person resets it, and
    a reset forgets the trip, not the nodes that are still quarantined.

    ``held``: slots other replicas reserved and may still fill. A node that fits under the limit only
    without them is not refused and does not trip: it waits (``Admission.waiting``) until they are
    used (counted then), handed back or expired. The trip is decided on real nodes only.
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
        elif (len(counted) + 1 + held) / fleet > max_share:
            out[node] = Admission(False, f"{held} slots of the breaker's headroom held by other replicas", waiting=True)
        else:
            admitted[node] = now
            counted.add(node)
            out[node] = Admission(True)
    return out


def breaker_cap(fleet_size: int, max_share: float) -> int:
    """The most GPU nodes the breaker lets count at once: the largest k with k / fleet <= max_share. Pure.

    The same float comparison as ``decide_admissions`` (a product rounded down would differ from it by one
    node for shares such as 0.29).
    """
    fleet = max(fleet_size, 1)
    k = int(max_share * fleet)
    while (k + 1) / fleet <= max_share:
        k += 1
    while k > 0 and k / fleet > max_share:
        k -= 1
    return k


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
    decisions = decide_admissions(state, nodes, fleet_size, max_share, window, now, quarantined_now, held + keep)
    tripped = bool(state.get("tripped"))
    counted = len(state["admitted"].keys() | quarantined_now)
    free = breaker_cap(fleet_size, max_share) - counted - held - keep
    others_wait = any(h != holder and now - float(at) <= ttl for h, at in (state.get(WAITING_KEY) or {}).items())
    # An even share of what is not counted yet among the holders (at least two: an actuator runs with a
    # standby replica), so that two replicas splitting a burst both admit their half from their blocks.
    share = (breaker_cap(fleet_size, max_share) - counted) // max(2, len(reserved) + 1)
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
        block: int = 256,
        sync_seconds: float = 0.25,
        reservation_ttl: float = 20.0,
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
        # ``block`` 0 reserves nothing: every admission is then decided in the batched write. A standing
        # block (renewed while idle) lets the first wave of a burst in without waiting for a write.
        # The reservation (``settle``): at most ``block`` slots, written at least every ``sync_seconds`` while
        # held, lapsing ``reservation_ttl`` after its last write. We stop admitting from it half a TTL before
        # the others may count it lapsed: a node admitted from it just before this replica died is tainted
        # (and seen quarantined by the others' watches) by then.
        self.block, self.sync_seconds, self.reservation_ttl = block, sync_seconds, reservation_ttl
        # One holder per process, not per worker id: a restarted replica must not take over (and overwrite)
        # the reservation its dead predecessor may have filled with nodes not yet written into the window.
        self.holder = f"{uuid.uuid4().hex[:12]}"
        self._slots = 0  # unused slots of our reservation
        self._valid_until = 0.0  # local clock: admit from the reservation only before this
        self._used: dict[str, float] = {}  # admitted from the reservation, not yet in the window
        self._since_write = 0  # admissions from the reservation since our last write
        self._starved = False  # the last write could grant nothing: no top-up until a write frees some
        self._tripped = False  # as our last write saw it
        self._active = False  # admitted from the block since it was last handed back (a burst is on)
        self._last_local = 0.0  # when we last admitted from the block
        self._contended = False  # another replica waits for headroom held in reservations (our last write)
        self._wake = asyncio.Event()
        self.local_admissions = 0
        self.writes = 0

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
        if self._from_reservation(node):
            return Admission(True)
        fut: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        self._pending.append((node, fut))
        self._kick()
        return await fut

    def _from_reservation(self, node: str) -> bool:
        """Admit from our reserved slots, without a call: True when it did."""
        now = time.time()
        if self._tripped or now >= self._valid_until:
            return False
        if node not in self._used:  # a node admitted from it before (a redelivery) costs no second slot
            if self._slots <= 0:
                return False
            self._slots -= 1
            self._used[node] = now
            self._since_write += 1
            self.local_admissions += 1
            self._active, self._last_local = True, now
        if self._topup_due():
            self._kick()  # write before the block runs dry; admissions go on from what is left meanwhile
        elif self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())  # the periodic write of what we admitted
        return True

    def _linger(self) -> float:
        """How long the flusher waits for work before its next write of the reservation."""
        if self._contended:
            return self.sync_seconds / 5  # others wait for what we hold: hand it back as soon as we can
        if self._used or self._active:
            return self.sync_seconds  # the window must learn of the nodes we admitted from the block
        return self.reservation_ttl / 8  # idle: renew it (a burst then starts from it, without a write)

    def _topup_due(self) -> bool:
        return self._since_write > 0 and not self._starved and not self._contended and self._slots < self.block // 2

    def _kick(self) -> None:
        self._wake.set()
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())

    async def _flush(self) -> None:
        # Every quarantine of the batch waits for this read-modify-write: it goes ahead of the taints
        # already queued (priority 0), or each batch of admissions waits behind the previous batch's taints.
        API_PRIORITY.set(-1)
        while True:
            if not self._pending and not self._topup_due():
                # Holding a reservation with nothing waiting: write what we admitted from it within
                # sync_seconds (the window must learn of them, and the reservation must not lapse), and
                # hand it back once a whole period passed without an admission from it (the burst is over).
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    # Others wait for what we hold: hand it back as soon as we stop admitting from it.
                    await asyncio.wait_for(self._wake.wait(), self._linger())
                if not self._pending and not self._topup_due():
                    # Hand the block back when another replica waits for it, or as soon as a burst is over
                    # (a sync period without an admission from it, in the same write that records the last
                    # ones): the tail of a burst on the other replica must not wait for it. Idle, it is
                    # taken again in the next renewal.
                    burst_over = self._active and time.time() - self._last_local >= self.sync_seconds
                    if not await self._write([], release=self._contended or burst_over):
                        await asyncio.sleep(self.sync_seconds)  # the API server failed us: do not spin
                    continue
            # Slots our last write granted serve the nodes that queued while it was in flight first: decided
            # centrally instead, they would leave the slots unused, held from the other replicas.
            batch = []
            for node, fut in self._pending:
                if not fut.done() and self._from_reservation(node):
                    fut.set_result(Admission(True))
                else:
                    batch.append((node, fut))
            self._pending = []
            if batch or self._topup_due():
                await self._write(batch, release=False)

    async def _write(self, batch: list[tuple[str, asyncio.Future[Admission]]], release: bool) -> bool:
        """One ``settle`` of the ConfigMap: the batch decided, our admissions recorded, our block renewed."""
        nodes = list(dict.fromkeys(n for n, _ in batch))
        used = dict(self._used)
        if release:
            self._slots = 0
        keep = self._slots if time.time() < self._valid_until and not self._tripped else 0
        want = 0 if release else self.block
        since, self._since_write = self._since_write, 0
        try:
            fleet, quarantined = await self.fleet_snapshot()
            result = await update_json_configmap(
                self.kube,
                self.namespace,
                self.name,
                lambda s: settle(
                    s,
                    self.holder,
                    nodes,
                    used,
                    keep,
                    want,
                    fleet,
                    self.max_share,
                    self.window,
                    time.time(),
                    self.reservation_ttl,
                    quarantined,
                ),
                seen=self._seen,
            )
        except Exception as exc:  # every waiter must learn of the failure, none may hang
            self._since_write += since
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return False
        self.writes += 1
        if release:
            self._active = False
        for node, at in used.items():
            if self._used.get(node) == at:
                del self._used[node]
        # Slots taken from ``keep`` while the write was in flight are covered by it; a reservation that had
        # lapsed meanwhile is not ours any more (what was admitted from it is quarantined by now).
        self._slots = (self._slots if result.kept else 0) + result.granted
        if self._slots:
            self._valid_until = result.at + self.reservation_ttl / 2
        self._starved = result.granted == 0 and want > keep
        self._tripped, self._contended = result.tripped, result.contended
        metrics.BREAKER_OPEN.set(1 if result.tripped else 0)
        for node, decision in result.decisions.items():
            if decision.tripped_now and self.on_trip is not None:
                await self.on_trip(decision, node)
        waiting = []
        for node, fut in batch:
            decision = result.decisions[node]
            if fut.done():
                continue
            if decision.waiting and not self._from_reservation(node):
                waiting.append((node, fut))
            else:
                fut.set_result(Admission(True) if decision.waiting else decision)
        if waiting:
            # The headroom is held by other replicas: they fill it, hand it back within sync_seconds or
            # their reservation lapses (a dead one). Ask again shortly.
            await asyncio.sleep(random.uniform(0.03, 0.08))
            self._pending[:0] = waiting
        return True

    async def close(self) -> None:
        """Stop writing; write the nodes admitted from our block and hand it back (bounded, best effort).

        After the consumer stopped (no admission comes any more). Without it the reservation lapses after
        ``reservation_ttl`` and the nodes admitted from it count as quarantined (the watch) meanwhile.
        """
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
            self._flusher = None
        if self._used or self._slots > 0:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._write([], release=True), 5)

    async def status(self) -> dict[str, Any]:
        state = await read_json_configmap(self.kube, self.namespace, self.name)
        now = time.time()
        admitted = admitted_within(state, self.window, now)
        fleet, quarantined = await self.fleet_snapshot(fresh=True)
        metrics.BREAKER_OPEN.set(1 if state.get("tripped") else 0)
        reserved = live_reservations(state, now, self.reservation_ttl)
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
            # Headroom replicas took in a burst: nodes admitted from it are counted above only once the
            # replica writes them (within its sync period); until then the reservation counts for them.
            "reserved": sum(int(r["n"]) for r in reserved.values()),
            "reservations": {
                h: {"slots": int(r["n"]), "lapses_in_s": round(float(r["at"]) + self.reservation_ttl - now, 1)}
                for h, r in reserved.items()
            },
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
