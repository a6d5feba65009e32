"""Detector: per-node state, folding, deterministic ids, probe and pod sources, classify_lines."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from pipeline.detection.detector import Detector, classify_lines, parse_health_check, prefilter
from schemas.records import Action, FaultEvent, FaultKind, HealthCheckResult, LogRecord, Severity, SignalGrade

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
UUID = "GPU-bc0fa0b9-cac2-f507-b715-9bebdb69c71e"


def rec(line: str, node: str = "n1", source: str = "kernel", seconds: float = 0, **kw: object) -> LogRecord:
    return LogRecord(node=node, source=source, ts=T0 + timedelta(seconds=seconds), line=line, **kw)


@pytest.fixture()
def detector() -> Detector:
    return Detector()


def test_prefilter_noise_and_faults() -> None:
    assert not prefilter("[12.3] IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready", "kernel")
    assert not prefilter("[12.3] nvidia 0000:3b:00.0: enabling device (0000 -> 0003)", "kernel")
    assert prefilter("NVRM: Xid (PCI:0000:4e:00): 79, GPU has fallen off the bus.", "kernel")
    assert prefilter("nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 28 x", "kernel")
    assert prefilter("x[1]: segfault at 0 ip 0 sp 0 error 4 in libnccl.so.2[7f+1]", "kernel")
    assert prefilter("CUDA error: an illegal memory access was encountered", "pod")
    assert not prefilter("step 10 loss 0.3", "pod")
    assert prefilter("CUDA error: an illegal memory access was encountered")  # no source: any source
    assert prefilter("{}", "probe")


def test_ids_are_deterministic_and_distinct(detector: Detector) -> None:
    line = "NVRM: Xid (PCI:0000:4e:00): 48, pid=1, name=x, An uncorrectable double bit error"
    first = detector.process(rec(line))
    again = Detector().process(rec(line))
    later = detector.process(rec(line, seconds=1))
    assert len(first) == 1 and first[0].id == again[0].id
    assert later[0].id != first[0].id
    other_node = Detector().process(rec(line, node="n2"))
    assert other_node[0].id != first[0].id


def test_uuid_map_is_per_node(detector: Detector) -> None:
    detector.process(rec(f"kernel: NVRM: GPU at PCI:0000:01:00: {UUID}"))
    xid = "kernel: NVRM: Xid (PCI:0000:01:00): 95, pid=1, name=x, Uncontained error"
    [event] = detector.process(rec(xid))
    assert event.gpu_uuid == UUID and event.pci == "0000:01:00.0"
    [elsewhere] = detector.process(rec(xid, node="n2"))
    assert elsewhere.gpu_uuid is None
    assert detector.gpu_uuid("n1", "PCI:0000:01:00") == UUID
    detector.forget("n1")
    assert detector.gpu_uuid("n1", "0000:01:00.0") is None


def test_three_line_fallen_off_bus_is_one_event_across_records(detector: Detector) -> None:
    lines = [
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
        "[ 1843.308146] NVRM: (PCI ID: 10de:26b5) installed in this system has",
        "[ 1843.308147] NVRM: fallen off the bus and is not responding to commands.",
    ]
    events = [e for i, line in enumerate(lines) for e in detector.process(rec(line, seconds=i))]
    assert len(events) == 1
    event = events[0]
    assert (event.kind, event.pci, event.action) == (FaultKind.GPU_FALLEN_OFF_BUS, "0000:b3:00.0", Action.REBOOT_NODE)
    assert event.detail["pci_id"] == "10de:26b5"
    assert event.line == "\n".join(lines)
    # The id is the first line's: replaying the same records gives the same event id.
    fresh = Detector()
    replay = [e for i, line in enumerate(lines) for e in fresh.process(rec(line, seconds=i))]
    assert replay[0].id == event.id
    assert detector.flush() == []


def test_three_line_form_in_one_record(detector: Detector) -> None:
    text = (
        "NVRM: The NVIDIA GPU 0000:b3:00.0\n               NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
        "               NVRM: fallen off the bus and is not responding to commands."
    )
    [event] = detector.process(rec(text))
    assert event.pci == "0000:b3:00.0"


def test_flush_emits_a_confirmed_fold_and_drops_an_ambiguous_one(detector: Detector) -> None:
    detector.process(rec("NVRM: The NVIDIA GPU 0000:b3:00.0", node="a"))
    detector.process(rec("NVRM: (PCI ID: 10de:26b5) installed in this system has", node="a"))
    detector.process(rec("NVRM: The NVIDIA GPU 0000:18:00.0", node="b"))  # could be "not supported"
    assert detector.flush("b") == []
    [event] = detector.flush()
    assert (event.node, event.pci) == ("a", "0000:b3:00.0")
    assert detector.flush() == []


def test_unsupported_gpu_message_is_not_a_fault(detector: Detector) -> None:
    for line in (
        "NVRM: The NVIDIA GPU 0000:01:00.0 (PCI ID: 10de:1c82)",
        "NVRM: installed in this system is not supported by the",
        "NVRM: NVIDIA 470.82.01 driver release.",
    ):
        assert detector.process(rec(line)) == []
    assert detector.flush() == []


def test_fallen_off_bus_after_xid79_is_the_same_fault_but_not_much_later(detector: Detector) -> None:
    assert len(detector.process(rec("NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus."))) == 1
    assert detector.process(rec("NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.", seconds=1)) == []
    # An hour later the GPU (after a reset) falls off again: a new fault.
    [again] = detector.process(rec("NVRM: GPU 0000:01:00.0: GPU has fallen off the bus.", seconds=3600))
    assert again.kind is FaultKind.GPU_FALLEN_OFF_BUS


def test_sxid_counts_first_line_only(detector: Detector) -> None:
    base = "nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, "
    events: list[FaultEvent] = []
    for tail in ("Non-fatal, Link 44 Minion Link DLREQ interrupt", "Severity 0 Engine instance 44 Sub-engine 00",
                 "Data {0x2c, 0x2c}", "Non-fatal, Link 45 Minion Link DLREQ interrupt", "Data {0x2d}"):
        events += detector.process(rec(base + tail))
    assert [e.link for e in events] == [44, 45]
    soe = "nvidia-nvswitch0: SXid (PCI:0004:00:00.0): 26006, "
    soe_events = detector.process(rec(soe + "SOE HALTED")) + detector.process(rec(soe + "SOE HALT data[0] = 0x 0"))
    assert len(soe_events) == 1 and soe_events[0].action is Action.ALERT  # unknown code, no printed severity


def test_sxid_event_fields(detector: Detector) -> None:
    [event] = detector.process(
        rec("[1.1] nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 28 sourcetrack timeout error")
    )
    assert (event.kind, event.code, event.nvswitch, event.link, event.fatal) == (
        FaultKind.SXID, 24007, "nvidia-nvswitch0", 28, True)
    assert event.quarantine


def test_pod_record_carries_pod_fields(detector: Detector) -> None:
    record = rec("RuntimeError: CUDA error: uncorrectable ECC error encountered", source="pod",
                 namespace="ml", pod="trainer-0", container="main")
    [event] = detector.process(record)
    assert (event.kind, event.grade, event.pod, event.namespace) == (
        FaultKind.POD_ERROR, SignalGrade.HARDWARE, "trainer-0", "ml")
    assert not event.quarantine
    # Kernel-only text in a pod's log is not a kernel fault.
    assert detector.process(rec("NVRM: Xid (PCI:0000:01:00): 79, x", source="pod")) == []


def test_probe_records(detector: Detector) -> None:
    failed = HealthCheckResult(node="n1", check="remapped_rows", passed=False, severity=Severity.CRITICAL,
                               pci="0000:3B:00", gpu_uuid=UUID, values={"failed": True}, ts=T0)
    [event] = detector.process(rec(failed.to_bytes().decode(), source="probe"))
    assert (event.kind, event.action, event.severity, event.pci) == (
        FaultKind.HEALTH_CHECK, Action.CONTACT_SUPPORT, Severity.CRITICAL, "0000:3b:00.0")
    passed = HealthCheckResult(node="n1", check="ecc", passed=True, ts=T0)
    assert detector.process(rec(passed.to_bytes().decode(), source="probe")) == []
    assert detector.process(rec('{"check": 3}', source="probe")) == []
    assert parse_health_check("not json") is None


def test_classify_lines_reports_where_each_fault_begins() -> None:
    lines = [
        "noise",
        "NVRM: The NVIDIA GPU 0000:b3:00.0",
        "NVRM: (PCI ID: 10de:26b5) installed in this system has",
        "NVRM: fallen off the bus and is not responding to commands.",
        "NVRM: Xid (PCI:0000:4e:00): 13, pid=1, name=x, Graphics Exception (GPC 1, TPC 2, SM 3)",
    ]
    results = list(classify_lines(lines))
    assert [(n, e.kind) for n, e in results] == [(2, FaultKind.GPU_FALLEN_OFF_BUS), (5, FaultKind.XID)]
    assert results[1][1].detail["gpc"] == 1
    ids = [e.id for _, e in classify_lines(lines)]
    assert ids == [e.id for _, e in results]


def test_classify_lines_flushes_at_end_of_input() -> None:
    lines = ["NVRM: The NVIDIA GPU 0000:b3:00.0", "NVRM: (PCI ID: 10de:26b5) installed in this system has"]
    [(line_no, event)] = list(classify_lines(lines))
    assert line_no == 1 and event.pci == "0000:b3:00.0"
