"""The catalog is current and the single source of an Xid's behaviour (issue 11, points 1, 8, 9, 10)."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest

from pipeline.actuator.plan import NodeView, expand_actions, plan_incident
from pipeline.actuator.policy import DEFAULT_RULE, PolicySet
from pipeline.actuator.problems import ProblemClass, classify_incident
from pipeline.actuator.settings import ActuatorSettings
from pipeline.aggregate.aggregator import Aggregator
from pipeline.detection.catalog import Catalog
from pipeline.detection.detector import Detector, classify_lines
from pipeline.detection.parse_core import health_event
from schemas.records import Action, FaultKind, HealthCheckResult, NodeIncident, Severity

REPO = Path(__file__).resolve().parents[2]
T = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)


def xid_line(code: int, text: str = "test", bus: str = "4e") -> str:
    return f"NVRM: Xid (PCI:0000:{bus}:00): {code}, pid=1, name=python3, {text}"


def events_for(lines: list[str], catalog: Catalog | None = None) -> list:
    return [event for _, event in classify_lines(lines, catalog=catalog)]


def run_aggregator(events: list, catalog: Catalog | None = None) -> list:
    agg = Aggregator(catalog=catalog)
    state = agg.new_state("local")
    out: list = []
    for i, event in enumerate(events):
        state, produced = agg.step(state, event, now=float(i))
        out += produced
    return out


# -- point 8: a current catalog ----------------------------------------------------------------------

def test_catalog_runs_to_172_with_nvidia_buckets(catalog: Catalog) -> None:
    assert set(range(151, 173)) <= set(catalog.xid_codes())
    buckets = {code: catalog.xid_entry(code)["bucket"] for code in range(151, 173)}
    assert {c for c, b in buckets.items() if b == "IGNORE"} == {152, 153, 157, 160, 161}
    assert {c for c, b in buckets.items() if b == "RESET_GPU"} == {155, 156, 158}
    assert buckets[151] == "RESTART_VM" and catalog.xid(151).action is Action.REBOOT_NODE
    assert {c for c, b in buckets.items() if b == "UNBUCKETED"} == set(range(162, 173))


def test_unbucketed_codes_alert_without_quarantine_by_default_and_are_configurable(catalog: Catalog) -> None:
    for code in [*range(162, 173), 4242]:
        cls = catalog.xid(code)
        assert cls.action is Action.ALERT and not cls.quarantine, code
    strict = Catalog.load(overrides={"defaults": {"unknown_xid": {"action": "CONTACT_SUPPORT", "severity": "error"}},
                                     "xid": {167: {"action": "REBOOT_NODE"}}})
    assert strict.xid(4242).action is Action.CONTACT_SUPPORT and strict.xid(167).action is Action.REBOOT_NODE


def test_xid154_recovery_actions_to_7(catalog: Catalog) -> None:
    expected = {0: Action.IGNORE, 1: Action.RESET_GPU, 2: Action.REBOOT_NODE, 3: Action.RESET_GPU,
                4: Action.RESET_GPU, 5: Action.CONTACT_SUPPORT, 6: Action.RESET_GPU, 7: Action.REBOOT_NODE}
    for number, action in expected.items():
        line = xid_line(154, f"GPU recovery action changed from 0x0 (None) to 0x{number} (Some text)")
        [event] = events_for([line])
        assert (event.subcode, event.action) == (number, action), number


def test_nvlink5_subcode_rows_win_over_the_printed_flag(catalog: Catalog) -> None:
    # intrInfo bits 20-25 = 4 (0x00400000): the decode table's NETIR link-down row resets the GPU
    # although the line says Nonfatal; another subcode follows the flag.
    down = xid_line(149, "NETIR_LINK_EVT Nonfatal XC0 i0 Link 3 (0x00400000 0x00000000 0x0 0x0 0x0 0x0)")
    other = xid_line(149, "NETIR_LINK_EVT Nonfatal XC0 i0 Link 3 (0x00100000 0x00000000 0x0 0x0 0x0 0x0)")
    first, second = events_for([down, other])
    assert (first.subcode, first.action) == (4, Action.RESET_GPU)
    assert (second.subcode, second.action) == (1, Action.IGNORE)
    row = {"action": "REBOOT_NODE", "severity": "critical"}
    rows = Catalog.load(overrides={"nvlink5": {"subcodes": {149: {1: row}}}})
    assert events_for([other], rows)[0].action is Action.REBOOT_NODE


# -- point 9: quiet for application faults -----------------------------------------------------------

def test_ignore_bucket_codes_and_a_lone_xid45_raise_nothing_on_the_node() -> None:
    lines = [xid_line(43, "Ch 00000010"), xid_line(63, "Row Remapper: New row marked for remapping"),
             xid_line(45, "Ch 00000010, errorString CTX SWITCH TIMEOUT"),
             xid_line(154, "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)")]
    assert run_aggregator(events_for(lines)) == []


def test_restart_app_raises_one_warning_event_only() -> None:
    [incident] = run_aggregator(events_for([xid_line(31, "Ch 0000000b, intr 10000000. MMU Fault")]))
    assert incident.action is Action.RESTART_APP and not incident.quarantine
    assert [s.name for s in expand_actions(DEFAULT_RULE, incident)] == ["event"]


def test_alert_raises_a_condition_and_an_event_without_quarantine() -> None:
    [incident] = run_aggregator(events_for([xid_line(168, "Errors found in WPR")]))
    assert incident.action is Action.ALERT and not incident.quarantine
    assert [s.name for s in expand_actions(DEFAULT_RULE, incident)] == ["condition", "event"]
    node = NodeView.from_object({"metadata": {"name": "gpu-1"}, "status": {"nodeInfo": {"bootID": "b"}}})
    plan = plan_incident(incident, PolicySet(), node, ActuatorSettings(), now=0.0)
    assert [s.name for s in plan.steps] == ["condition", "event"] and not plan.escalated


def test_an_ignore_incident_posts_nothing() -> None:
    incident = NodeIncident(incident_id="i", node="n", signature="xid:43:-", kind=FaultKind.XID, code=43, first_seen=T,
                            last_seen=T, severity=Severity.INFO, action=Action.IGNORE, quarantine=False)
    assert expand_actions(DEFAULT_RULE, incident) == []


# -- point 10: one source of truth -------------------------------------------------------------------

def test_sticky_repeats_follow_the_catalog() -> None:
    # 92 (high single-bit ECC rate) is IGNORE and not sticky: repeats raise nothing.
    repeats = [xid_line(92, "High single-bit ECC error rate")] * 2
    catalog = Catalog.load(overrides={"xid": {92: {"action": "RESTART_APP", "sticky": True}}})
    events = events_for(repeats, catalog)
    for i, event in enumerate(events):  # two bursts, an hour apart
        event.ts = T + timedelta(hours=i)
    out = run_aggregator(events, catalog)
    assert [(o.revision, o.action) for o in out] == [(0, Action.RESTART_APP), (1, Action.CONTACT_SUPPORT)]
    assert "sticky Xid 92" in (out[1].escalation_reason or "")


def test_workflows_come_from_the_catalog() -> None:
    # An operator who wants Xid 45 treated as a fault on its own removes its follower workflow.
    lone45 = [xid_line(45, "Ch 00000010")]
    assert run_aggregator(events_for(lone45)) == []
    catalog = Catalog.load(overrides={"xid": {45: {"workflow": "", "action": "RESET_GPU"}}})
    [incident] = run_aggregator(events_for(lone45, catalog), catalog)
    assert incident.action is Action.RESET_GPU


def test_problem_classes_come_from_the_catalog(catalog: Catalog) -> None:
    def incident(code: int, kind: FaultKind = FaultKind.XID) -> NodeIncident:
        return NodeIncident(incident_id="i", node="n", signature=f"{kind.value}:{code}:-", kind=kind, code=code,
                            first_seen=T, last_seen=T, severity=Severity.ERROR, action=Action.RESET_GPU,
                            quarantine=True)

    assert classify_incident(incident(48)).condition_type is ProblemClass.ECC
    assert classify_incident(incident(171)).condition_type is ProblemClass.ECC
    assert classify_incident(incident(149)).condition_type is ProblemClass.NVLINK
    assert classify_incident(incident(79)).condition_type is ProblemClass.FELL_OFF_BUS
    assert classify_incident(incident(79, FaultKind.GPU_FALLEN_OFF_BUS)).condition_type is ProblemClass.FELL_OFF_BUS
    assert classify_incident(incident(13)).condition_type is ProblemClass.XID
    overridden = Catalog.load(overrides={"xid": {13: {"problem": "ecc"}}})
    assert classify_incident(incident(13), overridden).condition_type is ProblemClass.ECC
    health = NodeIncident(incident_id="h", node="n", signature="health_check:nvlink:0000:4e:00.0",
                          kind=FaultKind.HEALTH_CHECK, first_seen=T, last_seen=T, severity=Severity.ERROR,
                          action=Action.RESET_GPU, quarantine=True)
    assert classify_incident(health).condition_type is ProblemClass.NVLINK


def test_parse_stage_health_events_use_the_catalog_table(catalog: Catalog) -> None:
    for check in ("gpu_count", "driver", "nvlink", "ecc", "remapped_rows", "something_new"):
        result = HealthCheckResult(node="n", check=check, passed=False)
        assert health_event(result).action is catalog.health_check(check).action, check
    failed_rows = HealthCheckResult(node="n", check="remapped_rows", passed=False, values={"failed": True})
    assert health_event(failed_rows).action is Action.CONTACT_SUPPORT


def test_detector_aggregator_and_problems_default_to_the_configured_catalog() -> None:
    configured = Catalog.configured()
    assert Detector().catalog is configured and Aggregator().catalog is configured


def test_configured_catalog_reads_the_overrides_from_the_environment(tmp_path: Path) -> None:
    overrides = tmp_path / "overrides.yaml"
    overrides.write_text("xid:\n  31: {action: REBOOT_NODE, severity: critical}\n", encoding="utf-8")
    line = "Nov 22 10:00:00 gpu-1 kernel: " + xid_line(31, "MMU Fault")
    env = {**os.environ, "XIDFLOW_CATALOG_OVERRIDES": str(overrides), "PYTHONPATH": str(REPO)}
    code = (
        "from pipeline.detection.catalog import Catalog; from pipeline.detection.detector import Detector; "
        "from pipeline.aggregate.aggregator import Aggregator; c = Catalog.configured(); "
        "print(c.xid(31).action.value, Detector().catalog is c, Aggregator().catalog is c)"
    )
    probe = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert probe.stdout.split() == ["REBOOT_NODE", "True", "True"], probe.stderr
    # `xidflow classify` without --catalog-overrides uses the same environment the worker does.
    cli = subprocess.run([sys.executable, "-m", "pipeline.cli", "classify", "--format", "json", "-"], input=line,
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    [row] = [orjson.loads(r) for r in cli.stdout.splitlines()]
    assert (row["code"], row["action"], row["quarantine"]) == (31, "REBOOT_NODE", True)


def test_a_bad_override_fails_loudly(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("xid:\n  31: {action: EXPLODE}\n", encoding="utf-8")
    env = {**os.environ, "XIDFLOW_CATALOG_OVERRIDES": str(bad), "PYTHONPATH": str(REPO)}
    cli = subprocess.run([sys.executable, "-m", "pipeline.cli", "classify", "-"], input="x\n", env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode != 0 and "xid 31" in (cli.stderr + cli.stdout)


@pytest.fixture
def catalog() -> Catalog:
    return Catalog.default()




@pytest.mark.parametrize("command", ["worker", "actuator"])
def test_worker_and_actuator_refuse_a_bad_override_before_connecting(tmp_path: Path, command: str) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("xid:\n  31: {action: EXPLODE}\n", encoding="utf-8")
    env = {**os.environ, "XIDFLOW_CATALOG_OVERRIDES": str(bad), "PYTHONPATH": str(REPO),
           "KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", command], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "invalid catalog override" in proc.stderr and "xid 31" in proc.stderr
