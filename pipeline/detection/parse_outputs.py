"""What the parse stage produces, and what happens when the broker refuses it.

``pipeline.detection.parse_stage.ParseStage`` hands each batch's fault events and dead letters (from
``pipeline.detection.parse_core.ParseCore``) to ``OutputSender.send``, and waits on the returned ``Output``
futures before it commits. An output the broker or the client refuses for what it is (too large,
invalid: ``per_record``) is replaced by a dead letter saying why, with a short payload and then none
(``OutputSender.replace``); a failure of the connection itself is raised, and the stage restarts from
its last commit. ``OutputSender`` also keeps, per input partition, up to where dead letters were
handed to the producer and acknowledged, so a replay of those records does not send them twice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiokafka import AIOKafkaProducer
from aiokafka.errors import (
    CorruptRecordException,
    InvalidMessageError,
    InvalidTimestampError,
    KafkaError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    RecordTooLargeError,
)

from pipeline.detection.parse_core import STAGE
from pipeline.detection.parse_settings import ParseSettings
from pipeline.runtime import metrics
from pipeline.runtime.deadletter_log import DeadLetterReporter
from schemas.records import DeadLetter, DeadLetterCode, FaultEvent

if TYPE_CHECKING:
    from aiokafka import TopicPartition

log = logging.getLogger("xidflow.parse")


@dataclass
class StageCounters:
    """What the parse stage did (benchmarks and tests read it); the outputs count their failures here too."""

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
    first_batch_records: int = 0  # records of that first batch: fetched before first_batch_at (benchmarks)
    last_batch_at: float | None = None  # monotonic time the last batch was processed and handed to settle
    first_batch_cpu: float | None = None  # process CPU time at the first batch (benchmarks)
    last_batch_cpu: float | None = None
    drained_at: float | None = None  # monotonic time the last commit finished (after run() returns)


class OutputSender:
    """Hands fault events and dead letters to the producer; replaces refused ones with dead letters."""

    def __init__(self, fault_topic: str, dead_topic: str, settings: ParseSettings, counters: StageCounters) -> None:
        self.fault_topic = fault_topic
        self.dead_topic = dead_topic
        self.settings = settings
        self.counters = counters
        self._dead_letters = DeadLetterReporter(metrics.DEADLETTERS, settings.dead_letter_log_per_s)
        # Per input partition: offsets below this had their dead letters acknowledged; a replay of
        # those records (held multi-line commit, restart, rebalance back to us) does not re-send them.
        self._dead_done: dict[tuple[str, int], int] = {}
        # Same, for letters handed to the producer and not failed: a replay while they are in flight
        # (a rebalance) does not send them twice. A failed settle restarts the stage, which falls
        # back to the acknowledged marks.
        self._dead_sent: dict[tuple[str, int], int] = {}

    def restart(self) -> None:
        """A new run of the stage (after a failure): only what was acknowledged counts as sent."""
        self._dead_sent = dict(self._dead_done)

    def sent(self, ends: Mapping[TopicPartition, int]) -> None:
        """The dead letters of records below ``ends`` were handed to the producer."""
        for tp, end in ends.items():
            key = (tp.topic, tp.partition)
            if end > self._dead_sent.get(key, -1):
                self._dead_sent[key] = end

    def acknowledged(self, ends: Mapping[TopicPartition, int]) -> None:
        """The dead letters of records below ``ends`` were acknowledged by the broker."""
        for tp, end in ends.items():
            key = (tp.topic, tp.partition)
            if end > self._dead_done.get(key, -1):
                self._dead_done[key] = end

    async def send(
        self, producer: AIOKafkaProducer, events: list[FaultEvent], dead: list[DeadLetter]
    ) -> list[Output]:
        """Hand every output to the producer; one that cannot even be sent is replaced at once."""
        outputs: list[Output] = []
        limit = self.settings.max_output_bytes
        for ev in events:
            fallback = _event_letter(ev)
            try:
                data = ev.to_bytes()
                if len(data) > limit:
                    raise OutputTooLarge(f"{len(data)} bytes > max_output_bytes {limit}")
                future = await producer.send(self.fault_topic, data, key=ev.node.encode())
            except Exception as exc:  # noqa: BLE001 - a record's failure is that record's dead letter
                if not per_record(exc):
                    raise
                await self.replace(producer, fallback, exc)
                continue
            metrics.FAULT_EVENTS.labels(ev.kind.value).inc()
            outputs.append(Output(future, fallback, len(data)))
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
                if not per_record(exc):
                    raise
                await self.replace(producer, fallback, exc)
                continue
            outputs.append(Output(future, fallback, len(data)))
        return outputs

    async def replace(self, producer: AIOKafkaProducer, fallback: Callable[[BaseException, int], DeadLetter],
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
                if not per_record(again):
                    raise
                exc = again
                continue
            self._dead_letters.report(letter)
            return
        self.counters.outputs_lost += 1
        metrics.OUTPUTS_LOST.inc()
        log.error("parse: output refused and its dead letter refused too (%s: %s)", type(exc).__name__, exc)


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


def per_record(exc: BaseException) -> bool:
    """A failure of this output alone (refused record, serialisation), not of the connection."""
    if isinstance(exc, PER_RECORD_ERRORS):
        return True
    return isinstance(exc, Exception) and not isinstance(exc, KafkaError)


@dataclass(slots=True)
class Output:
    """One output handed to the producer: its delivery future, the dead letter that replaces it, its size."""

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
