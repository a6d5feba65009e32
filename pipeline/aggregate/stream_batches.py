"""Batches of a Faust stream's events that fill while the agent works: the aggregation's ``take``.

Faust's ``Stream.take_events(max_, within)`` stops its stream while the agent works on a batch and
starts the next one with a fresh ``within`` wait. In a burst the agent's batch waits for the broker
(its incidents' acknowledgements, 20-100 ms on a loaded machine), so each batch held only what the
stream moved in ``within`` (10 ms): a 310-record fetch reached the agent as 15 batches of 1-134
events, and each cost a round trip (profile of a 500-node burst: the last fault events waited 2 s in
Faust for their turn). ``take_batches`` takes the events the stream delivers meanwhile into the next
batch instead, and hands that batch over at once: a burst becomes as few batches as the agent's own
pace allows, each up to ``max_`` events.

Acknowledgements are as in ``take_events``: an event is acknowledged when the agent asks for the next
batch (or the generator closes), never before; ``GuardedConsumer`` counts only the ones the agent
reported finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from pipeline.kafka import upstream


def take_batches(stream: Any, max_: int, within: float) -> AsyncGenerator[list[Any], None]:
    """Lists of up to ``max_`` events of ``stream`` (a Faust stream): what arrived while the agent worked
    on the previous one, else what arrives within ``within`` seconds (at once when ``max_`` arrive)."""
    batches = _take(stream, max_, within)
    # Like take_events: the stream closes a generator left open when it stops (its finally acknowledges).
    upstream.attach_generator(stream, batches)
    return batches


async def _take(stream: Any, max_: int, within: float) -> AsyncGenerator[list[Any], None]:
    events: list[Any] = []
    full = asyncio.Event()
    room = asyncio.Event()
    room.set()

    async def add(value: Any) -> Any:
        # A processor of the stream, run for every event as the stream is drained in the background.
        try:
            event = stream.current_event
            if event is None:
                raise RuntimeError("take_batches: the stream has no current event")
            events.append(event)
            if len(events) >= max_:
                full.set()
                room.clear()
                await stream.wait(room)  # never more than ``max_`` in a batch
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            stream.log.exception("Error adding to the batch: %r", exc)
            await stream.crash(exc)
        return value

    enable_acks = stream.enable_acks
    stream.enable_acks = False  # acknowledged here, once the agent is done with the batch
    stream.add_processor(add)
    upstream.drain_in_background(stream)
    try:
        while not stream.should_stop:
            if not events:
                await stream.wait_for_stopped(full, timeout=within)
            if not events:
                continue
            batch = events[:]
            events.clear()
            full.clear()
            room.set()
            try:
                yield batch
            finally:
                for event in batch:
                    await stream.ack(event)
    finally:
        stream.enable_acks = enable_acks
        upstream.remove_processor(stream, add)
