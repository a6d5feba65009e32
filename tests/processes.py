"""Helpers the process tests share: whether a process has ended, read from /proc."""

from __future__ import annotations

import time
from pathlib import Path


def gone(pid: int, within_s: float = 10) -> bool:
    """The process ended within ``within_s`` (a zombie waiting for its parent counts: it runs nothing)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False
