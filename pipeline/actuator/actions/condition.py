"""condition: set a NodeCondition for node-repair tooling, and put it back on recovery.

Without attributes it sets the problem's own condition (GpuXid, GpuEcc, GpuFellOffBus, ...) to True.
With ``type`` and ``status`` it sets a well-known condition other tools act on instead, e.g.
``{name: condition, type: AcceleratedHardwareReady, status: "False"}``, which Karpenter node repair and
EKS node auto repair replace a node on. ``reason`` overrides the reason (default: the problem's).

xidflow owns (ledger) what it changed: its own condition types always, another type only when it
changed its status (a value another tool already wrote is left to that tool). Undo puts back the
healthy status (``conditions.recovered_status``), and only while the condition still says what
xidflow wrote.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pipeline.actuator import conditions, effects
from pipeline.actuator.actions.base import ActionDef, ActionSpecLike, Kind, StepContext, StepLike, StepResult
from pipeline.actuator.kube import Conflict, Kube, KubeUnavailable, NotFound
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.problems import OWN_CONDITION_TYPES, Problem, ProblemClass, event_message
from schemas.records import Outcome

if TYPE_CHECKING:
    from pipeline.actuator.settings import ActuatorSettings

_ATTEMPTS = 50


def target(spec: ActionSpecLike, problem: Problem | None) -> tuple[str, str]:
    """(type, status) the step sets: the policy's, else the problem's own condition, True."""
    if spec.condition_type:
        return spec.condition_type, str(spec.status)
    return str(problem.condition_type if problem else ProblemClass.XID), "True"


def _effect_key(spec: ActionSpecLike, settings: ActuatorSettings, problem: Problem | None) -> str | None:
    if not spec.condition_type and problem is None:
        return None
    return conditions.effect_key(*target(spec, problem))


def decide(view: NodeView, step: StepLike, ctx: StepContext) -> tuple[dict[str, Any] | None, StepResult]:
    """The condition to write given the node as seen (pure), or None with why nothing is written.

    The effector writes it with the ledger in one status write (``status_change``); ``run`` writes it alone.
    """
    plan, problem = ctx.plan, ctx.plan.problem
    ctype, status = target(step.spec, problem)
    default_reason = "ContactSupport" if plan.escalated else (problem.event_reason if problem else "RescueRequest")
    reason = step.spec.reason or default_reason
    message = event_message(ctx.incident) if ctx.incident else f"rescue request {plan.flow_key}"
    key = conditions.effect_key(ctype, status)
    current = view.condition(ctype)
    already = current is not None and current.get("status") == status
    if already and ctype not in OWN_CONDITION_TYPES and not view.ledger.owners(key):
        # Another tool (or a person) already says so: theirs to clear, never ours to undo.
        return None, StepResult(Outcome.ALREADY_APPLIED, f"{ctype}={status} already set by someone else; not owned")
    if already and current is not None and current.get("reason") == reason:
        return None, StepResult(Outcome.ALREADY_APPLIED, f"{ctype}={status} already set", owns=(key,))
    entry = conditions.next_condition(current, ctype, status, reason, message, effects.now_rfc3339())
    return entry, StepResult(Outcome.APPLIED, f"{ctype}={status} ({reason})", owns=(key,))


async def run(ctx: StepContext, step: StepLike) -> StepResult:
    """Conditional status write: of two replicas racing, one sets it and the other sees it set."""
    view = ctx.view
    for _ in range(_ATTEMPTS):
        entry, result = decide(view, step, ctx)
        if entry is None:
            return result
        body = {"metadata": {"resourceVersion": view.resource_version}, "status": {"conditions": [entry]}}
        try:
            written = await ctx.kube.patch_node_status(view.name, body)
        except Conflict:
            fresh = await ctx.writer.read(view.name)
            if fresh is None:
                raise NotFound(404, "NotFound", f"node {view.name} is gone") from None
            view = fresh
            continue
        ctx.view = NodeView.from_object(written)
        return result
    raise KubeUnavailable(f"node {view.name}: condition kept conflicting")


def restorations(view: NodeView, owned: Iterable[str], message: str) -> list[dict[str, Any]]:
    """The conditions undo writes back (pure): each owned entry (``GpuXid``, ``AcceleratedHardwareReady=False``)
    whose condition still has the status xidflow set gets the healthy status; the rest are left alone."""
    out: list[dict[str, Any]] = []
    now = effects.now_rfc3339()
    for entry in owned:
        ctype, set_status = conditions.parse_owned(entry)
        current = view.condition(ctype)
        if current is None or current.get("status") != set_status:
            continue  # already healthy, or someone else changed it since: not ours to overwrite
        out.append(
            conditions.next_condition(
                current, ctype, conditions.recovered_status(set_status), conditions.RECOVERED_REASON, message, now
            )
        )
    return out


async def restore(kube: Kube, view: NodeView, owned: Iterable[str], message: str) -> list[str]:
    """Undo: put back every owned condition in one conditional status patch; the types written."""
    entries = list(owned)
    for _ in range(_ATTEMPTS):
        writes = restorations(view, entries, message)
        if not writes:
            return []
        body = {"metadata": {"resourceVersion": view.resource_version}, "status": {"conditions": writes}}
        try:
            await kube.patch_node_status(view.name, body)
        except Conflict:
            view = NodeView.from_object(await kube.get_node(view.name))
            continue
        return [str(c["type"]) for c in writes]
    raise KubeUnavailable(f"node {view.name}: conditions kept conflicting")


ACTION = ActionDef(
    name="condition",
    kind=Kind.INSTANT,
    attrs=frozenset({"condition_type", "status", "reason"}),
    owns="the NodeCondition it set: the problem's own type, or the policy's type when xidflow changed it",
    undo="put the healthy status back (own types False, XidflowRecovered; a type set False/Unknown True), "
    "while it still says what xidflow set",
    effect_key=_effect_key,
    run=run,
    status_change=decide,
)
