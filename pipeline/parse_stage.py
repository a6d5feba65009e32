"""The hot parse path: raw log topics -> fault events keyed by node, malformed input -> dead letters.

Why a batch consumer and not a Faust agent: Faust's per-event machinery (one Event object, one ack,
several awaits per record) caps an agent at a few thousand records/s here, a few % of what the
Kafka client reads. This stage runs inside the Faust worker as a service but talks to Kafka through
aiokafka's batch API (``getmany``) and does per record only what it must:

1. ``ParseCore`` (pure, no I/O) looks at the raw bytes of the whole batch first: a payload that
   contains none of the prefilter's markers (``gate_markers``) cannot carry a line that passes
   ``pipeline.detect.prefilter``, so it is counted as noise without being decoded (99.9% of the
   stream). The scan is one pass of an aho-corasick automaton (``bytes.find`` per marker without it)
   over the batch joined by NUL bytes, so noise costs no Python-level work per record. Markers
   spelled with a JSON escape (``NET\\/``) count as markers; payloads with JSON ``\\u`` escapes, empty,
   null or oversize payloads always take the full path. One record in ``shape_check_every`` is decoded
   anyway, so a shipper sending an unknown shape shows up in the dead-letter topic quickly.
2. Candidates go through ``pipeline.adapters.decode_record`` (LogRecords + DeadLetters), then the
   per-line ``prefilter`` and ``Detector.process``.
3. ``ParseStage`` (I/O) produces the fault events (key = node) and dead letters, waits until the
   broker acknowledged all of them, then commits the batch's offsets. A detector that still holds
   the first lines of a multi-line message keeps the commit of that record's partition behind it,
   so a crash replays those lines instead of losing the fault.

The stage never dies on input: every per-record failure becomes a dead letter with a reason. A record
batch the consumer cannot decode (a codec library missing, a corrupt batch) does not restart it either:
its partition is held or skipped with a dead-letter marker, once, loudly (``pipeline.undecodable``).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import dataclasses
import itertools
import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import (
    CommitFailedError,
    CorruptRecordException,
    InvalidMessageError,
    InvalidTimestampError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
)
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline import kafka_clients, metrics, undecodable, upstream
from pipeline.bounds import DEFAULT_MAX_DEAD_LETTERS, DEFAULT_MAX_LINE_CHARS, cap_dead_letters, clip_record
from pipeline.catalog import Catalog
from pipeline.deadletter_log import DeadLetterReporter
from pipeline.group_membership import leave_on_close
from pipeline.liveness import LIVENESS, Component
from pipeline.settings import ConsumerGroupSettings, TopicNames
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

STAGE = "parse"


PRODUCER_BATCH_BYTES = 512 << 10
"""Producer batch size of the worker's producers (parse stage and Faust): aiokafka's default, 16 KiB,
holds ~24 fault events; the 25th send to a partition then waits until the batch in flight is
acknowledged (one partition, one request in flight), so a burst was sent one round trip at a time."""


class ParseSettings(BaseSettings):
    """Tuning of the parse stage (environment: ``XIDFLOW_PARSE_<FIELD>``)."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_PARSE_", extra="ignore")

    max_records: int = Field(
        default=20_000, ge=1, le=1_000_000, description="Default 20000. Records per getmany batch (1 to 1000000)."
    )
    poll_timeout_ms: int = Field(
        default=50,
        ge=1,
        le=60_000,
        description="Default 50. How long getmany waits for records when none are buffered (1 to 60000).",
    )
    shape_check_every: int = Field(
        default=1000,
        ge=0,
        description="Default 1000. Decode one noise record in this many to catch unknown shapes (0: never).",
    )
    multiline_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=3600,
        description="Default 2. A node whose detector holds a partial multi-line message this long is "
        "flushed, so its fault is emitted and its partition's commit moves on (above 0, at most 3600).",
    )
    fetch_max_bytes: int = Field(
        default=16 << 20,
        ge=1 << 20,
        le=1 << 30,
        description="Default 16 MiB. Consumer fetch_max_bytes (1 MiB to 1 GiB): with max_records, what one "
        "batch may hold in memory (20000 log lines are ~4 MB).",
    )
    fetch_max_wait_ms: int = Field(
        default=50,
        ge=1,
        le=10_000,
        description="Default 50. How long one fetch waits on the broker for data (aiokafka: 500). A partition "
        "drained while such a long poll is in flight is fetched again only when it returns (1 to 10000).",
    )
    max_partition_fetch_bytes: int = Field(
        default=4 << 20,
        ge=1 << 20,
        le=1 << 30,
        description="Default 4 MiB. Consumer max_partition_fetch_bytes (1 MiB to 1 GiB).",
    )
    max_unsettled_batches: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Default 4. Batches parsed ahead of their acknowledgements and commits (commits stay "
        "ordered; 1 to 64).",
    )
    max_unsettled_bytes: int = Field(
        default=32 << 20,
        ge=1 << 20,
        le=4 << 30,
        description="Default 32 MiB. Bytes of fault events and dead letters produced but not yet acknowledged "
        "before parsing waits (1 MiB to 4 GiB).",
    )
    linger_ms: int = Field(default=2, ge=0, le=10_000, description="Default 2. Producer linger for fault events.")
    max_batch_bytes: int = Field(
        default=PRODUCER_BATCH_BYTES,
        ge=16 << 10,
        le=1 << 20,
        description="Default 512 KiB. Producer batch size per partition (16 KiB to 1 MiB; keep it below the "
        "topics' max.message.bytes). A full batch makes the next send wait for the one in flight to be "
        "acknowledged: with aiokafka's 16 KiB a 500-line burst waited for several round trips in a row.",
    )
    dead_letter_log_per_s: float = Field(
        default=10.0, ge=0, description="Default 10. Dead letters logged per second at most (the rest are counted)."
    )
    max_line_chars: int = Field(
        default=DEFAULT_MAX_LINE_CHARS,
        ge=256,
        le=262_144,
        description="Default 4096. Characters kept of one log line that reaches the detector; a longer line is "
        "cut with a marker and its record goes to the dead-letter topic once (256 to 262144).",
    )
    max_dead_letters_per_record: int = Field(
        default=DEFAULT_MAX_DEAD_LETTERS,
        ge=1,
        le=1000,
        description="Default 10. Dead letters one input record yields at most; the last summarises the rest.",
    )
    max_output_bytes: int = Field(
        default=512 << 10,
        ge=16 << 10,
        le=1 << 20,
        description="Default 512 KiB. Largest fault event produced; a bigger one becomes a dead letter "
        "(keep it below the topics' max.message.bytes; 16 KiB to 1 MiB).",
    )
    max_nodes: int = Field(
        default=50_000,
        ge=1,
        le=10_000_000,
        description="Default 50000. Nodes whose detector state (multi-line folds, GPU UUIDs) is kept; past "
        "this the node quiet for longest is forgotten, so made-up node names cannot grow memory.",
    )
    stall_after_s: float = Field(
        default=120.0,
        gt=0,
        le=86_400,
        description="Default 120. /healthz fails when the stage had input waiting and made no progress "
        "(no commit) for this long, or its loop did not run for this long.",
    )


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


@dataclass
class BatchResult:
    """What one batch of raw records turned into."""

    events: list[FaultEvent] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)
    records: int = 0
    noise: int = 0
    decoded: int = 0


MAX_GATE_BYTES = 1 << 20
"""Payloads above this skip the gate (the adapter dead-letters oversize records)."""


def gate_markers() -> tuple[str, ...]:
    """The substrings ``pipeline.detect.prefilter`` looks for, for every source.

    A payload that contains none of them cannot contain a line that passes the prefilter, whatever
    its shape, so it need not be decoded. ``ParseCore`` adds their JSON-escaped spellings
    (``gate_patterns``) and treats any ``\\u`` escape as a possible marker. tests/unit/test_parse_stage.py
    checks this stays equivalent to the prefilter.
    """
    from pipeline.parsing.kernel import NCCL_MARKER, NVRM_MARKER, SXID_MARKER
    from pipeline.parsing.pod import POD_ANCHORS

    return (NVRM_MARKER, SXID_MARKER, NCCL_MARKER, *POD_ANCHORS)


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
            from pipeline import detect

            detector_factory = detector_factory or detect.Detector
            prefilter = prefilter or detect.prefilter
        if decode_record is None:
            from pipeline.adapters import decode_record
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

    def candidates(self, values: list[bytes | None]) -> list[int]:
        """Indexes of the records that must be decoded; all others are noise.

        One C-speed substring scan over the whole batch joined by NUL bytes (no marker contains NUL,
        so no match spans two records), instead of a Python-level test per record: the per-record
        cost of the 99.9% noise is then a few bytes of ``join`` and scan.
        """
        n = len(values)
        if n == 0:
            return []
        marked: set[int] = set()
        try:
            lengths = list(map(len, values))
        except TypeError:  # a null value (tombstone): the adapter dead-letters it
            marked.update(i for i, v in enumerate(values) if v is None)
            values = [v or b"" for v in values]
            lengths = list(map(len, values))
        if min(lengths) == 0 or max(lengths) > MAX_GATE_BYTES:
            # Empty or oversize payloads go to the adapter, which dead-letters them with a reason.
            marked.update(i for i, size in enumerate(lengths) if size == 0 or size > MAX_GATE_BYTES)
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
            # One pass of the Rust aho-corasick automaton over the batch for all markers at once.
            for _, pos, _ in self._automaton.find_matches_as_indexes(buf):
                marked.add(record_at(pos))
            if escapes:
                for _, pos, _ in self._escapes.find_matches_as_indexes(buf):
                    marked.add(record_at(pos))
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

    def process(self, records: Sequence[RawRecord], now: float | None = None, topic: str | None = None) -> BatchResult:
        """Turn one batch of records into events and dead letters.

        ``topic``: all records come from this topic (a getmany partition batch), which saves a
        per-record look at the topic; without it the batch may mix topics.
        """
        result = BatchResult(records=len(records))
        now = time.monotonic() if now is None else now
        if topic is None:
            health = [r for r in records if r.topic == self.health_topic]
            logs = [r for r in records if r.topic != self.health_topic] if health else records
        elif topic == self.health_topic:
            health, logs = list(records), []
        else:
            health, logs = [], records
        for rec in health:
            self._guarded(rec, result, now, self._health)
        wanted = self.candidates(list(map(_VALUE, logs)))
        result.noise = len(logs) - len(wanted)
        result.decoded += len(wanted)
        for index in wanted:
            self._guarded(logs[index], result, now, self._decode_and_detect)
        result.events += self.flush_stale(now)
        return result

    def _guarded(
        self, rec: RawRecord, result: BatchResult, now: float, handler: Callable[[RawRecord, BatchResult, float], None]
    ) -> None:
        try:
            handler(rec, result, now)
        except Exception as exc:  # noqa: BLE001 - the stage never dies on input; the reason says why
            log.exception("parse error at %s[%d]@%d", rec.topic, rec.partition, rec.offset)
            result.dead_letters.append(
                DeadLetter.of(
                    STAGE,
                    f"parse error {type(exc).__name__}: {exc}",
                    rec.value,
                    DeadLetterCode.PARSE_ERROR,
                    topic=rec.topic,
                    partition=rec.partition,
                    offset=rec.offset,
                    key=_text(rec.key),
                )
            )

    def _decode_and_detect(self, rec: RawRecord, result: BatchResult, now: float) -> None:
        lines, dead = self.decode_record(
            rec.value,
            rec.key,
            rec.headers,
            rec.topic,
            timestamp_ms=rec.timestamp,
            partition=rec.partition,
            offset=rec.offset,
        )
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
            dead.append(
                DeadLetter.of(
                    STAGE,
                    f"over-long line: {cut} characters cut to {limit} per line; the payload is the input",
                    rec.value,
                    DeadLetterCode.TRUNCATED,
                    topic=rec.topic,
                    partition=rec.partition,
                    offset=rec.offset,
                    key=_text(rec.key),
                )
            )
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
            result.dead_letters.append(
                DeadLetter.of(
                    STAGE,
                    reason,
                    rec.value,
                    DeadLetterCode.INVALID_RECORD,
                    topic=rec.topic,
                    partition=rec.partition,
                    offset=rec.offset,
                    key=_text(rec.key),
                )
            )
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


def _text(key: bytes | None) -> str | None:
    if key is None:
        return None
    return key.decode("utf-8", "replace")


@dataclass
class StageCounters:
    records: int = 0
    noise: int = 0
    events: int = 0
    dead_letters: int = 0
    batches: int = 0
    commit_failures: int = 0
    outputs_failed: int = 0  # outputs the broker or client refused, replaced by dead letters
    outputs_lost: int = 0  # outputs whose replacement dead letter was refused too (logged)
    dead_letters_skipped: int = 0  # dead letters of replayed records whose letters were already acknowledged
    first_batch_at: float | None = None  # monotonic time the first non-empty batch arrived
    last_batch_at: float | None = None  # monotonic time the last batch was processed and handed to settle
    first_batch_cpu: float | None = None  # process CPU time at the first batch (benchmarks)
    last_batch_cpu: float | None = None
    drained_at: float | None = None  # monotonic time the last commit finished (after run() returns)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, stage: ParseStage) -> None:
        self.stage = stage

    async def on_partitions_revoked(self, revoked: Any) -> None:
        # Commit what is acknowledged before the partitions move, so the next owner replays little.
        try:
            await self.stage.drain()
        except Exception as exc:  # noqa: BLE001 - replay by the next owner covers it
            log.warning("parse: last commit before rebalance failed: %s", exc)
        # Partial multi-line state must not leak into other partitions' output: start over.
        self.stage.core.reset()

    async def on_partitions_assigned(self, assigned: Any) -> None:
        self.stage.assigned = set(assigned)
        self.stage.release_held()
        # Commit positions of partitions owned before are not ours to move any more.
        for tp in [tp for tp in self.stage._ends if tp not in self.stage.assigned]:
            del self.stage._ends[tp]
            self.stage._committed.pop(tp, None)


class ParseStage:
    """Consume the raw topics in batches, produce fault events and dead letters, commit after acks."""

    def __init__(
        self,
        bootstrap: str,
        group_id: str,
        topics: TopicNames | None = None,
        settings: ParseSettings | None = None,
        core: ParseCore | None = None,
        input_topics: list[str] | None = None,
        client_id: str = "xidflow-parse",
        group: ConsumerGroupSettings | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.group_id = group_id
        self.topics = topics or TopicNames()
        self.settings = settings or ParseSettings()
        self.core = core or ParseCore(self.topics, self.settings)
        self.input_topics = input_topics or self.topics.raw_inputs
        self.fault_topic = self.topics.name("fault_events")
        self.dead_topic = self.topics.name("deadletter")
        self.client_id = client_id
        self.group = group or ConsumerGroupSettings()
        self.counters = StageCounters()
        self.assigned: set[TopicPartition] = set()
        self._stopping = asyncio.Event()
        self._dead_letters = DeadLetterReporter(metrics.DEADLETTERS, self.settings.dead_letter_log_per_s)
        self._inflight: collections.deque[asyncio.Task] = collections.deque()
        self._inflight_bytes: collections.deque[int] = collections.deque()  # output bytes of each settle
        # Per input partition: offsets below this had their dead letters acknowledged; a replay of
        # those records (held multi-line commit, restart, rebalance back to us) does not re-send them.
        self._dead_done: dict[tuple[str, int], int] = {}
        # Same, for letters handed to the producer and not failed: a replay while they are in flight
        # (a rebalance) does not send them twice. A failed settle restarts the stage, which falls
        # back to the acknowledged marks.
        self._dead_sent: dict[tuple[str, int], int] = {}
        self._ends: dict[TopicPartition, int] = {}  # end of the last processed batch per partition
        self._committed: dict[TopicPartition, int] = {}  # last offset committed per partition
        self.live: Component = LIVENESS.component(f"parse:{group_id}", self.settings.stall_after_s)
        self.undecodable = undecodable.Undecodable()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self, stop_after: int | None = None) -> StageCounters:
        """Run until ``stop()`` (or until ``stop_after`` records were processed, for benchmarks)."""
        s = self.settings
        self._dead_sent = dict(self._dead_done)  # after a failure: only what was acknowledged counts
        consumer = kafka_clients.consumer(
            bootstrap=self.bootstrap,
            group_id=self.group_id,
            client_id=self.client_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_bytes=s.fetch_max_bytes,
            max_partition_fetch_bytes=s.max_partition_fetch_bytes,
            fetch_max_wait_ms=s.fetch_max_wait_ms,
            **self.group.consumer_options(),
        )
        producer = kafka_clients.producer(
            bootstrap=self.bootstrap,
            client_id=self.client_id,
            acks="all",
            # Not idempotent: aiokafka's idempotent producer cannot go on after the broker refuses one
            # record (MessageSizeTooLarge): the next batch to that partition fails with
            # OutOfOrderSequenceNumber (it has no epoch bump, KIP-360), which would restart the stage
            # for a per-record refusal that must only be a dead letter. Order is kept without it
            # (aiokafka sends one batch per partition at a time); a retry after a lost acknowledgement
            # may repeat a fault event, which the aggregation merges (at-least-once, as everywhere).
            enable_idempotence=False,
            linger_ms=s.linger_ms,
            max_batch_size=s.max_batch_bytes,
        )
        await producer.start()
        self.release_held()  # a new consumer: nothing is paused
        try:
            await consumer.start()
            consumer.subscribe(self.input_topics, listener=_Rebalance(self))
            try:
                while not self._stopping.is_set():
                    self.live.beat()
                    try:
                        batches = await consumer.getmany(timeout_ms=s.poll_timeout_ms, max_records=s.max_records)
                    except Exception as exc:
                        failure = upstream.locate_undecodable(exc)
                        if failure is None:
                            raise  # not a batch: the connection or the broker (the host restarts the stage)
                        await self._undecodable(consumer, producer, failure)
                        continue
                    if batches:
                        await _let_fetcher_run()
                    await self._handle(consumer, producer, batches)
                    if stop_after is not None and self.counters.records >= stop_after:
                        break
                await self.drain()
                self.counters.drained_at = time.monotonic()
            finally:
                for task in self._inflight:
                    task.cancel()
                self._inflight.clear()
                self._inflight_bytes.clear()
                if self.group.leave_on_shutdown:
                    leave_on_close(consumer)
                await consumer.stop()
        finally:
            await producer.stop()
        return self.counters

    async def _handle(
        self,
        consumer: AIOKafkaConsumer,
        producer: AIOKafkaProducer,
        batches: dict[TopicPartition, list[Any]],
    ) -> None:
        now = time.monotonic()
        if not batches:
            # Nothing new: still let stale partial messages out so their faults are not held back,
            # and move the commits they held back (up to the end of what was processed).
            stale = self.core.flush_stale(now)
            behind = self._behind()
            if not stale and not self._inflight and not behind:
                self.live.progressed(now, idle=True)
            outputs = await self._send(producer, stale, [])
            await self._settle(consumer, producer, outputs, behind)
            return
        self.live.busy(now)
        if self.counters.first_batch_at is None:
            self.counters.first_batch_at = now
            self.counters.first_batch_cpu = time.process_time()
        result = BatchResult()
        ends: dict[TopicPartition, int] = {}
        for tp, records in batches.items():
            part = self.core.process(records, now, topic=tp.topic)
            self.live.beat()  # a long batch is work, not a stall
            result.events += part.events
            result.dead_letters += part.dead_letters
            result.records += part.records
            result.noise += part.noise
            ends[tp] = records[-1].offset + 1
            self._ends[tp] = ends[tp]
            # Metrics per batch, not per record: the hot path stays free of per-line bookkeeping.
            metrics.LINES_IN.labels(tp.topic).inc(len(records))
        outputs = await self._send(producer, result.events, result.dead_letters)
        for tp, end in ends.items():
            key = (tp.topic, tp.partition)
            if end > self._dead_sent.get(key, -1):
                self._dead_sent[key] = end
        c = self.counters
        c.records += result.records
        c.noise += result.noise
        c.events += len(result.events)
        c.dead_letters += len(result.dead_letters)
        c.batches += 1
        await self._settle(consumer, producer, outputs, ends)
        c.last_batch_at = time.monotonic()
        c.last_batch_cpu = time.process_time()

    async def _undecodable(
        self, consumer: AIOKafkaConsumer, producer: AIOKafkaProducer, failure: undecodable.Failure
    ) -> None:
        """A batch of one partition could not be decoded: read up to it, then hold it or skip it.

        aiokafka delivered none of that partition's fetch, not even the good records before the batch:
        they are read first, ``max_records`` stopping right before the batch. Other partitions' records
        stay buffered in the consumer for the next ``getmany``.
        """
        tp = TopicPartition(failure.topic, failure.partition)
        s = self.settings
        for _ in range(APPROACH_ROUNDS):
            self.live.beat()
            if tp not in consumer.assignment():
                return  # moved away meanwhile: its new owner meets the batch
            position = await consumer.position(tp)
            action = self.undecodable.decide(failure, position)
            if action is not undecodable.Action.APPROACH:
                break
            consumer.seek(tp, position)  # drop the half-read fetch: fetch again from the position
            try:
                got = await consumer.getmany(tp, timeout_ms=s.poll_timeout_ms,
                                             max_records=min(failure.first_offset - position, s.max_records))
            except Exception as exc:
                again = upstream.locate_undecodable(exc)
                if again is None:
                    raise
                # Offsets before the batch are not all records (a control batch, compaction): the batch
                # cannot be told apart from what precedes it; treat it as starting at the position.
                failure = dataclasses.replace(again, first_offset=min(position, again.first_offset))
                continue
            if got.get(tp):
                await self._handle(consumer, producer, {tp: got[tp]})
        else:
            return  # not there yet: the next getmany meets the batch again
        if action is undecodable.Action.RETRY:
            log.debug("undecodable batch at %s[%d]@%s: fetching it once more", tp.topic, tp.partition, failure.offsets)
            consumer.seek(tp, position)
            return
        first = self.undecodable.first_report(failure)
        text = failure.describe(action)
        topic_label = metrics.bounded(tp.topic, self.input_topics)
        if first:
            log.error("parse: %s", text)
            metrics.UNDECODABLE_BATCHES.labels(STAGE, topic_label, failure.reason.value).inc()
        if action is undecodable.Action.HOLD:
            consumer.pause(tp)
            self.undecodable.hold(failure)
            self.live.fault(f"{tp.topic}[{tp.partition}]", text)
            self._held_gauges()
            return
        # SKIP: the marker first, durable, then the commit past the batch, then read on after it.
        resume = self.undecodable.resume_after(failure)
        letter = DeadLetter.of(STAGE, text, None, DeadLetterCode.UNDECODABLE, topic=tp.topic,
                               partition=tp.partition, offset=failure.first_offset)
        await self.drain()  # commits stay in order
        await (await producer.send(self.dead_topic, letter.to_bytes()))
        metrics.DEADLETTERS.labels(STAGE, DeadLetterCode.UNDECODABLE.value).inc()
        self.counters.dead_letters += 1
        self._ends[tp] = resume
        await self._commit(consumer, {tp: resume})
        consumer.seek(tp, resume)

    def release_held(self) -> None:
        """Partitions are assigned anew (rebalance, restart): nothing is paused any more; a held batch
        is met again, held again, and not logged again."""
        for failure in self.undecodable.release_all():
            self.live.clear(f"{failure.topic}[{failure.partition}]")
        self._held_gauges()

    def _held_gauges(self) -> None:
        per_topic = collections.Counter(metrics.bounded(t, self.input_topics) for t, _ in self.undecodable.held)
        for topic in dict.fromkeys([*self.input_topics, *per_topic]):
            metrics.HELD_PARTITIONS.labels(STAGE, topic).set(per_topic.get(topic, 0))

    async def _settle(
        self,
        consumer: AIOKafkaConsumer,
        producer: AIOKafkaProducer,
        outputs: list[_Output],
        ends: dict[TopicPartition, int],
    ) -> None:
        """Commit this batch once its outputs are acknowledged, overlapped with the next batches.

        Commits stay in order (each settle waits for the one before it); parsing runs at most
        ``max_unsettled_batches`` batches ahead of the broker's acknowledgements and commits. An
        output the broker refuses for what it is (too large, invalid) becomes a dead letter; only a
        failure of the connection itself fails the settle (the stage restarts from the last commit).
        """
        offsets = self._committable(ends)
        while self._inflight and self._inflight[0].done():
            self._inflight_bytes.popleft()
            self._inflight.popleft().result()  # re-raise a connection failure: restart from the last commit
        size = sum(o.size for o in outputs)
        # Bounded work ahead of the broker: batches, and bytes of outputs not yet acknowledged (a batch
        # of large dead letters would otherwise hold hundreds of MB, which the allocator keeps).
        while self._inflight and (
            len(self._inflight) >= self.settings.max_unsettled_batches
            or sum(self._inflight_bytes) + size > self.settings.max_unsettled_bytes
        ):
            self._inflight_bytes.popleft()
            await self._inflight.popleft()
        previous = self._inflight[-1] if self._inflight else None

        async def settle() -> None:
            if previous is not None:
                await previous
            if outputs:
                # Offsets are committed only after every output (or its dead letter) is acknowledged.
                results = await asyncio.gather(*(o.future for o in outputs), return_exceptions=True)
                for out, res in zip(outputs, results, strict=True):
                    if isinstance(res, BaseException):
                        if not _per_record(res):
                            raise res
                        await self._replace(producer, out.fallback, res)
            for tp, end in ends.items():
                key = (tp.topic, tp.partition)
                if end > self._dead_done.get(key, -1):
                    self._dead_done[key] = end
            if await self._commit(consumer, offsets):
                self.live.progressed()

        self._inflight.append(asyncio.ensure_future(settle()))
        self._inflight_bytes.append(size)

    async def drain(self) -> None:
        """Wait until every processed batch is acknowledged and committed."""
        while self._inflight:
            self._inflight_bytes.popleft()
            await self._inflight.popleft()

    async def _send(
        self, producer: AIOKafkaProducer, events: list[FaultEvent], dead: list[DeadLetter]
    ) -> list[_Output]:
        """Hand every output to the producer; one that cannot even be sent is replaced at once."""
        outputs: list[_Output] = []
        limit = self.settings.max_output_bytes
        for ev in events:
            fallback = _event_letter(ev)
            try:
                data = ev.to_bytes()
                if len(data) > limit:
                    raise OutputTooLarge(f"{len(data)} bytes > max_output_bytes {limit}")
                future = await producer.send(self.fault_topic, data, key=ev.node.encode())
            except Exception as exc:  # noqa: BLE001 - a record's failure is that record's dead letter
                if not _per_record(exc):
                    raise
                await self._replace(producer, fallback, exc)
                continue
            metrics.FAULT_EVENTS.labels(ev.kind.value).inc()
            outputs.append(_Output(future, fallback, len(data)))
        for dl in dead:
            if dl.partition is not None and dl.offset is not None and dl.topic is not None:
                if dl.offset < self._dead_sent.get((dl.topic, dl.partition), -1):
                    self.counters.dead_letters_skipped += 1
                    continue
            self._dead_letters.report(dl)
            fallback = _letter_letter(dl)
            try:
                data = dl.to_bytes()
                if len(data) > limit:
                    raise OutputTooLarge(f"{len(data)} bytes > max_output_bytes {limit}")
                future = await producer.send(self.dead_topic, data, key=dl.key.encode() if dl.key else None)
            except Exception as exc:  # noqa: BLE001 - as above
                if not _per_record(exc):
                    raise
                await self._replace(producer, fallback, exc)
                continue
            outputs.append(_Output(future, fallback, len(data)))
        return outputs

    async def _replace(self, producer: AIOKafkaProducer, fallback: Callable[[BaseException, int], DeadLetter],
                       exc: BaseException) -> None:
        """Produce the dead letter that replaces a refused output: with a short payload, then none.

        Never raises for the record: when even the bare letter is refused, it is logged and counted.
        """
        self.counters.outputs_failed += 1
        metrics.OUTPUT_FAILURES.inc()
        for max_payload in (4096, 0):
            letter = fallback(exc, max_payload)
            try:
                key = letter.key.encode() if letter.key else None
                await (await producer.send(self.dead_topic, letter.to_bytes(), key=key))
            except Exception as again:  # noqa: BLE001
                if not _per_record(again):
                    raise
                exc = again
                continue
            self._dead_letters.report(letter)
            return
        self.counters.outputs_lost += 1
        metrics.OUTPUTS_LOST.inc()
        log.error("parse: output refused and its dead letter refused too (%s: %s)", type(exc).__name__, exc)

    def _behind(self) -> dict[TopicPartition, int]:
        """Processed ends of owned partitions whose commit lags (a held multi-line start was flushed)."""
        behind: dict[TopicPartition, int] = {}
        if not self._ends:
            return behind
        for tp, offset in self._committable(self._ends).items():
            if tp in self.assigned and offset > self._committed.get(tp, -1):
                behind[tp] = self._ends[tp]
        return behind

    def _committable(self, ends: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        held = self.core.held_offsets()
        offsets = dict(ends)
        for (topic, partition), offset in held.items():
            tp = TopicPartition(topic, partition)
            if tp in offsets:
                offsets[tp] = min(offsets[tp], offset)
        return offsets

    async def _commit(self, consumer: AIOKafkaConsumer, offsets: dict[TopicPartition, int]) -> bool:
        """Commit; True when done (or nothing to commit)."""
        if not offsets:
            return True
        try:
            await consumer.commit(offsets)
            self._committed.update(offsets)
            return True
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance took the partitions away: the new owner replays from the last commit
            # (at-least-once; deterministic event ids make the replay harmless downstream).
            self.counters.commit_failures += 1
            log.warning("parse commit failed (%s); records will be replayed by the partition owner", exc)
            return False


APPROACH_ROUNDS = 50
"""Fetches of the good records before an undecodable batch, at most, before the stage goes on (and meets
the batch again at the next ``getmany``)."""


async def _let_fetcher_run() -> None:
    """A few turns of the event loop before a batch is parsed, so the next fetch is on the wire meanwhile.

    Draining a partition's fetched records wakes aiokafka's fetch task, which needs three loop turns
    (wake up, plan the requests, start the request task) to send the next fetch; parsing the batch
    first would hold the request back by the whole parse time and serialise fetch and parse.
    """
    for _ in range(3):
        await asyncio.sleep(0)


class OutputTooLarge(ValueError):
    """An output is larger than ``max_output_bytes`` (the broker would refuse it)."""


PER_RECORD_ERRORS: tuple[type[BaseException], ...] = (
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
    CorruptRecordException,
    InvalidMessageError,
    InvalidTimestampError,
)
"""Kafka errors about one record (not the connection): the record's output becomes a dead letter."""


def _per_record(exc: BaseException) -> bool:
    """A failure of this output alone (refused record, serialisation), not of the connection."""
    if isinstance(exc, PER_RECORD_ERRORS):
        return True
    return isinstance(exc, Exception) and not isinstance(exc, KafkaError)


@dataclass(slots=True)
class _Output:
    future: asyncio.Future
    fallback: Callable[[BaseException, int], DeadLetter]
    size: int = 0


def _event_letter(ev: FaultEvent) -> Callable[[BaseException, int], DeadLetter]:
    def make(exc: BaseException, max_payload: int) -> DeadLetter:
        return DeadLetter.of(
            STAGE,
            f"fault event {ev.id} ({ev.kind.value}) could not be produced: {type(exc).__name__}: {exc}",
            ev.line,
            DeadLetterCode.OUTPUT_FAILED,
            max_payload=max_payload,
            key=ev.node,
        )

    return make


def _letter_letter(dl: DeadLetter) -> Callable[[BaseException, int], DeadLetter]:
    def make(exc: BaseException, max_payload: int) -> DeadLetter:
        return DeadLetter.of(
            dl.stage,
            f"{dl.reason} [dead letter refused: {type(exc).__name__}: {exc}]",
            dl.payload,
            dl.code,
            max_payload=max_payload,
            topic=dl.topic,
            partition=dl.partition,
            offset=dl.offset,
            key=dl.key,
        )

    return make
