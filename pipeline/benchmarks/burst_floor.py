"""The burst's floor: the least any Kafka-based pipeline can do on this machine, measured in the same run.

A minimal chain with no xidflow logic: the bench's producer (the burst's own settings) writes the same
N kernel lines to a topic of its own; one consumer process (``python -m pipeline.benchmarks.burst_floor``,
a plain aiokafka consumer assigned every partition) reads them, takes each line's node from its JSON
and hands it to the bare client (``pipeline.benchmarks.storm.raw_quarantine``: the read and the
conditional cordon + taint patch, with the concurrency the bare-client baseline uses). Latency as the
burst's: the moment a watch saw the taint - the moment the line was handed to the producer.

What the floor leaves out, so it is a lower bound and not a design: a second hop (the real path is
kernel line -> worker -> incidents topic -> actuator), offset commits and transactions (no
exactly-once, nothing survives a crash), the rules, the ledger, the breaker, the audit, Events and
conditions. If even this chain's p99 is above the goal's multiple of the bare client's time, no design
meets the goal on this machine; what lies between the floor and ``burst_p99_ms`` is xidflow's own cost.

Keys (``<prefix>_floor_*``): ``p50_ms``/``p99_ms``/``max_ms``/``samples``/``missing``/``over_5s``,
``vs_raw_ratio`` (its p99 / the bare client's ``<prefix>_raw_ms`` of the same run) and ``cpu_s`` (CPU
seconds in its window: the consumer process, the bench process, and the world's idle processes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from typing import Any

import orjson

from pipeline.actuator.kube import Kube
from pipeline.actuator.testing import create_nodes, delete_nodes
from pipeline.benchmarks import procstat
from pipeline.benchmarks.burst_watch import FATAL_LINE, TAINT_KEY, NodeWatch, kmsg, summarize
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics

READY = b"ready\n"
LABEL = "xidflow.bench/burst-floor"
WARM = 4
"""Lines through the chain before the clock starts, as the burst warms its pipeline up (connections, joins)."""


async def consume(bootstrap: str, kubeconfig: str, topic: str, partitions: int, concurrency: int) -> None:
    """The floor's consumer process: every line read -> its node quarantined by the bare client. Never returns."""
    from aiokafka import TopicPartition

    from pipeline.benchmarks.storm import raw_quarantine

    kube = Kube.from_config(kubeconfig, concurrency)
    consumer = kafka_clients.consumer(
        bootstrap=bootstrap, enable_auto_commit=False, group_id=None, fetch_max_wait_ms=10
    )
    await consumer.start()
    tps = [TopicPartition(topic, p) for p in range(partitions)]
    consumer.assign(tps)
    await consumer.seek_to_end(*tps)
    for tp in tps:
        await consumer.position(tp)  # resolved before the bench is told to start
    sys.stdout.buffer.write(READY)
    sys.stdout.buffer.flush()
    sem = asyncio.Semaphore(concurrency)
    tasks: set[asyncio.Task[None]] = set()

    async def one(node: str) -> None:
        async with sem:
            await raw_quarantine(kube, node, TAINT_KEY)

    while True:
        for records in (await consumer.getmany(timeout_ms=100)).values():
            for rec in records:
                task = asyncio.create_task(one(orjson.loads(rec.value)["hostname"]))
                tasks.add(task)
                task.add_done_callback(tasks.discard)


async def floor_baseline(
    bootstrap: str, kube: Kube, kubeconfig: str, tag: str, prefix: str, nodes: int, partitions: int,
    concurrency: int, raw_ms: float | None, others: dict[str, int], limit_s: float = 180,
) -> dict[str, Any]:
    """Run the floor once for ``nodes`` fresh nodes; its keys (module docstring).

    ``others``: name -> pid of the processes whose CPU in the window is reported beside the floor's
    (the world's, idle by now).
    """
    topic = f"b{tag}.floor-kernel"
    names = [f"b{tag}-floor-{i:05d}" for i in range(nodes)]
    warm = [f"b{tag}-floor-warm-{i}" for i in range(WARM)]
    selector = f"{LABEL}={tag}"
    await ensure_topics(bootstrap, [topic], partitions)
    await create_nodes(kube, [*names, *warm], {LABEL: tag})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline.benchmarks.burst_floor", "--bootstrap", bootstrap, "--kubeconfig", kubeconfig,
        "--topic", topic, "--partitions", str(partitions), "--concurrency", str(concurrency),
        stdout=asyncio.subprocess.PIPE,
    )
    producer = kafka_clients.producer(bootstrap, acks=1, linger_ms=5)
    watch: NodeWatch | None = None
    try:
        assert proc.stdout is not None
        if await asyncio.wait_for(proc.stdout.readline(), 120) != READY:
            raise RuntimeError(f"the floor's consumer exited ({await proc.wait()})")
        await producer.start()
        page = await kube._call(kube.core.list_node, label_selector=selector, limit=1)
        watch = NodeWatch(kube, selector, page["metadata"]["resourceVersion"])
        watch.start()
        await asyncio.sleep(0.3)  # the watch is established before the first line
        for i, node in enumerate(warm):
            await producer.send_and_wait(topic, kmsg(FATAL_LINE, node, i), key=node.encode())
        if not await _until(lambda: all(n in watch.tainted for n in warm), 120):
            raise RuntimeError("floor warm-up: the consumer did not taint its warm-up nodes within 120 s")
        pids = {"floor": proc.pid, **others}
        cpu_before = _cpu(pids)
        sent: dict[str, float] = {}
        futures = []
        for i, node in enumerate(names):
            sent[node] = time.time()
            futures.append(await producer.send(topic, kmsg(FATAL_LINE, node, i), key=node.encode()))
        await asyncio.gather(*futures)
        await _until(lambda: all(n in watch.tainted for n in names), limit_s)
        cpu = {n: round(c - cpu_before[n], 2) for n, c in _cpu(pids).items() if n in cpu_before}
        tainted = dict(watch.tainted)
    finally:
        if watch is not None:
            watch.stop()
        await producer.stop()
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
        with contextlib.suppress(Exception):
            await delete_nodes(kube, [*names, *warm])
    return floor_figures(prefix, sent, tainted, cpu, raw_ms)


def floor_figures(
    prefix: str, sent: dict[str, float], tainted: dict[str, float], cpu: dict[str, float], raw_ms: float | None
) -> dict[str, Any]:
    """The floor's keys from when each line was handed to the producer and its taint seen (seconds). Pure.

    A node whose taint was never seen counts as missing (and over 5 s), as in the burst's own figures.
    """
    latencies = [(tainted[n] - t) * 1000 for n, t in sent.items() if n in tainted]
    out = summarize(f"{prefix}_floor", latencies, len(sent))
    out[f"{prefix}_floor_cpu_s"] = cpu
    p99 = out.get(f"{prefix}_floor_p99_ms")
    if p99 is not None and raw_ms:
        out[f"{prefix}_floor_vs_raw_ratio"] = round(p99 / raw_ms, 3)
    return out


def _cpu(pids: dict[str, int]) -> dict[str, float]:
    """name -> CPU seconds so far of each pid still there, and the bench process's own (``bench``)."""
    out = {"bench": sum(os.times()[:2])}
    for name, pid in pids.items():
        with contextlib.suppress(OSError):
            out[name] = procstat.read(pid).cpu_s
    return out


async def _until(done: Any, limit_s: float) -> bool:
    """Poll ``done()`` (the watch's thread fills what it reads) until true (True) or ``limit_s`` passed (False)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if done():
            return True
        await asyncio.sleep(0.05)
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("--bootstrap", "--kubeconfig", "--topic"):
        parser.add_argument(name, required=True)
    parser.add_argument("--partitions", type=int, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    a = parser.parse_args()
    asyncio.run(consume(a.bootstrap, a.kubeconfig, a.topic, a.partitions, a.concurrency))


if __name__ == "__main__":
    main()
