"""The I/O half of ``pipeline.kafka.undecodable`` for a plain aiokafka consumer (the parse stage, the actuator).

aiokafka delivers none of a failing partition's fetch, not even the good records before the bad batch.
``approach`` reads them first (``max_records`` stopping right before the batch), hands them to the stage,
and then asks ``Undecodable.decide`` what to do with the batch. The stage does the rest (its own dead
letter, commit and log line), since each commits in its own way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.kafka import upstream
from pipeline.kafka.undecodable import Action, Failure, Undecodable

APPROACH_ROUNDS = 50
"""Fetches of the good records before an undecodable batch, at most, before the stage goes on (and meets
the batch again at the next ``getmany``)."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do with the batch, once the partition's good records before it were handed on."""

    action: Action  # RETRY, HOLD or SKIP
    failure: Failure
    position: int  # the partition's next offset not yet delivered (where a RETRY seeks back to)


async def approach(
    consumer: AIOKafkaConsumer,
    undecodable: Undecodable,
    failure: Failure,
    handle: Callable[[dict[TopicPartition, list[Any]]], Awaitable[None]],
    *,
    poll_timeout_ms: int,
    max_records: int,
    beat: Callable[[], None] = lambda: None,
) -> Decision | None:
    """Hand the good records before the batch to ``handle``, then decide; None: nothing to do now.

    None when the partition moved away meanwhile (its new owner meets the batch) or the batch was not
    reached within ``APPROACH_ROUNDS`` fetches (the next ``getmany`` meets it again). Other partitions'
    records stay buffered in the consumer for the stage's next ``getmany``.
    """
    tp = TopicPartition(failure.topic, failure.partition)
    for _ in range(APPROACH_ROUNDS):
        beat()
        if tp not in consumer.assignment():
            return None
        position = await consumer.position(tp)
        action = undecodable.decide(failure, position)
        if action is not Action.APPROACH:
            return Decision(action, failure, position)
        consumer.seek(tp, position)  # drop the half-read fetch: fetch again from the position
        try:
            got = await consumer.getmany(tp, timeout_ms=poll_timeout_ms,
                                         max_records=min(failure.first_offset - position, max_records))
        except Exception as exc:
            again = upstream.locate_undecodable(exc)
            if again is None:
                raise
            # Offsets before the batch are not all records (a control batch, compaction): the batch
            # cannot be told apart from what precedes it; treat it as starting at the position.
            failure = dataclasses.replace(again, first_offset=min(position, again.first_offset))
            continue
        if got.get(tp):
            await handle({tp: got[tp]})
    return None
