"""Kafka's default partitioning of keyed records, with each key's hash computed once per process.

aiokafka's ``DefaultPartitioner`` hashes every keyed record's key with murmur2 written in Python (a few
microseconds a record); in a burst the worker sends two or three records per line, all keyed by node
name, and the fleet's node names repeat across every burst. ``KeyPartitioner`` keeps each key's
hash (the masked murmur2 value, independent of the partition count) and answers the partition Kafka's
default partitioner answers: ``all_partitions[murmur2(key) & 0x7FFFFFFF % len(all_partitions)]``, so a
node's records land where every other Kafka client (and the co-partitioned topics) expect them.
A record without a key is left to aiokafka's rule (a random available partition).
"""

from __future__ import annotations

from collections.abc import Sequence

from aiokafka.partitioner import DefaultPartitioner, murmur2

DEFAULT_MAX_KEYS = 1 << 18
"""Hashes kept at most (262,144 keys, some 30 MB at most): past it the memo starts over, so made-up
keys cannot grow memory; a fleet's node names fit."""


class KeyPartitioner:
    """A producer's ``partitioner`` (aiokafka's and Faust's ``producer_partitioner``): Kafka's default, memoized."""

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self._hashes: dict[bytes, int] = {}
        self._max_keys = max(1, max_keys)
        self._keyless = DefaultPartitioner()

    def __call__(self, key: bytes | None, all_partitions: Sequence[int], available: Sequence[int]) -> int:
        if key is None:
            return self._keyless(key, all_partitions, available)
        hashed = self._hashes.get(key)
        if hashed is None:
            if len(self._hashes) >= self._max_keys:
                self._hashes.clear()
            hashed = self._hashes[key] = murmur2(key) & 0x7FFFFFFF
        return all_partitions[hashed % len(all_partitions)]
