"""Fleet scale: the burst scenario on a 10,000-node fleet, next to the same burst on a small fleet.

Two worlds of ``pipeline.benchmarks.burst`` run one after the other in the same run, each with a
real worker and two real ``xidflow actuator`` replicas: a base fleet of ``nodes`` GPU nodes and a
large one of ``fleet`` GPU nodes (created through the API as KWOK does: labels, capacity and status
in one create call), where the same ``nodes`` nodes get the fatal line. Each world measures:

- ``*_create_s``: creating the fleet; ``*_members_s`` / ``*_steady_s``: from the processes' start
  until the groups are Stable / until every node carries xidflow's own conditions (the actuators'
  list + watch + one status patch per node: the steady state);
- ``*_actuator_*``: each actuator's memory and CPU read from ``/proc/<pid>/status`` and ``/stat``:
  at steady state (VmHWM: the peak of its start, the initial list included), then sampled every
  0.1 s for two resync periods at rest (``cpu_rest_pct``: the median 1 s window; ``cpu_resync_pct``:
  the busiest one, where a resync pass of every node falls);
- the bare client's quarantine writes on ``nodes`` other nodes (the storm's baseline, same API
  server, same fleet in it): ``*_raw_burst_ms`` is the time it needs for them;
- the burst (``scale_burst_p99_ms``, and ``scale_base_burst_p99_ms`` on the base fleet);
- after it, ``xidflow status`` and ``xidflow breaker status`` as subprocesses on the whole fleet
  (wall time; the breaker's ``counted`` and ``fleet_size``);
- ``*_burst_rebalances``: the actuator group's membership warnings (aiokafka's "rebalancing", "member_id
  was not recognized", "session expired") in the actuators' logs from the burst's start until its end:
  0 says the burst ran on one stable assignment. Teardown's orderly leave, which the logs show about a
  minute after the start, is not counted.

The base fleet runs twice, before and after the large one (``scale_base_*``, ``scale_base2_*``): the
machine is shared and its speed drifts. Ratios: ``scale_burst_vs_base_ratio`` (goal <= 1.10; over the
mean of the two base bursts), ``scale_burst_vs_raw_ratio``, ``scale_burst_vs_base_raw_normalized``
(each burst over the bare client's time just before it, large over base), and per-node
ratios of steady-state time, memory and status time between the two fleets (a linear cost gives a
per-node ratio near 1; a super-linear one grows with the fleet). Not a test: it returns numbers.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any

import orjson

from pipeline.actuator.kube import Kube
from pipeline.actuator.testing import create_nodes, delete_nodes
from pipeline.benchmarks import procstat
from pipeline.benchmarks.burst import run_scenario
from pipeline.benchmarks.burst_watch import TAINT_KEY
from pipeline.benchmarks.burst_world import World
from pipeline.benchmarks.storm import raw_quarantine_rate

REBALANCE_MARKS = (b"because it is rebalancing", b"member_id was not recognized", b"session expired",
                   b"generation id is not")
"""What aiokafka logs at WARNING or above, in one member at least, when the group rebalances or loses it."""

RESYNC_S = 10.0
"""The actuators' resync period (``XIDFLOW_ACTUATOR_RESYNC_SECONDS``' default): the rest is sampled for two."""


def _actuator_pids(world: World) -> dict[str, int]:
    # The supervised child does the work (and holds the memory): the supervisor itself only waits.
    return {n: p.work_pid() for n, p in world.procs.items() if n.startswith("actuator") and p.proc is not None}


async def _cli(world: World, *args: str) -> tuple[float, bytes]:
    """Wall seconds of ``xidflow <args>`` as a person runs it against the world's fleet, and its stdout."""
    env = {**os.environ, "KUBECONFIG": world.kubeconfig}
    start = time.monotonic()
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "pipeline.cli", *args, "--selector", world.selector, "-n", world.namespace],
        env=env,
        capture_output=True,
        check=False,
    )
    took = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError(f"xidflow {' '.join(args)} failed: {done.stderr.decode(errors='replace')[-500:]}")
    return took, done.stdout


def rebalance_marks(text: bytes) -> int:
    """Lines of an actuator's log that say its group rebalanced or dropped it (``REBALANCE_MARKS``). Pure."""
    return sum(any(m in line for m in REBALANCE_MARKS) for line in text.splitlines())


def _log_sizes(world: World) -> dict[str, int]:
    return {n: p.log.stat().st_size if p.log.exists() else 0
            for n, p in world.procs.items() if n.startswith("actuator")}


def _marks_since(world: World, sizes: dict[str, int]) -> int:
    count = 0
    for name, size in sizes.items():
        with world.procs[name].log.open("rb") as f:
            f.seek(size)
            count += rebalance_marks(f.read())
    return count


def _per_replica(key: str, values: dict[str, float]) -> dict[str, Any]:
    return {key: max(values.values()), f"{key}_by_replica": values}


async def _at_rest(prefix: str, world: World) -> dict[str, Any]:
    """Steady-state timings, memory and CPU of the actuators, and the bare client's writes."""
    out: dict[str, Any] = {f"{prefix}_fleet": world.fleet_size}
    out.update({f"{prefix}_{k}": v for k, v in world.timings.items()})
    pids = _actuator_pids(world)
    world.progress(f"{prefix}: at rest", 0, 1)
    samples = await procstat.sample(pids, 2 * RESYNC_S + 1)
    world.progress(f"{prefix}: at rest", 1, 1)
    usage = {name: procstat.usage(s) for name, s in samples.items()}
    steady = world.steady
    out.update(_per_replica(f"{prefix}_actuator_start_cpu_s", {n: round(s.cpu_s, 1) for n, s in steady.items()}))
    out.update(_per_replica(f"{prefix}_actuator_start_peak_rss_mb", {n: round(s.hwm_kb / 1024, 1)
                                                                       for n, s in steady.items()}))
    out.update(_per_replica(f"{prefix}_actuator_rss_mb", {n: u.rss_mb for n, u in usage.items()}))
    out.update(_per_replica(f"{prefix}_actuator_cpu_rest_pct", {n: u.cpu_median_pct for n, u in usage.items()}))
    out.update(_per_replica(f"{prefix}_actuator_cpu_resync_pct", {n: u.cpu_max_pct for n, u in usage.items()}))
    out.update(_per_replica(f"{prefix}_actuator_cpu_mean_pct", {n: u.cpu_mean_pct for n, u in usage.items()}))
    # The bare client's writes on as many other nodes (outside the actuators' selector), this API server, now.
    raw = [f"{world.tag}-raw-{i:05d}" for i in range(world.nodes)]
    world.others += raw
    await create_nodes(world.kube, raw, {"xidflow.bench/scale-raw": world.tag}, gpu=True)
    kube = Kube.from_config(world.kubeconfig, 32)
    try:
        rate = await raw_quarantine_rate(kube, raw, TAINT_KEY, 32)
    finally:
        kube.close()
    out[f"{prefix}_raw_nodes_per_s"] = round(rate, 1)
    out[f"{prefix}_raw_burst_ms"] = round(world.nodes / rate * 1000, 1)
    await asyncio.sleep(2)  # the API server's own work after the writes is not the burst's
    return out


async def _after(prefix: str, world: World, rebalances: int) -> dict[str, Any]:
    """``xidflow status`` and ``xidflow breaker status`` on the whole fleet, after the burst."""
    await delete_nodes(world.kube, world.others)
    world.others.clear()
    status_s, _ = await _cli(world, "status")
    breaker_s, text = await _cli(world, "breaker", "status", "-o", "json")
    breaker = orjson.loads(text)
    return {
        f"{prefix}_status_s": round(status_s, 2),
        f"{prefix}_breaker_status_s": round(breaker_s, 2),
        f"{prefix}_breaker_counted": breaker.get("counted"),
        f"{prefix}_breaker_fleet_size": breaker.get("fleet_size"),
        f"{prefix}_burst_rebalances": rebalances,
    }


def _ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 3) if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def _mean(*values: Any) -> float | None:
    known = [v for v in values if isinstance(v, int | float)]
    return sum(known) / len(known) if known else None


def ratios(r: dict[str, Any]) -> dict[str, Any]:
    """The scale section's ratios from its figures (absent figures give None). Pure.

    The base fleet's burst runs before and after the large one (``scale_base_*``, ``scale_base2_*``):
    the large fleet's burst is compared with their mean, so load that drifts during the run counts
    on both sides. ``scale_burst_vs_base_raw_normalized`` compares the two after dividing each burst by
    the bare client's time measured just before it (the API server's speed at that moment).
    """
    big, base = r.get("scale_fleet"), r.get("scale_base_fleet")
    size = _ratio(big, base)
    base_p99 = _mean(r.get("scale_base_burst_p99_ms"), r.get("scale_base2_burst_p99_ms"))
    vs_raw = _ratio(r.get("scale_burst_p99_ms"), r.get("scale_raw_burst_ms"))
    base_vs_raw = _mean(
        _ratio(r.get("scale_base_burst_p99_ms"), r.get("scale_base_raw_burst_ms")),
        _ratio(r.get("scale_base2_burst_p99_ms"), r.get("scale_base2_raw_burst_ms")),
    )
    out: dict[str, Any] = {
        "scale_burst_vs_base_ratio": _ratio(r.get("scale_burst_p99_ms"), base_p99),
        "scale_burst_vs_raw_ratio": vs_raw,
        "scale_base_burst_vs_raw_ratio": round(base_vs_raw, 3) if base_vs_raw is not None else None,
        "scale_burst_vs_base_raw_normalized": _ratio(vs_raw, base_vs_raw),
        "scale_fleet_ratio": size,
    }
    # Per node, large fleet over base fleet: about 1 when the cost is linear in the fleet, above when worse.
    for key in ("steady_s", "status_s", "breaker_status_s", "actuator_start_cpu_s"):
        grow = _ratio(r.get(f"scale_{key}"), r.get(f"scale_base_{key}"))
        out[f"scale_{key}_growth_per_node"] = round(grow / size, 3) if grow is not None and size else None
    return out


async def scale(
    bootstrap: str, kubeconfig: str, fleet: int, nodes: int, progress: Any = None
) -> dict[str, Any]:
    kw = {"progress": progress} if progress else {}

    def hooks(prefix: str) -> dict[str, Any]:
        logs: dict[str, int] = {}

        async def before(world: World) -> dict[str, Any]:
            out = await _at_rest(prefix, world)
            logs.update(_log_sizes(world))  # the burst starts after this hook
            return out

        async def after(world: World) -> dict[str, Any]:
            return await _after(prefix, world, _marks_since(world, logs))

        return {"before": before, "after": after}

    out: dict[str, Any] = {}
    out.update(await run_scenario(bootstrap, kubeconfig, nodes, "scale_base_burst", fleet=nodes,
                                  **hooks("scale_base"), **kw))
    out.update(await run_scenario(bootstrap, kubeconfig, nodes, "scale_burst", fleet=fleet,
                                  **hooks("scale"), **kw))
    out.update(await run_scenario(bootstrap, kubeconfig, nodes, "scale_base2_burst", fleet=nodes,
                                  **hooks("scale_base2"), **kw))
    out.update(ratios(out))
    return out
