"""Planning (pure): quarantine expansion, opt-out, cancellation, attempt cap, requests, recovery."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pipeline.actuator.engine import group_steps
from pipeline.actuator.ownership import LEDGER_ANNOTATION, Ledger
from pipeline.actuator.plan import NodeView, plan_incident, plan_recovery, plan_request
from pipeline.actuator.policy import PolicySet, load_yaml_text
from pipeline.actuator.problems import ProblemClass, classify_incident, event_message
from pipeline.actuator.requests import RescueAction, RescueActionRequest
from pipeline.actuator.settings import ActuatorSettings
from schemas.records import Action, FaultKind, NodeIncident, NodeRecovered, Severity

NOW = 1_700_000_000.0
SETTINGS = ActuatorSettings()


def incident(
    code: int = 79, action: Action = Action.REBOOT_NODE, kind: FaultKind = FaultKind.XID, iid: str = "inc-1"
) -> NodeIncident:
    ts = datetime(2024, 7, 4, tzinfo=UTC)
    return NodeIncident(
        incident_id=iid,
        node="gpu-1",
        signature=f"{kind.value}:{code}",
        kind=kind,
        code=code,
        pci="0000:4e:00.0",
        first_seen=ts,
        last_seen=ts,
        severity=Severity.CRITICAL,
        action=action,
        quarantine=action.quarantines,
        line="NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    )


def node(labels: dict[str, str] | None = None, ledger: Ledger | None = None, unschedulable: bool = False) -> NodeView:
    obj: dict[str, Any] = {
        "metadata": {
            "name": "gpu-1",
            "labels": labels or {},
            "annotations": {LEDGER_ANNOTATION: ledger.to_annotation()} if ledger else {},
            "resourceVersion": "7",
        },
        "spec": {"unschedulable": unschedulable},
        "status": {"nodeInfo": {"bootID": "boot-a"}, "conditions": [{"type": "Ready", "status": "True"}]},
    }
    return NodeView.from_object(obj)


REBOOT_POLICY = load_yaml_text(
    "kind: RescuePolicy\nmetadata: {name: r}\nspec:\n  rules:\n"
    "  - {name: reboot79, priority: 10, codes: [79], actions: [{name: quarantine}, {name: drain},"
    " {name: reboot, uncordonAfter: true}]}\n"
)


def test_default_quarantine_expands_for_quarantining_actions() -> None:
    plan = plan_incident(incident(), PolicySet(), node(), SETTINGS, NOW)
    assert [s.key for s in plan.steps] == ["cordon", "taint", "condition", "event", "notifyWorkload"]
    assert plan.rule == "global-default" and plan.skip_reason is None
    assert plan.steps[1].effect == "taint:nvidia.com/gpu-fault:NoSchedule"
    assert plan.steps[2].effect == "condition:GpuFellOffBus"


def test_default_policy_only_reports_application_errors() -> None:
    plan = plan_incident(incident(code=13, action=Action.RESTART_APP), PolicySet(), node(), SETTINGS, NOW)
    assert [s.key for s in plan.steps] == ["event"]


def test_opt_out_label_skips_everything() -> None:
    view = node(labels={SETTINGS.opt_out_label: "true"})
    plan = plan_incident(incident(), PolicySet(), view, SETTINGS, NOW)
    assert plan.steps == () and "opt-out" in (plan.skip_reason or "")


def test_manual_only_turns_policies_off() -> None:
    settings = ActuatorSettings(manual_only=True)
    plan = plan_incident(incident(), PolicySet(), node(), settings, NOW)
    assert plan.steps == () and "manual-only" in (plan.skip_reason or "")


def test_cancelled_flow_is_not_replanned() -> None:
    ledger = Ledger()
    ledger.cancel("inc-1", "manual-uncordon", NOW)
    plan = plan_incident(incident(), PolicySet(), node(ledger=ledger), SETTINGS, NOW)
    assert plan.skip_reason == "cancelled: manual-uncordon"


def test_schedulable_node_whose_cordon_we_owned_counts_as_manual_uncordon() -> None:
    ledger = Ledger()
    ledger.own("cordon", "inc-1")
    plan = plan_incident(incident(), PolicySet(), node(ledger=ledger, unschedulable=False), SETTINGS, NOW)
    assert plan.skip_reason == "cancelled: manual-uncordon"


def test_disruptive_flow_counts_an_attempt_and_cap_escalates_to_contact_support() -> None:
    plan = plan_incident(incident(), REBOOT_POLICY, node(), SETTINGS, NOW)
    assert [s.key for s in plan.steps] == ["cordon", "taint", "condition", "event", "notifyWorkload", "drain", "reboot"]
    assert plan.new_attempt and not plan.escalated

    ledger = Ledger(attempts=[NOW - 10, NOW - 20, NOW - 30])
    capped = plan_incident(incident(iid="inc-2"), REBOOT_POLICY, node(ledger=ledger), SETTINGS, NOW)
    assert capped.escalated and not capped.new_attempt
    assert "reboot" not in [s.key for s in capped.steps]
    assert "attempt cap" in capped.details["escalation"]

    old = Ledger(attempts=[NOW - 90_000] * 3)  # outside the 24 h window
    assert not plan_incident(incident(iid="inc-3"), REBOOT_POLICY, node(ledger=old), SETTINGS, NOW).escalated


def test_redelivered_flow_is_not_capped_by_its_own_attempt() -> None:
    ledger = Ledger(attempts=[NOW - 10, NOW - 20, NOW - 30])
    ledger.flow("inc-1", NOW)
    plan = plan_incident(incident(), REBOOT_POLICY, node(ledger=ledger), SETTINGS, NOW)
    assert not plan.escalated and not plan.new_attempt


def test_contact_support_incident_never_reboots() -> None:
    plan = plan_incident(incident(action=Action.CONTACT_SUPPORT), REBOOT_POLICY, node(), SETTINGS, NOW)
    assert plan.escalated and "reboot" not in [s.name for s in plan.steps]


def test_repeated_actions_get_distinct_step_keys() -> None:
    policies = load_yaml_text(
        "kind: RescuePolicy\nmetadata: {name: r}\nspec:\n  rules:\n"
        "  - {priority: 1, actions: [{name: cordon}, {name: unCordon}, {name: cordon}]}\n"
    )
    plan = plan_incident(incident(), policies, node(), SETTINGS, NOW)
    assert [s.key for s in plan.steps] == ["cordon", "unCordon", "cordon#2"]


def test_rescue_request_plan_keeps_order_and_is_keyed_by_request() -> None:
    ts = datetime(2024, 7, 4, tzinfo=UTC)
    request = RescueActionRequest(
        request_id="abc",
        node_name="gpu-1",
        xid=79,
        escalate_time=ts,
        received_at=ts,
        requested_by="ops",
        actions=[RescueAction(name="cordon"), RescueAction(name="drain", waittime=5), RescueAction(name="unCordon")],
    )
    plan = plan_request(request, node(), SETTINGS)
    assert plan.flow_key == "req:abc"
    assert [(s.key, s.spec.waittime) for s in plan.steps] == [("cordon", 0), ("drain", 5), ("unCordon", 0)]


def test_recovery_undoes_only_what_this_flow_alone_owns() -> None:
    ledger = Ledger()
    ledger.own("cordon", "inc-1")
    ledger.own("cordon", "inc-2")
    ledger.own("taint:nvidia.com/gpu-fault:NoSchedule", "inc-1")
    ledger.own("condition:GpuCount", "inc-1")
    view = node(ledger=ledger, unschedulable=True)
    undo = plan_recovery(NodeRecovered(incident_id="inc-1", node="gpu-1", reason="quiet"), view)
    assert undo.uncordon is False  # inc-2 still needs the cordon
    assert undo.remove_taints == (("nvidia.com/gpu-fault", "NoSchedule"),)
    assert undo.clear_conditions == ("GpuCount",)
    assert set(undo.disown) == {"cordon", "taint:nvidia.com/gpu-fault:NoSchedule", "condition:GpuCount"}


def test_recovery_never_uncordons_a_cordon_xidflow_did_not_make() -> None:
    undo = plan_recovery(NodeRecovered(incident_id="inc-1", node="gpu-1", reason="quiet"), node(unschedulable=True))
    assert undo.uncordon is False and undo.disown == ()


def test_problem_classes_and_event_text() -> None:
    assert classify_incident(incident(code=79)).condition_type == ProblemClass.FELL_OFF_BUS
    assert classify_incident(incident(code=48)).condition_type == ProblemClass.ECC
    assert classify_incident(incident(code=74)).condition_type == ProblemClass.NVLINK
    assert classify_incident(incident(code=12020, kind=FaultKind.SXID)).event_reason == "SXidError"
    assert classify_incident(incident(code=13)).condition_type == ProblemClass.XID
    msg = event_message(incident())
    assert "xid 79" in msg and "PCI 0000:4e:00.0" in msg and "fallen off the bus" in msg


def test_steps_group_into_one_node_write_and_one_instant_batch() -> None:
    plan = plan_incident(incident(), REBOOT_POLICY, node(), SETTINGS, NOW)
    assert [[s.key for s in g] for g in group_steps(plan.steps)] == [
        ["cordon", "taint"],
        ["condition", "event", "notifyWorkload"],
        ["drain"],
        ["reboot"],
    ]
