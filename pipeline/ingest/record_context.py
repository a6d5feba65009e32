"""One Kafka record's facts (key, headers, topic, partition, offset) and how a ``LogRecord`` is made from them.

Pure, no I/O. The shape readers (``pipeline.ingest.adapters`` for the dispatch, plain text, JSON lines
and other shippers; ``pipeline.ingest.fluentbit``; ``pipeline.ingest.loki_streams``) all take a
``RecordContext``: it supplies the fallbacks (node from a header or the Kafka key, source from the
hint or the topic, time from the Kafka timestamp), builds validated ``LogRecord``s, and writes
``DeadLetter``s that say where the record was. A shape reader raises ``Reject`` for one entry that
cannot become a ``LogRecord``; the caller turns it into a dead letter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError

from pipeline.ingest.record_fields import (
    NODE_FIELDS,
    NODE_HEADERS,
    TIME_FIELDS,
    clean_node,
    from_epoch_number,
    parse_timestamp,
    source_for_topic,
)
from schemas.records import DeadLetter, DeadLetterCode, LogRecord, Source

STAGE = "adapter"


class Reject(Exception):
    """One entry (or the whole record) cannot become a LogRecord; the message is the reason."""

    def __init__(self, reason: str, code: DeadLetterCode = DeadLetterCode.INVALID_RECORD) -> None:
        super().__init__(reason)
        self.code = code


class RecordContext:
    """The Kafka-side facts about one record, and the helpers the shape readers share."""

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

    def dead(
        self, reason: str, payload: bytes | str | None, code: DeadLetterCode = DeadLetterCode.OTHER
    ) -> DeadLetter:
        """A dead letter for ``payload``, its reason naming the topic, partition and offset."""
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
                        node = clean_node(bytes(raw).decode("utf-8"))
                    except (UnicodeDecodeError, TypeError):
                        node = None
                    if node:
                        return node
        return clean_node(self._key_text)

    def default_source(self) -> Source:
        """The source where the record does not say: the hint, else the topic's, else kernel."""
        if self.hint is not None:
            return self.hint
        # Kernel is the default because the kernel parsers only match NVRM/SXid shapes, so a pod line
        # mis-sourced as kernel is ignored rather than mis-classified.
        return source_for_topic(self.topic) or Source.KERNEL

    def fallback_time(self) -> datetime:
        """The Kafka record timestamp, else now."""
        if self.timestamp_ms is not None:
            ts = from_epoch_number(int(self.timestamp_ms))
            if ts is not None:
                return ts
        return datetime.now(UTC)

    def record_time(self, obj: Mapping[str, Any]) -> datetime | None:
        """The first wall-clock time among the record's ``TIME_FIELDS``."""
        for field in TIME_FIELDS:
            raw = obj.get(field)
            if raw is not None:
                ts = parse_timestamp(raw)
                if ts is not None:
                    return ts
        return None

    def record_node(self, obj: Mapping[str, Any]) -> str | None:
        """The first usable node among the record's ``NODE_FIELDS``."""
        for field in NODE_FIELDS:
            raw = obj.get(field)
            if raw is not None:
                node = clean_node(raw)
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
        """A validated ``LogRecord``; raises ``Reject`` saying why when there is none to make."""
        if node is None:
            raise Reject(
                "no node: no node/hostname/host field, no node header and no Kafka key", DeadLetterCode.NO_NODE
            )
        if not isinstance(line, str):
            raise Reject(f"log line is {type(line).__name__}, not a string")
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
            raise Reject(f"invalid log record: {exc.errors()[0].get('msg', exc)}") from exc
