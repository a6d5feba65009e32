"""The warm supervisor (``pipeline.runtime.supervisor``): its crash-loop arithmetic, and real forked children.

The process tests run a small script in a subprocess (the supervisor installs signal handlers and
forks, which a pytest process must not do to itself): a child that crashes is replaced, SIGTERM is
forwarded and ends everything, a SIGKILLed supervisor takes its child with it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.runtime.supervisor import CrashLoop, child_pids, describe_status, exit_code, parse_ppid
from tests.processes import gone

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_first_crash_is_replaced_at_once_then_backoff_doubles_and_gives_up() -> None:
    loop = CrashLoop(initial_s=0.5, max_s=2.0, stable_after_s=60, give_up_after=5)
    assert [loop.next_delay(1.0) for _ in range(6)] == [0.0, 0.5, 1.0, 2.0, 2.0, None]


def test_a_child_that_lived_long_enough_resets_the_crash_count() -> None:
    loop = CrashLoop(initial_s=0.5, max_s=30, stable_after_s=60, give_up_after=3)
    assert [loop.next_delay(1.0) for _ in range(3)] == [0.0, 0.5, 1.0]
    assert loop.next_delay(61.0) == 0.0 and loop.in_a_row == 1


def test_status_words_and_exit_codes() -> None:
    killed = signal.SIGKILL  # waitpid's status of a child killed by a signal is the signal number
    assert describe_status(killed) == "killed by SIGKILL" and exit_code(killed) == 137
    assert describe_status(3 << 8) == "exited 3" and exit_code(3 << 8) == 3


def test_parse_ppid_survives_a_name_with_parentheses() -> None:
    assert parse_ppid("42 (a (b) c) S 7 42 42 0 -1") == 7


SCRIPT = textwrap.dedent(
    """
    import logging, os, signal, sys, time
    from pathlib import Path
    from pipeline.runtime.supervisor import supervise
    logging.basicConfig(level="INFO")
    marks = Path(sys.argv[1])
    def work():
        marks.mkdir(exist_ok=True)
        n = len(list(marks.iterdir()))
        (marks / str(os.getpid())).touch()
        if sys.argv[2] == "crash" and n < 2:
            os.kill(os.getpid(), signal.SIGKILL)  # the first two children crash; the third lives until stopped
        if sys.argv[2] == "always":
            os.kill(os.getpid(), signal.SIGSEGV)
        if sys.argv[2] == "exit":
            os._exit(4)  # an exit the child chose (a sentence at start): not retried
        while True:
            time.sleep(0.05)
    sys.exit(supervise(work, "test"))
    """
)


def _start(tmp_path: Path, mode: str, **env: str) -> tuple[subprocess.Popen[bytes], Path]:
    marks = tmp_path / "children"
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(marks), mode],
        env={**os.environ, "XIDFLOW_SUPERVISOR_BACKOFF_INITIAL_S": "0.05", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return proc, marks


def _children(marks: Path, count: int, proc: subprocess.Popen[bytes]) -> list[int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pids = sorted(int(p.name) for p in marks.iterdir()) if marks.exists() else []
        if len(pids) >= count:
            return pids
        assert proc.poll() is None, proc.communicate()[0].decode()
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} children within 30 s")


@linux
def test_crashed_children_are_replaced_and_sigterm_ends_the_last_one(tmp_path: Path) -> None:
    proc, marks = _start(tmp_path, "crash")
    try:
        third = _children(marks, 3, proc)[-1]
        deadline = time.monotonic() + 10
        while child_pids(proc.pid) != [third] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child_pids(proc.pid) == [third]
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode()
        assert proc.returncode == 128 + signal.SIGTERM  # the child's status: it died of the forwarded SIGTERM
        assert "restart 2 (crash 2 in a row), next child in 0.1 s" in out, out
        assert gone(third)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@linux
def test_sigkill_of_the_supervisor_leaves_no_orphan(tmp_path: Path) -> None:
    proc, marks = _start(tmp_path, "live")
    try:
        child = _children(marks, 1, proc)[0]
        proc.kill()
        proc.wait(10)
        assert gone(child), f"child {child} outlived its SIGKILLed supervisor"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@linux
def test_a_crash_loop_gives_up_with_the_childs_status(tmp_path: Path) -> None:
    proc, marks = _start(
        tmp_path, "always", XIDFLOW_SUPERVISOR_GIVE_UP_AFTER="3", XIDFLOW_SUPERVISOR_BACKOFF_MAX_S="0.1"
    )
    out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 128 + signal.SIGSEGV, out
    assert "killed by SIGSEGV" in out and "crash 4 in a row; giving up (exit 139)" in out, out
    assert len(list(marks.iterdir())) == 4


@linux
def test_a_child_that_exits_by_itself_is_not_replaced(tmp_path: Path) -> None:
    proc, marks = _start(tmp_path, "exit")
    assert proc.wait(60) == 4
    assert len(list(marks.iterdir())) == 1


@linux
def test_disabled_runs_the_work_in_this_process(tmp_path: Path) -> None:
    proc, marks = _start(tmp_path, "exit", XIDFLOW_SUPERVISOR_ENABLED="false")
    assert proc.wait(60) == 4
    assert [int(p.name) for p in marks.iterdir()] == [proc.pid]


def test_a_sigterm_at_the_fork_stops_the_child_instead_of_being_lost(tmp_path: Path) -> None:
    """SIGTERM sent while the child is being forked (a pod deleted as it starts; the crash test's worker
    stopped 0.05 s after its start): the child's copy of the supervisor's handler had nobody to forward
    it to, the child went on working and the supervisor waited for ever."""
    script = tmp_path / "at_fork.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time
        from pipeline.runtime.supervisor import Supervisor, SupervisorSettings

        # The signal arrives in the parent as fork returns, and the child takes a while to set its
        # own handlers: the window, made wide enough to hit every time.
        os.register_at_fork(after_in_parent=lambda: os.kill(os.getpid(), signal.SIGTERM),
                            after_in_child=lambda: time.sleep(0.3))

        def work():
            time.sleep(60)
            return 0

        sys.exit(Supervisor(work, "t", SupervisorSettings()).run())
    """))
    proc = subprocess.run([sys.executable, str(script)], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, timeout=40)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout + proc.stderr
