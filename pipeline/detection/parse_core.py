"""The pure half of the parse stage: one batch of raw Kafka records -> fault events and dead letters.

No Kafka client, no producer, no I/O: ``pipeline.detection.parse_stage.ParseStage`` fetches the
batches, hands them to ``ParseCore.process`` and produces what comes back (``pipeline.detection.parse_outputs``);
the replay command and the unit tests drive ``ParseCore`` directly. Per batch:

1. The marker gate looks at the raw bytes of the whole batch first: a payload that contains none of
   the prefilter's markers (``gate_markers``) cannot carry a line that passes
   ``pipeline.detection.detector.prefilter``, so it is counted as noise without being decoded (99.9% of the
   stream). The scan is one pass of an aho-corasick automaton (``bytes.find`` per marker without it)
   over the batch joined by NUL bytes, so noise costs no Python-level work per record. Markers
   spelled with a JSON escape (``NET\\/``) count as markers; payloads with JSON ``\\u`` escapes, empty,
   null or large payloads (over 64 KiB) always take the full path. One record in ``shape_check_every`` is decoded
   anyway, so a shipper sending an unknown shape shows up in the dead-letter topic quickly.
2. Candidates go through ``pipeline.ingest.adapters.decode_record`` (LogRecords + DeadLetters), then the
   per-line ``prefilter`` and ``Detector.process``. ``ParseCore.held_offsets`` tells the stage which
   records a detector still holds the first lines of (a multi-line message), so their commit waits.

Every per-record failure becomes a dead letter with a reason: the core never raises for its input.
One piece rather than two modules (a little over 400 lines): the gate's helpers exist only for
``ParseCore.candidates``, and ``ParseCore`` is one class. Tuning: ``pipeline.detection.parse_settings``.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import ValidationError

from pipeline.detection.catalog import Catalog
from pipeline.detection.parse_settings import ParseSettings
from pipeline.ingest.bounds import budget_by_key, cap_dead_letters, cap_lines, clip_record, cut_raw_lines
from pipeline.runtime.settings import TopicNames
from schemas.records import (
    Action,
    DeadLetter,
    DeadLetterCode,
    FaultEvent,
    FaultKind,
    HealthCheckResult,
    LogRecord,
    Severity,
    Source,
    stable_id,
)

log = logging.getLogger("xidflow.parse")

_VALUE = operator.attrgetter("value")
_SIZE = operator.attrgetter("serialized_value_size")

STAGE = "parse"
"""The stage name dead letters of the parse path carry (core, stage and outputs alike)."""


class DetectorLike(Protocol):
    def process(self, record: LogRecord) -> list[FaultEvent]: ...

    def flush(self, node: str | None = None) -> list[FaultEvent]: ...

    def forget(self, node: str) -> None: ...


class RawRecord(Protocol):
    """What ``ParseCore`` needs of a consumed record (aiokafka's ConsumerRecord has it)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]]
    timestamp: int


class BareRecord(Protocol):
    """A record fetched without its topic and partition (the parse stage's fetch: ``upstream.deliver_bare_records``)."""

    offset: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes | None]]
    timestamp: int


class Located:
    """A bare record with the topic and partition it was fetched from: what ``ParseCore`` needs of a candidate."""

    __slots__ = ("topic", "partition", "offset", "key", "value", "headers", "timestamp")

    def __init__(self, topic: str, partition: int, rec: BareRecord) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = rec.offset
        self.key = rec.key
        self.value = rec.value
        self.headers = rec.headers
        self.timestamp = rec.timestamp


@dataclass
class BatchResult:
    """What one batch of raw records turned into."""

    events: list[FaultEvent] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    records: int = 0
    noise: int = 0
    decoded: int = 0


MAX_GATE_BYTES = 64 << 10
"""Payloads above this are not scanned: they are decoded, within the parse stage's bounds (the record's lines,
its node's bytes in the batch; the adapter dead-letters oversize records). A shipper sends a line or a few a
record; a scan of a large record dense with markers cost more than its bounded decode (every match is one)."""


def gate_markers() -> tuple[str, ...]:
    """The substrings ``pipeline.detection.detector.prefilter`` looks for, for every source.

    A payload that contains none of them cannot contain a line that passes the prefilter, whatever
    its shape, so it need not be decoded. ``ParseCore`` adds their JSON-escaped spellings
    (``gate_patterns``) and treats any ``\\u`` escape as a possible marker. tests/unit/test_parse_stage.py
    checks this stays equivalent to the prefilter.
    """
    from pipeline.ingest.parsing.kernel import KERNEL_MARKERS
    from pipeline.ingest.parsing.pod import POD_ANCHORS

    return (*KERNEL_MARKERS, *POD_ANCHORS)


UNICODE_ESCAPE = b"\\u"
"""A JSON ``\\uXXXX`` escape can spell any character of a marker: a payload holding one is always decoded."""

_JSON_ESCAPES = (("\\", "\\\\"), ('"', '\\"'), ("/", "\\/"))
"""Characters a JSON encoder writes as a two-character escape (``/`` optionally: ``"NET\\/"`` is ``NET/``)."""


def gate_patterns(markers: Sequence[str]) -> tuple[bytes, ...]:
    """The markers as bytes, each with its JSON-escaped spelling where that differs (``NET/``, ``NET\\/``)."""
    out: dict[bytes, None] = {}
    for marker in markers:
        out[marker.encode()] = None
        escaped = marker
        for char, escape in _JSON_ESCAPES:
            escaped = escaped.replace(char, escape)
        out[escaped.encode()] = None
    return tuple(out)


def _automaton(markers: Sequence[bytes]) -> Any:
    """A multi-pattern matcher (``ahocorasick_rs``), or None where it is not installed.

    Without it the gate falls back to one ``bytes.find`` pass per marker: same answers, ~10x slower.
    """
    try:
        import ahocorasick_rs
    except ImportError:
        return None
    # Leftmost-first lets the library use its SIMD prefilter (~3x faster here than the default
    # overlapping-standard semantics); any match in a record is enough to mark it.
    return ahocorasick_rs.BytesAhoCorasick(list(markers), matchkind=ahocorasick_rs.MatchKind.LeftmostFirst)


def health_event(result: HealthCheckResult) -> FaultEvent:
    """A health-check result as a fault event (passed checks too: reboot recovery needs them)."""
    if result.passed:
        action, severity = Action.IGNORE, Severity.INFO
    else:
        action = Catalog.configured().health_check(result.check, result.values).action
        severity = result.severity if result.severity.rank >= Severity.ERROR.rank else Severity.ERROR
    return FaultEvent(
        id=stable_id(result.node, "health_check", result.check, result.gpu_index, result.ts.isoformat()),
        node=result.node,
        kind=FaultKind.HEALTH_CHECK,
        source=Source.PROBE,
        pci=result.pci,
        gpu_uuid=result.gpu_uuid,
        action=action,
        severity=severity,
        name=result.check,
        detail={"check": result.check, "passed": result.passed, "gpu_index": result.gpu_index},
        ts=result.ts,
        line=result.message,
        boot_id=result.boot_id,
    )


class ParseCore:
    """Raw Kafka records -> fault events and dead letters. Pure apart from the detector's memory."""

    def __init__(
        self,
        topics: TopicNames | None = None,
        settings: ParseSettings | None = None,
        detector_factory: Callable[[], DetectorLike] | None = None,
        prefilter: Callable[..., bool] | None = None,
        decode_record: Callable[..., tuple[list[LogRecord], list[DeadLetter]]] | None = None,
        markers: Sequence[str] | None = None,
        use_automaton: bool = True,
    ) -> None:
        # The detection and adapter modules are imported here, not at module import, so that the
        # Faust app can be built (and its tests run) by code that injects its own.
        if detector_factory is None or prefilter is None:
            from pipeline.detection import detector as detect
            detector_factory = detector_factory or detect.Detector
            prefilter = prefilter or detect.prefilter
        if decode_record is None:
            from pipeline.ingest.adapters import decode_record
        self.topics = topics or TopicNames()
        self.settings = settings or ParseSettings()
        self._detector_factory = detector_factory
        self.detector: DetectorLike = detector_factory()
        self.prefilter = prefilter
        self.decode_record = decode_record
        self.health_topic = self.topics.name("health_checks")
        self._seen = 0
        self.markers: tuple[bytes, ...] = gate_patterns(markers or gate_markers())
        # The two-byte ``\\u`` has a matcher of its own: in the markers' automaton it made the SIMD
        # prefilter's fingerprints two bytes long, and common pairs ("or", "re", "ti") then matched
        # everywhere (1.7 GB/s instead of 7.3 GB/s here); alone it is a memchr-speed search.
        self._automaton = _automaton(self.markers) if use_automaton else None
        self._escapes = _automaton((UNICODE_ESCAPE,)) if use_automaton else None
        # node -> (topic, partition, offset, first-seen monotonic time) of the oldest record whose
        # lines may still sit in the detector as the start of a multi-line message.
        self.partial: dict[str, tuple[str, int, int, float]] = {}
        # Nodes with detector state, least recently seen first (bounded by ``max_nodes``).
        self._nodes: collections.OrderedDict[str, None] = collections.OrderedDict()

    def reset(self) -> None:
        """Forget detector state (after a rebalance: the records are replayed from committed offsets)."""
        self.detector = self._detector_factory()
        self.partial.clear()
        self._nodes.clear()

    def _touch(self, node: str) -> None:
        """Note that ``node`` has detector state; forget the quietest node past ``max_nodes``."""
        nodes = self._nodes
        if node in nodes:
            nodes.move_to_end(node)
            return
        nodes[node] = None
        if len(nodes) > self.settings.max_nodes:
            old, _ = nodes.popitem(last=False)
            if old not in self.partial:  # a node mid-fold is kept until its fold is flushed
                self.detector.forget(old)
            else:
                nodes[old] = None

    def candidates(self, values: list[bytes | None], sizes: list[int] | None = None) -> list[int]:
        """Indexes of the records that must be decoded; all others are noise.

        One C-speed substring scan over the whole batch joined by NUL bytes (no marker contains NUL,
        so no match spans two records), instead of a Python-level test per record: the per-record
        cost of the 99.9% noise is then a few bytes of ``join`` and scan.

        ``sizes``: each value's length as the consumer counted it already (aiokafka's
        ``serialized_value_size``, ``_sizes``). It spares a pass that touches every value object only
        for its length, the first touch of fresh records being the costly part of the gate (25-55 of
        ~280 ns a record). Sizes that do not add up to the joined batch are ignored and counted anew.
        """
        n = len(values)
        if n == 0:
            return []
        marked: set[int] = set()
        lengths = sizes if sizes is not None and len(sizes) == n and min(sizes) > 0 else None
        if lengths is not None:
            try:
                buf = b"\x00".join(values)  # type: ignore[arg-type]
            except TypeError:  # a null value the sizes did not say
                lengths = None
            else:
                if sum(lengths) + n - 1 != len(buf):
                    lengths = None
        if lengths is None:
            try:
                lengths = list(map(len, values))
            except TypeError:  # a null value (tombstone): the adapter dead-letters it
                marked.update(i for i, v in enumerate(values) if v is None)
                values = [v or b"" for v in values]
                lengths = list(map(len, values))
            buf = b"\x00".join(values)  # type: ignore[arg-type]
        if min(lengths) == 0 or max(lengths) > MAX_GATE_BYTES:
            # Empty or large payloads go to the adapter (the empty and the oversize become dead letters with a
            # reason); the large ones are left out of the scan (an empty value in their place).
            big = [i for i, size in enumerate(lengths) if size > MAX_GATE_BYTES]
            marked.update(i for i, size in enumerate(lengths) if size == 0)
            if big:
                marked.update(big)
                values = list(values)
                lengths = list(lengths)
                for i in big:
                    values[i], lengths[i] = b"", 0
                buf = b"\x00".join(values)  # type: ignore[arg-type]
        ends: list[int] = []  # ends[i]: bytes of records 0..i, separators left out (C-level accumulate)
        indexes = range(n)

        def record_at(pos: int) -> int:
            # Record i spans [ends[i-1] + i, ends[i] + i) in ``buf``: the first i with ends[i] + i > pos.
            if not ends:
                ends.extend(itertools.accumulate(lengths))
            return bisect.bisect_right(indexes, pos, key=lambda i: ends[i] + i)

        escapes = buf.find(b"\\") != -1  # memchr: most batches hold no backslash at all
        if self._automaton is not None:
            # One pass of the Rust aho-corasick automaton over the batch for all markers at once. Its matches come
            # in order: the rest of a marked record's matches are passed over with one comparison each (a record
            # of 100,000 marker lines cost the gate 0.5 s when each match looked its record up).
            for automaton in (self._automaton, self._escapes) if escapes else (self._automaton,):
                record_end = -1
                for _, pos, _ in automaton.find_matches_as_indexes(buf):
                    if pos < record_end:
                        continue
                    index = record_at(pos)
                    marked.add(index)
                    record_end = ends[index] + index
        else:
            find = buf.find
            for marker in (*self.markers, UNICODE_ESCAPE) if escapes else self.markers:
                pos = find(marker)
                while pos != -1:
                    index = record_at(pos)
                    marked.add(index)
                    # Skip to the next record: one hit per record is enough.
                    pos = find(marker, ends[index] + index + 1) if index + 1 < n else -1
        every = self.settings.shape_check_every
        if every:
            # Sample noise for shape checks so an unknown shipper format shows up as dead letters.
            first = (-self._seen) % every
            marked.update(range(first, n, every))
        self._seen += n
        return sorted(marked)

    def process(
        self,
        records: Sequence[RawRecord] | Sequence[BareRecord],
        now: float | None = None,
        topic: str | None = None,
        partition: int | None = None,
    ) -> BatchResult:
        """Turn one batch of records into events and dead letters.

        ``topic``: all records come from this topic (a getmany partition batch), which saves a
        per-record look at the topic; without it the batch may mix topics. ``partition`` (with
        ``topic``): the records are ``BareRecord``\\s of this partition, and only those that are decoded
        are given their topic and partition (``Located``).
        """
        result = BatchResult(records=len(records))
        now = time.monotonic() if now is None else now
        if partition is not None:
            if topic is None:
                raise ValueError("process: a partition without its topic")
            self._process_bare(records, topic, partition, result, now)  # type: ignore[arg-type]
            return result
        if topic is None:
            health = [r for r in records if r.topic == self.health_topic]
            logs = [r for r in records if r.topic != self.health_topic] if health else records
        elif topic == self.health_topic:
            health, logs = list(records), []
        else:
            health, logs = [], records
        for index in self._within_budget(health, range(len(health)), result):
            self._guarded(health[index], result, now, self._health)
        wanted = self.candidates(list(map(_VALUE, logs)), _sizes(logs))
        result.noise = len(logs) - len(wanted)
        wanted = self._within_budget(logs, wanted, result)
        result.decoded += len(wanted)
        for index in wanted:
            self._guarded(logs[index], result, now, self._decode_and_detect)
        result.events += self.flush_stale(now)
        return result

    def _process_bare(
        self, records: Sequence[BareRecord], topic: str, partition: int, result: BatchResult, now: float
    ) -> None:
        if topic == self.health_topic:
            for index in self._within_budget(records, range(len(records)), result, topic, partition):
                self._guarded(Located(topic, partition, records[index]), result, now, self._health)
        else:
            wanted = self.candidates(list(map(_VALUE, records)))
            result.noise = len(records) - len(wanted)
            wanted = self._within_budget(records, wanted, result, topic, partition)
            result.decoded += len(wanted)
            for index in wanted:
                self._guarded(Located(topic, partition, records[index]), result, now, self._decode_and_detect)
        result.events += self.flush_stale(now)

    def _within_budget(
        self,
        records: Sequence[RawRecord] | Sequence[BareRecord],
        wanted: Sequence[int],
        result: BatchResult,
        topic: str | None = None,
        partition: int | None = None,
    ) -> list[int]:
        """The ``wanted`` records within their node's bytes of this batch (``bounds.budget_by_key``); the others
        become one dead letter per node, which names them and carries the first as its payload."""
        limit = self.settings.max_key_bytes_per_batch
        kept, over = budget_by_key([(i, records[i].key, len(records[i].value or b"")) for i in wanted], limit)
        for key, indexes in over.items():
            first, last = records[indexes[0]], records[indexes[-1]]
            where_topic = topic if topic is not None else first.topic  # type: ignore[union-attr]
            where_partition = partition if partition is not None else first.partition  # type: ignore[union-attr]
            size = sum(len(records[i].value or b"") for i in indexes)
            node = _text(key)
            result.dead_letters.append(
                DeadLetter.of(
                    STAGE,
                    f"node {node}: {len(indexes)} records ({size} bytes) with fault markers past the node's {limit} "
                    f"bytes in one batch (XIDFLOW_PARSE_MAX_KEY_BYTES_PER_BATCH) were not parsed: offsets "
                    f"{first.offset} to {last.offset} of {where_topic}[{where_partition}]; the payload is the first",
                    first.value,
                    DeadLetterCode.NODE_OVER_BUDGET,
                    topic=where_topic,
                    partition=where_partition,
                    offset=first.offset,
                    key=node,
                )
            )
        return kept

    def _guarded(
        self, rec: RawRecord, result: BatchResult, now: float, handler: Callable[[RawRecord, BatchResult, float], None]
    ) -> None:
        try:
            handler(rec, result, now)
        except Exception as exc:  # noqa: BLE001 - the stage never dies on input; the reason says why
            log.exception("parse error at %s[%d]@%d", rec.topic, rec.partition, rec.offset)
            why = f"parse error {type(exc).__name__}: {exc}"
            result.dead_letters.append(_letter(rec, why, DeadLetterCode.PARSE_ERROR))

    def _decode_and_detect(self, rec: RawRecord, result: BatchResult, now: float) -> None:
        most = self.settings.max_lines_per_record
        value, raw_lines = cut_raw_lines(rec.value, most) if rec.value else (rec.value, 0)
        lines, dead = self.decode_record(
            value,
            rec.key,
            rec.headers,
            rec.topic,
            timestamp_ms=rec.timestamp,
            partition=rec.partition,
            offset=rec.offset,
        )
        found = max(raw_lines, cap_lines(lines, most))
        if found > most:
            # The first lines are parsed (a fault among them is still seen); the record, once, says the rest were not.
            dead.append(_letter(
                rec,
                f"{found} lines in one record, past the limit of {most} (XIDFLOW_PARSE_MAX_LINES_PER_RECORD): "
                f"the first {most} were parsed, the rest not; the payload is the input",
                DeadLetterCode.TOO_MANY_LINES,
            ))
        limit = self.settings.max_line_chars
        cut = 0
        for line in lines:
            if not self.prefilter(line.line, line.source):
                continue
            # Bound what this line can become (a fault event carries it twice): cut, with a marker.
            cut += clip_record(line, limit)
            self._touch(line.node)
            events = self.detector.process(line)
            if events:
                result.events += events
                self.partial.pop(line.node, None)
            elif line.node not in self.partial:
                self.partial[line.node] = (rec.topic, rec.partition, rec.offset, now)
        if cut:
            # The whole input, once, where an operator can read what was cut (itself cut to 64 KiB).
            dead.append(_letter(
                rec, f"over-long line: {cut} characters cut to {limit} per line; the payload is the input",
                DeadLetterCode.TRUNCATED,
            ))
        if dead:
            result.dead_letters += cap_dead_letters(dead, self.settings.max_dead_letters_per_record)

    def _health(self, rec: RawRecord, result: BatchResult, now: float) -> None:
        """Probe records are ``HealthCheckResult`` JSON, not log lines: validate, then classify.

        Failed checks are classified by the detector (catalog); passed checks become IGNORE events
        too, because recovery after a reboot needs to see that the checks pass.
        """
        try:
            if rec.value is None:
                raise ValueError("null value")
            check = HealthCheckResult.from_bytes(rec.value)
        except (ValidationError, ValueError) as exc:
            reason = f"not a HealthCheckResult: {str(exc).splitlines()[0]}"
            result.dead_letters.append(_letter(rec, reason, DeadLetterCode.INVALID_RECORD))
            return
        result.decoded += 1
        if check.passed:
            result.events.append(health_event(check))
            return
        line = LogRecord(
            node=check.node,
            source=Source.PROBE,
            ts=check.ts,
            line=rec.value.decode("utf-8", "replace"),
            boot_id=check.boot_id,
            shipper="probe",
        )
        clip_record(line, self.settings.max_line_chars)
        self._touch(line.node)
        result.events += self.detector.process(line) or [health_event(check)]

    def flush_stale(self, now: float) -> list[FaultEvent]:
        """Flush nodes whose partial multi-line message waited longer than the timeout."""
        events: list[FaultEvent] = []
        timeout = self.settings.multiline_timeout_s
        for node, (_, _, _, since) in list(self.partial.items()):
            if now - since >= timeout:
                events += self.detector.flush(node)
                del self.partial[node]
        return events

    def held_offsets(self) -> dict[tuple[str, int], int]:
        """(topic, partition) -> lowest offset still needed by a partial multi-line message."""
        held: dict[tuple[str, int], int] = {}
        for topic, partition, offset, _ in self.partial.values():
            tp = (topic, partition)
            if tp not in held or offset < held[tp]:
                held[tp] = offset
        return held


def _letter(rec: RawRecord, reason: str, code: DeadLetterCode) -> DeadLetter:
    """The dead letter of one record of the parse path: its coordinates, and the record as the payload."""
    return DeadLetter.of(STAGE, reason, rec.value, code, topic=rec.topic, partition=rec.partition, offset=rec.offset,
                         key=_text(rec.key))


def _sizes(records: Sequence[RawRecord]) -> list[int] | None:
    """Value sizes as aiokafka's ``ConsumerRecord`` carries them (``len(value)``, -1 for None), or None."""
    try:
        return list(map(_SIZE, records))
    except AttributeError:  # records of another kind (the replay, tests): ``candidates`` counts the lengths
        return None


def _text(key: bytes | None) -> str | None:
    if key is None:
        return None
    return key.decode("utf-8", "replace")
