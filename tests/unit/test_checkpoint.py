"""Checkpoint-aware drain, the pure parts: the option's validation against the catalog, the run-time
lost-GPU fallback, and the wait's bookkeeping on pod conditions."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.actuator import checkpoint
from pipeline.actuator.checkpoint import DONE, REQUESTED, Wait
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import LEDGER_ANNOTATION, Ledger
from pipeline.actuator.plan import plan_from_ledger, plan_incident, stored
from pipeline.actuator.policy import PolicyError, load_yaml_text
from pipeline.actuator.settings import ActuatorSettings
from pipeline.actuator.testing import make_incident
from pipeline.detection.catalog import Catalog
from schemas.records import Action, FaultKind

CATALOG = Catalog.default()
T0 = 1_800_000_000.0


def policy(rule: str) -> str:
    return f"kind: RescuePolicy\nmetadata: {{name: t}}\nspec:\n  rules:\n  - {rule}\n"


# -- the option ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "seconds"), [(300, 300.0), ("300s", 300.0), ("5m", 300.0), ("1h", 3600.0),
                                               (" 90 ", 90.0), (2.5, 2.5)])
def test_grace_is_seconds_or_a_duration(text: Any, seconds: float) -> None:
    assert checkpoint.parse_grace(text) == seconds


@pytest.mark.parametrize("text", [0, -5, "soon", "5d", True, 86401])
def test_a_grace_that_is_not_a_sane_duration_is_refused(text: Any) -> None:
    with pytest.raises(ValueError):
        checkpoint.parse_grace(text)


def test_a_drain_rule_for_a_fault_where_the_gpu_runs_takes_the_option() -> None:
    text = policy("{codes: [48, 74, 154], actions: [{name: cordon}, {name: drain, checkpointGrace: 5m}]}")
    rules = load_yaml_text(text)
    assert rules.rules[0].actions[1].checkpoint_grace == 300.0


@pytest.mark.parametrize(
    ("rule", "why"),
    [
        ("{codes: [48, 79], actions: [{name: cordon}, {name: drain, checkpointGrace: 60}]}", "Xid 79"),
        ("{kinds: [gpu_fallen_off_bus], actions: [{name: drain, checkpointGrace: 60}]}", "gpu_fallen_off_bus"),
        ("{codes: [151], actions: [{name: drain, checkpointGrace: 60}]}", "Xid 151: the catalog's action"),
        ("{codes: [12020], kinds: [sxid], actions: [{name: drain, checkpointGrace: 60}]}", "SXid 12020"),
    ],
)
def test_the_option_is_refused_where_the_gpu_is_lost_naming_the_field_and_the_fault(rule: str, why: str) -> None:
    with pytest.raises(PolicyError) as err:
        load_yaml_text(policy(rule))
    index = 1 if "cordon" in rule else 0
    assert str(err.value).startswith(f"RescuePolicy/t spec.rules[0].actions[{index}].checkpointGrace: not allowed")
    assert why in str(err.value)


def test_the_option_belongs_to_drain_only() -> None:
    with pytest.raises(PolicyError, match=r"actions\[0\]\.checkpointGrace: not valid for action 'reboot'"):
        load_yaml_text(policy("{codes: [48], actions: [{name: reboot, checkpointGrace: 60}]}"))


def test_a_catalog_override_moves_the_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    overrides = tmp_path / "o.yaml"
    overrides.write_text("xid:\n  48: {action: REBOOT_NODE, severity: critical}\n")
    monkeypatch.setenv("XIDFLOW_CATALOG_OVERRIDES", str(overrides))
    with pytest.raises(PolicyError, match="Xid 48"):
        load_yaml_text(policy("{codes: [48], actions: [{name: drain, checkpointGrace: 60}]}"))


# -- the run-time fallback --------------------------------------------------------------------------------
def test_an_incident_that_left_a_running_gpu_may_wait() -> None:
    assert checkpoint.gpu_lost(make_incident("n", "i", code=48, action=Action.RESET_GPU), CATALOG) is None
    assert checkpoint.gpu_lost(make_incident("n", "i", code=74, action=Action.RESET_GPU), CATALOG) is None


def test_lost_gpu_incidents_drain_at_once() -> None:
    assert "lost" in checkpoint.gpu_lost(make_incident("n", "i", code=79), CATALOG)
    fell = make_incident("n", "i", code=79, kind=FaultKind.GPU_FALLEN_OFF_BUS)
    assert "fell off the bus" in checkpoint.gpu_lost(fell, CATALOG)
    # Xid 154's recovery action asked for a reboot: only the incident's action says so.
    assert "REBOOT_NODE" in checkpoint.gpu_lost(make_incident("n", "i", code=154, action=Action.REBOOT_NODE), CATALOG)
    # An ECC incident whose evidence holds an Xid 79 of the same node.
    ecc = make_incident("n", "i", code=48, action=Action.RESET_GPU)
    ecc = ecc.model_copy(update={"signatures": ["xid:48:0000:4e:00.0", "xid:79:0000:4e:00.0"]})
    assert "Xid 79" in checkpoint.gpu_lost(ecc, CATALOG)
    missing = make_incident("n", "i", code=None, kind=FaultKind.HEALTH_CHECK, action=Action.RESET_GPU)  # type: ignore[arg-type]
    missing = missing.model_copy(update={"signature": "health_check:gpu_count:node"})
    assert "missing" in checkpoint.gpu_lost(missing, CATALOG)


# -- the wait ------------------------------------------------------------------------------------------------
def pod(name: str, *conditions: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": name}, "status": {"conditions": list(conditions)}}


def cond(kind: str, status: str, at: float) -> dict[str, Any]:
    return {"type": kind, "status": status, "lastTransitionTime": checkpoint.rfc3339(at)}


def test_the_wait_lives_in_the_ledger_as_plain_values() -> None:
    wait = Wait.start(T0, 300)
    assert Wait.from_value(wait.value()) == wait and wait.remaining(T0 + 100) == 200
    assert Wait.from_value(None) is None and Wait.from_value({"at": 1}) is None
    assert wait.remaining(T0 + 400) == 0


def test_progress_asks_pending_and_answered() -> None:
    wait = Wait.start(T0 + 0.7, 60)  # a request written in the same second counts (whole seconds)
    pods = [
        pod("new"),
        pod("stale", cond(REQUESTED, "True", T0 - 3600), cond(DONE, "True", T0 - 3500)),  # an older request
        pod("asked", cond(REQUESTED, "True", T0)),
        pod("done", cond(REQUESTED, "True", T0 + 1), cond(DONE, "True", T0 + 5)),
        pod("refused"),
    ]
    prog = checkpoint.progress(pods, wait, frozenset({"ns/refused"}))
    assert prog.to_ask == ("ns/new", "ns/stale") and prog.pending == ("ns/asked",) and prog.answered == ("ns/done",)
    assert not prog.over
    assert checkpoint.progress([pods[3]], wait).over


def test_a_new_request_voids_an_old_answer_in_the_same_write() -> None:
    old = pod("p", cond(REQUESTED, "True", T0 - 3600), cond(DONE, "True", T0 - 3500))
    patch = checkpoint.request_patch(old, "msg", T0)
    types = {c["type"]: c for c in patch["status"]["conditions"]}
    assert types[REQUESTED]["status"] == "True" and types[REQUESTED]["lastTransitionTime"] == checkpoint.rfc3339(T0)
    assert types[DONE]["status"] == "False"
    assert [c["type"] for c in checkpoint.request_patch(pod("q"), "m", T0)["status"]["conditions"]] == [REQUESTED]


def test_the_request_message_names_the_fault_and_the_deadline() -> None:
    wait = Wait.start(T0, 300)
    text = checkpoint.request_message(make_incident("gpu-1", "i", code=48, action=Action.RESET_GPU), "gpu-1", wait)
    assert "xid 48" in text and "gpu-1" in text and checkpoint.rfc3339(T0 + 300) in text and DONE in text


def node(ledger: Ledger) -> NodeView:
    annotations = {LEDGER_ANNOTATION: ledger.to_annotation()}
    return NodeView.from_object({"metadata": {"name": "gpu-1", "resourceVersion": "7", "annotations": annotations}})


def test_a_resumed_flow_keeps_the_drain_option() -> None:
    rules = load_yaml_text(policy("{codes: [48], actions: [{name: cordon}, {name: drain, checkpointGrace: 5m}]}"))
    settings = ActuatorSettings()
    incident = make_incident("gpu-1", "inc", code=48, action=Action.RESET_GPU)
    plan = plan_incident(incident, rules, node(Ledger()), settings, T0)
    ledger = Ledger()
    ledger.open_flow("inc", stored(plan, incident), T0)
    kept = plan_from_ledger(node(ledger), "inc", settings)
    assert kept is not None and kept[0].steps[1].spec.checkpoint_grace == 300.0


def test_a_drain_waiting_for_checkpoints_is_not_reported_stuck_before_its_grace_and_timeout() -> None:
    from pipeline.actuator.fleetmetrics import step_timeout

    assert step_timeout({"name": "drain", "timeout": 300, "checkpointGrace": 600.0}) == 900
    assert step_timeout({"name": "drain", "timeout": 300}) == 300
