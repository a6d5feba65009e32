"""A record batch the consumer cannot decode: where it is, why, and what to do with it (pure).

aiokafka decodes a fetched batch while ``getmany`` hands its records out. When that fails — the
codec's library is missing (``UnsupportedCodecError``: lz4, snappy and zstd need ``cramjam``, the
field failure of issue 21), a CRC mismatch (``CorruptRecordException``), a compressed payload that
does not decompress — ``getmany`` raises, names no partition, delivers none of the partition's
records of that fetch (not even the good ones before the bad batch) and raises again on every later
fetch of the same offset. A stage that lets it escape restarts forever and reads nothing at all. The
records of other partitions that the same ``getmany`` had already taken (their positions moved past
them) go down with the exception: ``upstream.drained_before`` gets them back, and the stage processes
them before it deals with the batch.

``locate`` finds the partition and the batch's offsets in the exception's traceback (aiokafka's
record iterator, ``PartitionRecords._unpack_records``, holds both); ``Undecodable`` decides:

- **unsupported codec -> hold.** The data is fine; the fix is installing the library. The partition
  is read up to the batch and paused there: nothing of it is committed past, the other partitions
  keep flowing, /healthz (readiness) is red (in the worker and the actuator alike), and the restarted process
  (with the library) reads it from there.
- **anything else (corrupt) -> skip, with a dead-letter marker.** Such a batch can never be decoded,
  whoever reads it. After a second failure at the same offset (one re-fetch rules out a transient
  fault) a dead letter names the topic, partition, offset range and reason, and the partition goes on
  after the batch. Nothing is lost silently: the marker says exactly which offsets to look at.

Each batch is logged once (per process), however often it is fetched again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from aiokafka.errors import (
    CorruptRecordException,
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    RecordTooLargeError,
    RequestTimedOutError,
    UnsupportedCodecError,
)

UNREACHABLE = (KafkaConnectionError, NodeNotReadyError, KafkaTimeoutError, RequestTimedOutError, ConnectionError,
               TimeoutError)
"""Errors that mean the broker could not be reached or did not answer in time."""
UNREADABLE = (CorruptRecordException, UnsupportedCodecError, RecordTooLargeError)
"""Errors that mean a fetched record batch could not be read (``locate`` may still fail to place one)."""


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the broker could not be reached (and nothing else: not a batch, not an ACL)."""
    return isinstance(exc, UNREACHABLE)


def unreadable(exc: BaseException) -> bool:
    """Whether ``exc`` says a record batch could not be read."""
    return isinstance(exc, UNREADABLE)


class Reason(enum.StrEnum):
    """Why a batch could not be decoded: a closed set (metric label values)."""

    UNSUPPORTED_CODEC = "unsupported_codec"
    CORRUPT = "corrupt"


class Action(enum.StrEnum):
    APPROACH = "approach"  # read the partition's good records up to the batch first
    RETRY = "retry"  # fetch the batch once more (a transient fault?)
    HOLD = "hold"  # pause the partition at the batch
    SKIP = "skip"  # dead-letter marker, then go on after the batch


@dataclass(frozen=True)
class Failure:
    """One batch that could not be decoded."""

    topic: str
    partition: int
    first_offset: int
    last_offset: int | None  # None: the batch header could not say
    reason: Reason
    error: str  # "ExceptionType: message"

    @property
    def offsets(self) -> str:
        if self.last_offset is None or self.last_offset == self.first_offset:
            return str(self.first_offset)
        return f"{self.first_offset}-{self.last_offset}"

    def describe(self, action: Action) -> str:
        """The one log line (and dead-letter reason) an operator reads: where, why, what to do."""
        where = f"{self.topic}[{self.partition}] offset {self.offsets}"
        if self.reason is Reason.UNSUPPORTED_CODEC:
            todo = ("partition HELD at this offset (nothing committed past it; other partitions keep flowing; "
                    "/healthz is red): install the codec library the project declares (pip install "
                    "'aiokafka[lz4,snappy,zstd]', i.e. cramjam) in this process's image (worker or actuator) and "
                    "restart it; it re-reads from here, nothing is lost")
        elif action is Action.SKIP:
            todo = ("batch SKIPPED: a dead letter names these offsets; read them with another client "
                    "(kafka-dump-log) to see what was lost")
        else:
            todo = "fetching it once more before skipping it"
        return f"undecodable record batch at {where}: {self.error}; {todo}"


@dataclass
class Undecodable:
    """What to do with each failure, and which to log (pure: the stage does the I/O)."""

    attempts_before_skip: int = 2
    _attempts: dict[tuple[str, int, int], int] = field(default_factory=dict)
    _logged: set[tuple[str, int, int, Reason]] = field(default_factory=set)
    held: dict[tuple[str, int], Failure] = field(default_factory=dict)

    def decide(self, failure: Failure, position: int) -> Action:
        """``position``: the partition's next offset not yet delivered to the stage."""
        if position < failure.first_offset:
            return Action.APPROACH
        if failure.reason is Reason.UNSUPPORTED_CODEC:
            return Action.HOLD
        key = (failure.topic, failure.partition, failure.first_offset)
        self._attempts[key] = self._attempts.get(key, 0) + 1
        if self._attempts[key] < self.attempts_before_skip:
            return Action.RETRY
        del self._attempts[key]
        return Action.SKIP

    @staticmethod
    def resume_after(failure: Failure) -> int:
        """Where a skipped batch's partition goes on (just after its first offset when its end is unknown)."""
        return (failure.last_offset if failure.last_offset is not None else failure.first_offset) + 1

    def first_report(self, failure: Failure) -> bool:
        """True the first time this batch fails for this reason (log it and count it then only)."""
        key = (failure.topic, failure.partition, failure.first_offset, failure.reason)
        if key in self._logged:
            return False
        self._logged.add(key)
        return True

    def hold(self, failure: Failure) -> None:
        self.held[(failure.topic, failure.partition)] = failure

    def release_all(self) -> list[Failure]:
        """A new assignment resumes every partition (aiokafka forgets pauses): nothing is held now."""
        released = list(self.held.values())
        self.held.clear()
        return released
