"""``xidflow bench``: throughput against a raw Kafka consumer, and end-to-end latency."""

from __future__ import annotations

import asyncio
import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import click


@click.command("bench")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the results to this JSON file.",
)
@click.option("--records", type=int, default=200_000, show_default=True, help="Records for the throughput run.")
@click.option("--repeats", type=int, default=3, show_default=True, help="Interleaved throughput runs (best of).")
@click.option("--latency-samples", type=int, default=200, show_default=True, help="Faults timed end to end.")
@click.option(
    "--noise-rate",
    type=float,
    default=10_000.0,
    show_default=True,
    help="Background noise lines/s during the latency run.",
)
@click.option(
    "--sections",
    default="throughput,latency,flood,parse,storm,burst,failover,rolling",
    show_default=True,
    help="Comma-separated sections to run (e.g. --sections burst --nodes 100 for a quick run).",
)
@click.option("--nodes", type=click.IntRange(1, 5000), default=500, show_default=True,
              help="Nodes that each get one fatal kernel line in the burst, failover and rolling sections.")
@click.option("--storm-nodes", type=click.IntRange(1, 5000), default=500, show_default=True,
              help="Nodes that get a fatal Xid at once in the actuator storm.")
@click.option("--fleet", type=click.IntRange(1, 100_000), default=10_000, show_default=True,
              help="GPU nodes of the scale section's large fleet (--sections scale; the burst is --nodes of them).")
@click.option(
    "--bootstrap",
    envvar="KAFKA_BOOTSTRAP_SERVERS",
    default=None,
    help="Kafka to use; without it a local broker is started for the run.",
)
@click.option(
    "--save-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("bench-results"),
    show_default=True,
    help="Every run is saved here as bench-<time>.json.",
)
def bench(
    json_path: Path | None,
    records: int,
    repeats: int,
    latency_samples: int,
    noise_rate: float,
    sections: str,
    bootstrap: str | None,
    save_dir: Path,
    storm_nodes: int,
    nodes: int,
    fleet: int,
) -> None:
    """Measure the parse stage against a raw aiokafka consumer, and line-to-incident latency."""
    import orjson
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from pipeline.benchmarks.pipeline import SECTIONS, BenchContext, run_bench

    names = [s.strip() for s in sections.split(",") if s.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise click.BadParameter(f"unknown sections {unknown}; known: {sorted(SECTIONS)}", param_hint="--sections")
    console = Console()
    infra = None
    tmp = None
    kubeconfig = os.environ.get("KUBECONFIG")
    needs_kube = {"storm", "burst", "failover", "rolling", "scale"}
    if not bootstrap or (needs_kube & set(names) and not kubeconfig):
        from pipeline.localinfra.launcher import LocalInfra

        tmp = tempfile.TemporaryDirectory(prefix="xidflow-bench-")
        console.print("starting local infrastructure for this run (endpoints in the environment are used as given)")
        if bootstrap:
            os.environ["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
        from pipeline.benchmarks.pipeline import heartbeat_grace_s, heartbeat_lease_s, largest_fleet
        from pipeline.localinfra.controlplane import NODE_LEASE_S, NODE_MONITOR_GRACE_S

        infra = LocalInfra(Path(tmp.name), log=lambda m: console.print(f"[dim]local:[/] {m}"))
        lease = heartbeat_lease_s(largest_fleet(names, nodes, storm_nodes, fleet), NODE_LEASE_S)
        grace = heartbeat_grace_s(lease, NODE_LEASE_S, NODE_MONITOR_GRACE_S)
        console.print(f"node Leases of {lease} s (renewed every {lease / 4:g} s), lifecycle grace {grace} s")
        endpoints = infra.up(detach=False, node_lease_s=lease, node_monitor_grace_s=grace)
        bootstrap, kubeconfig = endpoints.kafka_bootstrap, endpoints.kubeconfig
    try:
        with Progress(
            TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(), console=console
        ) as progress:
            tasks: dict[str, int] = {}

            def report(task: str, done: float, total: float) -> None:
                if task not in tasks:
                    tasks[task] = progress.add_task(task, total=total)
                progress.update(tasks[task], completed=done, total=total)

            ctx = BenchContext(
                bootstrap=bootstrap,
                records=records,
                repeats=repeats,
                noise_rate=noise_rate,
                latency_samples=latency_samples,
                kubeconfig=kubeconfig,
                storm_nodes=storm_nodes,
                nodes=nodes,
                fleet=fleet,
                progress=report,
            )
            if infra is not None:
                ctx.results.update(heartbeat_lease_s=lease, node_monitor_grace_s=grace)
            results = asyncio.run(run_bench(ctx, names))
    finally:
        if infra is not None:
            infra.down(quiet=True)
        if tmp is not None:
            tmp.cleanup()

    table = Table(title="xidflow bench")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("raw aiokafka consumer", "raw_consume_rate", "{:,.0f} records/s"),
        ("parse stage", "pipeline_rate", "{:,.0f} records/s"),
        ("parse stage / raw consumer", "ratio", "{:.1%}"),
        ("raw consumer, per CPU second", "raw_consume_rate_cpu", "{:,.0f} records/s"),
        ("parse stage, per CPU second", "pipeline_rate_cpu", "{:,.0f} records/s"),
        ("ratio, CPU time", "ratio_cpu", "{:.1%}"),
        ("latency p50 (line -> incident)", "latency_p50_ms", "{:.1f} ms"),
        ("latency p99", "latency_p99_ms", "{:.1f} ms"),
        ("latency samples", "latency_samples", "{}"),
        ("background noise achieved", "background_noise_lines_per_s", "{:,.0f} lines/s"),
        ("flood: good node p50 without a flood (line -> incident)", "flood_quiet_p50_ms", "{:,.0f} ms"),
        ("flood: good node p99 without a flood", "flood_quiet_p99_ms", "{:,.0f} ms"),
        ("flood: good node p50 while another node floods", "flood_p50_ms", "{:,.0f} ms"),
        ("flood: good node p99 while another node floods", "flood_p99_ms", "{:,.0f} ms"),
        ("flood: p50 flooded / quiet", "flood_vs_quiet_p50_ratio", "{:.2f}"),
        ("flood: p99 flooded / quiet", "flood_vs_quiet_p99_ratio", "{:.2f}"),
        ("flood: p50 of good nodes on other partitions", "flood_other_partitions_p50_ms", "{:,.0f} ms"),
        ("flood: p99 of good nodes on other partitions", "flood_other_partitions_p99_ms", "{:,.0f} ms"),
        ("flood: p50 of good nodes on the flooder's partition", "flood_same_partition_p50_ms", "{:,.0f} ms"),
        ("flood: p99 of good nodes on the flooder's partition", "flood_same_partition_p99_ms", "{:,.0f} ms"),
        ("flood: good faults without an incident after 60 s", "flood_missing", "{}"),
        ("flood: rate the flooding node sent", "flood_mb_per_s", "{:,.1f} MB/s"),
        ("flood: the flooding node's dead letters by code", "flood_deadletters", "{}"),
        ("storm: nodes quarantined at once", "storm_nodes", "{}"),
        ("storm: seconds until all quarantined", "storm_seconds", "{:.2f} s"),
        ("storm: nodes quarantined per second", "storm_nodes_per_s", "{:,.0f} nodes/s"),
        ("raw API writes of the same patches", "raw_nodes_per_s", "{:,.0f} nodes/s"),
        ("storm / raw write rate (goal >= 0.5)", "storm_vs_raw_ratio", "{:.2f}"),
        ("burst: nodes, one fatal line each at once", "burst_samples", "{}"),
        ("burst p50 (line -> taint)", "burst_p50_ms", "{:,.0f} ms"),
        ("burst p99 (goal < 1000 ms)", "burst_p99_ms", "{:,.0f} ms"),
        ("burst max", "burst_max_ms", "{:,.0f} ms"),
        ("burst: worker p99 (line -> incident, goal < 250 ms)", "burst_worker_p99_ms", "{:,.0f} ms"),
        ("burst: bare client, the same taints", "burst_raw_ms", "{:,.0f} ms"),
        ("burst p99 / bare client (goal <= 1.15)", "burst_vs_raw_ratio", "{:.2f}"),
        ("burst: CPU per quarantined node, every process, to settled", "burst_cpu_ms_per_node", "{:,.2f} ms"),
        ("burst: bare client's CPU per node, every process", "burst_raw_cpu_ms_per_node", "{:,.2f} ms"),
        ("burst: CPU per node / bare client's (goal <= 1.5)", "burst_cpu_per_node_ratio", "{:.2f}"),
        ("burst: the same, each process's idle use taken off", "burst_cpu_per_node_net_ratio", "{:.2f}"),
        ("burst: Kafka requests per node (broker's count)", "burst_kafka_requests_per_node", "{:,.1f}"),
        ("burst: Kafka socket bytes per node, in + out", "burst_kafka_bytes_per_node", "{:,.0f} B"),
        ("burst: API server requests per node, to settled", "burst_cost_api_requests_per_node", "{:,.1f}"),
        ("burst: bare client's API server requests per node", "burst_raw_cost_api_requests_per_node", "{:,.1f}"),
        ("burst floor: bare Kafka consumer -> bare client, p99", "burst_floor_p99_ms", "{:,.0f} ms"),
        ("burst floor p99 / bare client (the least any Kafka pipeline does)", "burst_floor_vs_raw_ratio", "{:.2f}"),
        ("failover, actuator child SIGKILLed: p99 (goal < 5000 ms)", "failover_actuator_p99_ms", "{:,.0f} ms"),
        ("failover, actuator: lines over 5 s", "failover_actuator_over_5s", "{}"),
        ("failover, actuator: kill to back in group", "failover_actuator_restart_s", "{:.1f} s"),
        ("failover, worker child SIGKILLed: p99 (goal < 5000 ms)", "failover_worker_p99_ms", "{:,.0f} ms"),
        ("failover, worker: lines over 5 s", "failover_worker_over_5s", "{}"),
        ("failover, worker: kill to back in groups", "failover_worker_restart_s", "{:.1f} s"),
        ("failover, actuator process (not its child) killed: p99", "failover_actuator_process_p99_ms", "{:,.0f} ms"),
        ("failover, actuator process: kill to back in group", "failover_actuator_process_restart_s", "{:.1f} s"),
        ("failover, worker process (not its child) killed: p99", "failover_worker_process_p99_ms", "{:,.0f} ms"),
        ("failover, worker process: kill to back in groups", "failover_worker_process_restart_s", "{:.1f} s"),
        ("failover, actuator lost for good: p99", "failover_lost_actuator_p99_ms", "{:,.0f} ms"),
        ("failover, actuator lost: kill to survivor holding all", "failover_lost_actuator_takeover_s", "{:.1f} s"),
        ("failover, worker lost for good (2 workers): p99", "failover_lost_worker_p99_ms", "{:,.0f} ms"),
        ("failover, worker lost: kill to survivor holding all", "failover_lost_worker_takeover_s", "{:.1f} s"),
        ("failover, worker lost: kill to session expired", "failover_lost_worker_expired_s", "{:.2f} s"),
        ("failover, worker lost: kill to rebalanced", "failover_lost_worker_rebalanced_s", "{:.2f} s"),
        ("failover, lost: session timeout (goal: p99 < it + 2 s)", "failover_lost_worker_session_timeout_s",
         "{:.0f} s"),
        ("rolling SIGTERM restart: p99 (goal < 1000 ms)", "rolling_p99_ms", "{:,.0f} ms"),
        ("rolling: lines over 5 s / lines", "rolling_over_5s", "{}"),
        ("rolling: longest rebalance (12 a run; heartbeat sets it)", "rolling_rebalance_max_ms", "{:,.0f} ms"),
        ("scale: GPU nodes", "scale_fleet", "{:,}"),
        ("scale: fleet created in", "scale_create_s", "{:.1f} s"),
        ("scale: actuators start to steady state", "scale_steady_s", "{:.1f} s"),
        ("scale: base fleet steady state", "scale_base_steady_s", "{:.1f} s"),
        ("scale: actuator peak RSS during start (goal < 500 MB)", "scale_actuator_start_peak_rss_mb", "{:,.0f} MB"),
        ("scale: actuator RSS at rest", "scale_actuator_rss_mb", "{:,.0f} MB"),
        ("scale: base fleet actuator RSS at rest", "scale_base_actuator_rss_mb", "{:,.0f} MB"),
        ("scale: actuator CPU at rest (median second)", "scale_actuator_cpu_rest_pct", "{:.1f} %"),
        ("scale: node Lease duration (KWOK renews every quarter)", "scale_heartbeat_lease_s", "{} s"),
        ("scale: Lease renewals per second at rest", "scale_heartbeats_per_s", "{:,.0f}"),
        ("scale: actuator CPU, busiest second (resync)", "scale_actuator_cpu_resync_pct", "{:.1f} %"),
        ("scale: xidflow status on the fleet", "scale_status_s", "{:.2f} s"),
        ("scale: xidflow status on the base fleet", "scale_base_status_s", "{:.2f} s"),
        ("scale: xidflow breaker status", "scale_breaker_status_s", "{:.2f} s"),
        ("scale: breaker counted / fleet size", "scale_breaker_counted", "{}"),
        ("scale: burst p99 inside the fleet", "scale_burst_p99_ms", "{:,.0f} ms"),
        ("scale: actuator group rebalances during that burst", "scale_burst_rebalances", "{}"),
        ("scale: the same burst on the base fleet", "scale_base_burst_p99_ms", "{:,.0f} ms"),
        ("scale: burst p99 fleet / base, pairs one after the other", "scale_burst_vs_base_pair_ratios", "{}"),
        ("scale: burst p99 fleet / base, median of the pairs", "scale_burst_vs_base_ratio", "{:.2f}"),
        ("scale: both fleets bursting at once, fleet / base", "scale_burst_vs_base_together_pair_ratios", "{}"),
        ("scale: the same, median (goal <= 1.10; one load for both)", "scale_burst_vs_base_together_ratio",
         "{:.2f}"),
        ("scale: bare client, same writes", "scale_raw_burst_ms", "{:,.0f} ms"),
        ("scale: burst p99 / bare client", "scale_burst_vs_raw_ratio", "{:.2f}"),
        ("scale: base burst p99 / bare client", "scale_base_burst_vs_raw_ratio", "{:.2f}"),
        ("scale: the two ratios above, fleet / base", "scale_burst_vs_base_raw_normalized", "{:.2f}"),
    ]
    for label, key, fmt in rows:
        if results.get(key) is not None:
            table.add_row(label, fmt.format(results[key]))
    for proc, pct in (results.get("scale_rest_cpu_pct") or {}).items():
        table.add_row(f"scale: CPU at rest, {proc} (mean)", f"{pct:.1f} %")
    for key, split in results.items():
        if key.endswith("_cpu_split") and isinstance(split, dict):
            for proc, both in split.items():
                table.add_row(f"{key.removesuffix('_cpu_split')} CPU per node: {proc} (pipeline / bare)",
                              f"{both['pipeline']:,.2f} / {both['bare']:,.2f} ms")
    parse = results.get("parse")
    if isinstance(parse, dict) and "parse_lines_per_s" in parse:
        table.add_row("pure parse (one core)", f"{parse['parse_lines_per_s']:,.0f} lines/s")
    for key, value in results.items():
        if key.endswith("_error"):
            table.add_row(f"[red]{key}", str(value))
    console.print(table)
    data = orjson.dumps(results, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY)
    save_dir.mkdir(parents=True, exist_ok=True)
    saved = save_dir / f"bench-{datetime.now(UTC).strftime('%Y%m%dT%H%M%SZ')}.json"
    saved.write_bytes(data)
    console.print(f"saved {saved}")
    if json_path is not None:
        json_path.write_bytes(data)
        console.print(f"wrote {json_path}")
    if any(k.endswith("_error") for k in results):
        raise SystemExit(1)
