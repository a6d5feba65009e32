"""Node conditions (pure): policy attributes of the condition action, transitions, ownership, baseline."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.actuator import conditions
from pipeline.actuator.actions.condition import restorations, target
from pipeline.actuator.baseline_conditions import lacks, missing
from pipeline.actuator.ownership import LEDGER_ANNOTATION, Ledger
from pipeline.actuator.plan import NodeView, plan_incident, plan_recovery
from pipeline.actuator.policy import ActionSpec, PolicyError, load_yaml_text
from pipeline.actuator.problems import HEALTHY, OWN_CONDITION_TYPES, ProblemClass
from pipeline.actuator.settings import ActuatorSettings
from schemas.records import Action, FaultKind, NodeIncident, NodeRecovered, Severity

SETTINGS = ActuatorSettings()
AHR = "AcceleratedHardwareReady"
T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def policy(action: str) -> str:
    return f"kind: RescuePolicy\nmetadata: {{name: p}}\nspec:\n  rules:\n  - {{codes: [79], actions: [{action}]}}\n"


def view(conds: list[dict[str, Any]] | None = None, ledger: Ledger | None = None) -> NodeView:
    return NodeView.from_object(
        {
            "metadata": {
                "name": "gpu-1",
                "resourceVersion": "7",
                "annotations": {LEDGER_ANNOTATION: ledger.to_annotation()} if ledger else {},
            },
            "status": {"conditions": conds or [{"type": "Ready", "status": "True"}]},
        }
    )


def incident(code: int = 79, kind: FaultKind = FaultKind.XID) -> NodeIncident:
    ts = datetime(2026, 1, 1, tzinfo=UTC)
    return NodeIncident(
        incident_id="inc-1", node="gpu-1", signature=f"{kind.value}:{code}", kind=kind, code=code,
        first_seen=ts, last_seen=ts, severity=Severity.CRITICAL, action=Action.REBOOT_NODE, quarantine=True,
    )


# -- policy syntax -------------------------------------------------------------------------------------------
def test_policy_sets_a_well_known_condition() -> None:
    text = policy(f"{{name: quarantine}}, {{name: condition, type: {AHR}, status: 'False', reason: GpuLost}}")
    spec = load_yaml_text(text).rules[0].actions[1]
    assert (spec.condition_type, spec.status, spec.reason) == ("AcceleratedHardwareReady", "False", "GpuLost")


def test_unquoted_yaml_status_is_read_as_the_status_it_spells() -> None:
    spec = load_yaml_text(policy(f"{{name: condition, type: {AHR}, status: False}}")).rules[0].actions[0]
    assert spec.status == "False"


def test_prefixed_type_is_valid() -> None:
    spec = ActionSpec.model_validate({"name": "condition", "type": "example.com/GpuHealthy", "status": "Unknown"})
    assert spec.condition_type == "example.com/GpuHealthy"


@pytest.mark.parametrize(
    ("action", "field", "words"),
    [
        ("{name: condition, type: 'Accelerated Hardware', status: 'False'}", ".type:", "not a valid condition type"),
        ("{name: condition, type: -bad, status: 'False'}", ".type:", "not a valid condition type"),
        ("{name: condition, type: X, status: Broken}", ".status:", "'True', 'False' or 'Unknown'"),
        ("{name: condition, type: AcceleratedHardwareReady}", ".status:", "required with type"),
        ("{name: condition, status: 'False'}", ".type:", "required with status"),
        ("{name: condition, type: Ready, status: 'False'}", ".type:", "written by the kubelet"),
        ("{name: condition, type: GpuXid, status: 'False'}", ".status:", "own condition GpuXid"),
        ("{name: condition, reason: 'not camel case'}", ".reason:", "not a valid condition reason"),
        ("{name: cordon, type: AcceleratedHardwareReady, status: 'False'}", ".type:", "not valid for action 'cordon'"),
        ("{name: event, status: 'False'}", ".status:", "not valid for action 'event'"),
    ],
)
def test_invalid_condition_attributes_name_the_field(action: str, field: str, words: str) -> None:
    with pytest.raises(PolicyError) as err:
        load_yaml_text(policy(action))
    text = str(err.value)
    assert f"spec.rules[0].actions[0]{field}" in text and words in text, text


# -- transitions ---------------------------------------------------------------------------------------------
def test_transition_time_kept_when_the_status_stays() -> None:
    current = {"type": "GpuXid", "status": "True", "reason": "XidError", "lastTransitionTime": T0}
    written = conditions.next_condition(current, "GpuXid", True, "ContactSupport", "again", T1)
    assert written["lastTransitionTime"] == T0
    assert written["lastHeartbeatTime"] == T1 and written["reason"] == "ContactSupport"


def test_transition_time_moves_when_the_status_changes() -> None:
    current = {"type": "GpuXid", "status": "False", "reason": "NoGpuXid", "lastTransitionTime": T0}
    written = conditions.next_condition(current, "GpuXid", True, "XidError", "xid 79", T1)
    assert written["status"] == "True" and written["lastTransitionTime"] == T1


def test_new_condition_gets_both_times() -> None:
    written = conditions.next_condition(None, "AcceleratedHardwareReady", "False", "XidError", "m" * 2000, T1)
    assert written["lastTransitionTime"] == written["lastHeartbeatTime"] == T1
    assert len(written["message"]) == conditions.MESSAGE_MAX


def test_status_text() -> None:
    assert [conditions.status_text(s) for s in (True, False, "Unknown")] == ["True", "False", "Unknown"]
    with pytest.raises(ValueError, match="one of True, False, Unknown"):
        conditions.status_text("maybe")


# -- ownership and undo --------------------------------------------------------------------------------------
def test_effect_keys_record_what_was_set() -> None:
    assert conditions.effect_key("GpuXid") == "condition:GpuXid"  # the form older ledgers hold
    assert conditions.effect_key("AcceleratedHardwareReady", "False") == "condition:AcceleratedHardwareReady=False"
    assert conditions.parse_owned("GpuXid") == ("GpuXid", "True")
    assert conditions.parse_owned("AcceleratedHardwareReady=False") == ("AcceleratedHardwareReady", "False")
    assert conditions.recovered_status("True") == "False"
    assert conditions.recovered_status("False") == conditions.recovered_status("Unknown") == "True"


def test_plan_owns_the_policy_condition_and_recovery_restores_it() -> None:
    policies = load_yaml_text(policy(f"{{name: condition}}, {{name: condition, type: {AHR}, status: 'False'}}"))
    plan = plan_incident(incident(), policies, view(), SETTINGS, 0.0)
    assert [s.effect for s in plan.steps] == ["condition:GpuFellOffBus", "condition:AcceleratedHardwareReady=False"]
    assert target(plan.steps[1].spec, plan.problem) == ("AcceleratedHardwareReady", "False")

    ledger = Ledger()
    for step in plan.steps:
        assert step.effect is not None
        ledger.own(step.effect, "inc-1")
    faulty = [
        {"type": "GpuFellOffBus", "status": "True", "lastTransitionTime": T0},
        {"type": "AcceleratedHardwareReady", "status": "False", "lastTransitionTime": T0},
    ]
    undo = plan_recovery(NodeRecovered(incident_id="inc-1", node="gpu-1", reason="quiet"), view(faulty, ledger))
    assert set(undo.clear_conditions) == {"GpuFellOffBus", "AcceleratedHardwareReady=False"}
    back = {c["type"]: c for c in restorations(view(faulty, ledger), undo.clear_conditions, "recovered")}
    assert back["GpuFellOffBus"]["status"] == "False" and back["AcceleratedHardwareReady"]["status"] == "True"
    assert all(c["reason"] == "XidflowRecovered" and c["lastTransitionTime"] != T0 for c in back.values())


def test_undo_leaves_a_condition_someone_else_changed_since() -> None:
    # AcceleratedHardwareReady is True again (another tool's word): xidflow's False is no longer there to undo.
    now = [{"type": "AcceleratedHardwareReady", "status": "True"}, {"type": "GpuXid", "status": "False"}]
    assert restorations(view(now), ["AcceleratedHardwareReady=False", "GpuXid"], "recovered") == []


# -- baseline and the fallen-off-bus condition ---------------------------------------------------------------
def test_baseline_adds_only_the_missing_own_conditions_as_false() -> None:
    have = [{"type": "Ready", "status": "True"}, {"type": "GpuXid", "status": "True", "reason": "XidError"}]
    added = missing(view(have), T1)
    assert {c["type"] for c in added} == OWN_CONDITION_TYPES - {"GpuXid"}
    assert all(c["status"] == "False" and c["lastTransitionTime"] == T1 for c in added)
    ecc = next(c for c in added if c["type"] == "GpuEcc")
    assert ecc["reason"] == HEALTHY[ProblemClass.ECC][0]
    complete = have + added
    assert missing(view(complete), T1) == []
    assert lacks(view(have)) and not lacks(view(complete))  # the cheap question agrees with the full one
    assert not lacks(view([{"type": "Ready", "status": "True"}, *({"type": t} for t in OWN_CONDITION_TYPES)]))


def test_fallen_off_bus_has_a_condition_named_for_it() -> None:
    assert "GpuFellOffBus" in OWN_CONDITION_TYPES and HEALTHY[ProblemClass.FELL_OFF_BUS][0] == "NoGpuFellOffBus"
    for kind in (FaultKind.XID, FaultKind.GPU_FALLEN_OFF_BUS):
        plan = plan_incident(incident(79, kind), load_yaml_text(policy("{name: condition}")), view(), SETTINGS, 0.0)
        assert plan.problem is not None and plan.problem.condition_type == ProblemClass.FELL_OFF_BUS


# -- the CRD schema and admission policy say the same as the code ----------------------------------------------
ROOT = Path(__file__).resolve().parents[2]


def _action_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "deploy" / "crds" / "rescuepolicies.xidflow.dev.yaml").read_text())
    rules = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["rules"]
    return rules["items"]["properties"]["actions"]["items"]["properties"]


def test_crd_schema_matches_the_condition_checks() -> None:
    props = _action_schema()
    assert props["status"]["enum"] == list(conditions.STATUSES)
    assert props["type"]["pattern"] == conditions._TYPE.pattern and props["type"]["maxLength"] == conditions.TYPE_MAX
    assert props["reason"]["pattern"] == conditions._REASON.pattern
    for good in ("AcceleratedHardwareReady", "example.com/Gpu.ok"):
        assert re.match(props["type"]["pattern"], good) and conditions.type_error(good) is None


def test_admission_policy_lists_the_same_kubelet_and_own_types() -> None:
    text = (ROOT / "deploy" / "crds" / "admission" / "rescuepolicy-validation.yaml").read_text()
    policy = next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "ValidatingAdmissionPolicy")
    lists = [set(re.findall(r"'(\w+)'", m)) for v in policy["spec"]["validations"]
             for m in re.findall(r"a\.type in \[([^\]]*)\]", v["expression"])]
    assert conditions.KUBELET_TYPES in lists and OWN_CONDITION_TYPES in lists


def test_example_replace_policy_sets_accelerated_hardware_ready_false() -> None:
    examples = load_yaml_text((ROOT / "deploy" / "examples" / "policies.yaml").read_text())
    labelled = NodeView.from_object({"metadata": {"name": "gpu-1", "labels": {"xidflow.dev/repair": "replace"}}})
    plan = plan_incident(incident(79), examples, labelled, SETTINGS, 0.0)
    assert plan.rule == "replace-on-hardware-fault"
    assert [s.effect for s in plan.steps if s.name == "condition"] == [
        "condition:GpuFellOffBus", "condition:AcceleratedHardwareReady=False"
    ]
    assert examples.select(FaultKind.XID, 79, {}).name != "replace-on-hardware-fault"  # only where labelled


def test_status_lists_a_policy_condition_xidflow_owns() -> None:
    from pipeline.commands.status import node_rows

    ledger = Ledger()
    ledger.own(conditions.effect_key(AHR, "False"), "inc-1")
    obj = {
        "metadata": {"name": "gpu-1", "annotations": {LEDGER_ANNOTATION: ledger.to_annotation()}},
        "status": {"conditions": [{"type": AHR, "status": "False", "reason": "GpuHardwareFault", "message": "xid 79"}]},
    }
    [row] = node_rows([obj], now=0.0)
    assert [(f["condition"], f["status"]) for f in row["faults"]] == [(AHR, "False")]
