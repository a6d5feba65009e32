"""Pipeline benchmark: the parse stage against a raw aiokafka consumer, and end-to-end latency.

Sections are async functions ``section(ctx) -> dict`` registered in ``SECTIONS``; each adds its
figures to one result dict. Later issues add sections (e.g. an actuator storm) with ``register``.

- ``throughput``: N Fluent Bit kmsg records (0.1% faults) on a fresh topic; a raw aiokafka consumer
  reads them all (baseline: fetch + iterate, nothing else, with the stage's fetch settings), and the
  parse stage processes the same records (gate, adapters, detector, produce fault events, commit
  after acks). Rates are measured from the first batch received to the last batch processed, so
  group joins do not count, and count the records after that first batch on both sides; the
  stage's commits overlap its processing, and the one final commit after the last batch is left
  out of ``pipeline_rate`` (``pipeline_rates_incl_final_commit`` has it in). Best of ``repeats``
  rounds in which the two take turns going first (a run after one of its own kind measured 3-8%
  faster); ``ratio_median`` and ``ratio_cpu_median`` are the medians of the rounds' own ratios. The
  per-CPU-second rates are less sensitive to other load on the machine.
- ``latency``: a real ``xidflow worker`` process; ~10,000 noise lines/s in the background and a fault
  line for a fresh node every 100 ms; latency = incident received - fault line sent (wall clock).
- ``flood``: a good node's line-to-incident latency while one other node floods the kernel topic with
  records of ~86,000 short marker lines (~600 KB) as fast as the broker takes them, against the same latency without
  the flood, as ratios of the same run (``pipeline.benchmarks.flood``).
- ``parse``: the pure parse figures of ``pipeline.benchmarks.parse.run_parse_benchmark``.
- ``storm``: N incidents at once to a real actuator; nodes quarantined per second, against a bare
  client writing the same patches at the same concurrency (``storm_vs_raw_ratio``).
- ``burst``, ``failover``, ``rolling``: kernel line to taint with real worker and actuator processes
  (``pipeline.benchmarks.burst``): ``burst_p50_ms``/``_p99_ms``/``_max_ms``,
  ``failover_actuator_p99_ms``, ``failover_worker_p99_ms`` (the supervised child killed),
  ``failover_actuator_process_p99_ms``, ``failover_worker_process_p99_ms`` (the whole process killed
  and restarted), ``failover_lost_actuator_p99_ms``, ``failover_lost_worker_p99_ms`` (a replica that
  never comes back; with ``_takeover_s``, split into ``_expired_s`` and ``_rebalanced_s``, and
  ``_session_timeout_s``), each with ``_over_5s`` counts, and ``rolling_p99_ms`` (with its groups'
  ``rolling_rebalances`` and their ``_rebalance_p50_ms``/``_max_ms``); each split into
  ``_parse``/``_aggregate`` (worker) and ``_actuator`` shares.
  The burst also times a bare client writing the same N taints in the same run (``burst_raw_ms``)
  and reports ``burst_vs_raw_ratio`` = ``burst_p99_ms`` / ``burst_raw_ms``.
  A second bare run writes nodes made like the fleet's (GPU labels and capacity, xidflow's conditions:
  ``burst_raw_alike_ms``, ``burst_vs_raw_alike_ratio``; ``burst_node_bytes`` gives a fleet node's size by part),
  and ``burst_api`` / ``burst_raw_api`` / ``burst_raw_alike_api`` / ``burst_settled_api`` count what the API
  server did in each window (``pipeline.benchmarks.apimetrics``: requests by verb and resource, watch events,
  new connections).
  What a remediated node costs (``pipeline.benchmarks.cost``): every process's CPU from the first line until
  every node is settled and the lifecycle controller answered its cordon, against the bare client's until the
  same answer (``burst_cpu_per_node_ratio``, ``burst_cpu_split``), with the broker's own counters
  (``burst_kafka_*``, ``pipeline.benchmarks.kafkameter``) and the API server's (``burst_cost_api_*``).
  Then its floor (``pipeline.benchmarks.burst_floor``): the same N lines through one plain consumer
  process to the same bare client, ``burst_floor_p99_ms`` and ``burst_floor_vs_raw_ratio``.
- ``scale`` (not run by default): the burst of ``nodes`` nodes inside a fleet of ``fleet`` GPU nodes
  and on a fleet of ``nodes``, with steady-state time, actuator memory and CPU, ``xidflow status``
  time and the breaker's count on each (``pipeline.benchmarks.scale``).

One module (about 500 lines): the section registry, the shared context and the throughput, latency and
parse sections that use the same broker set-up; the scenario benches live beside it (burst, storm, scale, soak).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from pipeline.detection.parse_settings import ParseSettings
from pipeline.detection.parse_stage import ParseStage
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from pipeline.runtime.settings import TopicNames

ProgressFn = Callable[[str, float, float], None]
"""progress(task, completed, total): how a section reports progress (the CLI draws it with rich)."""


@dataclass
class BenchContext:
    bootstrap: str
    records: int = 200_000
    noise_rate: float = 10_000.0
    latency_samples: int = 200
    partitions: int = 4
    repeats: int = 3
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    kubeconfig: str | None = None
    storm_nodes: int = 500
    nodes: int = 500  # burst, failover and rolling scenarios
    fleet: int = 10_000  # GPU nodes of the scale section's large fleet
    progress: ProgressFn = lambda task, done, total: None
    results: dict[str, Any] = field(default_factory=dict)


HEARTBEATS_PER_S = 100
"""Lease renewals per second the bench's own control plane is given at most (``heartbeat_lease_s``)."""


def largest_fleet(sections: list[str], nodes: int, storm_nodes: int, fleet: int) -> int:
    """The most nodes the named sections hold at once (a scenario's fleet with its bare client's copy). Pure."""
    sizes = [2 * nodes + 8]
    if "storm" in sections:
        sizes.append(2 * storm_nodes)
    if "scale" in sections:
        sizes.append(fleet + 2 * nodes + 8)
    return max(sizes)


def heartbeat_lease_s(nodes: int, default_s: int) -> int:
    """KWOK's node Lease duration for a bench control plane holding ``nodes`` nodes (a kubelet renews every quarter
    of it): the kubelet's default, or longer where its renewals would pass ``HEARTBEATS_PER_S``. Pure.

    A 10,000-node cluster's kubelets renew 1,000 Leases a second with the default 40 s Lease; its control plane
    has cores for that. Here the API server, etcd and KWOK that renew them share two cores with everything the
    bench measures, so a fleet that large would measure its own heartbeats. The renewals stay as they are
    (each one a kubelet's write, KWOK's Lease controller, the lifecycle controller reading them), only fewer a
    second; the lifecycle controller's grace follows the Lease (``heartbeat_grace_s``), as a kubelet's does.
    """
    return max(default_s, -(-4 * nodes // HEARTBEATS_PER_S))


def heartbeat_grace_s(lease_s: int, default_lease_s: int, default_grace_s: int) -> int:
    """The node lifecycle controller's grace for a Lease of ``lease_s``: the default's margin over the default
    Lease (10 s). Pure."""
    return lease_s + (default_grace_s - default_lease_s)


Section = Callable[[BenchContext], Awaitable[dict[str, Any]]]
SECTIONS: dict[str, Section] = {}


def register(name: str) -> Callable[[Section], Section]:
    def wrap(fn: Section) -> Section:
        SECTIONS[name] = fn
        return fn

    return wrap


_NOISE = (
    "IPv6: ADDRCONF(NETDEV_CHANGE): eth{n}: link becomes ready",
    "mlx5_core 0000:{b:02x}:00.0: mlx5_fw_tracer_handle_traces:741:(pid {p}): FW tracer event",
    "EXT4-fs (nvme0n1p{n}): mounted filesystem with ordered data mode. Quota mode: none.",
    "cni0: port {n}(veth{p:x}) entered forwarding state",
    "nvidia-uvm: Loaded the UVM driver, major device number {n}.",
    "TCP: request_sock_TCP: Possible SYN flooding on port {p}. Sending cookies.",
    "device veth{p:x} entered promiscuous mode",
    "Memory cgroup out of memory: Killed process {p} (python3) total-vm:412192kB, anon-rss:62936kB",
)
_FAULTS = (
    "NVRM: Xid (PCI:0000:{b:02x}:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "NVRM: Xid (PCI:0000:{b:02x}:00): 31, pid={p}, name=python3, Ch 00000008, intr 00000000. MMU Fault",
    "NVRM: Xid (PCI:0000:{b:02x}:00): 13, pid={p}, name=python3, Graphics SM Warp Exception on "
    "(GPC 1, TPC 2, SM 0): Out Of Range Address",
)


def kmsg_record(line: str, node: str, seq: int) -> bytes:
    """A Fluent Bit kmsg-input record as its Kafka output writes it (format json)."""
    return orjson.dumps(
        {
            "priority": 4,
            "sequence": seq,
            "sec": 1000 + seq // 1000,
            "usec": seq % 1000,
            "msg": line,
            "hostname": node,
            "@timestamp": time.time(),
        }
    )


def make_corpus(records: int, fault_ratio: float = 0.001, nodes: int = 64, seed: int = 11) -> list[tuple[bytes, bytes]]:
    """(key, value) pairs: ``records`` kmsg records over ``nodes`` nodes with ``fault_ratio`` faults."""
    rng = random.Random(seed)
    out = []
    for i in range(records):
        node = f"bench-node-{rng.randrange(nodes)}"
        templates = _FAULTS if rng.random() < fault_ratio else _NOISE
        line = rng.choice(templates).format(n=rng.randrange(8), b=rng.randrange(256), p=rng.randrange(99999))
        out.append((node.encode(), kmsg_record(line, node, i)))
    return out


async def produce_all(bootstrap: str, topic: str, corpus: list[tuple[bytes, bytes]], progress: ProgressFn) -> None:
    producer = kafka_clients.producer(bootstrap=bootstrap, linger_ms=20, max_batch_size=512 * 1024, acks=1)
    await producer.start()
    try:
        pending = []
        for i, (key, value) in enumerate(corpus, 1):
            pending.append(await producer.send(topic, value, key=key))
            if len(pending) >= 20_000:
                await asyncio.gather(*pending)
                pending.clear()
                progress("produce", i, len(corpus))
        await asyncio.gather(*pending)
        progress("produce", len(corpus), len(corpus))
    finally:
        await producer.stop()


@dataclass
class Rate:
    wall: float  # records per wall-clock second, first batch to last
    cpu: float  # records per CPU second of this process over the same span (less sensitive to load)
    gc_s: float = 0.0  # CPU seconds of this thread in the cyclic GC during the whole run (start to stop)


class GcClock:
    """CPU seconds the cyclic garbage collector takes while in use (``gc.callbacks``).

    Both sides allocate one ``ConsumerRecord`` per record and keep a batch alive while the next is
    fetched, so full collections walk this process's whole heap over and over; that share is neither
    side's own work, and it moves with the heap (what else the process imported).
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._started

    def __enter__(self) -> GcClock:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def _rate(records: int, wall_s: float, cpu_s: float, gc_s: float = 0.0) -> Rate:
    return Rate(
        records / wall_s if wall_s > 0 else float("inf"), records / cpu_s if cpu_s > 0 else float("inf"), gc_s
    )


async def raw_consume(bootstrap: str, topic: str, total: int, settings: ParseSettings, progress: ProgressFn) -> Rate:
    """Rate of a bare aiokafka consumer (same fetch settings as the parse stage): fetch and iterate."""
    consumer = kafka_clients.consumer(
        topic,
        bootstrap=bootstrap,
        group_id=f"bench-raw-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        fetch_max_bytes=settings.fetch_max_bytes,
        max_partition_fetch_bytes=settings.max_partition_fetch_bytes,
        fetch_max_wait_ms=settings.fetch_max_wait_ms,
    )
    await consumer.start()
    seen = 0
    first: tuple[float, float, int] | None = None
    try:
        with GcClock() as gc_clock:
            while seen < total:
                batches = await consumer.getmany(timeout_ms=settings.poll_timeout_ms, max_records=settings.max_records)
                if batches and first is None:
                    # The clock starts when the first records are in; they were fetched before it and do not count.
                    first = (time.monotonic(), time.process_time(), sum(map(len, batches.values())))
                for records in batches.values():
                    for _record in records:
                        seen += 1
                progress("raw consumer", seen, total)
        start = first or (time.monotonic(), time.process_time(), 0)
        return _rate(seen - start[2], time.monotonic() - start[0], time.process_time() - start[1], gc_clock.seconds)
    finally:
        await consumer.stop()


async def parse_stage_rate(ctx: BenchContext, topics: TopicNames, raw_topic: str, settings: ParseSettings) -> Rate:
    stage = ParseStage(
        ctx.bootstrap, f"bench-parse-{uuid.uuid4().hex[:8]}", topics=topics, settings=settings, input_topics=[raw_topic]
    )

    async def report() -> None:
        while True:
            ctx.progress("parse stage", stage.counters.records, ctx.records)
            await asyncio.sleep(0.2)

    reporter = asyncio.ensure_future(report())
    try:
        with GcClock() as gc_clock:
            c = await stage.run(stop_after=ctx.records)
    finally:
        reporter.cancel()
    ctx.progress("parse stage", c.records, ctx.records)
    ctx.results["fault_events"] = c.events
    ctx.results["dead_letters"] = c.dead_letters
    ctx.results["noise_skipped"] = c.noise
    ctx.results.setdefault("pipeline_rates_incl_final_commit", []).append(
        (c.records - c.first_batch_records) / ((c.drained_at or 0) - (c.first_batch_at or 0))
    )
    return _rate(
        c.records - c.first_batch_records,
        (c.last_batch_at or 0) - (c.first_batch_at or 0),
        (c.last_batch_cpu or 0) - (c.first_batch_cpu or 0),
        gc_clock.seconds,
    )


@register("throughput")
async def throughput(ctx: BenchContext) -> dict[str, Any]:
    """Raw consumer and parse stage on the same records, interleaved ``repeats`` times; best of each.

    Where a record's time goes (issue 22 part 6; CPU per record, 200,000 kmsg records, 0.1% faults,
    20,000-record batches, the shared 2-core machine at load 8-15, 2026-11-25):

    - raw consumer 1.2-1.5 us: aiokafka's per-record generator and ``ConsumerRecord`` (about 70% of
      its samples in py-spy) and the cyclic GC walking each batch's 20,000 fresh records (0.45-0.55 us:
      with the GC off the raw consumer needs 0.87 us, the stage 1.25 us).
    - the stage with a no-op ``ParseCore``: 1.55 us against the raw consumer's 1.52 (medians of 5):
      producer, acknowledgements, commits and the fetch overlap cost nothing measurable.
    - ``ParseCore`` in the stage 0.3-0.4 us (thread CPU per step): values of the fresh records 0.08
      (their first touch, cache-cold), lengths 0.05 and min/max 0.02, the NUL join 0.04-0.06, the
      aho-corasick scan 0.03 (0.11, warm, before its ``\\u`` matcher was split off), offsets 0.015, decoding
      the 0.2% candidates (faults and 1-in-1000 shape checks, ~30 us each) 0.06, then sending the
      fault events.

    Seven runs of main and of the split scan, interleaved (min/median/max): ``ratio_cpu`` 0.70/0.74/0.77
    -> 0.73/0.79/0.80, ``ratio`` 0.54/0.70/0.93 -> 0.64/0.78/0.93. ``ratio`` (wall) is no measure of the
    stage on this machine: the raw consumer's wall time per record ranged 1.4-9.7 us between runs
    whose CPU time was 1.2-1.6 us (it waits on a broker that shares the two cores with load 8-28),
    so the same code spreads over 0.3 of ``ratio`` from run to run. What is left to 0.8 of
    CPU is the stage's one pass over the records' values, which the raw consumer never touches (the
    first three items above, 0.15-0.2 us), and the candidates' decoding. The one larger lever was
    aiokafka's per-record ``ConsumerRecord``: no documented seam skips it (a ``value_deserializer``
    is one more call per record; there is no batch API). The stage now takes aiokafka's decoded
    records as they come out of its batches (``upstream.deliver_bare_records``, parse5; the pinned
    internals are checked by tests/unit/test_upstream_internals.py), so it no longer pays what the raw
    consumer still pays: eight interleaved pairs, main vs parse5 (load 4-41, 2026-11-27), medians of
    ``ratio`` 0.80 -> 1.02, ``ratio_median`` 0.80 -> 1.03, ``ratio_cpu`` 0.85 -> 1.08,
    ``ratio_cpu_median`` 0.83 -> 1.09 (parse5's lowest ``ratio_cpu_median`` 0.93), the raw consumer at
    a median 282k (main's runs) and 277k (parse5's) records per CPU second. The bench process keeps
    CPython's GC thresholds for both sides, not the worker's ``pipeline.runtime.gcpolicy``.
    Without a broker (20,000 records, thread CPU, GC off) a record costs the raw consumer 1.97 us and
    the stage 1.37 us (2.61 us with ConsumerRecords), of which 0.92 us is aiokafka's fetch and decode.
    GC tuning (``gc.freeze()`` after start, a larger first threshold) would cut 0.3-0.5 us from both
    sides; it is the worker process's policy, not the stage's.

    Follow-up (parse4, load 3-20): the GC is 0.8 us of the ~1.9 us a record costs either side here
    (``raw_gc_ns_per_record``/``pipeline_gc_ns_per_record``); ``gc.set_threshold(50_000, 20, 100)`` took
    the stage from 422-435k to 673-683k records per CPU second and the raw consumer from 523-532k to
    886-922k, so ``ratio_cpu`` fell from ~0.81 to ~0.75: a common cost pulls the ratio towards 1.
    Taking every buffered record before parsing, so the next fetch overlaps the whole parse, measured
    worse (``ratio_cpu`` of three runs each 0.82/0.82/0.87 -> 0.61/0.68/0.71; its full collections
    took longer, with up to 70,000 live records instead of 20,000) once the first batch's records
    stopped counting on both sides; before, that change looked like a
    gain only because its first, uncounted batch was a whole fetch. The best-of ``ratio`` pairs each
    side's luckiest run, often from different rounds; ``ratio_median`` (per round, the two runs back to
    back) is the steadier wall figure.
    """
    topics = TopicNames(prefix=f"bench-{ctx.run_id}-")
    raw_topic = topics.name("logs_kernel")
    await ensure_topics(
        ctx.bootstrap, [raw_topic, topics.name("fault_events"), topics.name("deadletter")], ctx.partitions
    )
    await produce_all(ctx.bootstrap, raw_topic, make_corpus(ctx.records), ctx.progress)
    settings = ParseSettings()
    raws: list[Rate] = []
    stages: list[Rate] = []
    for i in range(ctx.repeats):
        # Each goes first in every other round: neither always meets the broker right after the other.
        if i % 2 == 0:
            raws.append(await raw_consume(ctx.bootstrap, raw_topic, ctx.records, settings, ctx.progress))
        stages.append(await parse_stage_rate(ctx, topics, raw_topic, settings))
        if i % 2 == 1:
            raws.append(await raw_consume(ctx.bootstrap, raw_topic, ctx.records, settings, ctx.progress))
    raw_rate = max(r.wall for r in raws)
    pipeline_rate = max(r.wall for r in stages)
    raw_cpu = max(r.cpu for r in raws)
    pipeline_cpu = max(r.cpu for r in stages)
    rounds = [stage.wall / raw.wall for raw, stage in zip(raws, stages, strict=True)]
    rounds_cpu = [stage.cpu / raw.cpu for raw, stage in zip(raws, stages, strict=True)]
    return {
        "records": ctx.records,
        "repeats": ctx.repeats,
        "raw_consume_rate": raw_rate,
        "pipeline_rate": pipeline_rate,
        "ratio": pipeline_rate / raw_rate,
        "raw_consume_rate_cpu": raw_cpu,
        "pipeline_rate_cpu": pipeline_cpu,
        "ratio_cpu": pipeline_cpu / raw_cpu,
        "raw_consume_rates": [r.wall for r in raws],
        "pipeline_rates": [r.wall for r in stages],
        # Each round's two runs are back to back, so a round's ratio sees one level of outside load;
        # the best-of figures above take each side's luckiest run, often from different rounds.
        "ratio_rounds": rounds,
        "ratio_median": statistics.median(rounds),
        "ratio_cpu_rounds": rounds_cpu,
        "ratio_cpu_median": statistics.median(rounds_cpu),
        # Nanoseconds of cyclic GC per record, median of the runs: a common cost of both (GcClock).
        "raw_gc_ns_per_record": statistics.median(r.gc_s for r in raws) / ctx.records * 1e9,
        "pipeline_gc_ns_per_record": statistics.median(r.gc_s for r in stages) / ctx.records * 1e9,
    }


@dataclass
class BenchWorker:
    """A real ``xidflow worker`` process of a section, with its log file."""

    proc: asyncio.subprocess.Process
    log_path: Path
    log_file: Any

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), 20)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self.log_file.close()


async def start_worker(ctx: BenchContext, prefix: str, name: str) -> BenchWorker:
    """Topics for ``prefix`` and a worker process reading them (app id ``bench-<run>-<name>``)."""
    from pipeline.app import worker_topics

    app_id = f"bench-{ctx.run_id}-{name}"
    await ensure_topics(ctx.bootstrap, worker_topics(app_id, TopicNames(prefix=prefix)), ctx.partitions)
    env = {
        **os.environ,
        "XIDFLOW_TOPIC_PREFIX": prefix,
        "KAFKA_BOOTSTRAP_SERVERS": ctx.bootstrap,
        "XIDFLOW_PARSE_POLL_TIMEOUT_MS": "5",
    }
    log_path = Path(tempfile.gettempdir()) / f"xidflow-bench-worker-{ctx.run_id}-{name}.log"
    log_file = log_path.open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline.cli", "worker", "--app-id", app_id, "--partitions", str(ctx.partitions),
        "--session-timeout", "10", "--loglevel", "warning",
        env=env, stdout=subprocess.DEVNULL, stderr=log_file,
    )
    return BenchWorker(proc, log_path, log_file)


async def warm_up(ctx: BenchContext, worker: BenchWorker, producer: Any, consumer: Any, kernel: str, tag: str) -> None:
    """Until the worker has joined its groups and turned a fault line into an incident (nothing is timed before)."""
    warm_deadline = time.monotonic() + 120
    while time.monotonic() < warm_deadline:
        if worker.proc.returncode is not None:
            raise RuntimeError(f"worker exited: {worker.log_tail()}")
        node = f"{tag}-w-{uuid.uuid4().hex[:6]}"
        await producer.send_and_wait(kernel, kmsg_record(_FAULTS[0].format(b=0x4E), node, 0), key=node.encode())
        t_end = time.monotonic() + 5
        while time.monotonic() < t_end:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                if any(r.key == node.encode() for r in records):
                    ctx.progress("worker warm-up", 1, 1)
                    return
        ctx.progress("worker warm-up", 0, 1)
    raise RuntimeError("worker did not produce an incident within 120 s")


@dataclass
class TimedWorld:
    """A section's worker, warmed up, with a producer of raw lines and a reader of its incidents."""

    worker: BenchWorker
    producer: Any
    consumer: Any
    topics: TopicNames

    @property
    def kernel(self) -> str:
        return self.topics.name("logs_kernel")


@contextlib.asynccontextmanager
async def timed_world(ctx: BenchContext, name: str) -> AsyncIterator[TimedWorld]:
    """Topics ``bench-<run>-<name>-``, a worker on them that turned a fault line into an incident, the clients."""
    topics = TopicNames(prefix=f"bench-{ctx.run_id}-{name}-")
    worker = await start_worker(ctx, topics.prefix, name)
    producer = kafka_clients.producer(bootstrap=ctx.bootstrap, linger_ms=1, acks=1)
    consumer = kafka_clients.consumer(
        topics.name("incidents"), bootstrap=ctx.bootstrap, auto_offset_reset="latest", group_id=None
    )
    await producer.start()
    await consumer.start()
    try:
        await warm_up(ctx, worker, producer, consumer, topics.name("logs_kernel"), f"{name}-{ctx.run_id}")
        yield TimedWorld(worker, producer, consumer, topics)
    finally:
        await consumer.stop()
        await producer.stop()
        await worker.stop()


@register("latency")
async def latency(ctx: BenchContext) -> dict[str, Any]:
    async with timed_world(ctx, "lat") as world:
        return await _latency(ctx, world)


async def _latency(ctx: BenchContext, world: TimedWorld) -> dict[str, Any]:
    producer, consumer, kernel = world.producer, world.consumer, world.kernel
    latencies: list[float] = []
    stop = asyncio.Event()
    noise_sent = 0

    async def noise() -> None:
        nonlocal noise_sent
        rng = random.Random(5)
        tick = 0.01
        per_tick = max(1, int(ctx.noise_rate * tick))
        next_at = time.monotonic()
        while not stop.is_set():
            for _ in range(per_tick):
                node = f"noise-{rng.randrange(64)}"
                line = rng.choice(_NOISE).format(n=rng.randrange(8), b=rng.randrange(256), p=rng.randrange(99999))
                await producer.send(kernel, kmsg_record(line, node, noise_sent), key=node.encode())
                noise_sent += 1
            next_at += tick
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    noise_task = asyncio.ensure_future(noise())
    try:
        await asyncio.sleep(2)  # let the noise reach steady state
        noise_started, noise_count0 = time.monotonic(), noise_sent
        timed = await timed_faults(ctx, producer, consumer, kernel, f"lat-{ctx.run_id}-m", ctx.latency_samples,
                                   "latency")
        latencies = timed.latencies_ms
        achieved = (noise_sent - noise_count0) / (time.monotonic() - noise_started)
    finally:
        stop.set()
        await asyncio.gather(noise_task, return_exceptions=True)
    if not latencies:
        raise RuntimeError("no incident latency measured")
    return {
        "latency_p50_ms": _pct(latencies, 0.50),
        "latency_p99_ms": _pct(latencies, 0.99),
        "latency_max_ms": latencies[-1],
        "latency_samples": len(latencies),
        "latency_missing": ctx.latency_samples - len(latencies),
        "background_noise_lines_per_s": achieved,
    }


@dataclass
class Timed:
    latencies_ms: list[float]
    """Sorted: line sent -> its incident received, wall clock."""
    missing: int
    """Fault lines whose incident did not come within the deadline."""
    waited_ms: float = 0.0
    """How long the last fault line's incident was waited for (a missing one's latency is at least this)."""
    by_node: dict[str, float] = field(default_factory=dict)
    """Each node's latency (ms); the missing ones are not in it."""


async def timed_faults(
    ctx: BenchContext, producer: Any, consumer: Any, kernel: str, tag: str, count: int, task: str,
    interval_s: float = 0.1, wait_s: float = 60,
) -> Timed:
    """One fault line for a fresh node (``<tag>-<i>``) every ``interval_s``; the latency of each one's incident."""
    sent: dict[str, float] = {}
    by_node: dict[str, float] = {}

    async def faults() -> None:
        for i in range(count):
            node = f"{tag}-{i}"
            value = kmsg_record(_FAULTS[0].format(b=0x4E), node, i)
            sent[node] = time.time()
            await producer.send(kernel, value, key=node.encode())
            await asyncio.sleep(interval_s)

    sending = asyncio.ensure_future(faults())
    started = time.monotonic()
    deadline = started + count * interval_s + wait_s
    try:
        while len(by_node) < count and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=100)
            now = time.time()
            for records in batches.values():
                for rec in records:
                    node = rec.key.decode() if rec.key else ""
                    if node.startswith(f"{tag}-") and node in sent and orjson.loads(rec.value).get("revision") == 0:
                        by_node[node] = (now - sent.pop(node)) * 1000
                        ctx.progress(task, len(by_node), count)
    finally:
        sending.cancel()
        await asyncio.gather(sending, return_exceptions=True)
    waited_ms = (time.monotonic() - started - count * interval_s) * 1000
    return Timed(sorted(by_node.values()), count - len(by_node), waited_ms, by_node)


@register("flood")
async def flood_section(ctx: BenchContext) -> dict[str, Any]:
    """A good node's line-to-incident latency while another node floods, against it without (``flood``)."""
    from pipeline.benchmarks.flood import flood

    return await flood(ctx)


@register("parse")
async def pure_parse(ctx: BenchContext) -> dict[str, Any]:
    try:
        from pipeline.benchmarks.parse import run_parse_benchmark
    except ImportError as exc:
        return {"parse_error": f"pipeline.benchmarks.parse not importable: {exc}"}
    ctx.progress("pure parse", 0, 1)
    result = await asyncio.to_thread(run_parse_benchmark, 1_000_000, 0.001, 2)
    ctx.progress("pure parse", 1, 1)
    return {"parse": result}


@register("storm")
async def actuator_storm(ctx: BenchContext) -> dict[str, Any]:
    """N nodes each get a fatal incident at once; seconds until all are quarantined in the API server."""
    if not ctx.kubeconfig:
        return {"storm_error": "no Kubernetes API server (KUBECONFIG) for the storm"}
    from pipeline.benchmarks.storm import storm

    ctx.progress("actuator storm", 0, 1)
    result = await storm(ctx.storm_nodes, ctx.bootstrap, ctx.kubeconfig)
    ctx.progress("actuator storm", 1, 1)
    return result


def _needs_kube(ctx: BenchContext, section: str) -> dict[str, Any] | None:
    if not ctx.kubeconfig:
        return {f"{section}_error": f"no Kubernetes API server (KUBECONFIG) for the {section} section"}
    return None


@register("burst")
async def burst_section(ctx: BenchContext) -> dict[str, Any]:
    """N nodes' fatal lines at once: produce -> worker -> actuator -> taint seen by a node watch."""
    from pipeline.benchmarks.burst import burst

    return _needs_kube(ctx, "burst") or await burst(ctx.bootstrap, ctx.kubeconfig or "", ctx.nodes, ctx.progress)


@register("failover")
async def failover_section(ctx: BenchContext) -> dict[str, Any]:
    """The burst with one of two actuators, then the worker, SIGKILLed and restarted during it."""
    from pipeline.benchmarks.burst import failover

    return _needs_kube(ctx, "failover") or await failover(
        ctx.bootstrap, ctx.kubeconfig or "", ctx.nodes, ctx.progress
    )


@register("rolling")
async def rolling_section(ctx: BenchContext) -> dict[str, Any]:
    """Paced lines while each of two workers and two actuators is restarted with SIGTERM in turn."""
    from pipeline.benchmarks.burst import rolling

    return _needs_kube(ctx, "rolling") or await rolling(ctx.bootstrap, ctx.kubeconfig or "", ctx.nodes, ctx.progress)


@register("scale")
async def scale_section(ctx: BenchContext) -> dict[str, Any]:
    """The burst inside a ``fleet``-node fleet next to the same burst on a ``nodes``-node fleet."""
    from pipeline.benchmarks.scale import scale

    return _needs_kube(ctx, "scale") or await scale(
        ctx.bootstrap, ctx.kubeconfig or "", ctx.fleet, ctx.nodes, ctx.progress
    )


def _pct(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


async def run_bench(ctx: BenchContext, sections: list[str]) -> dict[str, Any]:
    """Run the named sections in order; one failing section is reported, not fatal to the rest."""
    ctx.results.update(
        {
            "started_at": datetime.now(UTC).isoformat(),
            "bootstrap": ctx.bootstrap,
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "load_avg_start": os.getloadavg(),  # the machine is shared: figures are read against this
        }
    )
    for name in sections:
        try:
            ctx.results.update(await SECTIONS[name](ctx))
        except Exception as exc:  # noqa: BLE001 - report which section failed and why
            ctx.results[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
    ctx.results["finished_at"] = datetime.now(UTC).isoformat()
    ctx.results["load_avg_end"] = os.getloadavg()
    return ctx.results
