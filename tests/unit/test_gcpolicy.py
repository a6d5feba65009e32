"""The services' garbage-collector policy: thresholds from the environment, long-lived objects frozen."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from pipeline.runtime.gcpolicy import GcSettings, tune


@pytest.fixture
def restored_gc() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_the_defaults_collect_far_less_often_than_cpython(restored_gc: None) -> None:
    assert tune() == (50_000, 20, 100)
    assert gc.get_threshold()[0] > 700
    assert gc.get_freeze_count() > 0  # what the process holds at start is out of the collector's way


def test_the_environment_sets_them(monkeypatch: pytest.MonkeyPatch, restored_gc: None) -> None:
    for n, v in (("0", "700"), ("1", "10"), ("2", "10")):
        monkeypatch.setenv(f"XIDFLOW_GC_THRESHOLD{n}", v)
    assert tune(GcSettings()) == (700, 10, 10)  # CPython's own


@pytest.mark.parametrize(("name", "value"), [("THRESHOLD0", "0"), ("THRESHOLD1", "-1"), ("THRESHOLD2", "x")])
def test_nonsense_is_refused(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(f"XIDFLOW_GC_{name}", value)
    with pytest.raises(ValueError, match=name.lower()):
        GcSettings()


def test_a_service_start_that_paused_the_collector_gets_it_back(restored_gc: None) -> None:
    gc.disable()  # what pipeline.cli does for the start of worker and actuator
    try:
        tune()
        assert gc.isenabled()
    finally:
        gc.enable()
