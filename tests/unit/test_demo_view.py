"""The demo's screen reads like kubectl at any width, piped: one line per node, whole names, short words."""

from __future__ import annotations

import io
import re
from datetime import UTC, datetime

import orjson
import pytest
from rich.console import Console

from pipeline.actuator.ownership import LAST_ACTION_ANNOTATION, LEDGER_ANNOTATION, REBOOT_REQUEST_ANNOTATION
from pipeline.demo import view
from pipeline.demo.fleet import STANDBY_LABEL
from pipeline.demo.runner import Verdict
from pipeline.demo.scenario import STEPS
from schemas.records import Outcome, RemediationRecord

NOW = 1_800_000_000.0
RUN = "83b56b"
NODES = [f"gpu-{RUN}-{i:02d}" for i in range(1, 9)]
STANDBY = f"gpu-{RUN}-standby-1"
TAINT = "nvidia.com/gpu-fault"
FLOW = "9f0e0c1d2a3b4c5d6e7f8091a2b3c4d5"  # incident ids are 32 hex characters


def node(name: str, *, fault: tuple[str, str] | None = None, standby: bool = False, cordoned: bool = False,
         reboot: bool = False, flow: str = FLOW, since: float = 75.0) -> dict:
    """A Node object in the API's JSON form, as the demo's fleet and xidflow leave it."""
    labels = {"nvidia.com/gpu.present": "true"} | ({STANDBY_LABEL: "true"} if standby else {})
    annotations: dict[str, str] = {}
    conditions = [{"type": "Ready", "status": "True"}]
    spec: dict = {"unschedulable": True} if cordoned else {}
    if fault:
        ctype, message = fault
        ledger = {"v": 1, "owned": {"cordon": [flow], f"taint:{TAINT}:NoSchedule": [flow],
                                    f"condition:{ctype}": [flow]},
                  "flows": {flow: {"at": NOW - since, "done": {"cordon": NOW}, "claims": {}}}, "attempts": []}
        annotations = {LEDGER_ANNOTATION: orjson.dumps(ledger).decode(),
                       LAST_ACTION_ANNOTATION: f"cordon+taint+condition {flow} by vm-23806-actuator-2 at "
                                               f"{datetime.fromtimestamp(NOW - 12, UTC).isoformat()}"}
        conditions.append({"type": ctype, "status": "True", "reason": "XidError", "message": message})
        spec = {"unschedulable": True, "taints": [{"key": TAINT, "value": "xid", "effect": "NoSchedule"}]}
    if reboot:
        annotations[REBOOT_REQUEST_ANNOTATION] = "requested"
    return {"metadata": {"name": name, "labels": labels, "annotations": annotations, "resourceVersion": "7"},
            "spec": spec,
            "status": {"conditions": conditions, "nodeInfo": {"bootID": "1c9e4f7a-0b3d-4e2a-9f61-2d8c5b7e0a13"}}}


def fleet() -> list[dict]:
    """The fleet in the middle of the demo: every state word at once."""
    return [
        node(NODES[0]),
        node(NODES[1], fault=("GpuFellOffBus", "xid 79, PCI 0000:4e:00, count 2001, action RESTART_BM: NVRM: Xid"),
             reboot=True, since=200),
        node(NODES[2], fault=("GpuSXid", "sxid 24007, count 1, action RESTART_BM: nvidia-nvswitch3: SXid"),
             flow="1b2c3d4e5f60718293a4b5c6d7e8f901"),
        node(NODES[3], fault=("GpuFellOffBus", "gpu_fallen_off_bus 79, PCI 0000:3b:00.0, count 1, action "
                                               "RESTART_BM: NVRM: The NVIDIA GPU"), since=12),
        node(NODES[4]),
        node(NODES[5], fault=("GpuNvlink", "xid 74, PCI 0000:ca:00, count 1, action RESTART_BM: NVRM: Xid")),
        node(NODES[6]),
        node(NODES[7]),
        node(STANDBY, standby=True, cordoned=True),
    ]


STATES = {NODES[0]: "Ready", NODES[1]: "Rebooting", NODES[2]: "Quarantined", NODES[3]: "Quarantined",
          NODES[5]: "Quarantined", STANDBY: "Standby"}


def audit() -> list[RemediationRecord]:
    at = datetime.fromtimestamp(NOW - 3, UTC)
    return [RemediationRecord(record_id=str(i), node=NODES[2], incident_id="1b2c3d4e5f60718293a4b5c6d7e8f901",
                              action=action, outcome=Outcome.APPLIED, finished_at=at,
                              reason="rule sxid-standby of policy demo-nvswitch-standby: a fatal NVSwitch error "
                                     "quarantines the node and brings a warm standby into service")
            for i, action in enumerate(("cordon", "taint", "condition", "event", "enableWarmStandby"))]


def snapshot() -> view.Snapshot:
    via = {n: "Fluent Bit -> Kafka" for n in [*NODES, STANDBY]} | {NODES[2]: "Loki -> loki-tail -> Kafka"}
    return view.Snapshot(title=f"GPU fleet, demo {RUN}: {STEPS[2].title}", nodes=fleet(), standby_label=STANDBY_LABEL,
                         order=[*NODES, STANDBY], kernel_paths=via, audit=audit(), audit_count=57,
                         audit_topic=f"demo-{RUN}.gpu.remediation.audit", now=NOW)


def verdicts() -> list[Verdict]:
    out = []
    for step in STEPS:
        for idx, exp in step.expect.items():
            out.append(Verdict(step.title, NODES[idx - 1], exp, exp, True, step.why))
        if step.standby_in_service:
            out.append(Verdict(step.title, STANDBY, "standby in service", "in service", True,
                               "the warm-standby policy brings a matching standby node into service"))
    out.append(Verdict("Reboot and recovery", NODES[1], "recovered", "still quarantined", False,
                       "drained, reboot requested through the annotation hook, new boot id with passing checks, "
                       "then xidflow removed only what it applied"))
    return out


def printed(renderable: object, width: int, **kw: object) -> str:
    out = io.StringIO()
    Console(width=width, file=out, force_terminal=False).print(renderable, **kw)
    return out.getvalue()


def line_of(text: str, name: str) -> list[str]:
    """The lines on which ``name`` stands as a whole word."""
    return [line for line in text.splitlines() if re.search(rf"(^|\s){re.escape(name)}(\s|$)", line)]


@pytest.mark.parametrize("width", [80, 200])
def test_live_view_has_one_whole_line_per_node_with_its_state_and_taint(width: int) -> None:
    text = printed(view.live_view(snapshot()), width)
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines)
    header = next(line for line in lines if line.startswith("NODE "))
    assert header.split() == ["NODE", "STATE", "FAULT", "AGE", "TAINTS"]  # every column fits 80
    for name in [*NODES, STANDBY]:
        fleet_rows = [line for line in line_of(text, name) if line.startswith(name + " ")]
        assert len(fleet_rows) == 1, (name, text)
        row = fleet_rows[0].split()
        assert row[1] == STATES.get(name, "Ready")
        if name in (NODES[1], NODES[2], NODES[3], NODES[5]):
            assert row[-1] == TAINT
    # The fault, the age, short ids; nothing of the old screen's cut-off ids or timestamps.
    assert line_of(text, NODES[1])[0].split()[2:5] == ["xid", "79", "3m20s"]
    assert line_of(text, NODES[2])[0].split()[2:5] == ["sxid", "24007", "75s"]
    assert line_of(text, NODES[3])[0].split()[2:5] == ["xid", "79", "12s"]  # the three-line fallen-off-bus form
    assert re.search(r"\b1b2c3d4e$", text, re.M) and "1b2c3d4e5" not in text
    assert not re.search(r"[0-9a-f]{9,}", text) and " at 20" not in text


@pytest.mark.parametrize("width", [80, 200])
def test_live_view_audit_trail_is_one_line_per_record(width: int) -> None:
    text = printed(view.live_view(snapshot()), width)
    heading = f"audit trail: 57 records on demo-{RUN}.gpu.remediation.audit"
    assert heading in text
    audit_lines = text.split(heading, 1)[1].strip().splitlines()
    assert audit_lines[0].split() == ["AGE", "NODE", "ACTION", "OUTCOME", "INCIDENT"]
    assert [line.split() for line in audit_lines[1:]] == [
        ["3s", NODES[2], action, "applied", "1b2c3d4e"]
        for action in ("cordon", "taint", "condition", "event", "enableWarmStandby")]


def test_a_narrow_console_loses_columns_never_a_name() -> None:
    text = printed(view.live_view(snapshot()), 50)
    header = next(line for line in text.splitlines() if line.startswith("NODE "))
    assert header.split() == ["NODE", "STATE", "FAULT"]
    for name in [*NODES, STANDBY]:
        assert any(line.startswith(name + " ") and line.split()[1] == STATES.get(name, "Ready")
                   for line in text.splitlines())
    assert all(len(line) <= 50 for line in text.splitlines())


@pytest.mark.parametrize("width", [80, 200])
def test_report_is_one_line_per_expectation_and_reasons_are_whole_words(width: int) -> None:
    vs = verdicts()
    text = printed(view.report(vs), width)
    lines = text.splitlines()
    lines = lines[1:]  # a blank line sets the report off from the live view
    assert lines[0] == view.REPORT_TITLE and lines[1].split() == ["STEP", "NODE", "EXPECTED", "OBSERVED", "RESULT"]
    assert all(len(line) <= width for line in lines)
    table_rows = [line for line in lines[2:] if re.match(r"^\d+ ", line)]
    assert len(table_rows) == len(vs)
    numbers = {s.title: n for n, s in enumerate(STEPS, 1)} | {"Reboot and recovery": len(STEPS) + 1}
    for row, v in zip(table_rows, vs, strict=True):
        assert row.startswith(f"{numbers[v.step]} ")
        assert f" {v.node} " in row and f" {v.expected} " in row and f" {v.observed} " in row
        assert row.endswith(" ok" if v.ok else " WRONG")
    # Every reason is there once, after its step's title, its words whole (wrapped, never cut).
    prose = " ".join(" ".join(line.split()) for line in lines[2:] if line not in table_rows)
    for step in STEPS:
        assert f"{step.title}: {step.why}" in prose
        assert prose.count(step.why) == 1
    assert "the warm-standby policy brings a matching standby node into service" in prose


def test_reasons_stand_in_a_why_column_when_every_one_fits() -> None:
    vs = verdicts()
    text = printed(view.report(vs), 400)
    lines = text.splitlines()[1:]
    assert lines[1].split() == ["STEP", "NODE", "EXPECTED", "OBSERVED", "RESULT", "WHY"]
    assert len(lines) == 2 + len(vs)
    assert lines[2].endswith(f"{STEPS[0].title}: {STEPS[0].why}")
    assert lines[3].endswith(" -")  # the same reason as the line above


def test_details_are_every_column_whole_whatever_the_width() -> None:
    text = printed(view.details(snapshot()), 80, soft_wrap=True)
    assert text.startswith("\nGPU fleet")  # it follows the live view, whose last line may lack its newline
    header = next(line for line in text.splitlines() if line.startswith("NODE "))
    assert header.split() == ["NODE", "STATE", "FAULT", "AGE", "TAINTS", "EFFECTS", "WHY", "INCIDENTS", "BOOT",
                              "LINES-VIA", "LAST-ACTION"]
    row = line_of(text, NODES[2])[0].split("   ")
    assert [c.strip() for c in row if c.strip()] == [
        NODES[2], "Quarantined", "sxid 24007", "75s", TAINT, "condition/GpuSXid,cordon,taint/NoSchedule", "RESTART_BM",
        "1b2c3d4e", "1c9e4f7a", "Loki -> loki-tail -> Kafka", "cordon+taint+condition 1b2c3d4e 12s ago"]
    assert "quarantines the node and brings a warm standby into service" in text  # audit reasons, one line each


def test_result_line() -> None:
    text = printed(view.result_line(verdicts(), 57, "t"), 80)
    n = len(verdicts())
    assert text.strip() == f"demo failed: {n - 1}/{n} expectations met; 57 audit records on t"
