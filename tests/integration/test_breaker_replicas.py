"""Two replicas' breakers reserving headroom in one ConfigMap on a real API server.

The pure rule is proven in ``tests/unit/test_breaker_reservations.py``; here the I/O around it: two
``Breaker`` objects (two replicas: two holders) admit at once and never let more than the limit in, the
trip comes only at the real limit, and a replica that dies holding a reservation (no hand-back, no
more writes: a SIGKILL) blocks the other one only until the reservation lapses.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline.actuator.app import ensure_namespace
from pipeline.actuator.breaker import Breaker
from tests.integration.test_actuator_effects import Env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def replica(env: Env, configmap: str, ttl: float = 20.0) -> Breaker:
    # 20 GPU nodes at 50%: at most 10 count at once. Small blocks and a short sync: many writes interleave.
    return Breaker(
        env.kube, env.namespace, configmap, env.selector, 0.5, 300, block=4, sync_seconds=0.1, reservation_ttl=ttl
    )


async def test_two_replicas_admit_up_to_the_limit_and_trip_there(env: Env) -> None:
    names = await env.make_nodes(20)
    await ensure_namespace(env.kube, env.namespace)
    a, b = replica(env, "breaker-two"), replica(env, "breaker-two")
    try:
        # One admission each first: each write reserves a block, so that the burst starts from them.
        got = [await a.admit(names[0]), await b.admit(names[1])]
        got += await asyncio.gather(*(a.admit(n) for n in names[2::2]), *(b.admit(n) for n in names[3::2]))
        assert sum(d.allowed for d in got) == 10
        assert sum(d.tripped_now for d in got) == 1
        assert a.local_admissions + b.local_admissions > 0  # some came from the reserved blocks
        status = await a.status()
        assert status["tripped"] and "11 of 20" in status["reason"]
        # Every admitted node is written into the window (the blocks' last writes); nothing stays reserved.
        for _ in range(50):
            status = await a.status()
            if status["quarantined_in_window"] == 10 and status["reserved"] == 0:
                break
            await asyncio.sleep(0.1)
        assert status["quarantined_in_window"] == 10 and status["reserved"] == 0
    finally:
        await a.close()
        await b.close()


async def test_a_dead_replicas_reservation_lapses(env: Env) -> None:
    names = await env.make_nodes(20)
    await ensure_namespace(env.kube, env.namespace)
    dead, live = replica(env, "breaker-kill", ttl=2.0), replica(env, "breaker-kill", ttl=2.0)
    assert (await dead.admit(names[0])).allowed
    assert dead._slots == 4  # its first write reserved a block (an even share of the 9 left, at most 4)
    assert dead._flusher is not None
    dead._flusher.cancel()  # SIGKILLed: no hand-back, no renewal
    status = await live.status()
    assert status["reserved"] == 4 and list(status["reservations"]) == [dead.holder]
    start = time.monotonic()
    try:
        got = await asyncio.gather(*(live.admit(n) for n in names[1:10]))
        assert all(d.allowed for d in got)  # 1 + 9 = 10: every one fits once the dead block lapsed
        assert time.monotonic() - start >= 1.0  # the last ones waited for it (2 s after its write)
        assert (await live.admit(names[10])).tripped_now  # the 11th: the real limit
        status = await live.status()
        assert dead.holder not in status["reservations"]
    finally:
        await live.close()
