"""An outage as state changes (pipeline.runtime.reachability): lost, once a minute while it lasts, back."""

from __future__ import annotations

import asyncio
import logging
import logging.config

import pytest
from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import KafkaConnectionError, NodeNotReadyError

from pipeline.kafka import reachability as kafka_reachability
from pipeline.runtime import logconfig
from pipeline.runtime.reachability import BROKER, ClientRetries, Dependency


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lines(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="test.reachability")
    return caplog


def dependency(clock: Clock) -> Dependency:
    return Dependency("Kafka broker", clock=clock, logger=logging.getLogger("test.reachability"))


def said(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "test.reachability"]


def test_an_outage_is_one_line_lost_one_a_minute_and_one_back(lines: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    broker = dependency(clock)
    for _ in range(5000):  # 50 s of aiokafka's attempts at 100 a second
        broker.failed("Unable connect to node with id 1: Connect call failed")
        clock.now += 0.01
    assert said(lines) == [("WARNING", "Kafka broker unreachable: Unable connect to node with id 1: Connect call "
                                       "failed (said again once a minute while it lasts, and when it is back)")]
    clock.now += 10.5
    broker.failed("Failed fetch messages from 1: NodeNotReadyError")
    assert said(lines)[1] == ("ERROR", "Kafka broker still unreachable after 60 s: 5001 failed attempts, the last: "
                                       "Failed fetch messages from 1: NodeNotReadyError")
    clock.now += 30
    broker.failed("again")  # less than a minute after the reminder: counted, not said
    assert len(said(lines)) == 2
    clock.now += 20
    broker.reachable()
    assert said(lines)[2:] == [("INFO", "Kafka broker reachable again after 110 s (5002 failed attempts)")]
    assert not broker.down
    broker.reachable()  # up: nothing to say, nothing to take a lock for
    assert len(said(lines)) == 3


def test_answers_between_failures_are_not_back(lines: pytest.LogCaptureFixture) -> None:
    """One broker of three down: the others answer while connections to it keep failing."""
    clock = Clock()
    broker = dependency(clock)
    for _ in range(20):
        broker.failed("Unable connect to node with id 2")
        clock.now += 1
        broker.reachable()
        clock.now += 1
    assert broker.down and [level for level, _ in said(lines)] == ["WARNING"]
    clock.now += 5
    broker.reachable()  # no failure for the settling time: back
    assert not broker.down and said(lines)[-1][0] == "INFO"


async def test_an_answer_inside_the_settling_time_is_looked_at_again_on_the_loop(
    lines: pytest.LogCaptureFixture,
) -> None:
    broker = Dependency("Kafka broker", settle_s=0.2, logger=logging.getLogger("test.reachability"))
    broker.failed("x")
    broker.reachable()  # too soon after the failure: the loop looks again when it settled
    assert broker.down
    await asyncio.sleep(0.4)
    assert not broker.down and said(lines)[-1][1].startswith("Kafka broker reachable again after 0 s (1 failed")


def test_a_look_booked_on_a_loop_that_closed_does_not_keep_it_down_on_the_next(
    lines: pytest.LogCaptureFixture,
) -> None:
    loki = Dependency("Loki", settle_s=0.2, logger=logging.getLogger("test.reachability"))

    async def fail_then_answer_too_soon() -> None:
        loki.failed("x")
        loki.reachable()  # books a look on this loop, which closes before it comes

    asyncio.run(fail_then_answer_too_soon())
    assert loki.down

    async def answers_on_the_next_loop() -> None:  # the same process, a new loop (a second asyncio.run)
        loki.reachable()
        await asyncio.sleep(0.4)

    asyncio.run(answers_on_the_next_loop())
    assert not loki.down and said(lines)[-1][1].startswith("Loki reachable again")


def record(name: str, level: int, msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_client_records_of_failed_attempts_are_counted_not_written() -> None:
    kafka_reachability.install()
    keep = ClientRetries().filter
    BROKER.down, BROKER.failures = False, 0
    try:
        # aiokafka reports a failed attempt with the exception as an argument: routed by its type.
        assert not keep(record("aiokafka", logging.ERROR, "Unable connect to node with id %s: %s", 1,
                               ConnectionRefusedError(111, "Connect call failed")))
        assert BROKER.down and BROKER.failures == 1
        assert not keep(record("aiokafka.consumer.fetcher", logging.ERROR, "Failed fetch messages from %s: %s", 1,
                               NodeNotReadyError("node 1")))
        # While the broker is down, the client's other warnings are part of the outage ("Unable to update
        # metadata" carries no exception)...
        assert not keep(record("aiokafka", logging.ERROR, "Unable to update metadata from %s", [1]))
        assert BROKER.failures == 3
        # ...and so are its rediscoveries as the broker comes back; no other logger's lines are.
        assert not keep(record("aiokafka.consumer.group_coordinator", logging.INFO, "Discovered coordinator 1"))
        assert keep(record("xidflow.parse", logging.ERROR, "parse: %s", OSError("disk")))
        BROKER.down = False
        assert keep(record("aiokafka", logging.WARNING, "Unable to update metadata from %s", [1]))  # not down
        assert keep(record("aiokafka.consumer.group_coordinator", logging.INFO, "Discovered coordinator 1"))
        assert not keep(record("faust.transport", logging.ERROR, "x %s", KafkaConnectionError("closed")))
    finally:
        BROKER.down, BROKER.failures = False, 0


def test_a_metadata_answer_says_the_broker_is_back() -> None:
    kafka_reachability.install()
    kafka_reachability.install()  # once, however often
    assert getattr(ClusterMetadata.update_metadata, "_xidflow_reachability", False)
    assert ClusterMetadata.update_metadata.__wrapped__.__name__ == "update_metadata"  # type: ignore[attr-defined]
    seen: list[str] = []
    BROKER.down, BROKER._last_failure = True, 0.0  # type: ignore[attr-defined]
    original = BROKER._back
    BROKER._back = lambda now: (seen.append("back"), setattr(BROKER, "down", False))  # type: ignore[method-assign]
    try:
        ClusterMetadata.update_metadata(ClusterMetadata(), _metadata())
        assert seen == ["back"]
    finally:
        BROKER._back = original  # type: ignore[method-assign]
        BROKER.down = False


def _metadata() -> object:
    from aiokafka.protocol.metadata import MetadataResponse_v0

    return MetadataResponse_v0([(1, "127.0.0.1", 9092)], [])


def test_every_process_configuration_filters_the_clients_retries() -> None:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logconfig.configure("info", "text")
        assert any(isinstance(f, ClientRetries) for h in root.handlers for f in h.filters)
        logging.config.dictConfig(logconfig.dict_config("info", "json"))  # what Faust's worker is given
        assert any(isinstance(f, ClientRetries) for h in root.handlers for f in h.filters)
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
