"""Pure parts of the Loki tail bridge: URL, message parsing, resume cursor."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import orjson
import pytest

from pipeline.ingest.adapters import decode_record
from pipeline.ingest.loki_tail import TailCursor, TailEntry, encode_entry, parse_tail_message, tail_url


def test_tail_url_maps_scheme_and_keeps_prefix() -> None:
    url = tail_url(
        "https://logs.example.com/loki-gw/", '{job="kmsg"} |= "NVRM"', start_ns=17, delay_for_s=9, limit=50
    )
    parts = urlsplit(url)
    assert (parts.scheme, parts.netloc, parts.path) == (
        "wss",
        "logs.example.com",
        "/loki-gw/loki/api/v1/tail",
    )
    assert parse_qs(parts.query) == {
        "query": ['{job="kmsg"} |= "NVRM"'],
        "start": ["17"],
        "delay_for": ["5"],  # Loki's maximum
        "limit": ["50"],
    }
    assert urlsplit(tail_url("http://loki:3100", '{a="b"}')).scheme == "ws"
    assert "start" not in tail_url("http://loki:3100", '{a="b"}')


@pytest.mark.parametrize("bad", ["loki:3100", "ftp://loki", "http://"])
def test_tail_url_rejects_non_http(bad: str) -> None:
    with pytest.raises(ValueError):
        tail_url(bad, "{}")


def test_parse_tail_message() -> None:
    raw = orjson.dumps(
        {
            "streams": [
                {"stream": {"node": "a"}, "values": [["10", "x"], ["11", "y"], [12, "bad"]]},
                {"stream": {"node": "b"}, "values": [["10", "z"]]},
                {"values": []},
            ],
            "dropped_entries": [{"labels": {"node": "a"}, "timestamp": "9"}],
        }
    )
    msg = parse_tail_message(raw)
    assert [(e.ts_ns, e.labels["node"], e.line) for e in msg.entries] == [
        (10, "a", "x"),
        (11, "a", "y"),
        (10, "b", "z"),
    ]
    assert msg.dropped == 1
    assert len(msg.malformed) == 2
    assert parse_tail_message(b"nope").malformed and parse_tail_message(b"[]").malformed


def entry(ts: int, node: str, line: str) -> TailEntry:
    return TailEntry(ts, {"node": node}, line)


def test_cursor_skips_only_what_was_produced_at_the_resume_timestamp() -> None:
    cursor = TailCursor()
    first = [entry(1, "a", "x"), entry(2, "a", "y"), entry(2, "b", "y")]
    assert cursor.select_new(first) == first
    for e in first:
        cursor.mark(e)
    assert cursor.last_ts_ns == 2
    # Reconnect with start=2: Loki replays everything at ts >= 2.
    replay = [entry(2, "a", "y"), entry(2, "b", "y"), entry(2, "c", "y"), entry(3, "a", "z")]
    assert cursor.select_new(replay) == [entry(2, "c", "y"), entry(3, "a", "z")]


def test_cursor_same_line_same_ts_on_two_nodes_are_distinct() -> None:
    cursor = TailCursor()
    cursor.mark(entry(5, "a", "same"))
    assert cursor.select_new([entry(5, "a", "same"), entry(5, "b", "same")]) == [entry(5, "b", "same")]


def test_cursor_late_entry_does_not_move_resume_point() -> None:
    cursor = TailCursor()
    cursor.mark(entry(10, "a", "x"))
    late = entry(7, "b", "late")
    assert cursor.select_new([late]) == [late]
    cursor.mark(late)
    assert cursor.last_ts_ns == 10 and len(cursor.seen_at_last) == 1


def test_cursor_drops_duplicates_inside_one_message() -> None:
    assert TailCursor().select_new([entry(1, "a", "x"), entry(1, "a", "x")]) == [entry(1, "a", "x")]


def test_encoded_entry_is_understood_by_the_adapters() -> None:
    e = TailEntry(1717495780000000123, {"node": "gpu-1", "job": "kmsg"}, "NVRM: Xid (PCI:0000:4e:00): 79, x")
    records, dead = decode_record(encode_entry(e), b"gpu-1", None, "gpu.logs.kernel")
    assert dead == [] and len(records) == 1
    assert (records[0].node, records[0].line, records[0].shipper) == ("gpu-1", e.line, "loki")


def test_auth_headers_tenant_basic_and_bearer_file(tmp_path) -> None:
    import base64

    from pipeline.ingest.loki_tail import LokiAuth, tail_identity

    assert LokiAuth().headers() == {}
    basic = LokiAuth(org_id="team-a", username="bridge", password="s3cret").headers()
    assert basic["X-Scope-OrgID"] == "team-a"
    assert base64.b64decode(basic["Authorization"].removeprefix("Basic ")) == b"bridge:s3cret"
    token = tmp_path / "token"
    token.write_text("first\n")
    auth = LokiAuth(bearer_token_file=token)
    assert auth.headers() == {"Authorization": "Bearer first"}
    token.write_text("rotated")  # read again on every connection
    assert auth.headers() == {"Authorization": "Bearer rotated"}
    with pytest.raises(ValueError):
        LokiAuth(username="u", bearer_token_file=token)
    with pytest.raises(ValueError):
        LokiAuth(password="p")
    assert LokiAuth().ssl_context() is None
    # One tail, one identity: tenant and query both name it.
    assert tail_identity('{a="b"}', "t1") == tail_identity('{a="b"}', "t1") != tail_identity('{a="b"}', "t2")


def test_identity_ignores_labels_loki_derives_only_in_query_results() -> None:
    """A replay (query) carries detected_level, the live tail does not: still the same entry."""
    live = TailEntry(5, {"job": "kmsg", "node": "n1", "service_name": "kmsg"}, "NVRM: Xid 79")
    replayed = TailEntry(5, {**live.labels, "detected_level": "unknown"}, "NVRM: Xid 79")
    cursor = TailCursor()
    cursor.mark(live)
    assert not cursor.is_new(replayed)


def test_the_command_says_cannot_reach_kafka_only_when_that_is_what_happened() -> None:
    # Every Kafka error that stopped the bridge used to read "cannot reach Kafka", an unreadable batch or an
    # ACL refusal included: the operator then looked at the network instead of the topic.
    from aiokafka.errors import (
        CorruptRecordException,
        KafkaConnectionError,
        RecordTooLargeError,
        TopicAuthorizationFailedError,
        UnsupportedCodecError,
    )

    from pipeline.commands.loki_tail import kafka_failure

    def say(exc: Exception) -> str:
        return kafka_failure(exc, "k:9092", "gpu.logs.kernel")

    assert say(KafkaConnectionError("Unable to bootstrap")).startswith("cannot reach Kafka at k:9092")
    for unreadable in (CorruptRecordException("Invalid CRC"), UnsupportedCodecError("Libraries for lz4 not found"),
                       RecordTooLargeError("There are some messages at [Partition=Offset]")):
        text = say(unreadable)
        assert "cannot reach" not in text and "a record batch of gpu.logs.kernel could not be read" in text, text
        assert type(unreadable).__name__ in text
    refused = say(TopicAuthorizationFailedError("gpu.logs.kernel"))
    assert "cannot reach" not in refused and "TopicAuthorizationFailedError" in refused, refused
