"""The actuator as a consumer group on real Kafka: replicas, redelivery, commits, dead letters,
rescue requests, recovery, the breaker, and an API server that is down for a while."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from urllib.parse import urlparse

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from kubernetes import config

from pipeline.actuator.app import Actuator, actuator_topics, ensure_namespace
from pipeline.actuator.kube import Kube
from pipeline.actuator.requests import RescueAction, RescueActionRequest
from pipeline.actuator.testing import make_incident, node_events, publish, wait_until
from pipeline.kafka.admin import ensure_topics
from pipeline.runtime.settings import KafkaSettings
from schemas.records import DeadLetter, NodeRecovered, Outcome
from tests.integration.relay import Relay
from tests.integration.test_actuator_effects import Env, outcomes

# A hang (an unbounded retry against a broken API server) fails in minutes, with its stack, not at 600 s.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.fixture
async def env(kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]) -> AsyncIterator[Env]:
    world = Env(kafka_bootstrap, kubeconfig, unique)
    await ensure_topics(kafka_bootstrap, actuator_topics(world.topics), partitions=4)
    yield world
    await world.close()


@contextlib.asynccontextmanager
async def consuming(act: Actuator) -> AsyncIterator[Actuator]:
    await act.consumer.start()
    act._consuming = True
    task = asyncio.create_task(act.run())
    try:
        yield act
    finally:
        act.consumer._stopping.set()
        await task


async def cordoned(env: Env, names: list[str]) -> bool:
    nodes = [await env.node(n) for n in names]
    return all(n["spec"].get("unschedulable") for n in nodes)


async def committed(bootstrap: str, group: str, topic: str) -> tuple[dict[int, int], dict[int, int]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for attempt in range(40):
            try:
                offsets = await admin.list_consumer_group_offsets(group)
                break
            except KafkaError as exc:
                # The broker answers "coordinator not available" while it loads the group's offsets partition
                # (a private broker just started, on a loaded machine): retriable, as aiokafka's own clients do.
                if not exc.retriable or attempt == 39:
                    raise
                await asyncio.sleep(0.25)
    finally:
        await admin.close()
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
        if not tps:
            await consumer._client.force_metadata_update()
            tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or []]
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    got = {tp.partition: meta.offset for tp, meta in offsets.items() if tp.topic == topic}
    return got, {tp.partition: end for tp, end in ends.items() if end > 0}


async def test_two_replicas_in_one_group_quarantine_each_node_once_despite_redelivery(env: Env) -> None:
    names = await env.make_nodes(8)
    group = env.unique("group")
    one = await env.actuator(worker="a", group_id=group)
    two = await env.actuator(worker="b", group_id=group)
    incidents = [make_incident(n, f"inc-k-{i}") for i, n in enumerate(names)]
    async with consuming(one), consuming(two):
        await publish(env.bootstrap, env.topics.name("incidents"), incidents + incidents)  # every one twice
        await wait_until(lambda: cordoned(env, names), 60, what="all nodes cordoned")

        async def all_done() -> bool:
            got, ends = await committed(env.bootstrap, group, env.topics.name("incidents"))
            return bool(ends) and all(got.get(p) == e for p, e in ends.items())

        await wait_until(all_done, 30, what="offsets committed to the end")
    audit = await env.audit()
    for name in names:
        assert len(await node_events(env.kube, name)) == 1
        applied = [r.action for r in audit if r.node == name and r.outcome == Outcome.APPLIED]
        assert applied.count("cordon") == 1 and applied.count("event") == 1


async def test_recovery_request_and_dead_letter_through_kafka(env: Env) -> None:
    a, b = await env.make_nodes(2)
    act = await env.actuator()
    now = datetime.now(UTC)
    request = RescueActionRequest(
        request_id="r-1",
        node_name=b,
        xid=79,
        escalate_time=now,
        received_at=now,
        requested_by="tests",
        actions=[RescueAction(name="cordon"), RescueAction(name="unCordon")],
    )
    async with consuming(act):
        await publish(env.bootstrap, env.topics.name("incidents"), [make_incident(a, "inc-kr")])
        await wait_until(lambda: cordoned(env, [a]), 30, what="cordon")
        await publish(
            env.bootstrap, env.topics.name("incidents"), [NodeRecovered(incident_id="inc-kr", node=a, reason="quiet")]
        )

        async def uncordoned() -> bool:
            return not (await env.node(a))["spec"].get("unschedulable")

        await wait_until(uncordoned, 30, what="undo")
        await publish(env.bootstrap, env.topics.name("remediation_requests"), [request])
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(bootstrap_servers=env.bootstrap)
        await producer.start()
        await producer.send_and_wait(env.topics.name("incidents"), b"{not json", key=a.encode())
        await producer.stop()

        async def request_done() -> bool:
            return ("unCordon", "applied") in outcomes(await env.audit(), b)

        await wait_until(request_done, 30, what="rescue request executed")
    assert not (await env.node(b))["spec"].get("unschedulable")
    req_records = [r for r in await env.audit() if r.node == b]
    assert {r.incident_id for r in req_records} == {"req:r-1"}
    consumer = AIOKafkaConsumer(
        env.topics.name("deadletter"), bootstrap_servers=env.bootstrap, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        msg = await asyncio.wait_for(consumer.getone(), 20)
    finally:
        await consumer.stop()
    letter = DeadLetter.from_bytes(msg.value)
    assert letter.stage == "actuator" and "not JSON" in letter.reason and letter.payload == "{not json"


async def test_breaker_trips_at_threshold_and_only_reset_closes_it(env: Env) -> None:
    names = await env.make_nodes(4)
    act = await env.actuator(breaker_max_share=0.5)
    for i, name in enumerate(names[:3]):
        await act.engine.handle(make_incident(name, f"inc-b-{i}"))
    states = [bool((await env.node(n))["spec"].get("unschedulable")) for n in names[:3]]
    assert states == [True, True, False]
    third = [r for r in await env.audit() if r.node == names[2] and r.action == "cordon"][0]
    assert third.outcome == Outcome.SKIPPED and "breaker" in third.reason
    assert any(r.action == "breaker-trip" for r in await env.audit())
    status = await act.breaker.status()
    assert status["tripped"] and status["quarantined_in_window"] == 2
    events = await env.kube._call(env.kube.core.list_namespaced_event, env.namespace)
    assert any(e["reason"] == "CircuitBreakerTripped" for e in events["items"])
    # still open for the next node; the Event (information) still goes out
    await act.engine.handle(make_incident(names[3], "inc-b-3"))
    assert not (await env.node(names[3]))["spec"].get("unschedulable")
    assert len(await node_events(env.kube, names[3])) == 1
    # A person returns names[0] to service; after the reset the breaker counts what is quarantined now.
    await env.kube.patch_node(names[0], {"spec": {"unschedulable": False, "taints": []}})
    assert await act.breaker.reset(by="tests") is True
    await act.engine.handle(make_incident(names[3], "inc-b-4"))
    assert (await env.node(names[3]))["spec"]["unschedulable"] is True


async def test_api_server_down_for_a_while_is_retried_and_applied_later(env: Env, kubeconfig: str) -> None:
    """The actuator talks to the real API server through a TCP relay that is closed at first."""
    (name,) = await env.make_nodes(1)
    api_client = config.new_client_from_config(config_file=kubeconfig)
    target = urlparse(api_client.configuration.host)
    relay = Relay((target.hostname or "127.0.0.1", target.port or 443))  # not listening yet: the server is down
    api_client.configuration.host = f"https://127.0.0.1:{relay.port}"
    act = Actuator(
        env.settings(worker_id="down"),
        KafkaSettings(KAFKA_BOOTSTRAP_SERVERS=env.bootstrap),
        env.topics,
        kubeconfig,
    )
    act.kube.close()
    act.kube = Kube(api_client, 4)
    act.engine.kube = act.breaker.kube = act.drains.kube = act.kube
    await ensure_namespace(env.kube, env.namespace)
    await act.auditor.start()
    env.actuators.append(act)
    handling = asyncio.create_task(act.engine.handle(make_incident(name, "inc-down")))
    await asyncio.sleep(1.5)
    assert not handling.done()
    assert not (await env.node(name))["spec"].get("unschedulable")

    # The relay runs on threads of its own: it must keep forwarding even while the actuator's event
    # loop waits on its Kubernetes calls (sharing one loop made the test itself a deadlock risk).
    relay.start()
    try:
        await asyncio.wait_for(handling, 60)
    finally:
        relay.cut()
    assert (await env.node(name))["spec"]["unschedulable"] is True
    assert ("cordon", "applied") in outcomes(await env.audit(), name)


async def test_an_error_escaping_the_consumer_is_logged_and_ends_the_process_non_zero(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever escapes ``consumer.run`` (a Kafka client error no handler knew) must not end the process with
    status 0 and no line: the orchestrator would not know to restart it, and nobody would know why."""

    class Breaking(Actuator):
        async def run(self) -> None:
            await asyncio.sleep(0.2)
            raise OSError("the broker's answer could not be read")  # what the client raises, in its place

    act = Breaking(env.settings(worker_id="breaks"), KafkaSettings(KAFKA_BOOTSTRAP_SERVERS=env.bootstrap), env.topics,
                   env.kubeconfig)
    with pytest.raises(RuntimeError, match="consumer stopped") as raised:
        await asyncio.wait_for(act.run_forever(asyncio.Event()), 60)
    assert isinstance(raised.value.__cause__, OSError)
    assert any("the consumer stopped: OSError" in r.getMessage() for r in caplog.records)
