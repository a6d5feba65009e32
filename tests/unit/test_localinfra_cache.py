"""A cached build folder is absent or complete: a build that fails or is killed publishes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.localinfra import cache


def test_a_finished_build_is_published_whole(tmp_path: Path) -> None:
    target = tmp_path / "tool" / "v1-abc"
    with cache.publishing(target, "v1", "tool") as staging:
        (staging / "tool").write_text("binary")
        assert not cache.is_complete(target, "tool")  # nothing visible while building
    assert cache.is_complete(target, "tool")
    assert (target / "tool").read_text() == "binary"
    assert (target / cache.MARKER).read_text() == "v1"
    assert sorted(p.name for p in target.parent.iterdir()) == ["v1-abc"]  # no staging left


def test_a_failed_build_publishes_nothing_and_keeps_no_staging(tmp_path: Path) -> None:
    target = tmp_path / "v1"
    with pytest.raises(RuntimeError), cache.publishing(target, "v1", "tool") as staging:
        (staging / "tool").write_text("half")
        raise RuntimeError("compiler died")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_a_build_that_did_not_produce_its_files_is_not_published(tmp_path: Path) -> None:
    target = tmp_path / "v1"
    with pytest.raises(FileNotFoundError, match="etcd"), cache.publishing(target, "v1", "kube-apiserver", "etcd") as s:
        (s / "kube-apiserver").write_text("x")
    assert not cache.is_complete(target, "kube-apiserver", "etcd")


def test_a_complete_folder_that_lost_a_file_is_not_complete(tmp_path: Path) -> None:
    with cache.publishing(tmp_path / "v1", "v1", "tool") as staging:
        (staging / "tool").write_text("x")
    (tmp_path / "v1" / "tool").unlink()
    assert not cache.is_complete(tmp_path / "v1", "tool")


def test_a_target_published_meanwhile_by_another_process_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "v1"
    with cache.publishing(target, "v1", "tool") as staging:
        (staging / "tool").write_text("mine")
        target.mkdir()  # the other builder published first
        (target / "tool").write_text("theirs")
        (target / cache.MARKER).write_text("v1")
    assert (target / "tool").read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]


def test_an_incomplete_leftover_at_the_target_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "v1"
    target.mkdir()
    (target / "junk").write_text("from an older layout without a marker")
    with cache.publishing(target, "v1", "tool") as staging:
        (staging / "tool").write_text("x")
    assert sorted(p.name for p in target.iterdir()) == [cache.MARKER, "tool"]


_BUILDER = """
import sys, time
from pathlib import Path
from pipeline.localinfra import cache
target = Path(sys.argv[1])
with cache.publishing(target, "v1", "tool") as staging:
    (staging / "tool").write_text("built")
    print("built", flush=True)
    time.sleep(60)  # killed here: built, not yet published
"""


def test_a_builder_killed_between_build_and_publish_leaves_no_cache_and_the_next_build_clears_its_staging(
    tmp_path: Path,
) -> None:
    target = tmp_path / "loki" / "v1-abc"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", _BUILDER, str(target)], cwd=root, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(root)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "built"
        os.kill(proc.pid, signal.SIGKILL)  # no finally, no cleanup: what a crash or OOM kill leaves
    finally:
        proc.wait(timeout=30)
    leftovers = [p.name for p in target.parent.iterdir()]
    assert leftovers == [f"v1-abc.partial-{proc.pid}"], leftovers
    assert not cache.is_complete(target, "tool")

    with cache.publishing(target, "v1", "tool") as staging:
        (staging / "tool").write_text("rebuilt")
    assert cache.is_complete(target, "tool")
    assert sorted(p.name for p in target.parent.iterdir()) == ["v1-abc"]  # the dead builder's staging is gone
