"""Repair budgets: at most N nodes (or a share) of a node group in a repair step at once, across replicas (I/O).

A RescuePolicy's ``repairBudgets`` name node labels (``topology.kubernetes.io/rack``, a node pool); each value
of such a label is a group. A drain, reboot, GPU reset or diagnostics step takes a slot in every group its
node belongs to before it starts (all or none, ``breaker_rules.take_group_slots``), renews it with its lease
and gives it back when it ends; a step whose group is full waits, its lease held, until a slot frees. The
slots live in one ConfigMap written with its resourceVersion, as the breaker's state does, so every replica
sees one budget; a slot whose replica died is free after the lease period.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from pipeline.actuator.breaker_rules import group_holders, take_group_slots
from pipeline.actuator.configmap_state import read_json_configmap, update_json_configmap
from pipeline.actuator.kube import Kube

log = logging.getLogger("xidflow.actuator.budgets")


class RepairBudgets:
    """The repair slots of the node groups the policies in force name."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        stale_after: float,
        budgets: Callable[[], tuple[Any, ...]],
        fleet_selector: str,
    ) -> None:
        self.kube, self.namespace, self.name = kube, namespace, name
        self.stale_after, self.budgets, self.fleet_selector = stale_after, budgets, fleet_selector
        self.sizes: Callable[[str, str], int | None] | None = None
        """Nodes of the fleet with ``label=value`` from a watch cache (the reconciler's); None: not known yet."""

    async def _size(self, label: str, value: str) -> int:
        known = self.sizes(label, value) if self.sizes is not None else None
        if known is not None:
            return known
        selector = ",".join(s for s in (self.fleet_selector, f"{label}={value}") if s)
        return len(await self.kube.list_nodes(selector))

    async def caps(self, labels: Mapping[str, str]) -> dict[str, int]:
        """``"<label>=<value>"`` -> nodes of that group that may be in repair at once, for a node's labels."""
        out: dict[str, int] = {}
        for budget in self.budgets():
            value = labels.get(budget.label)
            if value is None:
                continue
            size = await self._size(budget.label, value) if budget.max_share is not None else 0
            out[f"{budget.label}={value}"] = budget.cap(size)
        return out

    async def acquire(self, node: str, worker: str, labels: Mapping[str, str], poll: float = 1.0) -> dict[str, Any]:
        """Wait for a slot in each of the node's groups; what the wait was (for the step's audit record)."""
        caps = await self.caps(labels)
        if not caps:
            return {}
        start = time.monotonic()
        logged: str | None = None
        while True:
            full = await update_json_configmap(
                self.kube, self.namespace, self.name,
                lambda s: take_group_slots(s, node, worker, caps, self.stale_after, time.time()),
            )
            if full is None:
                waited = round(time.monotonic() - start, 1)
                return {"repair_budget": sorted(caps), **({"budget_waited_s": waited} if waited >= poll else {})}
            if full != logged:
                log.info("%s waits for a repair slot of %s (%d in repair)", node, full, caps[full])
                logged = full
            await asyncio.sleep(poll * random.uniform(0.5, 1.5))

    async def renew(self, node: str, worker: str) -> None:
        def mutate(state: dict[str, Any]) -> None:
            for holders in (state.get("groups") or {}).values():
                slot = holders.get(node)
                if slot and slot.get("by") == worker:
                    slot["at"] = time.time()

        await update_json_configmap(self.kube, self.namespace, self.name, mutate)

    async def release(self, node: str, worker: str) -> None:
        """Give the node's slots back, only where ``worker`` holds them (a replica that took the step over holds
        its own)."""

        def mutate(state: dict[str, Any]) -> None:
            groups = state.get("groups") or {}
            for key in list(groups):
                if (groups[key].get(node) or {}).get("by") == worker:
                    del groups[key][node]
                if not groups[key]:
                    del groups[key]

        await update_json_configmap(self.kube, self.namespace, self.name, mutate)

    async def holders(self, key: str) -> list[str]:
        return group_holders(await read_json_configmap(self.kube, self.namespace, self.name), key)
