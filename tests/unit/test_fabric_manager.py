"""Fabric Manager's own log (issue 36, deliverable 1): its SXid reports are the same typed SXid events as the
driver's kernel line, and the fault both report is one incident, counted once, in either order, seconds apart,
and across a worker restart.

Report lines are leptonai/gpud's (components/accelerator/nvidia/fabric-manager: testdata/fabricmanager.log,
log_matcher.go); the kernel lines beside them are constructed in the driver's SXid format for the same switch.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from pipeline.aggregate.aggregator import Aggregator, event_signature
from pipeline.aggregate.state import NodeState
from pipeline.detection.detector import Detector
from pipeline.ingest.parsing.common import prefix_is_fabric_manager
from pipeline.ingest.parsing.kernel import SXidLine, parse_kernel_line
from schemas.records import Action, FaultEvent, FaultKind, LogRecord, NodeIncident, Reporter, Source

NODE = "gpu-node-9"
T0 = datetime(2025, 2, 27, 15, 10, 2, tzinfo=UTC)
FM_NONFATAL = ("[Feb 27 2025 15:10:02] [ERROR] [tid 12727] detected NVSwitch non-fatal error 12028 on fid 0 on "
               "NVSwitch pci bus id 00000000:86:00.0 physical id 3 port 61")
FM_FATAL = ("[Jul 23 2024 07:53:55] [ERROR] [tid 841] detected NVSwitch fatal error 20034 on fid 0 on NVSwitch pci "
            "bus id 00000000:86:00.0 physical id 3 port 33")
# The driver's line of the same fault (constructed: nvidia-nvswitch3 is the switch at 0000:86:00.0).
KERNEL_FATAL = "[ 1108.858286] nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 20034, Fatal, Link 33 LTSSM Fault Up"
KERNEL_CONTINUATION = ("[ 1108.858290] nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 20034, Severity 1 Engine instance 33 "
                       "Sub-engine instance 00")


def test_a_report_is_an_sxid_line_with_the_switch_and_port() -> None:
    parsed = parse_kernel_line(FM_NONFATAL)
    assert isinstance(parsed, SXidLine)
    assert (parsed.code, parsed.pci, parsed.fatal, parsed.link, parsed.nvswitch) == (
        12028, "0000:86:00.0", False, 61, None)
    assert (parsed.reporter, parsed.physical_id, parsed.detail) == (Reporter.FABRIC_MANAGER, 3, {"fid": 0})
    assert parsed.header and not parsed.continuation
    fatal = parse_kernel_line(FM_FATAL)
    assert isinstance(fatal, SXidLine) and (fatal.code, fatal.fatal, fatal.link) == (20034, True, 33)


@pytest.mark.parametrize("prefix", [
    "", "[Jul 09 2024 18:14:07] [ERROR] [tid 12727] ", "[ERROR] [tid 12727] ",
    "Mar 03 18:39:57 gpu-node-9 nv-fabricmanager[5183]: ", "nv-fabricmanager: ",
    "2024-07-04T11:09:40+00:00 gpu-node-9 nvidia-fabricmanager[77]: ", "/var/log/fabricmanager.log:",
    "fabricmanager.log.1:42:[Jul 09 2024 18:14:07] [ERROR] [tid 1] ",
])
def test_the_prefixes_fabric_manager_and_its_shippers_put_there(prefix: str) -> None:
    assert prefix_is_fabric_manager(prefix)
    assert isinstance(parse_kernel_line(prefix + FM_FATAL[FM_FATAL.index("detected"):]), SXidLine)


@pytest.mark.parametrize("prefix", [
    "Mar 03 18:39:57 gpu-node-9 gpu-alerter[812]: ", "ALERT: node-3: ", "echo '", 'msg="',
    "2026-09-18T08:51:12Z WARN  ", "kernel: ",
])
def test_another_programs_line_quoting_the_report_is_not_one(prefix: str) -> None:
    assert not prefix_is_fabric_manager(prefix)
    assert parse_kernel_line(prefix + FM_FATAL[FM_FATAL.index("detected"):]) is None


def test_the_parts_after_the_code_are_optional() -> None:
    """Only 'detected NVSwitch <fatal|non-fatal> error <code>' is required: the journald form says 'on NodeId 0'."""
    syslog = ("Mar 03 18:39:57 gpu-node-9 nv-fabricmanager[5183]: detected NVSwitch non-fatal error 22013 on NodeId 0 "
              "on NVSwitch pci bus id 00000000:08:00.0 physical id 3 port 60")
    parsed = parse_kernel_line(syslog)
    assert isinstance(parsed, SXidLine) and parsed.detail == {"nodeid": 0}
    assert (parsed.pci, parsed.link, parsed.physical_id) == ("0000:08:00.0", 60, 3)
    bare = parse_kernel_line("detected NVSwitch fatal error 12020")
    assert isinstance(bare, SXidLine) and (bare.code, bare.pci, bare.link, bare.fatal) == (12020, None, None, True)


def events(lines: list[tuple[float, str]], detector: Detector | None = None) -> list[FaultEvent]:
    detector = detector or Detector()
    out: list[FaultEvent] = []
    for at, line in lines:
        out += detector.process(LogRecord(node=NODE, source=Source.KERNEL, ts=T0 + timedelta(seconds=at), line=line))
    return out


def test_the_event_is_the_drivers_sxid_event_with_the_reporter() -> None:
    [fm] = events([(0, FM_FATAL)])
    [kernel] = events([(0, KERNEL_FATAL), (0, KERNEL_CONTINUATION)])
    same = ("kind", "code", "pci", "link", "fatal", "action", "severity", "name")
    assert {k: getattr(fm, k) for k in same} == {k: getattr(kernel, k) for k in same}
    assert (fm.kind, fm.action, fm.reporter, kernel.reporter) == (
        FaultKind.SXID, Action.RESET_GPU, Reporter.FABRIC_MANAGER, Reporter.DRIVER)
    assert fm.detail["physical_id"] == 3 and fm.nvswitch is None and kernel.nvswitch == "nvidia-nvswitch3"
    assert event_signature(fm) == event_signature(kernel) == "sxid:20034:0000:86:00.0"
    assert fm.id != kernel.id  # each line keeps its own deterministic id


def incidents(outputs: list) -> list[NodeIncident]:
    return [o for o in outputs if isinstance(o, NodeIncident)]


def run(lines: list[tuple[float, str]], state: NodeState | None = None) -> tuple[NodeState, list[NodeIncident]]:
    agg = Aggregator()
    state = state or agg.new_state(NODE)
    out: list = []
    for event in events(lines):
        state, emitted = agg.step(state, event, now=1_000.0 + (event.ts - T0).total_seconds())
        out += emitted
    return state, incidents(out)


@pytest.mark.parametrize("order", ["driver-first", "fabric-manager-first"])
@pytest.mark.parametrize("skew_s", [0.0, 1.5, 45.0])
def test_the_fault_both_report_is_one_incident_counted_once(order: str, skew_s: float) -> None:
    driver, manager = [(0.0, KERNEL_FATAL), (0.0, KERNEL_CONTINUATION)], [(skew_s, FM_FATAL)]
    lines = driver + manager if order == "driver-first" else [(0.0, FM_FATAL), (skew_s, KERNEL_FATAL)]
    state, out = run(lines)
    assert len(out) == 1 and out[0].action is Action.RESET_GPU
    [inc] = state.incidents.values()
    assert inc.count == 1 and inc.reports == {"driver": 1, "fabric_manager": 1}
    assert len(inc.evidence_ids) == 2  # both reports are evidence of the one fault


def test_a_storm_both_print_counts_each_error_once_and_a_lone_report_still_counts() -> None:
    both = [(i, KERNEL_FATAL) for i in range(5)] + [(i + 0.5, FM_FATAL) for i in range(5)]
    state, out = run(both)
    [inc] = state.incidents.values()
    assert (len(out), inc.count, inc.reports) == (1, 5, {"driver": 5, "fabric_manager": 5})
    # Fabric Manager reports one more the driver's line did not reach us for: the count follows the fuller one.
    state, _ = run([(6, FM_FATAL)], state)
    assert next(iter(state.incidents.values())).count == 6


def test_one_fault_across_a_restart_of_the_worker() -> None:
    """The per-reporter counts live in the node's state (the changelog): a worker that restarted between the two
    reports, with a fresh detector, still folds the second into the first's incident and counts it once."""
    state, out = run([(0, KERNEL_FATAL)])
    restored = NodeState.from_bytes(state.to_bytes())
    state, more = run([(2, FM_FATAL)], restored)
    assert len(out) == 1 and more == []
    assert next(iter(state.incidents.values())).count == 1


def test_a_non_fatal_report_opens_nothing_from_either_reporter() -> None:
    state, out = run([(0, FM_NONFATAL)])
    assert out == [] and state.incidents == {}
