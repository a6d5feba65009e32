"""/healthz: live while every stage makes progress (pipeline.runtime.liveness, pipeline.runtime.metrics)."""

from __future__ import annotations

from pipeline.runtime.liveness import Liveness


def test_an_idle_stage_is_live_and_a_busy_one_without_progress_is_not() -> None:
    live = Liveness()
    parse = live.component("parse", stall_after_s=10, now=0)
    for t in range(0, 100, 5):
        parse.beat(t)
        parse.progressed(t, idle=True)
    assert live.check(100) == (True, [])
    parse.busy(100)
    for t in range(100, 200, 5):  # the loop goes round (a restart loop does), nothing is committed
        parse.beat(t)
    ok, reasons = live.check(200)
    assert not ok and "parse: input waiting, no progress" in reasons[0]
    parse.progressed(201)
    assert live.check(205)[0]


def test_a_stage_whose_loop_stopped_is_not_live() -> None:
    live = Liveness()
    agg = live.component("aggregate", stall_after_s=10, now=0)
    agg.progressed(1, idle=True)
    assert live.check(10)[0]
    ok, reasons = live.check(30)
    assert not ok and "loop has not run" in reasons[0]
    live.remove("aggregate")
    assert live.check(30)[0]


def test_healthz_is_served_next_to_the_metrics() -> None:
    from pipeline.runtime import metrics
    from pipeline.runtime.liveness import LIVENESS

    def get(path: str) -> tuple[str, bytes]:
        got: dict[str, str] = {}
        body = b"".join(metrics.app({"PATH_INFO": path, "REQUEST_METHOD": "GET", "QUERY_STRING": ""},
                                    lambda status, headers: got.setdefault("status", status)))
        return got["status"], body

    status, _ = get("/metrics")
    assert status.startswith("200")
    comp = LIVENESS.component("unit-test-stage", stall_after_s=1, now=0)
    try:
        comp.busy(0)
        status, body = get("/healthz")
        assert status.startswith("503") and b"unit-test-stage" in body
    finally:
        LIVENESS.remove("unit-test-stage")
    assert get("/healthz")[0].startswith("200")


def test_a_fault_makes_the_process_unhealthy_but_not_a_restart_candidate() -> None:
    """A partition held at an undecodable batch: /healthz red, /livez green (a restart cannot fix it)."""
    registry = Liveness()
    stage = registry.component("parse", stall_after_s=30, now=0.0)
    why = "undecodable record batch at t[0] offset 4-9: lz4 library missing"
    stage.fault("t[0]", why)
    assert registry.check(now=1.0) == (False, [f"parse: {why}"])
    assert registry.check(now=1.0, faults=False) == (True, [])
    stage.clear("t[0]")
    assert registry.check(now=1.0) == (True, [])
