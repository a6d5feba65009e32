"""Kernel line to taint, end to end, under a burst and through failover and rolling restarts.

Each scenario builds its own world (topic prefix, worker app id, actuator group, N fresh fake GPU
nodes in the API server) and runs real processes: ``xidflow worker`` (parse stage + aggregation)
and two ``xidflow actuator`` replicas, each a static group member (``XIDFLOW_GROUP_INSTANCE_ID``).
One fatal kernel line (Xid 79, as Fluent Bit's kmsg input writes it) per node goes to the raw kernel
topic; a watch on the nodes sees each node's quarantine taint appear. Latency = the moment the watch
saw the taint - the moment the line was handed to the producer (same clock, same process).

- ``burst``: every node's line at once, nothing disturbed.
- ``failover_actuator``: the same burst; the working process of one of the two actuator replicas is
  SIGKILLed right after the burst is produced: the child of ``xidflow actuator``'s warm supervisor
  (``pipeline.runtime.supervisor``), which forks a replacement at once with the same identity.
- ``failover_worker``: the same with the worker's working child SIGKILLed.
- ``failover_actuator_process`` / ``failover_worker_process``: the whole ``xidflow`` process (the
  supervisor, and its child with it) SIGKILLed and started again at once with the same identity,
  what the kubelet does to a crashed container (same pod, same name): the cost of a process start.
- ``failover_lost_actuator`` / ``failover_lost_worker``: a replica SIGKILLed that never comes back
  (pod deleted without a goodbye, node lost): the other replica (two workers in the worker case)
  takes its partitions once the broker expires its session (``_session_timeout_s``, reported), so
  the figure is bounded by that timeout plus the rebalance (``_takeover_s``: kill to the survivors
  holding every partition).
- ``rolling``: two workers and two actuators; lines are paced over the time it takes to restart
  each process in turn with SIGTERM (each waits for the previous one to be back in its groups).

Not a test: it returns numbers (``pipeline.benchmarks.pipeline`` puts them under stable keys).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pipeline.actuator.testing import create_nodes, delete_nodes
from pipeline.benchmarks import apimetrics, kafkameter, procstat
from pipeline.benchmarks.burst_watch import (
    FATAL_LINE,
    PACE_S,
    TAINT_KEY,
    GroupWatch,
    NodeWatch,
    first_unsettled,
    kmsg,
    percentile,
    summarize,
    takeover_split,
    unsettled_windows,
)
from pipeline.benchmarks.burst_world import IncidentTail, World, profile, stop_profile
from pipeline.benchmarks.cost import cost_keys, idle_rates, net_of_idle
from pipeline.benchmarks.kafkameter import KafkaMeter
from pipeline.kafka import clients as kafka_clients
from pipeline.runtime import startmarks

Disruption = Callable[[World], Awaitable[dict[str, Any]]]


async def run_scenario(
    bootstrap: str,
    kubeconfig: str,
    nodes: int,
    prefix: str,
    partitions: int = 8,
    workers: int = 1,
    disrupt: Disruption | None = None,
    pace_until_done: bool = False,
    progress: Callable[[str, float, float], None] = lambda t, d, n: None,
    baseline: bool = False,
    fleet: int = 0,
    before: Disruption | None = None,
    after: Disruption | None = None,
) -> dict[str, Any]:
    """Run one scenario; return its figures under ``<prefix>_*`` keys.

    ``disrupt`` runs right after the burst is handed to the producer (or, with ``pace_until_done``,
    while lines are paced out, one node at a time, until it returns). ``baseline``: afterwards, with the
    scenario's processes still up (idle), a bare client writes the same taints to N other nodes
    (``bare_client_baseline``). ``fleet``: GPU nodes in the world (at least ``nodes``; the others get no
    line). ``before`` runs at steady state after the warm-up, before the clock starts; ``after`` once
    every taint was seen; their figures are added.
    """
    world = World(bootstrap, kubeconfig, nodes, partitions, workers=workers, fleet=fleet, progress=progress)
    producer = kafka_clients.producer(bootstrap, acks=1, linger_ms=5)
    sent: dict[str, float] = {}
    extra: dict[str, Any] = {}
    watch: NodeWatch | None = None
    tail: IncidentTail | None = None
    meter: KafkaMeter | None = None
    try:
        progress(f"{prefix}: setup", 0, 1)
        await world.setup()
        meter = await kafka_meter(world)
        await producer.start()
        await world.warm_up(producer)
        progress(f"{prefix}: setup", 1, 1)
        if before is not None:
            extra.update(await before(world))
        # A node of the fleet as the burst finds it (xidflow's conditions on it): the bare client's second
        # run writes nodes shaped like it (``bare_client_baseline``).
        template = await world.kube.get_node(world.names[0]) if baseline else None
        if baseline:
            extra[f"{prefix}_idle_cpu_s"] = await quiet_cpu(world, IDLE_S)
            idle = idle_rates(extra[f"{prefix}_idle_cpu_s"], IDLE_S)
            extra[f"{prefix}_api_read_cpu_s"] = await api_read_cpu(world, idle)
        watch = NodeWatch(world.kube, world.selector, await world.resource_version())
        watch.start()
        tail = IncidentTail(world)
        await tail.start()
        await asyncio.sleep(0.3)  # the watch is established before the clock starts
        topic = world.topics.name("logs_kernel")
        api_before = await api_snapshot(world)
        kafka_before = await meter.read() if meter is not None else None
        cpu_before = cpu_seconds(world)
        started, started_at = time.monotonic(), time.time()
        spies = profile(world, prefix) if baseline else []
        if not pace_until_done:
            futures = []
            for i, node in enumerate(world.names):
                sent[node] = time.time()
                futures.append(await producer.send(topic, kmsg(FATAL_LINE, node, i), key=node.encode()))
            disruption = asyncio.ensure_future(disrupt(world)) if disrupt else None
            await asyncio.gather(*futures)
            if disruption is not None:
                extra.update(await disruption)
        else:
            assert disrupt is not None
            disruption = asyncio.ensure_future(disrupt(world))
            for i, node in enumerate(world.names):
                if disruption.done():
                    break
                sent[node] = time.time()
                await producer.send(topic, kmsg(FATAL_LINE, node, i), key=node.encode())
                await asyncio.sleep(PACE_S)
            extra.update(await disruption)
        marks = {"lines_sent": time.monotonic() - started}
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not all(n in watch.tainted for n in sent):
            world.check_alive()
            progress(prefix, sum(n in watch.tainted for n in sent), len(sent))
            await asyncio.sleep(0.2)
        progress(prefix, sum(n in watch.tainted for n in sent), len(sent))
        marks["taints_seen"] = time.monotonic() - started
        extra[f"{prefix}_cpu_s"] = cpu_spent(cpu_before, cpu_seconds(world))
        api_tainted = await api_snapshot(world)
        extra.update(api_keys(f"{prefix}_api", api_before, api_tainted, len(sent)))
        if baseline:
            # The cost window (``pipeline.benchmarks.cost``): on until every node's flow wrote its last write and
            # the lifecycle controller answered its cordon. Waited for on the watch already open (a list every
            # moment would be work of its own in the window), before anything else of the bench reads Kafka.
            settled_from = time.monotonic()
            marks["taint_window_read"] = settled_from - started
            finished = await until(lambda: watch.done(list(sent)), 180, world)
            extra[f"{prefix}_settled_s"] = round(time.monotonic() - settled_from, 2) if finished else None
            extra[f"{prefix}_cost_window_s"] = round(time.monotonic() - started, 2)
            extra[f"{prefix}_cost_marks_s"] = cost_marks(marks, {
                "last_tainted": watch.tainted, "last_settled": watch.settled, "last_answered": watch.answered,
            }, list(sent), started_at)
            # The whole flows' CPU (Events and conditions too), not only the taints' window: work held back
            # until after the last taint is still work.
            extra[f"{prefix}_settled_cpu_s"] = cpu_spent(cpu_before, cpu_seconds(world))
            await stop_profile(spies)
            # What the flows still asked of the API server after the last taint (Events, conditions).
            api_settled = await api_snapshot(world)
            extra.update(api_keys(f"{prefix}_settled_api", api_tainted, api_settled, len(sent)))
            extra.update(api_keys(f"{prefix}_cost_api", api_before, api_settled, len(sent)))
            extra.update(kafka_keys(f"{prefix}_kafka", kafka_before, await meter.read() if meter else None, len(sent)))
        latencies = [(watch.tainted[n] - t) * 1000 for n, t in sent.items() if n in watch.tainted]
        stages = stage_split(
            prefix, sent, await incident_times(world), watch.tainted, await incident_times(world, "fault_events"),
            delivered=tail.seen,
        )
        if after is not None:
            extra.update(await after(world))
        out = {**summarize(prefix, latencies, len(sent)), **stages, **extra}
        if baseline:
            progress(f"{prefix}: bare client", 0, 1)
            # The actuators write Events and conditions after the taints: the baseline starts once they are
            # settled (above), so it does not share the API server with them.
            # The same reading as before the burst: whether the world is as idle as it was then (the
            # broker and the worker still working off the burst would share the cores with the bare client).
            out[f"{prefix}_raw_before_cpu_s"] = await quiet_cpu(world, IDLE_S)
            out.update(await bare_client_baseline(world, prefix, out.get(f"{prefix}_p99_ms"), meter=meter))
            window = out.get(f"{prefix}_cost_window_s")
            bare_window = out.get(f"{prefix}_raw_cost_window_s")
            if window and bare_window:
                out.update(cost_keys(prefix, len(sent), out[f"{prefix}_settled_cpu_s"], window,
                                     out[f"{prefix}_raw_settled_cpu_s"], bare_window,
                                     idle_rates(out[f"{prefix}_idle_cpu_s"], IDLE_S),
                                     out[f"{prefix}_api_read_cpu_s"]))
            if template is not None:
                out[f"{prefix}_node_bytes"] = node_bytes(template)
                out.update(await bare_client_baseline(world, prefix, out.get(f"{prefix}_p99_ms"), template))
            progress(f"{prefix}: bare client", 1, 1)
            progress(f"{prefix}: floor", 0, 1)
            out.update(await floor(world, prefix, out.get(f"{prefix}_raw_ms")))
            progress(f"{prefix}: floor", 1, 1)
        return out
    finally:
        if watch is not None:
            watch.stop()
        if tail is not None:
            await tail.stop()
        if meter is not None:
            await meter.stop()
        await producer.stop()
        await world.teardown()


def cpu_seconds(world: World) -> dict[str, tuple[int, float]]:
    """Each running process of the world, its infrastructure (``World.infra``) and the bench itself -> (pid,
    CPU seconds used so far)."""
    out = {"bench": (os.getpid(), sum(os.times()[:2]))}
    for name, proc in world.procs.items():
        if proc.alive() and proc.proc is not None:
            # The supervised child does the work; the supervisor itself only waits for it.
            with contextlib.suppress(OSError):
                pid = proc.work_pid()
                out[name] = (pid, procstat.read(pid).cpu_s)
    # The API server, etcd and Kafka: on two cores the CPU they get is what bounds the taints' time.
    for name, pid in world.infra.items():
        with contextlib.suppress(OSError):
            out[name] = (pid, procstat.read(pid).cpu_s)
    return out


def cpu_spent(before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]]) -> dict[str, float]:
    """CPU seconds each process used between two readings (a restarted one, another pid, is left out). Pure.

    On this 2-core machine the pipeline's own processes share the cores with the API server they wait
    for: what they use during a burst is time the API server does not get.
    """
    return {
        name: round(cpu - before[name][1], 2)
        for name, (pid, cpu) in after.items()
        if name in before and before[name][0] == pid
    }


async def bare_client_baseline(
    world: World, prefix: str, p99_ms: float | None, template: dict[str, Any] | None = None,
    meter: KafkaMeter | None = None,
) -> dict[str, Any]:
    """The API server's own time for the scenario's N taints, measured in the same run.

    A bare client (``pipeline.benchmarks.storm.raw_quarantine_rate``: per node the read and the
    conditional cordon + taint patch the actuator makes) quarantines N fresh nodes outside the
    actuators' selector, with the concurrency of all the scenario's actuators together, once the
    actuators are done with the burst (``World.wait_conditions``; ``<prefix>_settled_s``). Keys:
    ``<prefix>_raw_ms`` (its time for the N writes), ``<prefix>_raw_nodes_per_s`` and
    ``<prefix>_vs_raw_ratio`` = the scenario's p99 / ``<prefix>_raw_ms`` (1.0: the pipeline adds
    nothing to the API server's own time).

    With ``template`` (a node of the scenario's fleet) the N nodes are made like it (``alike``: GPU labels,
    capacity, xidflow's conditions) instead of bare, and the keys are ``<prefix>_raw_alike_*`` (and
    ``<prefix>_vs_raw_alike_ratio``): the API server's work per write grows with the object (decoded,
    patched, encoded, stored and sent to each watcher), and a profile found the fleet's nodes 5x the
    bare ones.
    """
    from pipeline.actuator.settings import ActuatorSettings
    from pipeline.benchmarks.storm import bare_client, raw_quarantine_rate

    concurrency = ActuatorSettings().api_concurrency * world.actuators
    raw = "raw_alike" if template is not None else "raw"
    names = [f"b{world.tag}-{raw.replace('_', '-')}-{i:05d}" for i in range(world.nodes)]
    labels = {"xidflow.bench/burst-raw": world.tag}
    make = None if template is None else (lambda name: alike(template, name, labels, world.selector))
    await create_nodes(world.kube, names, labels, body=make)
    kube = await bare_client(world.kubeconfig, concurrency)
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    page = await world.kube._call(world.kube.core.list_node, label_selector=selector, limit=1)
    watch = NodeWatch(world.kube, selector, page["metadata"]["resourceVersion"])
    watch.start()
    await asyncio.sleep(0.3)  # the watch is established before the clock starts
    api_before = await api_snapshot(world)
    kafka_before = await meter.read() if meter is not None else None
    cpu_before = cpu_seconds(world)
    started = time.monotonic()
    try:
        rate = await raw_quarantine_rate(kube, names, TAINT_KEY, concurrency)
        cpu = cpu_spent(cpu_before, cpu_seconds(world))
        api_written = await api_snapshot(world)
        api = api_keys(f"{prefix}_{raw}_api", api_before, api_written, world.nodes)
        # Its cost window (``pipeline.benchmarks.cost``): until the lifecycle controller answered every cordon.
        answered = await until(lambda: watch.done(names, settled=False), 180, world)
        settled = {
            f"{prefix}_{raw}_settled_cpu_s": cpu_spent(cpu_before, cpu_seconds(world)),
            f"{prefix}_{raw}_cost_window_s": round(time.monotonic() - started, 2) if answered else None,
            **api_keys(f"{prefix}_{raw}_cost_api", api_before, await api_snapshot(world), world.nodes),
            **kafka_keys(f"{prefix}_{raw}_kafka", kafka_before, await meter.read() if meter else None, world.nodes),
        }
    finally:
        watch.stop()
        await kube.aclose()
        with contextlib.suppress(Exception):
            await delete_nodes(world.kube, names)
    raw_ms = world.nodes / rate * 1000
    out: dict[str, Any] = {
        f"{prefix}_{raw}_ms": round(raw_ms, 1),
        f"{prefix}_{raw}_nodes_per_s": round(rate, 1),
        f"{prefix}_{raw}_concurrency": concurrency,
        f"{prefix}_{raw}_cpu_s": cpu,
        **api,
        **settled,
    }
    if p99_ms is not None:
        out[f"{prefix}_vs_{raw}_ratio"] = round(p99_ms / raw_ms, 3)
    return out


def cost_marks(marks: dict[str, float], seen: dict[str, dict[str, float]], names: list[str],
               started_at: float) -> dict[str, float]:
    """Where a cost window's seconds went, each from its start, in order: ``marks`` (the bench's own steps) and,
    for each of ``seen`` (mark -> node -> wall time: the watch's records), when the last of ``names`` got there.
    Pure."""
    out = dict(marks)
    out.update({k: max(v[n] for n in names) - started_at for k, v in seen.items() if all(n in v for n in names)})
    return {k: round(v, 2) for k, v in sorted(out.items(), key=lambda kv: kv[1])}


IDLE_S = 2.0
"""Seconds of the at-rest readings (before the burst, before the bare client): each process's idle rate."""


async def until(check: Callable[[], bool], limit_s: float, world: World) -> bool:
    """Until ``check()`` holds (True) or ``limit_s`` passed (False); a process of the world that died stops it."""
    deadline = time.monotonic() + limit_s
    while not check():
        world.check_alive()
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


async def kafka_meter(world: World) -> KafkaMeter | None:
    """The broker's own counters for this world's windows (``pipeline.benchmarks.kafkameter``); None where the
    broker is not a local one of this run or cannot be read (the figures then lack the Kafka keys)."""
    pid = world.infra.get("kafka")
    if pid is None:
        return None
    meter = KafkaMeter(pid)
    return meter if await meter.start() else None


def kafka_keys(key: str, before: kafkameter.Snapshot | None, after: kafkameter.Snapshot | None,
               nodes: int) -> dict[str, Any]:
    """``<key>`` (``kafkameter.delta``), ``<key>_requests_per_node`` and ``<key>_bytes_per_node`` (socket bytes
    in and out), or nothing when a reading is missing. Pure."""
    if before is None or after is None:
        return {}
    d = kafkameter.delta(before, after, nodes)
    return {key: d, f"{key}_requests_per_node": d["requests_per_node"],
            f"{key}_bytes_per_node": d["net_bytes_per_node"]}


async def quiet_cpu(world: World, window_s: float = 1.0) -> dict[str, float]:
    """CPU seconds each of the world's processes used in the next ``window_s`` with nothing asked of them."""
    before = cpu_seconds(world)
    await asyncio.sleep(window_s)
    return {k: v for k, v in cpu_spent(before, cpu_seconds(world)).items() if k != "bench"}


async def api_read_cpu(world: World, idle_rate: dict[str, float]) -> dict[str, float]:
    """CPU seconds each process (the API server writing its ``/metrics``, the bench reading it) spends on one
    ``api_snapshot`` at rest, less its idle use (``idle_rate``) meanwhile: the bench's own work inside each
    cost window, which holds one such reading."""
    before, started = cpu_seconds(world), time.monotonic()
    await api_snapshot(world)
    return net_of_idle(cpu_spent(before, cpu_seconds(world)), idle_rate, time.monotonic() - started)


def alike(template: dict[str, Any], name: str, labels: dict[str, str], selector: str) -> dict[str, Any]:
    """A Node to create like ``template`` (labels, status: capacity, conditions, node info) under another name,
    without the scenario's selector label (the actuators must not own it) and with ``labels``. Pure."""
    key = selector.split("=", 1)[0]
    kept = {k: v for k, v in (template["metadata"].get("labels") or {}).items() if k != key}
    if "kubernetes.io/hostname" in kept:
        kept["kubernetes.io/hostname"] = name
    status = {k: v for k, v in (template.get("status") or {}).items() if k in ("capacity", "allocatable", "conditions",
                                                                                 "nodeInfo", "addresses")}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {**kept, **labels}},
            "status": status}


def node_bytes(node: dict[str, Any]) -> dict[str, int]:
    """A Node's JSON size in bytes, whole and by part (where the API server's per-write work goes). Pure."""
    import orjson

    meta = node.get("metadata") or {}
    status = node.get("status") or {}
    parts = {
        "total": node,
        "labels": meta.get("labels") or {},
        "annotations": meta.get("annotations") or {},
        "managedFields": meta.get("managedFields") or [],
        "spec": node.get("spec") or {},
        "conditions": status.get("conditions") or [],
        "status_other": {k: v for k, v in status.items() if k != "conditions"},
    }
    return {k: len(orjson.dumps(v)) for k, v in parts.items()}


async def api_snapshot(world: World) -> apimetrics.Snapshot | None:
    """The API server's own counters now (``pipeline.benchmarks.apimetrics``); None where it does not answer."""
    try:
        return await apimetrics.scrape(world.kube)
    except Exception:  # a profile, not the figure: a run without it still has its latencies
        return None


def api_keys(
    key: str, before: apimetrics.Snapshot | None, after: apimetrics.Snapshot | None, nodes: int
) -> dict[str, Any]:
    """``<key>`` (``apimetrics.delta``: requests by kind, per node, watch events, new connections),
    ``<key>_requests`` (their total) and ``<key>_requests_per_node``, or nothing when a reading is missing. Pure."""
    if before is None or after is None:
        return {}
    d = apimetrics.delta(before, after, nodes)
    return {key: d, f"{key}_requests": d["requests_total"],
            f"{key}_requests_per_node": round(d["requests_total"] / nodes, 2) if nodes else None}


async def floor(world: World, prefix: str, raw_ms: float | None) -> dict[str, Any]:
    """The least any Kafka-based pipeline can do with the scenario's N lines here (``pipeline.benchmarks.burst_floor``),
    right after the bare client and under the same conditions: the world's processes idle, the same
    API server and broker, the bare client's concurrency. ``<prefix>_floor_*`` keys."""
    from pipeline.actuator.settings import ActuatorSettings
    from pipeline.benchmarks.burst_floor import floor_baseline

    others = {name: pid for name, (pid, _) in cpu_seconds(world).items() if name != "bench"}
    return await floor_baseline(
        world.bootstrap, world.kube, world.kubeconfig, world.tag, prefix, world.nodes, world.partitions,
        ActuatorSettings().api_concurrency * world.actuators, raw_ms, others,
    )


async def incident_times(world: World, name: str = "incidents", limit_s: float = 30) -> dict[str, float]:
    """node -> when the worker produced the node's first record on topic ``name`` (its timestamp, seconds).

    ``incidents``: the aggregation's output; ``fault_events``: the parse stage's.
    """
    from aiokafka import TopicPartition

    topic = world.topics.name(name)
    consumer = kafka_clients.consumer(
        bootstrap=world.bootstrap, auto_offset_reset="earliest", enable_auto_commit=False, group_id=None
    )
    await consumer.start()
    first: dict[str, float] = {}
    try:
        tps = [TopicPartition(topic, p) for p in range(world.partitions)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and any([await consumer.position(tp) < end for tp, end in ends.items()]):
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for rec in records:
                    node = rec.key.decode() if rec.key else ""
                    first.setdefault(node, rec.timestamp / 1000)
    finally:
        await consumer.stop()
    return first


def stage_split(
    prefix: str,
    sent: dict[str, float],
    incident: dict[str, float],
    tainted: dict[str, float],
    fault: dict[str, float] | None = None,
    delivered: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Where the time went: line -> incident produced (worker), incident -> taint seen (actuator + API).

    With ``fault`` (node -> its fault event's timestamp) the worker's share is split too: line -> fault
    event produced (``parse``), fault event -> incident produced (``aggregate``). With ``delivered``
    (node -> when a consumer could first read its incident): line -> incident readable (``delivery``;
    the worker's share as a consumer sees it) and incident readable -> taint seen (``apply``; the
    actuators' and the API server's share).
    """
    fault, delivered = fault or {}, delivered or {}
    worker = sorted((incident[n] - t) * 1000 for n, t in sent.items() if n in incident)
    actuator = sorted((tainted[n] - incident[n]) * 1000 for n in sent if n in incident and n in tainted)
    parse = sorted((fault[n] - t) * 1000 for n, t in sent.items() if n in fault)
    aggregate = sorted((incident[n] - fault[n]) * 1000 for n in sent if n in fault and n in incident)
    out: dict[str, Any] = {}
    delivery = sorted((delivered[n] - t) * 1000 for n, t in sent.items() if n in delivered)
    apply = sorted((tainted[n] - delivered[n]) * 1000 for n in sent if n in delivered and n in tainted)
    stages = (("worker", worker), ("actuator", actuator), ("parse", parse), ("aggregate", aggregate),
              ("delivery", delivery), ("apply", apply))
    for name, values in stages:
        if values:
            out[f"{prefix}_{name}_p50_ms"] = round(percentile(values, 0.50), 1)
            out[f"{prefix}_{name}_p99_ms"] = round(percentile(values, 0.99), 1)
    return out


async def kill_and_restart(world: World, proc: str, delay_s: float = 0.1, child: bool = True) -> dict[str, Any]:
    """SIGKILL one replica mid-burst; seconds until it is back in its groups with the same identity.

    ``child``: kill the process that does the work (the supervisor forks its replacement); else the
    whole ``xidflow`` process, started again at once (a container restart). ``rebalances``: how many
    its groups went through meanwhile (a ``GroupWatch``): a static member back within its session
    takes its partitions back without one (KIP-345), so anything but 0 says the handover did not hold.
    """
    watch = GroupWatch(world.bootstrap, world.groups(proc))
    await watch.start()
    try:
        await asyncio.sleep(delay_s)
        p = world.procs[proc]
        before = await world.member_ids(proc)
        victim = p.work_pid() if child else None
        timeline = world.logdir / f"{proc}-start.jsonl"
        # A restarted process's start, step by step (a forked child keeps its supervisor's environment: none).
        p.env[startmarks.ENV] = str(timeline)
        start, killed_at = time.monotonic(), time.time()
        if victim is not None and p.proc is not None and victim != p.proc.pid:
            os.kill(victim, signal.SIGKILL)
        else:
            await p.signal(signal.SIGKILL)
            await p.start()
        await world.wait_members([proc], replaced=before)
        back = round(time.monotonic() - start, 2)
        await asyncio.sleep(0.5)  # a rebalance the rejoin started would show by now
    finally:
        samples = await watch.stop()
    return {"restart_s": back, "rebalances": len(unsettled_windows(samples)), **start_timeline(timeline, killed_at)}


def start_timeline(path: Any, since: float) -> dict[str, Any]:
    """``start_ms``: each step of a start (``pipeline.runtime.startmarks``) in ms after ``since``, in order;
    ``start_cpu_ms``: the CPU the process (and, supervised, its child) had used by then, where the wall
    clock of a busy machine says little. A supervised child written before the crash is not counted."""
    import json

    marks: dict[str, dict[str, Any]] = {}
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            m = json.loads(line)
            if m["t"] >= since - 1.0 and m["mark"] != "exec":  # exec: /proc's clock, coarse; t0 is the kill
                marks.setdefault(m["mark"], m)
    if not marks:
        return {}
    ordered = sorted(marks.items(), key=lambda kv: kv[1]["t"])
    fork = marks.get("fork")
    parent = fork["pid"] if fork else None
    base_cpu = fork["cpu"] if fork else 0.0
    return {
        "start_ms": {k: round((m["t"] - since) * 1000) for k, m in ordered},
        "start_cpu_ms": {k: round(((m["cpu"] + base_cpu) if m["pid"] != parent else m["cpu"]) * 1000)
                         for k, m in ordered},
    }


async def lose(world: World, proc: str, delay_s: float = 0.1) -> dict[str, Any]:
    """SIGKILL one replica mid-burst for good (its supervised child dies with it); the survivors take over.

    ``takeover_s``: kill to every group Stable with the survivors holding the partitions; with
    ``session_timeout_s`` (the broker expires the dead member only after it) it bounds the figure.
    Split by a ``GroupWatch`` (``takeover_split``): ``expired_s`` (kill to the coordinator expiring the
    member: the session after its last heartbeat, up to ``heartbeat_interval_s`` before the kill) and
    ``rebalanced_s`` (to the survivors holding every partition: their next heartbeat, rejoin, sync).
    The rest of a line's wait after the takeover is the survivors' work: a worker's table recovery
    and the backlog through the worker and the actuators to the API server.
    """
    from pipeline.runtime.settings import ConsumerGroupSettings

    group = ConsumerGroupSettings()
    watch = GroupWatch(world.bootstrap, world.groups(proc))
    await watch.start()
    try:
        await asyncio.sleep(delay_s)
        p = world.procs[proc]
        start, killed_at = time.monotonic(), time.time()
        p.lost = True
        await p.signal(signal.SIGKILL)
        survivors = [n for n, q in world.procs.items() if not q.lost and set(world.groups(n)) & set(world.groups(proc))]
        await world.wait_members(survivors, limit_s=300)
        await world.wait_assigned(world.groups(proc))
        takeover = round(time.monotonic() - start, 2)
    finally:
        samples = await watch.stop()
    return {"takeover_s": takeover, **takeover_split(samples, proc, killed_at),
            "session_timeout_s": group.session_timeout_s, "heartbeat_interval_s": group.heartbeat_interval_s}


async def rolling_restart(world: World) -> dict[str, Any]:
    """SIGTERM and restart each process in turn, each back in its groups before the next.

    A ``GroupWatch`` times each rebalance of the world's groups (``unsettled_windows``): every line on
    a partition whose owner left (or is moving) waits at least that long under the eager protocol.
    """
    from pipeline.runtime.settings import ConsumerGroupSettings

    groups = sorted({g for name in world.procs for g in world.groups(name)})
    watch = GroupWatch(world.bootstrap, groups)
    await watch.start()
    took: dict[str, dict[str, float]] = {}
    term_at: dict[str, float] = {}
    try:
        await asyncio.sleep(1.0)
        for name, proc in world.procs.items():
            before = await world.member_ids(name)
            start, term_at[name] = time.monotonic(), time.time()
            await proc.signal(signal.SIGTERM)
            stopped = time.monotonic()
            await proc.start()
            await world.wait_members(list(world.procs), replaced=before)
            # Profile: how long the orderly stop took, and the new process until every group is settled.
            took[name] = {"stop_s": round(stopped - start, 2), "back_s": round(time.monotonic() - stopped, 2)}
        await asyncio.sleep(1.0)
    finally:
        samples = await watch.stop()
    for name, at in term_at.items():
        # SIGTERM to the first of its groups rebalancing: the orderly stop before its LeaveGroup, while
        # its partitions are no longer read and not yet anyone else's.
        left = first_unsettled(samples, world.groups(name), at, name)
        if left is not None and name in took:
            took[name]["leave_s"] = round(left - at, 2)
    windows = sorted((end - begin) * 1000 for _, begin, end in unsettled_windows(samples))
    out: dict[str, Any] = {"rolling_restart_s": took, "rolling_rebalances": len(windows),
                           "rolling_heartbeat_interval_s": ConsumerGroupSettings().heartbeat_interval_s}
    if windows:
        out["rolling_rebalance_p50_ms"] = round(percentile(windows, 0.5), 1)
        out["rolling_rebalance_max_ms"] = round(windows[-1], 1)
    return out


async def burst(bootstrap: str, kubeconfig: str, nodes: int, progress: Any = None) -> dict[str, Any]:
    kw = {"progress": progress} if progress else {}
    return await run_scenario(bootstrap, kubeconfig, nodes, "burst", baseline=True, **kw)


async def failover(bootstrap: str, kubeconfig: str, nodes: int, progress: Any = None) -> dict[str, Any]:
    kw = {"progress": progress} if progress else {}

    def scenario(prefix: str, disruption: Callable[[World], Awaitable[dict[str, Any]]]) -> Disruption:
        async def run(world: World) -> dict[str, Any]:
            return {f"{prefix}_{k}": v for k, v in (await disruption(world)).items()}

        return run

    out: dict[str, Any] = {}
    runs: list[tuple[str, Disruption, int]] = [
        ("failover_actuator", scenario("failover_actuator", lambda w: kill_and_restart(w, "actuator-1")), 1),
        ("failover_worker", scenario("failover_worker", lambda w: kill_and_restart(w, "worker-0")), 1),
        ("failover_actuator_process", scenario(
            "failover_actuator_process", lambda w: kill_and_restart(w, "actuator-1", child=False)), 1),
        ("failover_worker_process", scenario(
            "failover_worker_process", lambda w: kill_and_restart(w, "worker-0", child=False)), 1),
        ("failover_lost_actuator", scenario("failover_lost_actuator", lambda w: lose(w, "actuator-1")), 1),
        # Two workers: someone must be there to take the lost one's partitions.
        ("failover_lost_worker", scenario("failover_lost_worker", lambda w: lose(w, "worker-1")), 2),
    ]
    for prefix, disrupt, workers in runs:
        out.update(await run_scenario(bootstrap, kubeconfig, nodes, prefix, workers=workers, disrupt=disrupt, **kw))
    return out


async def rolling(bootstrap: str, kubeconfig: str, nodes: int, progress: Any = None) -> dict[str, Any]:
    kw = {"progress": progress} if progress else {}
    return await run_scenario(
        bootstrap, kubeconfig, nodes, "rolling", workers=2, disrupt=rolling_restart, pace_until_done=True, **kw
    )
