"""Kernel lines as the operating systems GPU fleets run write them (issue 21, deliverable 6), end to end
through the pure parse stage: the batch marker gate lets them in, the adapter takes the wall-clock time the
prefix carries (as it already did for syslog headers) and the event is the one the catalog gives.

Formats: Talos machined's ``"%s: %7s: [%s]: %s"`` (facility, priority, RFC 3339 time, text) with talosctl's
``"<node>: "`` in front; systemd ``logs-show.c`` for ``journalctl -o short-*``; rsyslog's RFC 3339 and RFC 5424
templates. NCCL's ``WARN Call to ibv_* failed`` on the pod topic is sympathetic only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest

from pipeline.detection.detector import Detector
from pipeline.detection.parse_core import ParseCore
from pipeline.detection.parse_settings import ParseSettings
from pipeline.ingest.adapters import decode_record
from pipeline.runtime.settings import TopicNames
from schemas.records import Action, FaultKind, SignalGrade

TOPICS = TopicNames()
KERNEL = TOPICS.name("logs_kernel")
PODS = TOPICS.name("logs_pods")
KAFKA_MS = 1_735_689_600_000  # 2025-01-01: the Kafka timestamp, used when the line carries no wall-clock time
KAFKA_TIME = datetime.fromtimestamp(KAFKA_MS / 1000, UTC)
XID62 = "NVRM: Xid (PCI:0000:48:00): 62, pid='<unknown>', name=<unknown>, 0000(0000) 00000000 00000000"


@dataclass
class Rec:
    value: bytes
    key: bytes | None = b"gpu-node-17"
    topic: str = KERNEL
    partition: int = 0
    offset: int = 0
    headers: list = field(default_factory=list)
    timestamp: int = KAFKA_MS


# (prefix, the event time it carries; None: no wall-clock time in it, Kafka's is used)
PREFIXES = [
    ("gpu-node-17: kern: warning: [2026-04-22T21:25:20.505406921Z]: ",
     datetime(2026, 4, 22, 21, 25, 20, 505406, tzinfo=UTC)),
    ("kern:    crit: [2026-04-22T21:25:20Z]: ", datetime(2026, 4, 22, 21, 25, 20, tzinfo=UTC)),
    ("2024-07-04T13:09:40+0200 gpu-node-17 kernel: ", datetime(2024, 7, 4, 11, 9, 40, tzinfo=UTC)),
    ("2024-07-04T11:09:40.123456+00:00 gpu-node-17 kernel: ", datetime(2024, 7, 4, 11, 9, 40, 123456, tzinfo=UTC)),
    # No year in it: the Kafka time's, or the year before when that date would lie ahead of it.
    ("Dec 30 11:09:40.123456 gpu-node-17 kernel: ", datetime(2024, 12, 30, 11, 9, 40, 123456, tzinfo=UTC)),
    ("Thu 2024-07-04 11:09:40 UTC gpu-node-17 kernel: ", datetime(2024, 7, 4, 11, 9, 40, tzinfo=UTC)),
    ("<4>1 2024-07-04T11:09:40.123Z gpu-node-17 kernel - - - ", datetime(2024, 7, 4, 11, 9, 40, 123000, tzinfo=UTC)),
    ('<4>1 2024-07-04T11:09:40Z gpu-node-17 kernel - - [timeQuality tzKnown="1"] ',
     datetime(2024, 7, 4, 11, 9, 40, tzinfo=UTC)),
    # No wall-clock time (monotonic), or a named zone other than UTC (ambiguous): Kafka's time.
    ("[538441.007373] gpu-node-17 kernel: ", None),
    ("Thu 2024-07-04 11:09:40 CEST gpu-node-17 kernel: ", None),
]


@pytest.mark.parametrize(("prefix", "ts"), PREFIXES, ids=[p for p, _ in PREFIXES])
def test_gate_passes_and_the_prefix_time_is_the_event_time(prefix: str, ts: datetime | None) -> None:
    noise = [Rec(f"{prefix}eth0: link up {i}".encode(), offset=i) for i in range(20)]
    core = ParseCore(TOPICS, ParseSettings(shape_check_every=0))
    result = core.process([*noise, Rec((prefix + XID62).encode(), offset=20)])
    assert (result.noise, result.decoded, result.dead_letters) == (20, 1, [])
    [event] = result.events
    assert (event.kind, event.code, event.pci, event.action) == (FaultKind.XID, 62, "0000:48:00.0", Action.RESET_GPU)
    assert event.node == "gpu-node-17"
    assert event.ts == (ts or KAFKA_TIME)


def test_talos_node_prefix_never_names_the_node() -> None:
    """talosctl prints the node as it was addressed (often an IP): the Kafka key or header names the node."""
    line = f"172.20.1.2: kern: warning: [2026-04-22T21:25:20Z]: {XID62}".encode()
    [record], dead = decode_record(line, b"gpu-node-17", None, KERNEL)
    assert (record.node, record.shipper, record.line, dead) == ("gpu-node-17", "talos", XID62, [])
    records, [letter] = decode_record(line, None, None, KERNEL)
    assert records == [] and "no node" in letter.reason


@pytest.mark.parametrize(
    "line",
    [
        # Another facility writing to /dev/kmsg on Talos, another program's syslog tag, RFC 5424 APP-NAME.
        f"gpu-node-17: user: warning: [2026-04-22T21:25:20Z]: {XID62}",
        f"Nov 22 10:15:30 gpu-node-17 gpu-alerter[812]: {XID62}",
        f"2024-07-04T11:09:40+0000 gpu-node-17 gpu-alerter: {XID62}",
        f"<11>1 2024-07-04T11:09:40Z gpu-node-17 gpu-alerter 812 - - {XID62}",
    ],
)
def test_a_program_quoting_the_kernel_in_a_shipped_header_is_not_a_fault(line: str) -> None:
    [record], dead = decode_record(line.encode(), b"gpu-node-17", None, KERNEL)
    assert dead == [] and record.line.endswith(XID62) and record.line != XID62
    assert Detector().process(record) == []


@pytest.mark.parametrize(
    "line",
    [
        "spark01:2683:2826 [0] misc/ibvwrap.cc:268 NCCL WARN Call to ibv_create_cq failed",
        "misc/ibvwrap.cc:187 NCCL WARN Call to ibv_modify_qp failed with error Network is unreachable",
        "gpu-7:2211:2390 [5] NCCL WARN Call to ibv_poll_cq() returned -1",
    ],
)
def test_nccl_verbs_failures_pass_the_gate_and_are_sympathetic(line: str) -> None:
    core = ParseCore(TOPICS, ParseSettings(shape_check_every=0))
    result = core.process([Rec(line.encode(), topic=PODS)])
    [event] = result.events
    assert (event.kind, event.grade, event.name) == (FaultKind.POD_ERROR, SignalGrade.SYMPATHETIC,
                                                     "nccl_ibv_call_failed")
    assert event.action is Action.IGNORE
