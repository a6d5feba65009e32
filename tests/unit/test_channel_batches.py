"""The aggregation takes its fault events a batch at a time from its channel's queue, and keeps what
Faust's per-event stream did for the guarantees: stale events are not applied (and never committed
past), applied ones are tracked as in flight until the agent acknowledges them."""

import asyncio
from typing import Any

import pytest
from faust import Event
from faust.types import TP, ConsumerMessage

from agents.worker import create_app
from pipeline.aggregate.stream_batches import ChannelBatches

TOPIC = "xidflow-fault-events"


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> Any:
    app = create_app("127.0.0.1:9", topics=None).app
    app.flow_control.resume()  # as once the worker's partitions are assigned
    monkeypatch.setattr(app.topics, "acks_enabled_for", lambda topic: True)  # a subscribed source topic
    monkeypatch.setattr(type(app.consumer), "source_topics", frozenset({TOPIC}))
    return app


def _event(app: Any, partition: int, offset: int, generation: int | None = None) -> Event:
    tp = TP(TOPIC, partition)
    message = ConsumerMessage(TOPIC, partition, offset, 0.0, 0, None, b"node", b"{}", None, tp=tp,
                      generation_id=app.consumer_generation_id if generation is None else generation)
    message.incref()  # what the conductor does for the one channel it delivers to
    return Event(app, message.key, message.value, None, message)


def _queued(app: Any, events: list[Event]) -> Any:
    channel = app.channel()
    for event in events:
        channel.queue.put_nowait(event)
    return channel


async def test_a_batch_is_everything_waiting_in_order_up_to_its_size(app: Any) -> None:
    events = [_event(app, p, o) for o in range(3) for p in (0, 1)]
    batches = ChannelBatches(app, _queued(app, events), max_=4, within=0.001)
    first = await batches.take()
    assert first == events[:4]
    assert all(e.message in app.consumer.unacked for e in first)  # in flight: a rebalance waits for them
    assert await batches.take() == events[4:]


async def test_an_idle_batch_takes_what_arrives_within_the_wait(app: Any) -> None:
    channel = _queued(app, [])
    batches = ChannelBatches(app, channel, max_=100, within=0.05)
    events = [_event(app, 0, o) for o in range(3)]

    async def arrive() -> None:
        for event in events:
            await asyncio.sleep(0.005)
            channel.queue.put_nowait(event)

    arriving = asyncio.ensure_future(arrive())
    assert await batches.take() == events
    await arriving


async def test_events_of_an_older_generation_are_not_applied_and_never_committed_past(app: Any) -> None:
    stale, fresh = _event(app, 0, 5, generation=-1), _event(app, 0, 6)
    batches = ChannelBatches(app, _queued(app, [stale, fresh]), max_=10, within=0.001)
    assert await batches.take() == [fresh]
    consumer = app.consumer
    assert stale.message.acked and consumer.redo == {TP(TOPIC, 0): 5}  # read again from the committed offset
    assert not consumer.acked_offsets(TP(TOPIC, 0))


async def test_nothing_is_applied_while_the_flow_is_suspended(app: Any) -> None:
    events = [_event(app, 0, 1), _event(app, 0, 2)]
    channel = _queued(app, events)
    batches = ChannelBatches(app, channel, max_=10, within=0.001)
    app.flow_control.suspend()
    taking = asyncio.ensure_future(batches.take())
    await asyncio.sleep(0.01)
    assert not taking.done() and all(e.message.acked for e in events)  # skipped, handed back
    app.flow_control.resume()
    later = _event(app, 0, 3)
    channel.queue.put_nowait(later)
    assert await taking == [later]
    taking.cancel()


async def test_an_acknowledged_batch_counts_only_once_the_agent_finished_it(app: Any) -> None:
    events = [_event(app, 0, 0), _event(app, 0, 1)]
    batches = ChannelBatches(app, _queued(app, events), max_=10, within=0.001)
    batch = await batches.take()
    consumer = app.consumer
    consumer.finished([e.message for e in batch])
    batches.acknowledge(batch)
    assert consumer.acked_offsets(TP(TOPIC, 0)) == [0, 1]
    assert not any(e.message in consumer.unacked for e in batch)
    batches.acknowledge(batch)  # twice: booked once
    assert consumer.acked_offsets(TP(TOPIC, 0)) == [0, 1]


async def test_the_batches_end_when_faust_ends_the_channel(app: Any) -> None:
    # Faust throws StopAsyncIteration into an agent's channel when it stops: the agent returns, no crash.
    event = _event(app, 0, 0)
    channel = _queued(app, [event])
    await channel.throw(StopAsyncIteration())
    batches = ChannelBatches(app, channel, max_=10, within=0.001)
    assert await batches.take() is None  # the end comes first, as in Faust's stream
    assert not event.message.acked and event.message not in app.consumer.unacked  # never committed past
    idle = ChannelBatches(app, _queued(app, []), max_=10, within=0.001)
    taking = asyncio.ensure_future(idle.take())
    await asyncio.sleep(0)
    await idle._queue.throw(StopAsyncIteration())
    assert await taking is None


async def test_a_batch_waits_past_within_for_the_rest_of_a_fetch_being_handed_out(
    app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Faust hands a fetch out 100 records a loop turn; on a busy worker the rest comes after ``within``.
    channel = _queued(app, [])
    events = [_event(app, 0, o) for o in range(4)]
    left = {"n": len(events)}
    monkeypatch.setattr(app.consumer, "undelivered", lambda: left["n"], raising=False)
    batches = ChannelBatches(app, channel, max_=100, within=0.005)

    async def hand_out() -> None:
        for event in events:
            left["n"] -= 1
            channel.queue.put_nowait(event)
            await asyncio.sleep(0.02)  # four times ``within`` between two records

    handing = asyncio.ensure_future(hand_out())
    assert await batches.take() == events
    await handing


async def test_a_batch_does_not_wait_past_within_once_the_fetch_is_handed_out(
    app: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    channel = _queued(app, [])
    first, late = _event(app, 0, 0), _event(app, 0, 1)
    monkeypatch.setattr(app.consumer, "undelivered", lambda: 0, raising=False)
    batches = ChannelBatches(app, channel, max_=100, within=0.005)
    channel.queue.put_nowait(first)
    taking = asyncio.ensure_future(batches.take())
    await asyncio.sleep(0.05)
    channel.queue.put_nowait(late)
    assert await taking == [first]
    assert await batches.take() == [late]
