"""Faust's per-record delivery to the agents' channels (``upstream.FaustConsumer.wait_first``), without a broker.

Faust's consumer hands every fetched record to the conductor as ``wait_first(callback(message),
suspend_flow.wait())``. The seam runs the callback's first step inline and answers what mode's
``wait_first`` would when it finishes there; a callback that has to wait goes on in mode's ``wait_first``,
so a rebalance (the flow suspended) or a stop still ends the wait. These tests hold both halves to
mode's answers, and check that Faust still delivers through that one call.
"""

from __future__ import annotations

import asyncio
import inspect
import warnings
from collections.abc import AsyncIterator
from typing import Any

import faust
import pytest
from faust.transport.consumer import Consumer as FaustBaseConsumer

from pipeline.kafka import upstream


@pytest.fixture
async def consumer() -> AsyncIterator[upstream.FaustConsumer]:
    app = faust.App("xidflow-test-drain", broker="kafka://127.0.0.1:1")

    async def nothing(*_: Any, **__: Any) -> None:
        return None

    yield upstream.FaustConsumer(
        app.transport, callback=nothing, on_partitions_revoked=nothing, on_partitions_assigned=nothing
    )


def test_faust_delivers_each_record_through_wait_first_of_the_callback_and_the_flow() -> None:
    source = "".join(inspect.getsource(FaustBaseConsumer._drain_messages).split())
    assert "awaitself.wait_first(callback(message),self.suspend_flow.wait())" in source, (
        "faust: Consumer._drain_messages no longer delivers a record as wait_first(callback(message), "
        "suspend_flow.wait()): upstream.FaustConsumer.wait_first no longer saves its tasks")


async def test_a_callback_that_finishes_at_once_runs_inline_and_wins(consumer: upstream.FaustConsumer) -> None:
    ran_in: list[Any] = []
    tasks_before = len(asyncio.all_tasks())

    async def deliver() -> str:
        ran_in.append(asyncio.current_task())
        ran_in.append(len(asyncio.all_tasks()))
        return "put"

    suspend = asyncio.Event()
    callback = deliver()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the flow's wait, never started, is closed: no "never awaited"
        results = await consumer.wait_first(callback, suspend.wait())
    assert results.done == [callback]
    assert results.results == ["put"]
    assert results.stopped is False
    # In the delivering task itself: no task per record.
    assert ran_in == [asyncio.current_task(), tasks_before]


async def test_a_callback_that_raises_at_once_raises(consumer: upstream.FaustConsumer) -> None:
    async def deliver() -> None:
        raise ValueError("decode")

    with pytest.raises(ValueError, match="decode"):
        await consumer.wait_first(deliver(), asyncio.Event().wait())


async def test_a_callback_that_waits_finishes_in_mode_wait_first(consumer: upstream.FaustConsumer) -> None:
    room = asyncio.Event()
    steps: list[str] = []

    async def deliver() -> int:
        steps.append("first")
        await room.wait()  # a full queue
        steps.append("rest")
        return 3

    callback = deliver()
    waiting = asyncio.ensure_future(consumer.wait_first(callback, asyncio.Event().wait()))
    await asyncio.sleep(0.01)
    assert steps == ["first"] and not waiting.done()
    room.set()
    results = await waiting
    assert steps == ["first", "rest"]
    assert results.done == [callback] and results.results == [3] and results.stopped is False


async def test_a_suspended_flow_ends_the_wait_of_a_waiting_callback_and_cancels_it(
    consumer: upstream.FaustConsumer,
) -> None:
    suspend = asyncio.Event()
    ended: list[str] = []

    async def deliver() -> None:
        try:
            await asyncio.Event().wait()  # never room: only the rebalance ends it
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    flow = suspend.wait()
    waiting = asyncio.ensure_future(consumer.wait_first(deliver(), flow))
    await asyncio.sleep(0.01)
    suspend.set()
    results = await waiting
    assert results.done == [flow] and results.stopped is False
    await asyncio.sleep(0)
    assert ended == ["cancelled"]


async def test_a_stopped_consumer_answers_as_mode_does(consumer: upstream.FaustConsumer) -> None:
    await consumer.stop()  # never started: only marks it stopped
    ran: list[str] = []

    async def deliver() -> None:
        ran.append("ran")

    results = await consumer.wait_first(deliver(), asyncio.Event().wait())
    assert results.stopped is True and results.done == []
