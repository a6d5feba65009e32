"""Loki push and tail JSON -> ``LogRecord``s, one per stream value, and dead letters for what is not one.

Pure, no I/O; ``pipeline.ingest.adapters`` decodes the JSON and calls ``from_loki`` for an object with
``streams``. The shape (``POST /loki/api/v1/push`` and ``/loki/api/v1/tail``):
``{"streams": [{"stream": {labels}, "values": [["<ns>", "<line>"(, {metadata})], ...]}],
"dropped_entries": [...]}``. One Kafka record may carry many lines; a bad entry is dead-lettered
alone. The node comes from a label (``NODE_LABELS``), else a header or the Kafka key
(``pipeline.ingest.record_context``). ``pipeline.ingest.loki_tail`` is the bridge that writes this
shape to Kafka.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from pipeline.ingest.record_context import RecordContext, Reject
from pipeline.ingest.record_fields import NODE_LABELS, POD_LABELS, SOURCE_BY_VALUE, clean_node, parse_timestamp
from schemas.records import DeadLetter, DeadLetterCode, LogRecord, Source


def from_loki(ctx: RecordContext, obj: dict[str, Any], value: bytes) -> tuple[list[LogRecord], list[DeadLetter]]:
    """The lines of one Loki message (``obj``, decoded from ``value``), and dead letters for the rest."""
    streams = obj.get("streams")
    records: list[LogRecord] = []
    dead: list[DeadLetter] = []
    dropped = obj.get("dropped_entries")
    if dropped:
        # Loki tells us it lost entries before they reached us; nothing is dropped silently.
        count = len(dropped) if isinstance(dropped, list) else "some"
        reason = f"Loki reported {count} dropped_entries (lost upstream)"
        dead.append(ctx.dead(reason, orjson.dumps(dropped), DeadLetterCode.UPSTREAM_LOSS))
    if not isinstance(streams, list):
        reason = f"Loki 'streams' is {type(streams).__name__}, not a list"
        dead.append(ctx.dead(reason, value, DeadLetterCode.UNKNOWN_SHAPE))
        return records, dead
    if not streams and not dropped:
        dead.append(ctx.dead("Loki message with no streams", value, DeadLetterCode.UNKNOWN_SHAPE))
        return records, dead
    for i, stream in enumerate(streams):
        if not isinstance(stream, dict):
            dead.append(ctx.dead(f"Loki streams[{i}] is not an object", value, DeadLetterCode.UNKNOWN_SHAPE))
            continue
        labels = stream.get("stream")
        if labels is None:
            labels = {}
        values = stream.get("values")
        if not isinstance(labels, dict) or not isinstance(values, list):
            dead.append(ctx.dead(f"Loki streams[{i}] needs 'stream' object and 'values' list", value,
                                 DeadLetterCode.UNKNOWN_SHAPE))
            continue
        node = None
        for label in NODE_LABELS:
            node = clean_node(labels.get(label))
            if node:
                break
        node = node or ctx.fallback_node()
        source = _loki_source(labels) or ctx.default_source()
        namespace = labels.get("namespace") or labels.get("namespace_name")
        pod = labels.get("pod") or labels.get("pod_name")
        container = labels.get("container") or labels.get("container_name")
        boot_id = labels.get("boot_id")
        for j, entry in enumerate(values):
            try:
                if not isinstance(entry, list) or len(entry) < 2:
                    raise Reject("entry is not [timestamp_ns, line]")
                raw_ts = entry[0]
                if not isinstance(raw_ts, str) or not raw_ts.isdigit():
                    raise Reject(f"timestamp {raw_ts!r} is not a nanosecond epoch string")
                ts = parse_timestamp(raw_ts)
                if ts is None:
                    raise Reject(f"timestamp {raw_ts!r} out of range")
                records.append(
                    ctx.make(
                        node,
                        source,
                        ts,
                        entry[1],
                        "loki",
                        namespace=namespace,
                        pod=pod,
                        container=container,
                        boot_id=boot_id,
                    )
                )
            except Reject as exc:
                dead.append(ctx.dead(f"Loki streams[{i}].values[{j}]: {exc}", orjson.dumps(entry), exc.code))
    return records, dead


def _loki_source(labels: Mapping[str, Any]) -> Source | None:
    explicit = labels.get("source")
    if isinstance(explicit, str) and explicit in SOURCE_BY_VALUE:
        return SOURCE_BY_VALUE[explicit]
    for label in POD_LABELS:
        if labels.get(label):
            return Source.POD
    if labels.get("transport") == "kernel" or labels.get("syslog_identifier") == "kernel":
        return Source.KERNEL
    return None
