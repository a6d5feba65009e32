"""How the worker hands records to Kafka: node states with their changelog acknowledgement, short fetch waits.

No broker: a fake producer stands in for Faust's (its ``send`` returns the delivery future, as
aiokafka's does), and the consumer thread's client factory is replaced.
"""

from __future__ import annotations

import asyncio
import types

import pytest

from agents.worker import create_app
from pipeline.app import WorkerSettings
from pipeline.kafka import upstream


class FakeProducer:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, bytes, int | None, asyncio.Future]] = []

    async def send(self, topic, key, value, partition, timestamp, headers):  # noqa: ANN001, ANN201
        future = asyncio.get_running_loop().create_future()
        self.sent.append((topic, key, value, partition, future))
        return future


class FakeChangelogProducer(FakeProducer):
    """aiokafka's ``send`` signature (the table's own producer, ``ChangelogProducer``)."""

    async def send(self, topic, value=None, key=None, partition=None):  # noqa: ANN001, ANN201
        return await super().send(topic, key, value, partition, None, None)


def _app() -> tuple[object, FakeProducer]:
    xapp = create_app("127.0.0.1:1")
    xapp.app.producer = FakeProducer()  # incidents; never the states
    producer = FakeChangelogProducer()
    xapp.node_state.changelog_producer.producer = producer
    return xapp, producer


def test_node_states_go_to_the_changelog_at_once_and_the_write_returns_their_acknowledgement() -> None:
    xapp, producer = _app()
    table = xapp.node_state

    async def main() -> None:
        durable = await table.write([(b"node-a", b"state-1", 3), (b"node-b", b"state-2", 5)])
        # Both records are on their way at once, raw, to the partition named (that of the node's events).
        assert [(t, k, v, p) for t, k, v, p, _ in producer.sent] == [
            ("xidflow-node-state-changelog", b"node-a", b"state-1", 3),
            ("xidflow-node-state-changelog", b"node-b", b"state-2", 5),
        ]
        # The store has them for the next batch; the batch itself waits for ``durable``.
        assert table.get(b"node-a") == b"state-1" and table.get(b"node-b") == b"state-2"
        producer.sent[0][4].set_result(None)
        await asyncio.sleep(0)
        assert not durable.done()  # not before every record of the batch is acknowledged
        producer.sent[1][4].set_result(None)
        await durable
        assert xapp.app.producer.sent == []  # the states have their own client (ChangelogProducer)

    asyncio.run(main())


def test_a_state_is_never_written_before_the_changelog_producer_started() -> None:
    xapp = create_app("127.0.0.1:1")
    xapp.app.producer = FakeProducer()

    async def main() -> None:
        # Faust's producer instead would put a partition's states on two clients, out of order.
        with pytest.raises(RuntimeError):
            await xapp.node_state.write([(b"node-a", b"state-1", 0)])
        assert xapp.app.producer.sent == [] and xapp.node_state.get(b"node-a") is None

    asyncio.run(main())


def test_a_changelog_write_that_fails_fails_the_acknowledgement() -> None:
    xapp, producer = _app()
    table = xapp.node_state

    async def main() -> None:
        durable = await table.write([(b"node-a", b"state-1", 0)])
        producer.sent[0][4].set_exception(RuntimeError("broker gone"))
        with pytest.raises(RuntimeError):
            await durable  # the batch is read again (GuardedConsumer.finishing); the replay rewrites the state

    asyncio.run(main())


def test_worker_consumers_long_poll_briefly(monkeypatch: pytest.MonkeyPatch) -> None:
    xapp = create_app("127.0.0.1:1", settings=WorkerSettings(fetch_max_wait_ms=20))
    consumer_class = xapp.app.transport.Consumer
    assert consumer_class.fetch_max_wait_ms == 20
    made = types.SimpleNamespace(_fetch_max_wait_ms=1500)  # Faust's hard-coded wait
    monkeypatch.setattr(
        upstream.faust_aiokafka.AIOKafkaConsumerThread, "_create_worker_consumer", lambda self, transport: made
    )
    thread = object.__new__(upstream._ConsumerThread)
    thread.consumer = types.SimpleNamespace(fetch_max_wait_ms=consumer_class.fetch_max_wait_ms)
    assert thread._create_worker_consumer(None)._fetch_max_wait_ms == 20
