"""Input adapters: raw Kafka records from any shipper -> ``LogRecord``s, or ``DeadLetter``s saying why not.

Pure functions, no I/O. ``decode_record`` is on the hot path of the parse agent, so it decodes once
with orjson, dispatches on the shape by looking at a few keys, and never raises: whatever it cannot
understand becomes a ``DeadLetter`` naming what is wrong and where.

Shapes understood (field names from the shippers' documentation):

- Fluent Bit ``kmsg`` input: ``priority``, ``sequence``, ``sec``, ``usec``, ``msg``. ``sec``/``usec``
  are time since boot, so the wall-clock time comes from the Kafka output's ``timestamp_key``
  (default ``@timestamp``, ``double`` or ``iso8601[_ns]``) when present.
- Fluent Bit ``tail`` + ``kubernetes`` filter: ``log`` (or ``message`` from the CRI parser),
  ``kubernetes.host``, ``kubernetes.pod_name``, ``kubernetes.namespace_name``,
  ``kubernetes.container_name``, time in ``time``/``@timestamp``/``date``.
- Fluent Bit ``systemd`` input (journald): ``MESSAGE``, ``_HOSTNAME``, ``_TRANSPORT``,
  ``__REALTIME_TIMESTAMP``.
- Fluent Bit's Kafka output ``format json`` (one JSON object per Kafka record), the
  ``[timestamp, {record}]`` / ``[[timestamp, {metadata}], {record}]`` array forms of its JSON encoders,
  and newline-delimited JSON (``json_lines``), each line decoded on its own.
- Loki push (``POST /loki/api/v1/push``) and tail (``/loki/api/v1/tail``) JSON:
  ``{"streams": [{"stream": {labels}, "values": [["<ns>", "<line>"(, {metadata})], ...]}],
  "dropped_entries": [...]}``. One Kafka record may carry many lines.
- A ``LogRecord`` already in our own wire format (``"type": "log"``).
- Plain text (one or more lines), with the node from a ``node``/``host``/``hostname`` header or the
  Kafka key.

The node comes from the record itself first (``node``, ``hostname``, ``host``, ``kubernetes.host``,
a Loki label), then a header, then the Kafka key: shippers put the host in the record, and the key
may be a partitioning choice of the producer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from pydantic import ValidationError

from pipeline.ingest import shippers
from pipeline.ingest.parsing.kmsg import decode_kmsg_escapes
from schemas.records import DeadLetter, DeadLetterCode, LogRecord, Source

STAGE = "adapter"

MAX_RECORD_BYTES = 1 << 20
"""Kafka's default ``message.max.bytes`` is ~1 MiB; anything bigger is not a log record we produced."""

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
_MIN_EPOCH_SECONDS = 1_000_000_000  # 2001-09-09: smaller numbers are uptimes, not wall-clock times
_MAX_EPOCH_SECONDS = 32_503_680_000  # year 3000

_SOURCE_BY_VALUE = {s.value: s for s in Source}


class _Reject(Exception):
    """One entry (or the whole record) cannot become a LogRecord; the message is the reason."""

    def __init__(self, reason: str, code: DeadLetterCode = DeadLetterCode.INVALID_RECORD) -> None:
        super().__init__(reason)
        self.code = code


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
    ctx = _Context(key, headers, topic, source_hint, timestamp_ms, partition, offset)
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
                    return ctx.from_json_lines(stripped.split(b"\n"), value)
                return [], [ctx.dead(f"invalid JSON: {exc}", value, DeadLetterCode.INVALID_JSON)]
            return ctx.from_json(obj, value)
        if first == b"[":
            # A dmesg line starts with '[' too ("[538441.007373] NVRM: ..."): JSON only if it parses.
            try:
                obj = orjson.loads(stripped)
            except orjson.JSONDecodeError:
                return ctx.from_text(value)
            return ctx.from_json(obj, value)
        return ctx.from_text(value)
    except Exception as exc:  # the contract is "never raises"; the reason says what broke
        return [], [ctx.dead(f"adapter error {type(exc).__name__}: {exc}", value, DeadLetterCode.PARSE_ERROR)]


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
        return _from_number(raw)
    if isinstance(raw, str):
        text = raw.strip()
        if not text:
            return None
        if text.isdigit():
            return _from_number(int(text))
        try:
            number = float(text)
        except ValueError:
            pass
        else:
            return _from_number(number)
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


def _from_number(value: float) -> datetime | None:
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
        if not (_MIN_EPOCH_SECONDS * 10**9 <= seconds_ns <= _MAX_EPOCH_SECONDS * 10**9):
            return None
        return ns_to_datetime(seconds_ns)
    if value >= 1e17:
        value /= 1e9
    elif value >= 1e14:
        value /= 1e6
    elif value >= 1e11:
        value /= 1e3
    if not (_MIN_EPOCH_SECONDS <= value <= _MAX_EPOCH_SECONDS):
        return None
    return datetime.fromtimestamp(value, UTC)


def _clean_node(raw: Any) -> str | None:
    if not isinstance(raw, str):
        return None
    node = raw.strip()
    if not node or len(node) > MAX_NODE_LEN:
        return None
    return node


class _Context:
    """The Kafka-side facts about one record, and the shape handlers that use them."""

    __slots__ = ("key", "headers", "topic", "hint", "timestamp_ms", "partition", "offset", "_key_text")

    def __init__(
        self,
        key: bytes | None,
        headers: Sequence[tuple[str, bytes]] | None,
        topic: str,
        hint: Source | None,
        timestamp_ms: int | None,
        partition: int | None,
        offset: int | None,
    ) -> None:
        self.key = key
        self.headers = headers
        self.topic = topic
        self.hint = hint
        self.timestamp_ms = timestamp_ms
        self.partition = partition
        self.offset = offset
        self._key_text: str | None = None
        if key:
            try:
                self._key_text = key.decode("utf-8")
            except (UnicodeDecodeError, AttributeError):
                self._key_text = None

    # -- shared helpers -------------------------------------------------------------------------

    def dead(
        self, reason: str, payload: bytes | str | None, code: DeadLetterCode = DeadLetterCode.OTHER
    ) -> DeadLetter:
        where = f"topic {self.topic}"
        if self.partition is not None:
            where += f" partition {self.partition}"
        if self.offset is not None:
            where += f" offset {self.offset}"
        return DeadLetter.of(
            STAGE,
            f"{reason} ({where})",
            payload,
            code,
            topic=self.topic,
            partition=self.partition,
            offset=self.offset,
            key=self._key_text if self._key_text is not None else (repr(self.key) if self.key else None),
        )

    def fallback_node(self) -> str | None:
        """Node from a header, else the Kafka key."""
        if self.headers:
            for name, raw in self.headers:
                if raw and isinstance(name, str) and name.lower() in NODE_HEADERS:
                    try:
                        node = _clean_node(bytes(raw).decode("utf-8"))
                    except (UnicodeDecodeError, TypeError):
                        node = None
                    if node:
                        return node
        return _clean_node(self._key_text)

    def default_source(self) -> Source:
        if self.hint is not None:
            return self.hint
        # Kernel is the default because the kernel parsers only match NVRM/SXid shapes, so a pod line
        # mis-sourced as kernel is ignored rather than mis-classified.
        return source_for_topic(self.topic) or Source.KERNEL

    def fallback_time(self) -> datetime:
        if self.timestamp_ms is not None:
            ts = _from_number(int(self.timestamp_ms))
            if ts is not None:
                return ts
        return datetime.now(UTC)

    def record_time(self, obj: Mapping[str, Any]) -> datetime | None:
        for field in TIME_FIELDS:
            raw = obj.get(field)
            if raw is not None:
                ts = parse_timestamp(raw)
                if ts is not None:
                    return ts
        return None

    def record_node(self, obj: Mapping[str, Any]) -> str | None:
        for field in NODE_FIELDS:
            raw = obj.get(field)
            if raw is not None:
                node = _clean_node(raw)
                if node:
                    return node
        return None

    def make(
        self,
        node: str | None,
        source: Source,
        ts: datetime,
        line: Any,
        shipper: str,
        *,
        namespace: Any = None,
        pod: Any = None,
        container: Any = None,
        boot_id: Any = None,
    ) -> LogRecord:
        if node is None:
            raise _Reject(
                "no node: no node/hostname/host field, no node header and no Kafka key", DeadLetterCode.NO_NODE
            )
        if not isinstance(line, str):
            raise _Reject(f"log line is {type(line).__name__}, not a string")
        # Validated constructor on purpose: in pydantic 2.x it is faster than model_construct, and a
        # ValidationError here is a reason for a dead letter, not a crash.
        try:
            return LogRecord(
                node=node,
                source=source,
                ts=ts,
                line=line.rstrip("\r\n"),
                namespace=namespace if isinstance(namespace, str) else None,
                pod=pod if isinstance(pod, str) else None,
                container=container if isinstance(container, str) else None,
                boot_id=boot_id if isinstance(boot_id, str) else None,
                shipper=shipper,
            )
        except ValidationError as exc:
            raise _Reject(f"invalid log record: {exc.errors()[0].get('msg', exc)}") from exc

    # -- plain text ------------------------------------------------------------------------------

    def from_text(self, value: bytes) -> tuple[list[LogRecord], list[DeadLetter]]:
        syslog = shippers.syslog_lines(value.decode("utf-8", "replace"), self.fallback_time())
        if syslog is not None:  # rsyslog & co: host and time in each line's syslog header
            return self.from_shipped(syslog, value)
        node = self.fallback_node()
        if node is None:
            reason = "plain-text record without node: set the Kafka key or a 'node' header"
            return [], [self.dead(reason, value, DeadLetterCode.NO_NODE)]
        # Kernel lines may carry stray bytes; replacement keeps the line parseable and JSON-encodable.
        text = value.decode("utf-8", "replace")
        source = self.default_source()
        ts = self.fallback_time()
        records = [self.make(node, source, ts, line, "plain") for line in text.splitlines() if line.strip()]
        return records, []

    # -- JSON ------------------------------------------------------------------------------------

    def from_json(self, obj: Any, value: bytes) -> tuple[list[LogRecord], list[DeadLetter]]:
        ts_hint: datetime | None = None
        if isinstance(obj, list):
            # Fluent Bit JSON encoders: [ts, {record}] or, with metadata, [[ts, {meta}], {record}].
            if len(obj) != 2 or not isinstance(obj[1], dict):
                return [], [self.dead("JSON array is not [timestamp, {record}]", value, DeadLetterCode.UNKNOWN_SHAPE)]
            head = obj[0]
            if isinstance(head, list) and head:
                head = head[0]
            ts_hint = parse_timestamp(head)
            obj = obj[1]
        if not isinstance(obj, dict):
            reason = f"JSON {type(obj).__name__} where an object was expected"
            return [], [self.dead(reason, value, DeadLetterCode.UNKNOWN_SHAPE)]
        try:
            if "streams" in obj:
                return self.from_loki(obj, value)
            if shippers.is_otlp_logs(obj):
                return self.from_shipped(shippers.otlp_lines(obj), value)
            if shippers.is_filebeat(obj):
                return self.from_shipped([shippers.filebeat_line(obj)], value)
            if obj.get("type") == "log" and "line" in obj:
                return [self.from_logrecord(obj)], []
            return [self.from_fluentbit(obj, ts_hint)], []
        except _Reject as exc:
            return [], [self.dead(str(exc), value, exc.code)]

    def from_json_lines(self, lines: list[bytes], value: bytes) -> tuple[list[LogRecord], list[DeadLetter]]:
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
                dead.append(self.dead(f"invalid JSON on line {number}: {exc}", raw, DeadLetterCode.INVALID_JSON))
                continue
            got, bad = self.from_json(obj, raw)
            records.extend(got)
            dead.extend(bad)
        return records, dead

    def from_logrecord(self, obj: dict[str, Any]) -> LogRecord:
        if not obj.get("node"):
            node = self.fallback_node()
            if node is None:
                raise _Reject("LogRecord without node and no node header or Kafka key", DeadLetterCode.NO_NODE)
            obj = {**obj, "node": node}
        try:
            return LogRecord.model_validate(obj)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(p) for p in first.get("loc", ()))
            raise _Reject(f"invalid LogRecord at '{loc}': {first.get('msg')}") from exc

    def from_fluentbit(self, obj: dict[str, Any], ts_hint: datetime | None) -> LogRecord:
        kube = obj.get("kubernetes")
        if isinstance(kube, dict):
            line = obj.get("log")
            if line is None:
                line = obj.get("message")
            if line is None:
                raise _Reject("kubernetes record without 'log' or 'message' field")
            node = _clean_node(kube.get("host")) or self.record_node(obj) or self.fallback_node()
            ts = self.record_time(obj) or ts_hint or self.fallback_time()
            return self.make(
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
            ts = self.record_time(obj) or ts_hint or self._kmsg_time(obj) or self.fallback_time()
            node = self.record_node(obj) or self.fallback_node()
            boot_id = obj.get("boot_id")
            msg = decode_kmsg_escapes(obj["msg"]) if isinstance(obj["msg"], str) else obj["msg"]  # \x0a etc.
            record = self.make(node, Source.KERNEL, ts, msg, "fluentbit-kmsg", boot_id=boot_id)
            record.replay_key = shippers.kmsg_replay_key(obj)
            return record
        if "MESSAGE" in obj:
            ts = self.record_time(obj) or ts_hint or _journald_time(obj) or self.fallback_time()
            node = self.record_node(obj) or self.fallback_node()
            kernel = obj.get("_TRANSPORT") == "kernel" or obj.get("SYSLOG_IDENTIFIER") == "kernel"
            source = Source.KERNEL if kernel else self.default_source()
            boot_id = obj.get("_BOOT_ID")
            message = obj["MESSAGE"]
            if not kernel and source is Source.KERNEL and obj.get("_TRANSPORT") and isinstance(message, str):
                # A userspace program's entry: keep its tag as journalctl shows it, so a kernel line it
                # quotes is not taken for the kernel's own (pipeline.ingest.parsing.common.prefix_is_kernel).
                message = f"{obj.get('SYSLOG_IDENTIFIER') or obj.get('_COMM') or 'userspace'}: {message}"
            return self.make(node, source, ts, message, "fluentbit-systemd", boot_id=boot_id)
        for field in ("log", "message", "msg"):
            if field in obj:
                ts = self.record_time(obj) or ts_hint or self.fallback_time()
                node = self.record_node(obj) or self.fallback_node()
                explicit = obj.get("source")
                source = (
                    _SOURCE_BY_VALUE.get(explicit) if isinstance(explicit, str) else None
                ) or self.default_source()
                return self.make(
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
            raise _Reject(f"JSON object of record type '{kind}' is not a log line", DeadLetterCode.UNKNOWN_SHAPE)
        keys = ", ".join(sorted(str(k) for k in obj)[:10])
        raise _Reject(f"JSON object has no log line field (msg/log/message/MESSAGE/streams); keys: {keys}",
                      DeadLetterCode.UNKNOWN_SHAPE)

    def _kmsg_time(self, obj: dict[str, Any]) -> datetime | None:
        # kmsg sec/usec count from boot; only a Fluent Bit build that rewrote them to epoch passes here.
        sec = obj.get("sec")
        if isinstance(sec, int) and not isinstance(sec, bool) and sec >= _MIN_EPOCH_SECONDS:
            usec = obj.get("usec")
            usec = usec if isinstance(usec, int) and 0 <= usec < 1_000_000 else 0
            return _from_number(sec * 1_000_000 + usec)
        return None

    def from_shipped(
        self, items: list[shippers.ShippedLine | shippers.ShapeError], value: bytes
    ) -> tuple[list[LogRecord], list[DeadLetter]]:
        """Lines that ``pipeline.ingest.shippers`` found in another shipper's record (OTLP, Filebeat, syslog)."""
        records: list[LogRecord] = []
        dead: list[DeadLetter] = []
        for item in items:
            if isinstance(item, shippers.ShapeError):
                dead.append(self.dead(str(item), value))
                continue
            try:
                ts = parse_timestamp(item.ts) if not isinstance(item.ts, datetime) else item.ts
                source = Source.POD if item.pod else Source.KERNEL if item.kernel else self.default_source()
                records.append(self.make(
                    item.node or self.fallback_node(), source, ts or self.fallback_time(), item.line,
                    item.shipper, namespace=item.namespace, pod=item.pod, container=item.container,
                    boot_id=item.boot_id,
                ))
            except _Reject as exc:
                dead.append(self.dead(f"{item.shipper} record: {exc}", value))
        return records, dead

    # -- Loki ------------------------------------------------------------------------------------

    def from_loki(self, obj: dict[str, Any], value: bytes) -> tuple[list[LogRecord], list[DeadLetter]]:
        streams = obj.get("streams")
        records: list[LogRecord] = []
        dead: list[DeadLetter] = []
        dropped = obj.get("dropped_entries")
        if dropped:
            # Loki tells us it lost entries before they reached us; nothing is dropped silently.
            count = len(dropped) if isinstance(dropped, list) else "some"
            reason = f"Loki reported {count} dropped_entries (lost upstream)"
            dead.append(self.dead(reason, orjson.dumps(dropped), DeadLetterCode.UPSTREAM_LOSS))
        if not isinstance(streams, list):
            reason = f"Loki 'streams' is {type(streams).__name__}, not a list"
            dead.append(self.dead(reason, value, DeadLetterCode.UNKNOWN_SHAPE))
            return records, dead
        if not streams and not dropped:
            dead.append(self.dead("Loki message with no streams", value, DeadLetterCode.UNKNOWN_SHAPE))
            return records, dead
        for i, stream in enumerate(streams):
            if not isinstance(stream, dict):
                dead.append(self.dead(f"Loki streams[{i}] is not an object", value, DeadLetterCode.UNKNOWN_SHAPE))
                continue
            labels = stream.get("stream")
            if labels is None:
                labels = {}
            values = stream.get("values")
            if not isinstance(labels, dict) or not isinstance(values, list):
                dead.append(self.dead(f"Loki streams[{i}] needs 'stream' object and 'values' list", value,
                                          DeadLetterCode.UNKNOWN_SHAPE))
                continue
            node = None
            for label in NODE_LABELS:
                node = _clean_node(labels.get(label))
                if node:
                    break
            node = node or self.fallback_node()
            source = _loki_source(labels) or self.default_source()
            namespace = labels.get("namespace") or labels.get("namespace_name")
            pod = labels.get("pod") or labels.get("pod_name")
            container = labels.get("container") or labels.get("container_name")
            boot_id = labels.get("boot_id")
            for j, entry in enumerate(values):
                try:
                    if not isinstance(entry, list) or len(entry) < 2:
                        raise _Reject("entry is not [timestamp_ns, line]")
                    raw_ts = entry[0]
                    if not isinstance(raw_ts, str) or not raw_ts.isdigit():
                        raise _Reject(f"timestamp {raw_ts!r} is not a nanosecond epoch string")
                    ts = parse_timestamp(raw_ts)
                    if ts is None:
                        raise _Reject(f"timestamp {raw_ts!r} out of range")
                    records.append(
                        self.make(
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
                except _Reject as exc:
                    dead.append(self.dead(f"Loki streams[{i}].values[{j}]: {exc}", orjson.dumps(entry), exc.code))
        return records, dead


def _loki_source(labels: Mapping[str, Any]) -> Source | None:
    explicit = labels.get("source")
    if isinstance(explicit, str) and explicit in _SOURCE_BY_VALUE:
        return _SOURCE_BY_VALUE[explicit]
    for label in POD_LABELS:
        if labels.get(label):
            return Source.POD
    if labels.get("transport") == "kernel" or labels.get("syslog_identifier") == "kernel":
        return Source.KERNEL
    return None


def _journald_time(obj: Mapping[str, Any]) -> datetime | None:
    raw = obj.get("__REALTIME_TIMESTAMP") or obj.get("_SOURCE_REALTIME_TIMESTAMP")
    if isinstance(raw, str) and raw.isdigit():
        return _from_number(int(raw) * 1000)  # journald writes microseconds
    return None
