"""``xidflow probe``: NVML health checks on this node, as HealthCheckResult records on an interval."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

import click

from pipeline.runtime.logconfig import log_options
from pipeline.runtime.settings import KafkaSettings, TopicNames

EXIT_NO_GPU = 2
EXIT_CHECK_FAILED = 1


def load_nvml() -> Any:
    """Import and initialise pynvml, or exit non-zero with a clear message when there is no GPU/driver."""
    try:
        import pynvml
    except ImportError as exc:  # the nvidia-ml-py package itself is missing
        click.echo(f"xidflow probe: pynvml (nvidia-ml-py) is not installed: {exc}", err=True)
        sys.exit(EXIT_NO_GPU)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        click.echo(
            f"xidflow probe: no usable NVIDIA GPU/driver on this machine ({type(exc).__name__}: {exc}). "
            "Run it on a GPU node with the NVIDIA driver installed (libnvidia-ml.so.1 must be loadable).",
            err=True,
        )
        sys.exit(EXIT_NO_GPU)
    return pynvml


@click.command("probe")
@log_options
@click.option("--node", envvar="NODE_NAME", required=True, help="This node's Kubernetes name [env NODE_NAME]")
@click.option("--expected-gpus", type=click.IntRange(0), default=None, help="GPUs this node should have")
@click.option(
    "--expected-nvlinks",
    type=click.IntRange(0),
    default=None,
    help="Active NVLinks per GPU [default: the node's best GPU]",
)
@click.option("--interval", type=click.FloatRange(min=1.0), default=60.0, show_default=True, help="Seconds")
@click.option("--once", is_flag=True, help="Run one round; exit 1 if any check failed")
@click.option("--topic", default=None, help="Kafka topic [default: the health checks topic]")
@click.option("--bootstrap", default=None, help="Kafka bootstrap servers [default: $KAFKA_BOOTSTRAP_SERVERS]")
@click.option("--stdout", "to_stdout", is_flag=True, help="Print JSON lines instead of producing to Kafka")
@click.option(
    "--driver-timeout",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="Seconds NVML may take to answer before the driver counts as hung",
)
def probe(
    node: str,
    expected_gpus: int | None,
    expected_nvlinks: int | None,
    interval: float,
    once: bool,
    topic: str | None,
    bootstrap: str | None,
    to_stdout: bool,
    driver_timeout: float,
) -> None:
    """Check GPU count, NVLink, ECC, remapped rows and driver responsiveness through NVML."""
    nvml = load_nvml()
    if not once:
        from pipeline.runtime.metrics import serve_metrics

        serve_metrics(component="probe")
    from pipeline.runtime.heartbeat import with_liveness

    code = asyncio.run(with_liveness(
        probe_loop(
            nvml,
            node=node,
            expected_gpus=expected_gpus,
            expected_nvlinks=expected_nvlinks,
            interval_s=interval,
            once=once,
            topic=topic or TopicNames().name("health_checks"),
            bootstrap_servers=None if to_stdout else (bootstrap or KafkaSettings().bootstrap_servers),
            driver_timeout_s=driver_timeout,
        )
    ))
    sys.exit(code)


async def probe_loop(
    nvml: Any,
    *,
    node: str,
    expected_gpus: int | None,
    expected_nvlinks: int | None,
    interval_s: float,
    once: bool,
    topic: str,
    bootstrap_servers: str | None,
    driver_timeout_s: float,
    stop: asyncio.Event | None = None,
) -> int:
    """Run check rounds on an initialised NVML until stopped (or once); Kafka when a bootstrap is given,
    else JSON lines on stdout. Returns the exit code: 1 when ``once`` and a check failed."""
    from pipeline.ingest.probe import DriverCall, read_boot_id, run_checks

    call = DriverCall()
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    producer = None
    if bootstrap_servers is not None:
        from pipeline.kafka import clients as kafka_clients
        producer = kafka_clients.producer(bootstrap=bootstrap_servers, acks="all", enable_idempotence=True)
        await producer.start()
    failed_any = False
    try:
        while True:
            results = run_checks(
                nvml,
                node,
                expected_gpus=expected_gpus,
                expected_nvlinks=expected_nvlinks,
                boot_id=read_boot_id(),  # read each round: a reboot between rounds must show
                call=call,
                driver_timeout_s=driver_timeout_s,
            )
            failed_any = failed_any or any(not r.passed for r in results)
            for result in results:
                if producer is None:
                    sys.stdout.buffer.write(result.to_bytes() + b"\n")
                else:
                    await producer.send_and_wait(topic, result.to_bytes(), key=node.encode())
            sys.stdout.flush()
            if once:
                break
            try:
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
                break
            except TimeoutError:
                pass
    finally:
        if producer is not None:
            await producer.stop()
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass
    return EXIT_CHECK_FAILED if once and failed_any else 0
