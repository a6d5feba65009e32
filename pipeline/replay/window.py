"""The replay's input: raw records (``RawLog``), merged in timestamp order, and the time window.

``pipeline.commands.replay`` reads the raw topics into ``RawLog``s and parses ``--since``/``--until``
with ``make_window``; ``pipeline.replay.run.simulate`` replays the records the window holds. ``iso``
writes the times the errors and the report (``pipeline.replay.report``) show.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime


@dataclass(frozen=True, slots=True)
class RawLog:
    """One record of a raw topic, as ``ParseCore`` reads it (aiokafka's ConsumerRecord has the same)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp: int
    """Milliseconds since the epoch (the record's Kafka timestamp): the replay's clock."""
    headers: Sequence[tuple[str, bytes]] = ()


@dataclass(frozen=True)
class Window:
    """Records with ``since <= timestamp < until`` (epoch seconds) are replayed."""

    since: float
    until: float

    def holds(self, ts_ms: int) -> bool:
        return self.since * 1000 <= ts_ms < self.until * 1000


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class WindowError(ValueError):
    """A --since/--until that is neither a duration nor a time; the message is one sentence."""


def parse_duration(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``7d``, ``2w`` -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise WindowError(f"{text!r} is not a duration (a number and one of s, m, h, d, w: 90s, 30m, 12h, 7d)")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def parse_bound(text: str, now: float) -> float:
    """A duration ago (``7d``) or an ISO-8601 time (``2026-11-20T08:00:00Z``; UTC when no zone) -> epoch s."""
    if _DURATION.match(text):
        return now - parse_duration(text)
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise WindowError(
            f"{text!r} is neither a duration (7d, 12h, 30m) nor an ISO-8601 time (2026-11-20T08:00:00Z)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def make_window(since: str, until: str | None, now: float) -> Window:
    start = parse_bound(since, now)
    end = parse_bound(until, now) if until else now
    if end <= start:
        raise WindowError(f"--until ({iso(end)}) is not after --since ({iso(start)})")
    if start > now:
        raise WindowError(f"--since ({iso(start)}) is in the future")
    return Window(start, end)


def merged(partitions: Iterable[Sequence[RawLog]]) -> Iterator[RawLog]:
    """Records of several partitions in timestamp order; each partition keeps its own order (per node)."""
    return heapq.merge(*partitions, key=lambda r: r.timestamp)


def iso(ts: float | None) -> str | None:
    """Epoch seconds -> ISO-8601 UTC to the second (``2026-11-20T08:00:00Z``); None stays None."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")

