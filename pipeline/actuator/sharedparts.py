"""The shared-part rule in the actuator: correlate fabric signals per topology label value, blame the part.

Why here and not in the worker: the worker has no Kubernetes access and no policy; the actuator
watches every GPU node (their labels) and holds the policy, so it resolves which part a node sits
behind. The pure correlation is ``pipeline.aggregate.sharedparts.observe``; its state for every label value
lives in one ConfigMap (``shared_parts_configmap``) written with its resourceVersion, the same
optimistic read-modify-write as the circuit breaker: the replicas that own different nodes'
partitions serialise their updates of one part there, and exactly one of them opens its incident.

What the rule does once a part's incident is open (``SharedPartRule``): a taint
``xidflow.dev/shared-<name>=<value>`` and the node condition ``XidflowSharedPart`` (reason
``SharedPartSuspected``, message naming the part) on each of its nodes, owned in the node's ledger
by the part's incident id (so ``xidflow reset`` removes them); one Warning Event; one audit record per
revision (which the notifier sends). No cordon, drain or reboot, and the breaker does not count the
taint (``ownership.is_shared_part_effect``). A node's own fatal fault (Xid 79) is still its own
incident, handled by the engine as before.

Level-triggered like the rest: what was applied is recorded in the part's entry after it is applied;
a signal redelivered after a crash finds the work not recorded and does it again, idempotently
(taints and conditions are checked on the Node, the Event has a deterministic name, the audit record
a deterministic id). The signal's offset is committed only after ``handle`` returns.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from datetime import UTC, datetime
from typing import Any

from pipeline.actuator import conditions, effects
from pipeline.actuator.audit import Auditor, make_record
from pipeline.actuator.configmap_state import read_json_configmap, update_json_configmap
from pipeline.actuator.effects import NodeChange
from pipeline.actuator.kube import Forbidden, Kube, KubeUnavailable, NotFound
from pipeline.actuator.nodestate import NodeWriter
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import SHARED_PART_TAINT_PREFIX, Ledger
from pipeline.actuator.policy import SharedPartRule
from pipeline.actuator.policystore import PolicyStore
from pipeline.actuator.settings import ActuatorSettings
from pipeline.aggregate.sharedparts import PartState, observe, part_key
from schemas.records import FabricSignal, Outcome, SharedPartIncident, stable_id

log = logging.getLogger("xidflow.actuator.sharedparts")

CONDITION_TYPE = "XidflowSharedPart"
REASON = "SharedPartSuspected"
AUDIT_ACTION = "sharedPart"
FORGET_AFTER_S = 86_400.0
"""A part without an open incident whose newest signal is this much older than the newest signal seen is
dropped from the ConfigMap (it holds only what can still open an incident)."""


def taint_key(part: str) -> str:
    return f"{SHARED_PART_TAINT_PREFIX}{part}"


def part_message(inc: SharedPartIncident) -> str:
    return (
        f"shared part {inc.label}={inc.value} suspected: fabric faults ({', '.join(inc.fault_classes)}) from "
        f"{len(inc.nodes)} nodes within {inc.window_s:g}s: {', '.join(inc.nodes)}"
    )


def part_of_message(message: str) -> str:
    """``<label>=<value>`` from a ``part_message`` (what ``xidflow status`` shows)."""
    head = message.removeprefix("shared part ")
    return head.split(" suspected", 1)[0] if head != message else message


def part_display(inc: SharedPartIncident) -> str:
    """What audit records name in place of a node: ``part:<name>=<value>``."""
    return f"part:{inc.part}={inc.value}"


def observe_all(
    state: dict[str, Any], signal: FabricSignal, matches: list[tuple[SharedPartRule, str]], now_ts: float
) -> list[str]:
    """Apply the signal to every part the node sits behind (ConfigMap state, in place). Pure.

    Returns the keys of the parts with an open incident whose effects are not all recorded as applied.
    """
    parts: dict[str, Any] = state.setdefault("parts", {})
    pending: list[str] = []
    for rule, value in matches:
        key = part_key(rule.label, value)
        ps = PartState.model_validate(parts[key]) if key in parts else PartState(label=rule.label, value=value)
        observe(ps, signal, part=rule.part, min_nodes=rule.min_nodes, window_s=rule.window, rule=rule.part,
                now=datetime.fromtimestamp(now_ts, UTC))
        parts[key] = ps.model_dump(mode="json")
        if needs_work(ps):
            pending.append(key)
    newest = signal.ts.timestamp()
    for key in list(parts):
        ps = parts[key]
        lasts = [float(m.get("last", 0)) for m in (ps.get("members") or {}).values()]
        if ps.get("incident") is None and (not lasts or max(lasts) < newest - FORGET_AFTER_S):
            del parts[key]
    return pending


def needs_work(ps: PartState) -> bool:
    inc = ps.incident
    if inc is None:
        return False
    return ps.event_for != inc.revision or any(node not in ps.applied for node in inc.nodes)


def forget_node(state: dict[str, Any], key: str, node: str) -> bool:
    """A person reset the node (``xidflow reset``): it leaves the part's incident; the incident closes (the
    part's entry is dropped) when none of its nodes is left. Pure; True when the state changed.

    A node reset while its part still fails comes back with its next fabric signal, as a new member.
    """
    entry = (state.get("parts") or {}).get(key)
    if entry is None:
        return False
    ps = PartState.model_validate(entry)
    if ps.incident is None or node not in ps.incident.nodes:
        return False
    ps.applied.pop(node, None)
    ps.members.pop(node, None)
    ps.incident.nodes = [n for n in ps.incident.nodes if n != node]
    if not ps.incident.nodes:
        del state["parts"][key]
    else:
        state["parts"][key] = ps.model_dump(mode="json")
    return True


async def forget_reset_node(kube: Kube, settings: ActuatorSettings, key: str, node: str) -> None:
    """``forget_node`` in the ConfigMap (``xidflow reset``)."""
    await update_json_configmap(
        kube, settings.namespace, settings.shared_parts_configmap, lambda state: forget_node(state, key, node)
    )


def parts_of(state: dict[str, Any]) -> list[PartState]:
    """Every part in the ConfigMap's state (what ``xidflow status`` shows)."""
    return [PartState.model_validate(v) for _, v in sorted((state.get("parts") or {}).items())]


class SharedParts:
    """Handles ``FabricSignal`` records: correlation, then the shared-part rule's effects."""

    def __init__(
        self, kube: Kube, writer: NodeWriter, auditor: Auditor, settings: ActuatorSettings, policies: PolicyStore
    ) -> None:
        self.kube, self.writer, self.auditor, self.settings, self.policies = kube, writer, auditor, settings, policies
        # One applier per part in this process: signals of many nodes of one part arrive together, and each
        # would otherwise apply (and audit) the same revision. Across replicas the ConfigMap's record of what
        # was applied keeps the duplicates to the few that race; each is idempotent.
        self._locks: dict[str, asyncio.Lock] = {}

    async def handle(self, signal: FabricSignal) -> None:
        """One signal, retried while the API server is unreachable (every step is idempotent)."""
        delay = self.settings.retry_initial_seconds
        while True:
            try:
                return await self._handle(signal)
            except (KubeUnavailable, Forbidden, NotFound) as exc:
                log.warning("%s; retrying fabric signal of %s in %.1fs", exc, signal.node, delay)
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, self.settings.retry_max_seconds)

    async def _handle(self, signal: FabricSignal) -> None:
        await self.policies.maybe_refresh()
        rules = self.policies.current.shared_parts
        if not rules:
            return  # no topology named: a fabric signal means nothing alone
        view = await self.writer.current(signal.node)
        if view is None:
            return
        matches = [(r, str(view.labels[r.label])) for r in rules if view.labels.get(r.label)]
        if not matches:
            return
        s = self.settings
        pending = await update_json_configmap(
            self.kube, s.namespace, s.shared_parts_configmap,
            lambda state: observe_all(state, signal, matches, time.time()),
        )
        by_key = {part_key(r.label, v): r for r, v in matches}
        for key in pending:
            async with self._locks.setdefault(key, asyncio.Lock()):
                await self._apply(key, by_key[key])

    async def _apply(self, key: str, rule: SharedPartRule) -> None:
        s = self.settings
        state = await read_json_configmap(self.kube, s.namespace, s.shared_parts_configmap)
        raw = (state.get("parts") or {}).get(key)
        if raw is None:
            return
        ps = PartState.model_validate(raw)
        inc = ps.incident
        if inc is None:
            return
        done: list[str] = []
        skipped: list[str] = []
        for node in inc.nodes:
            if node in ps.applied:
                continue
            if await self._mark_node(node, inc, rule):
                done.append(node)
            else:
                skipped.append(node)
        event = ps.event_for != inc.revision
        if event:
            await effects.create_event_once(
                self.kube, effects.EVENT_NAMESPACE, effects.object_name("xidflow-part", inc.incident_id),
                {"apiVersion": "v1", "kind": "Node", "name": inc.nodes[0], "uid": inc.nodes[0]},
                REASON, part_message(inc),
            )
            # The first record of the incident goes to the notifier (a person is told once, "switch X is");
            # later revisions (nodes joining) are audited only. Ids are deterministic: the first record's
            # is the same whichever revision two racing replicas saw, so receivers keep one notification.
            first = ps.event_for is None
            record = make_record(
                node=part_display(inc), flow_key=inc.incident_id, action=AUDIT_ACTION, outcome=Outcome.APPLIED,
                reason=part_message(inc), worker_id=s.worker_id, dry_run=s.dry_run,
                details={"revision": inc.revision, "tainted": sorted({*ps.applied, *done}), "skipped": skipped,
                         "notified": first},
            )
            record = record.model_copy(update={
                "record_id": stable_id("shared-part", inc.incident_id, "opened" if first else inc.revision),
                "shared_part": inc,
            })
            await self.auditor.emit(record, tell=first)

        def mark(state: dict[str, Any]) -> None:
            entry = (state.get("parts") or {}).get(key)
            if entry is None:
                return
            current = PartState.model_validate(entry)
            if current.incident is None or current.incident.incident_id != inc.incident_id:
                return
            for node in [*done, *skipped]:
                current.applied[node] = inc.revision
            if event and (current.event_for if current.event_for is not None else -1) < inc.revision:
                current.event_for = inc.revision
            state["parts"][key] = current.model_dump(mode="json")

        await update_json_configmap(self.kube, s.namespace, s.shared_parts_configmap, mark)

    async def _mark_node(self, node: str, inc: SharedPartIncident, rule: SharedPartRule) -> bool:
        """Taint and condition on one node of the part; False when the node opted out or is gone."""
        s = self.settings
        view = await self.writer.current(node)
        if view is None or view.opted_out(s.opt_out_label) or s.dry_run:
            return False
        flow = inc.incident_id
        now = time.time()
        if rule.taint_effect != "None":
            tkey = taint_key(rule.part)

            def taint(v: NodeView, ledger: Ledger) -> tuple[NodeChange | None, None]:
                present = any(t.get("key") == tkey and t.get("effect") == rule.taint_effect for t in v.taints)
                if present and flow in ledger.flows:
                    return None, None
                change = effects.taint_change(v, ledger, flow, tkey, inc.value, rule.taint_effect)
                _record_flow(ledger, inc, now)
                return change, None

            try:
                await self.writer.update(node, taint, "shared-part taint", first=view)
            except NotFound:
                return False
        if rule.condition:
            message = part_message(inc)

            def condition(v: NodeView, ledger: Ledger) -> tuple[NodeChange | None, None]:
                current = v.condition(CONDITION_TYPE)
                key = conditions.effect_key(CONDITION_TYPE)
                if current is not None and current.get("status") == "True" and ledger.owners(key) \
                        and current.get("message") == message[: conditions.MESSAGE_MAX]:
                    return None, None
                entry = conditions.next_condition(current, CONDITION_TYPE, "True", REASON, message,
                                                  effects.now_rfc3339())
                ledger.own(key, flow)
                _record_flow(ledger, inc, now)
                return NodeChange(status={"conditions": [entry]}), None

            try:
                await self.writer.update(node, condition, "shared-part condition")
            except NotFound:
                return False
        return True


def _record_flow(ledger: Ledger, inc: SharedPartIncident, now: float) -> None:
    """The part's flow in the node's ledger: finished at once (nothing for the reconciler to drive), kept
    because it owns the taint and condition (``xidflow reset`` and undo find them by it)."""
    if inc.incident_id not in ledger.flows:
        ledger.flow(inc.incident_id, now)
        ledger.set_flow_value(inc.incident_id, "part", part_key(inc.label, inc.value), now)
        ledger.finish(inc.incident_id, "shared-part", now)


