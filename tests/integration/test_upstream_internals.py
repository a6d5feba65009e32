"""Every private name of faust-streaming and aiokafka that xidflow touches, and every upstream behaviour it
patches: one test each, so that an upgrade fails here, for the right reason, before it loses a record.

Every one of them is used in ``pipeline/kafka/upstream.py`` alone (the seam): Faust's consumer hooks and bookkeeping
(for ``pipeline/kafka/fetch_watchdog.py``'s guarantees and two reads in ``pipeline/app.py``), aiokafka's record
iterator (where ``pipeline/kafka/undecodable.py``'s bad batch is), the coordinator's static identity and
DescribeGroups v4 (``pipeline/kafka/membership.py``) and the clients' metadata refresh; and the public stream
rules ``pipeline/aggregate/stream_batches.py`` repeats without a stream.
``test_no_private_upstream_name_outside_the_seam`` keeps it that way.
pyproject.toml holds these packages to one minor release; "Upgrading dependencies" (docs/dependencies.md)
says what to do when a test here fails. Each failure message names the upstream change and who relied on it.

Two kinds of test: the shape (a method we override or call still exists with the arguments and the kind
we use, and Faust still calls it from where our override expects) and the behaviour (the upstream defect
each override closes is still there, so the override is still needed and still aimed at the right thing,
checked on Faust's real code and, for aiokafka, against the real broker). A behaviour test that fails
because upstream *fixed* a defect is good news: re-read the override it names and drop what is redundant.
End-to-end, the guarantees themselves are tested by tests/integration/test_aggregation_crash.py and
test_pipeline_resilience.py.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import metadata
from typing import Any

import faust
import faust.transport.consumer as faust_consumer_base
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import AIOKafkaClient
from aiokafka.consumer.fetcher import Fetcher, FetchResult, PartitionRecords
from aiokafka.record.default_records import DefaultRecordBatch
from aiokafka.structs import ConsumerRecord
from faust.streams import Stream
from faust.tables.manager import TableManager
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP

from agents.worker import create_app
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka import fetch_watchdog, upstream
from pipeline.kafka import membership as group_membership
from pipeline.kafka.admin import ensure_topics

FAUST = f"faust-streaming {metadata.version('faust-streaming')}"
AIOKAFKA = f"aiokafka {metadata.version('aiokafka')}"

# ---------------------------------------------------------------------------------------------------------
# Shape: the private (and public) upstream methods we override or call.

ASYNC, SYNC, ASYNC_GEN, AWAITABLE = "coroutine function", "plain function", "async generator", "returns awaitable"

# (owner, name, parameters, kind, who relies on it)
METHODS: list[tuple[type, str, list[str], str, str]] = [
    (faust_aiokafka.Consumer, "_getmany", ["self", "active_partitions", "timeout"], ASYNC,
     "upstream.FaustConsumer._getmany -> fetch_records (fetch_watchdog keeps held partitions out of the fetch)"),
    (faust_aiokafka.Consumer, "_add_gap", ["self", "tp", "offset_from", "offset_to"], ASYNC,
     "upstream.FaustConsumer._add_gap -> keeps_gap (fetch_watchdog refuses gaps on the source topics)"),
    (faust_aiokafka.Consumer, "_new_offset", ["self", "tp"], SYNC,
     "upstream.FaustConsumer._new_offset -> offset_to_commit (fetch_watchdog: no commit past an unacked record)"),
    (faust_aiokafka.Consumer, "_new_consumer_thread", ["self"], SYNC,
     "upstream.FaustConsumer._new_consumer_thread installs upstream._ConsumerThread"),
    (faust_aiokafka.Consumer, "getmany", ["self", "timeout"], ASYNC_GEN,
     "fetch_watchdog.GuardedConsumer.getmany applies the seek fence"),
    (faust_aiokafka.Consumer, "seek", ["self", "partition", "offset"], ASYNC,
     "fetch_watchdog.GuardedConsumer.seek records the seek for the fence"),
    (faust_aiokafka.Consumer, "ack", ["self", "message"], SYNC,
     "fetch_watchdog.GuardedConsumer.ack counts only finished records"),
    (faust_aiokafka.Consumer, "perform_seek", ["self"], ASYNC,
     "fetch_watchdog.GuardedConsumer.perform_seek seeks partitions without a commit to their log start"),
    (faust_aiokafka.Consumer, "earliest_offsets", ["self", "*partitions"], ASYNC,
     "fetch_watchdog.GuardedConsumer.refresh_log_start / perform_seek"),
    (faust_aiokafka.AIOKafkaConsumerThread, "_create_worker_consumer", ["self", "transport"], SYNC,
     "upstream._ConsumerThread sets the worker consumer's fetch wait"),
    (faust_aiokafka.AIOKafkaConsumerThread, "_ensure_consumer", ["self"], SYNC,
     "the fetch watchdog timer (fetch_watchdog.install) reads the aiokafka consumer through it"),
    (AIOKafkaAdminClient, "_send_request", ["self", "request", "node_id"], ASYNC,
     "group_membership.describe_group sends DescribeGroups v4 with it"),
    (TableManager, "_update_channels", ["self"], ASYNC,
     "upstream.PromptTableManager.on_start subscribes the tables' channels with it"),
    (faust.Table, "on_rebalance", ["self", "assigned", "revoked", "newly_assigned", "generation_id"], ASYNC,
     "pipeline.app.NodeStateTable.on_rebalance tells the tick index which partitions the process owns"),
    (AIOKafkaClient, "force_metadata_update", ["self"], AWAITABLE,
     "loki_tail, commands/replay and actuator/testing refresh consumer._client's metadata"),
    (faust_aiokafka.Producer, "_ensure_producer", ["self"], SYNC,
     "upstream.faust_producer_client: the aggregation's record batches go to the aiokafka producer it returns"),
    (AIOKafkaProducer, "create_batch", ["self"], SYNC, "record_batches.RecordBatches fills one per partition"),
    (AIOKafkaProducer, "send_batch", ["self", "batch", "topic", "partition"], ASYNC,
     "record_batches.RecordBatches hands each filled batch over (one future per batch)"),
    (AIOKafkaProducer, "partitions_for", ["self", "topic"], ASYNC,
     "record_batches.RecordBatches partitions as send does (the producer's partitioner over this list)"),
]


def _kind(fn: Any) -> str:
    if inspect.isasyncgenfunction(fn):
        return ASYNC_GEN
    return ASYNC if inspect.iscoroutinefunction(fn) else SYNC


def _params(fn: Any) -> list[str]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        out.append(f"*{p.name}" if p.kind is p.VAR_POSITIONAL else f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name)
    return out


@pytest.mark.parametrize(("owner", "name", "params", "kind", "who"), METHODS,
                         ids=[f"{o.__name__}.{n}" for o, n, *_ in METHODS])
def test_the_upstream_methods_we_override_or_call_keep_their_shape(
    owner: type, name: str, params: list[str], kind: str, who: str
) -> None:
    package = FAUST if owner.__module__.startswith("faust") else AIOKAFKA
    fn = getattr(owner, name, None)
    assert fn is not None, f"{package} removed {owner.__name__}.{name}: {who}"
    assert _params(fn) == params, (
        f"{package} changed {owner.__name__}.{name}{_params(fn)} (was {params}): {who}")
    if kind != AWAITABLE:
        assert _kind(fn) == kind, f"{package} made {owner.__name__}.{name} a {_kind(fn)} (was a {kind}): {who}"


# Where Faust calls the hooks we override: an override Faust no longer calls is silently dead. Each entry names
# the override itself (not a string): a renamed or moved override fails at import, never stays behind as a
# stale name; test_every_private_override_of_ours_has_its_call_site checks that none is missing.
CALL_SITES: list[tuple[Callable[..., Any], str, Callable[..., Any]]] = [
    (faust_consumer_base.Consumer._wait_next_records, "self._getmany(", upstream.FaustConsumer._getmany),
    (faust_consumer_base.Consumer._drain_messages, "self._add_gap(", upstream.FaustConsumer._add_gap),
    (faust_consumer_base.Consumer._filter_committable_offsets, "self._new_offset(", upstream.FaustConsumer._new_offset),
    (faust_consumer_base.ThreadDelegateConsumer.__init__, "self._new_consumer_thread()",
     upstream.FaustConsumer._new_consumer_thread),
    (faust_aiokafka.AIOKafkaConsumerThread._create_consumer, "self._create_worker_consumer(",
     upstream._ConsumerThread._create_worker_consumer),
    # Not an override: the reader of the attribute Faust sets here (behind group_membership.faust_consumer).
    (faust_aiokafka.AIOKafkaConsumerThread.on_start, "self._consumer = self._create_consumer(",
     upstream.faust_aiokafka_consumer),
]

# Our subclasses of Faust's classes whose private overrides Faust must keep calling.
OVERRIDING = (upstream.FaustConsumer, upstream._ConsumerThread)


def test_faust_tells_each_table_of_a_rebalance_before_the_restore() -> None:
    # A public hook, but the tick index relies on when Faust calls it: with the whole new assignment, before
    # the recovery of the new partitions (whose keys the index then learns).
    source = inspect.getsource(TableManager.on_rebalance)
    assert "T(table.on_rebalance)" in source and source.index("T(table.on_rebalance)") < source.index(
        "self.recovery.on_rebalance"), (
        f"{FAUST} changed TableManager.on_rebalance: re-read pipeline.app.NodeStateTable.on_rebalance")


def test_the_table_manager_start_we_replace_is_still_sleep_then_subscribe_then_recover() -> None:
    # upstream.PromptTableManager.on_start is Faust's without the sleep: anything else Faust adds there
    # would be lost by the override.
    body = [line.strip() for line in inspect.getsource(TableManager.on_start).splitlines()[1:]]
    body = [line for line in body if line and not line.startswith(('"""', "#"))]
    assert body == ["await self.sleep(1.0)", "if not self.should_stop:", "await self._update_channels()",
                    "await self.recovery.start()"], (
        f"{FAUST} changed TableManager.on_start: re-read upstream.PromptTableManager.on_start ({body})")


@pytest.mark.parametrize(("caller", "call", "override"), CALL_SITES, ids=[c for _, c, _ in CALL_SITES])
def test_faust_still_calls_the_hooks_we_override(
    caller: Callable[..., Any], call: str, override: Callable[..., Any]
) -> None:
    assert call in inspect.getsource(caller), (
        f"{FAUST}: {caller.__qualname__} no longer calls `{call}...`: "
        f"{override.__module__}.{override.__qualname__} would never run")


@pytest.mark.parametrize(("caller", "call", "override"), CALL_SITES, ids=[c for _, c, _ in CALL_SITES])
def test_each_call_site_names_the_override_of_ours_it_reaches(
    caller: Callable[..., Any], call: str, override: Callable[..., Any]
) -> None:
    # The entry points at code of the seam, and that code is about the name Faust calls (or sets) there.
    assert getattr(override, "__module__", None) == upstream.__name__, (
        f"CALL_SITES entry for `{call}` names {override!r}, not a function of pipeline/kafka/upstream.py")
    name = re.search(r"self\.(\w+)", call)
    assert name is not None, call
    assert name.group(1) in inspect.getsource(override), (
        f"{override.__qualname__} does not mention `{name.group(1)}`: CALL_SITES pairs `{call}` with the wrong code")


def test_every_private_override_of_ours_has_its_call_site() -> None:
    # Derived, not listed: an override added to the seam without a call-site check fails here.
    # The seam defines its Faust subclasses in a function (at first use): their names without its prefix.
    checked = {override.__qualname__.rpartition("<locals>.")[2] for _, _, override in CALL_SITES}
    for cls in OVERRIDING:
        for name, member in vars(cls).items():
            if not callable(member) or not name.startswith("_") or name.startswith("__"):
                continue
            if any(name in vars(base) for base in cls.__mro__[1:]):
                assert f"{cls.__name__}.{name}" in checked, (
                    f"upstream.{cls.__name__}.{name} overrides a private method of {FAUST} but CALL_SITES has no "
                    "entry saying where Faust calls it")


# ---------------------------------------------------------------------------------------------------------
# Faust's consumer state, as fetch_watchdog.py and app.py read it (a real worker app's consumer).


@pytest.fixture
async def faust_consumer() -> Any:
    xapp = create_app("127.0.0.1:9", topics=None)  # never started: nothing connects
    consumer = xapp.app.consumer
    assert isinstance(consumer, fetch_watchdog.GuardedConsumer)
    return consumer


async def test_faust_consumer_state_the_watchdog_and_the_liveness_timer_read(faust_consumer: Any) -> None:
    c, tp = faust_consumer, TP("t", 0)
    where = "fetch_watchdog.GuardedConsumer / fetch_watchdog.install / app.install_aggregation_liveness"
    for name in ("_read_offset", "_committed_offset"):  # tp -> offset, None when unknown
        state = getattr(c, name, None)
        assert state is not None and state[tp] is None, f"{FAUST} changed Consumer.{name} (tp -> offset|None): {where}"
    assert c._acked[tp] == [], f"{FAUST} changed Consumer._acked (tp -> list of acknowledged offsets): {where}"
    assert hasattr(c._unacked_messages, "discard"), f"{FAUST} changed Consumer._unacked_messages: {where}"
    assert isinstance(c._paused_partitions, set), f"{FAUST} changed Consumer._paused_partitions: {where}"
    thread = c._thread
    assert isinstance(thread, upstream._ConsumerThread), f"{FAUST}: Consumer._thread is not ours: {where}"
    assert thread._consumer is None  # set by on_start (see the call sites above)
    with pytest.raises(faust_aiokafka.ConsumerNotStarted):
        thread._ensure_consumer()


async def test_faust_hard_codes_the_fetch_wait_and_our_thread_overrides_it(faust_consumer: Any) -> None:
    transport = faust_consumer.transport
    theirs = faust_aiokafka.AIOKafkaConsumerThread._create_worker_consumer(faust_consumer._thread, transport)
    ours = faust_consumer._thread._create_worker_consumer(transport)
    try:
        assert theirs._fetch_max_wait_ms == 1500, (
            f"{FAUST} no longer creates its consumer with fetch_max_wait_ms=1500: it may be a setting now "
            "(upstream._ConsumerThread patches aiokafka's _fetch_max_wait_ms instead)")
        assert ours._fetch_max_wait_ms == faust_consumer.fetch_max_wait_ms == fetch_watchdog.FETCH_MAX_WAIT_MS
    finally:
        await theirs.stop()
        await ours.stop()


# ---------------------------------------------------------------------------------------------------------
# The Faust defects GuardedConsumer closes (its module docstring), on Faust's own code.


def _new_offset(c: Any, tp: TP, committed: int | None, acked: list[int]) -> int | None:
    c._committed_offset[tp] = committed
    c._acked[tp] = list(acked)
    c._acked_index[tp] = set(acked)
    return faust_consumer_base.Consumer._new_offset(c, tp)


async def test_faust_commits_past_unacknowledged_records_when_no_commit_is_known(faust_consumer: Any) -> None:
    # Records 0-4 never acknowledged, 5-7 acknowledged, no commit yet: Faust commits 8.
    assert _new_offset(faust_consumer, TP("t", 0), None, [5, 6, 7]) == 8, (
        f"{FAUST} changed Consumer._new_offset without a known commit (it committed past the unacknowledged "
        "head): GuardedConsumer._new_offset's guard may be redundant; re-check it")


async def test_faust_head_check_is_off_by_one(faust_consumer: Any) -> None:
    # Committed 3 (record 3 is next), 4-5 acknowledged: record 3 was never acknowledged, yet Faust commits 6.
    assert _new_offset(faust_consumer, TP("t", 0), 3, [4, 5]) == 6, (
        f"{FAUST} fixed the off-by-one in Consumer._new_offset (min(acked) - committed > 1): "
        "GuardedConsumer._new_offset's guard may be redundant; re-check it")
    assert _new_offset(faust_consumer, TP("t", 0), 3, [5, 6]) is None


async def test_faust_books_a_jump_in_delivery_as_a_gap_and_commits_past_it(faust_consumer: Any) -> None:
    c, tp = faust_consumer, TP("t", 0)
    c._committed_offset[tp] = None
    await faust_consumer_base.Consumer._add_gap(c, tp, 3, 5)
    assert _new_offset(c, tp, None, [0, 1, 2, 6]) == 7, (
        f"{FAUST} no longer commits past a booked gap: GuardedConsumer._add_gap (no gaps on source topics) "
        "may be redundant")


async def test_faust_records_a_committed_zero_as_unknown(faust_consumer: Any) -> None:
    c, tp = faust_consumer, TP("t", 0)

    async def committed() -> dict[TP, int]:
        return {tp: 0}

    c.seek_to_committed = committed  # what aiokafka answers for a partition committed at 0
    await faust_consumer_base.Consumer.perform_seek(c)
    assert c._committed_offset[tp] is None, (
        f"{FAUST} now records a committed 0 in Consumer.perform_seek: GuardedConsumer.perform_seek's "
        "seek to the log start for 'no commit' may need re-checking")


async def test_faust_ack_books_a_message_once_and_forgets_it_as_in_flight(
    faust_consumer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    c, tp = faust_consumer, TP("t", 0)
    monkeypatch.setattr(c.app.topics, "acks_enabled_for", lambda topic: True)  # what a subscribed topic says

    class Message:
        def __init__(self) -> None:
            self.tp, self.topic, self.offset, self.acked = tp, tp.topic, 7, False

    message = Message()
    c._unacked_messages.add(message)
    assert faust_aiokafka.Consumer.ack(c, message) is True
    assert message.acked and c._acked[tp] == [7] and message not in c._unacked_messages, (
        f"{FAUST} changed Consumer.ack's bookkeeping (message.acked, _acked, _unacked_messages): "
        "GuardedConsumer.ack / unprocessed rely on it")
    assert faust_aiokafka.Consumer.ack(c, message) is False


def test_the_stream_rules_the_aggregation_batches_keep_are_still_faust_s() -> None:
    # pipeline/aggregate/stream_batches.py takes the agent's events from its channel's queue without a
    # stream, and applies per event what Faust's stream does: an event of an older consumer generation or
    # taken while the flow is suspended is skipped and acknowledged; an event of an acking topic is tracked
    # once as in flight (what a rebalance waits for); an event is acknowledged through ``Event.ack``.
    source = inspect.getsource(Stream._py_aiter)
    for rule in ("not self.app.flow_control.is_active()",
                 "message.generation_id != self.app.consumer_generation_id",
                 "if topic in acking_topics and not message.tracked:",
                 "add_unacked(message)",
                 "event.ack()"):
        assert rule in source, (
            f"{FAUST} changed how a stream skips, tracks or acknowledges an event ({rule!r} is gone from "
            "Stream._py_aiter): re-check ChannelBatches in pipeline/aggregate/stream_batches.py")
    track = inspect.getsource(faust_consumer_base.Consumer.track_message)
    assert "self._unacked_messages.add(message)" in track, (
        f"{FAUST} changed Consumer.track_message: ChannelBatches tracks its events with it")


# ---------------------------------------------------------------------------------------------------------
# aiokafka's record iterator, where upstream.locate_undecodable finds a bad batch.


def test_the_record_iterator_holds_the_partition_and_the_batch_in_its_frame() -> None:
    fn = getattr(PartitionRecords, upstream._RECORD_ITERATOR, None)
    assert fn is not None, (
        f"{AIOKAFKA} renamed PartitionRecords._unpack_records: upstream.locate_undecodable finds nothing")
    local_names = fn.__code__.co_varnames
    assert {"tp", "next_batch"} <= set(local_names), (
        f"{AIOKAFKA}: PartitionRecords._unpack_records' locals are {local_names}, upstream.locate_undecodable reads "
        "'tp' and 'next_batch' (tests/unit/test_undecodable.py checks it on real batches)")
    for attr in ("base_offset", "last_offset_delta"):
        assert hasattr(DefaultRecordBatch, attr), (
            f"{AIOKAFKA}: record batches lost .{attr} (upstream.locate_undecodable)")


def test_fetched_records_drains_into_a_local_dict_and_moves_positions_as_it_goes() -> None:
    # The loss upstream.drained_before undoes: getall advances each partition's position while
    # fetched_records collects the records in its local ``drained``, which a decode failure of a later
    # partition drops (tests/integration/test_undecodable_neighbours.py shows it on a real broker).
    fn = getattr(Fetcher, upstream._FETCHER_DRAIN, None)
    assert fn is not None, f"{AIOKAFKA} renamed Fetcher.fetched_records: upstream.drained_before finds nothing"
    assert upstream._DRAINED in fn.__code__.co_varnames, (
        f"{AIOKAFKA}: Fetcher.fetched_records' locals are {fn.__code__.co_varnames}, upstream.drained_before "
        f"reads {upstream._DRAINED!r}: re-check how it hands out records before a decode failure")
    getall = inspect.getsource(FetchResult.getall)
    assert "self._update_position()" in getall, (
        f"{AIOKAFKA} changed when FetchResult.getall moves the position: re-check upstream.drained_before "
        "(records it hands out may now be fetched again, or lost some other way)")


# ---------------------------------------------------------------------------------------------------------
# aiokafka against the real broker.


async def _topic(bootstrap: str, name: str, records: int = 0) -> TopicPartition:
    await ensure_topics(bootstrap, [name], partitions=1)
    if records:
        producer = kafka_clients.producer(bootstrap)
        await producer.start()
        try:
            for i in range(records):
                await producer.send_and_wait(name, f"r{i}".encode(), key=b"k")
        finally:
            await producer.stop()
    return TopicPartition(name, 0)


@asynccontextmanager
async def _started(
    bootstrap: str, group: str, prepare: Callable[[AIOKafkaConsumer], None] = lambda c: None, **kwargs: Any
) -> AsyncIterator[AIOKafkaConsumer]:
    """A started group consumer (committing only by hand); ``prepare`` runs on it before the start."""
    consumer = kafka_clients.consumer(bootstrap=bootstrap, group_id=group, enable_auto_commit=False, **kwargs)
    prepare(consumer)
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop()


async def test_seek_to_committed_leaves_a_partition_committed_at_zero_or_not_at_all_where_it_is(
    kafka_bootstrap: str, unique: Callable[[str], str]
) -> None:
    tp = await _topic(kafka_bootstrap, unique("seek"), records=5)
    async with _started(kafka_bootstrap, unique("g")) as consumer:
        consumer.assign([tp])
        await consumer.seek_to_end(tp)
        assert await consumer.position(tp) == 5
        assert await consumer.seek_to_committed(tp) == {tp: None}
        assert await consumer.position(tp) == 5, (
            f"{AIOKAFKA} now seeks a partition without a commit in seek_to_committed: "
            "GuardedConsumer.perform_seek's own seek to the log start may be redundant")
        await consumer.commit({tp: 0})
        await consumer.seek_to_committed(tp)
        assert await consumer.position(tp) == 5, (
            f"{AIOKAFKA} now seeks a partition committed at 0 in seek_to_committed: "
            "GuardedConsumer.perform_seek's own seek may be redundant")
        await consumer.commit({tp: 2})
        await consumer.seek_to_committed(tp)
        assert await consumer.position(tp) == 2


async def test_the_fetch_wait_set_before_start_reaches_the_fetcher(
    kafka_bootstrap: str, unique: Callable[[str], str]
) -> None:
    def patch(consumer: AIOKafkaConsumer) -> None:
        consumer._fetch_max_wait_ms = 50  # what upstream._ConsumerThread does to Faust's consumer

    async with _started(kafka_bootstrap, unique("g"), patch, fetch_max_wait_ms=1500) as consumer:
        assert consumer._fetcher._fetch_max_wait_ms == 50, (
            f"{AIOKAFKA} no longer builds its fetcher from AIOKafkaConsumer._fetch_max_wait_ms at start: "
            "upstream._ConsumerThread's fetch wait has no effect")


async def test_the_subscription_state_gives_the_fetch_position(
    kafka_bootstrap: str, unique: Callable[[str], str]
) -> None:
    tp = await _topic(kafka_bootstrap, unique("pos"), records=3)
    async with _started(kafka_bootstrap, unique("g")) as consumer:
        consumer.assign([tp])
        consumer.seek(tp, 2)
        # The fetch watchdog's read (fetch_watchdog.install): position without a round trip.
        position = consumer._subscription.subscription.assignment.state_value(tp).position
        assert position == 2 == await consumer.position(tp), (
            f"{AIOKAFKA} changed AIOKafkaConsumer._subscription.subscription.assignment.state_value(tp)"
            ".position: the fetch watchdog stands down (it catches the error) and stalls go unhealed")


async def test_force_metadata_update_makes_a_new_topic_known(
    kafka_bootstrap: str, unique: Callable[[str], str]
) -> None:
    async with _started(kafka_bootstrap, unique("g")) as consumer:
        topic = (await _topic(kafka_bootstrap, unique("md"))).topic
        updated = consumer._client.force_metadata_update()
        assert inspect.isawaitable(updated), f"{AIOKAFKA}: _client.force_metadata_update() is no longer awaitable"
        assert await updated is True
        assert consumer.partitions_for_topic(topic) == {0}, (
            f"{AIOKAFKA}: _client.force_metadata_update() no longer refreshes the consumer's metadata "
            "(loki_tail, commands/replay, actuator/testing)")


async def _static_member(bootstrap: str, group: str, topic: str, instance: str) -> AIOKafkaConsumer:
    consumer = kafka_clients.consumer(topic, bootstrap=bootstrap, group_id=group, group_instance_id=instance,
                                      session_timeout_ms=30_000, enable_auto_commit=False)
    await consumer.start()
    for _ in range(120):
        if consumer.assignment():
            return consumer
        await consumer.getmany(timeout_ms=500)
    await consumer.stop()
    raise AssertionError(f"{instance} never joined {group}")


async def _members(bootstrap: str, group: str) -> list[str | None]:
    view = await group_membership.describe_group(bootstrap, group)  # _send_request + DescribeGroups v4
    return [m.instance_id for m in view.members]


async def test_a_static_member_leaves_only_when_its_group_instance_id_is_cleared(
    kafka_bootstrap: str, unique: Callable[[str], str]
) -> None:
    topic = (await _topic(kafka_bootstrap, unique("static"))).topic
    kept, left = unique("kept"), unique("left")

    consumer = await _static_member(kafka_bootstrap, kept, topic, "pod-a")
    assert consumer._coordinator._group_instance_id == "pod-a", (
        f"{AIOKAFKA} moved the coordinator's _group_instance_id: group_membership.leave_on_close does nothing")
    await consumer.stop()
    assert await _members(kafka_bootstrap, kept) == ["pod-a"], (
        f"{AIOKAFKA} now sends LeaveGroup for a static member on close: group_membership.leave_on_close may be "
        "redundant, and a crash-restart (which should keep the membership) needs re-checking")

    consumer = await _static_member(kafka_bootstrap, left, topic, "pod-b")
    assert await _members(kafka_bootstrap, left) == ["pod-b"]  # DescribeGroups v4 names the instance
    group_membership.leave_on_close(consumer)
    await consumer.stop()
    for _ in range(50):  # the LeaveGroup is sent while the consumer stops; the broker applies it at once
        if await _members(kafka_bootstrap, left) == []:
            break
        await asyncio.sleep(0.1)
    assert await _members(kafka_bootstrap, left) == [], (
        f"{AIOKAFKA}: clearing the coordinator's _group_instance_id no longer makes close() send LeaveGroup "
        "(group_membership.leave_on_close; an orderly worker stop keeps its partitions until the session expires)")


# ---------------------------------------------------------------------------------------------------------
# The parse stage's bare records (upstream.deliver_bare_records) against the real broker.


async def _read_all(bootstrap: str, tp: TopicPartition, group: str, bare: bool, isolation: str) -> tuple[list, int]:
    async with _started(bootstrap, group, isolation_level=isolation, auto_offset_reset="earliest") as consumer:
        if bare:
            upstream.deliver_bare_records(consumer)
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        got: list[Any] = []
        while await consumer.position(tp) < end:
            got += (await consumer.getmany(tp, timeout_ms=500, max_records=3)).get(tp, [])
        return got, await consumer.position(tp)


@pytest.mark.parametrize("isolation", ["read_uncommitted", "read_committed"])
async def test_bare_records_from_the_broker_are_a_plain_consumers_records_without_the_record_object(
    kafka_bootstrap: str, unique: Callable[[str], str], isolation: str
) -> None:
    # Compressed batches with headers, an aborted and a committed transaction (their markers are control
    # records): the stage's consumer must see what a plain one sees, and stop at the same position.
    tp = await _topic(kafka_bootstrap, unique("bare"))
    plain = kafka_clients.producer(kafka_bootstrap, compression_type="gzip", linger_ms=5)
    txn = kafka_clients.producer(kafka_bootstrap, transactional_id=unique("txn"))
    await plain.start()
    await txn.start()
    try:
        sent = [await plain.send(tp.topic, b"plain %d" % i, key=b"node", partition=0,
                                 headers=[("xidflow-node", b"n1")]) for i in range(5)]
        await asyncio.gather(*sent)
        for outcome in ("aborted", "committed"):
            await txn.begin_transaction()
            for i in range(2):
                await txn.send_and_wait(tp.topic, f"{outcome} {i}".encode(), partition=0)
            await (txn.abort_transaction() if outcome == "aborted" else txn.commit_transaction())
        await plain.send_and_wait(tp.topic, b"after", partition=0)
    finally:
        await txn.stop()
        await plain.stop()
    full, full_end = await _read_all(kafka_bootstrap, tp, unique("g"), bare=False, isolation=isolation)
    bare, bare_end = await _read_all(kafka_bootstrap, tp, unique("g"), bare=True, isolation=isolation)
    facts = [(r.offset, r.timestamp, r.key, r.value, list(r.headers)) for r in full]
    assert [(r.offset, r.timestamp, r.key, r.value, list(r.headers)) for r in bare] == facts
    assert not [r for r in bare if isinstance(r, ConsumerRecord)], (
        f"{AIOKAFKA}: the consumer still hands out ConsumerRecords after upstream.deliver_bare_records")
    assert bare_end == full_end
    values = [r.value for r in bare]
    assert (b"aborted 0" in values) is (isolation == "read_uncommitted") and b"committed 1" in values
    assert values[-1] == b"after" and len(values) == (10 if isolation == "read_uncommitted" else 8)
