"""Orchestration: from a record (or from a node's ledger) to a plan, run group by group, audited.

The engine is level-triggered. A record from Kafka says what a node must go through; the flow is
recorded in the node's ledger with its first write, and from then on whichever replica owns the
node's partition drives it to the end - from the record, or without it (``resume``, called by the
reconciler) when the replica that started it died. What each action does lives in
``pipeline.actuator.actions``; how a group of steps touches the cluster (or, in dry-run, does not)
lives in ``pipeline.actuator.effector``.

One module (about 440 lines): a record's start, a node's resume, a recovery and the plan's run share the
per-node lock and the audit, and a repair case's next flow is driven in the same pass as the flow that opened
it (``_resume_locked``); split, the lock would have to travel between modules.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pipeline.actuator import repaircase
from pipeline.actuator.actions import Kind, StepResult, StopReason
from pipeline.actuator.audit import Auditor, default_worker_id, make_record
from pipeline.actuator.breaker import Breaker, DrainSlots
from pipeline.actuator.budgets import RepairBudgets
from pipeline.actuator.effector import DryRunEffector, Effector, FlowContext, LiveEffector
from pipeline.actuator.effects import NodeChange
from pipeline.actuator.kube import Forbidden, Invalid, Kube, KubeUnavailable, NotFound, unreachable
from pipeline.actuator.nodestate import NodeWriter
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import CORDON, Ledger, request_flow_key
from pipeline.actuator.plan import group_steps, plan_from_ledger, plan_incident, plan_recovery, plan_request
from pipeline.actuator.policystore import PolicyStore
from pipeline.actuator.repairloop import RepairLoop
from pipeline.actuator.settings import ActuatorSettings
from schemas.records import NodeIncident, NodeRecovered, Outcome, RescueActionRequest

__all__ = ["Engine", "FlowEnd", "FlowStatus", "group_steps"]

log = logging.getLogger("xidflow.actuator.engine")

ActuatorRecord = NodeIncident | NodeRecovered | RescueActionRequest


class FlowEnd(StrEnum):
    FINISHED = "finished"
    """Every step ran, or the flow stopped for good (failed, cancelled): recorded as finished."""
    HELD = "held"
    """Another replica holds a step's lease; the flow goes on there (or here, once the lease lapses)."""
    NOT_STARTED = "not-started"
    """Nothing was to happen (opt-out, cancelled before, dry-run)."""


@dataclass(frozen=True)
class FlowStatus:
    end: FlowEnd
    retry_at: float | None = None
    """When a held flow should be looked at again (the holder's lease end)."""


_MAX_PASSES = 20
"""Rounds of ``_resume_locked`` over a node's flows and cases (each a flow's end or a case's move) before it
leaves the rest to the next event or resync."""


def _evidence(recovered: NodeRecovered) -> dict[str, Any]:
    """What a recovery says about why (a code that cancels the incident names itself and its evidence)."""
    out: dict[str, Any] = {"recovered": recovered.reason}
    if recovered.detail:
        out["detail"] = recovered.detail
    if recovered.evidence_ids:
        out["evidence_ids"] = list(recovered.evidence_ids)
    if recovered.cancelled_by:
        out["cancelled_by"] = recovered.cancelled_by
    return out


def _flow_of(record: ActuatorRecord) -> str:
    if isinstance(record, RescueActionRequest):
        return request_flow_key(record.request_id)
    return record.incident_id


class Engine:
    def __init__(
        self,
        kube: Kube,
        auditor: Auditor,
        settings: ActuatorSettings,
        policies: PolicyStore,
        breaker: Breaker,
        drains: DrainSlots,
        budgets: RepairBudgets | None = None,
    ) -> None:
        self.auditor, self.settings = auditor, settings
        self.policies, self.breaker, self.drains = policies, breaker, drains
        self.worker = settings.worker_id or default_worker_id()
        self.writer = NodeWriter(kube, self.worker, settings.ledger_max_flows)
        live = LiveEffector(kube, self.writer, settings, policies, breaker, drains, budgets)
        # Dry-run is a different effector, not a branch in every step: it records and mutates nothing.
        self.effector: Effector = DryRunEffector() if settings.dry_run else live
        # Called with a request id once its plan is done or abandoned, so the decision API's
        # pending-plans limit stops counting it (set by the Actuator when the API module is present).
        self.on_request_done: Callable[[str], Awaitable[None]] | None = None
        self._live = live
        self._locks: dict[str, asyncio.Lock] = {}
        self._running: dict[str, FlowContext] = {}
        self.cases = RepairLoop(self.writer, self.effector, self._audit_now)
        """Repair cases the engine moves on by itself (return to service, a hand-off's answer)."""

    @property
    def kube(self) -> Kube:
        return self.writer.kube

    @kube.setter
    def kube(self, kube: Kube) -> None:
        """Swap the API client everywhere the engine reaches the cluster (tools and tests do)."""
        self.writer.kube = self._live.kube = kube

    # -- one driver per node in this process -------------------------------------------------------------
    def _lock(self, node: str) -> asyncio.Lock:
        return self._locks.setdefault(node, asyncio.Lock())

    def busy(self, node: str) -> bool:
        lock = self._locks.get(node)
        return lock is not None and lock.locked()

    # -- entry points -------------------------------------------------------------------------------------
    async def handle(self, record: ActuatorRecord, on_durable: Callable[[], None] | None = None) -> None:
        """One record from the incidents or requests topic, retried until the API server answers.

        ``on_durable`` is called as soon as the record's flow is recorded on its node (its offset may
        be committed then); a long wait inside the flow no longer holds back the partition.
        """
        delay = self.settings.retry_initial_seconds
        self.kube.quarantining(False)
        node = record.node
        try:
            while True:
                try:
                    async with self._lock(node):
                        if isinstance(record, NodeRecovered):
                            return await self._recovered(record)
                        return await self._start(record, on_durable)
                except (KubeUnavailable, Forbidden, NotFound) as exc:
                    # Unreachable, 5xx, RBAC not (yet) granted, our namespace missing: an operator or time
                    # fixes these. Every effect is idempotent, so replaying the whole record later is safe.
                    self.kube.quarantining(False)  # backing off: hold no other call up meanwhile
                    if not unreachable(exc):  # an outage is logged once, as such (reachability.API_SERVER)
                        log.warning("%s; retrying %s for %s in %.1fs", exc, record.type, node, delay)
                    await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                    delay = min(delay * 2, self.settings.retry_max_seconds)
                except Invalid as exc:
                    # The request itself is wrong (a bad Job template, a policy the API server refuses):
                    # retrying cannot help, so it is audited as failed and the record is done.
                    self.kube.quarantining(False)
                    log.error("%s for %s refused by the API server: %s", record.type, node, exc)
                    await self._audit_now(node, _flow_of(record), "decide", Outcome.FAILED, str(exc))
                    return
        finally:
            self.kube.quarantining(False)

    async def _start(self, record: NodeIncident | RescueActionRequest, on_durable: Callable[[], None] | None) -> None:
        flow = _flow_of(record)
        if isinstance(record, NodeIncident):
            # Until the node is out of scheduling, its API calls go ahead of other nodes' Events/conditions.
            self.kube.quarantining(record.quarantine or record.action.quarantines)
            await self.policies.maybe_refresh()
        view = await self.writer.current(record.node)  # the watch's view: no read on the hot path
        if view is None:
            await self._audit_now(record.node, flow, "decide", Outcome.SKIPPED, "node not found")
            await self._request_done(record)
            return
        ledger = view.ledger
        revision = record.revision if isinstance(record, NodeIncident) else 0
        if isinstance(record, NodeIncident):
            flow = repaircase.flow_of(ledger, flow, revision)  # a revision a repair case runs as a flow of its own
        known = flow in ledger.flows
        newer = known and revision > ledger.revision(flow)  # an escalation of a recorded incident
        if on_durable is not None and known and not newer:
            on_durable()  # recorded before (a redelivery): nothing here holds the partition back
            on_durable = None
        view = await self._reconcile_manual_uncordon(view)
        kept = plan_from_ledger(view, flow, self.settings) if view.ledger.is_open(flow) and not newer else None
        if kept is not None:
            plan = kept[0]  # the flow was recorded when it started: the same steps, whatever the policy now
        elif isinstance(record, NodeIncident):
            plan = plan_incident(record, self.policies.current, view, self.settings, time.time())
        else:
            plan = plan_request(record, view, self.settings)
        ctx = FlowContext(plan=plan, view=view, record=record, on_durable=on_durable, reopen=newer)
        status = await self.run_plan(ctx)
        if status.end != FlowEnd.HELD:
            await self._request_done(record)
        if not self.settings.dry_run and ctx.view.ledger.repairs:
            # What the flow's end opened in its repair case (the repair again, a hand-off, a return) goes on now.
            await self._resume_locked(record.node)

    async def resume(self, node: str) -> float | None:
        """Drive every open flow of the node from its ledger; when to look again if one is held elsewhere."""
        async with self._lock(node):
            return await self._resume_locked(node)

    async def _resume_locked(self, node: str) -> float | None:
        """``resume`` under the node's lock: the open flows, and the repair cases that wait on xidflow, until
        nothing moves (a flow's end may open the next one of its case)."""
        view = self.writer.known(node) or await self.writer.read(node)
        if view is None:
            return None
        view = await self._reconcile_manual_uncordon(view)
        retry: float | None = None
        for _ in range(_MAX_PASSES):
            moved = False
            if not self.settings.dry_run and repaircase.needs_driving(view.ledger):
                view, moved = await self.cases.drive(view)
            now = time.time()
            for flow in view.ledger.open_flows():
                until = self._held_elsewhere(view.ledger, flow, now)
                if until is not None:
                    retry = until if retry is None else min(retry, until)
                    continue
                kept = plan_from_ledger(view, flow, self.settings)
                if kept is None:
                    continue
                plan, record = kept
                ctx = FlowContext(plan=plan, view=view, record=record, resumed=True)
                status = await self.run_plan(ctx)
                view = ctx.view
                if status.retry_at is not None:
                    retry = status.retry_at if retry is None else min(retry, status.retry_at)
                elif status.end == FlowEnd.FINISHED:
                    moved = True
                    await self._request_done(record)
            if not moved:
                break
            view = self.writer.known(node) or view
        return retry

    def _held_elsewhere(self, ledger: Ledger, flow: str, now: float) -> float | None:
        """End of a live lease another replica holds on one of the flow's steps."""
        lease = self.settings.claim_timeout_seconds
        for claim in (ledger.flows.get(flow) or {}).get("claims", {}).values():
            at = float(claim.get("at", 0))
            if claim.get("by") != self.worker and now - at <= lease:
                return at + lease
        return None

    async def notice(self, view: NodeView) -> None:
        """A Node changed (watch): a person's uncordon cancels the flows owning the cordon, at once."""
        if view.unschedulable or not view.ledger.owners(CORDON):
            return
        await self._reconcile_manual_uncordon(view)

    async def _request_done(self, record: NodeIncident | RescueActionRequest) -> None:
        if self.on_request_done is None or not isinstance(record, RescueActionRequest):
            return
        try:
            await self.on_request_done(record.request_id)
        except Exception as exc:  # noqa: BLE001 - the plan entry also expires on its own
            log.warning("could not release plan %s from the pending-plans ledger: %s", record.request_id, exc)

    async def _recovered(self, recovered: NodeRecovered) -> None:
        flow = recovered.incident_id
        view = await self.writer.read(recovered.node)
        if view is None:
            await self._audit_now(recovered.node, flow, "undo", Outcome.SKIPPED, "node not found")
            return
        evidence = _evidence(recovered)
        held = repaircase.holds(view.ledger, flow)
        if held and recovered.reason != "manual":
            # Only the diagnostics gate returns a node under repair (a person's reset still does: below).
            await self._audit_now(view.name, flow, "undo", Outcome.SKIPPED, f"{recovered.reason}: {held}",
                                  details=evidence)
            return
        undo = plan_recovery(recovered, view)
        if not undo.disown:
            outcome = Outcome.ALREADY_APPLIED if view.ledger.flow_value(flow, "recovered") else Outcome.SKIPPED
            await self._audit_now(view.name, flow, "undo", outcome, "nothing owned by this incident")
            return
        result = await self.effector.undo(view, flow, recovered.reason, undo)
        await self._audit_now(view.name, flow, "undo", result.outcome, result.reason,
                              details={**evidence, **result.details})
        if recovered.reason == "manual" and not self.settings.dry_run:
            await self._close_case(view.name, flow, recovered.detail or "reset by a person")

    async def _close_case(self, node: str, flow: str, why: str) -> None:
        """A person took the node over: the flow's repair case is over (its history stays in the ledger)."""

        def mutate(v: NodeView, ledger: Ledger) -> tuple[NodeChange | None, None]:
            found = repaircase.case_of_flow(ledger, flow)
            if found is None or found[1].get("stage") == repaircase.CLOSED:
                return None, None
            repaircase.close(ledger, found[0], time.time(), why)
            return NodeChange(), None

        await self.writer.update(node, mutate, f"close repair case of {flow}")

    async def _record_join(self, ctx: FlowContext) -> None:
        """A fault of a repair case in progress (or handed off): recorded in the case, nothing else happens."""
        plan, record = ctx.plan, ctx.record
        assert plan.case is not None and record is not None
        rec = record.model_dump(mode="json")

        def mutate(v: NodeView, ledger: Ledger) -> tuple[NodeChange | None, None]:
            changed = repaircase.apply_decision(ledger, plan.case, None, rec, time.time())  # type: ignore[arg-type]
            return (NodeChange() if changed else None), None

        _, written = await self.writer.update(plan.node, mutate, f"repair case {plan.case.case_id} += {plan.flow_key}")
        ctx.wrote(written)

    async def _reconcile_manual_uncordon(self, view: NodeView) -> NodeView:
        """Persist the cancellation of flows whose cordon a person removed, and stop them if running here."""
        if view.unschedulable or not view.ledger.owners(CORDON) or self.settings.dry_run:
            return view

        def mutate(v: NodeView, ledger: Ledger) -> tuple[NodeChange | None, Any]:
            cancelled = ledger.reconcile_manual_uncordon(v.unschedulable, time.time())
            return (NodeChange() if cancelled else None), cancelled

        cancelled, written = await self.writer.update(view.name, mutate, "manual-uncordon detected", first=view)
        running = self._running.get(view.name)
        for flow in cancelled or []:
            if running is not None and running.plan.flow_key == flow:
                running.cancelled.set()
            await self._audit_now(view.name, flow, "cancel", Outcome.APPLIED, "manual-uncordon by a person")
        return written or view

    # -- plans --------------------------------------------------------------------------------------------
    async def run_plan(self, ctx: FlowContext) -> FlowStatus:
        plan = ctx.plan
        if ctx.incident is not None and not ctx.resumed:
            self.auditor.tell(ctx.incident)
        decision = (
            Outcome.SKIPPED if plan.skip_reason else Outcome.DRY_RUN if self.settings.dry_run else Outcome.APPLIED
        )
        why = plan.skip_reason or ("escalated to CONTACT_SUPPORT" if plan.escalated else f"rule {plan.rule}")
        details = {"rule": plan.rule, "steps": [s.key for s in plan.steps], **plan.details}
        self._audit(ctx, "resume" if ctx.resumed else "decide", StepResult(decision, why, details))
        self._running[plan.node] = ctx
        try:
            if plan.skip_reason:
                if plan.case is not None and not self.settings.dry_run:
                    await self._record_join(ctx)
                return FlowStatus(FlowEnd.NOT_STARTED)
            return await self._run_steps(ctx)
        finally:
            self._running.pop(plan.node, None)
            # Its quarantine is over (a skipped plan never started one): the audit records it waits for
            # below are held until this process is calm (``Auditor.hold``), which a task still counted
            # as quarantining would put off.
            self.kube.quarantining(False)
            # The record is done only when every audit record of it is durable.
            await asyncio.gather(*ctx.audits)

    async def _run_steps(self, ctx: FlowContext) -> FlowStatus:
        try:
            return await self._run_groups(ctx)
        finally:
            self.kube.quarantining(False)

    async def _run_groups(self, ctx: FlowContext) -> FlowStatus:
        groups = group_steps(ctx.plan.steps)
        stop: StepResult | None = None
        for index, group in enumerate(groups):
            if stop is not None:
                for step in group:
                    self._audit(ctx, step.key, StepResult(Outcome.SKIPPED, f"flow stopped earlier: {stop.reason}"))
                continue
            ctx.last_group = index == len(groups) - 1
            # Its calls go first while the node is still to be taken out of scheduling; never during a
            # long step (a drain would hold every other call of this process up for its whole length).
            self.kube.quarantining(
                group[0].action.kind != Kind.LONG and any(s.quarantining for g in groups[index:] for s in g)
            )
            results = await self.effector.run_group(ctx, group)
            for step in group:
                result = results[step.key]
                self._audit(ctx, step.key, result)
                if result.stop is not None and stop is None:
                    stop = result
            if stop is not None and stop.stop in (StopReason.HELD, StopReason.LEASE_LOST):
                return FlowStatus(FlowEnd.HELD, stop.details.get("lease_until"))
            last = group[-1]
            if stop is None and last.spec.waittime and index < len(groups) - 1:
                self.kube.quarantining(False)
                if not await self._wait_after(ctx, last.key, last.spec.waittime):
                    stop = StepResult(Outcome.SKIPPED, "cancelled: manual-uncordon", stop=StopReason.CANCELLED)
        self.kube.quarantining(False)
        await self.effector.finish(ctx, stop.stop.value if stop is not None and stop.stop else "done")
        return FlowStatus(FlowEnd.FINISHED)

    async def _wait_after(self, ctx: FlowContext, key: str, waittime: float) -> bool:
        """The policy's wait after a step, counted from when it was done (a resumed flow waits the rest).

        False when a person took over meanwhile.
        """
        done_at = ctx.view.ledger.done_at(ctx.plan.flow_key, key)
        remaining = waittime if done_at is None else done_at + waittime - time.time()
        if remaining <= 0:
            return True
        try:
            await asyncio.wait_for(ctx.cancelled.wait(), remaining)
        except TimeoutError:
            return True
        return False

    # -- audit --------------------------------------------------------------------------------------------
    def _audit(self, ctx: FlowContext, action: str, result: StepResult) -> None:
        record = make_record(
            node=ctx.plan.node,
            flow_key=ctx.plan.flow_key,
            action=action,
            outcome=result.outcome,
            reason=result.reason,
            worker_id=self.worker,
            dry_run=self.settings.dry_run,
            details=result.details,
        )
        # Queued, not sent: the auditor sends a flow's records after the taints of a burst, together.
        ctx.audits.append(self.auditor.submit(record))

    async def _audit_now(
        self,
        node: str,
        flow: str | None,
        action: str,
        outcome: Outcome,
        reason: str,
        details: dict[str, Any] | None = None,
    ) -> None:
        await self.auditor.emit(
            make_record(
                node=node,
                flow_key=flow,
                action=action,
                outcome=outcome,
                reason=reason,
                worker_id=self.worker,
                dry_run=self.settings.dry_run,
                details=details,
            )
        )
