"""The hot parse path: raw log topics -> fault events keyed by node, malformed input -> dead letters.

Why a batch consumer and not a Faust agent: Faust's per-event machinery (one Event object, one ack,
several awaits per record) caps an agent at a few thousand records/s here, a few % of what the
Kafka client reads. This stage runs inside the Faust worker as a service but talks to Kafka through
aiokafka's batch API (``getmany``) and does per record only what it must:

1. ``ParseCore`` (pure, no I/O) looks at the raw bytes of the whole batch first: a payload that
   contains none of the prefilter's markers (``gate_markers``) cannot carry a line that passes
   ``pipeline.detect.prefilter``, so it is counted as noise without being decoded (99.9% of the
   stream). The scan is one ``bytes.find`` loop per marker over the batch joined by NUL bytes, so
   noise costs no Python-level work per record. Payloads with JSON ``\\u`` escapes, empty, null or
   oversize payloads always take the full path. One record in ``shape_check_every`` is decoded
   anyway, so a shipper sending an unknown shape shows up in the dead-letter topic quickly.
2. Candidates go through ``pipeline.adapters.decode_record`` (LogRecords + DeadLetters), then the
   per-line ``prefilter`` and ``Detector.process``.
3. ``ParseStage`` (I/O) produces the fault events (key = node) and dead letters, waits until the
   broker acknowledged all of them, then commits the batch's offsets. A detector that still holds
   the first lines of a multi-line message keeps the commit of that record's partition behind it,
   so a crash replays those lines instead of losing the fault.

The stage never dies on input: every per-record failure becomes a dead letter with a reason.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline import metrics
from pipeline.catalog import Catalog
from pipeline.group_membership import leave_on_close
from pipeline.settings import ConsumerGroupSettings, TopicNames
from schemas.records import (
    Action,
    DeadLetter,
    FaultEvent,
    FaultKind,
    HealthCheckResult,
    LogRecord,
    Severity,
    Source,
    stable_id,
)

log = logging.getLogger("xidflow.parse")

STAGE = "parse"


class ParseSettings(BaseSettings):
    """Tuning of the parse stage (environment: ``XIDFLOW_PARSE_<FIELD>``)."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_PARSE_", extra="ignore")

    max_records: int = Field(default=20_000, description="Default 20000. Records per getmany batch.")
    poll_timeout_ms: int = Field(
        default=50, description="Default 50. How long getmany waits for records when none are buffered."
    )
    shape_check_every: int = Field(
        default=1000,
        description="Default 1000. Decode one noise record in this many to catch unknown shapes (0: never).",
    )
    multiline_timeout_s: float = Field(
        default=2.0,
        description="Default 2. A node whose detector holds a partial multi-line message this long is "
        "flushed, so its fault is emitted and its partition's commit moves on.",
    )
    fetch_max_bytes: int = Field(default=64 << 20, description="Default 64 MiB. Consumer fetch_max_bytes.")
    max_partition_fetch_bytes: int = Field(
        default=16 << 20, description="Default 16 MiB. Consumer max_partition_fetch_bytes."
    )
    max_unsettled_batches: int = Field(
        default=4,
        description="Default 4. Batches parsed ahead of their acknowledgements and commits (commits stay ordered).",
    )
    linger_ms: int = Field(default=2, description="Default 2. Producer linger for fault events.")
    dead_letter_log_per_s: float = Field(
        default=10.0, description="Default 10. Dead letters logged per second at most (the rest are counted)."
    )


class DetectorLike(Protocol):
    def process(self, record: LogRecord) -> list[FaultEvent]: ...

    def flush(self, node: str | None = None) -> list[FaultEvent]: ...


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
    its shape, so it need not be decoded. ``b"\\u"`` is added by ``ParseCore``: a JSON unicode escape
    could hide a marker. tests/unit/test_parse_stage.py checks this stays equivalent to the prefilter.
    """
    from pipeline.parsing.kernel import NCCL_MARKER, NVRM_MARKER, SXID_MARKER
    from pipeline.parsing.pod import POD_ANCHORS

    return (NVRM_MARKER, SXID_MARKER, NCCL_MARKER, *POD_ANCHORS)


def _automaton(markers: Sequence[bytes]) -> Any:
    """A multi-pattern matcher (``ahocorasick_rs``), or None where it is not installed.

    Without it the gate falls back to one ``bytes.find`` pass per marker: same answers, ~4x slower.
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
        self.markers: tuple[bytes, ...] = tuple(m.encode() for m in (markers or gate_markers())) + (b"\\u",)
        self._automaton = _automaton(self.markers) if use_automaton else None
        # node -> (topic, partition, offset, first-seen monotonic time) of the oldest record whose
        # lines may still sit in the detector as the start of a multi-line message.
        self.partial: dict[str, tuple[str, int, int, float]] = {}

    def reset(self) -> None:
        """Forget detector state (after a rebalance: the records are replayed from committed offsets)."""
        self.detector = self._detector_factory()
        self.partial.clear()

    def candidates(self, values: list[bytes | None]) -> list[int]:
        """Indexes of the records that must be decoded; all others are noise.

        One C-speed substring scan per marker over the whole batch joined by NUL bytes (no marker
        contains NUL, so no match spans two records), instead of a Python-level test per record:
        the per-record cost of the 99.9% noise is then a few bytes of ``join`` and ``find``.
        """
        n = len(values)
        if n == 0:
            return []
        marked: set[int] = set()
        if None in values:
            marked.update(i for i, v in enumerate(values) if v is None)
            values = [v or b"" for v in values]
        lengths = list(map(len, values))
        if 0 in lengths or max(lengths) > MAX_GATE_BYTES:
            # Empty or oversize payloads go to the adapter, which dead-letters them with a reason.
            marked.update(i for i, size in enumerate(lengths) if size == 0 or size > MAX_GATE_BYTES)
        buf = b"\x00".join(values)  # type: ignore[arg-type]
        starts: list[int] = []

        def record_at(pos: int) -> int:
            if not starts:
                starts.extend(itertools.accumulate((size + 1 for size in lengths), initial=0))
            return bisect.bisect_right(starts, pos) - 1

        if self._automaton is not None:
            # One pass of the Rust aho-corasick automaton over the batch for all markers at once.
            for _, pos, _ in self._automaton.find_matches_as_indexes(buf):
                marked.add(record_at(pos))
        else:
            find = buf.find
            for marker in self.markers:
                pos = find(marker)
                while pos != -1:
                    index = record_at(pos)
                    marked.add(index)
                    # Skip to the next record: one hit per record is enough.
                    pos = find(marker, starts[index + 1]) if index + 1 < n else -1
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
        wanted = self.candidates([r.value for r in logs])
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
        result.dead_letters += dead
        for line in lines:
            if not self.prefilter(line.line, line.source):
                continue
            events = self.detector.process(line)
            if events:
                result.events += events
                self.partial.pop(line.node, None)
            elif line.node not in self.partial:
                self.partial[line.node] = (rec.topic, rec.partition, rec.offset, now)

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
        self._dead_log_budget = 0.0
        self._dead_log_at = time.monotonic()
        self._dead_suppressed = 0
        self._inflight: collections.deque[asyncio.Task] = collections.deque()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self, stop_after: int | None = None) -> StageCounters:
        """Run until ``stop()`` (or until ``stop_after`` records were processed, for benchmarks)."""
        from pipeline import kafka_clients

        s = self.settings
        consumer = kafka_clients.consumer(
            bootstrap=self.bootstrap,
            group_id=self.group_id,
            client_id=self.client_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_bytes=s.fetch_max_bytes,
            max_partition_fetch_bytes=s.max_partition_fetch_bytes,
            **self.group.consumer_options(),
        )
        producer = kafka_clients.producer(
            bootstrap=self.bootstrap,
            client_id=self.client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=s.linger_ms,
        )
        await producer.start()
        try:
            await consumer.start()
            consumer.subscribe(self.input_topics, listener=_Rebalance(self))
            try:
                while not self._stopping.is_set():
                    batches = await consumer.getmany(timeout_ms=s.poll_timeout_ms, max_records=s.max_records)
                    await self._handle(consumer, producer, batches)
                    if stop_after is not None and self.counters.records >= stop_after:
                        break
                await self.drain()
                self.counters.drained_at = time.monotonic()
            finally:
                for task in self._inflight:
                    task.cancel()
                self._inflight.clear()
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
            # Nothing new: still let stale partial messages out so their faults are not held back.
            stale = self.core.flush_stale(now)
            futures = await self._send(producer, stale, [])
            await self._settle(consumer, futures, {})
            return
        if self.counters.first_batch_at is None:
            self.counters.first_batch_at = now
            self.counters.first_batch_cpu = time.process_time()
        result = BatchResult()
        ends: dict[TopicPartition, int] = {}
        for tp, records in batches.items():
            part = self.core.process(records, now, topic=tp.topic)
            result.events += part.events
            result.dead_letters += part.dead_letters
            result.records += part.records
            result.noise += part.noise
            ends[tp] = records[-1].offset + 1
            # Metrics per batch, not per record: the hot path stays free of per-line bookkeeping.
            metrics.LINES_IN.labels(tp.topic).inc(len(records))
            highwater = consumer.highwater(tp)
            if highwater is not None:
                metrics.CONSUMER_LAG.labels(tp.topic, str(tp.partition)).set(max(0, highwater - ends[tp]))
        futures = await self._send(producer, result.events, result.dead_letters)
        c = self.counters
        c.records += result.records
        c.noise += result.noise
        c.events += len(result.events)
        c.dead_letters += len(result.dead_letters)
        c.batches += 1
        await self._settle(consumer, futures, ends)
        c.last_batch_at = time.monotonic()
        c.last_batch_cpu = time.process_time()

    async def _settle(self, consumer: AIOKafkaConsumer, futures: list[asyncio.Future], ends: dict) -> None:
        """Commit this batch once its outputs are acknowledged, overlapped with the next batches.

        Commits stay in order (each settle waits for the one before it); parsing runs at most
        ``max_unsettled_batches`` batches ahead of the broker's acknowledgements and commits.
        """
        offsets = self._committable(ends)
        while self._inflight and self._inflight[0].done():
            self._inflight.popleft().result()  # re-raise a failed produce: restart from the last commit
        if len(self._inflight) >= self.settings.max_unsettled_batches:
            await self._inflight.popleft()
        previous = self._inflight[-1] if self._inflight else None

        async def settle() -> None:
            if previous is not None:
                await previous
            if futures:
                # Offsets are committed only after every output is acknowledged by the broker.
                await asyncio.gather(*futures)
            await self._commit(consumer, offsets)

        self._inflight.append(asyncio.ensure_future(settle()))

    async def drain(self) -> None:
        """Wait until every processed batch is acknowledged and committed."""
        while self._inflight:
            await self._inflight.popleft()

    async def _send(
        self, producer: AIOKafkaProducer, events: list[FaultEvent], dead: list[DeadLetter]
    ) -> list[asyncio.Future]:
        futures = []
        for ev in events:
            futures.append(await producer.send(self.fault_topic, ev.to_bytes(), key=ev.node.encode()))
            metrics.FAULT_EVENTS.labels(ev.kind.value).inc()
        for dl in dead:
            self._log_dead_letter(dl)
            metrics.DEADLETTERS.labels(dl.stage, dl.reason.split(":", 1)[0][:60]).inc()
            key = dl.key.encode() if dl.key else None
            futures.append(await producer.send(self.dead_topic, dl.to_bytes(), key=key))
        return futures

    def _committable(self, ends: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
        held = self.core.held_offsets()
        offsets = dict(ends)
        for (topic, partition), offset in held.items():
            tp = TopicPartition(topic, partition)
            if tp in offsets:
                offsets[tp] = min(offsets[tp], offset)
        return offsets

    async def _commit(self, consumer: AIOKafkaConsumer, offsets: dict[TopicPartition, int]) -> None:
        if not offsets:
            return
        try:
            await consumer.commit(offsets)
        except (CommitFailedError, KafkaError) as exc:
            # A rebalance took the partitions away: the new owner replays from the last commit
            # (at-least-once; deterministic event ids make the replay harmless downstream).
            self.counters.commit_failures += 1
            log.warning("parse commit failed (%s); records will be replayed by the partition owner", exc)

    def _log_dead_letter(self, dl: DeadLetter) -> None:
        now = time.monotonic()
        rate = self.settings.dead_letter_log_per_s
        self._dead_log_budget = min(rate, self._dead_log_budget + (now - self._dead_log_at) * rate)
        self._dead_log_at = now
        if self._dead_log_budget >= 1:
            self._dead_log_budget -= 1
            extra = f" ({self._dead_suppressed} more not logged)" if self._dead_suppressed else ""
            self._dead_suppressed = 0
            log.warning("dead letter from %s: %s%s", dl.topic, dl.reason, extra)
        else:
            self._dead_suppressed += 1
