"""Batches of the aggregation's fault events, read straight from its channel: the aggregation's ``take``.

Faust's conductor puts every fetched record of the agent's topics, as an ``Event``, on the queue of the
channel the agent's stream was made from. A Faust ``Stream`` then takes them one at a time: a loop turn
(``sleep(0)``) per event, the sensors, the current-event bookkeeping, a processor call and an
acknowledgement per event. In a 500-line burst that machinery, not the aggregation (55 us an event),
was most of the worker's CPU. ``ChannelBatches`` reads the queue itself, a batch at a time: every event
waiting there (up to ``max_``), else what arrives within ``within`` seconds of the first one, and the rest
of the fetch the consumer is still handing out (``GuardedConsumer.undelivered``). Events that
arrive while the agent works on a batch wait on the queue and form the next one at once, so a burst
becomes as few batches as the agent's own pace allows (as the earlier ``take_batches`` on the stream
did, without its per-event cost).

What the stream did that the aggregation's guarantees rest on is kept, per event and in queue order
(which is offset order per partition):

- an event of an older consumer generation, or one taken while Faust's flow control is suspended (a
  rebalance), is not handed to the agent: it is acknowledged without being applied, as the stream
  skips it (``GuardedConsumer.ack`` books such an event as unprocessed: its partition is read again
  from the committed offset, never committed past it);
- an event handed to the agent is tracked as in flight (``Consumer.track_message``): a rebalance waits
  for it to be acknowledged (``wait_empty``), the fetch watchdog sees its partition as being worked on;
- acknowledgement is the agent's (``acknowledge``), once it is done with the batch, through the event
  (its message's reference count, then ``Consumer.ack``): ``GuardedConsumer`` counts only what the
  agent reported finished and holds what is finishing until its changelog write is durable.

Faust's rebalance clears the channel's queue (flow control) as before, and the consumer reads the
cleared records again from the committed offsets. Only public names of Faust and mode are used.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

_POLL_S = 0.005
"""How often the wait for more events (``within``) looks whether the batch is full already."""

_FETCH_POLL_S = 0.001
"""How often, past ``within``, the wait looks whether the fetch being handed out is all on the queue."""

_MAX_WAIT_S = 1.0
"""The longest a batch waits for the rest of a fetch still being handed out (a bound, never reached in practice)."""


class ChannelBatches:
    """Takes the events of a Faust channel's queue in batches, for one agent (not concurrency-safe)."""

    def __init__(self, app: Any, channel: Any, max_: int, within: float) -> None:
        self._app = app
        self._queue = channel.queue  # the queue Faust's conductor fills for the agent's stream
        self._max = max(1, max_)
        self._within = within
        self._ended = False

    async def take(self) -> list[Any] | None:
        """The next batch: at least one event, at most ``max_``, each tracked as in flight.

        None once the channel ended (Faust throws ``StopAsyncIteration`` into it when it stops): the
        agent returns, as it would at the end of its stream's ``async for``.
        """
        while not self._ended:
            try:
                raw = await self._gather()
            except StopAsyncIteration:
                return None
            batch = self._admit(raw)
            if batch:
                return batch
        return None

    async def _gather(self) -> list[Any]:
        queue = self._queue
        raw: list[Any] = []
        if queue.empty():
            raw.append(await queue.get())  # idle: the first event opens the batch
            start = time.monotonic()
            deadline, limit = start + self._within, start + _MAX_WAIT_S
            undelivered = getattr(self._app.consumer, "undelivered", None)
            try:
                # Whatever comes with it joins it, up to ``within``; and the rest of its fetch, which
                # Faust hands out 100 records a loop turn: under load that outlasts ``within``, and the
                # rest would wait a whole batch (a broker round trip) for the next one.
                while queue.qsize() + 1 < self._max:
                    now = time.monotonic()
                    if now >= limit or (now >= deadline and not (undelivered and undelivered())):
                        break
                    await asyncio.sleep(min(deadline - now, _POLL_S) if now < deadline else _FETCH_POLL_S)
            except BaseException:
                # Cancelled (the agent stopping) with the event off the queue: handed back, never
                # committed past (``GuardedConsumer.ack`` books it unprocessed).
                self.acknowledge(raw)
                raise
        try:
            while len(raw) < self._max and not queue.empty():
                raw.append(queue.get_nowait())
        except StopAsyncIteration:
            if not raw:
                raise
            self._ended = True  # behind these events: they are the agent's, the next take ends
        return raw

    def _admit(self, raw: list[Any]) -> list[Any]:
        app = self._app
        consumer = app.consumer
        # Nothing below awaits: the flow and the generation cannot change while the batch is sorted.
        active = app.flow_control.is_active()
        generation = app.consumer_generation_id
        acks_enabled_for = app.topics.acks_enabled_for
        batch: list[Any] = []
        skipped: list[Any] = []
        for event in raw:
            message = event.message
            if not active or message.generation_id != generation:
                skipped.append(event)  # fetched before the rebalance: read again from the committed offset
                continue
            if not message.tracked and acks_enabled_for(message.topic):
                message.tracked = True
                consumer.track_message(message)
            batch.append(event)
        if skipped:
            self.acknowledge(skipped)  # what Faust's stream does with the events it skips
        return batch

    def acknowledge(self, events: list[Any]) -> None:
        """The agent is done with ``events`` (finished or handed back): acknowledge each once."""
        on_message_out = self._app.sensors.on_message_out
        for event in events:
            if event.ack():  # the last reference to its message: Consumer.ack booked it
                message = event.message
                on_message_out(message.tp, message.offset, message)
