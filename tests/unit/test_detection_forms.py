"""Every form the kernel and NCCL print, in every shipper shape (issue 11, points 2-5 and 7)."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
import pytest

from pipeline.aggregate.aggregator import Aggregator
from pipeline.detection.detector import Detector, classify_lines
from pipeline.ingest.adapters import decode_record
from pipeline.ingest.parsing.common import prefix_is_kernel
from pipeline.ingest.parsing.kernel import FallenOffBusLine, parse_kernel_line
from pipeline.ingest.parsing.kmsg import decode_kmsg_escapes, record_lines
from pipeline.ingest.parsing.pod import match_pod_signal
from schemas.records import Action, FaultKind, LogRecord, SignalGrade, Source

T = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)

THREE = (
    "NVRM: The NVIDIA GPU 0000:b3:00.0",
    "NVRM: (PCI ID: 10de:2330) installed in this system has",
    "NVRM: fallen off the bus and is not responding to commands.",
)
KMSG_ONE_RECORD = r"\x0a".join(THREE)


def kernel(line: str, node: str = "n1") -> LogRecord:
    return LogRecord(node=node, source=Source.KERNEL, ts=T, line=line)


# -- point 2: kmsg escapes and multi-line records ----------------------------------------------------


def test_kmsg_escapes_are_decoded() -> None:
    assert decode_kmsg_escapes(r"a\x0ab\x5cc\x09d") == "a\nb\\c\td"
    assert decode_kmsg_escapes("no escapes here") == "no escapes here"
    assert record_lines(KMSG_ONE_RECORD) == list(THREE)
    assert record_lines("#012".join(THREE)) == list(THREE)  # rsyslog's control-character escape
    assert record_lines("\n".join(THREE)) == list(THREE)
    assert record_lines("one line") == ["one line"]


@pytest.mark.parametrize(
    "text",
    [KMSG_ONE_RECORD, "6,812,5000000,-;" + KMSG_ONE_RECORD, "\n".join(THREE), "#012".join(THREE),
     "Nov 22 10:00:00 gpu-1 kernel: " + "#012".join(THREE), "[ 1234.5678] " + KMSG_ONE_RECORD],
    ids=["kmsg-msg", "kmsg-record", "newlines", "rsyslog-012", "rsyslog-header", "dmesg-prefix"],
)
def test_three_line_message_in_one_record_is_one_fault(text: str) -> None:
    detector = Detector()
    events = detector.process(kernel(text)) + detector.flush()
    assert [(e.kind, e.pci, e.code, e.action) for e in events] == [
        (FaultKind.GPU_FALLEN_OFF_BUS, "0000:b3:00.0", 79, Action.REBOOT_NODE)
    ]
    assert events[0].detail["pci_id"] == "10de:2330"


SHAPES = {
    "fluentbit-kmsg": ("gpu.logs.kernel", lambda: orjson.dumps(
        {"priority": 4, "sequence": 812, "sec": 5, "usec": 0, "msg": KMSG_ONE_RECORD, "hostname": "n1",
         "@timestamp": 1_763_805_600.0})),
    "fluentbit-kmsg-array": ("gpu.logs.kernel", lambda: orjson.dumps(
        [1_763_805_600.0, {"priority": 4, "sec": 5, "msg": KMSG_ONE_RECORD, "hostname": "n1"}])),
    "plain-kmsg": ("gpu.logs.kernel", lambda: ("4,812,5000000,-;" + KMSG_ONE_RECORD).encode()),
    "journald": ("gpu.logs.kernel", lambda: orjson.dumps(
        {"MESSAGE": "\n".join(THREE), "_HOSTNAME": "n1", "_TRANSPORT": "kernel",
         "__REALTIME_TIMESTAMP": "1763805600000000"})),
    "loki-push": ("gpu.logs.kernel", lambda: orjson.dumps(
        {"streams": [{"stream": {"node": "n1", "source": "kernel"},
                      "values": [["1763805600000000000", KMSG_ONE_RECORD]]}]})),
    "logrecord": ("gpu.logs.kernel", lambda: LogRecord(node="n1", source=Source.KERNEL, ts=T,
                                                        line=KMSG_ONE_RECORD).to_bytes()),
    "json-lines": ("gpu.logs.kernel", lambda: b"\n".join(orjson.dumps(
        {"priority": 4, "sec": 5, "msg": m, "hostname": "n1"}) for m in ("noise", KMSG_ONE_RECORD))),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_multiline_record_is_detected_in_every_shipper_shape(shape: str) -> None:
    topic, build = SHAPES[shape]
    records, dead = decode_record(build(), b"n1", [], topic)
    assert dead == []
    detector = Detector()
    events = [e for r in records for e in detector.process(r)] + detector.flush()
    assert [(e.kind, e.pci) for e in events] == [(FaultKind.GPU_FALLEN_OFF_BUS, "0000:b3:00.0")], shape


def test_fluentbit_kmsg_line_is_stored_decoded() -> None:
    [record], _ = decode_record(SHAPES["fluentbit-kmsg"][1](), b"n1", [], "gpu.logs.kernel")
    assert record.line == "\n".join(THREE)


# -- point 5: every fallen-off-the-bus wording -----------------------------------------------------

@pytest.mark.parametrize(
    ("line", "pci"),
    [
        ("NVRM: GPU 0000:29:00.0: GPU has fallen off the bus.", "0000:29:00.0"),  # NV_DEV_PRINTF, current
        ("NVRM: GPU at PCI:0000:0b:00: GPU has fallen off the bus.", "0000:0b:00.0"),  # older device prefix
        ("NVRM: GPU at 0000:01:00.0 has fallen off the bus.", "0000:01:00.0"),  # older drivers (issue 11)
        ("NVRM: GPU at 0000:01:00: has fallen off the bus.", "0000:01:00.0"),
        ("NVRM: GPU 18:00.0: GPU has fallen off the bus.", "0000:18:00.0"),
        ("NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:2330) installed in this system has fallen off the bus "
         "and is not responding to commands.", "0000:b3:00.0"),  # the three lines joined by a shipper
        ("NVRM: GPU has fallen off the bus.", None),
    ],
)
def test_every_fallen_off_wording(line: str, pci: str | None) -> None:
    parsed = parse_kernel_line(line)
    assert isinstance(parsed, FallenOffBusLine) and parsed.part == 0 and parsed.pci == pci
    [(_, event)] = list(classify_lines([f"Nov 22 10:00:00 gpu-1 kernel: [ 65.3] {line}"]))
    assert (event.kind, event.code, event.action, event.quarantine) == (
        FaultKind.GPU_FALLEN_OFF_BUS, 79, Action.REBOOT_NODE, True)


def test_older_three_line_form_with_at_pci() -> None:
    lines = ["NVRM: The NVIDIA GPU at PCI:0000:01:00", THREE[1], THREE[2]]
    [(line_no, event)] = list(classify_lines(lines))
    assert (line_no, event.pci) == (1, "0000:01:00.0")


def test_unsupported_gpu_message_is_not_a_fault() -> None:
    lines = ["NVRM: The NVIDIA GPU 0000:01:00.0 (PCI ID: 10de:1234)",
             "NVRM: installed in this system is not supported by the", "NVRM: NVIDIA 550.54 driver release."]
    assert list(classify_lines(lines)) == []


# -- point 3: the line's own SXid severity -----------------------------------------------------------

def test_sxid_outside_the_tables_follows_its_printed_severity() -> None:
    base = "[73309.599396] nvidia-nvswitch0: SXid (PCI:0000:06:00.0): {code}, {sev}, Link 04 RX Short Error Rate"
    rows = {
        "Non-fatal": (Action.IGNORE, False),
        "Fatal": (Action.RESET_GPU, True),
    }
    for sev, (action, quarantine) in rows.items():
        [(_, event)] = list(classify_lines([base.format(code=20009, sev=sev)]))
        assert (event.action, event.quarantine, event.fatal) == (action, quarantine, sev == "Fatal")


def test_nonfatal_unknown_sxid_raises_nothing_on_the_node() -> None:
    [(_, event)] = list(classify_lines(
        ["nvidia-nvswitch3: SXid (PCI:0000:c1:00.0): 28006, Non-fatal, Link 46 MC TS crumbstore MCTO (First)"]))
    state = Aggregator().new_state("n1")
    _, out = Aggregator().step(state, event, now=0.0)
    assert out == []


# -- point 4: quoted kernel lines are not faults -----------------------------------------------------

QUOTED = [
    # An alerting tool's message quoting the kernel line.
    "ALERT: gpu-node-3: NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    # A monitoring agent's own log line (journald short, its own tag).
    "Nov 21 23:11:02 gpu-node-3 gpud[2211]: NVRM: Xid (PCI:0000:4e:00): 48, An uncorrectable double bit error",
    # An application log with a level word.
    "2026-09-18T08:51:12Z WARN  NVRM: Xid (PCI:0000:3b:00.0): 79, pid=2113, GPU has fallen off the bus.",
    # A shell transcript grepping for it.
    "$ dmesg | grep 'NVRM: Xid (PCI:0000:4e:00): 79'",
    # A JSON-ish structured log.
    'level=error msg="NVRM: GPU 0000:29:00.0: GPU has fallen off the bus."',
    # A chat-ops bot relaying an SXid.
    "bot: relayed from node-7: nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 28 sourcetrack",
]


@pytest.mark.parametrize("line", QUOTED)
def test_quoted_kernel_lines_are_not_faults(line: str) -> None:
    assert list(classify_lines([line])) == []


@pytest.mark.parametrize(
    "prefix",
    ["", "   ", "[538441.007373] ", "[Thu Jul  4 11:09:40 2024] ", "Nov 21 23:11:02 host kernel: ", "kernel: ",
     "6,1234,5678,-;", "kern  :err   : [ 12.3] ", "kern  :warn  : 2025-01-25T10:34:54,859532+00:00 ",
     "2024-07-04T11:09:40.123456+00:00 gpu-node-1 kernel: ", "<4>1 2024-11-21T23:11:02.123Z host kernel - - - ",
     "<4>Nov 21 23:11:02 host kernel: ", "Thu 2024-07-04 11:09:40 UTC host kernel: ",
     "1790428806.570394 ws kernel: ", "Jul 04 11:09:40.123456 host kernel: [ 1.2] [  T1234] ", "[...] "],
)
def test_kernel_prefixes_are_accepted(prefix: str) -> None:
    assert prefix_is_kernel(prefix)
    [(_, event)] = list(classify_lines([prefix + "NVRM: Xid (PCI:0000:4e:00): 79, GPU has fallen off the bus."]))
    assert event.code == 79


# -- point 7: NCCL transport errors are sympathetic --------------------------------------------------

NCCL_NET = [
    "node-1:2323:2601 [3] transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from peer 10.0.0.2<41234> "
    "with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.0.0.1 remoteGids::ffff:10.0.0.2",
    "node-1:2323:2601 [3] NCCL WARN NET/IB : Got completion with error 12, opcode 0, len 0, vendor err 129",
    "node-1:2323:2601 [3] misc/socket.cc:49 NCCL WARN socketProgressOpt: Call to recv from 10.1.2.3<56789> "
    "failed : Connection reset by peer",
    "node-1:2323:2601 [3] NCCL WARN NET/Socket : Connection closed by remote peer 10.1.2.3<56789>",
    "node-1:2323:2601 [0] NCCL WARN NET/IB : Got async event : port error",
]


@pytest.mark.parametrize("line", NCCL_NET)
def test_nccl_transport_errors_are_sympathetic(line: str) -> None:
    signal = match_pod_signal(line)
    assert signal is not None and signal.grade is SignalGrade.SYMPATHETIC


def test_a_web_server_connection_reset_is_not_an_nccl_signal() -> None:
    assert match_pod_signal("nginx: recv() failed (104: Connection reset by peer) while reading") is None


def test_nccl_transport_errors_corroborate_and_never_open_alone() -> None:
    agg = Aggregator()
    detector = Detector()
    pod = LogRecord(node="n1", source=Source.POD, ts=T, line=NCCL_NET[0], pod="trainer-0", namespace="ml")
    [nccl] = detector.process(pod)
    state = agg.new_state("n1")
    state, out = agg.step(state, nccl, now=0.0)
    assert out == []  # alone: nothing
    [xid] = detector.process(kernel("NVRM: Xid (PCI:0000:4e:00): 79, GPU has fallen off the bus."))
    state, out = agg.step(state, xid, now=1.0)
    [incident] = out
    assert nccl.id in incident.evidence_ids and incident.code == 79


@pytest.mark.parametrize(
    "prefix",
    ["6,1234,5678,-,caller=T12;", "/var/log/kern.log:Nov 21 23:11:02 host kernel: ",
     "syslog.1:1234:Nov 21 23:11:02 host kernel: [ 1.2] ", "kern.log:[ 12.3] ", "[  +0.000004] ", "[Nov22 10:00] "],
)
def test_kmsg_caller_ids_and_grep_file_prefixes_are_kernel_lines(prefix: str) -> None:
    [(_, event)] = list(classify_lines([prefix + "NVRM: Xid (PCI:0000:4e:00): 48, An uncorrectable double bit error"]))
    assert event.code == 48


def test_grep_output_of_another_program_is_still_not_kernel() -> None:
    line = "messages:Nov 21 23:11:02 host gpud[1]: NVRM: Xid (PCI:0000:4e:00): 48, An uncorrectable double bit error"
    assert list(classify_lines([line])) == []


def test_the_node_side_fluent_bit_filter_keeps_every_new_form() -> None:
    """What these parsers now recognise must survive the chart's Fluent Bit grep before it ships."""
    import re
    from pathlib import Path

    import yaml

    config = yaml.safe_load((Path(__file__).resolve().parents[2] / "deploy/fluent-bit/fluent-bit.yaml").read_text())
    regexes = {f["match"]: f["regex"].partition(" ")[2] for f in config["pipeline"]["filters"] if f["name"] == "grep"}
    kernel_re, pod_re = (re.compile(regexes[m]) for m in ("kernel*", "kube.*"))
    corpus = Path(__file__).resolve().parents[2] / "tests/corpus"
    pod_lines = [line for case in yaml.safe_load((corpus / "pod_corpus.yaml").read_text())["cases"]
                 for line in case["lines"]]
    kernel_lines = [line for case in yaml.safe_load((corpus / "kernel_corpus.yaml").read_text())["cases"]
                    for line in case["lines"]]
    for line in [*NCCL_NET, *pod_lines]:
        if match_pod_signal(line) is not None:
            assert pod_re.search(line), line
    for line in [*kernel_lines, *THREE, KMSG_ONE_RECORD, *QUOTED]:
        if parse_kernel_line(line) is not None:
            assert kernel_re.search(line), line


def test_a_userspace_journal_entry_quoting_the_kernel_is_not_a_fault() -> None:
    quoted = {"MESSAGE": "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
              "_HOSTNAME": "n1", "_TRANSPORT": "stdout", "SYSLOG_IDENTIFIER": "gpu-alerter",
              "__REALTIME_TIMESTAMP": "1763805600000000"}
    [record], _ = decode_record(orjson.dumps(quoted), b"n1", [], "gpu.logs.kernel")
    assert Detector().process(record) == []
    own = {**quoted, "_TRANSPORT": "kernel", "SYSLOG_IDENTIFIER": "kernel"}
    [record], _ = decode_record(orjson.dumps(own), b"n1", [], "gpu.logs.kernel")
    assert [e.code for e in Detector().process(record)] == [79]
