"""The Faust application: topics, the node-state table, the parse service and the aggregation agent.

``declare_app`` declares one app per worker configuration (tests build several, each with its own app
id). It only declares: the agents (``agents/``) import this module, never the other way round, and
``agents.worker.create_app`` wires them onto a declared app.

Layout on Kafka (all keyed by node name):

- raw inputs (``TopicNames.raw_inputs``) -> parse service (``pipeline.detection.parse_stage``, aiokafka batch
  consumer in its own group ``<app_id>-parse``) -> ``fault_events`` and ``deadletter``.
- ``fault_events`` + ``<app_id>-ticks`` (internal, same partition count) -> aggregation agent,
  state in the ``node-state`` table (changelog ``<app_id>-node-state-changelog``) -> ``incidents``.

The table stores one ``NodeState`` per node (as ``NodeState.to_bytes()``) in the changelog partition
of the node's fault events (``NodeStateTable.write``), so a node's state and its events share a
partition number, and the aggregation agent can process batches of events from many nodes at once.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust
import mode
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.aggregate.copartition import NODE_STATE_TABLE, ticks_topic_name
from pipeline.aggregate.settings import AggregationSettings
from pipeline.detection.parse_settings import PRODUCER_BATCH_BYTES, ParseSettings
from pipeline.detection.parse_stage import ParseStage
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka import upstream
from pipeline.kafka.fetch_watchdog import FETCH_MAX_WAIT_MS
from pipeline.kafka.membership import faust_consumer, leave_on_close
from pipeline.kafka.partitioner import KeyPartitioner
from pipeline.runtime.settings import ConsumerGroupSettings, KafkaSettings, TopicNames
from pipeline.runtime.startmarks import mark

log = logging.getLogger("xidflow.app")


def worker_topics(app_id: str, topics: TopicNames) -> list[str]:
    """Topics a worker needs, fault events first (its partition count is the table's)."""
    return [
        topics.name("fault_events"),
        ticks_topic_name(app_id),
        *topics.raw_inputs,
        topics.name("incidents"),
        topics.name("fabric_signals"),
        topics.name("deadletter"),
    ]


class ChangelogProducer(mode.Service):
    """The node-state table's own Kafka producer, started and stopped with Faust's.

    Why not Faust's producer: aiokafka keeps one request in flight per broker and client, so the
    states of one batch (sent once its incidents are acknowledged) held back the incidents of the
    next batch for their whole round trip: two round trips per batch on the way to an incident in a
    burst. With its own client the changelog's request and the next incidents' travel side by side.
    Settings as Faust's producer's: acknowledged by all in-sync replicas, the worker's batch size.
    """

    def __init__(self, bootstrap: str, client_id: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._bootstrap = bootstrap
        self._client_id = client_id
        self.producer: Any = None  # an AIOKafkaProducer once started (it needs the running loop)

    async def on_start(self) -> None:
        self.producer = kafka_clients.producer(
            bootstrap=self._bootstrap,
            client_id=self._client_id,
            acks="all",
            max_batch_size=PRODUCER_BATCH_BYTES,
        )
        await self.producer.start()

    async def on_stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()  # sends what is pending first


class NodeStateTable(faust.Table):
    """The node-state table, written with an explicit changelog partition.

    Faust picks a table key's changelog partition from the *current* event, which is ambiguous when
    an agent processes a batch of events from several partitions; ``write`` names the partition of the
    events the state was computed from (the node's partition of the fault-event topic).
    """

    changelog_producer: ChangelogProducer | None = None
    """Where ``write`` sends the states (``declare_app`` sets it); without one, Faust's producer."""
    on_restored: Callable[[list[tuple[bytes, int]]], None] | None = None
    """Told the (key, partition) of the states the table took from its changelog (recovery), not from ``write``."""
    on_assigned: Callable[[set[Any]], None] | None = None
    """Told every partition (Faust ``TP``) this process is assigned after each rebalance: the state of any
    other partition left here is frozen (its new owner writes it), and must not be acted on."""

    def apply_changelog_batch(self, batch: Iterable[Any]) -> None:
        batch = list(batch)  # read twice: by the store, then for its keys
        super().apply_changelog_batch(batch)
        if self.on_restored is not None:
            # The keys are raw bytes (the table's raw codecs): what the store keeps them under, as they came.
            self.on_restored([(event.key, event.message.partition) for event in batch])

    async def on_rebalance(
        self, assigned: set[Any], revoked: set[Any], newly_assigned: set[Any], generation_id: int = 0
    ) -> None:
        # Faust's public hook, called with the whole new assignment before the restore of the new partitions.
        mark("assigned")
        await super().on_rebalance(assigned, revoked, newly_assigned, generation_id)
        if self.on_assigned is not None:
            self.on_assigned(set(assigned))

    async def on_recovery_completed(self, active_tps: set[Any], standby_tps: set[Any]) -> None:
        await super().on_recovery_completed(active_tps, standby_tps)
        mark("recovered")  # the table is restored: the agent may run (a restarted worker's start timeline)

    async def write(self, states: list[tuple[bytes, bytes, int]]) -> asyncio.Future[Any]:
        """Write node states (key, value, changelog partition): sent to the changelog, taken by the store.

        Returns the changelog's acknowledgement of them all (a future): the caller acknowledges its
        batch only once it is done, and reads the batch again if it failed; it need not wait for it
        before its next batch. The records go straight to a producer (``ChangelogProducer``). Faust's
        own way (``table[key] = value``) hands each one to Faust's producer buffer, which sends them
        one loop turn apiece, and waiting for that buffer took a loop turn and a timer per record
        (about 200-300 ms for 150 states in a burst); a changelog write that failed was not noticed
        either (the producer's ``flush`` does not raise).

        The store takes the states at once, so the next batch builds on them. A failed changelog write
        leaves the store ahead of the changelog, never behind the incidents (the caller writes states
        only after the broker has the batch's incidents): the batch read again is then a no-op by the
        states' positions, and writes the same states to the changelog again. The changelog holds what
        Faust would write: the raw key and value (the table's ``raw`` codecs), so recovery reads it as
        before.
        """
        topic = self.changelog_topic.get_topic_name()
        if self.changelog_producer is not None:
            own = self.changelog_producer.producer
            if own is None:
                # Never Faust's producer instead: two clients would not keep a partition's states in order.
                raise RuntimeError("the node-state changelog producer is not started")
            deliveries = [
                await own.send(topic, value=value, key=key, partition=partition) for key, value, partition in states
            ]
        else:
            producer = self.app.producer
            deliveries = [
                await producer.send(topic, key, value, partition=partition, timestamp=None, headers=None)
                for key, value, partition in states
            ]
        for key, value, _ in states:
            self.data[key] = value
        return asyncio.gather(*deliveries)


class WorkerSettings(BaseSettings):
    """How a worker runs (environment: ``XIDFLOW_WORKER_<FIELD>``)."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_WORKER_", extra="ignore")

    app_id: str = Field(
        default="xidflow",
        min_length=1,
        max_length=200,
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Default 'xidflow'. Faust app id = consumer group prefix (letters, digits, '.', '_', '-').",
    )
    partitions: int = Field(
        default=8,
        ge=1,
        le=10_000,
        description="Default 8. Partitions of topics the worker creates (existing ones are kept; 1 to 10000).",
    )
    replication_factor: int = Field(
        default=1, ge=1, le=32, description="Default 1. Replication of created topics (1 to 32)."
    )
    parse: bool = Field(default=True, description="Default true. Run the parse service in this worker.")
    aggregate: bool = Field(default=True, description="Default true. Run the aggregation agent in this worker.")
    tick_interval_s: float = Field(
        default=10.0, gt=0, le=3600.0, description="Default 10. How often quiet periods are checked."
    )
    aggregate_batch: int = Field(
        default=2000, ge=1, le=1_000_000, description="Default 2000. Fault events per aggregation batch."
    )
    aggregate_within_s: float = Field(
        default=0.01,
        gt=0,
        le=60.0,
        description="Default 0.01. How long an idle aggregation waits for more fault events before it takes "
        "a batch (events that arrive while it works on one form the next at once).",
    )
    fetch_max_wait_ms: int = Field(
        default=FETCH_MAX_WAIT_MS,
        ge=1,
        le=10_000,
        description="Default 50. How long a fetch of the aggregation's consumer waits on the broker for data "
        "(Faust's own: 1500). A partition drained while such a long poll is in flight waits for it: in a "
        "burst, for up to that long (1 to 10000).",
    )
    web_port: int | None = Field(
        default=None, ge=0, le=65535, description="Default none. Prometheus metrics port."
    )
    stall_after_s: float = Field(
        default=120.0,
        gt=0,
        le=86_400,
        description="Default 120. /healthz fails when the aggregation agent had fault events waiting and "
        "read none for this long, or its checks did not run for this long.",
    )

    @model_validator(mode="after")
    def _at_least_one_stage(self) -> WorkerSettings:
        if not (self.parse or self.aggregate):
            raise ValueError("parse and aggregate are both off: the worker would do nothing")
        return self


@dataclass
class XidflowApp:
    """The Faust app and the handles the agents and commands need."""

    app: faust.App
    settings: WorkerSettings
    topics: TopicNames
    aggregation: AggregationSettings
    parse: ParseSettings
    bootstrap: str
    fault_events: faust.TopicT
    ticks: faust.TopicT
    incidents: faust.TopicT
    deadletter: faust.TopicT
    node_state: NodeStateTable
    group: ConsumerGroupSettings = field(default_factory=ConsumerGroupSettings)


def declare_app(
    bootstrap: str | None = None,
    settings: WorkerSettings | None = None,
    topics: TopicNames | None = None,
    aggregation: AggregationSettings | None = None,
    parse: ParseSettings | None = None,
    group: ConsumerGroupSettings | None = None,
) -> XidflowApp:
    """Declare the app: its topics, the node-state table and leaving the group on shutdown; no agent yet.

    ``agents.worker.create_app`` wires the stages onto it.
    """
    bootstrap = bootstrap or KafkaSettings().bootstrap_servers
    settings = settings or WorkerSettings()
    topics = topics or TopicNames()
    aggregation = aggregation or AggregationSettings()
    parse = parse or ParseSettings()
    group = group or ConsumerGroupSettings()
    brokers = [f"kafka://{hp.strip()}" for hp in bootstrap.split(",") if hp.strip()]
    app = faust.App(
        settings.app_id,
        broker=brokers,
        store="memory://",
        # Faust creates ``<datadir>/v1/tables`` at start even for the memory store; its default is
        # relative to the working directory (a checkout, or a read-only image root). Nothing is kept
        # there, so the system's temporary directory does (the chart mounts /tmp).
        datadir=Path(tempfile.gettempdir()) / f"xidflow-worker-{settings.app_id}",
        topic_partitions=settings.partitions,
        topic_replication_factor=settings.replication_factor,
        table_standby_replicas=0,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        # Incidents and changelog records: a full 16 KiB batch made the agent wait for acknowledgements
        # one round trip at a time in a burst (``pipeline.detection.parse_settings.PRODUCER_BATCH_BYTES``).
        producer_max_batch_size=PRODUCER_BATCH_BYTES,
        # Kafka's default partitioning, each node name hashed once (incidents and fabric signals).
        producer_partitioner=KeyPartitioner(),
        # Both groups of the worker (Faust's and the parse stage's) use the same membership settings.
        consumer_group_instance_id=group.instance_id or None,
        broker_session_timeout=group.session_timeout_s,
        broker_heartbeat_interval=group.heartbeat_interval_s,
        broker_max_poll_interval=group.max_poll_interval_s,
        broker_request_timeout=max(40.0, group.session_timeout_s + 10),
        web_enabled=False,
        autodiscover=False,
        table_cleanup_interval=3600.0,
        TableManager=upstream.PromptTableManager,
        # Resolved when the app is built; the worker never makes an HTTP request: aiohttp is imported
        # only if something does (``upstream.import_faust_types``).
        HttpClient=upstream.aiohttp_session,
        **kafka_clients.faust_options(),  # TLS/SASL credentials, same as every other client
    )
    raw = {"key_serializer": "raw", "value_serializer": "raw"}
    fault_events = app.topic(topics.name("fault_events"), **raw)
    ticks = app.topic(ticks_topic_name(settings.app_id), partitions=settings.partitions, **raw)
    incidents = app.topic(topics.name("incidents"), **raw)
    deadletter = app.topic(topics.name("deadletter"), **raw)
    node_state = app.tables.add(
        NodeStateTable(
            app,
            name=NODE_STATE_TABLE,
            default=None,
            partitions=settings.partitions,
            key_type=bytes,
            value_type=bytes,  # NodeState.to_bytes(): the memory store then holds what the changelog holds
        )
    )
    # Started with Faust's producer, so before the agents, and stopped after them (Faust stops its
    # producer after the consumer and the agents): no state is written to a stopped client.
    node_state.changelog_producer = app.producer.add_dependency(
        ChangelogProducer(bootstrap, client_id=f"{settings.app_id}-changelog")
    )
    xapp = XidflowApp(
        app=app,
        settings=settings,
        topics=topics,
        aggregation=aggregation,
        parse=parse,
        bootstrap=bootstrap,
        fault_events=fault_events,
        ticks=ticks,
        incidents=incidents,
        deadletter=deadletter,
        node_state=node_state,
        group=group,
    )
    if group.leave_on_shutdown:
        # Sent before the consumer stops (pipeline.kafka.membership: leave on SIGTERM, not on a crash).
        @app.on_before_shutdown.connect
        async def _leave_group(sender: faust.App, **_: object) -> None:
            leave_on_close(faust_consumer(sender))

    return xapp


def parse_group_id(app_id: str) -> str:
    """The parse stage's consumer group (the aggregation's is Faust's: the app id)."""
    return f"{app_id}-parse"


def consumer_groups(xapp: XidflowApp) -> dict[str, list[str]]:
    """Each consumer group this worker runs -> the topics it consumes (what ``pipeline.kafka.lag`` reports)."""
    groups: dict[str, list[str]] = {}
    if xapp.settings.aggregate:
        groups[xapp.app.conf.id] = [xapp.fault_events.get_topic_name(), xapp.ticks.get_topic_name()]
    if xapp.settings.parse:
        groups[parse_group_id(xapp.settings.app_id)] = list(xapp.topics.raw_inputs)
    return groups


def install_lag_monitor(xapp: XidflowApp) -> None:
    """Report the consumer lag of the worker's groups on a timer (``pipeline.kafka.lag``), batches or not."""
    from pipeline.kafka.lag import LagMonitor

    monitor = LagMonitor(consumer_groups(xapp), xapp.bootstrap)

    class _LagService(mode.Service):
        async def on_start(self) -> None:
            monitor.start()

        async def on_stop(self) -> None:
            await monitor.stop()

    xapp.app.service(_LagService)


def install_memory_release(xapp: XidflowApp, interval_s: float = 30.0) -> None:
    """Give memory freed after a burst back to the system every ``interval_s`` (``pipeline.runtime.allocator``)."""
    from pipeline.runtime import allocator
    @xapp.app.timer(interval=interval_s)
    async def release_memory() -> None:
        allocator.trim()


def install_aggregation_liveness(xapp: XidflowApp, interval_s: float = 5.0) -> None:
    """A timer that tells ``/healthz`` whether the aggregation agent reads its fault events.

    Progress: the offsets Faust delivered to the agent moved, or every assigned fault-event
    partition is read to its end. The timer itself is the beat: a blocked event loop stops it.
    """
    from pipeline.runtime.liveness import LIVENESS

    topic = xapp.fault_events.get_topic_name()
    live = LIVENESS.component(f"aggregate:{xapp.settings.app_id}", xapp.settings.stall_after_s)
    last: dict = {}

    @xapp.app.timer(interval=interval_s)
    async def aggregation_liveness() -> None:
        consumer = xapp.app.consumer
        live.beat()
        try:
            tps = [tp for tp in consumer.assignment() if tp.topic == topic]
            read = {tp: upstream.read_offset(consumer, tp) for tp in tps}  # last offset delivered to the agent
            behind = False
            for tp in tps:
                highwater = consumer.highwater(tp)
                # Next offset the agent needs: after the last delivered one, else the committed one.
                done = read[tp] + 1 if read[tp] is not None else upstream.committed_offset(consumer, tp)
                if highwater is not None and highwater > 0 and (done is None or done < highwater):
                    behind = True
        except Exception:  # noqa: BLE001 - Faust internals moved: report beats only
            return
        moved = read != last
        last.clear()
        last.update(read)
        if not behind:
            live.progressed(idle=True)
        elif moved:
            live.progressed()
        else:
            live.busy()


class ParseService(mode.Service):
    """Hosts a ``ParseStage`` inside the Faust worker (started and stopped with the app)."""

    def __init__(self, stage: ParseStage, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.stage = stage
        self._run_task: asyncio.Task | None = None

    async def on_start(self) -> None:
        self._run_task = asyncio.ensure_future(self._run_forever())

    async def _run_forever(self) -> None:
        # The stage never raises on input (a record's failure is its dead letter); what is left is a
        # connection-level failure, retried with a growing pause. While it lasts the stage commits
        # nothing, and /healthz says so after ``stall_after_s``.
        # A batch it cannot decode is not such a failure: pipeline.kafka.undecodable holds or skips it.
        from pipeline.runtime import metrics
        pause, attempt = 1.0, 0
        while not self.should_stop:
            started = asyncio.get_running_loop().time()
            try:
                await self.stage.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep the worker alive; Kafka outages are transient
                if asyncio.get_running_loop().time() - started > 60:
                    pause, attempt = 1.0, 0  # it ran a while: a new outage, not the same one
                attempt += 1
                self.stage.live.note = f"restart {attempt} after {type(exc).__name__}, next in {pause:.0f}s"
                metrics.STAGE_RESTARTS.labels("parse").inc()
                metrics.STAGE_RESTART_DELAY.labels("parse").set(pause)
                log.exception("parse stage failed (restart %d, bounded back-off %.0fs of at most 30s); "
                              "restarting in %.0fs", attempt, pause, pause)
                await asyncio.sleep(pause)
                metrics.STAGE_RESTART_DELAY.labels("parse").set(0)
                pause = min(30.0, pause * 2)

    async def on_stop(self) -> None:
        self.stage.stop()
        if self._run_task is not None:
            try:
                await asyncio.wait_for(self._run_task, timeout=15)
            except (TimeoutError, asyncio.CancelledError):
                self._run_task.cancel()
