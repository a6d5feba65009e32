"""Small process and port helpers shared by the local Kafka and control-plane launchers."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path


class StartError(RuntimeError):
    """A local service did not come up; the message names it and quotes its log."""


def state_dict(obj: object) -> dict:
    """A launcher dataclass as JSON-ready state: paths as strings, the log callback left out."""
    d = asdict(obj)  # type: ignore[call-overload]
    d.pop("log", None)
    d["root"] = str(d["root"])
    return d


LISTEN_PORTS_FROM = 10000
"""The lowest port ``free_port`` picks (above the well-known and most registered services' ports)."""


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The ports the kernel gives outgoing connections (Linux's default when it cannot be read)."""
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port() -> int:
    """A loopback port free to listen on now, chosen below the kernel's ephemeral range.

    A daemon is started on its port some time after the port is chosen (the control plane's last
    components after the API server answers). A port of the ephemeral range may meanwhile become the
    local end of any process's outgoing connection, and the daemon then fails with "address already
    in use" (seen here: the controller-manager's port taken while the API server started). Ports below
    that range are only ever taken by a listener that asks for them.

    A port handed out once is not handed out again by this process: its daemon may not have bound it
    yet (the demo picks each node's Fluent Bit port before it starts any of them), and a second pick of
    the same free port would start two listeners on it.
    """
    low, _high = ephemeral_range()
    if low - LISTEN_PORTS_FROM >= 1000:
        for _ in range(100):
            port = random.randrange(LISTEN_PORTS_FROM, low)
            if port not in _handed_out and _bindable(port):
                _handed_out.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below the range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_handed_out: set[int] = set()


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


def spawn(cmd: list[str], log_file: Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> int:
    """Start a daemon in its own session (it outlives the CLI that started it); return its pid."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with open(log_file, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=cwd, env=env, start_new_session=True,
        )
    return proc.pid


def alive(pid: int | None, expect: str | None = None) -> bool:
    """True when ``pid`` runs; with ``expect``, only when its command line contains that text.

    State files outlive processes (a reboot, a new session): a recorded pid may since belong to an
    unrelated process, which must never be taken for ours, let alone signalled.
    """
    if not pid:
        return False
    if expect is not None:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False
        if expect not in cmdline:
            return False
    try:
        # Reap it if it is our exited child, so a zombie does not count as alive.
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return False
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
        return state != "Z"
    except (OSError, IndexError):
        return True


def stop(pid: int | None, timeout: float = 20.0, sig: int = signal.SIGTERM, expect: str | None = None) -> None:
    """Signal a daemon's whole process group and wait; SIGKILL after the timeout.

    ``expect``: text its command line must contain (see ``alive``); otherwise it is not ours.
    """
    if not alive(pid, expect):
        return
    assert pid is not None
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


PROGRESS_EVERY_S = 10.0
"""A start-up that takes longer says so this often (a cold machine's first ``local up``)."""


def wait_until(
    check: Callable[[], bool], timeout: float, what: str, pid: int | None, log_file: Path,
    log: Callable[[str], None] | None = None,
) -> None:
    """Poll ``check`` until true; fail early (with the log's tail) if the process died.

    With ``log``, a wait past ``PROGRESS_EVERY_S`` says what it waits for, for how long so far and where the
    process logs, every ``PROGRESS_EVERY_S`` seconds, so no start-up is a silent stretch."""
    start = time.monotonic()
    deadline = start + timeout
    next_report = start + PROGRESS_EVERY_S
    while time.monotonic() < deadline:
        if check():
            return
        if pid is not None and not alive(pid):
            raise StartError(f"{what} exited during start-up; last log lines:\n{tail(log_file)}")
        now = time.monotonic()
        if log is not None and now >= next_report:
            log(f"  ... waiting for {what} to be ready: {now - start:.0f}s of at most {timeout:.0f}s (log: {log_file})")
            next_report = now + PROGRESS_EVERY_S
        time.sleep(0.2)
    raise StartError(f"{what} not ready after {timeout:.0f}s; last log lines:\n{tail(log_file)}")


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def terminate(proc: subprocess.Popen | None, timeout: float = 30.0, sig: int = signal.SIGTERM) -> None:
    """Stop a child we started: ``sig`` (SIGTERM), then SIGKILL after ``timeout``; nothing if it already ended."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def append_lines(path: Path, lines: Iterable[str]) -> None:
    """Append lines to a log file the way a logging program does (one write, newline-terminated)."""
    with path.open("a") as f:
        f.write("".join(f"{line}\n" for line in lines))
