"""A pid recorded in a state file is only ours while its command line still says so."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.localinfra import procs


def test_alive_checks_the_command_line_when_asked() -> None:
    assert procs.alive(os.getpid())
    assert procs.alive(os.getpid(), expect="python")
    assert not procs.alive(os.getpid(), expect="/no/such/xidflow/state-dir")


def test_stop_leaves_a_process_that_is_not_ours_alone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not procs.alive(child.pid, expect="time.sleep"):  # until exec replaced the forked parent's cmdline
            assert time.monotonic() < deadline, "child never started"
            time.sleep(0.02)
        procs.stop(child.pid, timeout=1, expect="/no/such/xidflow/state-dir")
        assert child.poll() is None, "a process whose command line does not match was signalled"
        procs.stop(child.pid, timeout=5, expect="time.sleep")
        assert child.wait(timeout=5) is not None
    finally:
        if child.poll() is None:
            child.kill()


def test_kafka_cluster_ids_never_look_like_an_option() -> None:
    from pipeline.localinfra.kafka import new_cluster_id

    ids = {new_cluster_id() for _ in range(5000)}
    assert len(ids) == 5000 and not any(i.startswith("-") for i in ids)
    assert all(len(i) == 22 for i in ids)


def test_free_ports_are_chosen_below_the_ephemeral_range_and_free(tmp_path) -> None:  # noqa: ANN001
    low, _high = procs.ephemeral_range()
    ports = {procs.free_port() for _ in range(20)}
    assert all(procs.LISTEN_PORTS_FROM <= p < low for p in ports), ports  # no outgoing connection takes them
    assert all(procs._bindable(p) for p in ports)
    unreadable = tmp_path / "missing"
    assert procs.ephemeral_range(unreadable) == (32768, 60999)
    (tmp_path / "range").write_text("40000\t50000\n")
    assert procs.ephemeral_range(tmp_path / "range") == (40000, 50000)


def test_a_port_handed_out_is_not_handed_out_again_before_its_daemon_binds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The random choice repeats itself; only the first pick of each port may be handed out.
    picks = iter([20001, 20001, 20001, 20002])
    monkeypatch.setattr(procs.random, "randrange", lambda _a, _b: next(picks))
    monkeypatch.setattr(procs, "_handed_out", set())
    monkeypatch.setattr(procs, "_bindable", lambda _p: True)  # nothing listens yet: both would look free
    assert [procs.free_port(), procs.free_port()] == [20001, 20002]


def test_a_long_wait_says_what_it_waits_for_and_for_how_long(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "PROGRESS_EVERY_S", 0.2)
    ready_at = time.monotonic() + 0.9
    said: list[str] = []
    procs.wait_until(lambda: time.monotonic() >= ready_at, 10, "kube-scheduler", None, tmp_path / "s.log", said.append)
    assert len(said) >= 3, said
    assert all("waiting for kube-scheduler to be ready" in s and "of at most 10s" in s and "s.log" in s for s in said)
    quiet: list[str] = []
    procs.wait_until(lambda: True, 10, "etcd", None, tmp_path / "e.log", quiet.append)
    assert quiet == []
