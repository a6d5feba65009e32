"""Safety rails shared by every replica: the quarantine circuit breaker and cluster-wide drain slots (I/O).

Both keep their state in a ConfigMap written with its resourceVersion (optimistic concurrency), so
all replicas see one breaker and one drain budget. The decisions are pure functions over that
state (``breaker_rules``); ``Breaker`` batches concurrent admissions into one read-modify-write so
that a storm of incidents costs a few ConfigMap writes, not one per node.

Opt-in (``XIDFLOW_ACTUATOR_BREAKER_RESERVE_BLOCK``, default 0): in a burst each replica also reserves a
block of the breaker's headroom in that write (``settle``) and admits from it without asking again, so
two replicas do not queue every quarantine behind a ConfigMap write that the other one keeps
invalidating (409). The sum of the live reservations and the nodes counted never exceeds the limit; a
replica writes the nodes it admitted from its block into the window on its next write (every
``sync_seconds`` while it holds one), hands back what it did not use when the burst is over, and a
reservation nobody renews (its replica was SIGKILLed) expires after
``reservation_ttl`` seconds. That lapse is why it is off by default: in the bench a SIGKILLed actuator's
block held the survivor's admissions for the whole 20 s (failover p99 2 s -> 20 s), while the gain in a
burst on this 2-core machine was within its noise (admission p99 0.6-2.4 s -> 8 ms, burst p99 unchanged).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from pipeline.actuator.breaker_rules import (
    Admission,
    admitted_within,
    in_fleet,
    live_reservations,
    quarantined_by_xidflow,
    settle,
    take_drain_slot,
)
from pipeline.actuator.configmap_state import read_json_configmap, update_json_configmap
from pipeline.actuator.kube import API_PRIORITY, Kube
from pipeline.runtime import metrics

Fleet = tuple[int, frozenset[str], Collection[str]]
"""(GPU nodes of the fleet selector, those xidflow has quarantined now, their names)."""


class Breaker:
    """The circuit breaker on the share (and, with ``max_nodes``, the count) of GPU nodes quarantined in a window."""

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
        block: int = 0,
        sync_seconds: float = 0.25,
        reservation_ttl: float = 20.0,
        max_nodes: int = 0,
    ) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.fleet_selector, self.max_share, self.window = fleet_selector, max_share, window
        self.max_nodes = max_nodes
        """Absolute bound next to the share (``breaker_max_nodes``); 0: none."""
        self.fleet_cache_seconds = fleet_cache_seconds
        self.on_trip = on_trip
        self._fleet: tuple[float, Fleet] | None = None
        self.cache: Callable[[], Fleet | None] | None = None
        """(GPU nodes, those quarantined by xidflow, their names) kept by a list+watch of the same selector (the
        actuator's reconciler), None until it has listed. Admissions count the fleet from it instead of
        listing every node again: at 10,000 nodes that list is 20 pages parsed on the event loop, in the
        middle of the burst that asked. ``fresh`` reads (status, reset) still list."""
        self._pending: list[tuple[str, asyncio.Future[Admission]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._seen: dict[str, Any] = {}  # the breaker's ConfigMap as our last write left it
        # ``block`` 0 (the default, ``breaker_reserve_block``) reserves nothing: every admission is then decided
        # in the batched write, and nothing is written while idle. A standing
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

    async def fleet_snapshot(self, fresh: bool = False) -> Fleet:
        """GPU nodes in the fleet, those xidflow has quarantined now, and their names (cached
        ``fleet_cache_seconds``)."""
        now = time.monotonic()
        cached = None if fresh or self.cache is None else self.cache()
        if cached is not None:
            return cached
        if fresh or self._fleet is None or now - self._fleet[0] > self.fleet_cache_seconds:
            nodes = await self.kube.list_nodes(self.fleet_selector)
            quarantined = frozenset(n["metadata"]["name"] for n in nodes if quarantined_by_xidflow(n))
            self._fleet = (now, (len(nodes), quarantined, frozenset(n["metadata"]["name"] for n in nodes)))
        return self._fleet[1]

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
            if not self._pending and not self._topup_due() and not self.block:
                return  # no reservations: nothing to renew or hand back; the next admission starts us again
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
            fleet, quarantined, members = await self.fleet_snapshot()
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
                    members,
                    self.max_nodes,
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
        fleet, quarantined, members = await self.fleet_snapshot(fresh=True)
        admitted = in_fleet(admitted_within(state, self.window, now), members)
        metrics.BREAKER_OPEN.set(1 if state.get("tripped") else 0)
        reserved = live_reservations(state, now, self.reservation_ttl)
        return {
            "tripped": bool(state.get("tripped")),
            "reason": state.get("reason", ""),
            "tripped_at": state.get("tripped_at"),
            "quarantined_in_window": len(admitted),
            "quarantined_now": len(quarantined),
            "counted": len(admitted | quarantined),
            "fleet_size": fleet,
            "max_share": self.max_share,
            "max_nodes": self.max_nodes,
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
        _, quarantined, _ = await self.fleet_snapshot(fresh=True)

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
