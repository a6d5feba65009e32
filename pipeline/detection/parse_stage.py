"""The parse stage: raw log topics -> fault events keyed by node, malformed input -> dead letters.

Why a batch consumer and not a Faust agent: Faust's per-event machinery (one Event object, one ack,
several awaits per record) caps an agent at a few thousand records/s here, a few % of what the
Kafka client reads. This stage runs inside the Faust worker as a service but talks to Kafka through
aiokafka's batch API (``getmany``) and does per record only what it must. Its consumer hands out the
records as aiokafka decoded them from their batches, without the ``ConsumerRecord`` it builds for each
(``pipeline.kafka.upstream.deliver_bare_records``; the stage reads every record's value, the rest only
of the few it decodes):

1. ``pipeline.detection.parse_core.ParseCore`` (pure, no I/O) looks at the raw bytes of the whole batch first:
   a payload that contains none of the prefilter's markers cannot carry a line that passes
   ``pipeline.detection.detector.prefilter``, so it is counted as noise without being decoded (99.9% of the
   stream; the marker gate is described there).
2. Candidates go through ``pipeline.ingest.adapters.decode_record`` (LogRecords + DeadLetters), then the
   per-line ``prefilter`` and ``Detector.process`` (also in ``ParseCore``).
3. ``ParseStage`` (this module, the I/O) produces the fault events (key = node) and dead letters
   (``pipeline.detection.parse_outputs``), waits until the broker acknowledged all of them, then commits the
   batch's offsets. A detector that still holds the first lines of a multi-line message keeps the
   commit of that record's partition behind it, so a crash replays those lines instead of losing the
   fault.

The stage never dies on input: every per-record failure becomes a dead letter with a reason. A record
batch the consumer cannot decode (a codec library missing, a corrupt batch) does not restart it either:
its partition is held or skipped with a dead-letter marker, once, loudly (``pipeline.kafka.undecodable``).
Tuning: ``pipeline.detection.parse_settings.ParseSettings``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import CommitFailedError, KafkaError

from pipeline.detection.parse_core import STAGE, BatchResult, ParseCore
from pipeline.detection.parse_outputs import Output, OutputSender, StageCounters, per_record
from pipeline.detection.parse_settings import ParseSettings
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka import undecodable, undecodable_fetch, upstream
from pipeline.kafka.fetch_watchdog import IDLE_FETCH_MAX_WAIT_MS
from pipeline.kafka.membership import leave_on_close
from pipeline.kafka.partitioner import KeyPartitioner
from pipeline.runtime import metrics
from pipeline.runtime.liveness import LIVENESS, Component
from pipeline.runtime.settings import ConsumerGroupSettings, TopicNames
from pipeline.runtime.startmarks import mark
from schemas.records import DeadLetter, DeadLetterCode

log = logging.getLogger("xidflow.parse")


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
        mark("parse_assigned")
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
        self._inflight: collections.deque[asyncio.Task] = collections.deque()
        self._inflight_bytes: collections.deque[int] = collections.deque()  # output bytes of each settle
        self.outputs = OutputSender(self.fault_topic, self.dead_topic, self.settings, self.counters)
        self._ends: dict[TopicPartition, int] = {}  # end of the last processed batch per partition
        self._committed: dict[TopicPartition, int] = {}  # last offset committed per partition
        self.live: Component = LIVENESS.component(f"parse:{group_id}", self.settings.stall_after_s)
        self.undecodable = undecodable.Undecodable()
        self.partitioner = KeyPartitioner()  # kept across restarts of run(): the fleet's node names, hashed once

    def stop(self) -> None:
        self._stopping.set()

    async def run(self, stop_after: int | None = None) -> StageCounters:
        """Run until ``stop()`` (or until ``stop_after`` records were processed, for benchmarks)."""
        s = self.settings
        self.outputs.restart()  # after a failure: only what was acknowledged counts
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
            partitioner=self.partitioner,
        )
        await producer.start()
        self.release_held()  # a new consumer: nothing is paused
        try:
            await consumer.start()
            # Records as aiokafka decoded them, without the ConsumerRecord it builds for each: the stage
            # reads every record's value, the rest only of the few it decodes (ParseCore.process).
            upstream.deliver_bare_records(consumer)
            # Idle, one fetch of every partition waits long on the broker instead of 20 short ones a second.
            upstream.long_poll_when_idle(consumer, max(IDLE_FETCH_MAX_WAIT_MS, s.fetch_max_wait_ms))
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
                        # Other partitions' records this getmany took before the failure: their
                        # positions are past them already, so they are processed now or never.
                        if drained := upstream.drained_before(exc):
                            await self._handle(consumer, producer, drained)
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
        batches: dict[TopicPartition, list[upstream.BareRecord]],
    ) -> None:
        now = time.monotonic()
        if not batches:
            # Nothing new: still let stale partial messages out so their faults are not held back,
            # and move the commits they held back (up to the end of what was processed).
            stale = self.core.flush_stale(now)
            behind = self._behind()
            if not stale and not behind:
                # Nothing to produce or commit: no settle (each empty poll made one that committed nothing).
                self._reap()
                if not self._inflight:
                    self.live.progressed(now, idle=True)
                return
            outputs = await self.outputs.send(producer, stale, [])
            await self._settle(consumer, producer, outputs, behind)
            return
        self.live.busy(now)
        if self.counters.first_batch_at is None:
            self.counters.first_batch_at = now
            self.counters.first_batch_cpu = time.process_time()
            # Fetched before the clock started: benchmarks leave them out of the rate.
            self.counters.first_batch_records = sum(map(len, batches.values()))
        result = BatchResult()
        ends: dict[TopicPartition, int] = {}
        for tp, records in batches.items():
            part = self.core.process(records, now, topic=tp.topic, partition=tp.partition)
            self.live.beat()  # a long batch is work, not a stall
            result.events += part.events
            result.dead_letters += part.dead_letters
            result.records += part.records
            result.noise += part.noise
            ends[tp] = records[-1].offset + 1
            self._ends[tp] = ends[tp]
            # Metrics per batch, not per record: the hot path stays free of per-line bookkeeping.
            metrics.LINES_IN.labels(tp.topic).inc(len(records))
        outputs = await self.outputs.send(producer, result.events, result.dead_letters)
        self.outputs.sent(ends)
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
        decision = await undecodable_fetch.approach(
            consumer, self.undecodable, failure, lambda got: self._handle(consumer, producer, got),
            poll_timeout_ms=self.settings.poll_timeout_ms, max_records=self.settings.max_records,
            beat=self.live.beat)
        if decision is None:
            return
        action, failure, position = decision.action, decision.failure, decision.position
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
        outputs: list[Output],
        ends: dict[TopicPartition, int],
    ) -> None:
        """Commit this batch once its outputs are acknowledged, overlapped with the next batches.

        Commits stay in order (each settle waits for the one before it); parsing runs at most
        ``max_unsettled_batches`` batches ahead of the broker's acknowledgements and commits. An
        output the broker refuses for what it is (too large, invalid) becomes a dead letter; only a
        failure of the connection itself fails the settle (the stage restarts from the last commit).
        """
        offsets = self._committable(ends)
        self._reap()
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
                        if not per_record(res):
                            raise res
                        await self.outputs.replace(producer, out.fallback, res)
            self.outputs.acknowledged(ends)
            if await self._commit(consumer, offsets):
                self.live.progressed()

        self._inflight.append(asyncio.ensure_future(settle()))
        self._inflight_bytes.append(size)

    def _reap(self) -> None:
        """Forget the settles that are done, oldest first."""
        while self._inflight and self._inflight[0].done():
            self._inflight_bytes.popleft()
            self._inflight.popleft().result()  # re-raise a connection failure: restart from the last commit

    async def drain(self) -> None:
        """Wait until every processed batch is acknowledged and committed."""
        while self._inflight:
            self._inflight_bytes.popleft()
            await self._inflight.popleft()

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


async def _let_fetcher_run() -> None:
    """A few turns of the event loop before a batch is parsed, so the next fetch is on the wire meanwhile.

    Draining a partition's fetched records wakes aiokafka's fetch task, which needs three loop turns
    (wake up, plan the requests, start the request task) to send the next fetch; parsing the batch
    first would hold the request back by the whole parse time and serialise fetch and parse.
    """
    for _ in range(3):
        await asyncio.sleep(0)

