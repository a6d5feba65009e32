"""``xidflow local``: the embedded default infrastructure (Kafka + a Kubernetes control plane) on this machine."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from pipeline.localinfra.install import InstallError, InstallStep, Log, ensure_promtool, install_steps, run_steps
from pipeline.localinfra.launcher import LocalInfra, default_state_dir
from pipeline.localinfra.loki import ensure_loki
from pipeline.localinfra.procs import StartError

err = Console(stderr=True)


def _ensure_rsyslog(log: Log) -> None:
    """rsyslog with omkafka for its tests; a failure is a warning (only those tests need it, and fail loudly)."""
    from pipeline.localinfra.rsyslog import ensure_rsyslog_kafka

    try:
        ensure_rsyslog_kafka(log)
    except InstallError as exc:
        err.print(f"[yellow]warning:[/] {exc}")


def _log(msg: str) -> None:
    err.print(f"[dim]local:[/] {msg}")


state_dir_option = click.option(
    "--state-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Where state and logs live (default: $XIDFLOW_STATE_DIR or ~/.cache/xidflow/local).",
)


@click.group()
def local() -> None:
    """Start, inspect and stop the local Kafka broker and Kubernetes control plane (API server, controllers,
    scheduler, KWOK nodes)."""


@local.command()
@click.option("--loki/--no-loki", default=True, show_default=True,
              help="Also build Loki (several minutes on a cold cache, then cached).")
@click.option("--rsyslog/--no-rsyslog", default=False, show_default=True,
              help="Also install Debian's rsyslog with omkafka when missing (apt-get; root), for its tests.")
@click.option("--fluent-bit/--no-fluent-bit", default=False, show_default=True,
              help="Also build Fluent Bit from the vendored source (or check $FLUENT_BIT_BIN), cached by version.")
@click.option("--promtool/--no-promtool", default=False, show_default=True,
              help="Also install promtool (Debian's prometheus package, apt-get; root) for the alerting-rule tests.")
@click.option("--otelcol/--no-otelcol", default=False, show_default=True,
              help="Also build the OpenTelemetry Collector (collector builder + Go; minutes on a cold cache, "
                   "then cached), or check $OTELCOL_BIN.")
@click.option("--helm/--no-helm", default=False, show_default=True,
              help="Also build the pinned helm (Go build, cached): the demo renders the chart's Fluent Bit RBAC.")
def install(loki: bool, rsyslog: bool, fluent_bit: bool, promtool: bool, otelcol: bool, helm: bool) -> None:
    """Install (build or download) the local binaries now, with progress, without starting them."""
    try:
        steps = install_steps()
        if loki:
            steps.append(InstallStep("Loki (Go build)", ensure_loki))
        if rsyslog:
            steps.append(InstallStep("rsyslog with omkafka (apt-get, when missing)", _ensure_rsyslog))
        if promtool:
            steps.append(InstallStep("promtool (apt-get, when missing)", ensure_promtool))
        if fluent_bit:
            from pipeline.localinfra.fluentbit import VERSION, ensure_fluent_bit

            steps.append(InstallStep(f"Fluent Bit {VERSION} (CMake build of the vendored source)", ensure_fluent_bit))
        if otelcol:
            from pipeline.localinfra.otelcol import ensure_otelcol, otelcol_version

            steps.append(InstallStep(f"OpenTelemetry Collector {otelcol_version()} (collector builder, Go build)",
                                     ensure_otelcol))
        if helm:
            from pipeline.localinfra.helm import ensure_helm

            steps.append(InstallStep("helm (Go build)", ensure_helm))
        _log(f"installed in {run_steps(steps, err):.1f}s")
    except InstallError as exc:
        err.print(f"[red]error:[/] {exc}")
        sys.exit(1)


@local.command()
@click.option("--kafka-brokers", type=click.IntRange(1, 5), default=1, show_default=True,
              help="Number of Kafka brokers (KRaft, on loopback); use 3 for failure tests.")
@click.option("--kafka-security", type=click.Choice(["plaintext", "sasl_ssl"]), default="plaintext", show_default=True,
              help="sasl_ssl: SCRAM-SHA-512 over TLS, ACLs, one user per component (env prints the admin's).")
@click.option("--loki", is_flag=True, help="Also start a single-binary Loki on loopback (prints LOKI_URL).")
@state_dir_option
def up(kafka_brokers: int, kafka_security: str, loki: bool, state_dir: Path | None) -> None:
    """Start Kafka and the Kubernetes control plane in the background (endpoints from the environment win)."""
    infra = LocalInfra.load(state_dir or default_state_dir(), log=_log)
    t0 = time.monotonic()
    try:
        endpoints = infra.up(kafka_brokers=kafka_brokers, kafka_security=kafka_security, loki=loki)
    except (InstallError, StartError, OSError) as exc:
        err.print(f"[red]error:[/] could not start the local infrastructure: {exc}")
        sys.exit(1)
    _log(f"up in {time.monotonic() - t0:.1f}s; run: eval \"$(xidflow local env)\"")
    click.echo(endpoints.env_lines(), nl=False)


@local.command()
@state_dir_option
def env(state_dir: Path | None) -> None:
    """Print shell exports for KAFKA_BOOTSTRAP_SERVERS and KUBECONFIG (and LOKI_URL after `up --loki`)."""
    infra = LocalInfra.load(state_dir or default_state_dir(), log=_log)
    if not infra.endpoints:
        err.print("[red]error:[/] the local infrastructure is not up; run: xidflow local up")
        sys.exit(1)
    click.echo(infra.endpoints.env_lines(), nl=False)


@local.command()
@state_dir_option
def status(state_dir: Path | None) -> None:
    """Show what is running; exit 1 when something is down."""
    infra = LocalInfra.load(state_dir or default_state_dir(), log=_log)
    st = infra.status()
    table = Table(title=f"xidflow local ({infra.state_dir})")
    table.add_column("component")
    table.add_column("state")
    for name, ok in st.items():
        table.add_row(name, "[green]running[/]" if ok else "[red]down[/]")
    if infra.endpoints:
        table.add_row("kafka bootstrap", infra.endpoints.kafka_bootstrap)
        table.add_row("kubeconfig", infra.endpoints.kubeconfig)
        if infra.endpoints.loki_url:
            table.add_row("loki url", infra.endpoints.loki_url)
    Console().print(table)
    if not st or not all(st.values()):
        sys.exit(1)


@local.command()
@state_dir_option
def down(state_dir: Path | None) -> None:
    """Stop everything `local up` started; nothing is left listening."""
    infra = LocalInfra.load(state_dir or default_state_dir(), log=_log)
    infra.down()
    _log("down")
