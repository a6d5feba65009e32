"""The Faust application: topics, the node-state table, the parse service and the aggregation agent.

``create_app`` builds one app per worker configuration (tests build several, each with its own app
id). The wiring lives in ``agents/``; this module only declares what they wire together.

Layout on Kafka (all keyed by node name):

- raw inputs (``TopicNames.raw_inputs``) -> parse service (``pipeline.parse_stage``, aiokafka batch
  consumer in its own group ``<app_id>-parse``) -> ``fault_events`` and ``deadletter``.
- ``fault_events`` + ``<app_id>-ticks`` (internal, same partition count) -> aggregation agent,
  state in the ``node-state`` table (changelog ``<app_id>-node-state-changelog``) -> ``incidents``.

The table stores one ``NodeState`` per node (as ``NodeState.to_bytes()``) in the changelog partition
of the node's fault events (``NodeStateTable.put``), so a node's state and its events share a
partition number, and the aggregation agent can process batches of events from many nodes at once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import faust
import mode
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline import kafka_clients
from pipeline.aggregation import AggregationSettings
from pipeline.group_membership import faust_consumer, leave_on_close
from pipeline.parse_stage import ParseSettings, ParseStage
from pipeline.settings import ConsumerGroupSettings, KafkaSettings, TopicNames

log = logging.getLogger("xidflow.app")


def ticks_topic_name(app_id: str) -> str:
    """The worker's own topic of quiet-period ticks (created by ``xidflow worker`` with the others)."""
    return f"{app_id}-ticks"


NODE_STATE_TABLE = "node-state"


def changelog_topic_name(app_id: str) -> str:
    """The node-state table's changelog topic (Faust's ``<app id>-<table>-changelog``)."""
    return f"{app_id}-{NODE_STATE_TABLE}-changelog"


def worker_topics(app_id: str, topics: TopicNames) -> list[str]:
    """Topics a worker needs, fault events first (its partition count is the table's)."""
    return [
        topics.name("fault_events"),
        ticks_topic_name(app_id),
        *topics.raw_inputs,
        topics.name("incidents"),
        topics.name("deadletter"),
    ]


class NodeStateTable(faust.Table):
    """The node-state table, written with an explicit changelog partition.

    Faust picks a table key's changelog partition from the *current* event, which is ambiguous when
    an agent processes a batch of events from several partitions; ``put`` names the partition of the
    events the state was computed from (the node's partition of the fault-event topic).
    """

    _put_partition: int | None = None

    def put(self, key: bytes, value: bytes, partition: int) -> None:
        self._put_partition = partition
        try:
            self[key] = value
        finally:
            self._put_partition = None

    def partition_for_key(self, key: object) -> int | None:
        if self._put_partition is not None:
            return self._put_partition
        return super().partition_for_key(key)


class WorkerSettings(BaseSettings):
    """How a worker runs (environment: ``XIDFLOW_WORKER_<FIELD>``)."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_WORKER_", extra="ignore")

    app_id: str = Field(default="xidflow", description="Default 'xidflow'. Faust app id = consumer group prefix.")
    partitions: int = Field(
        default=8, description="Default 8. Partitions of topics the worker creates (existing ones are kept)."
    )
    replication_factor: int = Field(default=1, description="Default 1. Replication of created topics.")
    parse: bool = Field(default=True, description="Default true. Run the parse service in this worker.")
    aggregate: bool = Field(default=True, description="Default true. Run the aggregation agent in this worker.")
    tick_interval_s: float = Field(default=10.0, description="Default 10. How often quiet periods are checked.")
    aggregate_batch: int = Field(default=2000, description="Default 2000. Fault events per aggregation batch.")
    aggregate_within_s: float = Field(
        default=0.01, description="Default 0.01. Longest wait to fill an aggregation batch."
    )
    web_port: int | None = Field(default=None, description="Default none. Prometheus metrics port.")


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


def create_app(
    bootstrap: str | None = None,
    settings: WorkerSettings | None = None,
    topics: TopicNames | None = None,
    aggregation: AggregationSettings | None = None,
    parse: ParseSettings | None = None,
    group: ConsumerGroupSettings | None = None,
) -> XidflowApp:
    """Build the app and register the agents (``agents.parse``, ``agents.aggregate``) on it."""
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
        topic_partitions=settings.partitions,
        topic_replication_factor=settings.replication_factor,
        table_standby_replicas=0,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        # Both groups of the worker (Faust's and the parse stage's) use the same membership settings.
        consumer_group_instance_id=group.instance_id or None,
        broker_session_timeout=group.session_timeout_s,
        broker_heartbeat_interval=group.heartbeat_interval_s,
        broker_max_poll_interval=group.max_poll_interval_s,
        broker_request_timeout=max(40.0, group.session_timeout_s + 10),
        web_enabled=False,
        autodiscover=False,
        table_cleanup_interval=3600.0,
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
        # Sent before the consumer stops (pipeline.group_membership: leave on SIGTERM, not on a crash).
        @app.on_before_shutdown.connect
        async def _leave_group(sender: faust.App, **_: object) -> None:
            leave_on_close(faust_consumer(sender))

    from agents import aggregate as aggregate_agent
    from agents import parse as parse_agent

    if settings.parse:
        parse_agent.register(xapp)
    if settings.aggregate:
        aggregate_agent.register(xapp)
        from pipeline import fetch_watchdog

        fetch_watchdog.install(xapp.app, {xapp.fault_events.get_topic_name(), xapp.ticks.get_topic_name()})
    return xapp


class ParseService(mode.Service):
    """Hosts a ``ParseStage`` inside the Faust worker (started and stopped with the app)."""

    def __init__(self, stage: ParseStage, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.stage = stage
        self._run_task: asyncio.Task | None = None

    async def on_start(self) -> None:
        self._run_task = asyncio.ensure_future(self._run_forever())

    async def _run_forever(self) -> None:
        # The stage never raises on input; a connection-level failure is retried, not fatal.
        while not self.should_stop:
            try:
                await self.stage.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep the worker alive; Kafka outages are transient
                log.exception("parse stage failed; restarting in 1s")
                await asyncio.sleep(1.0)

    async def on_stop(self) -> None:
        self.stage.stop()
        if self._run_task is not None:
            try:
                await asyncio.wait_for(self._run_task, timeout=15)
            except (TimeoutError, asyncio.CancelledError):
                self._run_task.cancel()


