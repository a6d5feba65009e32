"""kubectl-style output: aligned columns that never truncate, at 80 columns and piped; -o wide|json|yaml."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.commands.output import Column, age, render_rows, render_table
from pipeline.commands.status import STATUS_COLUMNS, node_rows

PREFIX = "gpu-h100-sxm5-prod-us-east-1a-rack07-node-"
NOW = 1_800_000_000.0


def gpu_nodes() -> list[dict]:
    """Four nodes whose long names share a prefix; three carry what xidflow applied for a fault."""
    faults = {
        "0001": ("GpuCount", "xid 79, PCI 0000:3b:00.0, count 1, action RESTART_BM: NVRM: Xid 79, fallen off the bus"),
        "0002": ("GpuEcc", "xid 48, PCI 0000:5d:00.0, count 3, action RESET_GPU: NVRM: Xid 48, DBE"),
        "0004": ("GpuSXid", "sxid 12028, count 2, action RESTART_BM: nvidia-nvswitch2: SXid 12028"),
    }
    nodes = []
    for i, suffix in enumerate(("0001", "0002", "0003", "0004")):
        meta: dict = {"name": PREFIX + suffix, "annotations": {}, "resourceVersion": "1"}
        conditions = [{"type": "Ready", "status": "True"}]
        spec: dict = {}
        if suffix in faults:
            ctype, message = faults[suffix]
            flow = f"9f{i}e0c1d2a3b4c5d6e7f8{i}"
            ledger = {
                "v": 1,
                "owned": {
                    "cordon": [flow], "taint:nvidia.com/gpu-fault:NoSchedule": [flow], f"condition:{ctype}": [flow]
                },
                "flows": {flow: {"at": NOW - 600 * (i + 1), "done": {"cordon": NOW, "taint": NOW}, "claims": {}}},
                "attempts": [],
            }
            meta["annotations"] = {
                "xidflow.dev/ledger": orjson.dumps(ledger).decode(),
                "xidflow.dev/last-action": f"cordon+taint {flow} by actuator-0 at 2027-01-15T08:00:00Z",
            }
            conditions.append({"type": ctype, "status": "True", "reason": "XidError", "message": message,
                               "lastTransitionTime": "2027-01-15T08:00:00Z"})
            spec = {"unschedulable": True}
        nodes.append({"metadata": meta, "spec": spec, "status": {"conditions": conditions}})
    return nodes


def rows() -> list[dict]:
    return node_rows(gpu_nodes(), {"tripped": True, "admitted": {PREFIX + "0001": NOW - 5}, "window_seconds": 300},
                     now=NOW)


@pytest.mark.parametrize("output", ["table", "wide"])
def test_every_long_node_name_is_whole_and_on_its_own_line(output: str) -> None:
    text = render_rows(rows(), STATUS_COLUMNS, output)
    lines = text.splitlines()
    assert len(lines) == 5 and lines[0].startswith("NODE ")
    for suffix, line in zip(("0001", "0002", "0003", "0004"), lines[1:], strict=True):
        assert line.startswith(PREFIX + suffix + " ")
    # Aligned: every column starts at the same offset on every line.
    starts = [lines[0].index(h) for h in ("STATUS", "FAULT", "AGE", "APPLIED", "WHY", "BREAKER")]
    for line in lines[1:]:
        assert all(line[s - 1] == " " and line[s] != " " for s in starts)


def test_table_shows_fault_age_what_was_applied_why_and_the_breaker() -> None:
    line = render_rows(rows(), STATUS_COLUMNS, "table").splitlines()[1].split()
    assert line == [PREFIX + "0001", "Ready,SchedulingDisabled", "xid", "79", "10m", "condition,cordon,taint",
                    "RESTART_BM", "open,counted", "-"]  # no repair case: the rule has no repair loop
    healthy = render_rows(rows(), STATUS_COLUMNS, "table").splitlines()[3].split()
    assert healthy == [PREFIX + "0003", "Ready", "-", "-", "-", "-", "open", "-"]


def test_wide_adds_effects_incidents_and_last_action() -> None:
    text = render_rows(rows(), STATUS_COLUMNS, "wide")
    assert text.splitlines()[0].split()[-6:] == ["BREAKER", "REPAIR", "EFFECTS", "INCIDENTS", "STEPS-DONE",
                                                 "LAST-ACTION"]
    assert "condition/GpuEcc,cordon,taint/NoSchedule" in text and "9f1e0c1d2a3b4c5d6e7f81" in text


@pytest.mark.parametrize("output", ["json", "yaml"])
def test_json_and_yaml_keep_lists_and_objects(output: str) -> None:
    text = render_rows(rows(), STATUS_COLUMNS, output)
    data = orjson.loads(text) if output == "json" else yaml.safe_load(text)
    first = data[0]
    assert first["node"] == PREFIX + "0001"
    assert first["faults"][0]["fault"] == "xid 79" and first["faults"][0]["action"] == "RESTART_BM"
    assert isinstance(first["incidents"], list) and first["incidents"][0]["done"] == ["cordon", "taint"]
    assert first["applied"] == {
        "condition:GpuCount": ["9f0e0c1d2a3b4c5d6e7f80"],
        "cordon": ["9f0e0c1d2a3b4c5d6e7f80"],
        "taint:nvidia.com/gpu-fault:NoSchedule": ["9f0e0c1d2a3b4c5d6e7f80"],
    }
    assert first["breaker"] == {"state": "open", "counted": True}
    assert first["incident_age_seconds"] == 600
    assert data[2]["applied"] == {} and data[2]["faults"] == [] and data[2]["incidents"] == []


def test_render_table_never_truncates_or_wraps_and_keeps_cells_on_one_line() -> None:
    long = "x" * 300
    text = render_table(["a", "b"], [[long, "multi\nline"], ["", "z"]])
    assert text.splitlines() == ["A" + " " * 302 + "B", long + "   multi line", "-" + " " * 302 + "z"]


def test_ages_are_kubectls() -> None:
    """kubectl's HumanDuration (the real kubectl is asked in tests/integration/test_kubectl_output.py)."""
    cases = {None: "-", -5: "<invalid>", -1: "0s", 5: "5s", 119: "119s", 120: "2m", 330: "5m30s", 600: "10m",
             7199: "119m", 7200: "120m", 10_800: "3h", 11_700: "3h15m", 28_800: "8h", 3 * 86400: "3d",
             3 * 86400 + 7200: "3d2h", 8 * 86400: "8d", 800 * 86400: "2y70d", 9 * 365 * 86400: "9y"}
    assert {s: age(s) for s in cases} == cases


def test_narrow_columns_are_six_wide_as_kubectls() -> None:
    assert render_table(["n", "id"], [["a", "1"]]) == "N     ID\na     1\n"


def test_columns_marked_wide_only_show_in_wide_only() -> None:
    cols = [Column("a", lambda r: r["a"]), Column("b", lambda r: r["b"], wide_only=True)]
    assert render_rows([{"a": "1", "b": "2"}], cols, "table") == "A\n1\n"
    assert render_rows([{"a": "1", "b": "2"}], cols, "wide") == "A     B\n1     2\n"


KERNEL = (
    "Nov 21 23:11:02 {node} kernel: NVRM: Xid (PCI:0000:4E:00): 79, pid=1, GPU has fallen off the bus.\n"
    "[   38.17] nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link 44 Minion Link DLREQ\n"
    "[Thu Jul  4 11:09:40 2024] NVRM: Xid (0000:03:00): 62, Channel 00000001\n"
)


def test_classify_at_80_columns_piped_prints_whole_names_one_row_per_fault(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(KERNEL.format(node=PREFIX + "0001"))
    result = CliRunner(env={"COLUMNS": "80"}).invoke(cli, ["classify", str(log)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["LINE", "KIND", "CODE", "PCI", "ACTION", "QUARANTINE", "SEVERITY", "NAME", "DETAIL"]
    assert len(lines) == 4  # one line per fault: nothing wraps letter by letter
    assert "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS" in lines[1] and lines[2].split()[2] == "22013"
    assert lines[2].split()[-1] == "reporter=driver" and lines[1].split()[-1] == "-"  # DETAIL: who printed the SXid
    assert "3 fault(s) recognised" in result.stderr


@pytest.mark.parametrize("output", ["json", "yaml", "wide"])
def test_classify_output_formats(tmp_path: Path, output: str) -> None:
    log = tmp_path / "kern.log"
    log.write_text(KERNEL.format(node="n"))
    result = CliRunner(env={"COLUMNS": "80"}).invoke(cli, ["classify", "-o", output, str(log)])
    assert result.exit_code == 0, result.output
    if output == "json":
        data = [orjson.loads(line) for line in result.stdout.splitlines()]
    elif output == "yaml":
        data = yaml.safe_load(result.stdout)
    else:
        assert result.stdout.splitlines()[0].split()[-4:] == ["GPU", "LINK", "ID", "TEXT"]
        return
    assert [d["code"] for d in data] == [79, 22013, 62] and isinstance(data[0]["quarantine"], bool)


def test_status_rows_are_built_now_relative() -> None:
    assert node_rows(gpu_nodes(), None, now=time.time())[2]["breaker"] == {"state": "closed", "counted": False}
