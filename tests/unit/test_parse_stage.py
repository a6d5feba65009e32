"""The pure part of the parse stage: raw Kafka records -> fault events / dead letters."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import orjson
import yaml
from aiokafka.structs import ConsumerRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.detection.detector import prefilter
from pipeline.detection.parse_core import ParseCore
from pipeline.detection.parse_settings import ParseSettings
from pipeline.runtime.settings import TopicNames
from schemas.records import DeadLetterCode, FaultKind, HealthCheckResult

TOPICS = TopicNames()
KERNEL = TOPICS.name("logs_kernel")
HEALTH = TOPICS.name("health_checks")
XID79 = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


@dataclass
class Rec:
    value: bytes | None
    key: bytes | None = b"node-a"
    topic: str = KERNEL
    partition: int = 0
    offset: int = 0
    headers: list = field(default_factory=list)
    timestamp: int = 1_735_689_600_000


def kmsg(line: str, node: str = "node-a") -> bytes:
    return orjson.dumps({"priority": 4, "sec": 1, "usec": 0, "msg": line, "hostname": node})


def test_noise_is_skipped_without_decoding_and_faults_become_events() -> None:
    core = ParseCore(TOPICS, ParseSettings(shape_check_every=0))
    records = [Rec(kmsg(f"eth0: link up {i}"), offset=i) for i in range(100)] + [Rec(kmsg(XID79), offset=100)]
    result = core.process(records)
    assert (result.records, result.noise, result.decoded) == (101, 100, 1)
    assert [(e.kind, e.code, e.pci, e.node) for e in result.events] == [(FaultKind.XID, 79, "0000:4e:00.0", "node-a")]
    assert result.dead_letters == []


def test_malformed_candidates_and_sampled_noise_are_dead_lettered_with_a_reason() -> None:
    core = ParseCore(TOPICS, ParseSettings(shape_check_every=2))
    records = [
        Rec(b'{"msg": "NVRM: Xid (PCI:0000:4e:00): 79"', offset=1),  # truncated JSON naming a fault
        Rec(b"", offset=2),
        Rec(None, offset=3),
        Rec(b'{"unknown": "shape"}', offset=4),  # noise, not sampled
        Rec(b'{"another": "shape"}', offset=5),  # noise, sampled (every 2nd)
    ]
    result = core.process(records)
    reasons = [d.reason for d in result.dead_letters]
    assert len(reasons) == 4, reasons
    assert "invalid JSON" in reasons[0] and "offset 1" in reasons[0]
    assert all(d.topic == KERNEL for d in result.dead_letters)


def test_unicode_escaped_json_is_never_taken_for_noise() -> None:
    core = ParseCore(TOPICS, ParseSettings(shape_check_every=0))
    escaped = orjson.dumps({"msg": XID79.replace("<", "\\u003c"), "priority": 4}).replace(b"\\\\u003c", b"\\u003c")
    result = core.process([Rec(escaped)])
    assert result.noise == 0 and [e.code for e in result.events] == [79]


def test_a_marker_spelled_with_a_json_escape_is_decoded_and_other_escapes_stay_noise() -> None:
    """``\\/`` is JSON for ``/`` (some encoders write it): ``NET\\/`` hides the ``NET/`` anchor."""
    values = [
        b'{"log": "transport NET\\/Socket : peer closed", "kubernetes": {"host": "node-a"}}',
        b'{"msg": "mounted \\/var\\/lib with \\"quotes\\"", "priority": 6}',
        b'{"msg": "nothing here", "priority": 6}',
    ]
    for use_automaton in (True, False):
        core = ParseCore(TOPICS, ParseSettings(shape_check_every=0), use_automaton=use_automaton)
        assert core.candidates(values) == [0], use_automaton
    assert prefilter(orjson.loads(values[0])["log"])


def test_health_checks_pass_through_as_events_and_bad_ones_are_dead_letters() -> None:
    core = ParseCore(TOPICS)
    ts = datetime(2025, 1, 1, tzinfo=UTC)
    ok = HealthCheckResult(node="node-a", check="gpu_count", passed=True, boot_id="b1", ts=ts)
    bad = HealthCheckResult(node="node-a", check="ecc", passed=False, boot_id="b1", ts=ts, message="uncorrectable")
    result = core.process(
        [
            Rec(ok.to_bytes(), topic=HEALTH),
            Rec(bad.to_bytes(), topic=HEALTH, offset=1),
            Rec(b"not json", topic=HEALTH, offset=2),
        ]
    )
    assert [(e.kind, e.detail.get("check"), e.detail.get("passed")) for e in result.events] == [
        (FaultKind.HEALTH_CHECK, "gpu_count", True),
        (FaultKind.HEALTH_CHECK, "ecc", None),
    ]
    assert result.events[1].action.quarantines
    assert len(result.dead_letters) == 1 and "HealthCheckResult" in result.dead_letters[0].reason


def test_partial_multiline_message_holds_the_commit_until_flushed() -> None:
    core = ParseCore(TOPICS, ParseSettings(multiline_timeout_s=5))
    first = Rec(kmsg("NVRM: The NVIDIA GPU 0000:4e:00.0"), offset=7)
    result = core.process([first], now=0.0)
    assert result.events == [] and core.held_offsets() == {(KERNEL, 0): 7}
    lines = [
        "NVRM: (PCI ID: 10de:2330) installed in this system has",
        "NVRM: fallen off the bus and is not responding to commands.",
    ]
    result = core.process([Rec(kmsg(line), offset=8 + i) for i, line in enumerate(lines)], now=1.0)
    assert [e.kind for e in result.events] == [FaultKind.GPU_FALLEN_OFF_BUS]
    assert core.held_offsets() == {}


def test_parse_errors_never_escape() -> None:
    def broken(*args, **kwargs):  # an adapter bug must not kill the worker
        raise RuntimeError("boom")

    core = ParseCore(TOPICS, decode_record=broken)
    result = core.process([Rec(kmsg(XID79))])
    assert len(result.dead_letters) == 1 and "boom" in result.dead_letters[0].reason


_fragments = st.sampled_from(
    [
        "NVRM: ",
        "NVRM:",
        "SXid (",
        "libnccl",
        "error",
        "RROR",
        "ailure",
        "ssert",
        "misaligned",
        "ordinal",
        "Watchdog",
        "remote process",
        "NET/",
        "NET\\/",
        "eth0 up",
        " ",
        "\\u003c",
        "Xid",
        "\x00",
        "é",
    ]
)


@settings(max_examples=300)
@given(st.lists(st.lists(_fragments, max_size=6).map("".join), min_size=1, max_size=30))
def test_gate_keeps_every_payload_the_prefilter_could_pass(lines: list[str]) -> None:
    """The batch gate must never call noise what ``prefilter`` would let through (both matchers)."""
    values = [line.encode() for line in lines]
    for use_automaton in (True, False):
        core = ParseCore(TOPICS, ParseSettings(shape_check_every=0), use_automaton=use_automaton)
        wanted = set(core.candidates(values))
        for i, line in enumerate(lines):
            if prefilter(line):
                assert i in wanted, (use_automaton, line)
            if "\\u" in line:
                assert i in wanted
        # Over-selection only where a JSON decoder could still reveal a marker: a \\u escape, "NET\\/".
        assert wanted <= {
            i for i, line in enumerate(lines) if prefilter(line) or "\\u" in line or "NET\\/" in line or not line
        }


# -- what one record may become (issue 16) ---------------------------------------------------------


def test_an_oversized_fault_line_is_cut_with_a_marker_and_dead_lettered_once() -> None:
    core = ParseCore(TOPICS, ParseSettings(shape_check_every=0, max_line_chars=1000))
    result = core.process([Rec(kmsg(XID79 + " " + "x" * 600_000), offset=7)])
    [event] = result.events
    assert event.code == 79 and event.line.endswith("characters truncated]") and len(event.line) < 1100
    assert len(event.to_bytes()) < 10_000
    [letter] = result.dead_letters
    assert letter.code == DeadLetterCode.TRUNCATED and letter.offset == 7 and letter.payload_truncated
    assert len(letter.to_bytes()) < 200_000


def test_one_record_yields_at_most_the_configured_dead_letters() -> None:
    core = ParseCore(TOPICS, ParseSettings(shape_check_every=0, max_dead_letters_per_record=5,
                                           max_lines_per_record=2000))
    value = b"\n".join(b'{"no": "NVRM: line %d"}' % i for i in range(1000)) + b"\n{broken"
    result = core.process([Rec(value)])
    assert len(result.dead_letters) == 5
    summary = result.dead_letters[-1]
    assert summary.code == DeadLetterCode.MORE_PROBLEMS
    assert "997 more problems" in summary.reason and "invalid_json" in summary.reason


def test_every_adapter_dead_letter_has_a_code_from_the_closed_set() -> None:
    core = ParseCore(TOPICS, ParseSettings(shape_check_every=1))
    values = [b"", None, b'{"x": 1', b"[1, 2, 3]", b'{"streams": 5}', b'{"msg": 5, "priority": 1}',
              b'{"a":' * 2000 + b"1" + b"}" * 2000, b"\xff\xfe NVRM: garbage"]
    result = core.process([Rec(v, key=None, offset=i) for i, v in enumerate(values)])
    assert len(result.dead_letters) == len(values)
    assert all(d.code != DeadLetterCode.OTHER for d in result.dead_letters), [
        (d.code, d.reason) for d in result.dead_letters
    ]


@settings(max_examples=200)
@given(st.binary(max_size=3000), st.integers(0, 30))
def test_no_input_yields_unbounded_outputs(noise: bytes, depth: int) -> None:
    core = ParseCore(TOPICS, ParseSettings(shape_check_every=1, max_line_chars=512, max_dead_letters_per_record=3))
    value = b"[" * depth + b"NVRM: " + noise + XID79.encode() + noise * 20
    result = core.process([Rec(value, key=None), Rec(value)])
    assert len(result.dead_letters) <= 6
    assert all(len(e.to_bytes()) < 8 * 1024 for e in result.events)


# -- one record's lines, one node's bytes in a batch (issue 37 part 2) -------------------------------------------
def test_a_record_of_100000_lines_is_parsed_up_to_its_limit_and_dead_lettered_once() -> None:
    core = ParseCore(TOPICS, ParseSettings(shape_check_every=0, max_lines_per_record=1000))
    early = XID79.replace("4e:00", "01:00")
    late = XID79.replace("4e:00", "02:00")
    plain = "\n".join([early] + ["NVRM: x"] * 50_000 + [late] + ["NVRM: x"] * 49_998).encode()
    as_json = kmsg("\n".join([early] + ["NVRM: x"] * 50_000 + [late] + ["NVRM: x"] * 49_998))
    for value in (plain, as_json):
        result = core.process([Rec(value, offset=3)])
        # The fault in the first lines is seen; the one past the limit is not, and the record says so once.
        assert [e.pci for e in result.events] == ["0000:01:00.0"], value[:20]
        [letter] = result.dead_letters
        assert letter.code == DeadLetterCode.TOO_MANY_LINES and letter.offset == 3 and letter.key == "node-a"
        assert letter.reason.startswith("100000 lines in one record, past the limit of 1000")
        assert "XIDFLOW_PARSE_MAX_LINES_PER_RECORD" in letter.reason and letter.payload_truncated
        core.reset()


def test_one_nodes_flood_costs_that_nodes_lines_and_not_the_others_faults() -> None:
    core = ParseCore(TOPICS, ParseSettings(shape_check_every=0, max_key_bytes_per_batch=4096))
    flood = [Rec(kmsg(XID79 + " " + "x" * 900, node="noisy"), key=b"noisy", offset=i) for i in range(100)]
    good = [Rec(kmsg(XID79, node=f"good-{i}"), key=f"good-{i}".encode(), offset=100 + i) for i in range(3)]
    result = core.process(flood[:50] + good[:1] + flood[50:] + good[1:])
    assert sorted(e.node for e in result.events if e.node.startswith("good")) == ["good-0", "good-1", "good-2"]
    parsed = [e for e in result.events if e.node == "noisy"]
    assert 1 <= len(parsed) <= 5  # ~1 KB records in a 4 KiB budget
    [letter] = result.dead_letters
    assert letter.code == DeadLetterCode.NODE_OVER_BUDGET and letter.key == "noisy"
    skipped = 100 - len(parsed)
    assert letter.reason.startswith(f"node noisy: {skipped} records (")
    assert f"offsets {len(parsed)} to 99 of {KERNEL}[0]" in letter.reason
    assert "XIDFLOW_PARSE_MAX_KEY_BYTES_PER_BATCH" in letter.reason and letter.offset == len(parsed)
    # The next batch is a new budget: the node's faults are parsed again.
    assert core.process([Rec(kmsg(XID79, node="noisy"), key=b"noisy", offset=200)]).events


def test_a_large_record_is_not_scanned_but_decoded_within_the_bounds() -> None:
    core = ParseCore(TOPICS, ParseSettings(shape_check_every=0, max_lines_per_record=100))
    noise = "\n".join(["eth0: link up"] * 10_000).encode()  # 140 KB of noise, over the scan's 64 KiB
    result = core.process([Rec(noise)])
    assert result.decoded == 1 and result.noise == 0 and not result.events
    [letter] = result.dead_letters
    assert letter.code == DeadLetterCode.TOO_MANY_LINES


def test_detector_state_is_kept_for_at_most_max_nodes() -> None:
    core = ParseCore(TOPICS, ParseSettings(shape_check_every=0, max_nodes=50, multiline_timeout_s=0.001))
    records = [Rec(kmsg(XID79, node=f"made-up-{i}"), key=f"made-up-{i}".encode(), offset=i) for i in range(500)]
    result = core.process(records)
    assert len(result.events) == 500
    assert len(core._nodes) <= 51 and len(core.detector._nodes) <= 51  # type: ignore[attr-defined]


# -- the gate's value sizes from the consumer (issue 22 part 6) ------------------------------------


def _mixed_corpus() -> list[tuple[bytes | None, bytes | None, str]]:
    """(value, key, topic): every documented input shape, faults and look-alikes, noise and malformed input."""
    corpus = Path(__file__).resolve().parents[1] / "corpus"
    kernel = [line for case in yaml.safe_load((corpus / "kernel_corpus.yaml").read_text())["cases"]
              for line in case["lines"]]
    pod = [line for case in yaml.safe_load((corpus / "pod_corpus.yaml").read_text())["cases"] for line in case["lines"]]
    pods = TOPICS.name("logs_pods")
    out: list[tuple[bytes | None, bytes | None, str]] = []
    for i, line in enumerate(kernel):
        node = f"node-{i % 5}"
        out.append((kmsg(line, node=node), node.encode(), KERNEL))  # Fluent Bit kmsg
        out.append((line.encode(), node.encode(), KERNEL))  # plain text, node from the key
        out.append((kmsg(f"eth{i}: link becomes ready"), None, KERNEL))  # noise
    for i, line in enumerate(pod):
        body = {"log": line + "\n", "stream": "stderr", "time": "2024-06-04T10:09:40.123456789Z",
                "kubernetes": {"pod_name": f"trainer-{i}", "namespace_name": "ml", "host": f"node-{i % 3}",
                               "container_name": "pytorch"}}
        out.append((orjson.dumps(body), None, pods))  # Fluent Bit tail + kubernetes filter
    loki = {"streams": [{"stream": {"node": "n7", "job": "kmsg"},
                         "values": [["1717495780000000001", kernel[0]], ["1717495781000000000", "second"]]},
                        {"stream": {"node": "n8", "pod": "p", "namespace": "ns", "container": "c"},
                         "values": [["1717495782000000000", pod[0]]]}]}
    out.append((orjson.dumps(loki), None, "loki.raw"))
    out.append((b'{"msg": "NVRM: Xid (PCI:0000:4e:00): \\u0037\\u0039, GPU has fallen off the bus.", "hostname": "u"}',
                None, KERNEL))  # a marker behind JSON escapes
    for bad in (b"", None, b'{"x": 1', b"[1, 2, 3]", b'{"streams": 5}', b"\xff\xfe NVRM: garbage",
                kmsg(XID79 + " " + "x" * (1 << 20)), kmsg(XID79 + " \x00 tail")):
        out.append((bad, b"node-bad", KERNEL))
    return out


_WALL_CLOCK = re.compile(rb'"(ingested_at|received_at)":"[^"]*"')
"""The fields that say when a record was made (the wall clock), not what it says."""


def _outputs(core: ParseCore, batches: list[list]) -> list[bytes | int]:
    out: list[bytes | int] = []
    for batch in batches:
        result = core.process(batch, now=0.0)
        out += [_WALL_CLOCK.sub(b"", o.to_bytes()) for o in (*result.events, *result.dead_letters)]
        out += [result.records, result.noise, result.decoded]
    return out


def test_consumer_sizes_give_byte_identical_outputs() -> None:
    """Values sized by the consumer (aiokafka's ``serialized_value_size``), sized wrongly, or counted by the
    gate: the same fault events, dead letters and noise counts, byte for byte, over every input shape."""
    corpus = _mixed_corpus()
    rng = random.Random(3)
    rng.shuffle(corpus)

    def consumer_record(i: int, value: bytes | None, key: bytes | None, topic: str, skew: int = 0) -> ConsumerRecord:
        size = -1 if value is None else len(value) + skew
        return ConsumerRecord(topic, 0, i, 1_735_689_600_000, 0, key, value, None, -1 if key is None else len(key),
                              size, [])

    def batches(make) -> list[list]:  # noqa: ANN001
        records = [make(i, *item) for i, item in enumerate(corpus)]
        return [records[i:i + 37] for i in range(0, len(records), 37)]

    settings_ = ParseSettings(shape_check_every=5, multiline_timeout_s=1000)
    counted = _outputs(ParseCore(TOPICS, settings_), batches(lambda i, v, k, t: Rec(v, key=k, topic=t, offset=i)))
    sized = _outputs(ParseCore(TOPICS, settings_), batches(consumer_record))
    skewed = _outputs(ParseCore(TOPICS, settings_),
                      batches(lambda i, v, k, t: consumer_record(i, v, k, t, skew=1 if i % 11 == 0 else 0)))
    events = [o for o in counted if isinstance(o, bytes) and b'"kind"' in o]
    assert len(events) > 40 and any(b'"code":79' in e for e in events)  # the corpus does reach the detector
    assert sized == counted
    assert skewed == counted


def test_sizes_that_do_not_add_up_are_not_trusted() -> None:
    core = ParseCore(TOPICS, ParseSettings(shape_check_every=0))
    values = [kmsg("eth0 up"), kmsg(XID79), kmsg("eth1 up")]
    true = [len(v) for v in values]
    assert core.candidates(values) == [1]
    assert core.candidates(values, true) == [1]
    # One size off by the next record's length: positions would map the match to record 0.
    assert core.candidates(values, [true[0] + true[1], 1, true[2]]) == [1]
    assert core.candidates(values, [-1, *true[1:]]) == [1]
    assert core.candidates([None, *values], [-1, *true]) == [0, 2]
