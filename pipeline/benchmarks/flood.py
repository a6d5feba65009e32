"""The flood section: a good node's line-to-incident latency while another node floods, against it without.

One real ``xidflow worker``; fault lines of fresh good nodes, one every 100 ms (their names spread them over
every partition, the flooded one included), timed from the send to their incident. First without a flood
(``flood_quiet_*``), then while one node's shipper sends, as fast as the broker takes them, records of
~600 KB holding ~86,000 short lines, each the kernel marker (``flood_*``): the record the issue
measured at ~1 s of parse CPU each. The flood runs in a process of its own (``python -m
pipeline.benchmarks.flood``) so that it competes for the machine as a shipper would, not for the timing
loop. Both phases run in the same section, against the same worker, one after the other, and the result is
their ratio (``flood_vs_quiet_p50_ratio``, ``flood_vs_quiet_p99_ratio``): the machine's noise is in both.

Also reported: what the flood achieved (``flood_mb_per_s``, ``flood_records``), the good faults whose incident
did not come within a minute after the last was sent (``flood_missing``; each counts as the time it was waited
for, so the flooded percentiles are then lower bounds), the flooded latencies of the good nodes whose records share
the flooder's partition (``flood_same_partition_*``: they wait behind its records there, per-partition order) and
of the others (``flood_other_partitions_*``: they share only the stage's CPU), and the dead letters the flooding
node got, by code (``flood_deadletters``): what the parse stage's bounds (``XIDFLOW_PARSE_MAX_LINES_PER_RECORD``,
``..._MAX_KEY_BYTES_PER_BATCH``) turned its excess into.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from typing import Any

import orjson

from pipeline.benchmarks.pipeline import BenchContext, _pct, timed_faults, timed_world
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.partitioner import KeyPartitioner

FLOOD_LINE = b"NVRM: "
"""Each flood line is the kernel marker itself, so the parse stage's gate cannot pass it over as noise."""
FLOOD_LINES = 600_000 // (len(FLOOD_LINE) + 1)


def flood_record(lines: int = FLOOD_LINES) -> bytes:
    """A plain-text record of ``lines`` short marker lines (~600 KB, ~86,000 lines at the default)."""
    return b"\n".join([FLOOD_LINE] * lines)


async def produce_flood(bootstrap: str, topic: str, node: str, seconds: float, in_flight: int = 16) -> dict[str, Any]:
    """Send flood records keyed by ``node`` as fast as the broker acknowledges them, for ``seconds``."""
    value = flood_record()
    producer = kafka_clients.producer(bootstrap=bootstrap, acks=1, linger_ms=0, max_request_size=2 << 20,
                                      max_batch_size=1 << 20)
    await producer.start()
    sent = 0
    started = time.monotonic()
    try:
        pending: collections.deque[asyncio.Future] = collections.deque()
        while time.monotonic() - started < seconds:
            pending.append(await producer.send(topic, value, key=node.encode()))
            sent += 1
            if len(pending) >= in_flight:
                await pending.popleft()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    elapsed = time.monotonic() - started
    return {"records": sent, "bytes": sent * len(value), "seconds": elapsed}


async def _flood_process(bootstrap: str, topic: str, node: str, seconds: float) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline.benchmarks.flood", "--bootstrap", bootstrap, "--topic", topic, "--node", node,
        "--seconds", str(seconds), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )


async def _dead_letters(bootstrap: str, topic: str, node: str, until: float) -> collections.Counter[str]:
    """Dead letters keyed ``node`` on the dead-letter topic, by code, read until ``until`` (monotonic)."""
    counts: collections.Counter[str] = collections.Counter()
    consumer = kafka_clients.consumer(topic, bootstrap=bootstrap, auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    try:
        while time.monotonic() < until:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for rec in records:
                    letter = orjson.loads(rec.value)
                    if letter.get("key") == node:
                        counts[str(letter.get("code"))] += 1
    finally:
        await consumer.stop()
    return counts


async def flood(ctx: BenchContext) -> dict[str, Any]:
    samples = max(10, ctx.latency_samples // 4)
    flooder = f"flood-{ctx.run_id}-flooder"
    async with timed_world(ctx, "flood") as world:
        producer, consumer, kernel, worker = world.producer, world.consumer, world.kernel, world.worker
        quiet = await timed_faults(ctx, producer, consumer, kernel, f"flood-{ctx.run_id}-q", samples, "flood: quiet")
        # The flood lasts the flooded phase's sending plus a little; its backlog is the worker's to read after.
        seconds = 3 + samples * 0.1
        flood_proc = await _flood_process(ctx.bootstrap, kernel, flooder, seconds)
        await asyncio.sleep(3)  # the flood at its rate before the first good line
        flooded = await timed_faults(ctx, producer, consumer, kernel, f"flood-{ctx.run_id}-f", samples,
                                     "flood: flooded")
        out, err = await flood_proc.communicate()
        if flood_proc.returncode != 0:
            raise RuntimeError(f"flood producer failed: {err.decode(errors='replace')[-1000:]}")
        achieved = orjson.loads(out)
        letters = await _dead_letters(ctx.bootstrap, world.topics.name("deadletter"), flooder, time.monotonic() + 5)
        if worker.proc.returncode is not None:
            raise RuntimeError(f"worker exited during the flood: {worker.log_tail()}")
    if not quiet.latencies_ms:
        raise RuntimeError("no latency measured without the flood")
    q50, q99 = _pct(quiet.latencies_ms, 0.5), _pct(quiet.latencies_ms, 0.99)
    # A good fault whose incident never came counts as the time it was waited for: a lower bound.
    waited = flooded.latencies_ms + [flooded.waited_ms] * flooded.missing
    f50, f99 = _pct(waited, 0.5), _pct(waited, 0.99)
    # Good nodes whose records share the flooder's partition wait behind its records there (per-partition order);
    # the others only share the stage's CPU.
    partition = KeyPartitioner()
    flooded_partition = partition(flooder.encode(), list(range(ctx.partitions)), [])
    sharing = sorted(v for n, v in flooded.by_node.items()
                     if partition(n.encode(), list(range(ctx.partitions)), []) == flooded_partition)
    apart = sorted(v for n, v in flooded.by_node.items()
                   if partition(n.encode(), list(range(ctx.partitions)), []) != flooded_partition)
    return {
        "flood_other_partitions_p50_ms": _pct(apart, 0.5) if apart else None,
        "flood_other_partitions_p99_ms": _pct(apart, 0.99) if apart else None,
        "flood_same_partition_p50_ms": _pct(sharing, 0.5) if sharing else None,
        "flood_same_partition_p99_ms": _pct(sharing, 0.99) if sharing else None,
        "flood_same_partition_samples": len(sharing),
        "flood_quiet_p50_ms": q50,
        "flood_quiet_p99_ms": q99,
        "flood_p50_ms": f50,
        "flood_p99_ms": f99,
        "flood_max_ms": waited[-1],
        "flood_vs_quiet_p50_ratio": f50 / q50,
        "flood_vs_quiet_p99_ratio": f99 / q99,
        "flood_samples": samples,
        "flood_missing": flooded.missing,
        "flood_quiet_missing": quiet.missing,
        "flood_records": achieved["records"],
        "flood_mb_per_s": achieved["bytes"] / achieved["seconds"] / 1e6,
        "flood_deadletters": dict(letters),
    }


def main(argv: list[str] | None = None) -> int:
    """The flood producer of the section: prints what it sent as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    args = parser.parse_args(argv)
    result = asyncio.run(produce_flood(args.bootstrap, args.topic, args.node, args.seconds))
    sys.stdout.write(orjson.dumps(result).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
