"""A process's start as a timeline: named moments, written where ``XIDFLOW_START_TIMELINE`` says.

Why: a whole ``xidflow actuator`` process SIGKILLed and started again (a container restart) costs
seconds before its partitions flow, and that is the figure of ``xidflow bench`` (``failover_*_process``)
to explain. Each step of the start (imports, settings, the fork, Kubernetes and Kafka connections,
the group join, the first record) calls ``mark``; with the variable set, each mark is one JSON line
``{"pid", "mark", "t", "cpu"}`` (wall clock, the bench's clock; the process's CPU seconds so far, which
a busy machine does not inflate as it does the wall clock) appended to that file, else nothing happens.
The first mark of a process also writes ``exec`` (when the kernel started the process, from
``/proc``), so the interpreter's own start counts too.

Only the first occurrence of a name per process is written: the marks time a start, not a steady
state. Diagnostics only: no behaviour depends on them (a file that cannot be written is ignored).
"""

from __future__ import annotations

import contextlib
import os
import time

ENV = "XIDFLOW_START_TIMELINE"
"""The file the marks are appended to (unset: no marks). Set by ``xidflow bench``, not a deployment setting."""

_PATH = os.environ.get(ENV) or None
"""Read once: ``mark`` is also called on hot paths (the actuator's first record handled, once per record),
where unset it must cost nothing. The variable is given to a process at its start (``xidflow bench``)."""

_seen: set[tuple[int, str]] = set()


def process_started_at(pid: int | None = None) -> float | None:
    """When the kernel started ``pid`` (this process by default), wall clock; None off Linux."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            stat = f.read()
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, StopIteration, ValueError):
        return None
    ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22, starttime, in clock ticks since boot
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def mark(name: str) -> None:
    """Record that this process reached ``name`` now (once per process and name; nothing when unset)."""
    path = _PATH
    if path is None:
        return
    now, pid = time.time(), os.getpid()
    if (pid, name) in _seen:
        return
    lines = []
    if not any(p == pid for p, _ in _seen):
        started = process_started_at(pid)
        if started is not None:
            lines.append(f'{{"pid": {pid}, "mark": "exec", "t": {started:.3f}}}\n')
    _seen.add((pid, name))
    cpu = time.process_time()
    lines.append(f'{{"pid": {pid}, "mark": "{name}", "t": {now:.6f}, "cpu": {cpu:.4f}}}\n')
    with contextlib.suppress(OSError), open(path, "a") as f:
        f.write("".join(lines))
