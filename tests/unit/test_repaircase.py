"""The repair case (pure): opening, joining, relapses, the diagnostics verdict and what follows, the hand-off and
its answer, the return; the plan an incident of a repair rule gets; the policy's repair options."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.actuator import repaircase
from pipeline.actuator.ownership import Ledger
from pipeline.actuator.plan import plan_incident, plan_request
from pipeline.actuator.policy import PolicyError, load_yaml_text
from pipeline.actuator.requests import RescueAction, RescueActionRequest
from tests.unit.test_actuator_plan import NOW, SETTINGS, incident, node

LOOP = load_yaml_text(
    "kind: RescuePolicy\nmetadata: {name: loop}\nspec:\n  rules:\n"
    "  - name: gpu-lost\n    priority: 10\n    codes: [79]\n"
    "    actions: [{name: quarantine}, {name: drain}, {name: reboot, hook: job}, {name: diagnose, timeout: 600}]\n"
    "    repair: {window: 3600, maxFailedRepairs: 2, handoff: {webhookUrl: 'http://repair.example/hook'}}\n"
)
CLS = "GpuFellOffBus"


def opened(iid: str = "inc-1") -> tuple[Ledger, Any]:
    """A ledger where the incident's flow started (its first write) and the case opened."""
    plan = plan_incident(incident(iid=iid), LOOP, node(), SETTINGS, NOW)
    ledger = Ledger()
    rec = incident(iid=iid).model_dump(mode="json")
    ledger.open_flow(iid, {"rec": rec, "rule": plan.rule, "esc": False, "steps": []}, NOW)
    assert plan.case is not None
    repaircase.apply_decision(ledger, plan.case, iid, rec, NOW, plan.rule, plan.case_policy, list(plan.case_again))
    return ledger, plan


def test_a_new_incident_of_a_repair_rule_opens_a_case_with_the_rule_and_the_steps_to_run_again() -> None:
    ledger, plan = opened()
    assert plan.case.kind == "new" and [s.name for s in plan.steps][-2:] == ["reboot", "diagnose"]
    case = ledger.repairs[CLS]
    assert case["stage"] == repaircase.REPAIRING and case["case"] == "inc-1" and case["flows"] == ["inc-1"]
    assert case["policy"] == {"window": 3600, "maxFailedRepairs": 2, "webhookUrl": "http://repair.example/hook"}
    assert [s["name"] for s in case["again"]] == ["reboot", "diagnose"]
    assert case["faults"][0]["incident"] == "inc-1" and case["faults"][0]["code"] == 79
    # recomputed (a 409) or replayed: nothing doubles
    before = ledger.to_annotation()
    repaircase.apply_decision(ledger, plan.case, "inc-1", incident().model_dump(mode="json"), NOW + 1,
                              plan.rule, plan.case_policy, list(plan.case_again))
    assert ledger.to_annotation() == before


def test_a_fault_while_the_case_is_under_repair_joins_it_and_starts_nothing() -> None:
    ledger, _ = opened()
    plan = plan_incident(incident(iid="inc-2"), LOOP, node(ledger=ledger, unschedulable=True), SETTINGS, NOW + 5)
    assert plan.skip_reason and "repair case inc-1 is repairing" in plan.skip_reason
    assert plan.case is not None and plan.case.kind == "join"
    repaircase.apply_decision(ledger, plan.case, None, incident(iid="inc-2").model_dump(mode="json"), NOW + 5)
    assert [f["incident"] for f in ledger.repairs[CLS]["faults"]] == ["inc-1", "inc-2"]
    assert ledger.repairs[CLS]["flows"] == ["inc-1"]


def test_a_failed_diagnostics_runs_the_repair_again_then_hands_off_at_the_limit() -> None:
    ledger, _ = opened()
    repaircase.record_diagnostics(ledger, "inc-1", "job-1", "fail", "dcgmi diag -r 2", {"result": "fail"}, NOW + 10)
    case = ledger.repairs[CLS]
    assert case["failed"] == 1 and case["stage"] == repaircase.REPAIRING
    assert case["flows"] == ["inc-1", "inc-1-1"] and ledger.is_open("inc-1-1")
    assert [s["name"] for s in ledger.stored_plan("inc-1-1")["steps"]] == ["reboot", "diagnose"]
    assert ledger.stored_plan("inc-1-1")["rec"]["incident_id"] == "inc-1"  # any replica drives it from the case
    # the same Job's verdict again (a recomputed write): nothing doubles
    repaircase.record_diagnostics(ledger, "inc-1", "job-1", "fail", "", {}, NOW + 11)
    assert case["failed"] == 1 and len(case["diagnostics"]) == 1
    repaircase.note_repair(ledger, "inc-1-1", "reboot", "applied", NOW + 20)
    repaircase.record_diagnostics(ledger, "inc-1-1", "job-2", "timeout", "deadline", {}, NOW + 30)
    assert case["failed"] == 2 and case["stage"] == repaircase.INSPECTION
    steps = ledger.stored_plan("inc-1-2")["steps"]
    assert steps == [{**repaircase.INSPECTION_STEPS[0], "reason": "RepairsDidNotHold"}, {"name": "hardwareInspection"}]
    assert [r["flow"] for r in case["repairs"]] == ["inc-1-1"]


def test_the_hand_off_the_answer_and_the_gate_after_it() -> None:
    ledger, _ = opened()
    repaircase.record_diagnostics(ledger, "inc-1", "job-1", "fail", "", {}, NOW + 1)
    repaircase.record_diagnostics(ledger, "inc-1-1", "job-2", "fail", "", {}, NOW + 2)
    name = repaircase.handoff_name("gpu-1", ledger.repairs[CLS])
    assert name == "gpu-1-inc-1-1"
    repaircase.record_handoff(ledger, "inc-1-2", name, "resource", NOW + 3)
    case = ledger.repairs[CLS]
    assert case["stage"] == repaircase.HANDED_OFF and case["handoffs"] == 1
    assert repaircase.untouched(ledger) and repaircase.needs_driving(ledger)
    assert repaircase.record_answer(ledger, CLS, "InProgress", "rma", NOW + 4) is None
    key = repaircase.record_answer(ledger, CLS, "Replaced", "rma", NOW + 5)
    assert key == "inc-1-3" and case["stage"] == repaircase.DIAGNOSING
    assert ledger.stored_plan(key)["steps"] == [{"name": "diagnose"}]
    assert repaircase.record_answer(ledger, CLS, "Replaced", "rma", NOW + 6) is None  # once per hand-off
    repaircase.record_diagnostics(ledger, key, "job-3", "pass", "", {"result": "pass"}, NOW + 7)
    assert case["stage"] == repaircase.RETURNING and case["failed"] == 0  # new hardware: its history starts over
    repaircase.record_returned(ledger, CLS, NOW + 8)
    assert case["stage"] == repaircase.RETURNED and case["returned"] == NOW + 8
    assert [h["stage"] for h in case["history"]] == [
        "repairing", "repairing", "hardware-inspection", "handed-off", "diagnosing", "returning", "returned"]


def test_a_failed_gate_after_the_answer_hands_the_node_off_again() -> None:
    ledger, _ = opened()
    repaircase.record_diagnostics(ledger, "inc-1", "j1", "fail", "", {}, NOW)
    repaircase.record_diagnostics(ledger, "inc-1-1", "j2", "fail", "", {}, NOW)
    repaircase.record_handoff(ledger, "inc-1-2", "gpu-1-inc-1-1", "resource", NOW)
    key = repaircase.record_answer(ledger, CLS, "Repaired", "ops", NOW)
    repaircase.record_diagnostics(ledger, key, "j3", "fail", "", {}, NOW)
    case = ledger.repairs[CLS]
    assert case["stage"] == repaircase.INSPECTION
    assert ledger.stored_plan("inc-1-4")["steps"][0]["reason"] == "DiagnosticsFailed"
    assert repaircase.handoff_name("gpu-1", case) == "gpu-1-inc-1-2"  # the next hand-off is a new request


def returned(ledger: Ledger, at: float) -> None:
    repaircase.record_diagnostics(ledger, "inc-1", "job-1", "pass", "", {}, at)
    repaircase.record_returned(ledger, CLS, at)


def test_a_fault_back_within_the_window_is_the_same_case_and_the_limit_hands_it_off() -> None:
    ledger, _ = opened()
    returned(ledger, NOW + 100)
    plan = plan_incident(incident(iid="inc-2"), LOOP, node(ledger=ledger), SETTINGS, NOW + 200)
    assert plan.case.kind == "relapse" and plan.case.case_id == "inc-1" and plan.case.failed == 1
    assert [s.name for s in plan.steps][-2:] == ["reboot", "diagnose"]
    rec = incident(iid="inc-2").model_dump(mode="json")
    repaircase.apply_decision(ledger, plan.case, "inc-2", rec, NOW + 200)
    case = ledger.repairs[CLS]
    assert case["case"] == "inc-1" and case["failed"] == 1 and case["flows"] == ["inc-1", "inc-2"]
    repaircase.record_diagnostics(ledger, "inc-2", "job-2", "pass", "", {}, NOW + 300)
    repaircase.record_returned(ledger, CLS, NOW + 300)
    plan = plan_incident(incident(iid="inc-3"), LOOP, node(ledger=ledger), SETTINGS, NOW + 400)
    assert plan.case.kind == "escalate" and plan.case.failed == 2
    names = [s.name for s in plan.steps]
    assert "reboot" not in names and "diagnose" not in names and names[-1] == "hardwareInspection"
    assert {"cordon", "taint", "drain"} <= set(names)
    assert "2 repairs did not hold (limit 2)" in plan.details["escalation"]


def test_a_fault_after_the_window_opens_a_new_case() -> None:
    ledger, _ = opened()
    returned(ledger, NOW)
    plan = plan_incident(incident(iid="inc-9"), LOOP, node(ledger=ledger), SETTINGS, NOW + 3601)
    assert plan.case.kind == "new" and plan.case.case_id == "inc-9"


def test_a_redelivered_incident_is_not_a_relapse() -> None:
    ledger, _ = opened()
    returned(ledger, NOW)
    plan = plan_incident(incident(iid="inc-1"), LOOP, node(ledger=ledger), SETTINGS, NOW + 5)
    assert plan.case is None and not plan.skip_reason


def test_a_handed_off_node_is_not_touched_by_incidents_or_requests() -> None:
    ledger, _ = opened()
    repaircase.record_diagnostics(ledger, "inc-1", "j1", "fail", "", {}, NOW)
    repaircase.record_diagnostics(ledger, "inc-1-1", "j2", "fail", "", {}, NOW)
    repaircase.record_handoff(ledger, "inc-1-2", "gpu-1-inc-1-1", "resource", NOW)
    view = node(ledger=ledger, unschedulable=True)
    plan = plan_incident(incident(iid="inc-5"), LOOP, view, SETTINGS, NOW)
    assert "handed-off as RepairRequest gpu-1-inc-1-1: xidflow does not touch the node" in plan.skip_reason
    assert plan.case.kind == "join" and not plan.steps
    other = plan_incident(incident(code=48, iid="inc-6"), LOOP, view, SETTINGS, NOW)
    assert other.skip_reason and other.case is None  # another class: not this case's evidence, still untouched
    request = RescueActionRequest(request_id="r1", node_name="gpu-1", xid=79, escalate_time=incident().first_seen,
                                  actions=[RescueAction(name="reboot")], received_at=incident().first_seen,
                                  requested_by="t")
    assert "does not touch the node" in (plan_request(request, view, SETTINGS).skip_reason or "")


def test_an_incident_recovery_does_not_return_a_node_the_gate_holds() -> None:
    ledger, _ = opened()
    assert "diagnostics gate returns the node" in (repaircase.holds(ledger, "inc-1") or "")
    returned(ledger, NOW)
    assert repaircase.holds(ledger, "inc-1") is None


def test_a_persons_uncordon_closes_the_case() -> None:
    ledger, _ = opened()
    ledger.own("cordon", "inc-1")
    assert ledger.reconcile_manual_uncordon(unschedulable=False, now=NOW) == ["inc-1"]
    assert ledger.repairs[CLS]["stage"] == repaircase.CLOSED


def test_lists_stay_capped_and_the_first_fault_is_kept() -> None:
    ledger, plan = opened()
    for i in range(30):
        repaircase.apply_decision(ledger, repaircase.Decision("join", CLS, "inc-1"), None,
                                  incident(iid=f"x{i}").model_dump(mode="json"), NOW + i)
    faults = ledger.repairs[CLS]["faults"]
    assert len(faults) == repaircase.MAX_FAULTS and faults[0]["incident"] == "inc-1" and faults[-1]["incident"] == "x29"


def test_summary_and_position_say_where_the_node_is() -> None:
    ledger, _ = opened()
    repaircase.record_diagnostics(ledger, "inc-1", "j1", "fail", "dcgm", {}, NOW + 1)
    assert repaircase.loop_position(ledger) == "repairing (GpuFellOffBus, 1/2 failed)"
    (case,) = repaircase.summary(ledger, NOW + 2)
    assert case["diagnostics"][0]["verdict"] == "fail" and case["failed_repairs"] == 1
    assert repaircase.loop_position(Ledger()) is None
    described = repaircase.describe({"metadata": {"name": "gpu-1", "annotations": {
        "xidflow.dev/ledger": ledger.to_annotation()}}}, NOW)
    assert described["position"].startswith("repairing") and described["cases"][0]["case"] == "inc-1"


@pytest.mark.parametrize(("rule", "error"), [
    ("actions: [{name: cordon}]\n    repair: {window: 10}", "repair: needs a diagnose action"),
    ("actions: [{name: cordon}, {name: diagnose}, {name: unCordon}]", "unCordon is not allowed with diagnose"),
    ("actions: [{name: reboot, uncordonAfter: true}, {name: diagnose}]", "uncordonAfter is not allowed"),
    ("actions: [{name: cordon}, {name: diagnose, hook: job}]", "hook: not valid for action 'diagnose'"),
])
def test_the_policy_refuses_a_repair_loop_that_cannot_hold(rule: str, error: str) -> None:
    with pytest.raises(PolicyError, match=error):
        load_yaml_text(f"kind: RescuePolicy\nmetadata: {{name: p}}\nspec:\n  rules:\n  - {rule}\n")


def test_repair_budgets_take_one_bound_and_one_label_each() -> None:
    base = "kind: RescuePolicy\nmetadata: {name: p}\nspec:\n  rules: [{actions: [{name: cordon}]}]\n"
    ok = load_yaml_text(base + "  repairBudgets: [{label: rack, maxNodes: 2}, {label: pool, maxShare: 0.2}]\n")
    caps = {b.label: (b.cap(10), b.cap(3)) for b in ok.repair_budgets}
    assert caps == {"rack": (2, 2), "pool": (2, 1)}  # 20% of 3 rounds down to 0: at least one
    with pytest.raises(PolicyError, match="exactly one of maxNodes and maxShare"):
        load_yaml_text(base + "  repairBudgets: [{label: rack, maxNodes: 2, maxShare: 0.5}]\n")
    with pytest.raises(PolicyError, match="named twice"):
        load_yaml_text(base + "  repairBudgets: [{label: rack, maxNodes: 2}]\n---\n"
                       + base.replace("name: p", "name: q") + "  repairBudgets: [{label: rack, maxNodes: 1}]\n")
    implied = load_yaml_text("kind: RescuePolicy\nmetadata: {name: p}\nspec:\n  rules:\n"
                             "  - {codes: [79], actions: [{name: cordon}, {name: diagnose}]}\n")
    assert implied.rules[0].repair_loop is not None and implied.rules[0].repair_loop.max_failed_repairs == 2


def test_a_revision_of_a_returned_incident_is_a_relapse_with_a_flow_of_its_own() -> None:
    ledger, _ = opened()
    returned(ledger, NOW)
    again = incident().model_copy(update={"revision": 1})  # the aggregation re-emits its open incident
    plan = plan_incident(again, LOOP, node(ledger=ledger), SETTINGS, NOW + 60)
    assert plan.case.kind == "relapse" and plan.flow_key == "inc-1-rev1"
    assert [s.name for s in plan.steps][-2:] == ["reboot", "diagnose"]
    repaircase.apply_decision(ledger, plan.case, plan.flow_key, again.model_dump(mode="json"), NOW + 60)
    ledger.open_flow(plan.flow_key, {"rec": again.model_dump(mode="json"), "steps": []}, NOW + 60, rev=1)
    assert ledger.repairs[CLS]["flows"] == ["inc-1", "inc-1-rev1"] and ledger.repairs[CLS]["failed"] == 1
    assert repaircase.flow_of(ledger, "inc-1", 1) == "inc-1-rev1" and repaircase.flow_of(ledger, "inc-1", 0) == "inc-1"
    # its redelivery plans that flow again, not a second relapse
    redelivered = plan_incident(again, LOOP, node(ledger=ledger), SETTINGS, NOW + 61)
    assert redelivered.flow_key == "inc-1-rev1" and redelivered.case is None


def test_a_redelivered_fault_that_joined_a_case_starts_nothing_after_the_return() -> None:
    ledger, _ = opened()
    late = incident(iid="inc-late")
    repaircase.apply_decision(ledger, repaircase.Decision("join", CLS, "inc-1"), None, late.model_dump(mode="json"),
                              NOW + 1)
    returned(ledger, NOW + 2)
    plan = plan_incident(late, LOOP, node(ledger=ledger), SETTINGS, NOW + 3)
    assert plan.skip_reason == "recorded in repair case inc-1 already" and not plan.steps
