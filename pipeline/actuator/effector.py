"""Runs one group of steps of a flow against the cluster, or, in dry-run, records what it would do.

The engine decides what runs and in which order; an effector makes it happen. ``LiveEffector``:
node-object steps (cordon, taint, unCordon) land in ONE conditional patch together with the ledger;
instant steps with calls of their own (Event) run concurrently, then ONE conditional status write sets
the conditions and records them all done (and the flow finished, when it is its last group); a long
step (drain, reboot, resetGpu, enableWarmStandby) is claimed first with a lease that a background
task renews while the runner works, so a second replica or a redelivery never starts it twice and
a replica that vanished is replaced within one lease period. ``DryRunEffector`` mutates nothing.

One module (about 500 lines): the live and the dry-run effector implement one protocol side by side,
so each step's two behaviours are read and changed together.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pipeline.actuator import effects, repaircase
from pipeline.actuator.actions import Kind, StepContext, StepResult, StopReason
from pipeline.actuator.actions import condition as condition_action
from pipeline.actuator.breaker import Breaker, DrainSlots
from pipeline.actuator.budgets import RepairBudgets
from pipeline.actuator.effects import NodeChange
from pipeline.actuator.kube import Kube, KubeUnavailable, unreachable
from pipeline.actuator.nodestate import NodeWriter
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import CORDON, Ledger
from pipeline.actuator.plan import Plan, Step, UndoPlan
from pipeline.actuator.policystore import PolicyStore
from pipeline.actuator.settings import ActuatorSettings
from schemas.records import NodeIncident, Outcome, RescueActionRequest

log = logging.getLogger("xidflow.actuator.effector")

# Lists kept in the ledger's record of a step are capped: the annotation must stay small.
_LEDGER_LIST_CAP = 20


@dataclass
class FlowContext:
    """One run of one flow on one node."""

    plan: Plan
    view: NodeView
    record: NodeIncident | RescueActionRequest | None = None
    resumed: bool = False
    reopen: bool = False
    """The record is a newer revision of a recorded flow (an escalation): its plan replaces the old one."""
    breaker_refused: str | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a person took over while the flow runs (manual uncordon seen by the watch)."""
    on_durable: Callable[[], None] | None = None
    """Called once the flow is recorded on the node: its record may be committed from then on."""
    audits: list[asyncio.Future[None]] = field(default_factory=list)
    _stored: dict[str, Any] | None = field(default=None, repr=False)
    last_group: bool = False
    """The group running now is the flow's last: a clean end is recorded in the same ledger write."""
    budgeted: bool = False
    """The long step running now holds repair-budget slots (renewed with its lease)."""

    @property
    def incident(self) -> NodeIncident | None:
        return self.record if isinstance(self.record, NodeIncident) else None

    @property
    def revision(self) -> int:
        return self.record.revision if isinstance(self.record, NodeIncident) else 0

    @property
    def stored(self) -> dict[str, Any] | None:
        """What the ledger keeps of this flow (``plan.stored``): built once per run, not at every write (its
        pydantic dumps of the record and every step were a visible share of a burst's profile). The ledger
        only serialises it, never changes it, so one dict serves each write and its retries."""
        from pipeline.actuator.plan import stored

        if self.record is None:
            return None
        if self._stored is None:
            self._stored = stored(self.plan, self.record)
        return self._stored

    def wrote(self, view: NodeView | None) -> None:
        if view is None:
            return
        self.view = view
        if self.on_durable is not None and self.plan.flow_key in view.ledger.flows:
            callback, self.on_durable = self.on_durable, None
            pending = list(self.audits)

            async def after_audits() -> None:
                await asyncio.gather(*pending, return_exceptions=True)
                callback()

            asyncio.ensure_future(after_audits())


class Effector(Protocol):
    async def run_group(self, ctx: FlowContext, group: list[Step]) -> dict[str, StepResult]: ...

    async def finish(self, ctx: FlowContext, status: str) -> None: ...

    async def undo(self, view: NodeView, flow: str, reason: str, undo: UndoPlan) -> StepResult: ...


class DryRunEffector:
    """Records what would happen; the cluster, the ledger included, is left as it is."""

    async def run_group(self, ctx: FlowContext, group: list[Step]) -> dict[str, StepResult]:
        return {s.key: StepResult(Outcome.DRY_RUN, f"dry-run: would {s.name}") for s in group}

    async def finish(self, ctx: FlowContext, status: str) -> None:
        return None

    async def undo(self, view: NodeView, flow: str, reason: str, undo: UndoPlan) -> StepResult:
        return StepResult(Outcome.DRY_RUN, "dry-run", dataclasses.asdict(undo))


def _capped(details: dict[str, Any]) -> dict[str, Any]:
    return {k: (v[:_LEDGER_LIST_CAP] if isinstance(v, list) else v) for k, v in details.items()}


class LiveEffector:
    def __init__(
        self,
        kube: Kube,
        writer: NodeWriter,
        settings: ActuatorSettings,
        policies: PolicyStore,
        breaker: Breaker,
        drains: DrainSlots,
        budgets: RepairBudgets | None = None,
    ) -> None:
        self.kube, self.writer, self.settings = kube, writer, settings
        self.policies, self.breaker, self.drains = policies, breaker, drains
        self.budgets = budgets
        self.worker = writer.worker

    # -- shared ledger bookkeeping ------------------------------------------------------------------------
    def _touch(self, ctx: FlowContext, ledger: Ledger, now: float) -> None:
        """Every write of a flow records it as open (first time) and counts its attempt (first time)."""
        flow = ctx.plan.flow_key
        if ctx.plan.new_attempt and flow not in ledger.flows:
            ledger.record_attempt(now, self.settings.attempt_window_seconds)
        kept = ctx.stored
        if kept is not None:
            ledger.open_flow(flow, kept, now, ctx.revision, replace=ctx.reopen)
            plan = ctx.plan
            if plan.case is not None:  # the repair case this incident opens or continues (idempotent)
                repaircase.apply_decision(ledger, plan.case, flow, kept["rec"], now, plan.rule, plan.case_policy,
                                          list(plan.case_again))

    @staticmethod
    def _end_with(ctx: FlowContext, ledger: Ledger, results: dict[str, StepResult], now: float) -> None:
        if ctx.last_group and all(r.stop is None for r in results.values()) and ledger.is_open(ctx.plan.flow_key):
            ledger.finish(ctx.plan.flow_key, "done", now)

    def _log(self, ledger: Ledger, flow: str, key: str, result: StepResult, now: float) -> None:
        entry = {"by": self.worker, "at": now, "outcome": result.outcome.value, "reason": result.reason}
        if result.details:
            entry["details"] = _capped(result.details)
        ledger.record_applied(flow, key, entry, now)

    @staticmethod
    def recorded(ledger: Ledger, flow: str, key: str) -> StepResult:
        """A step the ledger says is done: who did it and how, so the audit is complete even if they died."""
        entry = ledger.applied(flow, key) or {}
        details = {"applied_by": entry["by"], **(entry.get("details") or {})} if entry else {}
        return StepResult(Outcome.ALREADY_APPLIED, "recorded in the node ledger", details)

    def step_context(self, ctx: FlowContext) -> StepContext:
        return StepContext(
            kube=self.kube,
            writer=self.writer,
            settings=self.settings,
            worker=self.worker,
            plan=ctx.plan,
            view=ctx.view,
            incident=ctx.incident,
            drains=self.drains,
            policies=self.policies,
            breaker=self.breaker,
        )

    # -- groups -------------------------------------------------------------------------------------------
    async def run_group(self, ctx: FlowContext, group: list[Step]) -> dict[str, StepResult]:
        kind = group[0].action.kind
        if kind == Kind.NODE:
            await self._admit(ctx, group)
        if ctx.breaker_refused:
            blocked = {
                s.key: StepResult(Outcome.SKIPPED, ctx.breaker_refused)
                for s in group
                if not s.action.allowed_when_breaker_open
            }
            rest = [s for s in group if s.action.allowed_when_breaker_open]
            return blocked | (await self._run_kind(ctx, rest) if rest else {})
        return await self._run_kind(ctx, group)

    async def _run_kind(self, ctx: FlowContext, group: list[Step]) -> dict[str, StepResult]:
        kind = group[0].action.kind
        if kind == Kind.NODE:
            return await self._node_writes(ctx, group)
        if kind == Kind.INSTANT:
            return await self._instant(ctx, group)
        return {group[0].key: await self._long(ctx, group[0])}

    async def _admit(self, ctx: FlowContext, group: list[Step]) -> None:
        """Ask the breaker once per flow, before the first step that takes the node out of scheduling."""
        ledger = ctx.view.ledger
        pending = [s for s in group if s.quarantining and not ledger.is_done(ctx.plan.flow_key, s.key)]
        if not pending or ctx.breaker_refused is not None:
            return
        if any(owners for e, owners in ledger.owned.items() if e == CORDON or e.startswith("taint:")):
            return  # already quarantined by xidflow: counted when that happened
        admission = await self.breaker.admit(ctx.plan.node)
        if not admission.allowed:
            ctx.breaker_refused = admission.reason

    async def _node_writes(self, ctx: FlowContext, group: list[Step]) -> dict[str, StepResult]:
        flow = ctx.plan.flow_key
        sctx = self.step_context(ctx)

        def mutate(view: NodeView, ledger: Ledger) -> tuple[NodeChange | None, dict[str, StepResult]]:
            now = time.time()
            cancelled_now = bool(ledger.reconcile_manual_uncordon(view.unschedulable, now))
            if ledger.cancelled(flow):
                reason = f"cancelled: {ledger.cancelled(flow)}"
                skipped = {s.key: StepResult(Outcome.SKIPPED, reason, stop=StopReason.CANCELLED) for s in group}
                return (NodeChange() if cancelled_now else None), skipped
            self._touch(ctx, ledger, now)  # before the first mark: a new flow counts its attempt
            results: dict[str, StepResult] = {}
            spec: dict[str, Any] = {}
            cur = view
            wrote = cancelled_now
            for step in group:
                if ledger.is_done(flow, step.key):
                    results[step.key] = self.recorded(ledger, flow, step.key)
                    continue
                assert step.action.change is not None
                change = step.action.change(cur, ledger, step, sctx)
                ledger.mark_done(flow, step.key, now)
                spec.update(change.spec)
                cur = dataclasses.replace(
                    cur,
                    unschedulable=spec.get("unschedulable", cur.unschedulable),
                    taints=tuple(spec.get("taints", cur.taints)),
                )
                result = StepResult(Outcome.APPLIED if change.spec else Outcome.ALREADY_APPLIED, change.note)
                self._log(ledger, flow, step.key, result, now)
                results[step.key] = result
                wrote = True
            if wrote:
                self._end_with(ctx, ledger, results, now)
            return (NodeChange(spec=spec) if wrote else None), results

        label = f"{'+'.join(s.key for s in group)} {flow}"
        results, written = await self.writer.update(ctx.plan.node, mutate, label, ctx.view)
        ctx.wrote(written)
        return results

    async def _mark_done(
        self, ctx: FlowContext, done: dict[str, StepResult], status_steps: tuple[Step, ...] = ()
    ) -> dict[str, StepResult]:
        """Record steps done in one ledger write; ``status_steps`` (conditions) are applied by that very write.

        With status steps the write goes through the status subresource (conditions and ledger together),
        else through the Node. Returns every step's result, the status steps' included.
        """
        flow = ctx.plan.flow_key
        sctx = self.step_context(ctx)

        def mutate(view: NodeView, ledger: Ledger) -> tuple[NodeChange | None, dict[str, StepResult]]:
            now = time.time()
            results = dict(done)
            conditions = []
            for step in status_steps:
                assert step.action.status_change is not None
                entry, results[step.key] = step.action.status_change(view, step, sctx)
                if entry is not None:
                    conditions.append(entry)
            self._touch(ctx, ledger, now)
            for key, result in results.items():
                ledger.mark_done(flow, key, now)
                self._log(ledger, flow, key, result, now)
                for effect in result.owns:
                    ledger.own(effect, flow)
                for name, value in result.values.items():
                    ledger.set_flow_value(flow, name, value, now)
                step = next((s for s in ctx.plan.steps if s.key == key), None)
                if step is not None and step.action.repairs:
                    repaircase.note_repair(ledger, flow, step.name, result.outcome.value, now)
                if result.ledger_update is not None:
                    result.ledger_update(ledger, now)
            self._end_with(ctx, ledger, results, now)
            return NodeChange(status={"conditions": conditions} if conditions else {}), results

        keys = [*done, *(s.key for s in status_steps)]
        results, written = await self.writer.update(ctx.plan.node, mutate, f"{'+'.join(keys)} {flow}", ctx.view)
        ctx.wrote(written)
        return results

    async def _instant(self, ctx: FlowContext, group: list[Step]) -> dict[str, StepResult]:
        flow = ctx.plan.flow_key
        ledger = ctx.view.ledger
        if ledger.cancelled(flow):
            reason = f"cancelled: {ledger.cancelled(flow)}"
            return {s.key: StepResult(Outcome.SKIPPED, reason, stop=StopReason.CANCELLED) for s in group}
        results: dict[str, StepResult] = {}
        todo: list[Step] = []
        for step in group:
            if ledger.is_done(flow, step.key):
                results[step.key] = self.recorded(ledger, flow, step.key)
            else:
                todo.append(step)
        if not todo:
            return results
        # Steps with calls of their own (Events) run concurrently; then ONE write records them done and
        # applies the status steps (conditions) with it: the record follows every effect it names.
        status_steps = tuple(s for s in todo if s.action.status_change is not None)
        calls = [s for s in todo if s.action.status_change is None]
        sctx = self.step_context(ctx)
        outcomes = await asyncio.gather(*(self._run(s, sctx) for s in calls))
        ctx.view = sctx.view
        ran = dict(zip((s.key for s in calls), outcomes, strict=True))
        results.update(await self._mark_done(ctx, ran, status_steps))
        return results

    @staticmethod
    def _run(step: Step, sctx: StepContext) -> Awaitable[StepResult]:
        assert step.action.run is not None, f"{step.name} has no runner"
        return step.action.run(sctx, step)

    # -- long steps ---------------------------------------------------------------------------------------
    async def _claim(self, ctx: FlowContext, step: Step) -> tuple[StepResult | None, str | None]:
        """Claim the step on the node: a StepResult when it must not run here (done, cancelled, held),
        and the replica whose stale claim was retaken, if any."""
        flow = ctx.plan.flow_key
        lease = self.settings.claim_timeout_seconds

        Claimed = tuple[StepResult | None, str | None]

        def mutate(view: NodeView, ledger: Ledger) -> tuple[NodeChange | None, Claimed]:
            now = time.time()
            if ledger.is_done(flow, step.key):
                return None, (self.recorded(ledger, flow, step.key), None)
            # A person may have uncordoned the node since our cordon: record it, and stop if it was ours.
            reconciled = bool(ledger.reconcile_manual_uncordon(view.unschedulable, now))
            if ledger.cancelled(flow):
                change = NodeChange() if reconciled else None
                reason = f"cancelled: {ledger.cancelled(flow)}"
                return change, (StepResult(Outcome.SKIPPED, reason, stop=StopReason.CANCELLED), None)
            claim = ledger.claim_of(flow, step.key) or {}
            holder = ledger.claim_holder(flow, step.key, now, lease)
            if holder and holder != self.worker:
                until = float(claim.get("at", now)) + lease
                details = {"holder": holder, "lease_until": until}
                held = StepResult(Outcome.SKIPPED, f"in progress on {holder}", details, stop=StopReason.HELD)
                return None, (held, None)
            self._touch(ctx, ledger, now)
            ledger.claim(flow, step.key, self.worker, now)
            extra = step.action.claim_values(view) if step.action.claim_values else {}
            for name, value in extra.items():
                if ledger.flow_value(flow, name) is None:
                    ledger.set_flow_value(flow, name, value, now)
            previous = claim.get("by")
            return NodeChange(), (None, previous if previous and previous != self.worker else None)

        claimed, written = await self.writer.update(ctx.plan.node, mutate, f"claim {step.key} {flow}", ctx.view)
        ctx.wrote(written)
        return claimed

    async def _release(self, ctx: FlowContext, step: Step, result: StepResult, log_it: bool = True) -> None:
        flow = ctx.plan.flow_key

        def mutate(view: NodeView, ledger: Ledger) -> tuple[NodeChange | None, None]:
            claim = ledger.claim_of(flow, step.key) or {}
            if claim.get("by") != self.worker:
                return None, None
            ledger.release(flow, step.key)
            if log_it:
                self._log(ledger, flow, step.key, result, time.time())
            return NodeChange(), None

        _, written = await self.writer.update(ctx.plan.node, mutate, f"release {step.key} {flow}")
        ctx.wrote(written)

    async def _renew(self, ctx: FlowContext, step: Step, lost: asyncio.Event) -> None:
        """Keep the lease (and the drain slot) alive; notice a takeover or a cancellation."""
        flow, node = ctx.plan.flow_key, ctx.plan.node
        period = self.settings.claim_timeout_seconds / 3

        def mutate(view: NodeView, ledger: Ledger) -> tuple[NodeChange | None, str | None]:
            now = time.time()
            if ledger.reconcile_manual_uncordon(view.unschedulable, now) or ledger.cancelled(flow):
                return NodeChange(), "cancelled"
            if not ledger.renew(flow, step.key, self.worker, now):
                return None, "lost"
            return NodeChange(), None

        while True:
            await asyncio.sleep(period)
            try:
                verdict, _ = await self.writer.update(node, mutate, f"renew {step.key} {flow}")
                if step.action.uses_drain_slot:
                    await self.drains.renew(node, self.worker)
                if step.action.uses_repair_budget and self.budgets is not None and ctx.budgeted:
                    await self.budgets.renew(node, self.worker)
            except Exception as exc:  # noqa: BLE001 - keep trying: the lease outlives a few failed renewals
                if not unreachable(exc):  # an outage is logged once, as such (reachability.API_SERVER)
                    log.warning("renewing the lease of %s %s on %s failed: %s", step.key, flow, node, exc)
                continue
            if verdict == "cancelled":
                ctx.cancelled.set()
                return
            if verdict == "lost":
                lost.set()
                return

    async def _long(self, ctx: FlowContext, step: Step) -> StepResult:
        blocked, previous = await self._claim(ctx, step)
        if blocked is not None:
            return blocked
        retaken = {"retaken_from": previous} if previous else {}
        lost = asyncio.Event()
        sctx = self.step_context(ctx)
        runner = asyncio.ensure_future(self._budgeted(ctx, step, sctx))
        renewer = asyncio.ensure_future(self._renew(ctx, step, lost))
        watchers = [asyncio.ensure_future(lost.wait()), asyncio.ensure_future(ctx.cancelled.wait())]
        try:
            try:
                await asyncio.wait([runner, *watchers], return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:
                # Shutting down (SIGTERM, rebalance): hand the step over now instead of after the lease.
                runner.cancel()
                await asyncio.gather(runner, return_exceptions=True)
                stopped = StepResult(Outcome.SKIPPED, "replica stopping", stop=StopReason.LEASE_LOST)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(self._release(ctx, step, stopped, log_it=False)), 5)
                raise
            if runner.done():
                result = self._outcome(ctx, step, runner)
            else:
                runner.cancel()
                await asyncio.gather(runner, return_exceptions=True)
                if lost.is_set():
                    result = StepResult(Outcome.SKIPPED, "lease retaken by another replica", stop=StopReason.LEASE_LOST)
                else:
                    reason = f"cancelled: {ctx.view.ledger.cancelled(ctx.plan.flow_key) or 'manual-uncordon'}"
                    result = StepResult(Outcome.SKIPPED, reason, stop=StopReason.CANCELLED)
        finally:
            for task in (renewer, *watchers):
                task.cancel()
            if not runner.done():
                runner.cancel()
            await asyncio.gather(renewer, *watchers, return_exceptions=True)
        result.details = {**retaken, **result.details}
        if result.outcome == Outcome.APPLIED or result.ledger_update is not None:
            # Done, or a verdict that is the step's end either way (a failed diagnostics): recorded with what follows.
            await self._mark_done(ctx, {step.key: result})
        elif result.stop != StopReason.LEASE_LOST:
            await self._release(ctx, step, result)
        return result

    async def _budgeted(self, ctx: FlowContext, step: Step, sctx: StepContext) -> StepResult:
        """The step's runner inside a slot of each repair budget its node's groups have (none: just the runner)."""
        if not step.action.uses_repair_budget or self.budgets is None:
            return await self._run(step, sctx)
        waited = await self.budgets.acquire(ctx.plan.node, self.worker, ctx.view.labels)
        ctx.budgeted = bool(waited)
        try:
            result = await self._run(step, sctx)
        finally:
            if ctx.budgeted:
                ctx.budgeted = False
                await asyncio.shield(self.budgets.release(ctx.plan.node, self.worker))
        if waited:
            result.details = {**waited, **result.details}
        return result

    @staticmethod
    def _outcome(ctx: FlowContext, step: Step, runner: asyncio.Future[StepResult]) -> StepResult:
        exc = runner.exception()
        if exc is None:
            result = runner.result()
            if result.outcome == Outcome.FAILED and result.stop is None:
                result.stop = StopReason.FAILED
            return result
        if isinstance(exc, KubeUnavailable):
            raise exc  # the claim stays ours; the retry of the whole record resumes it
        log.error("%s on %s failed", step.key, ctx.plan.node, exc_info=exc)
        return StepResult(Outcome.FAILED, f"{type(exc).__name__}: {exc}", stop=StopReason.FAILED)

    # -- end of a flow --------------------------------------------------------------------------------------
    async def finish(self, ctx: FlowContext, status: str) -> None:
        flow = ctx.plan.flow_key

        def mutate(view: NodeView, ledger: Ledger) -> tuple[NodeChange | None, None]:
            if not ledger.is_open(flow):
                return None, None
            ledger.finish(flow, status, time.time())
            return NodeChange(), None

        _, written = await self.writer.update(ctx.plan.node, mutate, f"finish {flow}", ctx.view)
        ctx.wrote(written)

    # -- undo ---------------------------------------------------------------------------------------------
    async def undo(self, view: NodeView, flow: str, reason: str, undo: UndoPlan) -> StepResult:
        """Remove what the flow applied and nobody else owns; conditions first, then node + ledger at once."""
        from pipeline.actuator.plan import plan_recovery_for

        done: dict[str, Any] = {}

        def mutate(v: NodeView, ledger: Ledger) -> tuple[NodeChange | None, Any]:
            u = plan_recovery_for(flow, v)
            spec: dict[str, Any] = {}
            if u.uncordon:
                spec["unschedulable"] = False
            if u.remove_taints:
                spec.update(effects.remove_taints_change(v, list(u.remove_taints)).spec)
            for effect in u.disown:
                ledger.disown(effect, flow)
            ledger.set_flow_value(flow, "recovered", reason, time.time())
            done.update(uncordoned=u.uncordon, taints_removed=[list(t) for t in u.remove_taints])
            done["conditions_cleared"] = list(u.clear_conditions)
            return NodeChange(spec=spec), None

        # Conditions first: they are idempotent, and the ledger write below is what marks the undo done,
        # so a crash in between replays the whole undo instead of leaving a condition behind.
        await condition_action.restore(self.kube, view, undo.clear_conditions, f"{flow} recovered: {reason}")
        if undo.delete_device_rules:  # xidflow's DeviceTaintRules (taintDevice): idempotent like the conditions
            from pipeline.actuator.actions.taint_device import delete_rules

            done["device_rules_deleted"] = await delete_rules(self.kube, undo.delete_device_rules)
        await self.writer.update(view.name, mutate, f"undo {flow}")
        return StepResult(Outcome.APPLIED, reason, done)
