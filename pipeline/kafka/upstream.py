"""The one seam to Faust's and aiokafka's private internals: every private name xidflow touches is here.

The exactly-once guarantees of the aggregation (``pipeline.kafka.fetch_watchdog``), the handling of record
batches nobody can decode (``pipeline.kafka.undecodable``) and static-member group handling
(``pipeline.kafka.membership``) lean on
behaviour that faust-streaming and aiokafka do not publish. Everywhere else in xidflow calls the
names below, never a private attribute of theirs, so an upstream change meets one module.

Why it is safe to lean on them at all:

- the versions are pinned to the tested minor releases (``pyproject.toml``) and installed from the
  hashed ``requirements.lock``; ``docs/dependencies.md`` says how to upgrade;
- ``tests/integration/test_upstream_internals.py`` checks every name and behaviour used here (method
  signatures, that Faust still calls each hook, the defects the fetch watchdog closes, aiokafka's
  behaviour against a real broker) and names the upstream change when one fails.

What is used, by whom:

- Faust's aiokafka ``Consumer``: the hooks ``_getmany``, ``_add_gap``, ``_new_offset`` and
  ``_new_consumer_thread`` (overridden by ``FaustConsumer`` and handed on under public names), its
  bookkeeping ``_committed_offset``, ``_acked``, ``_read_offset``, ``_unacked_messages``,
  ``_paused_partitions`` and ``_thread``; its consumer thread's ``_create_worker_consumer``.
- aiokafka's consumer: ``_fetch_max_wait_ms`` (Faust hard-codes 1,500 ms), ``_subscription`` (fetch
  positions), ``_client.force_metadata_update``, ``_coordinator._group_instance_id`` (leaving a
  group as a static member); the admin client's ``_send_request`` and the protocol classes of
  ``aiokafka.protocol`` and ``aiokafka.coordinator.protocol`` (DescribeGroups v4, which aiokafka's
  admin does not offer); the frame of ``PartitionRecords._unpack_records`` (where a batch that
  cannot be decoded is) and of ``Fetcher.fetched_records`` (the records ``getmany`` had already taken
  out of the fetcher, positions advanced, when that batch raised); the consumer's ``_fetcher``, its
  buffer ``Fetcher._records``, ``FetchResult._partition_records`` and ``PartitionRecords._consumer_record``
  (``deliver_bare_records``: the parse stage reads aiokafka's decoded records without a
  ``ConsumerRecord`` built per record).
- aiokafka's fetcher: ``_get_actions_per_node`` (where it plans each fetch, reading ``_fetch_max_wait_ms``
  and ``_records`` each time; ``long_poll_when_idle``, ``tests/unit/test_idle_fetch.py``).
- Faust's consumer delivers each record as ``wait_first(callback(message), suspend_flow.wait())``
  (``Consumer._drain_messages``); ``FaustConsumer.wait_first`` (mode's public method) runs such a
  callback's first step inline instead of in four tasks (``tests/unit/test_drain_delivery.py``).
- Faust's ``TableManager``: ``on_start`` without its one-second sleep, calling ``_update_channels``.
- Faust's aiokafka ``Producer._ensure_producer`` (``faust_producer_client``): the aiokafka producer the
  aggregation hands its record batches to (``create_batch``/``send_batch``, public in aiokafka).
"""

from __future__ import annotations

import collections
import functools
import inspect
import sys
import types
from collections.abc import Callable, Generator, Sequence
from types import TracebackType
from typing import Any, Protocol

from aiokafka.consumer.fetcher import Fetcher, FetchResult
from aiokafka.coordinator.protocol import ConsumerProtocolMemberAssignment
from aiokafka.errors import UnsupportedCodecError
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Boolean, Bytes, Int16, Int32, Schema, String

from pipeline.kafka.undecodable import Failure, Reason

AIOKAFKA_FETCH_MAX_WAIT_MS = 500
"""aiokafka's default fetch wait, what a ``FaustConsumer`` keeps unless a subclass sets another."""


# -- Faust's import of aiohttp -------------------------------------------------------------------


class _NoHttpClient:
    """What ``faust.types.web.HttpClientT`` names in a worker: only annotations read it (``import_faust_types``)."""


def import_faust_types() -> None:
    """Import Faust's type modules without aiohttp, which the worker never uses (its web server is off).

    ``faust.types.web`` imports ``aiohttp.client`` only to name its ``ClientSession`` as a type alias, and
    every Faust app imports that module: aiohttp's import (its SSL contexts load the system's CA store)
    was ~0.13 s of CPU, a sixth of a restarted worker's imports before it can fork its child (issue 22,
    ``failover_worker_process``). The alias is bound to a stand-in class while ``faust.types.web`` is
    imported, and the stand-in is removed at once, so a later ``import aiohttp`` in this process (the
    actuator's Kubernetes client, Faust's own ``app.http_client``, which resolves the setting
    ``HttpClient`` = ``"aiohttp.client:ClientSession"`` by name) imports the real one. Nothing when either
    module is already imported. ``tests/unit/test_faust_types_import.py`` checks both.
    """
    if "faust.types.web" in sys.modules or "aiohttp.client" in sys.modules:
        return
    stand_in = types.ModuleType("aiohttp.client", "xidflow's stand-in while faust.types.web is imported")
    stand_in.ClientSession = _NoHttpClient  # type: ignore[attr-defined]
    sys.modules["aiohttp.client"] = stand_in
    try:
        import faust.types.web  # noqa: F401
    finally:
        if sys.modules.get("aiohttp.client") is stand_in:
            del sys.modules["aiohttp.client"]


def aiohttp_session(*args: Any, **kwargs: Any) -> Any:
    """Faust's ``HttpClient`` setting for the worker: an aiohttp ``ClientSession``, aiohttp imported on the call.

    Faust resolves the default (``"aiohttp.client:ClientSession"``) by importing it when the app is built,
    which would undo ``import_faust_types``; ``app.http_client`` still gets the real session.
    """
    from aiohttp.client import ClientSession

    return ClientSession(*args, **kwargs)


# -- Faust's consumer ----------------------------------------------------------------------------


_FAUST_CLASSES = frozenset({"_ConsumerThread", "FaustConsumer", "PromptTableManager"})


def __getattr__(name: str) -> Any:
    """The Faust subclasses, defined at their first use: the actuator uses only this module's aiokafka
    seams, and importing Faust for them cost every actuator start ~0.16 s of CPU, on the critical path
    of a restarted process (issue 22)."""
    if name in _FAUST_CLASSES:
        return _faust_classes()[name]
    if name == "faust_aiokafka":  # Faust's aiokafka driver module, as it was imported here (tests patch it)
        from faust.transport.drivers import aiokafka as faust_aiokafka

        return faust_aiokafka
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _faust_classes() -> dict[str, type]:
    from faust.tables.manager import TableManager
    from faust.transport.drivers import aiokafka as faust_aiokafka
    from mode.services import WaitResults

    class _ConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
        """Faust's consumer thread, with the fetch wait its consumer asks for (``FaustConsumer.fetch_max_wait_ms``)
        while records flow, and ``FaustConsumer.idle_fetch_max_wait_ms`` while none do (``long_poll_when_idle``)."""

        def _create_worker_consumer(self, transport: Any) -> Any:
            consumer = super()._create_worker_consumer(transport)
            consumer._fetch_max_wait_ms = getattr(self.consumer, "fetch_max_wait_ms", AIOKAFKA_FETCH_MAX_WAIT_MS)
            return consumer

        async def on_start(self) -> None:
            await super().on_start()
            idle_ms = getattr(self.consumer, "idle_fetch_max_wait_ms", None)
            if idle_ms is not None:
                long_poll_when_idle(self._consumer, idle_ms)


    class FaustConsumer(faust_aiokafka.Consumer):
        """Faust's aiokafka consumer with its private hooks and bookkeeping under names of ours.

        A subclass overrides ``fetch_records``, ``keeps_gap`` and ``offset_to_commit`` (calling
        ``super()`` for Faust's behaviour) and reads Faust's view of each partition through the readers.
        """

        fetch_max_wait_ms: int = AIOKAFKA_FETCH_MAX_WAIT_MS
        idle_fetch_max_wait_ms: int | None = None  # None: fetch_max_wait_ms always

        def _new_consumer_thread(self) -> Any:
            return _ConsumerThread(self, loop=self.loop, beacon=self.beacon)

        async def wait_first(self, *coros: Any, timeout: Any = None) -> Any:  # noqa: ASYNC109 - mode's signature
            """mode's ``wait_first``, without its four tasks when the first coroutine finishes at once.

            Faust's consumer delivers every fetched record as ``wait_first(callback(message),
            suspend_flow.wait())`` (``Consumer._drain_messages``): a task for the callback, one for each of
            the flow's, the service's stopped and crashed events, and ``asyncio.wait``: two loop turns and
            four tasks per record, where the callback (the conductor putting the event on the agent's
            queue) almost always finishes without waiting. In a burst that made the records trickle onto
            the queue in between everything else the loop ran, so the agent took them a few at a time.

            Here the callback's first step runs inline. Finished: the answer is the one ``wait_first``
            would give (the callback among the winners; the other awaitables, not started, are closed).
            Raised: raised, as ``wait_first`` does. Waiting (flow control suspended, a full queue, the
            producer buffer): the rest of it goes to mode's ``wait_first`` with the same other awaitables,
            so a rebalance (``suspend_flow``) or a stop still ends the wait as before. Any other call
            (a timeout, a first argument that is not a coroutine, a stopped or crashed service) is mode's.
            """
            first = coros[0] if coros else None
            if timeout is not None or not inspect.iscoroutine(first) or self.should_stop or self.crashed:
                return await super().wait_first(*coros, timeout=timeout)
            rest = coros[1:]
            try:
                yielded = first.send(None)
            except StopIteration as done:
                _close(rest)
                return WaitResults([first], [done.value], False)
            except BaseException:
                _close(rest)
                raise
            resumed = _resume(first, yielded)
            results = await super().wait_first(resumed, *rest)
            return WaitResults([first if c is resumed else c for c in results.done], results.results, results.stopped)


        async def _getmany(self, active_partitions: Any, timeout: float) -> Any:  # noqa: ASYNC109 - Faust's signature
            return await self.fetch_records(active_partitions, timeout)

        async def fetch_records(self, active_partitions: Any, timeout: float) -> Any:  # noqa: ASYNC109
            """One fetch of the partitions in ``active_partitions`` (None: all): {tp: [records]}."""
            return await super()._getmany(active_partitions, timeout)

        async def _add_gap(self, tp: Any, offset_from: int, offset_to: int) -> None:
            if self.keeps_gap(tp):
                await super()._add_gap(tp, offset_from, offset_to)

        def keeps_gap(self, tp: Any) -> bool:
            """Whether a jump in delivery on ``tp`` is booked as a gap Faust may commit past (Faust: always)."""
            return True

        def _new_offset(self, tp: Any) -> int | None:
            return self.offset_to_commit(tp)

        def offset_to_commit(self, tp: Any) -> int | None:
            """The offset Faust would commit for ``tp`` now (the first run of consecutive acknowledged offsets)."""
            return super()._new_offset(tp)

        # Faust's bookkeeping, read-only unless said otherwise.
        def committed_offset(self, tp: Any) -> int | None:
            return committed_offset(self, tp)

        def acked_offsets(self, tp: Any) -> list[int] | None:
            """Offsets acknowledged and not yet committed (Faust's ``_acked``)."""
            return self._acked.get(tp)

        def read_offset(self, tp: Any) -> int | None:
            return read_offset(self, tp)

        def in_flight_partitions(self) -> set[Any]:
            """Partitions with a message delivered to an agent and not yet acknowledged."""
            return {m.tp for m in self._unacked_messages}

        def forget_unacked(self, message: Any) -> None:
            """Drop ``message`` from Faust's unacknowledged set (it will be read again instead)."""
            self._unacked_messages.discard(message)

        def paused_by_faust(self, tp: Any) -> bool:
            return tp in self._paused_partitions

        def fetch_positions(self) -> tuple[set[Any], Callable[[Any], int]]:
            """(partitions aiokafka has paused, tp -> aiokafka's fetch position); raises if the consumer is gone."""
            inner = self._thread._ensure_consumer()
            state = inner._subscription.subscription.assignment
            return set(inner.paused()), lambda tp: state.state_value(tp).position

    class PromptTableManager(TableManager):
        """Faust's table manager without the one-second sleep it takes before subscribing.

        Faust sleeps a second at start so that tables defined late (by modules imported while the worker
        starts) are registered before it subscribes. xidflow adds its one table in ``create_app``, before
        the app starts (a later one is refused by Faust anyway), so the sleep only delayed every worker
        start, and a replacement child's rejoin (``pipeline.runtime.supervisor``), by a second.
        """

        async def on_start(self) -> None:
            if not self.should_stop:
                await self._update_channels()
                await self.recovery.start()

    # Their qualified names keep the function's prefix: mode's services key their tasks by the name the
    # class had when it was made.
    return {"_ConsumerThread": _ConsumerThread, "FaustConsumer": FaustConsumer,
            "PromptTableManager": PromptTableManager}


def _close(awaitables: Sequence[Any]) -> None:
    """Close the coroutines among ``awaitables`` that will never be awaited (no "never awaited" warning)."""
    for awaitable in awaitables:
        if inspect.iscoroutine(awaitable):
            awaitable.close()


async def _resume(coro: Any, yielded: Any) -> Any:
    """Await the rest of ``coro``, whose first step already ran and yielded ``yielded``."""
    return await _continue(coro, yielded)


@types.coroutine
def _continue(coro: Any, yielded: Any) -> Generator[Any, Any, Any]:
    # What ``await coro`` does after its first step: hand each yielded future to the task driving
    # us, send back what it sends (None once the future is done) and throw in what it throws
    # (cancellation), until ``coro`` returns.
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # noqa: BLE001 - every throw belongs to ``coro``
            try:
                yielded = coro.throw(exc)
            except StopIteration as done:
                return done.value
            continue
        try:
            yielded = coro.send(sent)
        except StopIteration as done:
            return done.value

def read_offset(consumer
: Any, tp: Any) -> int | None:
    """The last offset of ``tp`` a Faust consumer delivered to its agents (None: none yet)."""
    return consumer._read_offset.get(tp)


def committed_offset(consumer: Any, tp: Any) -> int | None:
    """The offset a Faust consumer last committed for ``tp`` (None: none, or 0; Faust records 0 as None)."""
    return consumer._committed_offset.get(tp)


def faust_producer_client(app: Any) -> Any:
    """The started ``AIOKafkaProducer`` behind a Faust app's producer (the aggregation hands it record
    batches, ``pipeline.kafka.record_batches``: Faust's own ``send`` is per record)."""
    return app.producer._ensure_producer()


def faust_aiokafka_consumer(app: Any) -> Any:
    """The aiokafka consumer behind a started Faust app's consumer (None before it started)."""
    thread = getattr(getattr(app, "_consumer", None), "_thread", None)
    return getattr(thread, "_consumer", None)


# -- aiokafka's clients --------------------------------------------------------------------------


async def refresh_metadata(consumer: Any) -> None:
    """Make ``consumer`` fetch cluster metadata now (a topic created meanwhile becomes assignable)."""
    await consumer._client.force_metadata_update()


def drop_static_identity(consumer: Any) -> tuple[str, str] | None:
    """Make ``consumer.stop()`` send LeaveGroup although it is a static member: (group, identity dropped).

    aiokafka's coordinator skips the LeaveGroup only while it has a group instance id; the id is no
    longer needed once the consumer is closing (it was used to join). None: not a static member of a
    group (nothing changed).
    """
    coordinator: Any = getattr(consumer, "_coordinator", None)
    instance_id = getattr(coordinator, "_group_instance_id", None)
    if coordinator is None or instance_id is None:
        return None
    coordinator._group_instance_id = None
    return str(coordinator.group_id), str(instance_id)


class _DescribeGroupsResponseV4(Response):
    API_KEY = 15
    API_VERSION = 4
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "groups",
            Array(
                ("error_code", Int16),
                ("group", String("utf-8")),
                ("state", String("utf-8")),
                ("protocol_type", String("utf-8")),
                ("protocol", String("utf-8")),
                (
                    "members",
                    Array(
                        ("member_id", String("utf-8")),
                        ("group_instance_id", String("utf-8")),
                        ("client_id", String("utf-8")),
                        ("client_host", String("utf-8")),
                        ("member_metadata", Bytes),
                        ("member_assignment", Bytes),
                    ),
                ),
                ("authorized_operations", Int32),
            ),
        ),
    )


class _DescribeGroupsRequestV4(RequestStruct):
    API_KEY = 15
    API_VERSION = 4
    RESPONSE_TYPE = _DescribeGroupsResponseV4
    SCHEMA = Schema(("groups", Array(String("utf-8"))), ("include_authorized_operations", Boolean))


class _DescribeGroups(Request[_DescribeGroupsRequestV4]):
    """aiokafka describes groups up to v3, which lacks the members' group.instance.id (added in v4)."""

    API_KEY = 15

    def __init__(self, groups: list[str]) -> None:
        self._groups = groups

    def build(self, request_struct_class: type[_DescribeGroupsRequestV4]) -> _DescribeGroupsRequestV4:
        return request_struct_class(self._groups, False)


async def describe_groups(admin: Any, group: str, node: int) -> list[Any]:
    """DescribeGroups v4 (with each member's group.instance.id) sent to ``node``: the answer's groups.

    Each is (error_code, name, state, protocol_type, protocol, members, authorized_operations), a
    member (member_id, group_instance_id, client_id, client_host, metadata, assignment bytes).
    """
    response = await admin._send_request(_DescribeGroups([group]), node)
    return list(response.groups)


def assigned_partitions(assignment: bytes | None) -> tuple[tuple[str, int], ...]:
    """The (topic, partition) pairs of a consumer-protocol member assignment, sorted."""
    if not assignment:
        return ()
    decoded = ConsumerProtocolMemberAssignment.decode(assignment)
    return tuple(sorted((t, p) for t, parts in decoded.assignment for p in parts))


# -- a batch that cannot be decoded --------------------------------------------------------------

_RECORD_ITERATOR = "_unpack_records"  # aiokafka.consumer.fetcher.PartitionRecords._unpack_records
_FETCHER_DRAIN = "fetched_records"  # aiokafka.consumer.fetcher.Fetcher.fetched_records
_DRAINED = "drained"  # its dict of the records taken out so far: {tp: [records]}


def locate_undecodable(exc: BaseException) -> Failure | None:
    """The batch behind a decode failure raised by ``getmany``, or None when ``exc`` is not one.

    A decode failure is an exception raised while aiokafka's record iterator unpacked a batch; its
    frame holds the partition (``tp``) and the batch (``next_batch``).
    """
    tb: TracebackType | None = exc.__traceback__
    frame_locals: dict[str, Any] | None = None
    while tb is not None:
        if tb.tb_frame.f_code.co_name == _RECORD_ITERATOR:
            frame_locals = tb.tb_frame.f_locals
        tb = tb.tb_next
    if frame_locals is None:
        return None
    tp, batch = frame_locals.get("tp"), frame_locals.get("next_batch")
    if tp is None or batch is None:
        return None
    try:
        first = int(batch.base_offset)
    except (AttributeError, TypeError, ValueError):
        return None
    try:
        last: int | None = first + int(batch.last_offset_delta)
    except (AttributeError, TypeError, ValueError):
        last = None
    reason = Reason.UNSUPPORTED_CODEC if isinstance(exc, UnsupportedCodecError) else Reason.CORRUPT
    text = str(exc)  # aiokafka's errors start with their class name already
    error = text if type(exc).__name__ in text else f"{type(exc).__name__}: {text}"
    return Failure(tp.topic, tp.partition, first, last, reason, error)



def drained_before(exc: BaseException) -> dict[Any, list[Any]]:
    """The records ``getmany`` had already handed itself when a batch of another partition failed to decode.

    aiokafka's ``Fetcher.fetched_records`` takes the fetched partitions one after the other into a local
    dict and advances each one's fetch position as it goes (``FetchResult.getall``). A decode failure
    of a later partition leaves that dict behind with the exception: the records in it are handed to
    nobody, their positions are past them, and a consumer that goes on never reads them (a stage would
    commit past them). They are the exception's to hand out: the caller processes them like a
    ``getmany`` answer. Empty when nothing was taken before the failure, or ``exc`` is no such failure.
    """
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name == _FETCHER_DRAIN and isinstance(frame.f_locals.get("self"), Fetcher):
            drained = frame.f_locals.get(_DRAINED)
            return {tp: list(records) for tp, records in drained.items() if records} if drained else {}
        tb = tb.tb_next
    return {}


# -- records without a ConsumerRecord each -------------------------------------------------------


class BareRecord(Protocol):
    """A record as aiokafka decoded it from its batch (``DefaultRecord``, ``LegacyRecord``): no topic, no partition.

    ``getmany`` keys each list of them by its ``TopicPartition``; the offset is the record's own.
    """

    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes | None]]


# ``PartitionRecords._unpack_records`` turns each decoded record into a ConsumerRecord by calling
# ``self._consumer_record(tp, record)``: an empty dict's ``get`` answers ``record`` for any ``tp`` and is a
# C call, where a Python ``lambda tp, record: record`` costs a frame per record (the very cost saved).
_AS_IS: Callable[[Any, Any], Any] = {}.get
_CONSUMER_RECORD = "_consumer_record"  # aiokafka.consumer.fetcher.PartitionRecords._consumer_record


class _BareFetchBuffer(collections.OrderedDict):  # type: ignore[type-arg]
    """``Fetcher._records`` (tp -> FetchResult or FetchError): each fetched partition stored in it hands out
    its records as decoded, not as ConsumerRecords.

    The fetcher stores a partition's fetch here (``_proc_fetch_request``) before anything drains it, so
    every record ``getmany`` returns went through the change; everything else (which batches are read,
    control batches and aborted transactions skipped, CRC checks, positions, errors) stays aiokafka's.
    """

    def __setitem__(self, tp: Any, result: Any) -> None:
        if type(result) is FetchResult:
            records = result._partition_records
            if records is not None:
                setattr(records, _CONSUMER_RECORD, _AS_IS)
        super().__setitem__(tp, result)


def deliver_bare_records(consumer: Any) -> None:
    """Make a started consumer's ``getmany`` hand out ``BareRecord``\\s instead of ``ConsumerRecord``\\s.

    aiokafka builds a ``ConsumerRecord`` (a Python dataclass of 11 fields, a tuple of the headers, two
    ``len``) for every record it hands out; the parse stage looks at the value of every record and at
    the rest only for the few it decodes. The
    consumer must have no key or value deserializer (they are applied in the step skipped). Call it
    after ``start()`` (the fetcher exists from then on) and before records are fetched.
    """
    fetcher = consumer._fetcher
    if fetcher is None:
        raise RuntimeError("deliver_bare_records: the consumer is not started")
    if fetcher._key_deserializer is not None or fetcher._value_deserializer is not None:
        raise ValueError("deliver_bare_records: a consumer with deserializers needs its ConsumerRecords")
    if type(fetcher._records) is _BareFetchBuffer:
        return
    buffer = _BareFetchBuffer()
    for tp, result in fetcher._records.items():
        buffer[tp] = result
    fetcher._records = buffer


# -- a fetch that waits long only when nothing can be held back by it ------------------------------


def fetch_covers_every_partition(buffered: Any, assignment: Any) -> bool:
    """Whether a fetch planned now asks for every assigned partition: none has records buffered, is
    paused or waits for its position. Pure (``buffered``: the fetcher's ``tp -> records`` buffer)."""
    if buffered:
        return False
    for tp in assignment.tps:
        state = assignment.state_value(tp)
        if state.paused or not state.has_valid_position:
            return False
    return True


def long_poll_when_idle(consumer: Any, idle_ms: int) -> None:
    """Make a started consumer's fetches wait ``idle_ms`` on the broker when they cover every partition.

    aiokafka keeps one fetch in flight per broker and leaves a partition whose records are still
    buffered out of it: a partition drained while a long poll waits is fetched again only when that
    poll returns, so a worker's consumers poll briefly (``fetch_max_wait_ms``, 50 ms). Idle, that short
    poll is 20 fetches a second per consumer, 50-90 ms of CPU per idle second on the 2-core bench
    node, taken from the actuators and the API server. A fetch that asks for every assigned partition
    holds nothing back: the broker answers it as soon as any of them has a record. Such a fetch waits
    ``idle_ms``; any other keeps the consumer's own wait. aiokafka reads the wait each time it plans
    its fetches (``Fetcher._get_actions_per_node``), which is wrapped here.
    """
    fetcher = consumer._fetcher
    if fetcher is None:
        raise RuntimeError("long_poll_when_idle: the consumer is not started")
    busy_ms = fetcher._fetch_max_wait_ms
    plan = fetcher._get_actions_per_node

    def plan_fetches(assignment: Any) -> Any:
        idle = fetch_covers_every_partition(fetcher._records, assignment)
        fetcher._fetch_max_wait_ms = idle_ms if idle else busy_ms
        return plan(assignment)

    fetcher._get_actions_per_node = plan_fetches
