"""Fleet scale: the burst scenario on a 10,000-node fleet, next to the same burst on a small fleet.

Two worlds of ``pipeline.benchmarks.burst_world`` run side by side on one API server, each with a real
worker and two real ``xidflow actuator`` replicas: a base fleet of ``nodes`` GPU nodes and a large one
of ``fleet`` GPU nodes, every one KWOK's (``machines.create_nodes``: Ready, its Lease renewed by KWOK as a
kubelet renews it, judged by the node lifecycle controller; the bench's control plane stretches the Lease
for a fleet this large, ``pipeline.benchmarks.pipeline.heartbeat_lease_s``). Their bursts take turns, in
pairs whose order flips (base, large | large, base | base, large ...):

- both bursts of a pair run against the same API server holding the same objects (both fleets; etcd's
  size and the apiserver's watch cache are the same for both), the other world's processes idle;
- a pair's two bursts are seconds apart, so the load of this shared machine, which moved the bare
  client's rate 5x within one run, is nearly the same for both; the flipped order cancels a drift that
  runs through the pairs. ``scale_burst_vs_base_ratio`` is the median of the pairs' ratios.

Running the worlds one after the other (base, large, base again, minutes apart) gave 0.17, 0.71,
1.21, 1.36 for the same code: each burst met another load on the machine and another API server (the
second base fleet ran on an etcd that had just held and deleted 10,000 nodes). Pairs seconds apart
still moved 0.61 to 4.71 under that load (14 pairs, four runs), so after the pairs both worlds also burst at the same
moment, their lines interleaved (``SIDE_BY_SIDE`` rounds, ``*_together_*`` figures,
``scale_burst_vs_base_together_ratio``): both bursts then meet the same load and the same API server,
and only what differs between the worlds, the fleet the actuators watch, can make one slower.

Every burst is ``nodes`` fresh nodes of its world that get one fatal line each: after a burst its nodes
are deleted and as many new ones created in their place (the fleet keeps its size), and the breaker
forgets the deleted nodes' admissions (its window would count them). The next burst starts when every
node carries xidflow's own conditions again and the previous burst's flows are done. Each world measures:

- ``*_create_s``: creating the fleet; ``*_members_s`` / ``*_steady_s``: from the processes' start
  until the groups are Stable / until every node carries xidflow's own conditions (the actuators'
  list + watch + one status patch per node: the steady state);
- ``*_actuator_*``: each actuator's memory and CPU read from ``/proc/<pid>/status`` and ``/stat``:
  at steady state (VmHWM: the peak of its start, the initial list included), then sampled every
  0.1 s for two resync periods at rest, both worlds at once (``cpu_rest_pct``: the median 1 s window;
  ``cpu_resync_pct``: the busiest one, where a resync pass of every node falls);
- the bare client's quarantine writes on ``nodes`` other nodes (the storm's baseline, same API
  server): ``*_raw_burst_ms`` is the time it needs for them;
- the bursts: ``*_burst_p99_ms`` the median of its bursts' p99s (each in ``*_burst_p99_ms_rounds``),
  with the stage split (``_delivery``: line to incident readable; ``_apply``: incident to taint seen)
  and ``*_burst_cpu_s``: CPU seconds per burst (median) of each process, the API server, etcd and
  Kafka (``kafka``) included, and the idle world's processes (``idle-*``): what the fleet's size costs;
- after the last burst, ``xidflow status`` and ``xidflow breaker status`` as subprocesses on the whole
  fleet (wall time; the breaker's ``counted`` and ``fleet_size``);
- ``*_burst_rebalances``: the actuator group's membership warnings (aiokafka's "rebalancing",
  "member_id was not recognized", "session expired") in the actuators' logs during its bursts: 0 says
  every burst ran on one stable assignment.

Ratios: ``scale_burst_vs_base_together_ratio`` (goal <= 1.10; the median of the side-by-side rounds'
ratios, the figure this machine's load does not move), ``scale_burst_vs_base_ratio`` (the median of the
pairs' ratios, ``scale_burst_vs_base_pair_ratios``), ``scale_burst_vs_raw_ratio``, and per-node ratios of steady-state
time, memory and status time between the two fleets (a linear cost gives a per-node ratio near 1; a
super-linear one grows with the fleet). Not a test: it returns numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from typing import Any

import orjson

from pipeline.actuator.configmap_state import update_json_configmap
from pipeline.actuator.kube import Kube
from pipeline.actuator.settings import ActuatorSettings
from pipeline.actuator.testing import create_nodes, delete_nodes
from pipeline.benchmarks import procstat
from pipeline.benchmarks.burst import cpu_spent, incident_times, stage_split, until
from pipeline.benchmarks.burst_watch import FATAL_LINE, TAINT_KEY, ConditionWatch, NodeWatch, kmsg, summarize
from pipeline.benchmarks.burst_world import IncidentTail, World, infra_pids, profile, stop_profile
from pipeline.benchmarks.storm import bare_client, raw_quarantine_rate
from pipeline.kafka import clients as kafka_clients

REBALANCE_MARKS = (b"because it is rebalancing", b"member_id was not recognized", b"session expired",
                   b"generation id is not")
"""What aiokafka logs at WARNING or above, in one member at least, when the group rebalances or loses it."""

RESYNC_S = 10.0
"""The actuators' resync period (``XIDFLOW_ACTUATOR_RESYNC_SECONDS``' default): the rest is sampled for two."""

PAIRS = 4
"""Pairs of bursts, one per world each, one world after the other. On this machine, shared with other
runs, one pair's ratio ranged 0.61 to 4.71 within one run (a burst met someone else's test run)."""

SIDE_BY_SIDE = 3
"""Rounds where both worlds burst at the same moment: whatever load the machine has then, both bursts
meet it, so their ratio does not move with it (``scale_burst_vs_base_together_ratio``)."""

SETTLE_S = 2.0
"""Quiet seconds before every burst: the API server's own work after the last writes is not the burst's."""

BASE, LARGE = "scale_base", "scale"


def burst_order(pairs: int) -> list[str]:
    """Which world bursts when: pairs of one burst each, the order flipped every pair. Pure.

    base, large | large, base | base, large ...: a load that grows (or falls) through the run is met
    first by one world and then by the other, so it does not favour either."""
    out: list[str] = []
    for i in range(pairs):
        out += [BASE, LARGE] if i % 2 == 0 else [LARGE, BASE]
    return out


def _actuator_pids(world: World) -> dict[str, int]:
    # The supervised child does the work (and holds the memory): the supervisor itself only waits.
    return {n: p.work_pid() for n, p in world.procs.items() if n.startswith("actuator") and p.proc is not None}


def _cpu(busy: World, idle: World, infra: dict[str, int]) -> dict[str, tuple[int, float]]:
    """name -> (pid, CPU seconds so far) of the bursting world's processes, the idle world's and the infra."""
    out: dict[str, tuple[int, float]] = {"bench": (os.getpid(), sum(os.times()[:2]))}
    for prefix, world in (("", busy), ("idle-", idle)):
        for name, proc in world.procs.items():
            if proc.alive():
                with contextlib.suppress(OSError):
                    pid = proc.work_pid()
                    out[prefix + name] = (pid, procstat.read(pid).cpu_s)
    for name, pid in infra.items():
        with contextlib.suppress(OSError):
            out[name] = (pid, procstat.read(pid).cpu_s)
    return out


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


async def _at_rest(worlds: dict[str, World], infra: dict[str, int]) -> dict[str, Any]:
    """Steady-state memory and CPU of every world's actuators, sampled together for two resync periods; with
    them every other process of the run (``scale_rest_cpu_pct``: the workers, the control plane and the broker,
    each its mean over the span), the node Leases' duration and the renewals a second that make it."""
    out: dict[str, Any] = {}
    pids = {(prefix, n): pid for prefix, w in worlds.items() for n, pid in _actuator_pids(w).items()}
    others = {f"{prefix}/{n}": p.work_pid() for prefix, w in worlds.items() for n, p in w.procs.items()
              if n.startswith("worker") and p.proc is not None}
    others.update(infra)
    progress = next(iter(worlds.values())).progress
    progress("at rest", 0, 1)
    samples = await procstat.sample({**{f"{p}/{n}": pid for (p, n), pid in pids.items()}, **others},
                                    2 * RESYNC_S + 1)
    progress("at rest", 1, 1)
    out["scale_rest_cpu_pct"] = {n: procstat.usage(samples[n]).cpu_mean_pct for n in sorted(others)}
    lease_s = await _lease_seconds(next(iter(worlds.values())))
    nodes = sum(w.fleet_size for w in worlds.values())
    out["scale_heartbeat_lease_s"] = lease_s
    out["scale_heartbeats_per_s"] = round(nodes / (lease_s / 4), 1) if lease_s else None
    for prefix, world in worlds.items():
        out[f"{prefix}_fleet"] = world.fleet_size
        out.update({f"{prefix}_{k}": v for k, v in world.timings.items()})
        usage = {n: procstat.usage(samples[f"{prefix}/{n}"]) for (p, n) in pids if p == prefix}
        steady = world.steady
        out.update(_per_replica(f"{prefix}_actuator_start_cpu_s", {n: round(s.cpu_s, 1) for n, s in steady.items()}))
        out.update(_per_replica(f"{prefix}_actuator_start_peak_rss_mb",
                                {n: round(s.hwm_kb / 1024, 1) for n, s in steady.items()}))
        out.update(_per_replica(f"{prefix}_actuator_rss_mb", {n: u.rss_mb for n, u in usage.items()}))
        out.update(_per_replica(f"{prefix}_actuator_cpu_rest_pct", {n: u.cpu_median_pct for n, u in usage.items()}))
        out.update(_per_replica(f"{prefix}_actuator_cpu_resync_pct", {n: u.cpu_max_pct for n, u in usage.items()}))
        out.update(_per_replica(f"{prefix}_actuator_cpu_mean_pct", {n: u.cpu_mean_pct for n, u in usage.items()}))
    return out


async def _lease_seconds(world: World) -> int | None:
    """The Lease duration KWOK (the nodes' kubelet) set on a node of the world; None where it has none."""
    try:
        lease = orjson.loads(await world.kube.raw_get(
            f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{world.names[0]}"))
    except Exception:  # noqa: BLE001 - a profile figure: a cluster without KWOK's Leases lacks it
        return None
    return (lease.get("spec") or {}).get("leaseDurationSeconds")


async def _raw(prefix: str, world: World) -> dict[str, Any]:
    """The bare client's quarantine writes on ``nodes`` other nodes (outside every selector), now."""
    raw = [f"{world.tag}-raw-{i:05d}" for i in range(world.nodes)]
    world.others += raw
    await create_nodes(world.kube, raw, {"xidflow.bench/scale-raw": world.tag}, gpu=True)
    kube = await bare_client(world.kubeconfig, 32)
    try:
        rate = await raw_quarantine_rate(kube, raw, TAINT_KEY, 32)
    finally:
        kube.close()
    await delete_nodes(world.kube, raw)  # both worlds' bursts see the same objects in the API server
    world.others.clear()
    return {f"{prefix}_raw_nodes_per_s": round(rate, 1), f"{prefix}_raw_burst_ms": round(world.nodes / rate * 1000, 1)}


async def _after(prefix: str, world: World) -> dict[str, Any]:
    """``xidflow status`` and ``xidflow breaker status`` on the whole fleet, after the last burst."""
    status_s, _ = await _cli(world, "status")
    breaker_s, text = await _cli(world, "breaker", "status", "-o", "json")
    breaker = orjson.loads(text)
    return {
        f"{prefix}_status_s": round(status_s, 2),
        f"{prefix}_breaker_status_s": round(breaker_s, 2),
        f"{prefix}_breaker_counted": breaker.get("counted"),
        f"{prefix}_breaker_fleet_size": breaker.get("fleet_size"),
    }


class BurstWatch(NodeWatch):
    """``NodeWatch`` (each node's taint) that also sees each node's flow done: a problem condition True,
    the flow's last write. The next burst waits for it, so it never shares the API server with this one's
    Events and conditions."""

    def __init__(self, kube: Kube, selector: str, resource_version: str, names: list[str]) -> None:
        from pipeline.actuator.problems import OWN_CONDITION_TYPES

        super().__init__(kube, selector, resource_version)
        self.own = OWN_CONDITION_TYPES
        self.unsettled = set(names)

    def _event(self, event: dict[str, Any], now: float) -> None:
        super()._event(event, now)
        obj = event.get("object") or {}
        conditions = (obj.get("status") or {}).get("conditions") or []
        if any(c.get("type") in self.own and c.get("status") == "True" for c in conditions):
            self.unsettled.discard((obj.get("metadata") or {}).get("name"))


async def _bursts(group: dict[str, World], idle: World | None, producer: Any, infra: dict[str, int],
                  label: str) -> dict[str, dict[str, Any]]:
    """One burst on the current burst nodes of each world of ``group``, all at once (their lines
    interleaved, the order flipped every node, so neither world's lines go first): each world's figures.

    With one world and ``idle`` the other one, the CPU each process spent on the burst too (with two
    bursting together the API server's CPU cannot be split between them)."""
    await asyncio.sleep(SETTLE_S)
    sizes = {p: _log_sizes(w) for p, w in group.items()}
    watches = {p: BurstWatch(w.kube, w.selector, await w.resource_version(), w.names) for p, w in group.items()}
    tails = {p: IncidentTail(w) for p, w in group.items()}
    for p in group:
        watches[p].start()
        await tails[p].start()
    spies: list[subprocess.Popen[bytes]] = []
    sent: dict[str, dict[str, float]] = {p: {} for p in group}
    cpu: dict[str, float] | None = None
    try:
        for p, w in group.items():
            spies += profile(w, f"{label}-{p}", actuators_only=True)
        await asyncio.sleep(0.3)  # the watches are established before the clock starts (and py-spy attached)
        only = next(iter(group.values())) if len(group) == 1 else None
        before = _cpu(only, idle, infra) if only is not None and idle is not None else None
        futures = []
        prefixes = list(group)
        for i in range(max(len(w.names) for w in group.values())):
            for p in prefixes if i % 2 == 0 else prefixes[::-1]:
                world = group[p]
                if i < len(world.names):
                    node = world.names[i]
                    sent[p][node] = time.time()
                    topic = world.topics.name("logs_kernel")
                    futures.append(await producer.send(topic, kmsg(FATAL_LINE, node, i), key=node.encode()))
        await asyncio.gather(*futures)
        for p, w in group.items():
            await until(lambda p=p: all(n in watches[p].tainted for n in sent[p]), 180, w)
        if only is not None and idle is not None and before is not None:
            cpu = cpu_spent(before, _cpu(only, idle, infra))
        await stop_profile(spies)
        settled = {p: await until(lambda p=p: not watches[p].unsettled, 180, w) for p, w in group.items()}
    finally:
        await stop_profile([s for s in spies if s.poll() is None])
        for p in group:
            watches[p].stop()
            await tails[p].stop()
    out: dict[str, dict[str, Any]] = {}
    for p, world in group.items():
        tainted = watches[p].tainted
        latencies = [(tainted[n] - t) * 1000 for n, t in sent[p].items() if n in tainted]
        figures = {**summarize("burst", latencies, len(sent[p])),
                   **stage_split("burst", sent[p], await incident_times(world), tainted,
                                 await incident_times(world, "fault_events"), delivered=tails[p].seen)}
        if cpu is not None:
            figures["cpu_s"] = cpu
        figures["unsettled"] = 0 if settled[p] else len(watches[p].unsettled)
        figures["rebalances"] = _marks_since(world, sizes[p])
        out[p] = figures
    return out


async def _fresh_burst_nodes(world: World, round_no: int) -> None:
    """Replace the world's burst nodes by as many new ones, and wait until they carry xidflow's conditions.

    The breaker forgets the old nodes' admissions: they left the cluster, and its window (five minutes)
    would count them against a fleet that keeps its size (the base fleet's second burst tripped it)."""
    from pipeline.actuator.problems import OWN_CONDITION_TYPES

    old = world.names
    new = [f"b{world.tag}-r{round_no}-{i:05d}" for i in range(world.nodes)]
    watch = ConditionWatch(world.kube, world.selector, await world.resource_version(), set(OWN_CONDITION_TYPES),
                           set(new))
    watch.start()
    try:
        await delete_nodes(world.kube, old)
        gone = set(old)

        def forget(state: dict[str, Any]) -> None:
            state["admitted"] = {n: t for n, t in (state.get("admitted") or {}).items() if n not in gone}

        await update_json_configmap(world.kube, world.namespace, ActuatorSettings().breaker_configmap, forget)
        await create_nodes(world.kube, new, {"xidflow.bench/burst": world.tag}, gpu=True)
        world.names = new
        if not await until(lambda: not watch.lacking, 300, world):
            raise RuntimeError(f"{len(watch.lacking)} fresh burst nodes still lack xidflow's conditions after 300 s")
    finally:
        watch.stop()


def _median(values: list[float], digits: int = 1) -> float | None:
    return round(procstat.median(values), digits) if values else None


def summarize_bursts(prefix: str, bursts: list[dict[str, Any]]) -> dict[str, Any]:
    """A world's bursts as its ``<prefix>_burst_*`` figures: medians over the bursts, counts summed. Pure."""
    out: dict[str, Any] = {}
    keys = sorted({k for b in bursts for k, v in b.items() if k.endswith("_ms") and isinstance(v, int | float)})
    for key in keys:
        out[f"{prefix}_{key}"] = _median([b[key] for b in bursts if isinstance(b.get(key), int | float)])
    out[f"{prefix}_burst_p99_ms_rounds"] = [b.get("burst_p99_ms") for b in bursts]
    for key in ("burst_samples", "burst_missing", "burst_over_5s", "unsettled", "rebalances"):
        total = sum(b.get(key) or 0 for b in bursts)
        out[f"{prefix}_burst_{key.removeprefix('burst_')}"] = total
    procs = sorted({p for b in bursts for p in b.get("cpu_s") or {}})
    out[f"{prefix}_burst_cpu_s"] = {p: _median([b["cpu_s"][p] for b in bursts if p in (b.get("cpu_s") or {})], 2)
                                    for p in procs}
    return out


def _ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 3) if isinstance(a, int | float) and isinstance(b, int | float) and b else None


def ratios(r: dict[str, Any]) -> dict[str, Any]:
    """The scale section's ratios from its figures (absent figures give None). Pure.

    Pair i is the i-th burst of each world (``burst_order``: seconds apart, same API server): the
    large fleet's burst is compared with the base fleet's of its own pair, and the headline is the
    median of those ratios, so one pair that met a disturbance on the machine does not make it. The
    same for the rounds where both burst at once (``_together``).
    """
    big, base = r.get("scale_fleet"), r.get("scale_base_fleet")
    size = _ratio(big, base)
    vs_raw = _ratio(r.get("scale_burst_p99_ms"), r.get("scale_raw_burst_ms"))
    base_vs_raw = _ratio(r.get("scale_base_burst_p99_ms"), r.get("scale_base_raw_burst_ms"))
    out: dict[str, Any] = {}
    for kind in ("", "_together"):
        pairs = [_ratio(a, b) for a, b in zip(r.get(f"scale{kind}_burst_p99_ms_rounds") or [],
                                                r.get(f"scale_base{kind}_burst_p99_ms_rounds") or [], strict=False)]
        known = [p for p in pairs if p is not None]
        out[f"scale_burst_vs_base{kind}_ratio"] = round(procstat.median(known), 3) if known else None
        out[f"scale_burst_vs_base{kind}_pair_ratios"] = pairs
    out.update({
        "scale_burst_vs_base_medians_ratio": _ratio(r.get("scale_burst_p99_ms"), r.get("scale_base_burst_p99_ms")),
        "scale_burst_vs_raw_ratio": vs_raw,
        "scale_base_burst_vs_raw_ratio": base_vs_raw,
        "scale_burst_vs_base_raw_normalized": _ratio(vs_raw, base_vs_raw),
        "scale_fleet_ratio": size,
    })
    # Per node, large fleet over base fleet: about 1 when the cost is linear in the fleet, above when worse.
    for key in ("steady_s", "status_s", "breaker_status_s", "actuator_start_cpu_s"):
        grow = _ratio(r.get(f"scale_{key}"), r.get(f"scale_base_{key}"))
        out[f"scale_{key}_growth_per_node"] = round(grow / size, 3) if grow is not None and size else None
    return out


async def scale(
    bootstrap: str, kubeconfig: str, fleet: int, nodes: int, progress: Any = None, pairs: int = PAIRS,
    side_by_side: int = SIDE_BY_SIDE,
) -> dict[str, Any]:
    kw = {"progress": progress} if progress else {}
    worlds = {BASE: World(bootstrap, kubeconfig, nodes, 8, fleet=nodes, **kw),
              LARGE: World(bootstrap, kubeconfig, nodes, 8, fleet=fleet, **kw)}
    producer = kafka_clients.producer(bootstrap, acks=1, linger_ms=5)
    out: dict[str, Any] = {}
    try:
        await producer.start()
        for prefix, world in worlds.items():
            world.progress(f"{prefix}: setup", 0, 1)
            await world.setup()
            await world.warm_up(producer)
            world.progress(f"{prefix}: setup", 1, 1)
        infra = infra_pids(kubeconfig)
        out.update(await _at_rest(worlds, infra))
        for prefix, world in worlds.items():
            out.update(await _raw(prefix, world))
        order = burst_order(pairs)
        rounds = dict.fromkeys(worlds, 0)

        async def fresh(prefix: str) -> None:
            # Every burst after a world's first needs new nodes: a tainted node is not tainted again.
            if rounds[prefix]:
                await _fresh_burst_nodes(worlds[prefix], rounds[prefix])
            rounds[prefix] += 1

        bursts: dict[str, list[dict[str, Any]]] = {p: [] for p in worlds}
        for i, prefix in enumerate(order):
            idle = next(w for p, w in worlds.items() if p != prefix)
            await fresh(prefix)
            figures = await _bursts({prefix: worlds[prefix]}, idle, producer, infra, f"burst{i + 1}of{len(order)}")
            bursts[prefix].append(figures[prefix])
        together: dict[str, list[dict[str, Any]]] = {p: [] for p in worlds}
        for i in range(side_by_side):
            for prefix in worlds:
                await fresh(prefix)
            for prefix, figures in (await _bursts(worlds, None, producer, infra, f"together{i + 1}")).items():
                together[prefix].append(figures)
        for prefix, world in worlds.items():
            out.update(summarize_bursts(prefix, bursts[prefix]))
            if side_by_side:
                out.update(summarize_bursts(f"{prefix}_together", together[prefix]))
            out.update(await _after(prefix, world))
        out["scale_burst_order"] = order
        out.update(ratios(out))
        return out
    except Exception as exc:  # noqa: BLE001 - a late failure keeps what was measured before it (35 minutes in)
        out["scale_error"] = f"{type(exc).__name__}: {exc}"
        return out
    finally:
        await producer.stop()
        for world in worlds.values():
            await world.teardown()
