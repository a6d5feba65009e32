"""Consumer lag of consumer groups, read from the broker: end offset minus the group's committed offset.

Every process runs a ``LagMonitor`` for its own groups (the worker: its Faust group and its parse
stage's group; the actuator: its group). It reads the committed offsets (admin client) and the end
offsets (a group-less consumer), both from ``pipeline.kafka.clients``, on a timer: the figure moves
whether or not records arrive, so a stalled consumer shows a growing lag. The lag is the group's,
not this member's: every member exports the same series (alerts take the ``max`` over members).

``partition_lag`` is the pure computation; ``LagMonitor`` is the I/O around it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka import TopicPartition

from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.reachability import CONNECTION_ERRORS
from pipeline.runtime import metrics
from pipeline.runtime.reachability import BROKER

log = logging.getLogger("xidflow.lag")


def partition_lag(
    partitions: Iterable[TopicPartition],
    committed: Mapping[TopicPartition, int],
    beginnings: Mapping[TopicPartition, int],
    ends: Mapping[TopicPartition, int],
) -> dict[TopicPartition, int]:
    """Records of each partition the group has not committed yet. Pure.

    A partition the group never committed counts from its first retained record (the groups read
    from the earliest offset); a committed offset below the first retained record (retention deleted
    what the group never read) counts from there too. Never negative; partitions without a known end
    offset are left out.
    """
    out: dict[TopicPartition, int] = {}
    for tp in partitions:
        end = ends.get(tp)
        if end is None:
            continue
        start = beginnings.get(tp, 0)
        done = committed.get(tp)
        position = start if done is None or done < 0 else max(done, start)
        out[tp] = max(0, end - position)
    return out


def group_lag(
    topics: Iterable[str],
    partitions_by_topic: Mapping[str, Iterable[int]],
    committed: Mapping[TopicPartition, int],
    beginnings: Mapping[TopicPartition, int],
    ends: Mapping[TopicPartition, int],
) -> dict[tuple[str, int], int]:
    """``partition_lag`` over the group's topics, keyed (topic, partition). Pure."""
    tps = [TopicPartition(t, p) for t in dict.fromkeys(topics) for p in sorted(partitions_by_topic.get(t, ()))]
    return {(tp.topic, tp.partition): lag for tp, lag in partition_lag(tps, committed, beginnings, ends).items()}


class LagMonitor:
    """Refreshes ``xidflow_consumer_lag{group,topic,partition}`` for the given groups every ``interval_s``.

    ``groups``: group id -> the topics it consumes (configured names: the label values stay a closed set).
    """

    def __init__(
        self,
        groups: Mapping[str, Iterable[str]],
        bootstrap: str | None = None,
        interval_s: float | None = None,
    ) -> None:
        self.groups = {g: tuple(dict.fromkeys(ts)) for g, ts in groups.items() if ts}
        self.bootstrap = bootstrap
        self.interval_s = interval_s if interval_s is not None else metrics.refresh_interval_s()
        self.last: dict[str, dict[tuple[str, int], int]] = {}
        self._admin: Any = None
        self._consumer: Any = None
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    # -- I/O ----------------------------------------------------------------------------------------------
    async def _connect(self) -> None:
        if self._admin is None:
            admin = kafka_clients.admin(bootstrap=self.bootstrap, client_id="xidflow-lag")
            await admin.start()
            self._admin = admin
        if self._consumer is None:
            consumer = kafka_clients.consumer(bootstrap=self.bootstrap, client_id="xidflow-lag",
                                              enable_auto_commit=False)
            await consumer.start()
            self._consumer = consumer

    async def _close(self) -> None:
        admin, consumer, self._admin, self._consumer = self._admin, self._consumer, None, None
        for client in (consumer, admin):
            if client is None:
                continue
            try:
                await (client.stop() if client is consumer else client.close())
            except Exception:  # noqa: BLE001 - closing a broken client must not raise
                pass

    async def _partitions(self, topics: list[str]) -> dict[str, list[int]]:
        # Metadata of every topic, filtered here: asking for named topics would let a broker with
        # auto.create.topics.enable create a missing one (with the wrong partition count).
        wanted = set(topics)
        out: dict[str, list[int]] = {}
        for entry in await self._admin.describe_topics():
            if entry.get("topic") in wanted and not entry.get("error_code"):
                out[entry["topic"]] = sorted(p["partition"] for p in entry.get("partitions") or [])
        return out

    async def refresh(self) -> dict[str, dict[tuple[str, int], int]]:
        """Read every group's lag once and set the gauge; returns group -> (topic, partition) -> lag."""
        await self._connect()
        topics = sorted({t for ts in self.groups.values() for t in ts})
        partitions = await self._partitions(topics)
        tps = [TopicPartition(t, p) for t, ps in partitions.items() for p in ps]
        if tps:
            ends = await self._consumer.end_offsets(tps)
            beginnings = await self._consumer.beginning_offsets(tps)
        else:
            ends, beginnings = {}, {}
        result: dict[str, dict[tuple[str, int], int]] = {}
        for group, group_topics in self.groups.items():
            offsets = await self._admin.list_consumer_group_offsets(group)
            committed = {tp: meta.offset for tp, meta in offsets.items()}
            lag = group_lag(group_topics, partitions, committed, beginnings, ends)
            for (topic, partition), value in lag.items():
                metrics.CONSUMER_LAG.labels(group, topic, str(partition)).set(value)
            metrics.LAG_REFRESHED.labels(group).set(time.time())
            result[group] = lag
        self.last = result
        return result

    # -- timer --------------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Refresh every ``interval_s`` until cancelled; a broker outage is logged once and retried."""
        try:
            while True:
                try:
                    await self.refresh()
                    if self._failing:
                        log.info("consumer lag readable again")
                    self._failing = False
                except asyncio.CancelledError:
                    raise
                except CONNECTION_ERRORS as exc:  # the broker's outage: said once by reachability.BROKER
                    BROKER.failed(f"consumer lag: {type(exc).__name__}: {exc}")
                    await self._close()  # a fresh connection next time
                except Exception as exc:  # noqa: BLE001 - Kafka or network errors: metrics never stop the work
                    if not self._failing:
                        log.warning("consumer lag not read (%s: %s); retrying every %gs",
                                    type(exc).__name__, exc, self.interval_s)
                    self._failing = True
                    await self._close()  # a fresh connection next time
                await asyncio.sleep(self.interval_s)
        finally:
            await self._close()

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name="xidflow-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
