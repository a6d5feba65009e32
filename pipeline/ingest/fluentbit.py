"""Fluent Bit's record shapes -> one ``LogRecord`` each (field names from Fluent Bit's documentation).

Pure, no I/O; ``pipeline.ingest.adapters`` decodes the JSON and calls ``from_fluentbit`` for an object
no other reader claims (``pipeline.ingest.loki_streams`` for Loki, ``pipeline.ingest.shippers`` for
OTLP, Filebeat and syslog). Shapes:

- ``kmsg`` input: ``priority``, ``sequence``, ``sec``, ``usec``, ``msg``. ``sec``/``usec`` are time
  since boot, so the wall-clock time comes from the Kafka output's ``timestamp_key`` (default
  ``@timestamp``, ``double`` or ``iso8601[_ns]``) when present.
- ``tail`` + ``kubernetes`` filter: ``log`` (or ``message`` from the CRI parser), ``kubernetes.host``,
  ``kubernetes.pod_name``, ``kubernetes.namespace_name``, ``kubernetes.container_name``, time in
  ``time``/``@timestamp``/``date``.
- ``systemd`` input (journald): ``MESSAGE``, ``_HOSTNAME``, ``_TRANSPORT``, ``__REALTIME_TIMESTAMP``.
- any other object with a ``log``/``message``/``msg`` field (record modifiers may add ``node``,
  ``source``, ``namespace``, ``pod``, ``container``, ``boot_id``).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pipeline.ingest import shippers
from pipeline.ingest.parsing.kmsg import decode_kmsg_escapes
from pipeline.ingest.record_context import RecordContext, Reject
from pipeline.ingest.record_fields import MIN_EPOCH_SECONDS, SOURCE_BY_VALUE, clean_node, from_epoch_number
from schemas.records import DeadLetterCode, LogRecord, Source


def from_fluentbit(ctx: RecordContext, obj: dict[str, Any], ts_hint: datetime | None) -> LogRecord:
    """The ``LogRecord`` one Fluent Bit record carries; raises ``Reject`` saying why when it carries none.

    ``ts_hint`` is the time of a ``[timestamp, {record}]`` array encoding, used when the record has none.
    """
    kube = obj.get("kubernetes")
    if isinstance(kube, dict):
        line = obj.get("log")
        if line is None:
            line = obj.get("message")
        if line is None:
            raise Reject("kubernetes record without 'log' or 'message' field")
        node = clean_node(kube.get("host")) or ctx.record_node(obj) or ctx.fallback_node()
        ts = ctx.record_time(obj) or ts_hint or ctx.fallback_time()
        return ctx.make(
            node,
            Source.POD,
            ts,
            line,
            "fluentbit-kubernetes",
            namespace=kube.get("namespace_name"),
            pod=kube.get("pod_name"),
            container=kube.get("container_name"),
        )
    if "msg" in obj and ("priority" in obj or "sec" in obj or "sequence" in obj):
        ts = ctx.record_time(obj) or ts_hint or _kmsg_time(obj) or ctx.fallback_time()
        node = ctx.record_node(obj) or ctx.fallback_node()
        boot_id = obj.get("boot_id")
        msg = decode_kmsg_escapes(obj["msg"]) if isinstance(obj["msg"], str) else obj["msg"]  # \x0a etc.
        record = ctx.make(node, Source.KERNEL, ts, msg, "fluentbit-kmsg", boot_id=boot_id)
        record.replay_key = shippers.kmsg_replay_key(obj)
        return record
    if "MESSAGE" in obj:
        ts = ctx.record_time(obj) or ts_hint or _journald_time(obj) or ctx.fallback_time()
        node = ctx.record_node(obj) or ctx.fallback_node()
        kernel = obj.get("_TRANSPORT") == "kernel" or obj.get("SYSLOG_IDENTIFIER") == "kernel"
        source = Source.KERNEL if kernel else ctx.default_source()
        boot_id = obj.get("_BOOT_ID")
        message = obj["MESSAGE"]
        if not kernel and source is Source.KERNEL and obj.get("_TRANSPORT") and isinstance(message, str):
            # A userspace program's entry: keep its tag as journalctl shows it, so a kernel line it
            # quotes is not taken for the kernel's own (pipeline.ingest.parsing.common.prefix_is_kernel).
            message = f"{obj.get('SYSLOG_IDENTIFIER') or obj.get('_COMM') or 'userspace'}: {message}"
        return ctx.make(node, source, ts, message, "fluentbit-systemd", boot_id=boot_id)
    for field in ("log", "message", "msg"):
        if field in obj:
            ts = ctx.record_time(obj) or ts_hint or ctx.fallback_time()
            node = ctx.record_node(obj) or ctx.fallback_node()
            explicit = obj.get("source")
            source = (
                SOURCE_BY_VALUE.get(explicit) if isinstance(explicit, str) else None
            ) or ctx.default_source()
            return ctx.make(
                node,
                source,
                ts,
                obj[field],
                "fluentbit",
                namespace=obj.get("namespace"),
                pod=obj.get("pod"),
                container=obj.get("container"),
                boot_id=obj.get("boot_id"),
            )
    kind = obj.get("type")
    if isinstance(kind, str) and kind != "log":
        raise Reject(f"JSON object of record type '{kind}' is not a log line", DeadLetterCode.UNKNOWN_SHAPE)
    keys = ", ".join(sorted(str(k) for k in obj)[:10])
    raise Reject(f"JSON object has no log line field (msg/log/message/MESSAGE/streams); keys: {keys}",
                 DeadLetterCode.UNKNOWN_SHAPE)


def _kmsg_time(obj: dict[str, Any]) -> datetime | None:
    # kmsg sec/usec count from boot; only a Fluent Bit build that rewrote them to epoch passes here.
    sec = obj.get("sec")
    if isinstance(sec, int) and not isinstance(sec, bool) and sec >= MIN_EPOCH_SECONDS:
        usec = obj.get("usec")
        usec = usec if isinstance(usec, int) and 0 <= usec < 1_000_000 else 0
        return from_epoch_number(sec * 1_000_000 + usec)
    return None


def _journald_time(obj: Mapping[str, Any]) -> datetime | None:
    raw = obj.get("__REALTIME_TIMESTAMP") or obj.get("_SOURCE_REALTIME_TIMESTAMP")
    if isinstance(raw, str) and raw.isdigit():
        return from_epoch_number(int(raw) * 1000)  # journald writes microseconds
    return None
