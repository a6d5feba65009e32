"""The pure parts of how xidflow reads what the cluster answers: a hook Job's end, a reboot Job's failed pod, an
unreachable node, and KWOK's stage for a deleted pod (tests/integration/test_actuator_controllers.py and
test_actuator_unreachable.py run them against the real controllers)."""

from __future__ import annotations

from pathlib import Path

import yaml

from pipeline.actuator.actions.reboot import _exit_of, _terminated_by_the_node
from pipeline.actuator.jobstatus import JobEnd, job_end
from pipeline.actuator.nodeview import NodeView
from pipeline.localinfra import kwok
from tests.unit.test_localinfra_controlplane import module_files


def condition(kind: str, status: str = "True", reason: str = "", message: str = "") -> dict[str, str]:
    return {"type": kind, "status": status, "reason": reason, "message": message}


def test_a_jobs_end_is_its_terminal_condition_and_nothing_before_it() -> None:
    assert job_end({"status": {"active": 1}}) is None
    # Kubernetes 1.31+ says first what it will do (SuccessCriteriaMet, FailureTarget): not the end yet.
    assert job_end({"status": {"conditions": [condition("FailureTarget", reason="BackoffLimitExceeded")]}}) is None
    assert job_end({"status": {"conditions": [condition("Complete", "False")]}}) is None
    assert job_end({"status": {"conditions": [condition("SuccessCriteriaMet"), condition("Complete")]}}) == JobEnd(True)
    failed = job_end({"status": {"conditions": [
        condition("FailureTarget"), condition("Failed", reason="BackoffLimitExceeded", message="limit reached")]}})
    assert failed == JobEnd(False, "BackoffLimitExceeded", "limit reached")
    assert failed.describe() == "Failed: BackoffLimitExceeded: limit reached"
    assert JobEnd(True).describe() == "Complete" and JobEnd(False).describe() == "Failed"


def test_a_reboot_jobs_pod_killed_by_the_nodes_shutdown_is_not_a_failed_request() -> None:
    shutdown = {"status": {"phase": "Failed", "conditions": [
        condition("DisruptionTarget", reason="TerminationByKubelet", message="imminent node shutdown")]}}
    crashed = {"status": {"phase": "Failed", "containerStatuses": [
        {"name": "reboot", "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}]}}
    assert _terminated_by_the_node(shutdown) and not _terminated_by_the_node(crashed)
    assert _exit_of([shutdown, crashed]) == "exit code 1 (Error)"
    assert _exit_of([{"status": {"containerStatuses": [{"state": {"running": {}}}]}}]) == ""


def test_a_node_is_unreachable_when_the_lifecycle_controller_made_ready_unknown() -> None:
    def view(*conditions: dict[str, str]) -> NodeView:
        return NodeView.from_object({"metadata": {"name": "n"}, "status": {"conditions": list(conditions)}})

    assert view(condition("Ready", "Unknown", "NodeStatusUnknown")).unreachable
    assert not view(condition("Ready", "False", "KubeletNotReady")).unreachable  # a kubelet answers, NotReady
    assert not view(condition("Ready")).unreachable
    assert not view().unreachable  # never reported: not judged yet


def test_kwok_runs_the_modules_stages_and_stops_a_deleted_running_pod_first(tmp_path: Path) -> None:
    files = module_files(tmp_path)
    for rel in kwok.STAGES:
        path = files / rel
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump({"kind": "Stage", "metadata": {"name": Path(rel).stem}, "spec": {}}))
    stages = kwok.all_stages(files)
    assert [s["metadata"]["name"] for s in stages][:-1] == [
        s["metadata"]["name"] for s in kwok.load_stages(files)]
    stop = stages[-1]
    assert stop == kwok.POD_STOP_STAGE and stop is not kwok.POD_STOP_STAGE
    expressions = {e["key"]: (e["operator"], e.get("values")) for e in stop["spec"]["selector"]["matchExpressions"]}
    assert expressions == {".metadata.deletionTimestamp": ("Exists", None), ".status.phase": ("In", ["Running"])}
    # A weight, where the module's pod-delete has none: KWOK picks this one while both match.
    assert stop["spec"]["weight"] >= 1
    template = stop["spec"]["next"]["statusTemplate"]
    assert "phase: Failed" in template and "exitCode: 143" in template
    assert "DisruptionTarget" not in template  # the conditions others wrote are kept, not rewritten
