"""A warm supervisor for ``xidflow worker`` and ``xidflow actuator``: a crashed child is replaced at once.

Why: a SIGKILLed (OOM-killed, segfaulted) worker or actuator used to cost a whole container restart
before its partitions flowed again: the kubelet notices, starts Python, and Python imports Faust,
aiokafka, the Kubernetes client, pydantic models... 4-5 s on a busy node (``xidflow bench``,
``failover_*``). Static membership (KIP-345, ``pipeline.runtime.settings.ConsumerGroupSettings``) already
lets a member that comes back with the same ``group.instance.id`` take its partitions back without
a rebalance; what was left on the critical path was the process start.

Design (a "zygote"): the command validates its settings and imports every heavy module once, in
this process, and then forks the child that does the work. When the child dies unexpectedly, the
supervisor forks a new one at once: the imports are already in memory (shared copy-on-write), so the
new child goes straight to connecting, and it joins with the same static instance id (the same
environment), so the broker hands it the dead child's partitions back without a rebalance.

Rules that keep it correct:

- **Nothing that runs before the fork starts a thread or keeps an event loop**: a forked child gets
  only the forking thread, so a lock held by another thread would stay held forever in the child.
  Every thread (metrics server, Kafka clients, Kubernetes pool, watches) and every loop is created
  in the child. ``supervise`` logs a warning when it is asked to fork with other threads alive.
- **The child dies with the supervisor**: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` on Linux (a pipe the
  child watches elsewhere), so a SIGKILL of the ``xidflow worker`` PID (the kubelet's, an operator's)
  never leaves an orphan working with the pod's identity. The child checks its parent after the
  prctl call too: a supervisor that died in between would otherwise be missed.
- **SIGTERM and SIGINT are forwarded** to the child (in its own process group, so a terminal's
  Ctrl-C reaches it once, through the supervisor): the orderly stop (commit, leave the group) is the
  child's, and the supervisor exits with the child's status and restarts nothing.
- **Crash loops are bounded**: the first crash (a death by signal) is replaced at once; one that follows a child that
  lived less than ``stable_after_s`` waits ``backoff_initial_s``, doubling up to ``backoff_max_s``;
  after ``give_up_after`` such crashes in a row the supervisor exits with the child's status, so
  the kubelet's CrashLoopBackOff and the pod's restart count show the loop. Each restart is logged
  with its count and the next delay, and counted in ``xidflow_supervisor_restarts_total`` (the
  counter is increased before the fork, so the new child exports it).
- **Ports belong to the child**: ``/metrics``, ``/healthz``, ``/livez`` are served by the process
  that does the work, because liveness must be answered by the loop that works (``pipeline.runtime.heartbeat``):
  a supervisor answering for a dead or stuck child would lie. The listening sockets close with the
  child and the new child binds them again (address reuse) within its first second; a probe that
  fails in that second is within every probe's failure threshold.

Only a child killed by a signal the supervisor did not forward (SIGKILL, SIGSEGV, the OOM killer) is
replaced. A child that exits by itself, whatever its status, ends the supervisor with that status: it
said why (a sentence at start such as an unreachable API server, a consumer that gave up), and the
command keeps its contract (one sentence, a non-zero exit, the kubelet restarts the pod) instead of
retrying a misconfiguration in a loop. Turn the supervisor off with ``--no-supervise`` or
``XIDFLOW_SUPERVISOR_ENABLED=false`` (one process, as before; e.g. under a debugger or on a platform
without ``fork``).

Considered and not chosen: a pre-forked standby child that waits, connected, for the active one to
die. Its extra gain is the child's own start-up (Kafka/Kubernetes connections, Faust services),
which a process cannot do twice in parallel without two members under one static id; it would need
the worker and actuator split into "prepare" and "join" phases. Fork-on-death already removes the
interpreter start and the imports, which were the bulk (see deploy/README.md, failover figures).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.runtime.startmarks import mark

log = logging.getLogger("xidflow.supervisor")

PR_SET_PDEATHSIG = 1  # linux/prctl.h
FORWARDED = (signal.SIGTERM, signal.SIGINT)


class SupervisorSettings(BaseSettings):
    """The warm supervisor of ``xidflow worker`` / ``xidflow actuator`` (environment ``XIDFLOW_SUPERVISOR_*``)."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_SUPERVISOR_", extra="ignore")

    enabled: bool = Field(
        default=True,
        description="Default true. Run the work in a forked child and replace it at once when it dies "
        "(imports already done, same static group member). False: one process, as before.",
    )
    backoff_initial_s: float = Field(
        default=0.5, ge=0, le=300,
        description="Default 0.5. Delay before replacing a child that died soon after the previous "
        "replacement (the first crash is replaced at once); doubles per crash in a row.",
    )
    backoff_max_s: float = Field(default=30.0, ge=0, le=3600, description="Default 30. The longest such delay.")
    stable_after_s: float = Field(
        default=60.0, gt=0, description="Default 60. A child that lived this long resets the crash count."
    )
    give_up_after: int = Field(
        default=10, ge=1,
        description="Default 10. Crashes in a row (each child shorter-lived than stable_after_s) after which "
        "the supervisor exits with the child's status, so the kubelet's CrashLoopBackOff takes over.",
    )


@dataclass
class CrashLoop:
    """When to replace a crashed child (pure: the caller says how long the child lived)."""

    initial_s: float
    max_s: float
    stable_after_s: float
    give_up_after: int
    in_a_row: int = 0
    """Crashes in a row, each child having lived less than ``stable_after_s``."""

    @classmethod
    def of(cls, settings: SupervisorSettings) -> CrashLoop:
        return cls(settings.backoff_initial_s, settings.backoff_max_s, settings.stable_after_s, settings.give_up_after)

    def next_delay(self, lived_s: float) -> float | None:
        """Seconds to wait before the next child, or None: give up (the crash loop is the pod's now)."""
        if lived_s >= self.stable_after_s:
            self.in_a_row = 0
        self.in_a_row += 1
        if self.in_a_row > self.give_up_after:
            return None
        if self.in_a_row == 1:
            return 0.0  # the case this module exists for: a crash after a healthy life costs no wait
        return min(self.max_s, self.initial_s * 2 ** (self.in_a_row - 2))


def describe_status(status: int) -> str:
    """``killed by SIGKILL`` / ``exited 3`` for a ``waitpid`` status (pure)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return f"killed by {name}"
    return f"exited {os.waitstatus_to_exitcode(status)}"


def exit_code(status: int) -> int:
    """The shell's exit status for a ``waitpid`` status: 128 + signal for a killed child (pure)."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def parse_ppid(stat: str) -> int:
    """The parent pid (field 4) from the text of ``/proc/<pid>/stat`` (pure; the name may hold ``)``)."""
    return int(stat[stat.rindex(")") + 2:].split()[1])


def child_pids(pid: int) -> list[int]:
    """The live children of ``pid`` (Linux ``/proc``): how a test or the bench finds the supervised child."""
    out: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError):
            if parse_ppid((entry / "stat").read_text()) == pid:
                out.append(int(entry.name))
    return sorted(out)


def _die_with_parent(parent: int, watch_fd: int | None) -> None:
    """In the child: be killed when the supervisor dies, however it dies."""
    if watch_fd is None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:

        def watch() -> None:
            with contextlib.suppress(OSError):
                os.read(watch_fd, 1)  # returns (EOF) when the supervisor's end closes: it died
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="xidflow-supervisor-watch", daemon=True).start()
    if os.getppid() != parent:  # the supervisor died before the death signal was armed
        os._exit(1)


def _child(work: Callable[[], object], parent: int, watch_fd: int | None) -> None:
    """The forked child's whole life: never returns into the supervisor's code."""
    code = 1
    try:
        os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the supervisor only, which forwards it once
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # Forked with the forwarded signals blocked (``Supervisor.run``): one sent meanwhile waited, and
        # now meets the child's own handlers, not the supervisor's copy that would have dropped it.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        _die_with_parent(parent, watch_fd)
        result = work()
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - the child must end here, whatever escaped the work
        show = getattr(exc, "show", None)  # a click.ClickException: its one sentence, as click prints it
        if callable(show):
            show()
            code = getattr(exc, "exit_code", 1)
        else:
            traceback.print_exc()
            code = 1
    finally:
        with contextlib.suppress(Exception):
            logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


class Supervisor:
    """Forks ``work`` and replaces it when it dies unexpectedly (see the module docstring)."""

    def __init__(self, work: Callable[[], object], name: str, settings: SupervisorSettings,
                 on_restart: Callable[[], None] = lambda: None) -> None:
        self.work, self.name, self.settings = work, name, settings
        self.on_restart = on_restart
        self.crashes = CrashLoop.of(settings)
        self.child: int | None = None
        self.stopping: signal.Signals | None = None
        self.restarts = 0

    def _forward(self, signum: int, _frame: object) -> None:
        self.stopping = signal.Signals(signum)
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, signum)

    def _fork(self) -> tuple[int, int | None]:
        """(child pid, the supervisor's end of the death pipe where prctl is not available)."""
        threads = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        if threads:
            log.warning("%s supervisor: forking with threads alive %s (they do not exist in the child)",
                        self.name, threads)
        watch_r = watch_w = None
        if not sys.platform.startswith("linux"):
            watch_r, watch_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # nothing buffered is written twice
        mark("fork")
        pid = os.fork()
        if pid == 0:
            if watch_w is not None:
                os.close(watch_w)
            _child(self.work, self._pid, watch_r)
        if watch_r is not None:
            os.close(watch_r)
        return pid, watch_w

    def run(self) -> int:
        """Supervise until the child stops on request or by itself, or the crash loop gives up; the exit status."""
        self._pid = os.getpid()
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        # The imported modules' objects stay shared with every child, not copied on first touch. Frozen without
        # a full collection first (CPython's recipe for fork: collector off early, freeze before the fork): the
        # command's start ran without the collector (``pipeline.cli``), and a collection here found ~2,000
        # objects of garbage (a few hundred kB, kept for good now) for ~60 ms of CPU before a restarted
        # container's first child.
        gc.freeze()
        # This process lives as long as the pod, and what it does per restart (log records, exceptions and
        # their tracebacks) makes cycles.
        gc.enable()
        watch_w: int | None = None
        while True:
            started = time.monotonic()
            # A SIGTERM between the fork and the child's own handlers ran the supervisor's handler in the
            # child, which had no child to forward it to: the child went on working, and the supervisor
            # waited for it for ever. Blocked around the fork, it waits until both sides are ready.
            signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
            try:
                self.child, watch_w = self._fork()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
            if self.stopping is not None:  # a signal came while forking: the child may have missed it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.child, self.stopping)
            log.info("%s supervisor: child pid %d started", self.name, self.child)
            _, status = os.waitpid(self.child, 0)
            if watch_w is not None:
                os.close(watch_w)
            lived = time.monotonic() - started
            self.child = None
            if self.stopping is not None or not os.WIFSIGNALED(status):
                return exit_code(status)  # asked to stop, or the child exited and said why
            delay = self.crashes.next_delay(lived)
            if delay is None:
                log.error("%s supervisor: child %s after %.1f s, crash %d in a row; giving up (exit %d)",
                          self.name, describe_status(status), lived, self.crashes.in_a_row, exit_code(status))
                return exit_code(status)
            self.restarts += 1
            log.warning(
                "%s supervisor: child %s after %.1f s; restart %d (crash %d in a row), next child in %.1f s",
                self.name, describe_status(status), lived, self.restarts, self.crashes.in_a_row, delay,
            )
            self.on_restart()
            if not self._sleep(delay):
                return exit_code(status)

    def _sleep(self, seconds: float) -> bool:
        """Wait the backoff; False when a stop was asked meanwhile (nothing to forward it to)."""
        deadline = time.monotonic() + seconds
        while self.stopping is None and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))
        return self.stopping is None


def preload(modules: Iterable[str]) -> None:
    """Import modules a command would import only once running, so each forked child finds them loaded.

    A module that is missing from this build is skipped (the child would fail on it the same way).
    """
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            log.debug("preload: %s not imported: %s", name, exc)


def _forkable() -> bool:
    """Whether a forked child's output goes where this process's goes: stdout and stderr are still the
    interpreter's own streams. A caller that replaced them to capture the output in memory (click's test
    runner, a program embedding the command) gets the work in its own process, not in a child whose
    sentences would be written into a copy of that memory and lost."""
    return hasattr(os, "fork") and sys.stdout is sys.__stdout__ and sys.stderr is sys.__stderr__


def supervise(work: Callable[[], object], name: str, enabled: bool | None = None) -> int:
    """Run ``work`` supervised (or in this process when disabled); the process's exit status.

    ``enabled`` (a command-line flag) overrides ``XIDFLOW_SUPERVISOR_ENABLED``.
    """
    settings = SupervisorSettings()
    if enabled is not None:
        settings = settings.model_copy(update={"enabled": enabled})
    if not settings.enabled or not _forkable():
        result = work()
        return result if isinstance(result, int) else 0
    from pipeline.runtime import metrics
    return Supervisor(work, name, settings, on_restart=metrics.SUPERVISOR_RESTARTS.inc).run()
