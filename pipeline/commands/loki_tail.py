"""``xidflow loki-tail``: bridge a Loki tail query into a Kafka topic."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import click

from pipeline.runtime.logconfig import log_options
from pipeline.runtime.settings import KafkaSettings, TopicNames


@click.command("loki-tail")
@click.option("--loki-url", required=True, envvar="LOKI_URL", help="Loki base URL, e.g. http://loki:3100 [$LOKI_URL]")
@click.option("--query", "logql", required=True, help='LogQL stream selector, e.g. {job="kmsg"} |= "NVRM"')
@click.option("--topic", default=None, help="Kafka topic to produce to [default: the kernel logs topic]")
@click.option("--node-label", default="node", show_default=True, help="Stream label holding the node name")
@click.option("--bootstrap", default=None, help="Kafka bootstrap servers [default: $KAFKA_BOOTSTRAP_SERVERS]")
@click.option("--start-ns", type=int, default=None, help="First start (ns epoch) [default: Loki's, 1h ago]")
@click.option(
    "--delay-for",
    type=click.IntRange(0, 5),
    default=0,
    show_default=True,
    help="Seconds Loki waits to order late entries",
)
@click.option(
    "--limit",
    type=click.IntRange(1),
    default=5000,
    show_default=True,
    help="Entries Loki replays on (re)connect",
)
@click.option("--org-id", default=None, envvar="LOKI_ORG_ID", help="X-Scope-OrgID header for multi-tenant Loki")
@click.option("--username", default=None, envvar="LOKI_USERNAME", help="Basic auth user (gateway in front of Loki)")
@click.option("--password-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="File holding the basic auth password [or $LOKI_PASSWORD]")
@click.option("--bearer-token-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="File holding a bearer token, read again on every (re)connect")
@click.option("--ca-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="PEM CA bundle to trust for https Loki URLs")
@click.option("--resume-scan", type=click.IntRange(0), default=10_000, show_default=True,
              help="Records per partition read back on start to resume where a previous run stopped (0: off)")
@click.option("-v", "--verbose", is_flag=True, help="Same as --log-level debug.")
@log_options
def loki_tail(
    loki_url: str,
    logql: str,
    topic: str | None,
    node_label: str,
    bootstrap: str | None,
    start_ns: int | None,
    delay_for: int,
    limit: int,
    org_id: str | None,
    username: str | None,
    password_file: Path | None,
    bearer_token_file: Path | None,
    ca_file: Path | None,
    resume_scan: int,
    verbose: bool,
) -> None:
    """Read Loki's /loki/api/v1/tail websocket and produce each entry to Kafka keyed by its node label."""
    import os

    from pipeline.ingest.loki_tail import LokiAuth, LokiRequestRejected, LokiTailBridge

    if verbose:
        logging.getLogger().setLevel(logging.DEBUG)
    topics = TopicNames()
    password = password_file.read_text().strip() if password_file else os.environ.get("LOKI_PASSWORD")
    try:
        auth = LokiAuth(org_id=org_id, username=username, password=password if username else None,
                        bearer_token_file=bearer_token_file, ca_file=ca_file)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        bridge = LokiTailBridge(
            loki_url=loki_url,
            query=logql,
            topic=topic or topics.name("logs_kernel"),
            bootstrap_servers=bootstrap or KafkaSettings().bootstrap_servers,
            deadletter_topic=topics.name("deadletter"),
            node_label=node_label,
            start_ns=start_ns,
            delay_for_s=delay_for,
            limit=limit,
            auth=auth,
            resume_scan=resume_scan,
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--loki-url") from exc

    async def main() -> None:
        from pipeline.ingest.loki_tail import STAGE
        from pipeline.runtime import metrics
        from pipeline.runtime.heartbeat import with_liveness

        metrics.serve_metrics(
            component=metrics.LOKI_TAIL, values={metrics.LOKI_TAIL_DEADLETTERS: metrics.deadletter_label_values(STAGE)}
        )
        await loki_reachable(loki_url)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        stats = await with_liveness(bridge.run(stop))
        click.echo(f"stopped: {stats}", err=True)

    from aiokafka.errors import KafkaError

    try:
        asyncio.run(main())
    except LokiRequestRejected as exc:
        raise click.ClickException(str(exc)) from exc
    except KafkaError as exc:
        raise click.ClickException(kafka_failure(exc, bridge.bootstrap_servers, bridge.topic)) from None


def kafka_failure(exc: BaseException, bootstrap: str, topic: str) -> str:
    """The sentence for a Kafka error that stopped the bridge: "cannot reach" only when that is what it says."""
    from pipeline.kafka import undecodable

    what = f"{type(exc).__name__}: {exc}" if type(exc).__name__ not in str(exc) else str(exc)
    if undecodable.unreachable(exc):
        return f"cannot reach Kafka at {bootstrap} (--bootstrap / KAFKA_BOOTSTRAP_SERVERS): {what}"
    if undecodable.unreadable(exc):
        return (f"a record batch of {topic} could not be read (not a connection problem): {what}; "
                "--resume-scan 0 starts without reading the topic back")
    return f"Kafka at {bootstrap} refused or failed a request for {topic} (not a connection problem): {what}"


async def loki_reachable(loki_url: str, timeout_s: float = 10.0) -> None:
    """Refuse to start when nothing answers at the Loki URL (later outages are retried with backoff)."""
    from urllib.parse import urlsplit

    parts = urlsplit(loki_url)
    port = parts.port or (443 if parts.scheme in ("https", "wss") else 80)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), timeout_s)
    except (OSError, TimeoutError) as exc:
        raise click.ClickException(f"cannot reach Loki at {loki_url} (--loki-url): {exc}") from None
    writer.close()
