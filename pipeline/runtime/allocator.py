"""Give freed memory back to the operating system (glibc), so a burst does not stay in the RSS.

A burst of large records (dead letters of up to 64 KiB, lines of hundreds of KB, batches of 20,000
records) makes the worker allocate a few hundred MB for a moment. CPython frees it, but glibc keeps
it: its mmap threshold grows with every large block freed (up to 32 MiB), so later large blocks come
from the heap, whose free space is only returned to the system from its top; and each thread gets an
arena of its own. The RSS then stays at the burst's high-water mark for the life of the process.

``tune()`` fixes the mmap threshold at 128 KiB (large blocks are mapped and unmapped, never kept)
and caps the arenas; ``trim()`` returns free heap pages (``malloc_trim``), and is cheap enough to call
every few seconds when idle. Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any

log = logging.getLogger("xidflow.allocator")

M_ARENA_MAX = -8
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 * 1024
ARENA_MAX = 2

_libc: Any = None


def _glibc() -> Any:
    global _libc
    if _libc is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.mallopt  # noqa: B018 - glibc only
            libc.malloc_trim  # noqa: B018
        except (OSError, AttributeError):
            _libc = False
        else:
            _libc = libc
    return _libc


def tune() -> bool:
    """Fixed mmap threshold and at most ``ARENA_MAX`` arenas; False where the allocator is not glibc."""
    libc = _glibc()
    if not libc:
        return False
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_ARENA_MAX, ARENA_MAX))
    if not ok:
        log.info("glibc refused the allocator settings; memory may stay at its high-water mark")
    return ok


def trim() -> None:
    """Return free heap memory to the system (no-op elsewhere than glibc)."""
    libc = _glibc()
    if libc:
        libc.malloc_trim(0)
