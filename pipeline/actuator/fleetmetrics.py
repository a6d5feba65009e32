"""The actuator's metrics: the closed label sets of its counters, and gauges of the fleet as it is now.

Gauges (refreshed every ``XIDFLOW_METRICS_REFRESH_S`` from the reconciler's node cache, a list+watch
of every GPU node, plus one read of the breaker's ConfigMap; nothing here lists nodes itself):

- ``xidflow_quarantined_nodes``: GPU nodes carrying xidflow's own cordon or taint (the breaker's rule,
  ``breaker_rules.quarantined_by_xidflow``), ``xidflow_gpu_nodes`` the fleet;
- ``xidflow_breaker_window_nodes`` / ``_share``: what the breaker counts against its limit (quarantined
  now, or admitted within its window), ``xidflow_breaker_open`` whatever replica tripped it;
- ``xidflow_flow_oldest_step_age_seconds{action}`` and ``..._timeout_seconds{action}``: the oldest
  open step of each action and its timeout, so "a flow stuck past its timeout" is
  ``age > timeout``; ``xidflow_flow_open_steps{action}``.

Every replica sees the whole fleet and exports the same values (alerts take the ``max``). The
computations are pure functions of ``NodeView``s; ``FleetGauges`` is the timer around them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.actuator import actions
from pipeline.actuator.actions.base import Kind
from pipeline.actuator.actions.drain import DEFAULT_DRAIN_TIMEOUT
from pipeline.actuator.breaker import Breaker
from pipeline.actuator.breaker_rules import admitted_within, in_fleet, quarantined_by_xidflow
from pipeline.actuator.configmap_state import read_json_configmap
from pipeline.actuator.effects import DEFAULT_REBOOT_TIMEOUT, DEFAULT_RESET_TIMEOUT
from pipeline.actuator.kube import unreachable
from pipeline.actuator.nodeview import NodeView
from pipeline.runtime import metrics
from schemas.records import Outcome

log = logging.getLogger("xidflow.actuator.metrics")

AUDIT_ACTIONS: dict[str, str] = {
    "decide": "The plan chosen for an incident or a rescue request (details: `rule`, `steps`), or why nothing is "
    "done (outcome `skipped`: opt-out, manual-only mode, cancelled, blamed on a shared part).",
    "resume": "A replica took over an open flow from the node's ledger (details as `decide`).",
    "undo": "A recovery (NodeRecovered, `xidflow reset`) removed what the flow applied (details: what was removed).",
    "cancel": "A person's uncordon ended the flows that owned the cordon (no re-cordon, no drain or reboot after it).",
    "breaker-trip": "The circuit breaker tripped: the reason names the share and the limit.",
    "rescue-request": "A rescue request refused for its signature (outcome `skipped`, details `refused`).",
    "api-idempotency-conflict": "The decision API refused an Idempotency-Key reused with a different body (409).",
    "sharedPart": "The shared-part rule blamed a part (a switch, a rack): the node is `<label>=<value>`, the record's "
    "`shared_part` says which nodes.",
    "return-to-service": "The diagnostics gate passed: what the repair case's flows applied was removed, the node is "
    "back in service (the record's flow is the case id; details: `fault_class`, `undone`; docs/repair.md).",
    "hand-back": "The external repair system answered a RepairRequest (`Repaired`, `Replaced`): the diagnostics gate "
    "runs again (details: `repair_request`, `answer`, `by`, `flow`).",
}
"""Audit record actions that are not policy actions (``engine``, ``app``, ``signing``, ``api``, ``sharedparts``), with
what the record says; every step's own name (``cordon``, ``drain``, ``drain#2``, ...) is one too (docs/audit.md).
Also the closed label set of ``xidflow_remediations_total``."""


STEP_ACTIONS: tuple[str, ...] = tuple(n for n in actions.ACTION_NAMES if actions.get(n).kind != Kind.MACRO)
"""Actions a flow step can be (a macro such as ``quarantine`` is expanded when planned)."""

REMEDIATION_ACTIONS: frozenset[str] = frozenset(actions.ACTION_NAMES) | frozenset(AUDIT_ACTIONS)

DEFAULT_STEP_TIMEOUTS: Mapping[str, float] = {
    "drain": DEFAULT_DRAIN_TIMEOUT, "reboot": DEFAULT_REBOOT_TIMEOUT, "resetGpu": DEFAULT_RESET_TIMEOUT}
STEP_TIMEOUT_S = 300.0
"""Timeout of a step whose policy and action give none: a node write, an Event or a Job start that is
still open after five minutes is stuck."""


def remediation_action(action: str) -> str:
    """The ``action`` label of ``xidflow_remediations_total``: the action's name (a flow's second drain,
    step ``drain#2``, counts as ``drain``), or ``other``."""
    return metrics.bounded(action.partition("#")[0], REMEDIATION_ACTIONS)


def label_values(webhooks: Iterable[str] = ()) -> dict[Any, list[tuple[str, ...]]]:
    """Every known label combination of the actuator's counters and per-action gauges (pure)."""
    names = sorted(REMEDIATION_ACTIONS) + [metrics.OTHER]
    hooks = list(dict.fromkeys(webhooks))
    return {
        metrics.REMEDIATIONS: [(a, o.value) for a in names for o in Outcome],
        metrics.FLOW_STEP_AGE: [(a,) for a in STEP_ACTIONS],
        metrics.FLOW_STEP_TIMEOUT: [(a,) for a in STEP_ACTIONS],
        metrics.FLOW_STEPS_OPEN: [(a,) for a in STEP_ACTIONS],
        metrics.NOTIFICATIONS: [(w, r) for w in hooks for r in ("delivered", "failed", "dropped")],
        metrics.NOTIFICATION_ATTEMPTS: [(w,) for w in hooks],
        metrics.ACTUATOR_DEADLETTERS: metrics.deadletter_label_values(metrics.ACTUATOR),
    }


# -- pure computations --------------------------------------------------------------------------------
def is_quarantined(view: NodeView) -> bool:
    """``breaker_rules.quarantined_by_xidflow`` of a cached view (one rule for the breaker and the gauge)."""
    return quarantined_by_xidflow({"metadata": {"annotations": view.annotations},
                                   "spec": {"unschedulable": view.unschedulable, "taints": list(view.taints)}})


@dataclass(frozen=True)
class OpenStep:
    node: str
    flow: str
    action: str
    age_s: float
    timeout_s: float


def step_timeout(spec: Mapping[str, Any]) -> float:
    """The step's policy timeout, else the action's default, else ``STEP_TIMEOUT_S``; a drain's checkpoint
    wait (``checkpointGrace``) comes before its own timeout, so it is added."""
    given = spec.get("timeout")
    base = float(given) if given else DEFAULT_STEP_TIMEOUTS.get(str(spec.get("name")), STEP_TIMEOUT_S)
    return base + float(spec.get("checkpointGrace") or 0)


def open_steps(view: NodeView, now: float) -> list[OpenStep]:
    """The step each open flow of the node is at, with how long it has been open. Pure.

    A step is open from when the step before it was done plus that step's wait (the flow's start for
    the first). Step keys follow ``plan``: the n-th step of one action in a flow is ``name#n``.
    """
    ledger = view.ledger
    out: list[OpenStep] = []
    for flow_key in ledger.open_flows():
        flow = ledger.flows.get(flow_key) or {}
        specs = (flow.get("plan") or {}).get("steps") or []
        since = float(flow.get("at") or now)
        seen: dict[str, int] = {}
        for spec in specs:
            name = str(spec.get("name"))
            seen[name] = seen.get(name, 0) + 1
            key = name if seen[name] == 1 else f"{name}#{seen[name]}"
            done = ledger.done_at(flow_key, key)
            if done is None:
                out.append(OpenStep(view.name, flow_key, name, max(0.0, now - since), step_timeout(spec)))
                break
            since = done + float(spec.get("waittime") or 0)
    return out


@dataclass(frozen=True)
class FleetFigures:
    gpu_nodes: int
    quarantined: frozenset[str]
    oldest: Mapping[str, OpenStep]
    """action -> its oldest open step"""
    open_steps: Mapping[str, int]


def fleet_figures(
    views: Iterable[NodeView], now: float, fleet: tuple[int, frozenset[str], Collection[str]] | None = None
) -> FleetFigures:
    """Quarantined nodes and the oldest open step per action over the fleet. Pure.

    ``fleet``: (GPU nodes, those quarantined) already counted elsewhere (the reconciler keeps both per
    watch event); then ``views`` need only hold the nodes that may have open flows, not the fleet."""
    count = 0
    quarantined: set[str] = set()
    oldest: dict[str, OpenStep] = {}
    opened: dict[str, int] = {}
    for view in views:
        if fleet is None:
            count += 1
            if is_quarantined(view):
                quarantined.add(view.name)
        for step in open_steps(view, now):
            action = metrics.bounded(step.action, STEP_ACTIONS)
            opened[action] = opened.get(action, 0) + 1
            if action not in oldest or step.age_s > oldest[action].age_s:
                oldest[action] = step
    if fleet is not None:
        return FleetFigures(fleet[0], fleet[1], oldest, opened)
    return FleetFigures(count, frozenset(quarantined), oldest, opened)


def breaker_window(state: Mapping[str, Any], quarantined: frozenset[str], fleet: int, window: float,
                   now: float, members: Collection[str] | None = None) -> tuple[int, float]:
    """Nodes the breaker counts now (quarantined, or admitted within the window and still in the fleet) and their
    share. Pure."""
    counted = len(in_fleet(admitted_within(state, window, now), members) | quarantined)
    return counted, counted / max(fleet, 1)


# -- the timer ----------------------------------------------------------------------------------------
def publish(figures: FleetFigures) -> None:
    metrics.GPU_NODES.set(figures.gpu_nodes)
    metrics.QUARANTINED_NODES.set(len(figures.quarantined))
    for action in (*STEP_ACTIONS, *(a for a in figures.oldest if a not in STEP_ACTIONS)):
        step = figures.oldest.get(action)
        metrics.FLOW_STEP_AGE.labels(action).set(step.age_s if step else 0)
        metrics.FLOW_STEP_TIMEOUT.labels(action).set(step.timeout_s if step else 0)
        metrics.FLOW_STEPS_OPEN.labels(action).set(figures.open_steps.get(action, 0))


class FleetGauges:
    """Refreshes the fleet gauges every ``interval_s`` from ``nodes()`` (the reconciler's cache).

    With ``fleet`` (the reconciler's count and quarantined set; None before its first list) ``nodes()``
    need only give the nodes that may have open flows: a refresh then costs those, not a pass over
    every node of the fleet on the event loop (85 ms at 10,000 nodes on an idle machine)."""

    def __init__(self, nodes: Callable[[], Mapping[str, NodeView]], breaker: Breaker,
                 interval_s: float | None = None,
                 fleet: Callable[[], tuple[int, frozenset[str], Collection[str]] | None] | None = None) -> None:
        self.nodes, self.breaker, self.fleet = nodes, breaker, fleet
        self.interval_s = interval_s if interval_s is not None else metrics.refresh_interval_s()
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    async def refresh(self) -> FleetFigures:
        now = time.time()
        views = self.nodes()
        fleet = self.fleet() if self.fleet else None
        figures = fleet_figures(list(views.values()), now, fleet)
        publish(figures)
        b = self.breaker
        metrics.BREAKER_MAX_SHARE.set(b.max_share)
        state = await read_json_configmap(b.kube, b.namespace, b.name)
        members = fleet[2] if fleet is not None else views.keys()
        counted, share = breaker_window(state, figures.quarantined, figures.gpu_nodes, b.window, now, members)
        metrics.BREAKER_WINDOW_NODES.set(counted)
        metrics.BREAKER_WINDOW_SHARE.set(share)
        metrics.BREAKER_OPEN.set(1 if state.get("tripped") else 0)  # tripped by any replica, or before we started
        return figures

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
                self._failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - metrics never stop the work
                if not self._failing and not unreachable(exc):  # an outage is said by reachability.API_SERVER
                    log.warning("fleet gauges not refreshed (%s: %s); retrying", type(exc).__name__, exc)
                self._failing = True
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name="xidflow-fleet-gauges")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
