"""Undecodable record batches (pure): where aiokafka's decode failure is, and hold vs skip.

``locate`` is checked against aiokafka's real record iterator (``PartitionRecords``) over real
record batches: an lz4 batch read while the codec library is missing, and a batch whose bytes were
changed after its CRC was computed.
"""

from __future__ import annotations

import pytest
from aiokafka import TopicPartition
from aiokafka import codec as aiokafka_codec
from aiokafka.consumer.fetcher import PartitionRecords
from aiokafka.errors import KafkaError
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.structs import ConsumerRecord

from pipeline.kafka.undecodable import Action, Failure, Reason, Undecodable
from pipeline.kafka.upstream import locate_undecodable as locate
from pipeline.runtime.liveness import Component

TP = TopicPartition("gpu.logs.kernel", 3)
LZ4 = 0x03


def batch(base: int, count: int, codec: int = 0) -> bytes:
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=codec, is_transactional=False,
                                        producer_id=-1, producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    for i in range(count):
        builder.append(i, timestamp=1_750_000_000_000, key=b"node", value=b"line %d" % i, headers=[])
    data = bytearray(builder.build())
    data[0:8] = base.to_bytes(8, "big")  # the broker assigns the base offset (not covered by the CRC)
    return bytes(data)


def read(data: bytes, fetch_offset: int) -> list[ConsumerRecord]:
    records = PartitionRecords(TP, MemoryRecords(data), [], fetch_offset, None, None, True, 0)
    return list(records)


def failure_of(data: bytes, fetch_offset: int) -> tuple[BaseException, Failure | None]:
    with pytest.raises(Exception) as info:
        read(data, fetch_offset)
    return info.value, locate(info.value)


def test_an_lz4_batch_without_its_library_is_located_with_its_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    data = batch(10, 2) + batch(12, 5, LZ4)
    assert [r.offset for r in read(data, 10)] == [10, 11, 12, 13, 14, 15, 16]  # readable with the library
    monkeypatch.setattr(aiokafka_codec, "has_lz4", lambda: False)
    exc, failure = failure_of(data, 10)
    assert failure == Failure(TP.topic, 3, 12, 16, Reason.UNSUPPORTED_CODEC,
                              "UnsupportedCodecError: Libraries for lz4 compression codec not found")
    text = failure.describe(Action.HOLD)
    assert "HELD" in text and "gpu.logs.kernel[3] offset 12-16" in text


def test_a_batch_changed_after_its_crc_is_located_as_corrupt() -> None:
    good = batch(0, 3)
    bad = bytearray(batch(3, 4))
    bad[-3] ^= 0xFF  # a byte of the last record's value
    exc, failure = failure_of(good + bytes(bad), 0)
    assert failure is not None and (failure.first_offset, failure.last_offset) == (3, 6)
    assert failure.reason is Reason.CORRUPT and "CorruptRecordException" in failure.error
    assert "SKIPPED" in failure.describe(Action.SKIP)


def test_other_errors_are_not_batches() -> None:
    try:
        raise KafkaError("connection lost")
    except KafkaError as exc:
        assert locate(exc) is None


def _failure(reason: Reason, first: int = 12, last: int | None = 16) -> Failure:
    return Failure("t", 0, first, last, reason, "E: x")


def test_good_records_before_the_batch_are_read_first() -> None:
    u = Undecodable()
    assert u.decide(_failure(Reason.UNSUPPORTED_CODEC), position=10) is Action.APPROACH
    assert u.decide(_failure(Reason.CORRUPT), position=11) is Action.APPROACH


def test_a_missing_codec_is_held_a_corrupt_batch_skipped_after_one_refetch() -> None:
    u = Undecodable()
    assert u.decide(_failure(Reason.UNSUPPORTED_CODEC), position=12) is Action.HOLD
    assert u.decide(_failure(Reason.UNSUPPORTED_CODEC), position=12) is Action.HOLD  # never skipped
    corrupt = _failure(Reason.CORRUPT)
    assert u.decide(corrupt, position=12) is Action.RETRY
    assert u.decide(corrupt, position=12) is Action.SKIP
    assert u.resume_after(corrupt) == 17
    assert u.resume_after(_failure(Reason.CORRUPT, last=None)) == 13


def test_each_batch_is_reported_once_and_held_partitions_are_released_on_reassignment() -> None:
    u = Undecodable()
    held = _failure(Reason.UNSUPPORTED_CODEC)
    assert u.first_report(held) and not u.first_report(held)
    assert u.first_report(_failure(Reason.UNSUPPORTED_CODEC, first=40))
    u.hold(held)
    assert u.release_all() == [held] and not u.held
    assert not u.first_report(held)  # met again after a rebalance: not logged again


def test_a_fault_makes_the_component_stalled_at_once_until_cleared() -> None:
    c = Component("parse:g", 120.0, last_beat=0.0, last_progress=0.0)
    assert c.stalled(1.0) is None
    c.fault("t[0]", "undecodable record batch at t[0] offset 5")
    c.progressed(2.0, idle=True)  # other partitions flowing do not hide it
    assert c.stalled(2.0) == "parse:g: undecodable record batch at t[0] offset 5"
    c.clear("t[0]")
    assert c.stalled(2.0) is None


# -- the records getmany had taken before the failure --------------------------------------------


async def test_records_drained_before_another_partitions_decode_failure_are_handed_out() -> None:
    """aiokafka's real ``Fetcher.fetched_records`` over real batches: partition 1 is taken (position
    moved past it) before partition 3's corrupt batch raises; ``drained_before`` returns partition 1's
    records, exactly the ones whose position moved, and nothing of partition 3."""
    from aiokafka.consumer.fetcher import Fetcher, FetchResult
    from aiokafka.consumer.subscription_state import SubscriptionState

    from pipeline.kafka.upstream import drained_before

    good_tp, bad_tp = TopicPartition(TP.topic, 1), TP
    bad = bytearray(batch(0, 2) + batch(2, 3))
    bad[-5] ^= 0x20  # a value byte of the second batch: its CRC no longer matches
    subscriptions = SubscriptionState()
    subscriptions.assign_from_user([good_tp, bad_tp])
    assignment = subscriptions.subscription.assignment
    for tp in (good_tp, bad_tp):
        subscriptions.seek(tp, 0)

    def result(tp: TopicPartition, data: bytes) -> FetchResult:
        records = PartitionRecords(tp, MemoryRecords(data), [], 0, None, None, True, 0)
        return FetchResult(tp, assignment=assignment, partition_records=records, backoff=0)

    fetcher = Fetcher.__new__(Fetcher)  # its drain loop only: no client, no fetch task
    fetcher._subscriptions = subscriptions
    fetcher._wait_consume_future = None
    fetcher._records = {good_tp: result(good_tp, batch(0, 4)), bad_tp: result(bad_tp, bytes(bad))}
    with pytest.raises(KafkaError) as info:
        await fetcher.fetched_records((), timeout=0)
    failure = locate(info.value)
    assert failure is not None and (failure.partition, failure.first_offset) == (3, 2)
    assert assignment.state_value(good_tp).position == 4  # moved: nobody would read 0-3 again
    drained = drained_before(info.value)
    assert {tp: [r.offset for r in rs] for tp, rs in drained.items()} == {good_tp: [0, 1, 2, 3]}
    assert assignment.state_value(bad_tp).position == 0  # the failing partition did not move


def test_nothing_is_drained_from_an_exception_raised_elsewhere() -> None:
    from pipeline.kafka.upstream import drained_before

    try:
        raise KafkaError("not from the fetcher")
    except KafkaError as exc:
        assert drained_before(exc) == {}
