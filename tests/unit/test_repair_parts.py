"""The repair loop's pure parts: the diagnostics verdict and result format, the hand-off's body and CloudEvent,
the breaker's absolute bound, repair-budget slots, codes that cancel, the CloudEvents headers, status rows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest

from pipeline.actuator import diagnostics, repaircase, repairrequest
from pipeline.actuator.breaker_rules import breaker_cap, decide_admissions, settle, take_group_slots
from pipeline.actuator.jobtemplates import validate_job_template
from pipeline.actuator.ownership import LEDGER_ANNOTATION
from pipeline.aggregate.aggregator import Aggregator
from pipeline.commands.status import history_rows, node_rows
from pipeline.detection.catalog import Catalog
from pipeline.kafka import cloudevents
from schemas.records import (
    Action,
    FaultEvent,
    FaultKind,
    NodeIncident,
    NodeRecovered,
    Outcome,
    RemediationRecord,
    Severity,
)
from tests.unit.test_repaircase import CLS, opened

T0 = datetime(2026, 11, 28, 12, 0, tzinfo=UTC)


# -- diagnostics --------------------------------------------------------------------------------------------
def job(condition: str | None, reason: str = "") -> dict[str, Any]:
    conds = [{"type": condition, "status": "True", "reason": reason}] if condition else []
    return {"status": {"conditions": conds}}


@pytest.mark.parametrize(("status", "message", "overdue", "verdict"), [
    (job("Complete"), None, False, "pass"),
    (job("Complete"), '{"result": "pass", "level": 2}', False, "pass"),
    (job("Complete"), '{"result": "fail", "tests": [{"name": "memory", "result": "fail", "gpu": 3}]}', False, "fail"),
    (job("Failed", "BackoffLimitExceeded"), '{"result": "fail", "exitCode": 226}', False, "fail"),
    (job("Failed", "DeadlineExceeded"), None, False, "timeout"),
    (job(None), None, False, None),
    (job(None), None, True, "timeout"),
    # Not an end yet: the Job controller's FailureTarget comes before Failed, a condition may be status False.
    (job("FailureTarget", "BackoffLimitExceeded"), None, False, None),
    ({"status": {"conditions": [{"type": "Complete", "status": "False"}]}}, None, False, None),
])
def test_the_verdict_comes_from_the_jobs_status_and_the_result_format(
    status: dict[str, Any], message: str | None, overdue: bool, verdict: str | None
) -> None:
    assert diagnostics.verdict(status, message, overdue).verdict == verdict


def test_the_result_object_is_read_capped_and_text_is_kept_as_text() -> None:
    result = diagnostics.read_message(orjson.dumps({
        "result": "fail", "level": 3, "exitCode": 226, "tests": [{"name": f"t{i}"} for i in range(40)],
        "message": "x" * 2000, "other": 1}).decode())
    assert set(result) == {"result", "level", "exitCode", "tests", "message"}
    assert len(result["tests"]) == diagnostics.MAX_TESTS and len(result["message"]) == 512
    assert diagnostics.read_message("Error: unable to connect to host engine") == {
        "message": "Error: unable to connect to host engine"}
    pod = {"status": {"containerStatuses": [{"state": {"terminated": {"exitCode": 1, "message": "m"}}}]}}
    assert diagnostics.termination_message(pod) == "m" and diagnostics.termination_message({}) is None


def test_the_built_in_diagnostics_job_is_a_documented_hook_running_dcgm_level_2() -> None:
    import yaml

    from pipeline.actuator import effects

    template = yaml.safe_load(effects.DEFAULT_DIAGNOSTICS_JOB)
    validate_job_template(template, "xidflow-node-ops")
    container = template["spec"]["template"]["spec"]["containers"][0]
    assert (container["image"], tuple(container["command"])) in effects.DOCUMENTED_HOOKS
    script = container["command"][-1]
    assert "nsenter -t 1 -m -u -i -n -p -- dcgmi diag -r 2" in script and "tee /dev/termination-log" in script
    assert not set("<>&") & set(script)  # the chart's admission policy carries the command as JSON
    assert template["spec"]["backoffLimit"] == 0 and template["spec"]["template"]["spec"]["hostPID"] is True


# -- the hand-off ---------------------------------------------------------------------------------------------
def test_the_repair_request_names_the_node_the_faults_the_evidence_and_the_repairs_tried() -> None:
    ledger, _ = opened()
    repaircase.note_repair(ledger, "inc-1", "reboot", "applied", 1_700_000_100)
    repaircase.record_diagnostics(ledger, "inc-1", "job-1", "fail", "dcgmi diag -r 2", {}, 1_700_000_200)
    case = ledger.repairs[CLS]
    request = repairrequest.body("gpu-1", "gpu-1-inc-1-1", case, "2 repairs did not hold", "w1")
    spec = request["spec"]
    assert request["kind"] == "RepairRequest" and request["apiVersion"] == "xidflow.dev/v1alpha1"
    assert spec["nodeName"] == "gpu-1" and spec["faultClass"] == CLS and spec["caseId"] == "inc-1"
    assert spec["faults"][0]["incidentId"] == "inc-1" and spec["faults"][0]["code"] == 79
    assert spec["faults"][0]["line"].startswith("NVRM: Xid")
    assert spec["repairsTried"] == [{"action": "reboot", "flow": "inc-1", "outcome": "applied",
                                     "at": "2023-11-14T22:15:00Z"}]
    assert spec["diagnostics"][0]["verdict"] == "fail" and spec["failedRepairs"] == 1
    assert all(v is not None for f in spec["faults"] for v in f.values())  # no nulls for the CRD's schema
    event = repairrequest.cloudevent(request, "/clusters/east/xidflow")
    assert event["specversion"] == "1.0" and event["type"] == repairrequest.EVENT_TYPE
    assert event["source"] == "/clusters/east/xidflow/actuator" and event["subject"] == "gpu-1"
    assert event["id"] == "gpu-1-inc-1-1" and event["data"] == request
    assert repairrequest.phase_of({"status": {"phase": "Replaced", "updatedBy": "rma"}}) == ("Replaced", "rma")
    assert repairrequest.phase_of({}) == (None, "")


# -- the breaker's absolute bound and the repair budgets --------------------------------------------------------
def test_the_breaker_trips_at_the_absolute_bound_before_the_share() -> None:
    assert breaker_cap(100, 0.5) == 50 and breaker_cap(100, 0.5, max_nodes=3) == 3 and breaker_cap(4, 0.5, 9) == 2
    state: dict[str, Any] = {}
    got = decide_admissions(state, ["a", "b", "c", "d"], 100, 0.5, 300, 1000.0, max_nodes=3)
    assert [got[n].allowed for n in "abcd"] == [True, True, True, False]
    assert got["d"].tripped_now and "limit 3 nodes" in state["reason"]
    # reservations never hold more than the bound either
    settled = settle({}, "h1", [], {}, 0, 10, 100, 0.5, 300, 1000.0, 20.0, frozenset({"x"}), max_nodes=3)
    assert settled.granted <= 2


def test_repair_slots_are_all_or_none_per_group_and_stale_ones_free() -> None:
    state: dict[str, Any] = {}
    caps = {"rack=r1": 2, "pool=p": 1}
    assert take_group_slots(state, "n1", "w", caps, 60, 0.0) is None
    assert take_group_slots(state, "n2", "w", caps, 60, 1.0) == "pool=p"  # the pool is full: no rack slot either
    assert set(state["groups"]["rack=r1"]) == {"n1"}
    assert take_group_slots(state, "n1", "w2", caps, 60, 2.0) is None  # a resumed step keeps its slot
    assert take_group_slots(state, "n2", "w", caps, 60, 100.0) is None  # n1's slots lapsed
    assert set(state["groups"]["pool=p"]) == {"n2"}


# -- codes that cancel ---------------------------------------------------------------------------------------
def xid(code: int, eid: str, at: timedelta, pci: str = "0000:4e:00.0") -> FaultEvent:
    c = Catalog.configured().xid(code)
    return FaultEvent(id=eid, node="n1", kind=FaultKind.XID, code=code, pci=pci, action=c.action, severity=c.severity,
                      name=c.name, ts=T0 + at, line=f"NVRM: Xid (PCI:{pci[:-2]}): {code}, pid=1, name=x")


def test_xid_162_cancels_an_open_xid_163_on_its_gpu_with_its_evidence() -> None:
    assert Catalog.configured().cancels(162) == {163} and not Catalog.configured().cancels(79)
    agg = Aggregator()
    state = agg.new_state("n1")
    state, out = agg.step(state, xid(163, "e1", timedelta()), 100.0)
    (opened_163,) = out
    state, out = agg.step(state, xid(162, "e2", timedelta(seconds=1), pci="0000:9a:00.0"), 101.0)
    assert [r.type for r in out] == ["incident"] and out[0].code == 162  # another GPU: an incident of its own
    state, out = agg.step(state, xid(162, "e3", timedelta(seconds=2)), 102.0)
    (closed,) = out
    assert isinstance(closed, NodeRecovered) and closed.reason == "cancelled"
    assert closed.incident_id == opened_163.incident_id and closed.evidence_ids == ["e3"]
    assert closed.cancelled_by == "xid:162:0000:4e:00.0" and "PSHC_REENGAGED" in closed.detail
    assert not any(i.code == 163 for i in state.incidents.values())


def test_a_cancelling_line_older_than_the_incident_cancels_nothing() -> None:
    agg = Aggregator()
    state = agg.new_state("n1")
    state, _ = agg.step(state, xid(163, "e1", timedelta(seconds=10)), 100.0)
    state, out = agg.step(state, xid(162, "e2", timedelta(seconds=5)), 101.0)
    assert not any(isinstance(r, NodeRecovered) for r in out)


# -- CloudEvents headers -------------------------------------------------------------------------------------
def test_incidents_recoveries_and_audit_records_carry_the_cloudevents_kafka_binding() -> None:
    inc = NodeIncident(incident_id="i1", node="gpu-1", signature="xid:79", kind=FaultKind.XID, first_seen=T0,
                       last_seen=T0, opened_at=T0, revision=2, severity=Severity.CRITICAL,
                       action=Action.REBOOT_NODE, quarantine=True)
    headers = dict(cloudevents.headers(inc, "/clusters/east/xidflow"))
    assert headers == {
        "ce_specversion": b"1.0", "ce_id": b"i1.2", "ce_source": b"/clusters/east/xidflow/aggregation",
        "ce_type": b"dev.xidflow.incident.v1", "ce_time": b"2026-11-28T12:00:00Z", "ce_subject": b"gpu-1",
        "content-type": b"application/json",
    }
    rec = dict(cloudevents.headers(NodeRecovered(incident_id="i1", node="gpu-1", reason="cancelled",
                                                 recovered_at=T0), "/xidflow"))
    assert rec["ce_id"] == b"i1.recovered" and rec["ce_type"] == b"dev.xidflow.recovered.v1"
    audit = RemediationRecord(record_id="r1", node="gpu-1", action="diagnose", outcome=Outcome.FAILED,
                              finished_at=T0)
    got = dict(cloudevents.headers(audit, "/xidflow"))
    assert got["ce_id"] == b"r1" and got["ce_source"] == b"/xidflow/actuator"
    assert got["ce_type"] == b"dev.xidflow.remediation.v1"
    with pytest.raises(ValueError, match="URI reference"):
        cloudevents.CloudEventsSettings(source="not a uri")


# -- status ------------------------------------------------------------------------------------------------
def test_status_shows_where_the_node_is_in_the_loop_and_its_history() -> None:
    ledger, _ = opened()
    repaircase.record_diagnostics(ledger, "inc-1", "j1", "fail", "", {}, 1_700_000_010)
    obj = {"metadata": {"name": "gpu-1", "annotations": {LEDGER_ANNOTATION: ledger.to_annotation()}},
           "spec": {"unschedulable": True}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    (row,) = node_rows([obj], now=1_700_000_020)
    assert row["repair"] == "repairing (GpuFellOffBus, 1/2 failed)"
    assert row["repairs"][0]["diagnostics"][0]["verdict"] == "fail"
    stages = [h["stage"] for h in history_rows(row)]
    assert stages == ["repairing", "repairing"]
