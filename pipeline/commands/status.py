"""``xidflow status``, ``xidflow reset``, ``xidflow breaker status|reset``: what xidflow did to the fleet."""

from __future__ import annotations

import asyncio
import getpass
import socket
from typing import Any

import click

kubeconfig_option = click.option("--kubeconfig", envvar="KUBECONFIG", default=None, help="Default: in-cluster.")
selector_option = click.option(
    "--selector", default=None, help="GPU fleet label selector (default XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR)."
)


def _settings(selector: str | None) -> Any:
    from pipeline.actuator.settings import ActuatorSettings

    settings = ActuatorSettings()
    return settings.model_copy(update={"gpu_node_selector": selector}) if selector else settings


def node_rows(nodes: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One row per node: state, open incidents, what xidflow applied, last action. Pure."""
    from pipeline.actuator.ownership import LAST_ACTION_ANNOTATION
    from pipeline.actuator.plan import NodeView

    rows = []
    for obj in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        view = NodeView.from_object(obj)
        ledger = view.ledger
        state = ("Ready" if view.ready else "NotReady") + (",SchedulingDisabled" if view.unschedulable else "")
        owning = sorted({f for owners in ledger.owned.values() for f in owners})
        rows.append(
            {
                "node": view.name,
                "state": state,
                "open": ", ".join(owning) or "-",
                "applied": ", ".join(sorted(ledger.owned)) or "-",
                "last": view.annotations.get(LAST_ACTION_ANNOTATION, "-"),
            }
        )
    return rows


@click.command("status")
@kubeconfig_option
@selector_option
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def status(kubeconfig: str | None, selector: str | None, as_json: bool) -> None:
    """A table of GPU nodes: state, open incidents, what xidflow applied, last action."""
    from pipeline.actuator.kube import Kube

    settings = _settings(selector)

    async def main() -> list[dict[str, str]]:
        kube = Kube.from_config(kubeconfig, 4)
        try:
            return node_rows(await kube.list_nodes(settings.gpu_node_selector))
        finally:
            kube.close()

    rows = asyncio.run(main())
    if as_json:
        import orjson

        click.echo(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GPU nodes ({settings.gpu_node_selector})")
    for col in ("node", "state", "open incidents", "xidflow applied", "last action"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["node"], r["state"], r["open"], r["applied"], r["last"])
    Console().print(table)


@click.command("reset")
@click.option("--node", "node_names", multiple=True, help="Node to reset (repeatable).")
@click.option("--all", "all_nodes", is_flag=True, help="Every GPU node xidflow applied something to.")
@kubeconfig_option
@selector_option
def reset(node_names: tuple[str, ...], all_nodes: bool, kubeconfig: str | None, selector: str | None) -> None:
    """Remove what xidflow applied (its cordons, taints, conditions); never what a person did. Audited."""
    if bool(node_names) == all_nodes:
        raise click.UsageError("give --node N (repeatable) or --all")
    from pipeline.actuator.app import Actuator
    from pipeline.actuator.plan import NodeView
    from pipeline.actuator.policy import PolicySet
    from schemas.records import NodeRecovered

    settings = _settings(selector)

    async def main() -> list[str]:
        act = Actuator(settings, kubeconfig=kubeconfig, policies=PolicySet())
        await act.auditor.start()
        done: list[str] = []
        try:
            if all_nodes:
                views = [NodeView.from_object(n) for n in await act.kube.list_nodes(settings.gpu_node_selector)]
            else:
                views = [NodeView.from_object(await act.kube.get_node(n)) for n in node_names]
            for view in views:
                flows = sorted({f for owners in view.ledger.owned.values() for f in owners})
                for flow in flows:
                    who = f"{getpass.getuser()}@{socket.gethostname()}"
                    await act.engine.handle(
                        NodeRecovered(
                            incident_id=flow, node=view.name, reason="manual", detail=f"xidflow reset by {who}"
                        )
                    )
                    done.append(f"{view.name}: {flow}")
        finally:
            await act.auditor.stop()
            act.kube.close()
        return done

    for line in asyncio.run(main()) or ["nothing applied by xidflow"]:
        click.echo(line)


@click.group("breaker")
def breaker() -> None:
    """The quarantine circuit breaker shared by all actuator replicas."""


def _breaker(kubeconfig: str | None, selector: str | None) -> Any:
    from pipeline.actuator.breaker import Breaker
    from pipeline.actuator.kube import Kube

    s = _settings(selector)
    kube = Kube.from_config(kubeconfig, 4)
    return Breaker(
        kube, s.namespace, s.breaker_configmap, s.gpu_node_selector, s.breaker_max_share, s.breaker_window_seconds
    )


@breaker.command("status")
@kubeconfig_option
@selector_option
def breaker_status(kubeconfig: str | None, selector: str | None) -> None:
    """Open or closed, why, and how many GPU nodes were quarantined in the window."""
    import orjson

    b = _breaker(kubeconfig, selector)
    try:
        state = asyncio.run(b.status())
    finally:
        b.kube.close()
    click.echo(orjson.dumps(state, option=orjson.OPT_INDENT_2).decode())


@breaker.command("reset")
@kubeconfig_option
@selector_option
def breaker_reset(kubeconfig: str | None, selector: str | None) -> None:
    """Close the breaker (only a person does this) and forget the window."""
    b = _breaker(kubeconfig, selector)
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    try:
        was_open = asyncio.run(b.reset(by=who))
    finally:
        b.kube.close()
    click.echo("breaker closed" if was_open else "breaker was already closed")
