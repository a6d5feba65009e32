"""No source record of the aggregation is skipped: none is committed past, none stays undelivered.

Faust (faust-streaming 0.15) can lose a record between the fetch and the agent without an error:

- Around a rebalance the consumer drops records it fetched or queued while the flow was suspended,
  and relies on "seek to committed offsets" to read them again. aiokafka's ``seek_to_committed``
  does nothing for a partition whose committed offset is missing or 0, so the consumer goes on
  from its fetch position, past records no agent ever saw.
- Faust commits the end of the first run of consecutive acknowledged offsets. It checks that the
  run starts at the committed offset only when one is known and non-zero, and then with an
  off-by-one (``min(acked) - committed > 1``): one record the agent never acknowledged, or all of
  them on a partition without a commit, are committed past, and a restart never reads them again.
- A record whose delivery was cut by the flow suspension is counted as read (seen: the record at
  the committed offset dropped right after a restart, the ones after it processed).
- Once ``take_events`` ends (the agent stopping), the stream acknowledges what it still pulls
  without the agent seeing it, and the final commit passes those records (the aggregation reads
  its channel without a stream, ``pipeline.aggregate.stream_batches``, but acknowledges a batch it
  failed on, and skips stale events by acknowledging them, as the stream does).
- A seek does not recall the records Faust already took from aiokafka: the rest of that batch is
  still handed out after the seek. The first such record moves Faust's read offset ahead of the
  seek target and is booked as a "gap" between them; the re-read records below it are then dropped
  as already read, and Faust commits past them as if the gap were a hole in the log (seen after a
  restart: the fetcher starts before recovery seeks to the committed offsets).

``GuardedConsumer`` closes these at the source:

- a record fetched before its partition's latest seek is turned away (``SeekFence``);
- Faust's "gaps" are not booked for the source topics: they are plain logs (delete policy, no
  transactional producer) with a record at every offset, so a jump in delivery means records that
  were fetched and dropped, never a hole to commit past;
- after every (re)assignment a source partition without a committed offset is sought to its log
  start (what ``auto_offset_reset=earliest`` means);
- an acknowledgement counts only for a record the agent reported finished (``finished``); any
  other is handed back (``unprocessed``) and fences its partition until re-read (``admit``);
- an offset is committed only when every offset from the committed one (or that log start) up to
  it was acknowledged.

A record batch it cannot decode (``pipeline.kafka.undecodable``: a codec library missing, a corrupt batch)
would otherwise escape ``getmany`` on every fetch and stop the whole consumer. Its partition is held
instead: never fetched from again by this process (nothing of it is acknowledged, so nothing is
committed past it), logged once with topic, partition and offsets, counted in
``xidflow_held_partitions{stage="aggregate"}`` and made a liveness fault; the other partitions flow.
The aggregation's input is written by the parse stage alone, so a corrupt batch is held too rather
than skipped; a worker restarted with the fix reads it from the committed offset.

The watchdog timer heals what is left: a partition whose fetch position stays ahead of delivery,
with an offset never acknowledged below acknowledged ones, or whose last delivered records are
neither acknowledged nor being processed, across two checks, is re-read from its committed offset
(or log start). Re-reading only ever repeats records: the aggregation makes a repeated record a
no-op, or sends the same incident again (at-least-once), never loses one.

One module (about 510 lines) on purpose: the guarded consumer and the watchdog timer close the defects
above together and share their state (seek fences, redo marks); the upstream names they need are in
``pipeline.kafka.upstream``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from aiokafka.errors import KafkaError

from pipeline.kafka import undecodable, upstream
from pipeline.runtime import metrics
from pipeline.runtime.liveness import LIVENESS, Component

log = logging.getLogger("xidflow.fetch_watchdog")


def first_unacked(start: int, acked: Iterable[int]) -> int | None:
    """The lowest offset from ``start`` on that is not acknowledged while a later one is, else None.

    Such an offset holds a record the agent never finished: the source topics are plain logs
    (delete policy, no transactional producer), so every offset holds a record.
    """
    done = {offset for offset in acked if offset >= start}
    if not done:
        return None
    nxt = start
    while nxt in done:
        nxt += 1
    return nxt if nxt < max(done) else None


@dataclass
class StallDetector:
    """Pure part: decides which partitions are stalled from successive observations."""

    checks_before_reseek: int = 2
    _suspect: dict[Any, tuple[Any, int]] = field(default_factory=dict)

    def observe(
        self,
        tp: Any,
        position: int | None,
        delivered: int | None,
        start: int,
        first_missing: int | None = None,
        tail_unacked: bool = False,
    ) -> int | None:
        """One observation; returns the offset to re-read from when ``tp`` is stalled, else None.

        ``delivered`` is Faust's read offset (None: nothing yet); ``start`` is the first record not
        known to be processed: the committed offset, else the log start. ``first_missing`` is a
        record at or after ``start`` never acknowledged while later ones were (``first_unacked``).
        ``tail_unacked`` says the last delivered record (at or after ``start``) is neither
        acknowledged nor being processed, as when the stream skipped it. The answer is always
        ``start``: Faust's read offset is the last delivered record after a delivery but the next
        one to read after a seek, so anything after ``start`` could skip a record that was never
        delivered.
        """
        next_needed = delivered + 1 if delivered is not None else start
        fetched_ahead = position is not None and position > next_needed
        if not fetched_ahead and first_missing is None and not tail_unacked:
            self._suspect.pop(tp, None)
            return None
        # Still the same hole, the same undelivered fetch or the same unacknowledged tail: stuck,
        # not in flight.
        if first_missing is not None:
            signature: tuple[Any, ...] = ("head", first_missing, start)
        else:
            signature = ("fetch" if fetched_ahead else "tail", delivered, start)
        seen, count = self._suspect.get(tp, (None, 0))
        count = count + 1 if seen == signature else 1
        self._suspect[tp] = (signature, count)
        if count >= self.checks_before_reseek:
            self._suspect.pop(tp, None)
            return start
        return None

    def forget(self, keep: set[Any]) -> None:
        for tp in list(self._suspect):
            if tp not in keep:
                del self._suspect[tp]


@dataclass
class SeekFence:
    """Pure part: which records Faust may hand out after their partition was sought.

    After a seek to ``T`` a partition's records are turned away until the record at ``T`` comes,
    unless they were fetched after the seek (aiokafka only returns records at its new position
    then). A record turned away belongs to the position the seek left: the seek reads it again, in
    order. "Fetched after" is judged conservatively (the seek is counted once it returned), so
    fresh records fetched while it ran are let through by their offset.
    """

    _seeks: int = 0
    _sought_at: dict[Any, int] = field(default_factory=dict)  # partition -> number of its latest seek
    _fetched_at: int = 0  # number of seeks done when the records being handed out were fetched
    _target: dict[Any, int] = field(default_factory=dict)  # partition -> offset sought, not yet read

    def sought(self, targets: dict[Any, int]) -> None:
        """``targets``' partitions were just sought to these offsets."""
        self._seeks += 1
        for tp, offset in targets.items():
            self._sought_at[tp] = self._seeks
            self._target[tp] = offset

    def fetched(self) -> None:
        """A new batch of records was just fetched."""
        self._fetched_at = self._seeks

    def admit(self, tp: Any, offset: int) -> bool:
        """May the record at ``offset`` of ``tp``, from the batch being handed out, go to Faust?"""
        target = self._target.get(tp)
        if target is None:
            return True
        if offset == target or self._sought_at.get(tp, 0) <= self._fetched_at:
            del self._target[tp]  # the partition reads at its new position
            return True
        return False

    def last_delivered(self, tp: Any, read_offset: int | None) -> int | None:
        """Faust's read offset as the last record delivered: None when nothing was since a seek.

        Faust's read offset is the last delivered record, except right after a seek, where it is
        the next one to read.
        """
        if read_offset is None or self._target.get(tp) == read_offset:
            return None
        return read_offset

    def forget(self, keep: set[Any]) -> None:
        for tp in set(self._sought_at) - keep:
            del self._sought_at[tp]
        for tp in set(self._target) - keep:
            del self._target[tp]


FETCH_MAX_WAIT_MS = 50
"""How long one fetch of the worker's consumers waits for data on the broker (aiokafka: 500 ms, Faust's
consumer: 1,500 ms, hard-coded). aiokafka keeps one fetch in flight per broker and leaves partitions
with records not yet handed out out of it; a partition drained while that long poll waits is fetched
only once it returns. In a burst that held a quarter of the fault events for 0.5-1.5 s. An idle
worker sends a small empty fetch every this many ms instead."""


IDLE_FETCH_MAX_WAIT_MS = 500
"""How long a fetch of the worker's consumers waits on the broker when it asks for every assigned partition
(nothing buffered, nothing paused: ``upstream.long_poll_when_idle``), aiokafka's default: such a fetch holds
no partition back, the broker answers it at the first record. An idle worker then fetches twice a second
per consumer instead of 20 times."""


class GuardedConsumer(upstream.FaustConsumer):
    """Faust's aiokafka consumer that neither skips nor commits past a source record.

    ``source_topics`` (set by ``guard``) are the topics whose records must all reach the agents;
    others (the table's changelog) keep Faust's behaviour.
    """

    source_topics: frozenset[str] = frozenset()
    fetch_max_wait_ms: int = FETCH_MAX_WAIT_MS
    idle_fetch_max_wait_ms: int | None = IDLE_FETCH_MAX_WAIT_MS
    _undecodable: undecodable.Undecodable | None = None
    _live: Component | None = None

    @property
    def undecodable(self) -> undecodable.Undecodable:
        """Batches this consumer could not decode, and the partitions it holds for them."""
        if self._undecodable is None:
            self._undecodable = undecodable.Undecodable()
        return self._undecodable

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._log_start: dict[Any, int] = {}
        self.redo: dict[Any, int] = {}  # source partition -> lowest offset an agent did not finish
        self.redone: dict[Any, int] = {}  # fenced partition -> watchdog checks left before seeking again
        self._finished: Counter[tuple[Any, int]] = Counter()  # (tp, offset) finished, until acknowledged
        self._finishing: Counter[tuple[Any, int]] = Counter()  # (tp, offset) whose effects are on their way
        self._held_acks: dict[tuple[Any, int], list[Any]] = {}  # their acknowledgements, until then
        self.seek_fence = SeekFence()
        self._undelivered = 0  # source records of the fetch being handed out, not yet handed to Faust

    def undelivered(self) -> int:
        """Source records of the fetch Faust is handing to the agents' channels, not handed yet.

        Faust hands a fetch out a record at a time, with a loop turn every 100 records: an agent
        taking a batch meanwhile sees a queue still filling (``pipeline.aggregate.stream_batches``).
        """
        return self._undelivered

    async def fetch_records(self, active_partitions: Any, timeout: float) -> Any:  # noqa: ASYNC109 - Faust's signature
        held = self._held_partitions()
        if held and active_partitions is not None:
            active_partitions = set(active_partitions) - held
            if not active_partitions:  # an empty set would mean "every partition" to aiokafka
                await asyncio.sleep(min(timeout, 1.0))
                return {}
        try:
            records = await super().fetch_records(active_partitions, timeout)
        except Exception as exc:
            failure = upstream.locate_undecodable(exc)
            if failure is None:
                raise
            self._hold(failure)
            # Other partitions' records this fetch took before the failure (their positions are past
            # them already): handed out now, or never read.
            records = upstream.drained_before(exc)
        self.seek_fence.fetched()
        source = self.source_topics
        self._undelivered = sum(len(batch) for tp, batch in records.items() if tp.topic in source)
        return records

    def _held_partitions(self) -> set[Any]:
        """Held partitions still assigned here (one that moved away is its new owner's to meet)."""
        if self._undecodable is None or not self._undecodable.held:
            return set()
        assigned = {(tp.topic, tp.partition): tp for tp in self.assignment()}
        for key in [k for k in self.undecodable.held if k not in assigned]:
            failure = self.undecodable.held.pop(key)
            self._release(failure)
        return {assigned[k] for k in self.undecodable.held}

    def _hold(self, failure: undecodable.Failure) -> None:
        topic = metrics.bounded(failure.topic, self.source_topics)
        text = failure.describe(undecodable.Action.HOLD)
        if self.undecodable.first_report(failure):
            log.error("aggregate: %s", text)
            metrics.UNDECODABLE_BATCHES.labels("aggregate", topic, failure.reason.value).inc()
        self.undecodable.hold(failure)
        if self._live is None:
            app_id = getattr(getattr(getattr(self, "app", None), "conf", None), "id", None) or f"{id(self):x}"
            self._live = LIVENESS.component(f"aggregate-fetch:{app_id}", stall_after_s=float("inf"))
        self._live.fault(f"{failure.topic}[{failure.partition}]", text)
        self._held_gauge(topic)

    def _release(self, failure: undecodable.Failure) -> None:
        if self._live is not None:
            self._live.clear(f"{failure.topic}[{failure.partition}]")
        self._held_gauge(metrics.bounded(failure.topic, self.source_topics))

    def _held_gauge(self, topic: str) -> None:
        count = sum(1 for t, _ in self.undecodable.held if metrics.bounded(t, self.source_topics) == topic)
        metrics.HELD_PARTITIONS.labels("aggregate", topic).set(count)

    async def getmany(self, timeout: float) -> AsyncIterator[tuple[Any, Any]]:  # noqa: ASYNC109 - Faust's signature
        # Faust iterates one fetched batch while the watchdog (or a rebalance) may seek: what is
        # left of the batch for a sought partition must not reach Faust's read offset and gaps.
        fence = self.seek_fence
        source = self.source_topics
        try:
            async for tp, message in super().getmany(timeout):
                if tp.topic in source:
                    self._undelivered -= 1
                    if not fence.admit(tp, message.offset):
                        continue
                yield tp, message
        finally:
            self._undelivered = 0  # the rest of the fetch (if any) is dropped: read again after a seek

    async def seek(self, partition: Any, offset: int) -> None:
        await super().seek(partition, offset)
        self._sought({partition: offset})

    def _sought(self, targets: dict[Any, int]) -> None:
        targets = {tp: offset for tp, offset in targets.items() if tp.topic in self.source_topics}
        self.seek_fence.sought(targets)

    def keeps_gap(self, tp: Any) -> bool:
        # A jump in delivery on a source topic is records fetched and dropped (see the module
        # docstring), not a hole in the log: booked as a gap, Faust would commit past them.
        return tp.topic not in self.source_topics

    def finished(self, messages: Iterable[Any]) -> None:
        """An agent made these messages' effects durable: their acknowledgement may count."""
        self._finished.update((m.tp, m.offset) for m in messages)  # a re-read twin counts apart

    def finishing(self, messages: Iterable[Any], durable: asyncio.Future[Any]) -> None:
        """These messages' effects are durable once ``durable`` is done: their acknowledgements wait for it.

        The agent goes on to its next batch meanwhile. Done: they count as ``finished`` (an
        acknowledgement that came in the meantime counts then). Failed or cancelled: they are
        ``unprocessed``, read again.
        """
        messages = list(messages)
        keys = [(m.tp, m.offset) for m in messages]
        self._finishing.update(keys)

        def settle(future: asyncio.Future[Any]) -> None:
            self._finishing.subtract(keys)
            held: list[Any] = []
            for key in keys:
                if self._finishing[key] <= 0:
                    del self._finishing[key]
                    held += self._held_acks.pop(key, [])
            failed = future.cancelled() or future.exception() is not None
            if failed:
                log.error("aggregate: a batch's node states did not reach the changelog (%s); reading it again",
                          "cancelled" if future.cancelled() else future.exception())
                self.unprocessed(messages)
                return
            self.finished(messages)
            for message in held:
                self.ack(message)

        durable.add_done_callback(settle)

    def ack(self, message: Any) -> bool:
        # Source records are acknowledged without the agent's code finishing them in some paths (a
        # stale event skipped, a batch the agent failed on, a stream at shutdown): only finished records count.
        if message.tp.topic in self.source_topics and not message.acked:
            key = (message.tp, message.offset)
            if self._finishing[key] > 0:  # its effects are on their way (``finishing``): counted then
                self._held_acks.setdefault(key, []).append(message)
                return False
            self._finishing.pop(key, None)
            if self._finished[key] <= 0:
                self._finished.pop(key, None)
                self.unprocessed([message])
                return False
            self._finished[key] -= 1
            if not self._finished[key]:
                del self._finished[key]
        return super().ack(message)

    def unprocessed(self, messages: Iterable[Any]) -> None:
        """``messages`` were delivered but their effects are not durable: read them again.

        Each is marked acknowledged without counting as such, so no later ``ack`` (the
        aggregation's batches are acknowledged even when the agent failed on them) lets a commit pass
        it. Its partition is fenced at its offset: ``admit`` turns away the partition's later
        records until the re-read (from the committed offset, by the watchdog) reaches the fence,
        so nothing after it is applied before it.
        """
        for message in messages:
            message.acked = True
            self.forget_unacked(message)
            tp = message.tp
            if tp.topic in self.source_topics:
                self.redo[tp] = min(self.redo.get(tp, message.offset), message.offset)

    def admit(self, messages: Iterable[Any]) -> list[Any]:
        """The messages an agent may apply now, in order; those after a fence are handed back."""
        out: list[Any] = []
        turned_away: list[Any] = []
        for message in messages:
            fence = self.redo.get(message.tp)
            if fence is not None and message.offset > fence:
                turned_away.append(message)
                continue
            if fence is not None:
                del self.redo[message.tp]  # the re-read reached the fence: the partition flows again
                self.redone.pop(message.tp, None)
            out.append(message)
        if turned_away:
            self.unprocessed(turned_away)
        return out

    def resume_offset(self, tp: Any) -> int | None:
        """The first offset of ``tp`` not known to be processed: committed, else the log start.

        A committed offset below the log start (records gone by retention) resumes at the log start.
        """
        committed = self.committed_offset(tp)
        log_start = self._log_start.get(tp)
        if committed is None:
            return log_start
        return committed if log_start is None else max(committed, log_start)

    async def refresh_log_start(self, tp: Any) -> int:
        start = (await self.earliest_offsets(tp)).get(tp) or 0
        self._log_start[tp] = start
        return start

    async def perform_seek(self) -> None:
        await super().perform_seek()
        self.redone.clear()  # Faust just sought every partition back to its committed offset
        assigned = [tp for tp in self.assignment() if tp.topic in self.source_topics]
        self._sought({tp: self.committed_offset(tp) or 0 for tp in assigned})
        self._log_start = dict(await self.earliest_offsets(*assigned)) if assigned else {}
        # Faust records a committed 0 as None; aiokafka seeks neither a missing nor a 0 commit, and
        # Faust's seek leaves a commit below the log start to the fetcher's reset.
        for tp in assigned:
            resume = self.resume_offset(tp)
            if resume is not None and resume != self.committed_offset(tp):
                await self.seek(tp, resume)

    def offset_to_commit(self, tp: Any) -> int | None:
        if tp.topic in self.source_topics:
            acked = self.acked_offsets(tp)
            if acked:
                resume = self.resume_offset(tp)
                if resume is None:
                    return None  # not positioned by us yet: commit nothing rather than guess
                if resume < min(acked):
                    return None  # a record below the acknowledged ones was never acknowledged
                # Faust commits the first run of consecutive acknowledged offsets: it stops at the
                # first record not acknowledged.
        return super().offset_to_commit(tp)


def guard(app: Any, source_topics: set[str], fetch_max_wait_ms: int = FETCH_MAX_WAIT_MS) -> None:
    """Make ``app`` use ``GuardedConsumer`` for ``source_topics`` (before its consumer is created)."""
    app.transport.Consumer = type(
        "GuardedConsumer",
        (GuardedConsumer,),
        {"source_topics": frozenset(source_topics), "fetch_max_wait_ms": fetch_max_wait_ms,
         "idle_fetch_max_wait_ms": max(IDLE_FETCH_MAX_WAIT_MS, fetch_max_wait_ms)},
    )


def install(
    app: Any, source_topics: set[str], interval_s: float = 1.5, fetch_max_wait_ms: int = FETCH_MAX_WAIT_MS
) -> StallDetector:
    """Guard ``app``'s consumer and register the watchdog as a Faust timer for the source topics."""
    guard(app, source_topics, fetch_max_wait_ms)
    detector = StallDetector()

    @app.timer(interval=interval_s)
    async def fetch_watchdog() -> None:
        try:
            await _check(app, source_topics, detector)
        except (KafkaError, OSError) as exc:  # OSError: TimeoutError and lost connections too
            # The broker is away (an outage, a restart): the log-start lookups time out after the client's
            # request timeout. An exception out of a Faust timer stops the worker, so this round is skipped; the
            # next one looks again, and the consumer's own reconnects say that the broker is gone.
            log.debug("fetch watchdog: broker unavailable, check skipped (%s)", type(exc).__name__)

    return detector


async def _check(app: Any, source_topics: set[str], detector: StallDetector) -> None:
    """One round of the watchdog over the source partitions assigned to ``app``'s consumer."""
    consumer = app.consumer
    if not getattr(consumer, "flow_active", True) or not isinstance(consumer, GuardedConsumer):
        return
    try:
        paused, position_of = consumer.fetch_positions()
    except Exception:  # noqa: BLE001 - internals moved: the watchdog stands down, the worker goes on
        return
    tps = [tp for tp in consumer.assignment() if tp.topic in source_topics]
    detector.forget(set(tps))
    consumer.seek_fence.forget(set(tps))
    for tp in set(consumer.redo) - set(tps):
        del consumer.redo[tp]  # a partition that moved is read from its committed offset anyway
    for tp in set(consumer.redone) - set(consumer.redo):
        del consumer.redone[tp]
    in_flight = consumer.in_flight_partitions()  # delivered, being processed
    for tp in tps:
        if tp in paused or consumer.paused_by_faust(tp):
            continue
        try:
            position = position_of(tp)
        except Exception:  # noqa: BLE001 - not assigned any more
            continue
        start = consumer.resume_offset(tp)
        if start is None:
            continue  # not positioned after its assignment yet
        fence = consumer.redo.get(tp)
        if fence is not None:
            await _reread_fenced(consumer, tp, fence, start)
            continue
        acked = consumer.acked_offsets(tp)
        missing = first_unacked(start, acked) if acked else None
        delivered = consumer.read_offset(tp)
        last = consumer.seek_fence.last_delivered(tp, delivered)
        tail_unacked = (
            last is not None
            and last >= start
            and (not acked or max(acked) < last)
            and tp not in in_flight
        )
        target = detector.observe(
            tp, position, delivered, start, first_missing=missing, tail_unacked=tail_unacked
        )
        if target is None:
            continue
        await consumer.refresh_log_start(tp)
        target = consumer.resume_offset(tp) or target
        log.warning(
            "%s[%d]: fetched up to %s, read offset %s, first unacknowledged %s: re-reading from %d",
            tp.topic, tp.partition, position, delivered, missing, target,
        )
        await consumer.seek(tp, target)


async def _reread_fenced(consumer: GuardedConsumer, tp: Any, fence: int, start: int) -> None:
    """Seek a fenced partition back to its committed offset; again if the fence is not reached soon."""
    left = consumer.redone.get(tp, 0)
    if left > 0:
        consumer.redone[tp] = left - 1
        return
    target = max(start, await consumer.refresh_log_start(tp))
    if target > fence:  # the unfinished records are gone from the log: nothing left to wait for
        log.warning("%s[%d]: unfinished records from %d are no longer in the log", tp.topic, tp.partition, fence)
        del consumer.redo[tp]
        consumer.redone.pop(tp, None)
        return
    log.warning("%s[%d]: records from %d not finished by the agent; re-reading from %d",
                tp.topic, tp.partition, fence, target)
    consumer.redone[tp] = 3
    await consumer.seek(tp, target)
