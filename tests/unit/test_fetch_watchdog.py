"""The fetch watchdog re-reads stalled partitions from the first record not known processed, and the
commit guard never lets an offset pass a record the agent did not acknowledge."""

import asyncio
from collections import Counter

import pytest
from faust.types import TP

from agents.worker import create_app
from pipeline.kafka import upstream
from pipeline.kafka.fetch_watchdog import GuardedConsumer, SeekFence, StallDetector, first_unacked


def test_progressing_partition_is_never_reseeked() -> None:
    d = StallDetector()
    for delivered in range(0, 50, 5):
        assert d.observe("p0", position=delivered + 20, delivered=delivered, start=0) is None


def test_caught_up_partition_is_not_suspect() -> None:
    d = StallDetector()
    for _ in range(5):
        assert d.observe("p0", position=11, delivered=10, start=0) is None
        assert d.observe("p1", position=0, delivered=None, start=0) is None


def test_fetched_but_undelivered_records_are_re_read_from_the_committed_offset() -> None:
    # Faust's read offset is the next record to read right after a seek (to the committed offset 7),
    # so "delivered + 1" would skip record 7: the re-read starts at the committed offset.
    d = StallDetector()
    assert d.observe("p2", position=22, delivered=7, start=7) is None  # first sight: maybe in flight
    assert d.observe("p2", position=22, delivered=7, start=7) == 7  # still stuck: re-read from 7


def test_nothing_delivered_resumes_from_the_start_offset() -> None:
    d = StallDetector()
    d.observe("p0", position=18, delivered=None, start=5)
    assert d.observe("p0", position=18, delivered=None, start=5) == 5


def test_delivery_between_checks_clears_the_suspicion() -> None:
    d = StallDetector()
    d.observe("p0", position=30, delivered=10, start=3)
    assert d.observe("p0", position=30, delivered=12, start=3) is None  # it moved: count restarts
    assert d.observe("p0", position=30, delivered=12, start=3) == 3


def test_unacknowledged_head_is_re_read_even_when_delivery_moves_on() -> None:
    d = StallDetector()
    assert d.observe("p0", position=30, delivered=29, start=4, first_missing=9) is None
    assert d.observe("p0", position=31, delivered=30, start=4, first_missing=9) == 4


def test_a_delivered_tail_nobody_acknowledges_is_re_read() -> None:
    # The stream skipped the last records it was handed (flow suspended, stale generation): they
    # count as read, are never acknowledged, and nothing later would reveal them.
    d = StallDetector()
    assert d.observe("p0", position=59, delivered=58, start=39, tail_unacked=True) is None
    assert d.observe("p0", position=59, delivered=58, start=39, tail_unacked=True) == 39


def test_a_tail_still_moving_is_not_stalled() -> None:
    d = StallDetector()
    assert d.observe("p0", position=59, delivered=50, start=39, tail_unacked=True) is None
    assert d.observe("p0", position=59, delivered=58, start=39, tail_unacked=True) is None  # delivery moved
    assert d.observe("p0", position=59, delivered=58, start=45, tail_unacked=True) is None  # commit moved


def test_records_fetched_before_their_partitions_seek_are_turned_away_until_the_target() -> None:
    fence = SeekFence()
    fence.fetched()  # a batch with records of p0 (from 10 on) and p1 is being handed out ...
    fence.sought({"p0": 5})  # ... when p0 is sought back to 5
    assert not fence.admit("p0", 11) and not fence.admit("p0", 12)  # left from the old position
    assert fence.admit("p1", 4)  # other partitions flow
    fence.fetched()  # the next batch is read at the new position
    assert fence.admit("p0", 5) and fence.admit("p0", 6)


def test_the_record_at_the_target_opens_the_partition_even_in_a_batch_counted_as_older() -> None:
    # The seek counts once it returned; records fetched while it ran start at its target.
    fence = SeekFence()
    fence.fetched()
    fence.sought({"p0": 5})
    assert fence.admit("p0", 5) and fence.admit("p0", 6) and fence.admit("p0", 7)


def test_right_after_a_seek_faust_s_read_offset_is_not_a_delivered_record() -> None:
    fence = SeekFence()
    fence.sought({"p0": 5})
    assert fence.last_delivered("p0", 5) is None  # Faust's read offset says "next to read" here
    fence.fetched()
    assert fence.admit("p0", 5)
    assert fence.last_delivered("p0", 5) == 5  # record 5 was handed out: now it is the last one read
    assert fence.last_delivered("p1", None) is None


def test_forget_drops_partitions_no_longer_assigned() -> None:
    d = StallDetector()
    d.observe("p0", position=30, delivered=10, start=0)
    d.forget(set())
    assert d.observe("p0", position=30, delivered=10, start=0) is None


def test_first_unacked() -> None:
    assert first_unacked(5, [5, 6, 7]) is None  # a run from the start: nothing missing
    assert first_unacked(5, [4, 5, 6]) is None  # Faust keeps the last committed offset (4) in the list
    assert first_unacked(5, [6, 7]) == 5  # the record at the committed offset was never acknowledged
    assert first_unacked(0, [0, 1, 2, 3, 14, 15]) == 4  # records dropped in the middle, later ones done
    assert first_unacked(5, [4]) is None
    assert first_unacked(5, [5, 6, 9]) == 7


async def test_a_jump_in_delivery_is_not_booked_as_a_hole_on_a_source_topic() -> None:
    # Faust books the offsets between two delivered records as a gap and commits past it; on the
    # source topics (plain logs, a record at every offset) that gap is records fetched and dropped.
    consumer = _guarded()
    consumer._gap = {}
    await consumer._add_gap(TP("fault", 0), 4, 13)
    assert consumer._gap == {}


def test_worker_app_uses_the_guarded_consumer() -> None:
    xapp = create_app("127.0.0.1:9", topics=None)
    consumer_class = xapp.app.transport.Consumer
    assert issubclass(consumer_class, GuardedConsumer)
    assert xapp.fault_events.get_topic_name() in consumer_class.source_topics
    assert xapp.ticks.get_topic_name() in consumer_class.source_topics


class _Msg:
    def __init__(self, tp: TP, offset: int) -> None:
        self.tp, self.offset, self.acked = tp, offset, False


def _guarded() -> GuardedConsumer:
    consumer = object.__new__(type("G", (GuardedConsumer,), {"source_topics": frozenset({"fault"})}))
    consumer.redo, consumer.redone, consumer._unacked_messages = {}, {}, set()
    consumer._finished, consumer._finishing, consumer._held_acks = Counter(), Counter(), {}
    return consumer


def test_an_unfinished_batch_is_never_counted_and_fences_its_partition_until_re_read() -> None:
    consumer = _guarded()
    p0, p1 = TP("fault", 0), TP("fault", 1)
    batch = [_Msg(p0, 10), _Msg(p0, 11), _Msg(p1, 4)]
    consumer.unprocessed(batch)
    assert all(m.acked for m in batch)  # a later ack (take_events closing) is a no-op: never committed
    assert consumer.redo == {p0: 10, p1: 4}
    later = [_Msg(p0, 12), _Msg(p1, 5)]
    assert consumer.admit(later) == []  # queued after the failure: turned away, re-read later
    assert consumer.redo == {p0: 10, p1: 4}
    reread = [_Msg(p0, 8), _Msg(p0, 9), _Msg(p0, 10), _Msg(p0, 11), _Msg(p0, 12)]
    assert consumer.admit(reread) == reread  # the re-read from the committed offset flows again
    assert consumer.redo == {p1: 4}


def test_other_topics_are_not_fenced() -> None:
    consumer = _guarded()
    consumer.unprocessed([_Msg(TP("changelog", 0), 3)])
    assert consumer.redo == {}


def test_an_acknowledgement_counts_only_for_records_the_agent_finished() -> None:
    consumer = _guarded()
    p0 = TP("fault", 0)
    stray = _Msg(p0, 7)
    assert consumer.ack(stray) is False  # acknowledged by Faust without the agent finishing it
    assert stray.acked and consumer.redo == {p0: 7}


def _count_faust_acks(monkeypatch) -> list[int]:  # noqa: ANN001
    """Faust's own ``ack`` (what GuardedConsumer lets through) records the offsets it counts."""
    counted: list[int] = []

    def ack(self, message) -> bool:  # noqa: ANN001
        if message.acked:
            return False
        message.acked = True
        counted.append(message.offset)
        return True

    monkeypatch.setattr(upstream.faust_aiokafka.Consumer, "ack", ack)
    return counted


async def test_a_batch_whose_states_are_on_their_way_is_acknowledged_once_they_are_durable(monkeypatch) -> None:
    counted = _count_faust_acks(monkeypatch)
    consumer = _guarded()
    p0 = TP("fault", 0)
    batch = [_Msg(p0, 3), _Msg(p0, 4)]
    durable = asyncio.get_running_loop().create_future()
    consumer.finishing(batch, durable)
    assert consumer.ack(batch[0]) is False  # take_events acknowledges it while the changelog write is out
    assert counted == [] and not batch[0].acked and consumer.redo == {}  # held, neither counted nor fenced
    durable.set_result(None)
    await asyncio.sleep(0)
    assert counted == [3]  # counted once durable
    assert consumer.ack(batch[1]) is True and counted == [3, 4]  # one acknowledged after that counts at once


async def test_a_batch_whose_states_did_not_reach_the_changelog_is_read_again(monkeypatch) -> None:
    counted = _count_faust_acks(monkeypatch)
    consumer = _guarded()
    p0 = TP("fault", 0)
    batch = [_Msg(p0, 3), _Msg(p0, 4)]
    durable = asyncio.get_running_loop().create_future()
    consumer.finishing(batch, durable)
    consumer.ack(batch[0])
    durable.set_exception(RuntimeError("broker gone"))
    await asyncio.sleep(0)
    assert counted == [] and all(m.acked for m in batch)  # never committed past
    assert consumer.redo == {p0: 3}  # fenced until the watchdog re-reads it
    assert consumer.ack(batch[1]) is False and counted == []


async def test_a_seek_mid_batch_drops_the_rest_of_the_batch_for_that_partition(monkeypatch) -> None:
    # Faust hands out a fetched batch record by record; the watchdog seeks p0 back to 5 half-way.
    # The rest of p0's batch must not reach Faust (it would move the read offset past the re-read
    # and book the skipped offsets as a hole); p1 and the next fetch flow as usual.
    from faust.transport.drivers import aiokafka as faust_aiokafka

    p0, p1 = TP("fault", 0), TP("fault", 1)
    batches = [[(p0, _Msg(p0, 10)), (p1, _Msg(p1, 3)), (p0, _Msg(p0, 11)), (p1, _Msg(p1, 4))],
               [(p0, _Msg(p0, 5))]]

    async def fake_getmany(self, timeout):  # noqa: ASYNC109 - Faust's signature; fetch once, hand the batch out
        await self._getmany(None, timeout)
        for item in batches.pop(0):
            yield item

    async def fake_fetch(self, active_partitions, timeout):  # noqa: ASYNC109 - Faust's signature
        return {}

    async def fake_seek(self, partition, offset):
        pass

    monkeypatch.setattr(faust_aiokafka.Consumer, "getmany", fake_getmany)
    monkeypatch.setattr(faust_aiokafka.ThreadDelegateConsumer, "_getmany", fake_fetch)
    monkeypatch.setattr(faust_aiokafka.ThreadDelegateConsumer, "_seek", fake_seek)
    consumer = _guarded()
    consumer.seek_fence, consumer._read_offset, consumer._gap = SeekFence(), {p0: 12}, {}
    consumer.log = type("Log", (), {"dev": lambda *a, **k: None})()
    handed_out = []
    async for tp, message in consumer.getmany(1.0):
        handed_out.append((tp.partition, message.offset))
        if message.offset == 10:
            await consumer.seek(p0, 5)
    assert handed_out == [(0, 10), (1, 3), (1, 4)]
    assert consumer._read_offset[p0] == 5
    assert [(tp.partition, m.offset) async for tp, m in consumer.getmany(1.0)] == [(0, 5)]


async def test_a_broker_away_skips_the_watchdogs_round_instead_of_stopping_the_worker(monkeypatch) -> None:
    """During an outage the log-start lookup times out (KafkaTimeoutError after the request timeout); out of a
    Faust timer that exception stopped the whole worker (seen with Kafka down ~50 s under Fluent Bit)."""
    from aiokafka.errors import KafkaConnectionError, KafkaTimeoutError

    from pipeline.kafka import fetch_watchdog

    timers: list = []

    class App:
        transport = type("Transport", (), {"Consumer": object})()

        def timer(self, interval: float):  # noqa: ANN202 - Faust's decorator
            return lambda fn: timers.append(fn) or fn

    fetch_watchdog.install(App(), {"src"})
    for exc in (KafkaTimeoutError("Failed to get offsets by times in 40000 ms"), KafkaConnectionError("gone"),
                TimeoutError(), ConnectionRefusedError()):
        async def failing(*_: object, exc: Exception = exc) -> None:
            raise exc

        monkeypatch.setattr(fetch_watchdog, "_check", failing)
        await timers[0]()  # returns: this round is skipped, the next one looks again

    async def broken(*_: object) -> None:
        raise ValueError("a bug is still a bug")

    monkeypatch.setattr(fetch_watchdog, "_check", broken)
    with pytest.raises(ValueError):
        await timers[0]()
