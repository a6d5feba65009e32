"""``xidflow demo``: the end-to-end demo on the embedded default (or the endpoints in the environment)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import click
from rich.console import Console

from pipeline.localinfra.install import InstallError
from pipeline.localinfra.launcher import LocalInfra, default_state_dir
from pipeline.localinfra.procs import StartError


@click.command("demo")
@click.option("--nodes", type=click.IntRange(8, 64), default=8, show_default=True, help="GPU nodes in the fleet.")
@click.option("--actuators", type=click.IntRange(1, 4), default=2, show_default=True, help="Actuator replicas.")
@click.option("--keep-infra/--stop-infra", default=True, show_default=True,
              help="Leave the local infrastructure running afterwards (`xidflow local down` stops it).")
@click.option("--step-timeout", type=float, default=90.0, show_default=True,
              help="Seconds each scenario step may take before it counts as failed.")
@click.option("--details", is_flag=True,
              help="After the run, print the fleet and the audit trail with every column (as kubectl -o wide): "
                   "what xidflow applied and why, incidents, boot ids, kernel-line paths, last actions, reasons.")
@click.option("--setup-started", type=float, default=None, hidden=True,
              help="When `make demo` began (seconds since the epoch), so the demo's last line gives the whole time, "
                   "builds and installs included.")
def demo(nodes: int, actuators: int, keep_infra: bool, step_timeout: float, details: bool,
         setup_started: float | None) -> None:
    """Simulate a GPU fleet and watch xidflow find and remediate its faults; exit 0 when all went right."""
    from pipeline.demo.runner import DemoRun

    started = time.time()
    console = Console()
    infra = None
    bootstrap, kubeconfig = os.environ.get("KAFKA_BOOTSTRAP_SERVERS"), os.environ.get("KUBECONFIG")
    if not (bootstrap and kubeconfig):
        infra = LocalInfra.load(default_state_dir(), log=lambda m: console.print(f"[dim]local:[/] {m}"))
        try:
            endpoints = infra.up()
        except (InstallError, StartError, OSError) as exc:
            console.print(f"[red]error:[/] could not start the local infrastructure: {exc}")
            sys.exit(1)
        bootstrap, kubeconfig = endpoints.kafka_bootstrap, endpoints.kubeconfig
    run = DemoRun(bootstrap=bootstrap, kubeconfig=kubeconfig, console=console, nodes=nodes, actuators=actuators,
                  step_timeout=step_timeout, details=details, workdir=Path(default_state_dir()) / "demo")
    ok = False
    try:
        ok = asyncio.run(run.run())
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
    except RuntimeError as exc:
        console.print(f"[red]error:[/] {exc}")
    finally:
        run.cleanup()
        if infra is not None and not keep_infra:
            infra.down()
    if infra is not None and keep_infra:
        console.print("local infrastructure left running: `xidflow local down` stops it")
    console.print(timing_line(setup_started, started, time.time()))
    sys.exit(0 if ok else 1)


def _minutes(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


def timing_line(setup_started: float | None, demo_started: float, now: float) -> str:
    """The demo's last line: how long it took, and with ``make demo``'s start, the set-up before it (a cold
    machine's builds and installs) and the total a newcomer waited."""
    if setup_started is None or setup_started > demo_started:
        return f"time: demo {_minutes(now - demo_started)} (infrastructure start included)"
    return (f"time: {_minutes(now - setup_started)} in all since `make demo` began: set-up "
            f"{_minutes(demo_started - setup_started)} (environment, builds and installs; seconds when cached), "
            f"demo {_minutes(now - demo_started)} (infrastructure start included)")
