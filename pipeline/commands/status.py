"""``xidflow status``, ``xidflow reset``, ``xidflow breaker status|reset``: what xidflow did to the fleet.

Output follows kubectl (``pipeline.commands.output``); ``--kubeconfig``, ``--context`` and
``--namespace`` mean what they mean to kubectl. Every failure a person can cause or meet (no
kubeconfig, an API server that is down, an unknown node, Kafka down) ends in one sentence on stderr
and a non-zero exit, never a traceback.

One module (about 470 lines): the three commands read the fleet the same way and share the row model
that the demo's view renders too; most of the length is rendering and the sentences for each failure.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import getpass
import os
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import click

from pipeline.commands.output import Column, age, emit, emit_object, joined, output_option

T = TypeVar("T")

kubeconfig_option = click.option(
    "--kubeconfig", envvar="KUBECONFIG", default=None,
    help="Kubeconfig file [env KUBECONFIG; default ~/.kube/config, else in-cluster].",
)
context_option = click.option("--context", default=None, help="Kubeconfig context to use (as kubectl --context).")
namespace_option = click.option(
    "-n", "--namespace", default=None,
    help="Namespace of xidflow's breaker and drain ConfigMaps [default XIDFLOW_ACTUATOR_NAMESPACE].",
)
selector_option = click.option(
    "--selector", "-l", default=None, help="GPU fleet label selector [default XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR]."
)


def _settings(selector: str | None, namespace: str | None = None) -> Any:
    from pydantic import ValidationError

    from pipeline.actuator.settings import ActuatorSettings

    try:
        settings = ActuatorSettings()
    except ValidationError as exc:
        raise click.ClickException(f"invalid settings (XIDFLOW_ACTUATOR_*):\n{exc}") from None
    update = {k: v for k, v in {"gpu_node_selector": selector, "namespace": namespace}.items() if v}
    return settings.model_copy(update=update) if update else settings


# -- reaching the cluster ------------------------------------------------------------------------------
def resolve_kubeconfig(kubeconfig: str | None, context: str | None) -> str | None:
    """The kubeconfig file to use (None: in-cluster), or a sentence saying why there is none.

    With ``--context`` a private copy of the file names that context as current, so that every
    client built from a path (the actuator's too) uses it.
    """
    path = kubeconfig or str(Path("~/.kube/config").expanduser())
    files = [p for p in path.split(os.pathsep) if p]  # KUBECONFIG may list several files, as for kubectl
    if not any(Path(p).is_file() for p in files):
        if kubeconfig:
            raise click.ClickException(f"the kubeconfig {kubeconfig} does not exist.")
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            if context:
                raise click.ClickException("--context needs a kubeconfig; none was given, ~/.kube/config is missing.")
            return None  # in a pod: the service account
        raise click.ClickException(
            "no kubeconfig: KUBECONFIG is not set, ~/.kube/config does not exist and this is not a pod in a "
            "cluster. Pass --kubeconfig FILE or set KUBECONFIG (`xidflow local env` prints it for the local one)."
        )
    if not context:
        return path
    if len(files) > 1:
        raise click.ClickException("--context needs a single kubeconfig file; pass --kubeconfig FILE.")
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise click.ClickException(f"the kubeconfig {path} cannot be read: {exc}") from None
    names = [c.get("name") for c in data.get("contexts") or [] if isinstance(c, dict)]
    if context not in names:
        raise click.ClickException(
            f"context {context!r} is not in the kubeconfig {path} (contexts: {', '.join(map(str, names)) or 'none'})."
        )
    data["current-context"] = context
    fd, copy = tempfile.mkstemp(prefix="xidflow-kubeconfig-", suffix=".yaml")  # mode 0600: it holds credentials
    atexit.register(_remove, copy)
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(data, f)
    return copy


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def make_kube(kubeconfig: str | None) -> Any:
    """A ``Kube`` for the resolved kubeconfig, or a sentence when the file is not a usable kubeconfig."""
    from kubernetes import config

    from pipeline.actuator.kube import Kube

    try:
        return Kube.from_config(kubeconfig, 4)
    except (config.ConfigException, OSError, ValueError) as exc:
        raise click.ClickException(f"the kubeconfig {kubeconfig or '(in-cluster)'} is not usable: {exc}") from None


def _api_host(kube: Any) -> str:
    return str(getattr(kube.api_client.configuration, "host", "") or "")


@contextlib.contextmanager
def sentences(kube_host: Callable[[], str] = lambda: "", kafka_note: str = "") -> Iterator[None]:
    """Turn what the API server and Kafka answer into one sentence and a non-zero exit."""
    from aiokafka.errors import KafkaError

    from pipeline.actuator.kube import Forbidden, KubeError, KubeUnavailable, NotFound

    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    try:
        yield
    except KubeUnavailable as exc:
        raise click.ClickException(
            f"cannot reach the Kubernetes API server{' at ' + kube_host() if kube_host() else ''}; is it running, "
            f"and does the kubeconfig point at it?\n  cause: {exc}"
        ) from None
    except NotFound as exc:
        raise click.ClickException(f"not found: {exc.message}") from None
    except Forbidden as exc:
        raise click.ClickException(
            f"the API server refused the request ({exc.status} {exc.reason}): {exc.message}"
        ) from None
    except KubeError as exc:
        raise click.ClickException(f"the API server answered {exc.status} {exc.reason}: {exc.message}") from None
    except (KafkaError, ConnectionError) as exc:
        raise click.ClickException(
            f"cannot reach Kafka at {bootstrap} (KAFKA_BOOTSTRAP_SERVERS): {exc}.{kafka_note}"
        ) from None


def _run(kube: Any, work: Callable[[], Awaitable[T]], kafka_note: str = "") -> T:
    async def work_then_close() -> T:
        try:
            return await work()
        finally:
            await kube.aclose()  # its HTTP session, on the loop it was opened on (else: "Unclosed client session")

    with sentences(lambda: _api_host(kube), kafka_note):
        try:
            return asyncio.run(work_then_close())
        finally:
            kube.close()


# -- xidflow status -------------------------------------------------------------------------------------
def _epoch(rfc3339: str | None) -> float | None:
    if not rfc3339:
        return None
    try:
        return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _message_parts(condition: Mapping[str, Any]) -> list[str]:
    # The condition message starts with the fault: "xid 79, PCI ..., count 2, action RESTART_BM: <line>".
    head = str(condition.get("message") or "").split(": ", 1)[0]
    return [p.strip() for p in head.split(",") if p.strip()]


def _fault_of(condition: Mapping[str, Any]) -> str:
    """``xid 79``, ``sxid 24007``; a fallen-off-the-bus line reads as the Xid it counts as (``xid 79``); the
    shared-part condition as the part (``part example.com/ib-switch=leaf-7``)."""
    from pipeline.actuator.sharedparts import CONDITION_TYPE, part_of_message

    if condition.get("type") == CONDITION_TYPE:
        return f"part {part_of_message(str(condition.get('message') or ''))}"
    parts = _message_parts(condition)
    if not parts:
        return str(condition.get("reason") or condition.get("type"))
    kind, _, code = parts[0].partition(" ")
    return f"xid {code}" if kind == "gpu_fallen_off_bus" and code else parts[0]


def _action_of(condition: Mapping[str, Any]) -> str | None:
    """The catalog's recommended action for the fault (the reason xidflow acted), when the message has it."""
    return next((p.split(" ", 1)[1] for p in _message_parts(condition) if p.startswith("action ")), None)


def node_rows(nodes: list[dict[str, Any]], breaker: Mapping[str, Any] | None = None,
              now: float | None = None) -> list[dict[str, Any]]:
    """One row per node: state, the fault, incident age, what xidflow applied and why, the breaker. Pure.

    Lists stay lists and objects stay objects (``-o json``); the table joins them for display.
    """
    from pipeline.actuator import repaircase
    from pipeline.actuator.ownership import LAST_ACTION_ANNOTATION
    from pipeline.actuator.plan import NodeView

    now = time.time() if now is None else now
    breaker = breaker or {}
    window = float(breaker.get("window_seconds") or 0)
    counted = {n for n, t in (breaker.get("admitted") or {}).items() if not window or now - float(t) <= window}
    tripped = bool(breaker.get("tripped"))
    rows = []
    for obj in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        view = NodeView.from_object(obj)
        ledger = view.ledger
        flows = sorted({f for owners in ledger.owned.values() for f in owners})
        owned_conditions = {k.split(":", 1)[1].partition("=")[0] for k in ledger.owned if k.startswith("condition:")}
        faults = []
        for cond in view.conditions:
            if cond.get("type") in owned_conditions:
                faults.append({
                    "condition": cond.get("type"),
                    "status": cond.get("status"),
                    "fault": _fault_of(cond),
                    "action": _action_of(cond),
                    "reason": cond.get("reason"),
                    "message": cond.get("message"),
                    "since": cond.get("lastTransitionTime"),
                })
        incidents = []
        for flow in flows:
            rec = ledger.flows.get(flow) or {}
            started = rec.get("at")
            incidents.append({
                "id": flow,
                "started": float(started) if started is not None else None,
                "age_seconds": round(now - float(started), 1) if started is not None else None,
                "done": sorted((rec.get("done") or {}).keys()),
                "applied": sorted(effect for effect, owners in ledger.owned.items() if flow in owners),
                "cancelled": rec.get("cancelled"),
            })
        # Shared parts blamed for this node's faults (pipeline.actuator.sharedparts): their flows name the part.
        shared = sorted({str((ledger.flows.get(f) or {}).get("part")) for f in flows
                         if (ledger.flows.get(f) or {}).get("part")})
        ages = [i["age_seconds"] for i in incidents if i["age_seconds"] is not None]
        if not ages:
            ages = [now - t for t in (_epoch(f["since"]) for f in faults) if t is not None]
        rows.append({
            "node": view.name,
            "ready": view.ready,
            "schedulable": not view.unschedulable,
            "status": ("Ready" if view.ready else "NotReady") + (",SchedulingDisabled" if view.unschedulable else ""),
            "faults": faults,
            "shared_parts": shared,
            "incident_age_seconds": max(ages) if ages else None,
            "incidents": incidents,
            "applied": {effect: sorted(owners) for effect, owners in sorted(ledger.owned.items())},
            "last_action": view.annotations.get(LAST_ACTION_ANNOTATION),
            "breaker": {"state": "open" if tripped else "closed", "counted": view.name in counted},
            # Where the node is in the repair loop, and each repair case's history (docs/repair.md).
            "repair": repaircase.loop_position(ledger),
            "repairs": repaircase.summary(ledger, now),
        })
    return rows


def _short_effect(effect: str) -> str:
    # "taint:nvidia.com/gpu-fault:NoSchedule" -> "taint/NoSchedule"; "condition:GpuXid" -> "condition/GpuXid"
    kind, _, rest = effect.partition(":")
    if kind == "taint":
        return f"taint/{rest.rsplit(':', 1)[-1]}"
    return f"{kind}/{rest}" if rest else kind


def _why(row: Mapping[str, Any]) -> str:
    """Why xidflow applied what it did: the action the catalog recommends for the fault, else the incident."""
    actions = sorted({f["action"] for f in row["faults"] if f["action"]})
    actions += [f"shared part {p}" for p in row.get("shared_parts") or ()]
    if actions:
        return joined(actions)
    return joined([f"incident {i['id']}" for i in row["incidents"]])


STATUS_COLUMNS = [
    Column("node", lambda r: r["node"]),
    Column("status", lambda r: r["status"]),
    Column("fault", lambda r: joined(sorted({f["fault"] for f in r["faults"]}))),
    Column("age", lambda r: age(r["incident_age_seconds"])),
    Column("applied", lambda r: joined(sorted({e.split(":", 1)[0] for e in r["applied"]}))),
    Column("why", _why),
    Column("breaker", lambda r: r["breaker"]["state"] + (",counted" if r["breaker"]["counted"] else "")),
    Column("repair", lambda r: r.get("repair") or "-"),
    Column("effects", lambda r: joined([_short_effect(e) for e in r["applied"]]), wide_only=True),
    Column("incidents", lambda r: joined([i["id"] for i in r["incidents"]]), wide_only=True),
    Column("steps-done", lambda r: joined(sorted({s for i in r["incidents"] for s in i["done"]})), wide_only=True),
    Column("last-action", lambda r: r["last_action"] or "-", wide_only=True),
]


def history_rows(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A node's repair history, one row per step of each case, oldest first (``xidflow status NODE``). Pure."""
    out = []
    for case in row.get("repairs") or []:
        for entry in case.get("history") or []:
            out.append({"node": row["node"], "case": case["case"], "fault_class": case["fault_class"],
                        "at": entry.get("at"), "stage": entry.get("stage"), "note": entry.get("note")})
    return sorted(out, key=lambda r: float(r["at"] or 0))


def _clock(epoch: float | None) -> str:
    return datetime.fromtimestamp(float(epoch)).astimezone().strftime("%Y-%m-%d %H:%M:%S") if epoch else "-"


HISTORY_COLUMNS = [
    Column("time", lambda r: _clock(r["at"])),
    Column("stage", lambda r: r["stage"] or "-"),
    Column("class", lambda r: r["fault_class"]),
    Column("what", lambda r: r["note"] or "-"),
    Column("case", lambda r: r["case"], wide_only=True),
]


@click.command("status")
@click.argument("node_name", required=False)
@kubeconfig_option
@context_option
@namespace_option
@selector_option
@output_option()
@click.option("--json", "as_json", is_flag=True, hidden=True, help="Same as -o json.")
def status(node_name: str | None, kubeconfig: str | None, context: str | None, namespace: str | None,
           selector: str | None, output: str, as_json: bool) -> None:
    """GPU nodes: state, fault, incident age, what xidflow applied and why, the breaker and where each node is in
    the repair loop. With NODE_NAME: that node's row and its repair history."""
    from pipeline.actuator.configmap_state import read_json_configmap

    settings = _settings(selector, namespace)
    kube = make_kube(resolve_kubeconfig(kubeconfig, context))

    async def main() -> list[dict[str, Any]]:
        if node_name:
            nodes = [await kube.get_node(node_name)]
        else:
            nodes = await kube.list_nodes(settings.gpu_node_selector)
        breaker = await read_json_configmap(kube, settings.namespace, settings.breaker_configmap)
        breaker.setdefault("window_seconds", settings.breaker_window_seconds)
        parts[:] = part_rows(await read_json_configmap(kube, settings.namespace, settings.shared_parts_configmap))
        return node_rows(nodes, breaker)

    parts: list[dict[str, Any]] = []
    rows = _run(kube, main)
    output = "json" if as_json else output
    emit(rows, STATUS_COLUMNS, output, empty=f"No GPU nodes match the selector {settings.gpu_node_selector!r}.")
    if node_name and output in ("table", "wide"):
        history = history_rows(rows[0])
        click.echo("")
        emit(history, HISTORY_COLUMNS, output, empty=f"No repair history on node {node_name}.")
    if parts and output in ("table", "wide"):
        # The parts blamed instead of their nodes, after the node table (JSON rows carry ``shared_parts``).
        click.echo("")
        emit(parts, PART_COLUMNS, output)


def part_rows(state: Mapping[str, Any], now: float | None = None) -> list[dict[str, Any]]:
    """One row per shared part with an open incident (the ``xidflow-shared-parts`` ConfigMap). Pure."""
    from pipeline.actuator.sharedparts import parts_of

    now = time.time() if now is None else now
    rows = []
    for part in parts_of(state):
        inc = part.incident
        if inc is None:
            continue
        rows.append({
            "part": inc.part, "label": inc.label, "value": inc.value, "nodes": inc.nodes,
            "faults": inc.fault_classes, "incident": inc.incident_id, "revision": inc.revision,
            "age_seconds": round(now - inc.opened_at.timestamp(), 1), "tainted": sorted(part.applied),
        })
    return rows


PART_COLUMNS = [
    Column("shared-part", lambda r: f"{r['label']}={r['value']}"),
    Column("nodes", lambda r: str(len(r["nodes"]))),
    Column("faults", lambda r: joined(r["faults"])),
    Column("age", lambda r: age(r["age_seconds"])),
    Column("incident", lambda r: r["incident"]),
    Column("node-names", lambda r: joined(r["nodes"]), wide_only=True),
]


# -- xidflow reset ---------------------------------------------------------------------------------------
@click.command("reset")
@click.option("--node", "node_names", multiple=True, help="Node to reset (repeatable).")
@click.option("--all", "all_nodes", is_flag=True, help="Every GPU node xidflow applied something to.")
@kubeconfig_option
@context_option
@namespace_option
@selector_option
def reset(node_names: tuple[str, ...], all_nodes: bool, kubeconfig: str | None, context: str | None,
          namespace: str | None, selector: str | None) -> None:
    """Remove what xidflow applied (its cordons, taints, conditions); never what a person did. Audited."""
    if bool(node_names) == all_nodes:
        raise click.UsageError("give --node N (repeatable) or --all")
    settings = _settings(selector, namespace)
    path = resolve_kubeconfig(kubeconfig, context)
    probe = make_kube(path)

    async def check() -> None:
        # Unknown nodes and an unreachable API server are reported before anything is audited.
        from pipeline.actuator.kube import NotFound

        missing = []
        for name in node_names:
            try:
                await probe.get_node(name)
            except NotFound:
                missing.append(name)
        if missing:
            raise click.ClickException(f"no such node: {', '.join(missing)} (nothing was reset).")
        if all_nodes:
            await probe.list_nodes(settings.gpu_node_selector)

    _run(probe, check)
    from pipeline.actuator.app import Actuator
    from pipeline.actuator.plan import NodeView
    from pipeline.actuator.policy import PolicySet
    from pipeline.actuator.sharedparts import forget_reset_node
    from schemas.records import NodeRecovered

    act = Actuator(settings, kubeconfig=path, policies=PolicySet())

    async def main() -> list[str]:
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
                    part = (view.ledger.flows.get(flow) or {}).get("part")
                    if part:  # the node leaves the shared part's incident; the last one closes it
                        await forget_reset_node(act.kube, settings, str(part), view.name)
                    done.append(f"{view.name}: {flow}" + (f" (shared part {part})" if part else ""))
        finally:
            await act.auditor.stop()
        return done

    note = " A reset is audited on Kafka before it changes a node, so nothing was changed."
    for line in _run(act.kube, main, note) or ["nothing applied by xidflow"]:
        click.echo(line)


# -- xidflow breaker ---------------------------------------------------------------------------------------
@click.group("breaker")
def breaker() -> None:
    """The quarantine circuit breaker shared by all actuator replicas."""


def _breaker(kubeconfig: str | None, context: str | None, namespace: str | None, selector: str | None) -> Any:
    from pipeline.actuator.breaker import Breaker

    s = _settings(selector, namespace)
    kube = make_kube(resolve_kubeconfig(kubeconfig, context))
    return Breaker(
        kube, s.namespace, s.breaker_configmap, s.gpu_node_selector, s.breaker_max_share, s.breaker_window_seconds,
        max_nodes=s.breaker_max_nodes,
    )


BREAKER_COLUMNS = [
    Column("state", lambda r: "open" if r["tripped"] else "closed"),
    Column("quarantined", lambda r: f"{r['quarantined_in_window']}/{r['fleet_size']}"),
    Column("max-share", lambda r: f"{r['max_share']:g}"),
    Column("max-nodes", lambda r: str(r.get("max_nodes") or "-")),
    Column("window", lambda r: age(r["window_seconds"])),
    Column("reason", lambda r: r["reason"] or "-"),
    Column("reset-by", lambda r: r["reset_by"] or "-", wide_only=True),
]


@breaker.command("status")
@kubeconfig_option
@context_option
@namespace_option
@selector_option
@output_option(default="json")
def breaker_status(kubeconfig: str | None, context: str | None, namespace: str | None, selector: str | None,
                   output: str) -> None:
    """Open or closed, why, and how many GPU nodes were quarantined in the window."""
    b = _breaker(kubeconfig, context, namespace, selector)
    state = _run(b.kube, b.status)
    emit_object(state, BREAKER_COLUMNS, output)


@breaker.command("reset")
@kubeconfig_option
@context_option
@namespace_option
@selector_option
def breaker_reset(kubeconfig: str | None, context: str | None, namespace: str | None, selector: str | None) -> None:
    """Close the breaker (only a person does this) and forget the window."""
    b = _breaker(kubeconfig, context, namespace, selector)
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    was_open = _run(b.kube, lambda: b.reset(by=who))
    click.echo("breaker closed" if was_open else "breaker was already closed")
