"""docs/repair.md is the contract of the repair loop: each of its tables is held to the code it describes."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from pipeline.actuator import diagnostics, repaircase, repairrequest
from pipeline.actuator.policy import RepairBudget, RepairSpec
from pipeline.kafka import cloudevents
from tests.unit.test_repaircase import CLS, opened

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "repair.md").read_text()


def table_keys(heading_text: str) -> list[str]:
    """The first column (backquoted names) of the first table after a line containing ``heading_text``."""
    start = DOC.index(heading_text)
    lines = DOC[start:].splitlines()
    rows = []
    in_table = False
    for line in lines:
        if line.startswith("|"):
            in_table = True
            rows.append(line)
        elif in_table:
            break
    keys = []
    for row in rows[2:]:
        cell = row.split("|")[1]
        keys += re.findall(r"`([^`]+)`", cell)
    return keys


def test_every_field_of_a_repair_case_is_documented() -> None:
    ledger, _ = opened()
    repaircase.record_diagnostics(ledger, "inc-1", "j1", "fail", "", {}, 1.0)
    repaircase.record_diagnostics(ledger, "inc-1-1", "j2", "fail", "", {}, 2.0)
    repaircase.record_handoff(ledger, "inc-1-2", "n-inc-1-1", "resource", 3.0)
    repaircase.note_repair(ledger, "inc-1-1", "reboot", "applied", 4.0)
    repaircase.close(ledger, CLS, 5.0, "reset by a person")
    case = ledger.repairs[CLS]
    documented = table_keys("| field | meaning |")
    assert set(case) == set(documented)
    faults = re.search(r"`\{(incident, rev[^}]*)\}`", DOC).group(1)  # type: ignore[union-attr]
    assert set(re.split(r",\s*", faults)) == set(case["faults"][0])
    for key, sample in (("repairs", case["repairs"][0]), ("diagnostics", case["diagnostics"][0]),
                        ("history", case["history"][0]), ("handoff", {**case["handoff"], "answered": 0, "by": ""})):
        shown = re.search(rf"\| `{key}` \| `\{{([^}}]*)\}}`", DOC)
        assert shown is not None, key
        assert set(re.split(r",\s*", shown.group(1))) == set(sample), key


def test_every_stage_is_documented() -> None:
    assert table_keys("| stage | the node |") == list(repaircase.STAGES)


def test_the_result_format_and_the_verdicts_are_the_codes() -> None:
    assert table_keys("| key | type | meaning |") == list(diagnostics.RESULT_KEYS)
    assert f"({diagnostics.RESULT_FORMAT})" in DOC.replace("`", "")
    assert f"{int(diagnostics.DEADLINE_GRACE)} s past the deadline" in DOC
    assert f"default {int(diagnostics.DEFAULT_TIMEOUT)}" in DOC


def test_the_policy_options_and_their_defaults() -> None:
    rows = {k: v for k, v in re.findall(r"^\| `([^`]+)` \| `?([^`|]*)`? \|", DOC, re.M)}
    spec = RepairSpec()
    assert rows["repair.window"] == f"{spec.window:g}"
    assert rows["repair.maxFailedRepairs"] == str(spec.max_failed_repairs)
    assert {f.alias or n for n, f in RepairBudget.model_fields.items()} == {"label", "maxNodes", "maxShare"}


def test_the_repair_request_table_is_the_crds_spec() -> None:
    crd = yaml.safe_load((ROOT / "deploy" / "crds" / "repairrequests.xidflow.dev.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    spec = schema["spec"]["properties"]
    documented = table_keys("| spec field | meaning |")
    assert {k.rstrip("[]") for k in documented} == set(spec)
    for key in ("faults", "repairsTried", "diagnostics"):
        row = next(line for line in DOC.splitlines() if line.startswith(f"| `{key}[]`"))
        assert set(re.findall(r"`(\w+)`", row.split("|")[2])) == set(spec[key]["items"]["properties"]), key
    assert schema["status"]["properties"]["phase"]["enum"] == ["Pending", "InProgress", "Repaired", "Replaced",
                                                               "Rejected"]
    assert all(f"`{phase}`" in DOC for phase in schema["status"]["properties"]["phase"]["enum"])
    assert set(repaircase.ANSWERS) == {"Repaired", "Replaced"} and repairrequest.EVENT_TYPE in DOC


def test_the_cloudevents_table_is_what_the_records_carry() -> None:
    from datetime import UTC, datetime

    from schemas.records import Action, FaultKind, NodeIncident, Severity

    t = datetime(2026, 1, 1, tzinfo=UTC)
    inc = NodeIncident(incident_id="i", node="n", signature="s", kind=FaultKind.XID, first_seen=t, last_seen=t,
                       severity=Severity.ERROR, action=Action.RESET_GPU, quarantine=True)
    headers = [h for h, _ in cloudevents.headers(inc, "/x")]
    assert table_keys("| header | incident | recovery | audit record |") == headers
    for record_type, ce_type in cloudevents.TYPES.items():
        assert f"`{ce_type}`" in DOC, record_type
