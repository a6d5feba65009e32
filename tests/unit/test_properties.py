"""Property tests: no input makes detection raise, and every event round-trips through its schema."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.detection.detector import Detector, classify_lines, prefilter
from pipeline.ingest.parsing import XidLine, match_pod_signal, normalize_pci, parse_kernel_line
from schemas.records import FaultEvent, LogRecord

T0 = datetime(2025, 1, 1, tzinfo=UTC)
FAST = settings(max_examples=150)

# Fragments of real fault lines, so that random combinations reach deep into the parsers.
FRAGMENTS = [
    "NVRM: ", "Xid (", "PCI:", "0000:4e:00", "0000:c3:00.0", "): ", "79", "154", "149", "13", "74", ", ",
    "pid=", "'<unknown>'", "name=", "<unknown>", "GPU has fallen off the bus.", "The NVIDIA GPU ",
    "(PCI ID: 10de:26b5) ", "installed in this system has", "fallen off the bus and is not responding",
    "GPU at PCI:", "GPU-bc0fa0b9-cac2-f507-b715-9bebdb69c71e", "nvidia-nvswitch0: ", "SXid (", "24007",
    "Fatal", "Non-fatal", "Nonfatal", "Link ", "-1", "(0x021425c6 0x0", "Severity 0", "Data {", "\n",
    "segfault at 7f ", "in libnccl.so.2[", "(GPC 1, TPC 2, SM 3)", "from 0x0 (None) to 0x", "ffffffff",
    "\"", "[12.5] ", "kernel: ", "\x00", "\ufffd", "CUDA error: ", "uncorrectable ECC error encountered",
    "NCCL error", "Watchdog caught collective operation timeout",
    # Prefixes of the operating systems fleets run (Talos, journalctl -o short-*, RFC 5424) and NCCL verbs.
    "talos-1: ", "kern: ", "warning: ", "[2026-04-22T21:25:20.505406921Z]: ", "<4>1 ", "2024-07-04T11:09:40+0000 ",
    "host kernel - - ", "[x@1 a=\"b\"] ", "Jul 04 11:09:40.123456 ", "NCCL WARN Call to ibv_", "create_cq failed",
    # MIG instances, dmesg -x, Fabric Manager's reports and the CUDA errors of a job whose GPU is gone (issue 36).
    " GPU-I:05", " GPU-CI:02", "syslog:err   : ", "user  :warn  : ", "detected NVSwitch ", "non-fatal error ",
    "fatal error ", " on fid 0", " on NVSwitch pci bus id ", "00000000:86:00.0", " physical id 3", " port 61",
    "[ERROR] [tid 841] ", "nv-fabricmanager[5183]: ", "Cuda failure 999 'unknown error'", "error=30 : unknown error",
    "all CUDA-capable devices are busy or unavailable",
]
fault_like = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=8), max_size=25).map("".join)
any_text = st.text(max_size=400) | fault_like | st.binary(max_size=300).map(lambda b: b.decode("utf-8", "replace"))


def _roundtrip(events: list[FaultEvent]) -> None:
    for event in events:
        assert FaultEvent.from_bytes(event.to_bytes()) == event
        assert orjson.loads(event.to_bytes())["id"] == event.id


@FAST
@given(lines=st.lists(any_text, max_size=12), source=st.sampled_from(["kernel", "pod", "probe"]))
def test_detector_never_raises_and_events_roundtrip(lines: list[str], source: str) -> None:
    detector = Detector()
    events: list[FaultEvent] = []
    for line in lines:
        events += detector.process(LogRecord(node="n", source=source, ts=T0, line=line))
        prefilter(line)
        parse_kernel_line(line)
        match_pod_signal(line)
        normalize_pci(line)
    events += detector.flush()
    _roundtrip(events)


@FAST
@given(raw=st.binary(max_size=2000))
def test_invalid_utf8_through_classify_lines(raw: bytes) -> None:
    text = raw.decode("utf-8", "replace")
    for source in ("kernel", "pod"):
        _roundtrip([event for _, event in classify_lines(text.splitlines(), source=source)])


@settings(max_examples=5)
@given(filler=st.sampled_from(["a", "NVRM: ", "SXid (", "(", "0x0 ", "\"", "rror "]))
def test_one_megabyte_lines(filler: str) -> None:
    line = filler * (1_000_000 // len(filler))
    tail = line + "NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus."
    detector = Detector()
    for source in ("kernel", "pod", "probe"):
        for text in (line, tail):
            _roundtrip(detector.process(LogRecord(node="n", source=source, ts=T0, line=text)))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=15,
)
health_like = st.fixed_dictionaries(
    {"node": st.text(max_size=5), "check": st.text(max_size=12) | st.integers(), "passed": st.booleans() | st.text()},
    optional={"severity": st.text(max_size=8), "pci": st.text(max_size=15) | st.integers(),
              "values": json_values, "gpu_index": json_values, "ts": st.text(max_size=30)},
)


@FAST
@given(payload=json_values | health_like)
def test_probe_json_of_the_wrong_shape(payload: object) -> None:
    # The stdlib encoder also writes integers beyond 64 bits, which orjson refuses to read.
    line = json.dumps(payload)
    _roundtrip(Detector().process(LogRecord(node="n", source="probe", ts=T0, line=line)))


# -- Talos's kernel log form: "[<node>: ]<facility>: <priority, right-aligned to 7>: [<RFC 3339 time>]: <text>" --

XID62 = "NVRM: Xid (PCI:0000:48:00): 62, pid='<unknown>', name=<unknown>, 0000(0000) 00000000 00000000"
_LEVELS = ["emerg", "alert", "crit", "err", "warning", "notice", "info", "debug"]
_host = st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z0-9-]{1,10}){0,3}", fullmatch=True)
_ipv4 = st.tuples(*[st.integers(0, 255)] * 4).map(lambda t: ".".join(map(str, t)))
_ipv6 = st.lists(st.integers(0, 0xFFFF).map(lambda n: f"{n:x}"), min_size=2, max_size=8).map(":".join)
_node = st.none() | _host | _ipv4 | _ipv6 | _ipv6.map(lambda a: a.replace(":0:", "::", 1))
_stamp = st.tuples(
    st.datetimes(min_value=datetime(2001, 1, 1), max_value=datetime(2099, 1, 1)), st.integers(0, 999_999_999)
).map(lambda t: t[0].strftime("%Y-%m-%dT%H:%M:%S") + _nano_fraction(t[1]) + "Z")


def _nano_fraction(nanos: int) -> str:
    """Go's time.RFC3339Nano drops trailing zeros, and the dot when nothing is left."""
    digits = f"{nanos:09d}".rstrip("0")
    return f".{digits}" if digits else ""


def _talos(node: str | None, facility: str, level: str, stamp: str) -> str:
    return (f"{node}: " if node else "") + f"{facility}: {level:>7}: [{stamp}]: "


@FAST
@given(node=_node, level=st.sampled_from(_LEVELS), stamp=_stamp)
def test_every_talos_kernel_prefix_is_the_kernel(node: str | None, level: str, stamp: str) -> None:
    parsed = parse_kernel_line(_talos(node, "kern", level, stamp) + XID62)
    assert isinstance(parsed, XidLine) and (parsed.code, parsed.pci) == (62, "0000:48:00.0")


@FAST
@given(node=_node, level=st.sampled_from(_LEVELS), stamp=_stamp,
       facility=st.sampled_from(["user", "mail", "daemon", "auth", "syslog", "lpr", "local0", "local7"]))
def test_no_other_talos_facility_is_the_kernel(node: str | None, level: str, stamp: str, facility: str) -> None:
    assert parse_kernel_line(_talos(node, facility, level, stamp) + XID62) is None
