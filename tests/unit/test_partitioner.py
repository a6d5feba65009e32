"""``KeyPartitioner`` answers exactly Kafka's default partitioning (aiokafka's ``DefaultPartitioner``)."""

from __future__ import annotations

import random

from aiokafka.partitioner import DefaultPartitioner

from pipeline.kafka.partitioner import KeyPartitioner


def _keys(n: int) -> list[bytes]:
    rng = random.Random(22)
    names = [f"gpu-node-{i:05d}".encode() for i in range(n)]
    names += [bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64))) for _ in range(n)]
    return names + [b"", b"\xff" * 3, "ноуд-ü".encode()]


def test_every_keyed_record_gets_the_default_partitioners_partition_twice() -> None:
    default, memo = DefaultPartitioner(), KeyPartitioner()
    for count in (1, 2, 3, 8, 12, 64, 1000):
        partitions = list(range(count))
        for key in _keys(3000):
            expected = default(key, partitions, partitions)
            assert memo(key, partitions, partitions) == expected, (key, count)
            assert memo(key, partitions, partitions[:1]) == expected  # availability does not move a key


def test_a_full_memo_starts_over_and_still_answers_the_same() -> None:
    default, memo = DefaultPartitioner(), KeyPartitioner(max_keys=7)
    partitions = list(range(8))
    for key in _keys(100) * 2:
        assert memo(key, partitions, partitions) == default(key, partitions, partitions)
    assert len(memo._hashes) <= 7


def test_a_record_without_a_key_goes_to_an_available_partition_else_any() -> None:
    memo = KeyPartitioner()
    assert {memo(None, [0, 1, 2, 3], [2]) for _ in range(50)} == {2}
    assert {memo(None, [0, 1, 2, 3], []) for _ in range(200)} == {0, 1, 2, 3}


def test_the_workers_producers_partition_with_it() -> None:
    from pipeline.app import declare_app
    from pipeline.detection.parse_stage import ParseStage

    assert isinstance(declare_app("127.0.0.1:1").app.producer.partitioner, KeyPartitioner)
    assert isinstance(ParseStage("127.0.0.1:1", "g").partitioner, KeyPartitioner)
