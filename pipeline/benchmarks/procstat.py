"""Memory and CPU of a running process from ``/proc/<pid>/status`` and ``/proc/<pid>/stat`` (Linux).

The parsers and the window arithmetic are pure; ``read`` and ``Sampler`` read the files.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcSample:
    at: float
    """time.monotonic() when read"""
    rss_kb: int
    """VmRSS: resident memory now"""
    hwm_kb: int
    """VmHWM: the largest resident memory since the process started"""
    cpu_s: float
    """user + system CPU seconds since the process started"""


def parse_status(text: str) -> tuple[int, int]:
    """(VmRSS, VmHWM) in kB from the text of ``/proc/<pid>/status``. Pure."""
    fields: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


def parse_stat_cpu(text: str, ticks_per_s: float) -> float:
    """utime + stime in seconds from the text of ``/proc/<pid>/stat``. Pure.

    The command name (field 2) is in parentheses and may hold spaces or parentheses itself, so the
    fields are counted from the last ``)``: utime and stime are fields 14 and 15.
    """
    rest = text[text.rindex(")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / ticks_per_s


def read(pid: int) -> ProcSample:
    at = time.monotonic()
    with open(f"/proc/{pid}/status") as f:
        rss, hwm = parse_status(f.read())
    with open(f"/proc/{pid}/stat") as f:
        cpu = parse_stat_cpu(f.read(), os.sysconf("SC_CLK_TCK"))
    return ProcSample(at, rss, hwm, cpu)


def cpu_windows(samples: list[ProcSample], window_s: float) -> list[float]:
    """CPU use in percent of one core over consecutive windows of ``window_s`` seconds. Pure.

    A window ends at the first sample at least ``window_s`` after its start; a last, shorter one is dropped.
    """
    out: list[float] = []
    start = samples[0] if samples else None
    for s in samples[1:]:
        assert start is not None
        if s.at - start.at >= window_s:
            out.append(100.0 * (s.cpu_s - start.cpu_s) / (s.at - start.at))
            start = s
    return out


def median(values: list[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


@dataclass(frozen=True)
class Usage:
    """One process over a sampled span."""

    rss_mb: float
    """the largest VmRSS seen in the span"""
    hwm_mb: float
    """VmHWM at the end: the process's peak since it started"""
    cpu_median_pct: float
    """median of the 1-second CPU windows: the process at rest"""
    cpu_max_pct: float
    """busiest 1-second window: a resync pass falls in it"""
    cpu_mean_pct: float
    """the whole span's CPU over its wall time"""


def usage(samples: list[ProcSample], window_s: float = 1.0) -> Usage:
    """Summary of samples of one process. Pure."""
    windows = cpu_windows(samples, window_s)
    span = samples[-1].at - samples[0].at if len(samples) > 1 else 0.0
    return Usage(
        rss_mb=round(max(s.rss_kb for s in samples) / 1024, 1),
        hwm_mb=round(samples[-1].hwm_kb / 1024, 1),
        cpu_median_pct=round(median(windows), 1),
        cpu_max_pct=round(max(windows, default=0.0), 1),
        cpu_mean_pct=round(100.0 * (samples[-1].cpu_s - samples[0].cpu_s) / span, 1) if span else 0.0,
    )


async def sample(pids: dict[str, int], seconds: float, every_s: float = 0.1) -> dict[str, list[ProcSample]]:
    """Read every process every ``every_s`` for ``seconds``."""
    out: dict[str, list[ProcSample]] = {name: [] for name in pids}
    end = time.monotonic() + seconds
    while True:
        for name, pid in pids.items():
            out[name].append(read(pid))
        if time.monotonic() >= end:
            return out
        await asyncio.sleep(every_s)
