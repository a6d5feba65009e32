"""What the Kafka broker itself did in a bench window: its own request and byte counters, read before and after.

The broker keeps them as JMX MBeans (``kafka.network:type=RequestMetrics``, ``BrokerTopicMetrics``,
``socket-server-metrics``); ``KafkaMeter.java`` beside this module reads them from the running broker's JVM
through the JDK's Attach API (no port, no flag on the broker) and prints one JSON line per reading. One helper
JVM per scenario, started before its clock: a reading then costs the broker a few MBean reads.

``parse`` and ``delta`` are pure; ``KafkaMeter`` runs the helper.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

HELPER = Path(__file__).with_name("KafkaMeter.java")

SUB_METERS = ("FetchConsumer", "FetchFollower")
"""Request meters that count part of another (``Fetch``): shown, but not added to the total again."""


@dataclass(frozen=True)
class Snapshot:
    requests: dict[str, int] = field(default_factory=dict)
    """request name (``Produce``, ``Fetch``, ``OffsetCommit``, ``Heartbeat``...) -> requests served so far"""
    bytes_in: int = 0
    """record bytes produced to the broker's topics so far"""
    bytes_out: int = 0
    """record bytes fetched by consumers so far (replication aside: one broker)"""
    net_in: int = 0
    """bytes the broker's sockets read so far (requests whole, headers and all)"""
    net_out: int = 0
    """bytes they wrote (responses whole)"""


def parse(line: bytes | str) -> Snapshot:
    """A ``Snapshot`` from one line of the helper's output. Pure."""
    d = orjson.loads(line)
    return Snapshot({str(k): int(v) for k, v in (d.get("requests") or {}).items()}, int(d.get("bytes_in", 0)),
                    int(d.get("bytes_out", 0)), int(d.get("net_in", 0)), int(d.get("net_out", 0)))


def delta(before: Snapshot, after: Snapshot, nodes: int) -> dict[str, Any]:
    """What the broker served between two readings, for a window that remediated ``nodes`` nodes. Pure.

    ``requests``: name -> count (zeros left out); ``requests_total`` (sub-meters not counted twice),
    ``requests_per_node``; record bytes in and out and socket bytes in and out, each in total and per node.
    """
    requests = {k: v - before.requests.get(k, 0) for k, v in sorted(after.requests.items())
                if v - before.requests.get(k, 0) > 0}
    total = sum(v for k, v in requests.items() if k not in SUB_METERS)
    sizes = {"bytes_in": after.bytes_in - before.bytes_in, "bytes_out": after.bytes_out - before.bytes_out,
             "net_in": after.net_in - before.net_in, "net_out": after.net_out - before.net_out}
    out: dict[str, Any] = {"requests": requests, "requests_total": total,
                           "requests_per_node": round(total / nodes, 2) if nodes else None, **sizes}
    out["net_bytes_per_node"] = round((sizes["net_in"] + sizes["net_out"]) / nodes) if nodes else None
    out["record_bytes_per_node"] = round((sizes["bytes_in"] + sizes["bytes_out"]) / nodes) if nodes else None
    return out


class KafkaMeter:
    """The helper JVM attached to one broker (``pid``); ``read()`` is a reading now, None when it cannot be had."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self, limit_s: float = 60) -> bool:
        """Start the helper and wait until it is attached; False (and no meter) where it cannot be."""
        java = shutil.which("java")
        if java is None:
            return False
        self._proc = await asyncio.create_subprocess_exec(
            java, str(HELPER), str(self.pid), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            assert self._proc.stdout is not None
            ready = await asyncio.wait_for(self._proc.stdout.readline(), limit_s)
        except TimeoutError:
            ready = b""
        if not ready.strip():
            await self.stop()
            return False
        return True

    async def read(self, limit_s: float = 10) -> Snapshot | None:
        proc = self._proc
        if proc is None or proc.returncode is not None or proc.stdin is None or proc.stdout is None:
            return None
        try:
            proc.stdin.write(b"\n")
            await proc.stdin.drain()
            return parse(await asyncio.wait_for(proc.stdout.readline(), limit_s))
        except (TimeoutError, OSError, orjson.JSONDecodeError, ValueError):
            return None

    async def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()
