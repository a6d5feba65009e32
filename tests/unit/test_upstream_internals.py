"""aiokafka's internals behind ``upstream.deliver_bare_records`` (the parse stage's fetch), checked without a broker.

The stage reads aiokafka's decoded records instead of a ``ConsumerRecord`` each by changing one step of
aiokafka's own record iterator, in the fetcher's buffer. Everything else stays aiokafka's: which batches
are read, control batches and aborted transactions skipped, CRC checks, codecs, positions. These tests
fail loudly when the pinned aiokafka moves any of what that relies on (the names, where the fetcher
stores a fetch, how the iterator builds a record), and check on real record batches (every codec, a
legacy message set, transactions aborted and committed, control batches, both isolation levels) that
the bare records are the same records, with the same next fetch position, as the ConsumerRecords.
tests/integration/test_upstream_internals.py checks the rest of the seam against a real broker.
"""

from __future__ import annotations

import collections
import inspect
import re
import struct
from importlib import metadata
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.consumer.fetcher import Fetcher, FetchResult, PartitionRecords
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.legacy_records import LegacyRecordBatchBuilder
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.record.util import calc_crc32c
from aiokafka.structs import ConsumerRecord

from pipeline.kafka import upstream

AIOKAFKA = f"aiokafka {metadata.version('aiokafka')}"
WHO = "upstream.deliver_bare_records (the parse stage reads every record through it)"
TP = TopicPartition("gpu.logs.kernel", 2)
READ_UNCOMMITTED, READ_COMMITTED = 0, 1
NONE, GZIP, SNAPPY, LZ4, ZSTD = 0, 1, 2, 3, 4
ABORT, COMMIT = b"\x00\x00\x00\x00", b"\x00\x00\x00\x01"
_CONTROL_BIT = 0x20
_ATTRIBUTES, _CRC = 21, 17  # byte positions in a v2 batch header; the CRC covers the attributes onwards


# -- the shape of what is relied on ------------------------------------------------------------------------


def _source(fn: Any) -> str:
    return inspect.getsource(fn)


def test_the_consumer_keeps_its_fetcher_and_the_fetcher_its_buffer_and_deserializers() -> None:
    init = _source(AIOKafkaConsumer.__init__) + _source(AIOKafkaConsumer.start)
    assert "self._fetcher = Fetcher(" in init, (
        f"{AIOKAFKA}: the consumer no longer keeps its Fetcher as _fetcher: {WHO}")
    fetcher_init = _source(Fetcher.__init__)
    assert "self._records = collections.OrderedDict()" in fetcher_init, (
        f"{AIOKAFKA}: Fetcher._records is no longer an OrderedDict made once in __init__: {WHO} replaces it")
    for name in ("self._key_deserializer = ", "self._value_deserializer = "):
        assert name in fetcher_init, f"{AIOKAFKA}: Fetcher lost {name.split()[0]}: {WHO} refuses deserializers with it"


def test_the_fetcher_stores_each_fetch_in_its_buffer_before_anything_drains_it() -> None:
    proc = _source(Fetcher._proc_fetch_request)
    assert "self._records[tp] = FetchResult(" in proc and "partition_records=partition_records" in proc, (
        f"{AIOKAFKA}: Fetcher._proc_fetch_request no longer stores a FetchResult with its PartitionRecords in "
        f"self._records[tp]: {WHO} sees no fetch (the stage would get ConsumerRecords, or none of its records)")
    assert "self._partition_records = partition_records" in _source(FetchResult.__init__), (
        f"{AIOKAFKA}: FetchResult no longer keeps its PartitionRecords as _partition_records: {WHO}")
    assert len(re.findall(r"self\._records\s*=[^=]", _source(Fetcher))) == 1, (
        f"{AIOKAFKA}: Fetcher replaces its _records buffer after __init__: {WHO} would be undone")


def test_the_record_iterator_builds_each_record_through_the_one_method_replaced() -> None:
    unpack = _source(PartitionRecords._unpack_records)
    assert unpack.count("self._consumer_record(tp, record)") == 1, (
        f"{AIOKAFKA}: PartitionRecords._unpack_records no longer builds each record with "
        f"self._consumer_record(tp, record): {WHO} changes nothing any more, or not every record")
    consumer_record = _source(PartitionRecords._consumer_record)
    for step in ("self._key_deserializer", "self._value_deserializer", "ConsumerRecord("):
        assert step in consumer_record, (
            f"{AIOKAFKA}: PartitionRecords._consumer_record no longer does {step!r}: re-check what {WHO} skips")


# -- the same records, on real batches ---------------------------------------------------------------------


def _v2(base: int, values: list[bytes], codec: int = NONE, producer_id: int = -1, control: bool = False,
        headers: list[tuple[str, bytes]] | None = None) -> bytes:
    transactional = producer_id >= 0
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=codec, is_transactional=transactional,
                                        producer_id=producer_id, producer_epoch=0 if transactional else -1,
                                        base_sequence=0 if transactional else -1, batch_size=1 << 20)
    for i, value in enumerate(values):
        # A control record's key: version 0, type 0 (abort) or 1 (commit).
        key = (ABORT if value == b"abort" else COMMIT) if control else b"node-%d" % i
        builder.append(i, timestamp=1_750_000_000_000 + i, key=key, value=b"" if control else value,
                       headers=[] if control else list(headers or []))
    data = bytearray(builder.build())
    data[0:8] = base.to_bytes(8, "big")  # the broker assigns the base offset (not covered by the CRC)
    if control:  # a transaction marker: the builder does not set the control bit, a broker does
        attributes = struct.unpack_from(">h", data, _ATTRIBUTES)[0] | _CONTROL_BIT
        struct.pack_into(">h", data, _ATTRIBUTES, attributes)
        struct.pack_into(">I", data, _CRC, calc_crc32c(bytes(data[_ATTRIBUTES:])))
    return bytes(data)


def _legacy(base: int, values: list[bytes]) -> bytes:
    builder = LegacyRecordBatchBuilder(magic=1, compression_type=NONE, batch_size=1 << 20)
    for i, value in enumerate(values):
        builder.append(base + i, timestamp=1_750_000_000_000, key=b"old", value=value)
    return bytes(builder.build())


def _log() -> tuple[bytes, list[tuple[int, int]]]:
    """A partition's fetch: every codec, one aborted and one committed transaction, control batches."""
    parts = []
    offset = 2
    for codec in (NONE, GZIP, SNAPPY, LZ4, ZSTD):
        values = [b"codec %d line %d" % (codec, i) for i in range(4)]
        parts.append(_v2(offset, values, codec, headers=[("xidflow-node", b"n1"), ("empty", b"")]))
        offset += len(values)
    aborted_at = offset
    parts.append(_v2(offset, [b"aborted 1", b"aborted 2"], producer_id=7))
    parts.append(_v2(offset + 2, [b"abort"], producer_id=7, control=True))
    parts.append(_v2(offset + 3, [b"committed 1", b"committed 2"], producer_id=8))
    parts.append(_v2(offset + 5, [b"commit"], producer_id=8, control=True))
    parts.append(_v2(offset + 6, [b"after"], GZIP))
    return b"".join(parts), [(7, aborted_at)]


def _read(data: bytes, aborted: list[tuple[int, int]], isolation: int, bare: bool, fetch_offset: int = 2
          ) -> tuple[list[Any], int]:
    records = PartitionRecords(TP, MemoryRecords(data), aborted, fetch_offset, None, None, True, isolation)
    if bare:
        buffer = upstream._BareFetchBuffer()
        buffer[TP] = FetchResult(TP, assignment=None, partition_records=records, backoff=0)
    return list(records), records.next_fetch_offset


def test_a_legacy_message_set_reads_the_same_bare() -> None:
    # aiokafka reads one fetch in one format (MemoryRecords looks at the first batch's magic).
    data = _legacy(0, [b"legacy a", b"legacy b"])
    full, full_next = _read(data, [], READ_UNCOMMITTED, bare=False, fetch_offset=0)
    bare, bare_next = _read(data, [], READ_UNCOMMITTED, bare=True, fetch_offset=0)
    assert not [r for r in bare if isinstance(r, ConsumerRecord)]
    assert [_facts(r) for r in bare] == [_facts(r) for r in full] and len(full) == 2 and bare_next == full_next == 2


def _facts(record: Any) -> tuple[Any, ...]:
    return record.offset, record.timestamp, record.key, record.value, list(record.headers)


@pytest.mark.parametrize("isolation", [READ_UNCOMMITTED, READ_COMMITTED], ids=["read_uncommitted", "read_committed"])
@pytest.mark.parametrize("fetch_offset", [2, 9])
def test_bare_records_are_the_consumer_records_without_the_record_object(isolation: int, fetch_offset: int) -> None:
    data, aborted = _log()
    full, full_next = _read(data, aborted, isolation, bare=False, fetch_offset=fetch_offset)
    bare, bare_next = _read(data, aborted, isolation, bare=True, fetch_offset=fetch_offset)
    assert full and all(type(r) is ConsumerRecord for r in full)
    assert not [r for r in bare if isinstance(r, ConsumerRecord)], (
        f"{AIOKAFKA}: the iterator still built ConsumerRecords after {WHO}: _consumer_record is not its step any more")
    assert [_facts(r) for r in bare] == [_facts(r) for r in full]
    assert bare_next == full_next, "the next fetch position must not depend on the records' kind"
    values = [r.value for r in bare]
    assert (b"aborted 1" in values) is (isolation == READ_UNCOMMITTED)  # aiokafka's isolation, kept
    assert b"abort" not in values and b"commit" not in values and b"" not in values  # control records skipped
    assert b"committed 2" in values and values[-1] == b"after"


def test_a_corrupt_batch_fails_the_bare_iterator_where_upstream_locates_it() -> None:
    good, bad = _v2(0, [b"a", b"b"]), bytearray(_v2(2, [b"c", b"d"], GZIP))
    bad[-1] ^= 0xFF  # after the CRC was computed: aiokafka's CRC check refuses the batch
    with pytest.raises(Exception) as info:
        _read(good + bytes(bad), [], READ_UNCOMMITTED, bare=True)
    failure = upstream.locate_undecodable(info.value)
    assert failure is not None and (failure.first_offset, failure.last_offset) == (2, 3)


async def test_deliver_bare_records_changes_each_fetch_stored_after_it_and_refuses_deserializers() -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers="localhost:1")
    with pytest.raises(RuntimeError):
        upstream.deliver_bare_records(consumer)  # not started: no fetcher yet
    fetcher = Fetcher.__new__(Fetcher)  # the attributes deliver_bare_records reads, without a client
    fetcher._records = collections.OrderedDict()
    fetcher._key_deserializer = fetcher._value_deserializer = None
    consumer._fetcher = fetcher
    upstream.deliver_bare_records(consumer)
    upstream.deliver_bare_records(consumer)  # twice is once
    assert type(fetcher._records) is upstream._BareFetchBuffer
    records = PartitionRecords(TP, MemoryRecords(_v2(0, [b"x"])), [], 0, None, None, True, 0)
    fetcher._records[TP] = FetchResult(TP, assignment=None, partition_records=records, backoff=0)
    assert [type(r) is not ConsumerRecord and r.value for r in records] == [b"x"]
    fetcher._value_deserializer = bytes.decode
    fetcher._records = collections.OrderedDict()
    with pytest.raises(ValueError):
        upstream.deliver_bare_records(consumer)
