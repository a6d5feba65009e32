"""``xidflow worker``: run the Faust worker (parse service + aggregation agent)."""

from __future__ import annotations

import asyncio

import click

from pipeline.runtime.logconfig import log_options


@click.command("worker")
@click.option(
    "--bootstrap",
    envvar="KAFKA_BOOTSTRAP_SERVERS",
    default="127.0.0.1:9092",
    show_default=True,
    help="Kafka bootstrap servers (host:port,...).",
)
@click.option("--app-id", default=None, help="Faust app id (consumer group prefix). [env XIDFLOW_WORKER_APP_ID]")
@click.option("--partitions", type=int, default=None, help="Partitions of topics created if missing.")
@click.option("--web-port", type=int, default=None, help="Serve Prometheus metrics on this port.")
@click.option("--parse/--no-parse", default=None, help="Run the parse service.")
@click.option("--aggregate/--no-aggregate", default=None, help="Run the aggregation agent.")
@click.option("--session-timeout", type=float, default=None,
              help="Group session timeout in seconds. [env XIDFLOW_GROUP_SESSION_TIMEOUT_S]")
@click.option("--instance-id", default=None,
              help="Static group member id (KIP-345). [env XIDFLOW_GROUP_INSTANCE_ID, else POD_NAME]")
@click.option("--supervise/--no-supervise", default=None,
              help="Run the work in a child that a warm supervisor replaces at once when it dies "
                   "(pipeline.runtime.supervisor). [env XIDFLOW_SUPERVISOR_ENABLED, default on]")
@log_options
def worker(
    bootstrap: str,
    app_id: str | None,
    partitions: int | None,
    web_port: int | None,
    parse: bool | None,
    aggregate: bool | None,
    session_timeout: float | None,
    instance_id: str | None,
    supervise: bool | None,
) -> None:
    """Run the Faust parse and aggregation worker until interrupted."""
    from pipeline.runtime.startmarks import mark

    mark("command")
    from pipeline.kafka import upstream

    upstream.import_faust_types()  # before Faust's first import: without aiohttp, which the worker never uses
    import faust

    from agents.worker import create_app
    from pipeline.aggregate import copartition
    from pipeline.app import WorkerSettings, worker_topics
    from pipeline.kafka.admin import ensure_topics
    from pipeline.runtime.settings import ConsumerGroupSettings, TopicNames, describe_validation_error

    overrides = {
        "app_id": app_id,
        "partitions": partitions,
        "web_port": web_port,
        "parse": parse,
        "aggregate": aggregate,
    }
    group_overrides = {"session_timeout_s": session_timeout, "instance_id": instance_id}
    from aiokafka.errors import KafkaError
    from pydantic import ValidationError

    from pipeline.aggregate.settings import AggregationSettings
    from pipeline.detection.catalog import Catalog, CatalogError
    from pipeline.detection.parse_settings import ParseSettings
    from pipeline.runtime.gcpolicy import GcSettings

    try:  # every setting is checked before anything connects: a bad value changes nothing
        settings = WorkerSettings(**{k: v for k, v in overrides.items() if v is not None})
        topics = TopicNames()
        group = ConsumerGroupSettings(**{k: v for k, v in group_overrides.items() if v is not None})
        aggregation = AggregationSettings()
        parse_settings = ParseSettings()
        gc_settings = GcSettings()
        Catalog.configured()  # the instance every stage of this process classifies with (overrides included)
    except ValidationError as exc:
        raise click.ClickException(describe_validation_error(exc)) from None
    except CatalogError as exc:
        raise click.ClickException(f"invalid catalog override: {exc}") from exc
    mark("settings")
    names = worker_topics(settings.app_id, topics)
    # The fault-event topic's partition count decides the ticks topic's and the table's: they must be
    # co-partitioned, and the worker refuses to run when they are not (pipeline.aggregate.copartition).
    shared = copartition.copartitioned_topics(settings.app_id, topics.name("fault_events"))

    async def prepare_topics() -> int:
        count = await copartition.prepare(bootstrap, shared, settings.partitions, settings.replication_factor)
        others = [n for n in names if n not in shared]
        await ensure_topics(bootstrap, others, settings.partitions, settings.replication_factor)
        return count

    try:
        actual = asyncio.run(prepare_topics())
    except copartition.CopartitionError as exc:
        raise click.ClickException(str(exc)) from exc
    except (KafkaError, OSError) as exc:
        raise click.ClickException(f"cannot reach Kafka at {bootstrap}: {exc}") from exc
    mark("topics")
    if actual != settings.partitions:
        click.echo(f"{names[0]} has {actual} partitions; using that for the node-state table", err=True)
        settings = settings.model_copy(update={"partitions": actual})
    from pipeline.runtime import allocator, gcpolicy, metrics, supervisor
    from pipeline.runtime.heartbeat import install_faust
    from pipeline.runtime.logconfig import current, dict_config
    from pipeline.runtime.metrics import serve_metrics

    supervisor.preload(WORKER_MODULES)
    mark("preloaded")
    level, fmt = current()

    def work() -> None:
        """The worker itself: every thread, loop and connection is made here, after the fork."""
        mark("work")
        allocator.tune()  # before the first burst: large blocks are then given back when freed
        gcpolicy.tune(gc_settings)  # the collector runs far less often: its CPU is a burst's latency
        serve_metrics(settings.web_port or None, metrics.WORKER, metrics.worker_label_values(topics.raw_inputs))
        # The settings validated above, not read from the environment again: the child's start is a
        # restarted worker's critical path (each settings object ~10 ms of CPU).
        xapp = create_app(bootstrap, settings, topics,
                          aggregation=aggregation, parse_settings=parse_settings, group=group)
        mark("built")
        install_faust(xapp.app)  # /livez answered by the Faust loop (liveness that sees a stuck loop)
        faust.Worker(xapp.app, loglevel=level, logging_config=dict_config(level, fmt), quiet=True
                     ).execute_from_commandline()

    raise SystemExit(supervisor.supervise(work, "worker", supervise))


WORKER_MODULES = (
    # What the worker imports only once it runs: imported by the supervisor before the fork, so a
    # replacement child does not pay for them (pipeline.runtime.supervisor).
    "faust.worker",
    "faust.app.base",
    "faust.agents",
    "faust.assignor.leader_assignor",
    "faust.sensors.monitor",
    "faust.web.base",
    "mode.supervisors",
    "faust.app.router",
    "faust.events",
    "faust.fixups.django",
    "faust.tables.sets",
    "faust.topics",
    "faust.transport.utils",
    "ahocorasick_rs",
    "faust.transport.drivers.aiokafka",
    "faust.tables.recovery",
    "faust.stores.memory",
    "agents.worker",
    "agents.parse",
    "agents.aggregate",
    "pipeline.ingest.adapters",
    "pipeline.detection.detector",
    "pipeline.ingest.parsing.kernel",
    "pipeline.ingest.parsing.pod",
    "pipeline.ingest.shippers",
    "pipeline.kafka.fetch_watchdog",
    "pipeline.kafka.lag",
)
