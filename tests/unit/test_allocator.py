"""pipeline.runtime.allocator: the worker's memory after a burst goes back to the system (glibc)."""

from __future__ import annotations

import sys

from pipeline.runtime import allocator


def test_tune_and_trim_work_on_glibc_and_do_nothing_elsewhere() -> None:
    tuned = allocator.tune()
    assert tuned is (sys.platform == "linux" and bool(allocator._glibc()))
    allocator.trim()  # never raises
