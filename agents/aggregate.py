"""Aggregation agent: fault events (and ticks) -> per-node state in a Faust table -> incidents.

Thin: the rules are ``pipeline.aggregate.aggregator.Aggregator``. The agent takes events in batches
straight from its channel, without Faust's per-event stream (``pipeline.aggregate.stream_batches``: what
arrived while it worked on the previous one),
applies them node by node in offset order, sends the incidents, waits until the
broker has them, and only then writes each touched node's state to the table (one changelog record
per node per batch, not one per event; ``NodeStateTable.write``). The batch is acknowledged only
once the changelog has its states (Faust does not flush before it commits), but the agent takes
its next batch meanwhile (``GuardedConsumer.finishing``): one broker round trip per batch on the
way from a fault event to its incident, whatever the batch's size, and at most one batch's states
on their way at a time. Incidents, dead letters and states go straight to the producer and are
acknowledged together. A batch the agent does not finish (or whose states the changelog did not
take) is handed
back to the consumer (``pipeline.kafka.fetch_watchdog.GuardedConsumer.unprocessed``): never committed
past, read again. A crash therefore either replays events whose state was not written (the same incidents,
same ids and revisions, are sent again: at-least-once) or events whose state was written (the
state's last applied position makes the replay a no-op). No incident is lost behind a state that
says it was sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from aiokafka.partitioner import DefaultPartitioner

from pipeline.aggregate.aggregator import Aggregator
from pipeline.aggregate.state import NodeState
from pipeline.aggregate.stream_batches import ChannelBatches
from pipeline.aggregate.tickindex import TickIndex
from pipeline.kafka import cloudevents, upstream
from pipeline.kafka.fetch_watchdog import GuardedConsumer
from pipeline.kafka.record_batches import RecordBatches
from pipeline.runtime import metrics
from pipeline.runtime.deadletter_log import DeadLetterReporter
from pipeline.runtime.startmarks import mark
from schemas.records import DeadLetter, DeadLetterCode, FabricSignal, FaultEvent, NodeIncident, NodeRecovered

if TYPE_CHECKING:
    from pipeline.app import XidflowApp

log = logging.getLogger("xidflow.aggregate")

STAGE = "aggregate"
_DEAD_LETTERS = DeadLetterReporter(metrics.DEADLETTERS)


def register(xapp: XidflowApp) -> None:
    app = xapp.app
    table = xapp.node_state
    aggregator = Aggregator(xapp.aggregation)
    ticks_name = xapp.ticks.get_topic_name()
    channel = app.topic(xapp.fault_events.get_topic_name(), ticks_name, key_serializer="raw", value_serializer="raw")
    settings = xapp.settings
    due = TickIndex(xapp.aggregation.quiet_period_s)
    table.on_restored = due.restored  # states recovered from the changelog: decoded once by the timer
    events_name = xapp.fault_events.get_topic_name()
    ce_source = cloudevents.CloudEventsSettings().source  # the ce_* headers of incidents and recoveries

    def assigned(tps: set[Any]) -> None:
        # A node's partition is its fault-event partition (ticks and changelog share the numbers).
        forgotten = due.assigned(tp.partition for tp in tps if tp.topic == events_name)
        if forgotten:
            log.info("tick index: forgot %d nodes of partitions no longer assigned here", forgotten)

    table.on_assigned = assigned

    @app.agent(channel, name=f"{settings.app_id}-aggregate")
    async def aggregate(stream: Any) -> None:
        # The stream is never iterated: its channel's queue is read a batch at a time (``ChannelBatches``).
        batches = ChannelBatches(app, stream.channel, settings.aggregate_batch, settings.aggregate_within_s)
        changelog: asyncio.Future[Any] | None = None  # the previous batch's, until the broker has it
        while True:
            events = await batches.take()
            if events is None:
                return  # the channel ended: Faust is stopping the agent
            mark("first_batch")  # a restarted worker's start, up to its first work (pipeline.runtime.startmarks)
            taken = events
            consumer = app.consumer
            guarded = isinstance(consumer, GuardedConsumer)
            try:
                if guarded:
                    # After an unfinished batch its partitions wait for their re-read: nothing after
                    # an unfinished record is applied before it.
                    admitted = {id(m) for m in consumer.admit([event.message for event in events])}
                    events = [event for event in events if id(event.message) in admitted]
                messages = [event.message for event in events]
                try:
                    changelog = await _apply_batch(
                        xapp, aggregator, table, ticks_name, events, changelog, due, ce_source
                    )
                    if guarded:
                        # Acknowledged once the changelog has the states; the next batch need not wait.
                        consumer.finishing(messages, changelog)
                    else:
                        await changelog
                except BaseException:
                    # The batch is acknowledged even now (below): the consumer must neither commit
                    # past these records nor forget them.
                    if guarded:
                        consumer.unprocessed(messages)
                    raise
            finally:
                # What ``finishing`` holds is counted once the changelog has it; the rest is booked now.
                batches.acknowledge(taken)

    @app.timer(interval=settings.tick_interval_s)
    async def request_ticks() -> None:
        # Table writes must happen inside the agent (changelog ordering), so the timer only asks; the
        # index says for which nodes, without decoding every state (``pipeline.aggregate.tickindex``).
        due.settle(table.get)
        for key in due.due(time.time()):
            if table.get(key) is None:
                due.forget(key)
                continue
            await xapp.ticks.send(key=key, value=b"tick", force=True)


async def _apply_batch(
    xapp: XidflowApp,
    aggregator: Aggregator,
    table: Any,
    ticks_name: str,
    events: list[Any],
    previous: asyncio.Future[Any] | None = None,
    due: TickIndex | None = None,
    ce_source: str = "/xidflow",
) -> asyncio.Future[Any]:
    """Apply one batch: incidents sent and acknowledged by the broker, then the node states written.

    Returns the changelog's acknowledgement of the states. ``previous`` (the last batch's) is waited
    for before the states are sent: at most one batch's states are on their way at a time. ``due``
    is told each state written (when a tick falls due for its node). Incidents and recoveries carry the
    CloudEvents Kafka binding's headers (``pipeline.kafka.cloudevents``, ``ce_source`` their prefix).
    """
    by_node: dict[bytes, list[Any]] = {}
    deliveries = []
    incidents_topic = xapp.incidents.get_topic_name()
    signals_topic = xapp.topics.name("fabric_signals")  # not incidents: the shared-part correlation's input
    for event in events:
        key = event.message.key
        if not key:
            deliveries.append(await _dead(xapp, event, "fault event without a node key", DeadLetterCode.NO_NODE))
            continue
        by_node.setdefault(key, []).append(event)
    now = time.time()
    new_states: list[tuple[bytes, bytes, int]] = []
    written: list[tuple[bytes, NodeState, int]] = []
    outgoing = _record_batches(xapp)
    for turn, (key, node_events) in enumerate(by_node.items(), 1):
        if turn % _NODES_PER_TURN == 0:
            await _let_others_run()
        # The store itself (what ``NodeStateTable.write`` fills): the table's own ``get`` runs Faust's
        # sensors and raises and catches a KeyError for every node without a state yet.
        stored: bytes | None = table.data.get(key)
        if stored is None:
            state = aggregator.new_state(key.decode("utf-8", "replace"))
        else:
            state = NodeState.from_bytes(stored)
        for event in node_events:
            msg = event.message
            try:
                if msg.topic == ticks_name:
                    state, out = aggregator.tick(state, now)
                else:
                    fault = FaultEvent.from_bytes(msg.value)
                    signals: list[FabricSignal] = []
                    state, out = aggregator.step(
                        state, fault, now, position=(msg.partition, msg.offset), signals=signals
                    )
                    out = [*out, *signals]
            except Exception as exc:  # noqa: BLE001 - the worker never dies on input
                reason = f"invalid fault event at {msg.topic}[{msg.partition}]@{msg.offset}: {str(exc).splitlines()[0]}"
                deliveries.append(await _dead(xapp, event, reason, DeadLetterCode.INVALID_RECORD))
                continue
            encoded, failure = encode_outputs(out)
            if failure is not None:
                # A record the encoders refuse (a lone surrogate in a string) is this event's dead letter,
                # with whatever it produced besides: the agent goes on with the next event.
                reason = f"output of {msg.topic}[{msg.partition}]@{msg.offset} not encodable: {failure}"
                deliveries.append(await _dead(xapp, event, reason, DeadLetterCode.INVALID_RECORD))
                continue
            for record, data in encoded:
                # Gathered per partition into record batches (``RecordBatches``): one producer call per
                # batch, not per record; all acknowledged together below.
                if isinstance(record, FabricSignal):
                    await outgoing.add(signals_topic, key, data)
                else:
                    await outgoing.add(incidents_topic, key, data, cloudevents.headers(record, ce_source))
                _observe(record, now)
        partition = node_events[-1].message.partition
        new_states.append((key, state.to_bytes(), partition))
        written.append((key, state, partition))
    deliveries += await outgoing.send_all()
    # The state is written only after the broker has the incidents (and dead letters): a crash in
    # between replays the events and sends the same incidents again (same ids), never loses one
    # behind a state that says it was sent. The batch is acknowledged (its offsets may be
    # committed) only after the state is on the changelog too (the caller's ``finishing``): a
    # commit never outruns the state. The next batch does not wait for that acknowledgement.
    if deliveries:
        await asyncio.gather(*deliveries)
    if previous is not None:
        await asyncio.wait([previous])  # its failure is the consumer's to handle (``finishing``)
    durable = await table.write(new_states)
    if due is not None:
        for key, state, partition in written:
            due.note(key, state, partition)
    return durable


_NODES_PER_TURN = 64
"""Nodes of a batch applied between two turns of the event loop (``_let_others_run``)."""


async def _let_others_run() -> None:
    """A few loop turns in the middle of a long batch: the parse stage's fault events go out and the next
    fetch comes in, instead of all of it waiting for the end of the batch (hundreds of ms on a busy node).
    The batch's own incidents are handed to the producer at its end (``RecordBatches.send_all``)."""
    for _ in range(3):
        await asyncio.sleep(0)


Output = NodeIncident | NodeRecovered | FabricSignal


def encode_outputs(outputs: list[Output]) -> tuple[list[tuple[Output, bytes]], str | None]:
    """Each output with its bytes, or (what was encoded, why the first one that could not be was not). Pure."""
    encoded: list[tuple[Output, bytes]] = []
    for record in outputs:
        try:
            encoded.append((record, record.to_bytes()))
        except Exception as exc:  # noqa: BLE001 - one record's failure is its event's dead letter
            return encoded, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return encoded, None


def _record_batches(xapp: XidflowApp) -> RecordBatches:
    """The batch's incidents and fabric signals on their way to the worker's producer, a record batch per partition."""
    app = xapp.app
    partitioner = app.conf.producer_partitioner or DefaultPartitioner()
    return RecordBatches(upstream.faust_producer_client(app), partitioner, app.conf.producer_max_batch_size)


async def _send(xapp: XidflowApp, topic: str, key: bytes | None, value: bytes) -> Awaitable[Any]:
    """Hand one record to the worker's producer; returns its delivery (the broker's acknowledgement).

    Partitioned by key like Faust's own send (the client's default partitioner).
    """
    return await xapp.app.producer.send(topic, key, value, partition=None, timestamp=None, headers=None)


_INCIDENTS_BY_ACTION: dict[str, Any] = {}
"""The incident counter's child per action: ``labels()`` takes a lock and builds a key on every call."""


def _observe(record: NodeIncident | NodeRecovered | FabricSignal, now: float) -> None:
    if isinstance(record, FabricSignal):
        return  # not an incident: the actuator's shared-part correlation counts them
    if isinstance(record, NodeRecovered):
        metrics.RECOVERIES.labels(record.reason).inc()
        return
    action = record.action.value
    counter = _INCIDENTS_BY_ACTION.get(action)
    if counter is None:
        counter = _INCIDENTS_BY_ACTION[action] = metrics.INCIDENTS.labels(action)
    counter.inc()
    if record.revision == 0 and record.source_ts is not None:
        # Log time of the opening line to the incident: the latency a fleet operator cares about.
        metrics.E2E_LATENCY.observe(max(0.0, now - record.source_ts.timestamp()))


async def _dead(xapp: XidflowApp, event: Any, reason: str, code: DeadLetterCode) -> Awaitable[Any]:
    """Send the event's dead letter; returns its delivery (to await before the offset may commit)."""
    msg = event.message
    key = msg.key.decode("utf-8", "replace") if msg.key else None
    letter = DeadLetter.of(
        STAGE, reason, msg.value, code, topic=msg.topic, partition=msg.partition, offset=msg.offset, key=key
    )
    _DEAD_LETTERS.report(letter)
    return await _send(xapp, xapp.deadletter.get_topic_name(), msg.key, letter.to_bytes())
