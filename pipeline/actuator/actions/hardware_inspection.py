"""hardwareInspection: hand the node to an external repair system, once per hand-off of its repair case.

The ``RepairRequest`` names the node, the faults and their evidence, the repairs tried and the diagnostics run
(``pipeline.actuator.repairrequest``); with the rule's ``handoff.webhookUrl`` it is also POSTed as a CloudEvent.
A Warning Event (reason ``HardwareInspection``) says why. The node stays out (its cordon and taint belong to
the case's flows) and nothing touches it until the request's status says ``Repaired`` or ``Replaced``
(``repaircase``). Idempotent: the request's name is the case's and the hand-off's number (a retry or a racing
replica finds it), the Event's is derived from it, the webhook receiver dedupes on the CloudEvent's id.
"""

from __future__ import annotations

from typing import Any

from pipeline.actuator import effects, repaircase, repairrequest
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepLike, StepResult
from pipeline.kafka.cloudevents import CloudEventsSettings
from schemas.records import Outcome


def _why(case: dict[str, Any]) -> str:
    policy = case.get("policy") or {}
    tried = ", ".join(str(r.get("action")) for r in case.get("repairs") or []) or "none"
    verdicts = ", ".join(str(d.get("verdict")) for d in case.get("diagnostics") or []) or "none"
    return (
        f"{case.get('class')}: {int(case.get('failed') or 0)} repairs did not hold (limit "
        f"{policy.get('maxFailedRepairs', 2)}, window {float(policy.get('window', 86400)):g}s); repairs tried: "
        f"{tried}; diagnostics: {verdicts}; faults: {len(case.get('faults') or [])}"
    )


async def run(ctx: StepContext, step: StepLike) -> StepResult:
    plan = ctx.plan
    found = repaircase.case_of_flow(ctx.view.ledger, plan.flow_key)
    if found is None:  # listed in a rule for a fault without a case: the case of the flow's own incident
        cls = str(plan.problem.condition_type) if plan.problem else "GpuXid"
        case: dict[str, Any] = {"case": plan.flow_key, "class": cls, "faults": [], "policy": {}}
        if ctx.incident is not None:
            case["faults"] = [repaircase.fault_entry(ctx.incident.model_dump(mode="json"), 0.0)]
    else:
        case = found[1]
    name = (case.get("handoff") or {}).get("name") if case.get("stage") == repaircase.HANDED_OFF else None
    name = name or repaircase.handoff_name(plan.node, case)
    reason = _why(case)
    request = repairrequest.body(plan.node, name, case, reason, ctx.worker)
    created = await repairrequest.create(ctx.kube, request)
    details: dict[str, Any] = {"repair_request": name, "created": created, "reason": reason}
    url = (case.get("policy") or {}).get("webhookUrl")
    via = "resource"
    if url:
        details["webhook_status"] = await repairrequest.post(
            url, repairrequest.cloudevent(request, CloudEventsSettings().source))
        via = "resource+webhook"
    event = effects.object_name(plan.node[:200], plan.node, name, "handoff")
    message = f"handed to the repair system as RepairRequest {name}: {reason}"
    details["event"] = event
    await effects.create_node_event(ctx.kube, ctx.view, event, "HardwareInspection", message)

    def record(ledger: Any, now: float) -> None:
        repaircase.record_handoff(ledger, plan.flow_key, name, via, now)

    return StepResult(Outcome.APPLIED if created else Outcome.ALREADY_APPLIED, f"RepairRequest {name} ({via})",
                      details, ledger_update=record)


ACTION = ActionDef(
    name="hardwareInspection",
    kind=Kind.INSTANT,
    owns="nothing on the node; the RepairRequest object is the external repair system's to answer",
    run=run,
)
