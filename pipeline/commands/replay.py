"""``xidflow replay``: what a candidate policy (and catalog) would have done on the retained raw logs.

The I/O around ``pipeline.replay``. It reads; it never writes:

- Kafka: a consumer **without a group** (``group_id=None``): partitions are assigned by hand, start
  offsets come from ``offsets_for_times(now - --since)``, end offsets are taken once at the start,
  and the records in between are read. With no group there is no membership, no rebalance of the
  worker's group and nothing that could be committed (aiokafka refuses ``commit`` without a group),
  which a fresh consumer group would not guarantee (it leaves a group and its offsets behind).
- Kubernetes (optional): GET/LIST only: the GPU nodes (labels for rules' node selectors, the fleet
  size for the breaker) and the ``RescuePolicy``/``WarmStandbyPolicy`` objects in force, the
  baseline of the diff. ``--baseline-policy FILE`` replaces the cluster's policies; without a
  reachable cluster the baseline is the built-in default policy, and the report says which it was.

Errors a person can cause or meet (a bad ``--since``, an unreadable or invalid policy, Kafka down)
are one sentence and a non-zero exit.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import click

from pipeline.commands.output import Column, emit, emit_object, joined

REPLAY_CLIENT_ID = "xidflow-replay"


@dataclass
class History:
    """What was read: per partition, the records that may hold a fault (noise is only counted)."""

    partitions: list[list[Any]] = field(default_factory=list)
    read: int = 0
    noise: int = 0
    topics: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


async def read_history(bootstrap: str | None, topics: list[str], since_ms: int, until_ms: int,
                       health_topic: str, timeout_s: float = 30.0) -> History:
    """Read ``[since, until)`` of the raw topics, up to their end offsets at the start; commit nothing."""
    from aiokafka import TopicPartition
    from aiokafka.errors import KafkaConnectionError

    from pipeline.detection.parse_core import ParseCore
    from pipeline.detection.parse_settings import ParseSettings
    from pipeline.kafka import clients as kafka_clients
    from pipeline.kafka import upstream
    from pipeline.replay.window import RawLog

    gate = ParseCore(settings=ParseSettings(shape_check_every=0))  # the parse stage's own noise gate
    consumer = kafka_clients.consumer(
        bootstrap=bootstrap, group_id=None, enable_auto_commit=False, client_id=REPLAY_CLIENT_ID,
        auto_offset_reset="earliest", request_timeout_ms=int(timeout_s * 1000),
    )
    history = History()
    try:
        try:
            await asyncio.wait_for(consumer.start(), timeout_s)
        except TimeoutError:
            raise KafkaConnectionError(f"no answer within {timeout_s:g}s") from None
        present = await consumer.topics()
        if any(t in present and not consumer.partitions_for_topic(t) for t in topics):
            await upstream.refresh_metadata(consumer)  # topics() fetched metadata apart from the client's
        tps: list[TopicPartition] = []
        for topic in topics:
            if topic not in present:
                history.missing.append(topic)
                continue
            history.topics.append(topic)
            tps += [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        if not tps:
            return history
        ends = await consumer.end_offsets(tps)
        found = await consumer.offsets_for_times({tp: since_ms for tp in tps})
        consumer.assign(tps)
        todo: dict[TopicPartition, list[Any]] = {}
        for tp in tps:
            start = found[tp].offset if found.get(tp) is not None else ends[tp]
            if start < ends[tp]:
                consumer.seek(tp, start)
                todo[tp] = []
        by_tp = dict(todo)
        while todo:
            batches = await consumer.getmany(*todo, timeout_ms=1000, max_records=20_000)
            for tp, msgs in batches.items():
                msgs = [m for m in msgs if m.offset < ends[tp]]
                if not msgs:
                    continue
                kept = [m for m in msgs if m.timestamp < until_ms]
                history.read += len(kept)
                if tp.topic == health_topic:
                    wanted = list(range(len(kept)))
                else:
                    wanted = gate.candidates([m.value for m in kept])
                history.noise += len(kept) - len(wanted)
                by_tp[tp] += [
                    RawLog(m.topic, m.partition, m.offset, m.key, m.value, m.timestamp, tuple(m.headers or ()))
                    for m in (kept[i] for i in wanted)
                ]
                if msgs[-1].offset + 1 >= ends[tp]:
                    todo.pop(tp, None)  # at the end offset taken at the start (timestamps need not grow)
            for tp in list(todo):
                if await consumer.position(tp) >= ends[tp]:
                    todo.pop(tp)
        history.partitions = [by_tp[tp] for tp in tps if by_tp.get(tp)]
        return history
    finally:
        await consumer.stop()


@dataclass
class ClusterView:
    labels: dict[str, dict[str, str]] = field(default_factory=dict)
    policies: Any = None
    baseline: str = ""


async def read_cluster(kube: Any, selector: str, settings: Any) -> ClusterView:
    """GPU node labels and the policies in force, by GET/LIST only (never the policy status writes)."""
    from pipeline.actuator.policy import API_GROUP, API_VERSION, RESCUE_PLURAL, STANDBY_PLURAL, load_yaml_file
    from pipeline.actuator.policystore import PolicyStore

    view = ClusterView()
    for node in await kube.list_nodes(selector):
        meta = node.get("metadata") or {}
        view.labels[meta.get("name", "")] = dict(meta.get("labels") or {})
    use_crds = settings.policy_source == "crd" or (
        settings.policy_source == "auto" and await kube.crd_installed(f"{RESCUE_PLURAL}.{API_GROUP}")
    )
    if use_crds:
        store = PolicyStore(None, settings)  # its validation and "last valid version" rules, without its writes
        listed = []
        for plural in (RESCUE_PLURAL, STANDBY_PLURAL):
            page = await kube.list_cluster_objects_page(API_GROUP, API_VERSION, plural, settings.policy_label_selector)
            listed += [(plural, doc) for doc in page.get("items") or []]
        names = [(doc.get("metadata") or {}).get("name", "") for plural, doc in listed if plural == RESCUE_PLURAL]
        view.policies = store.evaluate(listed)
        shown = ", ".join(sorted(names)) or "none, so the built-in default"
        view.baseline = f"RescuePolicy objects in the cluster ({shown})"
    elif settings.policy_file:
        view.policies = load_yaml_file(settings.policy_file)
        view.baseline = f"the actuator's policy file {settings.policy_file} (XIDFLOW_ACTUATOR_POLICY_FILE)"
    return view


def _load_policy(path: str, what: str) -> Any:
    from pipeline.actuator.policy import PolicyError, load_yaml_file

    try:
        return load_yaml_file(path)
    except OSError as exc:
        raise click.ClickException(f"cannot read the {what} {path}: {exc.strerror or exc}") from None
    except PolicyError as exc:
        raise click.ClickException(f"the {what} {path} is invalid: {exc}") from None


NODE_COLUMNS = [
    Column("node", lambda r: str(r["node"])),
    Column("quarantined", lambda r: "yes" if r["quarantined"] else "no"),
    Column("actions", lambda r: joined(r["actions"])),
    Column("gpus", lambda r: joined(r["gpus"])),
    Column("breaker", lambda r: "refused" if r["refused_by_breaker"] else "-"),
    Column("first", lambda r: str(r["first"] or "-")),
    Column("rules", lambda r: joined(r["rules"])),
    Column("faults", lambda r: joined(r["faults"]), wide_only=True),
    Column("incidents", lambda r: str(r["incidents"]), wide_only=True),
    Column("recovered", lambda r: str(r["recovered"]), wide_only=True),
]
ACTION_COLUMNS = [
    Column("action", lambda r: str(r["action"])),
    Column("applied", lambda r: str(r["applied"])),
    Column("nodes", lambda r: str(r["nodes"])),
    Column("gpus", lambda r: str(r["gpus"])),
]
DIFF_COLUMNS = [
    Column("node", lambda r: str(r["node"])),
    Column("action", lambda r: str(r["action"])),
    Column("change", lambda r: "+ added" if r["change"] == "added" else "- removed"),
    Column("gpus", lambda r: joined(r["gpus"])),
    Column("candidate-rules", lambda r: joined(r["candidate_rules"])),
    Column("baseline-rules", lambda r: joined(r["baseline_rules"])),
]
TRIP_COLUMNS = [
    Column("policy", lambda r: str(r["policy"])),
    Column("tripped-at", lambda r: str(r["at"])),
    Column("tripped-by", lambda r: str(r["tripped_by"])),
    Column("nodes-refused", lambda r: str(r["nodes_refused"])),
    Column("refusals", lambda r: str(r["refusals"])),
    Column("refused", lambda r: joined(r["refused"]), wide_only=True),
    Column("reason", lambda r: str(r["reason"]), wide_only=True),
]


PART_COLUMNS = [
    Column("shared-part", lambda r: r["part"]),
    Column("nodes", lambda r: str(len(r["nodes"]))),
    Column("faults", lambda r: joined(r["faults"])),
    Column("opened", lambda r: str(r["opened"])),
    Column("node-names", lambda r: joined(r["nodes"]), wide_only=True),
]


def print_report(rep: Mapping[str, Any], output: str) -> None:
    """JSON/YAML: the report object. Table: a header of facts, then one table per section."""
    if output in ("json", "yaml"):
        emit_object(rep, [], output)
        return
    h = rep["history"]
    click.echo(f"Window:   {rep['window']['since']} .. {rep['window']['until']} ({', '.join(rep['topics']) or 'none'})")
    click.echo(f"History:  {h['records_read']} records read, {h['noise']} noise, {h['fault_events']} fault events, "
               f"{h['incident_records']} incident records, {h['dead_letters']} dead letters")
    click.echo(f"Policy:   {rep['policy']}")
    click.echo(f"Catalog:  {rep['catalog']}")
    click.echo(f"Baseline: {rep['baseline']}")
    click.echo(f"Fleet:    {rep['fleet']['size']} GPU nodes ({rep['fleet']['source']})")
    sections = (
        ("Nodes the candidate policy would have acted on", rep["nodes"], NODE_COLUMNS,
         "no node would have been touched"),
        ("Actions", rep["actions"], ACTION_COLUMNS, "no action"),
        ("Diff against the baseline", rep["diff"], DIFF_COLUMNS, "no difference: both policies act the same"),
        ("Shared parts blamed (sharedParts), not their nodes", rep.get("shared_parts") or [], PART_COLUMNS,
         "no shared part"),
        ("Breaker trips", rep["breaker_trips"], TRIP_COLUMNS, "the breaker would not have tripped"),
    )
    for title, rows, columns, empty in sections:
        click.echo("")
        click.echo(f"{title}:")
        if rows:
            emit(rows, columns, output)
        else:
            click.echo(f"  ({empty})")
    click.echo("")
    click.echo("Nothing was changed on the cluster and no consumer offsets were committed. Assumed: "
               + "; ".join(rep["assumptions"][:3]) + ".")


@click.command("replay")
@click.option("--policy", "policy_file", required=True, type=str,
              help="Candidate RescuePolicy/WarmStandbyPolicy YAML (the layout of deploy/examples/policies.yaml).")
@click.option("--since", required=True, help="Start of the window: a duration ago (7d, 12h, 30m) or an ISO-8601 time.")
@click.option("--until", default=None, help="End of the window (a duration ago or an ISO-8601 time) [default: now].")
@click.option("--catalog-overrides", default=None, type=str,
              help="Candidate catalog overrides YAML [default: the catalog in force, XIDFLOW_CATALOG_OVERRIDES].")
@click.option("--baseline-policy", default=None, type=str,
              help="Policy YAML to diff against [default: the policies in force on the cluster].")
@click.option("--fleet-size", type=click.IntRange(1), default=None,
              help="GPU nodes in the fleet, the breaker's denominator [default: from the cluster, else the nodes "
                   "seen in the history].")
@click.option("--kubeconfig", envvar="KUBECONFIG", default=None, help="Kubeconfig file [env KUBECONFIG].")
@click.option("--context", default=None, help="Kubeconfig context to use (as kubectl --context).")
@click.option("--selector", "-l", default=None,
              help="GPU fleet label selector [default XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR].")
@click.option("--no-cluster", is_flag=True,
              help="Do not read the cluster (baseline: --baseline-policy or the default).")
@click.option("-o", "--output", "output", type=click.Choice(("table", "wide", "json", "yaml")), default="table",
              show_default=True, help="table (aligned columns), wide (more columns), json or yaml.")
def replay(policy_file: str, since: str, until: str | None, catalog_overrides: str | None,
           baseline_policy: str | None, fleet_size: int | None, kubeconfig: str | None, context: str | None,
           selector: str | None, no_cluster: bool, output: str) -> None:
    """Show what a candidate policy would have done on the retained raw logs, against the policy in force.

    Reads the raw topics from --since to their end (without a consumer group: nothing is committed),
    runs the worker's parsing and aggregation and the actuator's planning and circuit breaker in
    dry-run with the records' timestamps as the clock, and changes nothing anywhere.
    """
    from pipeline.commands.status import _settings, sentences
    from pipeline.detection.catalog import Catalog, CatalogError
    from pipeline.replay.config import ReplayConfig
    from pipeline.replay.report import report
    from pipeline.replay.run import simulate
    from pipeline.replay.window import WindowError, make_window, merged

    now = time.time()
    try:
        window = make_window(since, until, now)
    except WindowError as exc:
        raise click.ClickException(f"bad --since/--until: {exc}.") from None
    candidate = _load_policy(policy_file, "policy")
    if catalog_overrides is not None:
        if not os.path.isfile(catalog_overrides):
            raise click.ClickException(f"cannot read the catalog overrides {catalog_overrides}: no such file")
        try:
            Catalog.load(overrides=catalog_overrides)
        except CatalogError as exc:
            raise click.ClickException(f"the catalog overrides {catalog_overrides} are invalid: {exc}") from None
        except OSError as exc:
            raise click.ClickException(
                f"cannot read the catalog overrides {catalog_overrides}: {exc.strerror or exc}") from None
    settings = _settings(selector)
    from pipeline.aggregate.settings import AggregationSettings
    from pipeline.app import WorkerSettings
    from pipeline.detection.parse_settings import ParseSettings
    from pipeline.runtime.settings import TopicNames

    # Every setting is read (and refused with its variable named) before anything connects.
    topics = TopicNames()
    common: dict[str, Any] = {
        "actuator": settings, "aggregation": AggregationSettings(), "parse": ParseSettings(), "topics": topics,
        "tick_interval_s": WorkerSettings().tick_interval_s, "fleet_size": fleet_size,
    }
    baseline = _load_policy(baseline_policy, "baseline policy") if baseline_policy else None
    baseline_source = f"the policy file {baseline_policy} (--baseline-policy)" if baseline_policy else ""
    cluster = ClusterView()
    if not no_cluster:
        cluster, note = _cluster(kubeconfig, context, settings)
        if note:
            click.echo(note, err=True)
    if baseline is None:
        if cluster.policies is not None:
            baseline, baseline_source = cluster.policies, cluster.baseline
        else:
            from pipeline.actuator.policy import PolicySet

            baseline = PolicySet()
            why = "--no-cluster" if no_cluster else "the cluster's policies could not be read"
            baseline_source = f"the built-in default policy (quarantine per the catalog), as {why}"

    bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    with sentences(kafka_note=" Nothing was read, nothing was changed."):
        history = asyncio.run(read_history(
            bootstrap, topics.raw_inputs, int(window.since * 1000), int(window.until * 1000),
            topics.name("health_checks"),
        ))
    if not history.topics:
        raise click.ClickException(
            f"none of the raw topics exists on Kafka ({', '.join(topics.raw_inputs)}); is XIDFLOW_TOPIC_PREFIX right?")
    common["fleet_labels"] = cluster.labels
    with sentences():
        records = list(merged(history.partitions))
        cand = simulate(records, ReplayConfig(policies=candidate, catalog_overrides=catalog_overrides,
                                                         **common), window)
        base = simulate(records, ReplayConfig(policies=baseline, **common), window)
    rep = report(
        cand, base, window=window, policy=policy_file, baseline_source=baseline_source,
        catalog=(f"{catalog_overrides} (--catalog-overrides)" if catalog_overrides
                 else "the catalog in force" + (" (XIDFLOW_CATALOG_OVERRIDES)"
                                                 if os.environ.get("XIDFLOW_CATALOG_OVERRIDES") else "")),
        topics=history.topics,
    )
    rep["history"] = {"records_read": history.read, "noise": history.noise, **rep["history"]}
    if history.missing:
        rep["missing_topics"] = history.missing
    print_report(rep, output)


def _cluster(kubeconfig: str | None, context: str | None, settings: Any) -> tuple[ClusterView, str]:
    """The cluster's view, or an empty one and a sentence saying why it could not be read."""
    from pipeline.commands.status import make_kube, resolve_kubeconfig

    try:
        path = resolve_kubeconfig(kubeconfig, context)
        kube = make_kube(path)
    except click.ClickException as exc:
        return ClusterView(), f"note: the cluster is not read ({exc.message})"
    try:
        return asyncio.run(read_cluster(kube, settings.gpu_node_selector, settings)), ""
    except Exception as exc:  # noqa: BLE001 - the replay goes on without the cluster, and says so
        return ClusterView(), f"note: the cluster could not be read ({type(exc).__name__}: {exc})"
    finally:
        kube.close()
