"""Input adapters: raw Kafka records from any shipper -> ``LogRecord``s, or ``DeadLetter``s saying why not.

Pure functions, no I/O. ``decode_record`` is on the hot path of the parse agent, so it decodes once
with orjson, dispatches on the shape by looking at a few keys, and never raises: whatever it cannot
understand becomes a ``DeadLetter`` naming what is wrong and where.

This module is the entry point and the dispatch; the shapes are read in their own modules:

- Fluent Bit ``kmsg``, ``tail`` + ``kubernetes`` filter and ``systemd`` records:
  ``pipeline.ingest.fluentbit``. Fluent Bit's Kafka output ``format json`` (one JSON object per Kafka
  record), the ``[timestamp, {record}]`` / ``[[timestamp, {metadata}], {record}]`` array forms of its
  JSON encoders, and newline-delimited JSON (``json_lines``, each line decoded on its own) are
  unwrapped here.
- Loki push and tail JSON (``{"streams": [...], "dropped_entries": [...]}``, many lines per record):
  ``pipeline.ingest.loki_streams``.
- OpenTelemetry OTLP JSON, Filebeat, syslog text (rsyslog & co) and raw CRI lines: ``pipeline.ingest.shippers``;
  their lines become ``LogRecord``s here (``from_shipped``).
- A ``LogRecord`` already in our own wire format (``"type": "log"``): here.
- Plain text (one or more lines), with the node from a ``node``/``host``/``hostname`` header or the
  Kafka key: here.

The node comes from the record itself first (``node``, ``hostname``, ``host``, ``kubernetes.host``,
a Loki label), then a header, then the Kafka key: shippers put the host in the record, and the key
may be a partitioning choice of the producer. Field tables and time/node rules:
``pipeline.ingest.record_fields``; the per-record fallbacks, ``LogRecord`` building and dead letters:
``pipeline.ingest.record_context``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import orjson
from pydantic import ValidationError

from pipeline.ingest import shippers
from pipeline.ingest.fluentbit import from_fluentbit
from pipeline.ingest.loki_streams import from_loki
from pipeline.ingest.record_context import RecordContext, Reject
from pipeline.ingest.record_fields import parse_timestamp
from schemas.records import DeadLetter, DeadLetterCode, LogRecord, Source

MAX_RECORD_BYTES = 1 << 20
"""Kafka's default ``message.max.bytes`` is ~1 MiB; anything bigger is not a log record we produced."""


def decode_record(
    value: bytes | None,
    key: bytes | None,
    headers: Sequence[tuple[str, bytes]] | None,
    topic: str,
    source_hint: Source | None = None,
    *,
    timestamp_ms: int | None = None,
    partition: int | None = None,
    offset: int | None = None,
    max_bytes: int = MAX_RECORD_BYTES,
) -> tuple[list[LogRecord], list[DeadLetter]]:
    """Turn one Kafka record into the log lines it carries, and dead letters for what it cannot.

    ``source_hint`` applies where the record does not say (plain text, Loki streams without pod
    labels); without it the source is inferred from the topic name, else taken as kernel.
    ``timestamp_ms`` (the Kafka record timestamp) is used when the record carries no wall-clock time.
    Never raises.
    """
    ctx = RecordContext(key, headers, topic, source_hint, timestamp_ms, partition, offset)
    try:
        if value is None:
            return [], [ctx.dead("empty record: value is null (tombstone)", value, DeadLetterCode.EMPTY)]
        if len(value) > max_bytes:
            reason = f"oversize record: {len(value)} bytes > limit {max_bytes}"
            return [], [ctx.dead(reason, value, DeadLetterCode.OVERSIZE)]
        stripped = value.strip()
        if not stripped:
            return [], [ctx.dead("empty record: value is empty or whitespace", value, DeadLetterCode.EMPTY)]
        first = stripped[:1]
        if first == b"{":
            try:
                obj = orjson.loads(stripped)
            except orjson.JSONDecodeError as exc:
                if b"\n" in stripped:
                    return _from_json_lines(ctx, stripped.split(b"\n"), value)
                return [], [ctx.dead(f"invalid JSON: {exc}", value, DeadLetterCode.INVALID_JSON)]
            return _from_json(ctx, obj, value)
        if first == b"[":
            # A dmesg line starts with '[' too ("[538441.007373] NVRM: ..."): JSON only if it parses.
            try:
                obj = orjson.loads(stripped)
            except orjson.JSONDecodeError:
                return _from_text(ctx, value)
            return _from_json(ctx, obj, value)
        return _from_text(ctx, value)
    except Exception as exc:  # the contract is "never raises"; the reason says what broke
        return [], [ctx.dead(f"adapter error {type(exc).__name__}: {exc}", value, DeadLetterCode.PARSE_ERROR)]


# -- plain text ----------------------------------------------------------------------------------


def _from_text(ctx: RecordContext, value: bytes) -> tuple[list[LogRecord], list[DeadLetter]]:
    decoded = value.decode("utf-8", "replace")
    cri = shippers.cri_lines(decoded)
    if cri is not None:  # a container log file's lines, sent raw: the node comes from the key or a header
        node = ctx.fallback_node()
        if node is None:
            reason = "CRI log line without node: set the Kafka key or a 'node' header"
            return [], [ctx.dead(reason, value, DeadLetterCode.NO_NODE)]
        # The CRI format is the container runtime's: its text is a workload's on whatever topic it came, and a
        # workload's text never speaks for the kernel (a pod that prints dmesg output must not quarantine).
        return [ctx.make(node, Source.POD, item.ts or ctx.fallback_time(), item.line, item.shipper)
                for item in cri], []
    syslog = shippers.syslog_lines(decoded, ctx.fallback_time())
    if syslog is not None:  # rsyslog & co: host and time in each line's syslog header
        return _from_shipped(ctx, syslog, value)
    node = ctx.fallback_node()
    if node is None:
        reason = "plain-text record without node: set the Kafka key or a 'node' header"
        return [], [ctx.dead(reason, value, DeadLetterCode.NO_NODE)]
    # Kernel lines may carry stray bytes; replacement keeps the line parseable and JSON-encodable.
    source = ctx.default_source()
    ts = ctx.fallback_time()
    records = [ctx.make(node, source, ts, line, "plain") for line in decoded.splitlines() if line.strip()]
    return records, []


# -- JSON ----------------------------------------------------------------------------------------


def _from_json(ctx: RecordContext, obj: Any, value: bytes) -> tuple[list[LogRecord], list[DeadLetter]]:
    ts_hint: datetime | None = None
    if isinstance(obj, list):
        # Fluent Bit JSON encoders: [ts, {record}] or, with metadata, [[ts, {meta}], {record}].
        if len(obj) != 2 or not isinstance(obj[1], dict):
            return [], [ctx.dead("JSON array is not [timestamp, {record}]", value, DeadLetterCode.UNKNOWN_SHAPE)]
        head = obj[0]
        if isinstance(head, list) and head:
            head = head[0]
        ts_hint = parse_timestamp(head)
        obj = obj[1]
    if not isinstance(obj, dict):
        reason = f"JSON {type(obj).__name__} where an object was expected"
        return [], [ctx.dead(reason, value, DeadLetterCode.UNKNOWN_SHAPE)]
    try:
        if "streams" in obj:
            return from_loki(ctx, obj, value)
        if shippers.is_otlp_logs(obj):
            return _from_shipped(ctx, shippers.otlp_lines(obj), value)
        if shippers.is_filebeat(obj):
            return _from_shipped(ctx, [shippers.filebeat_line(obj)], value)
        if obj.get("type") == "log" and "line" in obj:
            return [_from_logrecord(ctx, obj)], []
        return [from_fluentbit(ctx, obj, ts_hint)], []
    except Reject as exc:
        return [], [ctx.dead(str(exc), value, exc.code)]


def _from_json_lines(ctx: RecordContext, lines: list[bytes], value: bytes) -> tuple[list[LogRecord], list[DeadLetter]]:
    """Newline-delimited JSON (``json_lines``): each line one record, bad lines dead-lettered alone."""
    records: list[LogRecord] = []
    dead: list[DeadLetter] = []
    for number, raw in enumerate(lines, 1):
        raw = raw.strip()
        if not raw:
            continue
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            dead.append(ctx.dead(f"invalid JSON on line {number}: {exc}", raw, DeadLetterCode.INVALID_JSON))
            continue
        got, bad = _from_json(ctx, obj, raw)
        records.extend(got)
        dead.extend(bad)
    return records, dead


def _from_logrecord(ctx: RecordContext, obj: dict[str, Any]) -> LogRecord:
    if not obj.get("node"):
        node = ctx.fallback_node()
        if node is None:
            raise Reject("LogRecord without node and no node header or Kafka key", DeadLetterCode.NO_NODE)
        obj = {**obj, "node": node}
    try:
        return LogRecord.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first.get("loc", ()))
        raise Reject(f"invalid LogRecord at '{loc}': {first.get('msg')}") from exc


# -- other shippers ------------------------------------------------------------------------------


def _from_shipped(
    ctx: RecordContext, items: list[shippers.ShippedLine | shippers.ShapeError], value: bytes
) -> tuple[list[LogRecord], list[DeadLetter]]:
    """Lines that ``pipeline.ingest.shippers`` found in another shipper's record (OTLP, Filebeat, syslog)."""
    records: list[LogRecord] = []
    dead: list[DeadLetter] = []
    for item in items:
        if isinstance(item, shippers.ShapeError):
            dead.append(ctx.dead(str(item), value))
            continue
        try:
            ts = parse_timestamp(item.ts) if not isinstance(item.ts, datetime) else item.ts
            source = Source.POD if item.pod else Source.KERNEL if item.kernel else ctx.default_source()
            records.append(ctx.make(
                item.node or ctx.fallback_node(), source, ts or ctx.fallback_time(), item.line,
                item.shipper, namespace=item.namespace, pod=item.pod, container=item.container,
                boot_id=item.boot_id,
            ))
        except Reject as exc:
            dead.append(ctx.dead(f"{item.shipper} record: {exc}", value))
    return records, dead
