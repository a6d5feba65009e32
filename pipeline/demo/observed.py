"""What Kubernetes did to the demo's workloads, read from the API server: the pods that moved, the budgets kept.

Pure: the runner feeds it what it lists and watches. ``PodMoves`` follows the workloads' pods from one
listing to the next: a pod that left its node (evicted by a drain, then finalised by KWOK) and the
pod its controller made in its place (the StatefulSet controller re-creates it under the same name, a
ReplicaSet under a new one), on the node the scheduler chose. ``Budgets`` keeps, per
PodDisruptionBudget, the lowest healthy count the disruption controller reported against the count it
desired: every status it wrote, from a watch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.demo.fleet import APP_LABEL, running

HEALTHY = "Ready"
"""The state word (``pipeline.demo.view.node_state``) of a node a pod may be placed on."""


@dataclass
class Move:
    """A pod that left ``source`` and the pod its controller made in its place."""

    workload: str  # the workload's name (its ``app`` label)
    owner: str  # the kind of controller that re-creates it: StatefulSet or ReplicaSet
    evicted: str  # the pod that left
    source: str  # the node it left
    left_at: float
    pod: str = ""  # the replacement ("" until its controller made it)
    target: str = ""  # where the scheduler placed it ("" while Pending)
    target_state: str = ""  # that node's state when the pod was placed there
    placed_at: float | None = None
    running: bool = False

    @property
    def status(self) -> str:
        if not self.pod:
            return "not re-created"
        return "Running" if self.running else "Pending"

    @property
    def healthy(self) -> bool:
        """Re-created, running, and placed on a node that was in service at the time."""
        return self.running and self.target_state == HEALTHY


@dataclass(frozen=True)
class _Seen:
    uid: str
    name: str
    workload: str
    owner: str
    node: str
    running: bool


def _seen(pod: Mapping[str, Any]) -> _Seen | None:
    """The pod as the tracker keeps it; None when it is being deleted (it has left its node)."""
    meta = pod.get("metadata") or {}
    if meta.get("deletionTimestamp"):
        return None
    owners = meta.get("ownerReferences") or []
    return _Seen(uid=meta.get("uid") or meta.get("name", ""), name=meta.get("name", ""),
                 workload=(meta.get("labels") or {}).get(APP_LABEL, ""),
                 owner=owners[0].get("kind", "") if owners else "",
                 node=(pod.get("spec") or {}).get("nodeName") or "", running=running(pod))


@dataclass
class PodMoves:
    """Pods that moved, from successive listings of the workloads' pods and the nodes' states."""

    moves: list[Move] = field(default_factory=list)
    _pods: dict[str, _Seen] | None = None
    _states: dict[str, str] = field(default_factory=dict)
    _replacing: dict[str, Move] = field(default_factory=dict)  # a replacement's uid -> its move

    def observe(self, pods: Iterable[Mapping[str, Any]], states: Mapping[str, str], now: float) -> None:
        """One listing of the pods and each node's state word at that moment. The first is the fleet as it started.

        A pod gone from the listing, or being deleted, has left its node: a move, until its controller's new
        pod (the next new pod of the same workload) appears and the scheduler places it. A placement counts
        against a node only when the node was out of service at both ends of the interval in which it
        happened (the previous listing and this one). A replacement that leaves in turn moves again.
        """
        current = {s.uid: s for s in map(_seen, pods) if s is not None}
        if self._pods is None:
            self._pods, self._states = current, dict(states)
            return
        for uid, old in self._pods.items():
            if uid in current:
                continue
            self._replacing.pop(uid, None)
            if old.node:
                self.moves.append(Move(old.workload, old.owner, old.name, old.node, now))
        for uid, new in current.items():
            move = self._replacing.get(uid)
            if move is None and uid not in self._pods:
                move = next((m for m in self.moves if not m.pod and m.workload == new.workload), None)
                if move is not None:
                    self._replacing[uid] = move
            if move is None:
                continue  # a pod that stayed where it was, or a pod nobody left room for (a scale-up)
            move.pod, move.running = new.name, new.running
            if new.node and not move.target:
                before = self._states.get(new.node, states.get(new.node, ""))
                move.target, move.placed_at = new.node, now
                move.target_state = before if before == HEALTHY else states.get(new.node, "")
        self._pods, self._states = current, dict(states)


@dataclass
class Budget:
    """The lowest healthy count the disruption controller reported for one PDB, against what it desired."""

    name: str
    lowest_healthy: int | None = None
    desired_then: int | None = None
    statuses: int = 0

    @property
    def margin(self) -> int | None:
        """The fewest healthy pods beyond the desired count the controller ever reported (None: no status yet)."""
        if self.lowest_healthy is None or self.desired_then is None:
            return None
        return self.lowest_healthy - self.desired_then

    @property
    def respected(self) -> bool:
        return self.margin is not None and self.margin >= 0


@dataclass
class Budgets:
    """Every PDB status the disruption controller wrote (watch events), folded per PDB."""

    by_name: dict[str, Budget] = field(default_factory=dict)

    def observe(self, pdb: Mapping[str, Any]) -> None:
        name = (pdb.get("metadata") or {}).get("name", "")
        status = pdb.get("status") or {}
        if not status.get("observedGeneration") or "currentHealthy" not in status:
            return  # not computed yet
        budget = self.by_name.setdefault(name, Budget(name))
        budget.statuses += 1
        healthy, desired = int(status.get("currentHealthy", 0)), int(status.get("desiredHealthy", 0))
        if budget.margin is None or healthy - desired < budget.margin:
            budget.lowest_healthy, budget.desired_then = healthy, desired

    @property
    def respected(self) -> bool:
        return bool(self.by_name) and all(b.respected for b in self.by_name.values())
