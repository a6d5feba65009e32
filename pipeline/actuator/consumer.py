"""The actuator's Kafka side: a consumer group on incidents and rescue requests.

Records of one node are handled in order, one at a time (one in-flight flow per node); different
nodes are handled concurrently. An offset is committed only when it and every earlier offset of its
partition are done - their flow recorded on the node (from then on the reconciler of whichever
replica owns the node finishes it) or, for a record that starts no flow, its effects applied and
audited - so a crash replays, never skips (the effects are idempotent), and a long wait inside a flow
does not hold back its partition. Undecodable records go to the dead-letter topic before their offset
counts as done.

A record batch aiokafka cannot decode (``pipeline.kafka.undecodable``) would escape ``getmany`` on every
fetch: the process would exit and meet it again after each restart. It is handled as in the parse stage
instead: the records other partitions' fetches had already yielded are dispatched, the partition's good
records before the batch are read, and then a corrupt batch is dead-lettered (naming its offsets) and
skipped - its offsets count as done only once the dead letter is durable - while a batch whose codec
library is missing holds (pauses) its partition, uncommitted, until a restart with the library.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from pydantic import ValidationError

from pipeline.actuator import signing
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka import undecodable, undecodable_fetch, upstream
from pipeline.kafka.membership import leave_on_close
from pipeline.runtime import metrics
from pipeline.runtime.deadletter_log import DeadLetterReporter
from pipeline.runtime.liveness import LIVENESS, Component
from pipeline.runtime.settings import ConsumerGroupSettings
from pipeline.runtime.startmarks import mark
from schemas.records import (
    ACTUATOR_INPUT,
    DeadLetter,
    DeadLetterCode,
    FabricSignal,
    NodeIncident,
    NodeRecovered,
    RescueActionRequest,
)

ActuatorRecord = NodeIncident | NodeRecovered | RescueActionRequest | FabricSignal
Handler = Callable[[ActuatorRecord, Callable[[], None]], Awaitable[None]]

log = logging.getLogger("xidflow.actuator.consumer")
STAGE = metrics.ACTUATOR
"""The stage its dead letters name (the metric label ``stage``): the process's own name."""
POLL_TIMEOUT_MS = 200
MAX_RECORDS = 1000


class OffsetTracker:
    """Per partition: offsets handed out and not yet done; what may be committed. Pure."""

    def __init__(self) -> None:
        self._pending: dict[TopicPartition, set[int]] = defaultdict(set)
        self._highest: dict[TopicPartition, int] = {}
        self._committed: dict[TopicPartition, int] = {}

    def started(self, tp: TopicPartition, offset: int) -> None:
        self._pending[tp].add(offset)
        self._highest[tp] = max(self._highest.get(tp, -1), offset)

    def done(self, tp: TopicPartition, offset: int) -> None:
        self._pending[tp].discard(offset)

    @property
    def in_flight(self) -> int:
        return sum(len(p) for p in self._pending.values())

    def committable(self) -> dict[TopicPartition, int]:
        """Next offset to commit per partition, only where it moved: the lowest pending, else highest + 1."""
        out: dict[TopicPartition, int] = {}
        for tp, highest in self._highest.items():
            pending = self._pending.get(tp)
            nxt = min(pending) if pending else highest + 1
            if nxt > self._committed.get(tp, -1):
                out[tp] = nxt
        return out

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        self._committed.update(offsets)

    def forget(self, tps: list[TopicPartition]) -> None:
        for tp in tps:
            self._pending.pop(tp, None)
            self._highest.pop(tp, None)
            self._committed.pop(tp, None)


_TOPIC_TYPES = {
    "incidents": ("incident", "recovered"),
    "requests": ("rescue_request",),
    "fabric": ("fabric_signal",),
}


class UndecodableRecord(ValueError):
    """A record the actuator cannot take, with why as a dead-letter code."""

    def __init__(self, message: str, code: DeadLetterCode) -> None:
        super().__init__(message)
        self.code = code


def decode_record(topic_kind: str, value: bytes) -> ActuatorRecord:
    """An incident-topic record (by its ``type``) or a rescue request; raises UndecodableRecord if neither."""
    if not value:
        raise UndecodableRecord("empty record", DeadLetterCode.EMPTY)
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        raise UndecodableRecord(f"not JSON: {exc}", DeadLetterCode.INVALID_JSON) from None
    if not isinstance(data, dict):
        raise UndecodableRecord("not a JSON object", DeadLetterCode.UNKNOWN_SHAPE)
    if topic_kind == "requests":
        data.setdefault("type", "rescue_request")
    if data.get("type") not in _TOPIC_TYPES[topic_kind]:
        raise UndecodableRecord(f"unknown record type {data.get('type')!r}", DeadLetterCode.UNKNOWN_SHAPE)
    try:
        return _validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        message = f"invalid {data.get('type')}: {first['msg']} at {first['loc']}"
        raise UndecodableRecord(message, DeadLetterCode.INVALID_RECORD) from None


_validate = ACTUATOR_INPUT.validate_python


def node_of(record: ActuatorRecord) -> str:
    return record.node


class ActuatorConsumer:
    """Reads both topics in one group and dispatches records to one worker task per node."""

    def __init__(
        self,
        bootstrap_servers: str,
        group_id: str,
        incidents_topic: str,
        requests_topic: str,
        deadletter_topic: str,
        handle: Handler,
        max_in_flight: int = 5000,
        commit_interval: float = 0.5,
        group: ConsumerGroupSettings | None = None,
        fabric_topic: str | None = None,
    ) -> None:
        self.topics = {incidents_topic: "incidents", requests_topic: "requests"}
        if fabric_topic:  # FabricSignal records for the shared-part correlation (pipeline.actuator.sharedparts)
            self.topics[fabric_topic] = "fabric"
        self.deadletter_topic = deadletter_topic
        self._dead_letters = DeadLetterReporter(metrics.ACTUATOR_DEADLETTERS)
        self.handle = handle
        self.max_in_flight = max_in_flight
        self.commit_interval = commit_interval
        self.group = group or ConsumerGroupSettings()  # static membership, session, heartbeat, poll interval
        self.bootstrap_servers, self.group_id = bootstrap_servers, group_id
        self.consumer: AIOKafkaConsumer | None = None
        self.producer: AIOKafkaProducer | None = None
        self.tracker = OffsetTracker()
        self._queues: dict[str, asyncio.Queue[tuple[TopicPartition, int, Any]]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._commit_lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        # Told which incident partitions this replica owns (the reconciler's sharding).
        self.on_assigned: Callable[[set[int], int], None] | None = None
        self.processed = 0
        self.failed = False
        # Proof of origin (issue 12): rescue requests must carry the decision API's signature.
        self.verifier = signing.Verifier.from_settings()
        self.refuse: Callable[[RescueActionRequest, str], Awaitable[None]] | None = None
        self.undecodable = undecodable.Undecodable()
        self._live: Component | None = None

    async def start(self) -> None:
        self.verifier.say_if_unchecked()  # here, where requests are read: `xidflow reset` builds a consumer too
        # Clients are made here, not in __init__: aiokafka binds them to the running loop.
        self.consumer = kafka_clients.consumer(
            bootstrap=self.bootstrap_servers,
            group_id=self.group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=1000,
            # New topics (and partitions) are noticed within seconds, not the 5-minute default.
            metadata_max_age_ms=5000,
            **self.group.consumer_options(),
        )
        self.producer = kafka_clients.producer(bootstrap=self.bootstrap_servers, acks="all", enable_idempotence=True)
        await self.producer.start()
        mark("producer")
        await self.consumer.start()
        mark("consumer_connected")
        self.consumer.subscribe(list(self.topics), listener=_Rebalance(self))

    async def stop(self) -> None:
        self._stopping.set()
        if not self.failed:  # a failed record never finishes: do not wait for it
            await self.drain(timeout_s=30)
        await self.commit()
        for task in self._workers.values():
            task.cancel()
        await asyncio.gather(*self._workers.values(), return_exceptions=True)
        if self.group.leave_on_shutdown:
            leave_on_close(self.consumer)  # orderly stop: partitions move at once (pipeline.kafka.membership)
        await self.consumer.stop()
        await self.producer.stop()

    async def run(self) -> None:
        """Fetch, dispatch and commit until ``stop``."""
        committer = asyncio.create_task(self._commit_loop())
        try:
            while not self._stopping.is_set():
                if self.tracker.in_flight >= self.max_in_flight:
                    # Backpressure: stop fetching until workers catch up.
                    await asyncio.sleep(0.05)
                    continue
                try:
                    batches = await self.consumer.getmany(timeout_ms=POLL_TIMEOUT_MS, max_records=MAX_RECORDS)
                except Exception as exc:
                    failure = upstream.locate_undecodable(exc)
                    if failure is None:
                        raise  # not a batch: the connection or the broker (the process is restarted)
                    # Other partitions' records this getmany took before the failure: their positions
                    # are past them already, so they are dispatched now or never.
                    await self._dispatch_all(upstream.drained_before(exc))
                    await self._undecodable(failure)
                    continue
                if batches:
                    mark("first_records")
                await self._dispatch_all(batches)
        finally:
            committer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await committer

    async def _dispatch_all(self, batches: dict[TopicPartition, list[Any]]) -> None:
        for tp, messages in batches.items():
            for msg in messages:
                await self._dispatch(tp, msg)

    async def _undecodable(self, failure: undecodable.Failure) -> None:
        """A batch of one partition could not be decoded: dispatch up to it, then hold it or skip it."""
        consumer = self.consumer
        decision = await undecodable_fetch.approach(consumer, self.undecodable, failure, self._dispatch_all,
                                                    poll_timeout_ms=POLL_TIMEOUT_MS, max_records=MAX_RECORDS)
        if decision is None:
            return
        action, failure = decision.action, decision.failure
        tp = TopicPartition(failure.topic, failure.partition)
        if action is undecodable.Action.RETRY:
            consumer.seek(tp, decision.position)
            return
        text = failure.describe(action)
        topic_label = metrics.bounded(tp.topic, self.topics)
        if self.undecodable.first_report(failure):
            log.error("actuator: %s", text)
            metrics.UNDECODABLE_BATCHES.labels(STAGE, topic_label, failure.reason.value).inc()
        if action is undecodable.Action.HOLD:
            consumer.pause(tp)  # nothing of it is dispatched, so nothing is committed past the batch
            self.undecodable.hold(failure)
            self._readiness().fault(f"{tp.topic}[{tp.partition}]", text)
            self._held_gauges()
            return
        # SKIP: the dead letter first, durable; only then do the batch's offsets count as done (committed
        # once every earlier offset of the partition is), and the partition reads on after it.
        resume = self.undecodable.resume_after(failure)
        letter = DeadLetter.of(STAGE, text, None, DeadLetterCode.UNDECODABLE, topic=tp.topic,
                               partition=tp.partition, offset=failure.first_offset)
        self._dead_letters.report(letter)
        await self.producer.send_and_wait(self.deadletter_topic, letter.to_bytes())
        self.tracker.started(tp, resume - 1)
        self.tracker.done(tp, resume - 1)
        consumer.seek(tp, resume)

    def release_held(self) -> None:
        """A new assignment resumes every partition (aiokafka forgets pauses): a held batch is met again."""
        for failure in self.undecodable.release_all():
            self._readiness().clear(f"{failure.topic}[{failure.partition}]")
        self._held_gauges()

    def _readiness(self) -> Component:
        """What a held partition makes of ``/healthz``, as in the worker: not ready (naming the partition and
        the fix) while ``/livez`` stays green, since a restart cannot install a codec library and would stop the
        partitions that still flow (``pipeline.runtime.liveness``). Registered at the first hold only."""
        if self._live is None:
            self._live = LIVENESS.component(f"actuator-consumer:{self.group_id}", stall_after_s=float("inf"))
        return self._live

    def _held_gauges(self) -> None:
        held = collections.Counter(metrics.bounded(t, self.topics) for t, _ in self.undecodable.held)
        for topic in dict.fromkeys([*self.topics, *held]):
            metrics.HELD_PARTITIONS.labels(STAGE, topic).set(held.get(topic, 0))

    async def _dispatch(self, tp: TopicPartition, msg: Any) -> None:
        self.tracker.started(tp, msg.offset)
        try:
            record = decode_record(self.topics[tp.topic], msg.value)
        except UndecodableRecord as exc:
            letter = DeadLetter.of(
                STAGE,
                str(exc),
                msg.value,
                exc.code,
                topic=tp.topic,
                partition=tp.partition,
                offset=msg.offset,
                key=msg.key.decode("utf-8", "replace") if msg.key else None,
            )
            self._dead_letters.report(letter)
            await self.producer.send_and_wait(self.deadletter_topic, letter.to_bytes(), key=msg.key)
            self.tracker.done(tp, msg.offset)
            return
        if isinstance(record, RescueActionRequest) and (why := self.verifier.check(msg.key, msg.value, msg.headers)):
            log.warning("refusing rescue request %s for %s: %s", record.request_id, record.node_name, why)
            if self.refuse is not None:  # issue 12: an unsigned or forged request does nothing but its audit
                await self.refuse(record, why)
            self.tracker.done(tp, msg.offset)
            return
        node = node_of(record)
        queue = self._queues.get(node)
        if queue is None:
            queue = self._queues[node] = asyncio.Queue()
            self._workers[node] = asyncio.create_task(self._node_worker(node, queue))
        queue.put_nowait((tp, msg.offset, record))

    async def _node_worker(self, node: str, queue: asyncio.Queue[tuple[TopicPartition, int, Any]]) -> None:
        while True:
            try:
                tp, offset, record = await asyncio.wait_for(queue.get(), timeout=60)
            except TimeoutError:
                if queue.empty():  # idle node: free its task; a later record starts a new one
                    self._queues.pop(node, None)
                    self._workers.pop(node, None)
                    return
                continue
            durable = _Once(self.tracker, tp, offset)
            try:
                await self.handle(record, durable)
            except Exception:
                # Unexpected bug: the record is retried by the next consumer after a restart, not skipped.
                log.exception("handling %s for %s failed; not committing it", record.type, node)
                self.failed = True
                self._stopping.set()
                raise
            durable()
            self.processed += 1
            mark("first_handled")

    async def commit(self) -> None:
        async with self._commit_lock:
            offsets = self.tracker.committable()
            if not offsets:
                return
            assigned = self.consumer.assignment()
            offsets = {tp: o for tp, o in offsets.items() if tp in assigned}
            if offsets:
                await self.consumer.commit(offsets)
                self.tracker.mark_committed(offsets)

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.commit_interval)
            try:
                await self.commit()
            except Exception:
                log.exception("offset commit failed; will retry")

    async def drain(self, timeout_s: float) -> None:
        """Wait until nothing is in flight (bounded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        # Polling a counter is simpler than signalling from every completion, and this runs only
        # at shutdown and rebalance.
        while self.tracker.in_flight and loop.time() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


class _Once:
    """Marks one offset done, once: when its flow is recorded on the node, or when it is handled."""

    def __init__(self, tracker: OffsetTracker, tp: TopicPartition, offset: int) -> None:
        self.tracker, self.tp, self.offset, self.fired = tracker, tp, offset, False

    def __call__(self) -> None:
        if not self.fired:
            self.fired = True
            self.tracker.done(self.tp, self.offset)


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, owner: ActuatorConsumer) -> None:
        self.owner = owner

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        """Commit what is done and hand over at once: the rebalance never waits for records in flight.

        Flows are level-triggered: a record whose flow is recorded on its node is done (its offset
        commits now) and the next owner's reconciler resumes the flow from the node's ledger; a record
        not yet recorded stays uncommitted and is redelivered to the next owner. Its run here may still
        finish meanwhile; every write is conditional and every effect idempotent, so the two runs never
        double an effect - and the rebalance (a replica's failover) is not held up by them.
        """
        if self.owner.on_assigned is not None:
            self.owner.on_assigned(set(), 0)  # own no node while the group rebalances
        with contextlib.suppress(Exception):
            await self.owner.commit()
        self.owner.tracker.forget(list(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        owner = self.owner
        mark("assigned")
        owner.release_held()
        if owner.on_assigned is None or owner.consumer is None:
            return
        incidents = next(t for t, kind in owner.topics.items() if kind == "incidents")
        count = len(owner.consumer.partitions_for_topic(incidents) or ())
        mine = {tp.partition for tp in owner.consumer.assignment() if tp.topic == incidents}
        owner.on_assigned(mine, count)
