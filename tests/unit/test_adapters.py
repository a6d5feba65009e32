"""Input adapters: every shipper shape -> LogRecords, everything else -> DeadLetters with a reason."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.ingest.adapters import decode_record
from pipeline.ingest.record_fields import parse_timestamp, source_for_topic
from schemas.records import DeadLetter, LogRecord, Source

XID = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
KERNEL_TOPIC = "gpu.logs.kernel"
POD_TOPIC = "gpu.logs.pods"


def one(value: bytes | None, key: bytes | None = None, headers=None, topic: str = KERNEL_TOPIC, **kw) -> LogRecord:
    records, dead = decode_record(value, key, headers, topic, **kw)
    assert dead == [], [d.reason for d in dead]
    assert len(records) == 1
    return records[0]


def rejected(value: bytes | None, key: bytes | None = None, headers=None, topic: str = KERNEL_TOPIC) -> str:
    records, dead = decode_record(value, key, headers, topic)
    assert records == []
    assert len(dead) == 1
    assert dead[0].stage == "adapter"
    assert dead[0].topic == topic
    return dead[0].reason


# -- Fluent Bit kmsg ---------------------------------------------------------------------------------


def test_kmsg_record_with_hostname_and_kafka_output_timestamp() -> None:
    body = {
        "priority": 3,
        "sequence": 1814,
        "sec": 11706,
        "usec": 732233,
        "msg": XID,
        "hostname": "gpu-node-7",
        "@timestamp": 1717495780.5,
    }
    rec = one(orjson.dumps(body), key=b"other-key")
    assert rec.node == "gpu-node-7"  # the record's own host wins over the partitioning key
    assert rec.source is Source.KERNEL
    assert rec.line == XID
    assert rec.ts == datetime(2024, 6, 4, 10, 9, 40, 500000, tzinfo=UTC)
    assert rec.shipper == "fluentbit-kmsg"


def test_kmsg_record_node_from_key_and_uptime_not_taken_as_epoch() -> None:
    body = {"priority": 4, "sequence": 2, "sec": 11706, "usec": 1, "msg": XID}
    rec = one(orjson.dumps(body), key=b"gpu-node-1", timestamp_ms=1_700_000_000_000)
    assert rec.node == "gpu-node-1"
    # sec/usec is time since boot: the Kafka timestamp is used instead of 1970 + 3h.
    assert rec.ts == datetime.fromtimestamp(1_700_000_000, UTC)


def test_kmsg_record_node_from_header() -> None:
    body = {"priority": 4, "sec": 5, "usec": 1, "msg": XID}
    rec = one(orjson.dumps(body), headers=[("trace", b"x"), ("node", b"gpu-node-h")])
    assert rec.node == "gpu-node-h"


def test_kmsg_iso8601_ns_timestamp() -> None:
    body = {"msg": XID, "priority": 3, "node": "n1", "@timestamp": "2024-06-04T10:09:40.123456789Z"}
    assert one(orjson.dumps(body)).ts == datetime(2024, 6, 4, 10, 9, 40, 123456, tzinfo=UTC)


def test_kmsg_without_any_node_is_dead_letter() -> None:
    reason = rejected(orjson.dumps({"priority": 3, "sec": 1, "usec": 2, "msg": XID}))
    assert "no node" in reason
    assert KERNEL_TOPIC in reason


# -- Fluent Bit tail + kubernetes filter -------------------------------------------------------------


def test_tail_kubernetes_record() -> None:
    body = {
        "log": "RuntimeError: CUDA error: an illegal memory access was encountered\n",
        "stream": "stderr",
        "time": "2024-06-04T10:09:40.123456789Z",
        "kubernetes": {
            "pod_name": "trainer-0",
            "namespace_name": "ml",
            "pod_id": "abc",
            "host": "gpu-node-3",
            "container_name": "pytorch",
            "docker_id": "def",
            "container_image": "nvcr.io/nvidia/pytorch:24.05",
        },
    }
    rec = one(orjson.dumps(body), topic=POD_TOPIC)
    assert (rec.node, rec.namespace, rec.pod, rec.container) == ("gpu-node-3", "ml", "trainer-0", "pytorch")
    assert rec.source is Source.POD
    assert rec.line == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert rec.ts == datetime(2024, 6, 4, 10, 9, 40, 123456, tzinfo=UTC)


def test_cri_message_field_and_date_double() -> None:
    body = {"message": "NCCL WARN x", "date": 1717495780.25, "kubernetes": {"host": "n2", "pod_name": "p"}}
    rec = one(orjson.dumps(body), topic=POD_TOPIC)
    assert rec.line == "NCCL WARN x"
    assert rec.ts == datetime(2024, 6, 4, 10, 9, 40, 250000, tzinfo=UTC)


def test_kubernetes_record_without_line_is_dead_letter() -> None:
    assert "without 'log'" in rejected(orjson.dumps({"kubernetes": {"host": "n"}}))


# -- Fluent Bit array forms --------------------------------------------------------------------------


def test_array_ts_record_form() -> None:
    rec = one(orjson.dumps([1717495780.0, {"msg": XID, "priority": 3, "host": "n4"}]))
    assert rec.node == "n4"
    assert rec.ts == datetime(2024, 6, 4, 10, 9, 40, tzinfo=UTC)


def test_array_with_metadata_form() -> None:
    rec = one(orjson.dumps([[1717495780.0, {}], {"log": "x", "kubernetes": {"host": "n5"}}]))
    assert rec.node == "n5"
    assert rec.ts == datetime(2024, 6, 4, 10, 9, 40, tzinfo=UTC)


def test_array_wrong_shape_is_dead_letter() -> None:
    assert "[timestamp, {record}]" in rejected(b"[1, 2, 3]")


# -- journald ----------------------------------------------------------------------------------------


def test_systemd_kernel_transport() -> None:
    body = {
        "MESSAGE": XID,
        "_HOSTNAME": "n6",
        "_TRANSPORT": "kernel",
        "__REALTIME_TIMESTAMP": "1717495780000001",
    }
    rec = one(orjson.dumps(body), topic="misc")
    assert (rec.node, rec.source) == ("n6", Source.KERNEL)
    assert rec.ts == datetime(2024, 6, 4, 10, 9, 40, 1, tzinfo=UTC)


# -- Loki --------------------------------------------------------------------------------------------


def test_loki_push_body_many_lines_many_streams() -> None:
    body = {
        "streams": [
            {
                "stream": {"node": "n7", "job": "kmsg"},
                "values": [
                    ["1717495780000000001", XID],
                    ["1717495781000000000", "second", {"trace_id": "t"}],
                ],
            },
            {
                "stream": {"node": "n8", "pod": "p", "namespace": "ns", "container": "c"},
                "values": [["1717495782000000000", "pod line"]],
            },
        ]
    }
    records, dead = decode_record(orjson.dumps(body), None, None, "loki.raw")
    assert dead == []
    assert [(r.node, r.line, r.source) for r in records] == [
        ("n7", XID, Source.KERNEL),
        ("n7", "second", Source.KERNEL),
        ("n8", "pod line", Source.POD),
    ]
    assert records[0].ts == datetime(2024, 6, 4, 10, 9, 40, tzinfo=UTC)
    assert (records[2].namespace, records[2].pod, records[2].container) == ("ns", "p", "c")
    assert all(r.shipper == "loki" for r in records)


def test_loki_tail_message_with_dropped_entries_keeps_lines_and_reports_loss() -> None:
    body = {
        "streams": [{"stream": {"node": "n9"}, "values": [["1717495780000000000", "a"]]}],
        "dropped_entries": [{"labels": {"node": "n9"}, "timestamp": "1717495779000000000"}],
    }
    records, dead = decode_record(orjson.dumps(body), None, None, KERNEL_TOPIC)
    assert [r.line for r in records] == ["a"]
    assert len(dead) == 1 and "dropped_entries" in dead[0].reason


def test_loki_bad_entry_is_dead_letter_others_kept() -> None:
    body = {"streams": [{"stream": {"node": "n"}, "values": [["x", "bad ts"], ["1717495780000000000", "ok"], [1]]}]}
    records, dead = decode_record(orjson.dumps(body), None, None, KERNEL_TOPIC)
    assert [r.line for r in records] == ["ok"]
    assert len(dead) == 2
    assert "values[0]" in dead[0].reason and "nanosecond" in dead[0].reason
    assert "values[2]" in dead[1].reason


def test_loki_node_falls_back_to_key_and_source_hint() -> None:
    body = {"streams": [{"stream": {"job": "x"}, "values": [["1717495780000000000", "l"]]}]}
    rec = one(orjson.dumps(body), key=b"nk", topic="t", source_hint=Source.POD)
    assert (rec.node, rec.source) == ("nk", Source.POD)


def test_loki_streams_wrong_type() -> None:
    assert "not a list" in rejected(b'{"streams": {"a": 1}}')


# -- our own LogRecord -------------------------------------------------------------------------------


def test_own_logrecord_roundtrip() -> None:
    original = LogRecord(node="n10", source=Source.POD, ts=datetime(2024, 1, 1, tzinfo=UTC), line="l", pod="p")
    assert one(original.to_bytes()) == original


def test_invalid_own_logrecord() -> None:
    assert "invalid LogRecord at 'source'" in rejected(b'{"type":"log","node":"n","line":"l","source":"x","ts":1}')


# -- plain text --------------------------------------------------------------------------------------


def test_plain_text_dmesg_line_with_key() -> None:
    line = "[538441.007373] " + XID
    rec = one(line.encode(), key=b"n11", timestamp_ms=1_717_495_780_000)
    assert (rec.node, rec.line, rec.source, rec.shipper) == ("n11", line, Source.KERNEL, "plain")
    assert rec.ts == datetime(2024, 6, 4, 10, 9, 40, tzinfo=UTC)


def test_plain_text_multiline_keeps_order_and_source_from_topic() -> None:
    text = b"NVRM: The NVIDIA GPU 0000:4e:00.0\r\nNVRM: (PCI ID: 10de:2330) installed in this system has\n\nx\n"
    records, dead = decode_record(text, b"n12", None, POD_TOPIC)
    assert dead == []
    assert [r.line for r in records] == [
        "NVRM: The NVIDIA GPU 0000:4e:00.0",
        "NVRM: (PCI ID: 10de:2330) installed in this system has",
        "x",
    ]
    assert {r.source for r in records} == {Source.POD}


def test_plain_text_invalid_utf8_is_replaced_not_rejected() -> None:
    rec = one(b"NVRM: Xid \xff\xfe", key=b"n")
    assert rec.line == "NVRM: Xid \ufffd\ufffd"


def test_plain_text_without_node() -> None:
    assert "without node" in rejected(b"NVRM: something")


# -- rejects -----------------------------------------------------------------------------------------


def test_empty_and_null_values() -> None:
    assert "null" in rejected(None, key=b"n")
    assert "empty" in rejected(b"", key=b"n")
    assert "empty" in rejected(b"  \n ", key=b"n")


def test_invalid_json_object() -> None:
    assert "invalid JSON" in rejected(b'{"msg": "x", ', key=b"n")


def test_invalid_utf8_inside_json() -> None:
    reason = rejected(b'{"msg": "\xff", "host": "n"}')
    assert "invalid JSON" in reason and "UTF-8" in reason


def test_json_of_wrong_shape() -> None:
    assert "no log line field" in rejected(b'{"foo": 1}', key=b"n")
    assert "not a string" in rejected(b'{"msg": 5, "priority": 1, "host": "n"}')
    assert "health_check" in rejected(b'{"type": "health_check", "node": "n"}')


def test_oversize_and_location_in_reason() -> None:
    records, dead = decode_record(b"x" * 2000, b"n", None, KERNEL_TOPIC, partition=3, offset=42, max_bytes=1000)
    assert records == []
    assert "oversize" in dead[0].reason and "partition 3 offset 42" in dead[0].reason
    assert (dead[0].partition, dead[0].offset, dead[0].key) == (3, 42, "n")


def test_node_too_long_is_rejected() -> None:
    assert "no node" in rejected(orjson.dumps({"msg": "x", "priority": 1, "host": "a" * 300}))


# -- helpers -----------------------------------------------------------------------------------------


def test_parse_timestamp_units() -> None:
    expected = datetime(2024, 6, 4, 10, 9, 40, tzinfo=UTC)
    for raw in (
        1717495780,
        1717495780000,
        1717495780000000,
        1717495780000000000,
        "1717495780000000000",
        "2024-06-04T10:09:40Z",
        "2024-06-04T10:09:40",
        1717495780.0,
    ):
        assert parse_timestamp(raw) == expected, raw
    for raw in (None, True, "nope", 0, -5, 11706, float("nan"), [], "", 10**30):
        assert parse_timestamp(raw) is None, raw


def test_source_for_topic() -> None:
    assert source_for_topic("gpu.logs.kernel") is Source.KERNEL
    assert source_for_topic("prod.gpu.logs.pods") is Source.POD
    assert source_for_topic("gpu.health.checks") is Source.PROBE
    assert source_for_topic("whatever") is None


# -- properties --------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=20,
)
shaped = st.fixed_dictionaries(
    {},
    optional={
        "msg": json_values,
        "log": json_values,
        "priority": json_values,
        "sec": json_values,
        "host": json_values,
        "kubernetes": json_values,
        "streams": json_values,
        "dropped_entries": json_values,
        "type": st.sampled_from(["log", "fault", "x"]),
        "line": json_values,
        "node": json_values,
        "@timestamp": json_values,
        "MESSAGE": json_values,
    },
)
keys = st.none() | st.binary(max_size=20)
headers = st.none() | st.lists(st.tuples(st.sampled_from(["node", "host", "x"]), st.binary(max_size=10)), max_size=3)


def check_outcome(records: list[LogRecord], dead: list[DeadLetter]) -> None:
    for rec in records:
        assert rec.node and len(rec.node) <= 253
        assert LogRecord.from_bytes(rec.to_bytes()) == rec  # every accepted record round-trips
    for d in dead:
        assert d.reason and d.stage == "adapter"
        DeadLetter.from_bytes(d.to_bytes())


@settings(max_examples=300)
@given(value=st.none() | st.binary(max_size=300), key=keys, hdrs=headers)
def test_random_bytes_never_raise(value, key, hdrs) -> None:
    check_outcome(*decode_record(value, key, hdrs, KERNEL_TOPIC))


@settings(max_examples=300)
@given(obj=shaped | json_values, key=keys, hdrs=headers, wrap=st.booleans())
def test_json_of_any_shape_never_raises(obj, key, hdrs, wrap) -> None:
    if wrap:
        obj = [1717495780.0, obj]
    try:
        value = orjson.dumps(obj)
    except (TypeError, orjson.JSONEncodeError):
        return  # hypothesis made something orjson cannot encode (e.g. huge ints)
    check_outcome(*decode_record(value, key, hdrs, KERNEL_TOPIC))


def test_one_megabyte_line_never_raises() -> None:
    big = b"NVRM: Xid " + b"a" * (1 << 20)
    records, dead = decode_record(big, b"n", None, KERNEL_TOPIC)
    assert records == [] and "oversize" in dead[0].reason
    records, dead = decode_record(big, b"n", None, KERNEL_TOPIC, max_bytes=2 << 20)
    assert len(records) == 1 and dead == []


def test_json_lines_each_line_decoded_bad_line_dead_lettered() -> None:
    body = (
        b'{"msg": "a", "priority": 3, "host": "n1"}\n'
        b'{"msg": "b", "priority"\n'
        b'{"log": "c", "kubernetes": {"host": "n2"}}\n'
    )
    records, dead = decode_record(body, None, None, KERNEL_TOPIC)
    assert [(r.node, r.line) for r in records] == [("n1", "a"), ("n2", "c")]
    assert len(dead) == 1 and "line 2" in dead[0].reason


def dumps_or_empty(obj: object) -> bytes:
    try:
        return orjson.dumps(obj)
    except (TypeError, orjson.JSONEncodeError):  # integers beyond 64 bits
        return b"{}"


@settings(max_examples=200)
@given(raw=st.binary(max_size=200) | shaped.map(dumps_or_empty))
def test_loki_tail_message_parsing_never_raises(raw: bytes) -> None:
    from pipeline.ingest.loki_tail import parse_tail_message

    msg = parse_tail_message(raw)
    assert all(isinstance(e.ts_ns, int) and isinstance(e.line, str) for e in msg.entries)
