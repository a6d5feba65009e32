"""One cached build folder: either absent or complete, never half-published.

Every installer that caches a build under ``cache_root()`` (Loki, helm, the OpenTelemetry Collector,
Fluent Bit, the Kafka jars, kube-apiserver and etcd) builds into a staging folder beside the target
(``<name>.partial-<pid>``), writes the ``.complete`` marker into it, and only then renames it onto the
target. A rename within one folder is atomic, so a reader sees the old state or the whole new folder
with its marker: a process killed anywhere before the rename leaves at most a staging folder, which
nothing recognises and the next build of the same target clears.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MARKER = ".complete"


def is_complete(target: Path, *files: str) -> bool:
    """The folder was published whole (its marker is there) and still holds ``files``."""
    return (target / MARKER).exists() and all((target / f).exists() for f in files)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _clear_abandoned(target: Path) -> None:
    """Staging folders of this target left by processes that died before publishing."""
    prefix = f"{target.name}.partial"
    if not target.parent.is_dir():
        return
    for stale in target.parent.glob(f"{prefix}*"):
        pid = stale.name[len(prefix) + 1:]
        # A live builder's folder stays: two processes may build the same target at once (the
        # one that publishes second finds the target complete and drops its own).
        if pid.isdigit() and _alive(int(pid)) and int(pid) != os.getpid():
            continue
        shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def one_builder(target: Path) -> Iterator[None]:
    """Hold the build lock of ``target``: one build at a time; a second caller (another test session,
    ``local install``, the demo) waits here for the first, then finds the target complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@contextmanager
def publishing(target: Path, stamp: str, *files: str) -> Iterator[Path]:
    """Build into the yielded staging folder; when the block ends normally, publish it as ``target``.

    ``stamp`` goes into the marker (the version built, for a reader). ``files`` are what a complete
    target must hold. If another process published the target meanwhile, its folder is kept and
    this one dropped. An exception in the block publishes nothing.
    """
    _clear_abandoned(target)
    staging = target.with_name(f"{target.name}.partial-{os.getpid()}")
    staging.mkdir(parents=True)
    try:
        yield staging
        missing = [f for f in files if not (staging / f).exists()]
        if missing:
            raise FileNotFoundError(f"the build left no {', '.join(missing)} in {staging}")
        (staging / MARKER).write_text(stamp)
        if not is_complete(target, *files):
            shutil.rmtree(target, ignore_errors=True)  # an older, incomplete attempt
            staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
