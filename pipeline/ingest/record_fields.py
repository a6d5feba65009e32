"""What shippers' record fields mean: wall-clock times, node names and the source a topic implies.

Pure functions and the field-name tables, no I/O. The input adapters (``pipeline.ingest.adapters``
dispatches on the shape; ``pipeline.ingest.record_context`` builds ``LogRecord``s;
``pipeline.ingest.fluentbit`` and ``pipeline.ingest.loki_streams`` read those shippers' shapes) all
take times, nodes and sources from here, so each rule is in one place.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from schemas.records import Source

MAX_NODE_LEN = 253

NODE_FIELDS: tuple[str, ...] = ("node", "node_name", "nodename", "hostname", "host", "_HOSTNAME")
"""Record fields naming the node, in order of preference (what shippers' record modifiers add)."""

NODE_LABELS: tuple[str, ...] = ("node", "node_name", "nodename", "kubernetes_node", "hostname", "host")
"""Loki stream labels naming the node, in order of preference."""

NODE_HEADERS: tuple[str, ...] = ("node", "host", "hostname")

TIME_FIELDS: tuple[str, ...] = ("@timestamp", "timestamp", "time", "date")
"""Fluent Bit's Kafka output ``timestamp_key`` default, then common parser/encoder keys."""

POD_LABELS: tuple[str, ...] = ("pod", "pod_name", "container", "container_name")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MIN_EPOCH_SECONDS = 1_000_000_000  # 2001-09-09: smaller numbers are uptimes, not wall-clock times
_MAX_EPOCH_SECONDS = 32_503_680_000  # year 3000

SOURCE_BY_VALUE: dict[str, Source] = {s.value: s for s in Source}


def source_for_topic(topic: str) -> Source | None:
    """The source a topic's name implies (``gpu.logs.kernel`` -> kernel, ``gpu.logs.pods`` -> pod)."""
    # The last dot-separated part decides first ("team-pods.gpu.logs.kernel" is kernel), then the rest.
    lowered = topic.lower()
    for name in (lowered.rsplit(".", 1)[-1], lowered):
        if "kernel" in name or "kmsg" in name or "dmesg" in name:
            return Source.KERNEL
        if "pod" in name or "container" in name:
            return Source.POD
        if "health" in name or "probe" in name:
            return Source.PROBE
    return None


def parse_timestamp(raw: Any) -> datetime | None:
    """A wall-clock time from the forms shippers write, or None when it is not one.

    Numbers: seconds, milliseconds, microseconds or nanoseconds since the epoch (told apart by
    magnitude); digit strings likewise (Loki's nanosecond strings); ISO 8601 strings with or without a
    zone (naive = UTC). Times before 2001 are taken as uptimes, not wall-clock times, and rejected.
    """
    if isinstance(raw, bool):
        return None
    if isinstance(raw, int | float):
        return from_epoch_number(raw)
    if isinstance(raw, str):
        text = raw.strip()
        if not text:
            return None
        if text.isdigit():
            return from_epoch_number(int(text))
        try:
            number = float(text)
        except ValueError:
            pass
        else:
            return from_epoch_number(number)
        try:
            ts = datetime.fromisoformat(text)
        except ValueError:
            return None
        if ts.tzinfo is None:
            ts = ts.replace(tzinfo=UTC)
        return ts
    return None


def ns_to_datetime(ns: int) -> datetime:
    """Nanoseconds since the epoch -> aware datetime (microsecond precision, exact integer arithmetic)."""
    return _EPOCH + timedelta(microseconds=ns // 1000)


def from_epoch_number(value: float) -> datetime | None:
    """Seconds, ms, us or ns since the epoch (told apart by magnitude) -> aware datetime; None if out of range."""
    if value != value or value <= 0:  # NaN or non-positive
        return None
    if isinstance(value, int):
        if value >= 10**17:
            seconds_ns = value
        elif value >= 10**14:
            seconds_ns = value * 1000
        elif value >= 10**11:
            seconds_ns = value * 1_000_000
        else:
            seconds_ns = value * 1_000_000_000
        if not (MIN_EPOCH_SECONDS * 10**9 <= seconds_ns <= _MAX_EPOCH_SECONDS * 10**9):
            return None
        return ns_to_datetime(seconds_ns)
    if value >= 1e17:
        value /= 1e9
    elif value >= 1e14:
        value /= 1e6
    elif value >= 1e11:
        value /= 1e3
    if not (MIN_EPOCH_SECONDS <= value <= _MAX_EPOCH_SECONDS):
        return None
    return datetime.fromtimestamp(value, UTC)


def clean_node(raw: Any) -> str | None:
    """A node name as a shipper wrote it, stripped; None when it is not a usable one."""
    if not isinstance(raw, str):
        return None
    node = raw.strip()
    if not node or len(node) > MAX_NODE_LEN:
        return None
    return node
