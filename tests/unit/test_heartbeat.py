"""/livez is answered by the event loop: 200 while it runs, no answer while it is blocked, 503 when late."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from pipeline.runtime import heartbeat
from pipeline.runtime.heartbeat import HealthSettings, Heartbeat


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str = "/livez", timeout: float = 10.0) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_a_blocked_loop_does_not_answer_and_a_running_one_does() -> None:
    port = free_port()
    settings = HealthSettings(port=port, addr="127.0.0.1")
    ready, block, release = threading.Event(), threading.Event(), threading.Event()
    after: list[int] = []

    async def main() -> None:
        server = asyncio.create_task(heartbeat.serve(settings))
        await asyncio.sleep(0.2)
        ready.set()
        await asyncio.to_thread(block.wait)
        release.wait()  # noqa: ASYNC251 - the point: the loop is stuck, nothing on it runs, /livez included
        after.append(await asyncio.to_thread(get, port))
        server.cancel()

    loop_thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    loop_thread.start()
    try:
        assert ready.wait(30)
        assert get(port) == 200
        assert get(port, "/metrics") == 404
        block.set()
        time.sleep(0.2)  # let the loop reach release.wait()
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=1.0)
    finally:
        block.set()  # an assertion above failed before it: the loop must not wait on it forever
        release.set()
        loop_thread.join(30)
    assert after == [200]  # running again: alive again


def test_a_loop_that_missed_its_ticks_is_reported_late() -> None:
    class Stalled(Heartbeat):
        async def tick_forever(self) -> None:  # the ticker never gets to run
            return None

    port = free_port()
    beat = Stalled(max_lag_s=5)
    beat.last_tick -= 60  # as if the loop had been too busy to tick for a minute

    async def main() -> int:
        server = asyncio.create_task(heartbeat.serve(HealthSettings(port=port, addr="127.0.0.1"), beat))
        await asyncio.sleep(0.2)
        status = await asyncio.to_thread(get, port)
        server.cancel()
        return status

    assert asyncio.run(main()) == 503


def test_port_zero_serves_nothing_and_work_still_runs() -> None:
    async def work() -> str:
        return "done"

    assert asyncio.run(heartbeat.with_liveness(work())) == "done"


def test_a_busy_port_does_not_stop_the_work() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        busy = HealthSettings(port=s.getsockname()[1], addr="127.0.0.1")
        asyncio.run(asyncio.wait_for(heartbeat.serve(busy), 5))  # returns: warned, not raised


def test_a_held_partition_fails_readiness_not_liveness() -> None:
    """The probes the chart wires to this port: /healthz (readiness) red on a fault, /livez (liveness) not."""
    from pipeline.runtime.liveness import LIVENESS

    port = free_port()
    stage = LIVENESS.component("unit-held-stage", stall_after_s=60)
    stage.fault("raw[3]", "undecodable record batch at raw[3] offset 7-9: lz4 library missing")

    async def main() -> tuple[int, int, int]:
        server = asyncio.create_task(heartbeat.serve(HealthSettings(port=port, addr="127.0.0.1")))
        await asyncio.sleep(0.2)
        statuses = (await asyncio.to_thread(get, port, "/livez"), await asyncio.to_thread(get, port, "/healthz"),
                    await asyncio.to_thread(get, port, "/metrics"))
        server.cancel()
        return statuses

    try:
        assert asyncio.run(main()) == (200, 503, 404)
    finally:
        LIVENESS.remove("unit-held-stage")
