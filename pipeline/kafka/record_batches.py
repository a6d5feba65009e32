"""The records of one aggregation batch, handed to the producer a record batch per partition, not one by one.

Why: ``AIOKafkaProducer.send`` (and Faust's wrapper around it) costs ~80 us a record on the bench node:
the wrapper, the partitioner, a delivery future and the accumulator's bookkeeping per record, a third
of the aggregation loop's CPU in a burst. aiokafka's ``create_batch``/``send_batch`` take a whole
record batch for one partition: the records are appended to it as they are made (each gets its
timestamp then, as with ``send``) and the batch is handed over with one future for all of them.

What ``send`` gave that is kept:

- the partition: the producer's own partitioner over the topic's partitions, in the order aiokafka
  hands them to it (``partitions_for``), so a node's records land where ``send`` put them;
- the order per partition: a partition's records are appended in the order they are added and its
  batches are handed to the producer in that order; a record too large for a record batch goes per
  record (``send``, as before: the broker's answer for it is the one it had), after what was gathered
  for its partition before it;
- the acknowledgement: ``deliveries`` holds one future per record batch (and per record sent alone);
  the caller waits for all of them before it writes its states, as it waited for each record's.

Everything is handed over at the end of the aggregation batch (``send_all``), not while it is applied:
aiokafka's ``send_batch`` waits until a partition's batch already queued is on its way (the request in
flight acknowledged) before it queues the next, where ``send`` appended to the queued one, so a batch
handed over mid-way can make the end of the aggregation batch wait a broker round trip. (A first version
that did so measured a 500-node worker p99 of 0.92-1.54 s in ``xidflow bench``, against 0.63-0.68 s
before; that wait is the likely reason.) The incidents' timestamps are still those of their making.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka.record.default_records import DefaultRecordBatchBuilder

Partitioner = Callable[[bytes | None, Sequence[int], Sequence[int]], int]


class RecordBatches:
    """One aggregation batch's records on their way to a started ``AIOKafkaProducer`` (not concurrency-safe)."""

    def __init__(self, producer: Any, partitioner: Partitioner, max_batch_bytes: int) -> None:
        self._producer = producer
        self._partitioner = partitioner
        self._limit = max_batch_bytes
        self._partitions: dict[str, list[int]] = {}
        self._open: dict[tuple[str, int], Any] = {}  # the batch being filled, per (topic, partition)
        self._full: dict[tuple[str, int], list[Any]] = {}  # batches filled before it, in order
        self.deliveries: list[asyncio.Future[Any]] = []
        """One per record batch (or record sent alone) handed over: the broker's acknowledgements."""

    async def add(
        self, topic: str, key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        """Append one record for ``topic`` (partitioned by ``key``, with ``headers``); ``send_all`` hands it over."""
        partitions = self._partitions.get(topic)
        if partitions is None:
            # As ``send`` lists them for its partitioner (waits for the topic's metadata the first time).
            partitions = self._partitions[topic] = list(await self._producer.partitions_for(topic))
        # The partitioner's third argument (available partitions) only matters for a record without a key.
        partition = self._partitioner(key, partitions, partitions)
        tp = (topic, partition)
        headers = list(headers)
        if DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers) > self._limit:
            # Alone, as ``send`` would make it its own batch anyway; what its partition has before it goes first.
            await self._send(tp)
            self.deliveries.append(
                await self._producer.send(topic, value, key=key, partition=partition, headers=headers or None)
            )
            return
        batch = self._open.get(tp)
        if batch is None:
            batch = self._open[tp] = self._producer.create_batch()
        if batch.append(timestamp=None, key=key, value=value, headers=headers) is None:  # full (and closed)
            self._full.setdefault(tp, []).append(batch)
            batch = self._open[tp] = self._producer.create_batch()
            batch.append(timestamp=None, key=key, value=value, headers=headers)  # fits an empty batch (above)

    async def send_all(self) -> list[asyncio.Future[Any]]:
        """Hand over everything gathered; returns ``deliveries``. Partitions go side by side, each in order."""
        tps = set(self._open) | set(self._full)
        if tps:
            await asyncio.gather(*(self._send(tp) for tp in tps))
        return self.deliveries

    async def _send(self, tp: tuple[str, int]) -> None:
        batches = self._full.pop(tp, [])
        open_batch = self._open.pop(tp, None)
        if open_batch is not None:
            batches.append(open_batch)
        topic, partition = tp
        for batch in batches:
            self.deliveries.append(await self._producer.send_batch(batch, topic, partition=partition))
