"""Runs plans: step by step, with the ledger, claims, the breaker and the audit.

Consecutive node-object steps (cordon, taint, unCordon) are written in ONE conditional patch
together with the ledger; consecutive instant steps (condition, Event) run concurrently and are
marked done in one ledger write; long steps (drain, reboot, resetGpu, enableWarmStandby) are
claimed first so that a second replica or a redelivery never starts them twice. Every write to a
Node carries the resourceVersion it was computed from and is recomputed on 409.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.actuator import effects, jobtemplates
from pipeline.actuator.audit import Auditor, default_worker_id, make_record
from pipeline.actuator.breaker import Breaker, DrainSlots
from pipeline.actuator.effects import NodeChange
from pipeline.actuator.kube import API_PRIORITY, Conflict, Forbidden, Invalid, Kube, KubeUnavailable, NotFound
from pipeline.actuator.ownership import (
    CORDON,
    LAST_ACTION_ANNOTATION,
    LEDGER_ANNOTATION,
    REBOOT_REQUEST_ANNOTATION,
    Ledger,
    request_flow_key,
)
from pipeline.actuator.plan import NodeView, Plan, Step, plan_incident, plan_recovery, plan_request
from pipeline.actuator.policystore import PolicyStore
from pipeline.actuator.problems import ProblemClass, event_message
from pipeline.actuator.settings import ActuatorSettings
from schemas.records import NodeIncident, NodeRecovered, Outcome

log = logging.getLogger("xidflow.actuator.engine")

NODE_WRITE = frozenset({"cordon", "taint", "unCordon"})
INSTANT = frozenset({"condition", "event"})
# Once the breaker refuses, only the Event (information, no disruption) may still happen.
ALLOWED_WHEN_BREAKER_OPEN = frozenset({"event"})


@dataclass
class StepResult:
    outcome: Outcome
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class FlowContext:
    plan: Plan
    incident: NodeIncident | None
    view: NodeView
    breaker_refused: str | None = None
    stop: bool = False
    audits: list[asyncio.Task[None]] = field(default_factory=list)


def _node(record: Any) -> str:
    return getattr(record, "node", None) or record.node_name


def _flow(record: Any) -> str:
    return record.incident_id if hasattr(record, "incident_id") else request_flow_key(record.request_id)


def group_steps(steps: tuple[Step, ...]) -> list[list[Step]]:
    """Consecutive node-write steps together, consecutive instant steps together, long steps alone.

    A step with a wait after it closes its group so the wait falls where the policy put it.
    """
    groups: list[list[Step]] = []
    for step in steps:
        kind = "node" if step.name in NODE_WRITE else "instant" if step.name in INSTANT else None
        last = groups[-1] if groups else None
        last_kind = None
        if last:
            last_kind = "node" if last[0].name in NODE_WRITE else "instant" if last[0].name in INSTANT else None
        if kind and last and last_kind == kind and not last[-1].spec.waittime:
            last.append(step)
        else:
            groups.append([step])
    return groups


class Engine:
    def __init__(
        self,
        kube: Kube,
        auditor: Auditor,
        settings: ActuatorSettings,
        policies: PolicyStore,
        breaker: Breaker,
        drains: DrainSlots,
    ) -> None:
        self.kube, self.auditor, self.settings = kube, auditor, settings
        self.policies, self.breaker, self.drains = policies, breaker, drains
        self.worker = settings.worker_id or default_worker_id()
        # Called with a request id once its plan is done or abandoned, so the decision API's
        # pending-plans limit stops counting it (set by the Actuator when the API module is present).
        self.on_request_done: Callable[[str], Awaitable[None]] | None = None

    # -- entry points -------------------------------------------------------------------------------
    async def handle(self, record: Any) -> None:
        """One record from the incidents or requests topic, retried until the API server answers."""
        delay = self.settings.retry_initial_seconds
        API_PRIORITY.set(1)
        while True:
            try:
                if isinstance(record, NodeIncident):
                    return await self.handle_incident(record)
                if isinstance(record, NodeRecovered):
                    return await self.handle_recovered(record)
                return await self.handle_request(record)
            except (KubeUnavailable, Forbidden, NotFound) as exc:
                # Unreachable, 5xx, RBAC not (yet) granted, our namespace missing: an operator or time
                # fixes these. Every effect is idempotent, so replaying the whole record later is safe.
                log.warning("%s; retrying %s for %s in %.1fs", exc, record.type, _node(record), delay)
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, self.settings.retry_max_seconds)
            except Invalid as exc:
                # The request itself is wrong (a bad Job template, a policy the API server refuses):
                # retrying cannot help, so it is audited as failed and the record is done.
                log.error("%s for %s refused by the API server: %s", record.type, _node(record), exc)
                await self._audit_now(_node(record), _flow(record), "decide", Outcome.FAILED, str(exc))
                return

    async def _read_node(self, name: str) -> NodeView | None:
        try:
            return NodeView.from_object(await self.kube.get_node(name))
        except NotFound:
            return None

    async def handle_incident(self, incident: NodeIncident) -> None:
        # Until the node is out of scheduling, its API calls go ahead of other nodes' Events/conditions.
        API_PRIORITY.set(0 if incident.quarantine or incident.action.quarantines else 1)
        await self.policies.maybe_refresh()
        view = await self._read_node(incident.node)
        if view is None:
            await self._audit_now(incident.node, incident.incident_id, "decide", Outcome.SKIPPED, "node not found")
            return
        view = await self._reconcile_manual_uncordon(view)
        plan = plan_incident(incident, self.policies.current, view, self.settings, time.time())
        await self.run_plan(FlowContext(plan=plan, incident=incident, view=view))

    async def handle_request(self, request: Any) -> None:
        view = await self._read_node(request.node_name)
        if view is None:
            flow = request_flow_key(request.request_id)
            await self._audit_now(request.node_name, flow, "decide", Outcome.SKIPPED, "node not found")
            await self._request_done(request.request_id)
            return
        view = await self._reconcile_manual_uncordon(view)
        plan = plan_request(request, view, self.settings)
        await self.run_plan(FlowContext(plan=plan, incident=None, view=view))
        await self._request_done(request.request_id)

    async def _request_done(self, request_id: str) -> None:
        if self.on_request_done is None:
            return
        try:
            await self.on_request_done(request_id)
        except Exception as exc:  # noqa: BLE001 - the plan entry also expires on its own
            log.warning("could not release plan %s from the pending-plans ledger: %s", request_id, exc)

    async def handle_recovered(self, recovered: NodeRecovered) -> None:
        flow = recovered.incident_id
        view = await self._read_node(recovered.node)
        if view is None:
            await self._audit_now(recovered.node, flow, "undo", Outcome.SKIPPED, "node not found")
            return
        undo = plan_recovery(recovered, view)
        if not undo.disown:
            outcome = Outcome.ALREADY_APPLIED if view.ledger.flow_value(flow, "recovered") else Outcome.SKIPPED
            await self._audit_now(view.name, flow, "undo", outcome, "nothing owned by this incident")
            return
        if self.settings.dry_run:
            await self._audit_now(view.name, flow, "undo", Outcome.DRY_RUN, "dry-run", details=dataclasses.asdict(undo))
            return
        done: dict[str, Any] = {}

        def mutate(v: NodeView, ledger: Ledger) -> tuple[NodeChange | None, Any]:
            u = plan_recovery(recovered, v)
            spec: dict[str, Any] = {}
            if u.uncordon:
                spec["unschedulable"] = False
            if u.remove_taints:
                spec.update(effects.remove_taints_change(v, list(u.remove_taints)).spec)
            for effect in u.disown:
                ledger.disown(effect, flow)
            ledger.set_flow_value(flow, "recovered", recovered.reason, time.time())
            done.update(uncordoned=u.uncordon, taints_removed=[list(t) for t in u.remove_taints])
            done["conditions_cleared"] = list(u.clear_conditions)
            return NodeChange(spec=spec), None

        # Conditions first: they are idempotent, and the ledger write below is what marks the undo done,
        # so a crash in between replays the whole undo instead of leaving a condition behind.
        await asyncio.gather(
            *(
                effects.set_condition(
                    self.kube,
                    view.name,
                    ctype,
                    False,
                    "XidflowRecovered",
                    f"{flow} recovered: {recovered.reason}",
                )
                for ctype in undo.clear_conditions
            )
        )
        await self._update_node(view.name, mutate, step_label=f"undo {flow}")
        await self._audit_now(view.name, flow, "undo", Outcome.APPLIED, recovered.reason, details=done)

    # -- plans -------------------------------------------------------------------------------------------
    async def run_plan(self, ctx: FlowContext) -> None:
        plan = ctx.plan
        if ctx.incident is not None:
            self.auditor.tell(ctx.incident)
        decision = (
            Outcome.SKIPPED if plan.skip_reason else Outcome.DRY_RUN if self.settings.dry_run else Outcome.APPLIED
        )
        self._audit(
            ctx,
            "decide",
            StepResult(
                decision,
                plan.skip_reason or ("escalated to CONTACT_SUPPORT" if plan.escalated else f"rule {plan.rule}"),
                {"rule": plan.rule, "steps": [s.key for s in plan.steps], **plan.details},
            ),
        )
        try:
            if plan.skip_reason:
                return
            for group in group_steps(plan.steps):
                if ctx.stop:
                    for step in group:
                        self._audit(ctx, step.key, StepResult(Outcome.SKIPPED, "flow stopped earlier"))
                    continue
                results = await self._run_group(ctx, group)
                if any(s.quarantining for s in group):
                    API_PRIORITY.set(1)
                for step in group:
                    result = results[step.key]
                    self._audit(ctx, step.key, result)
                    if result.outcome == Outcome.FAILED or result.reason.startswith(("cancelled", "in progress")):
                        ctx.stop = True
                last = group[-1]
                if last.spec.waittime and results[last.key].outcome == Outcome.APPLIED and not ctx.stop:
                    await asyncio.sleep(last.spec.waittime)
        finally:
            # The record is done only when every audit record of it is durable.
            await asyncio.gather(*ctx.audits)

    async def _run_group(self, ctx: FlowContext, group: list[Step]) -> dict[str, StepResult]:
        if self.settings.dry_run:
            return {s.key: StepResult(Outcome.DRY_RUN, f"dry-run: would {s.name}") for s in group}
        if ctx.breaker_refused:
            blocked = {
                s.key: StepResult(Outcome.SKIPPED, ctx.breaker_refused)
                for s in group
                if s.name not in ALLOWED_WHEN_BREAKER_OPEN
            }
            rest = [s for s in group if s.name in ALLOWED_WHEN_BREAKER_OPEN]
            return blocked | (await self._run_group_live(ctx, rest) if rest else {})
        return await self._run_group_live(ctx, group)

    async def _run_group_live(self, ctx: FlowContext, group: list[Step]) -> dict[str, StepResult]:
        first = group[0].name
        if first in NODE_WRITE:
            return await self._node_write_group(ctx, group)
        if first in INSTANT:
            return await self._instant_group(ctx, group)
        return {group[0].key: await self._long_step(ctx, group[0])}

    # -- node writes ------------------------------------------------------------------------------------
    async def _update_node(
        self,
        node: str,
        mutate: Callable[[NodeView, Ledger], tuple[NodeChange | None, Any]],
        step_label: str,
        first: NodeView | None = None,
    ) -> tuple[Any, NodeView | None]:
        """Conditional read-modify-write of a Node and its ledger, recomputed on 409.

        Returns what ``mutate`` returned and the Node as written (None when nothing was written).
        """
        view = first
        for _ in range(100):
            if view is None:
                view = await self._read_node(node)
                if view is None:
                    raise NotFound(404, "NotFound", f"node {node} is gone")
            ledger = view.ledger
            change, result = mutate(view, ledger)
            if change is None:
                return result, None
            ledger.prune(self.settings.ledger_max_flows)
            annotations: dict[str, str | None] = {
                LEDGER_ANNOTATION: ledger.to_annotation(),
                LAST_ACTION_ANNOTATION: f"{step_label} by {self.worker} at {effects.now_rfc3339()}",
                **change.annotations,
            }
            body: dict[str, Any] = {"metadata": {"resourceVersion": view.resource_version, "annotations": annotations}}
            if change.spec:
                body["spec"] = change.spec
            try:
                return result, NodeView.from_object(await self.kube.patch_node(node, body))
            except Conflict:
                view = None  # someone else wrote the node: read it again and recompute, never clobber
        raise KubeUnavailable(f"node {node}: gave up after 100 conflicting writes")

    def _record_attempt(self, ctx: FlowContext, ledger: Ledger, now: float) -> None:
        if ctx.plan.new_attempt and ctx.plan.flow_key not in ledger.flows:
            ledger.record_attempt(now, self.settings.attempt_window_seconds)

    async def _reconcile_manual_uncordon(self, view: NodeView) -> NodeView:
        """Persist the cancellation of flows whose cordon a person removed."""
        if view.unschedulable or not view.ledger.owners(CORDON):
            return view

        def mutate(v: NodeView, ledger: Ledger) -> tuple[NodeChange | None, Any]:
            cancelled = ledger.reconcile_manual_uncordon(v.unschedulable, time.time())
            return (NodeChange() if cancelled else None), cancelled

        cancelled, written = await self._update_node(view.name, mutate, "manual-uncordon detected", first=view)
        for flow in cancelled or []:
            await self._audit_now(view.name, flow, "cancel", Outcome.APPLIED, "manual-uncordon by a person")
        return written or view

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

    async def _node_write_group(self, ctx: FlowContext, group: list[Step]) -> dict[str, StepResult]:
        await self._admit(ctx, group)
        if ctx.breaker_refused:
            return {s.key: StepResult(Outcome.SKIPPED, ctx.breaker_refused) for s in group}
        flow = ctx.plan.flow_key
        problem = ctx.plan.problem

        def mutate(view: NodeView, ledger: Ledger) -> tuple[NodeChange | None, dict[str, StepResult]]:
            now = time.time()
            results: dict[str, StepResult] = {}
            if ledger.reconcile_manual_uncordon(view.unschedulable, now) and ledger.cancelled(flow):
                reason = f"cancelled: {ledger.cancelled(flow)}"
                return NodeChange(), {s.key: StepResult(Outcome.SKIPPED, reason) for s in group}
            if ledger.cancelled(flow):
                return None, {s.key: StepResult(Outcome.SKIPPED, f"cancelled: {ledger.cancelled(flow)}") for s in group}
            self._record_attempt(ctx, ledger, now)
            spec: dict[str, Any] = {}
            cur = view
            for step in group:
                if ledger.is_done(flow, step.key):
                    results[step.key] = StepResult(Outcome.ALREADY_APPLIED, "recorded in the node ledger")
                    continue
                if step.name == "cordon":
                    change = effects.cordon_change(cur, ledger, flow)
                elif step.name == "unCordon":
                    change = effects.uncordon_change(cur, ledger, flow)
                else:
                    s = step.spec
                    change = effects.taint_change(
                        cur,
                        ledger,
                        flow,
                        s.key or self.settings.taint_key,
                        s.value or (problem.taint_value if problem else "rescue-request"),
                        s.effect or self.settings.taint_effect,
                    )
                ledger.mark_done(flow, step.key, now)
                spec.update(change.spec)
                cur = dataclasses.replace(
                    cur,
                    unschedulable=spec.get("unschedulable", cur.unschedulable),
                    taints=tuple(spec.get("taints", cur.taints)),
                )
                outcome = Outcome.APPLIED if change.spec else Outcome.ALREADY_APPLIED
                results[step.key] = StepResult(outcome, change.note)
            if all(r.outcome == Outcome.ALREADY_APPLIED and r.reason.startswith("recorded") for r in results.values()):
                return None, results
            return NodeChange(spec=spec), results

        label = f"{'+'.join(s.key for s in group)} {flow}"
        results, written = await self._update_node(ctx.plan.node, mutate, label, ctx.view)
        ctx.view = written or ctx.view
        return results

    async def _mark_done(
        self,
        ctx: FlowContext,
        keys: list[str],
        extra: dict[str, Any] | None = None,
        owned: list[str] | None = None,
    ) -> None:
        flow = ctx.plan.flow_key

        def mutate(view: NodeView, ledger: Ledger) -> tuple[NodeChange | None, None]:
            now = time.time()
            self._record_attempt(ctx, ledger, now)
            for key in keys:
                ledger.mark_done(flow, key, now)
            for effect in owned or []:
                ledger.own(effect, flow)
            for name, value in (extra or {}).items():
                ledger.set_flow_value(flow, name, value, now)
            return NodeChange(), None

        _, written = await self._update_node(ctx.plan.node, mutate, f"{'+'.join(keys) or 'record'} {flow}", ctx.view)
        ctx.view = written or ctx.view

    # -- instant steps -----------------------------------------------------------------------------------
    async def _instant_group(self, ctx: FlowContext, group: list[Step]) -> dict[str, StepResult]:
        flow = ctx.plan.flow_key
        ledger = ctx.view.ledger
        if ledger.cancelled(flow):
            return {s.key: StepResult(Outcome.SKIPPED, f"cancelled: {ledger.cancelled(flow)}") for s in group}
        results: dict[str, StepResult] = {}
        todo = []
        for step in group:
            if ledger.is_done(flow, step.key):
                results[step.key] = StepResult(Outcome.ALREADY_APPLIED, "recorded in the node ledger")
            else:
                todo.append(step)
        outcomes = await asyncio.gather(*(self._instant(ctx, s) for s in todo))
        results.update({s.key: r for s, r in zip(todo, outcomes, strict=True)})
        if todo:
            owned = [r.details["owns"] for r in outcomes if "owns" in r.details]
            await self._mark_done(ctx, [s.key for s in todo], owned=owned)
        return results

    async def _instant(self, ctx: FlowContext, step: Step) -> StepResult:
        plan, incident = ctx.plan, ctx.incident
        problem = plan.problem
        message = event_message(incident) if incident else f"rescue request {plan.flow_key}"
        if step.name == "condition":
            ctype = str(problem.condition_type) if problem else str(ProblemClass.XID)
            reason = "ContactSupport" if plan.escalated else (problem.event_reason if problem else "RescueRequest")
            return await self._set_condition(ctx, ctype, reason, message)
        reason = problem.event_reason if problem else "RescueRequest"
        name = effects.object_name(plan.node[:200], plan.node, plan.flow_key, step.key)
        created = await effects.create_node_event(self.kube, ctx.view, name, reason, message)
        return StepResult(
            Outcome.APPLIED if created else Outcome.ALREADY_APPLIED,
            f"Warning {reason}" if created else f"Event {name} already exists",
            {"event": name},
        )

    async def _set_condition(self, ctx: FlowContext, ctype: str, reason: str, message: str) -> StepResult:
        """Conditional status write: of two replicas racing, one sets it and the other sees it set."""
        view = ctx.view
        for _ in range(50):
            current = view.condition(ctype)
            if current and current.get("status") == "True" and current.get("reason") == reason:
                return StepResult(Outcome.ALREADY_APPLIED, f"{ctype}=True already set")
            try:
                written = await effects.set_condition(
                    self.kube, ctx.plan.node, ctype, True, reason, message, view.resource_version
                )
            except Conflict:
                fresh = await self._read_node(ctx.plan.node)
                if fresh is None:
                    raise NotFound(404, "NotFound", f"node {ctx.plan.node} is gone") from None
                view = fresh
                continue
            ctx.view = NodeView.from_object(written)
            # Ownership of the condition is recorded with the step's done mark.
            return StepResult(Outcome.APPLIED, f"{ctype}=True ({reason})", {"owns": f"condition:{ctype}"})
        raise KubeUnavailable(f"node {ctx.plan.node}: condition kept conflicting")

    # -- long steps ----------------------------------------------------------------------------------------
    async def _claim(self, ctx: FlowContext, step: Step, extra: dict[str, Any] | None = None) -> StepResult | None:
        """Claim the step on the node; a StepResult when it must not run here (done, cancelled, running)."""
        flow = ctx.plan.flow_key

        def mutate(view: NodeView, ledger: Ledger) -> tuple[NodeChange | None, StepResult | None]:
            now = time.time()
            if ledger.is_done(flow, step.key):
                return None, StepResult(Outcome.ALREADY_APPLIED, "recorded in the node ledger")
            # A person may have uncordoned the node since our cordon: record it, and stop if it was ours.
            reconciled = bool(ledger.reconcile_manual_uncordon(view.unschedulable, now))
            if ledger.cancelled(flow):
                change = NodeChange() if reconciled else None
                return change, StepResult(Outcome.SKIPPED, f"cancelled: {ledger.cancelled(flow)}")
            holder = ledger.claim_holder(flow, step.key, now, self.settings.claim_timeout_seconds)
            if holder and holder != self.worker:
                return None, StepResult(Outcome.SKIPPED, f"in progress on {holder}")
            self._record_attempt(ctx, ledger, now)
            ledger.claim(flow, step.key, self.worker, now)
            for name, value in (extra or {}).items():
                if ledger.flow_value(flow, name) is None:
                    ledger.set_flow_value(flow, name, value, now)
            return NodeChange(), None

        blocked, written = await self._update_node(ctx.plan.node, mutate, f"claim {step.key} {flow}", ctx.view)
        ctx.view = written or ctx.view
        return blocked

    async def _release(self, ctx: FlowContext, step: Step) -> None:
        flow = ctx.plan.flow_key

        def mutate(view: NodeView, ledger: Ledger) -> tuple[NodeChange | None, None]:
            ledger.release(flow, step.key)
            return NodeChange(), None

        _, written = await self._update_node(ctx.plan.node, mutate, f"release {step.key} {flow}")
        ctx.view = written or ctx.view

    async def _long_step(self, ctx: FlowContext, step: Step) -> StepResult:
        extra = {"boot_id_before": ctx.view.boot_id} if step.name == "reboot" else None
        blocked = await self._claim(ctx, step, extra)
        if blocked is not None:
            return blocked
        try:
            runner = {
                "drain": self._drain,
                "reboot": self._reboot,
                "resetGpu": self._reset_gpu,
                "enableWarmStandby": self._warm_standby,
            }[step.name]
            result = await runner(ctx, step)
        except (KubeUnavailable, asyncio.CancelledError):
            raise  # the claim stays ours; the retry of the whole record resumes it
        except Exception as exc:
            log.exception("%s on %s failed", step.key, ctx.plan.node)
            result = StepResult(Outcome.FAILED, f"{type(exc).__name__}: {exc}")
        if result.outcome == Outcome.APPLIED:
            await self._mark_done(ctx, [step.key])
        else:
            await self._release(ctx, step)
        return result

    async def _drain(self, ctx: FlowContext, step: Step) -> StepResult:
        await self.drains.acquire(ctx.plan.node, self.worker)
        try:
            res = await effects.drain(self.kube, ctx.plan.node, step.spec)
        finally:
            await self.drains.release(ctx.plan.node)
        details = {"evicted": res.evicted, "forced": res.forced, "left_alone": res.left_alone}
        if not res.ok:
            return StepResult(Outcome.FAILED, res.reason, details | {"blocked": res.blocked})
        return StepResult(Outcome.APPLIED, f"{len(res.evicted)} evicted, {len(res.forced)} forced", details)

    async def _reboot(self, ctx: FlowContext, step: Step) -> StepResult:
        plan, spec = ctx.plan, step.spec
        before = ctx.view.ledger.flow_value(plan.flow_key, "boot_id_before") or ctx.view.boot_id
        hook = spec.hook or "job"
        details: dict[str, Any] = {"hook": hook, "boot_id_before": before}
        if hook == "job":
            name = effects.object_name("xidflow-reboot", plan.node, plan.flow_key, length=12)
            template = spec.job_template or self._template(
                self.settings.reboot_job_template, effects.DEFAULT_REBOOT_JOB
            )
            job = effects.render_job(
                template, name, self.settings.namespace, plan.node, {"xidflow.dev/flow": plan.flow_key[:63]}
            )
            job = jobtemplates.enforce(job, self.settings.hook_service_account)
            details["job"] = name
            details["created"] = await effects.create_hook_job(self.kube, job)
        elif hook == "annotation":

            def mutate(view: NodeView, ledger: Ledger) -> tuple[NodeChange | None, None]:
                if view.annotations.get(REBOOT_REQUEST_ANNOTATION) == plan.flow_key:
                    return None, None
                return effects.reboot_annotation_change(plan.flow_key), None

            await self._update_node(plan.node, mutate, f"reboot-request {plan.flow_key}")
        else:
            payload = {"node": plan.node, "flow": plan.flow_key, "bootId": before, "action": "reboot"}
            details["status"] = await effects.call_webhook(spec.webhook_url or "", payload, plan.flow_key)
        ok, view = await effects.wait_for_reboot(
            self.kube, plan.node, before, spec.timeout or effects.DEFAULT_REBOOT_TIMEOUT
        )
        if not ok:
            return StepResult(Outcome.FAILED, "node did not come back Ready with a new bootID", details)
        details["boot_id_after"] = view.boot_id
        if hook == "annotation":

            def clear(v: NodeView, ledger: Ledger) -> tuple[NodeChange | None, None]:
                if REBOOT_REQUEST_ANNOTATION not in v.annotations:
                    return None, None
                return NodeChange(annotations={REBOOT_REQUEST_ANNOTATION: None}), None

            await self._update_node(plan.node, clear, f"reboot-done {plan.flow_key}")
        if spec.uncordon_after:
            flow = plan.flow_key

            def uncordon(v: NodeView, ledger: Ledger) -> tuple[NodeChange | None, str]:
                change = effects.uncordon_change(v, ledger, flow)
                return change, change.note or "uncordoned"

            details["uncordon"], _ = await self._update_node(plan.node, uncordon, f"uncordon-after-reboot {flow}")
        return StepResult(Outcome.APPLIED, f"rebooted: bootID {before} -> {view.boot_id}", details)

    @staticmethod
    def _template(path: str, default: str) -> str:
        if not path:
            return default
        with open(path, encoding="utf-8") as fh:
            return fh.read()

    async def _reset_gpu(self, ctx: FlowContext, step: Step) -> StepResult:
        plan, spec = ctx.plan, step.spec
        name = effects.object_name("xidflow-gpureset", plan.node, plan.flow_key, length=12)
        template = spec.job_template or self._template(self.settings.reset_job_template, effects.DEFAULT_RESET_JOB)
        job = effects.render_job(
            template, name, self.settings.namespace, plan.node, {"xidflow.dev/flow": plan.flow_key[:63]}
        )
        job = jobtemplates.enforce(job, self.settings.hook_service_account)
        if ctx.incident is not None and ctx.incident.pci:
            for container in job["spec"]["template"]["spec"].get("containers", []):
                container.setdefault("env", []).append({"name": "XIDFLOW_GPU_PCI", "value": ctx.incident.pci})
        created = await effects.create_hook_job(self.kube, job)
        details = {"job": name, "created": created}
        if spec.timeout:
            ok = await effects.wait_for_job(self.kube, self.settings.namespace, name, spec.timeout)
            if not ok:
                return StepResult(Outcome.FAILED, "reset Job failed" if ok is False else "reset Job timed out", details)
        return StepResult(Outcome.APPLIED, f"reset Job {name}", details)

    async def _warm_standby(self, ctx: FlowContext, step: Step) -> StepResult:
        plan = ctx.plan
        # Standby nodes are part of the GPU fleet: the fleet selector keeps the choice inside it.
        selector = ",".join(x for x in (self.settings.gpu_node_selector, f"{self.settings.standby_label}=true") if x)
        standby = await self.kube.list_nodes(selector)
        targets = self.policies.current.standby_targets(ctx.view.labels)
        chosen = effects.choose_standby([n for n in standby if n["metadata"]["name"] != plan.node], targets)
        if chosen is None:
            return StepResult(Outcome.FAILED, "no cordoned standby node available", {"targets": targets})
        for _ in range(20):
            node = NodeView.from_object(await self.kube.get_node(chosen))
            if not node.unschedulable:
                break
            change = effects.standby_change(node, plan.node, plan.flow_key)
            body = {
                "metadata": {"resourceVersion": node.resource_version, "annotations": change.annotations},
                "spec": change.spec,
            }
            try:
                await self.kube.patch_node(chosen, body)
                break
            except Conflict:
                continue
        await self._mark_done(ctx, [], {"standby": chosen})
        return StepResult(Outcome.APPLIED, f"standby {chosen} made schedulable", {"standby": chosen})

    # -- audit -------------------------------------------------------------------------------------------
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
        ctx.audits.append(asyncio.ensure_future(self.auditor.emit(record)))

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
