"""Fuzz soak: many malformed records through a real ``xidflow worker``; is it alive, exact and bounded?

``python -m pipeline.benchmarks.soak --records 1000000 [--bootstrap host:port] [--rounds 3]``

The fuzzed records (deterministic for a seed) are random bytes, JSON of the wrong shapes, truncated
JSON, deeply nested JSON, and now and then a kernel Xid line of several hundred kilobytes, mixed with
harmless lines that pass the gate. Every malformed record carries ``fuzz-<n>`` and a gate marker, so
it is decoded and must become exactly one dead letter naming it; the harmless ones must become none. The soak
fuzzes shapes, not one node's volume: the parse stage's per-node bytes in a batch
(``XIDFLOW_PARSE_MAX_KEY_BYTES_PER_BATCH``, which folds a node's excess into one dead letter per node and batch)
is lifted for its worker, or a node's several-hundred-kilobyte line would fold the node's next records of its
batch into one letter; ``tests/unit/test_parse_stage.py`` and the bench's flood section cover that bound.

Figures: the worker's RSS before, after each round (once the parse group's commits reached the end
of the input) and after an idle pause; /healthz answers seen during the run; dead letters expected,
seen, duplicated and missing; the size of /metrics; and the seconds from a fresh node's fault line to
its incident after the soak. ``--trace-malloc`` also writes the top allocation sites of the worker
(tracemalloc, by file and line) after each round, for finding where memory stays.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from pipeline.app import worker_topics
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from pipeline.runtime.settings import TopicNames

REPO = Path(__file__).resolve().parents[2]
XID = "NVRM: Xid (PCI:0000:{bus}:00): {code}, pid=1234, name=python3, {text}"
FUZZ_ID = re.compile(r"fuzz-(\d+)\b")
HUGE_EVERY = 10_000
"""One record in this many is a huge kernel line (300 to 700 KB: under the broker's 1 MiB)."""

_TRACE_HOOK = '''
import os, threading, time, tracemalloc
tracemalloc.start(int(os.environ.get("XIDFLOW_SOAK_TRACE_FRAMES", "8")))
def _watch():  # a snapshot whenever the soak touches <out>.now (mode's worker owns the signals)
    out = os.environ["XIDFLOW_SOAK_TRACE_OUT"]
    while True:
        time.sleep(1)
        if os.path.exists(out + ".now"):
            os.unlink(out + ".now")
            snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            with open(out, "a") as f:
                f.write(f"--- {time.time():.0f} traced={tracemalloc.get_traced_memory()}\\n")
                if first:
                    for stat in snap.compare_to(first[0], "traceback")[:15]:  # what grew since the start
                        f.write(f"{stat}\\n")
                        for line in stat.traceback.format()[-12:]:
                            f.write(f"    {line}\\n")
                else:
                    first.append(snap)
first = []
threading.Thread(target=_watch, daemon=True).start()
'''


def fuzz_records(count: int, seed: int = 7, start: int = 0) -> Iterator[tuple[bytes, bytes | None, bool]]:
    """(value, key, malformed) for records ``start`` .. ``start + count - 1``."""
    rng = random.Random(seed + start)
    for n in range(start, start + count):
        tag = f"NVRM: fuzz-{n} ".encode()
        node = f"soak-node-{rng.randrange(200)}".encode()
        pick = rng.random()
        if n % HUGE_EVERY == HUGE_EVERY - 1:
            text = f"fuzz-{n} " + "h" * rng.randrange(300_000, 700_000)
            line = XID.format(bus="4e", code=79, text=text)
            yield orjson.dumps({"priority": 3, "sec": 5, "msg": line, "hostname": node.decode()}), node, True
        elif pick < 0.25:  # random bytes, no key and no node: plain text nobody can place
            raw = bytearray(rng.randbytes(rng.randrange(20, 2000)))
            at = rng.randrange(len(raw))
            # "x" first: bytes that open with '{' would be JSON lines, each line its own problem.
            yield b"x" + bytes(raw[:at]) + b"\n" + tag + bytes(raw[at:]), None, True
        elif pick < 0.45:  # JSON of the wrong shape
            shape = rng.randrange(4)
            if shape == 0:
                value = orjson.dumps({tag.decode(): 1, "x": [rng.random() for _ in range(rng.randrange(20))]})
            elif shape == 1:
                value = orjson.dumps([1, 2, 3, tag.decode()])
            elif shape == 2:
                value = orjson.dumps({"streams": tag.decode()})
            else:
                value = orjson.dumps({"msg": rng.randrange(100), "priority": 3, "note": tag.decode()})
            yield value, node, True
        elif pick < 0.60:  # truncated JSON
            full = orjson.dumps({"msg": tag.decode() + "x" * rng.randrange(200), "hostname": node.decode()})
            after_tag = full.index(tag) + len(tag)  # cut after the marker: the record must still name itself
            yield full[: rng.randrange(after_tag, len(full) - 1)], node, True
        elif pick < 0.75:  # deep nesting (past orjson's limit: invalid; below it: no log field)
            depth = rng.randrange(100, 5000)
            yield b'{"a":' * depth + b'"' + tag + b'"' + b"}" * depth, node, True
        else:  # harmless lines that pass the gate: decoded, no fault, no dead letter
            line = f"NVRM: loading NVIDIA UNIX x86_64 Kernel Module {n}"
            yield orjson.dumps({"priority": 6, "sec": 5, "msg": line, "hostname": node.decode()}), node, False


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def _partitions(topic: str, count: int) -> list[Any]:
    from aiokafka import TopicPartition

    return [TopicPartition(topic, p) for p in range(count)]


async def _committed(bootstrap: str, group: str) -> dict[Any, int]:
    admin = kafka_clients.admin(bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
        return {tp: meta.offset for tp, meta in offsets.items()}
    finally:
        await admin.close()


async def wait_settled(
    bootstrap: str, group: str, topics: list[str], partitions: int, within_s: float, alive: Callable[[], bool]
) -> bool:
    """Until the group's commits reach the end of ``topics`` (True), the worker dies or time runs out."""
    consumer = kafka_clients.consumer(bootstrap=bootstrap)
    await consumer.start()
    try:
        tps = [tp for t in topics for tp in _partitions(t, partitions)]
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and alive():
        done = await _committed(bootstrap, group)
        if all(done.get(tp, 0) >= end for tp, end in ends.items() if end > 0):
            return True
        await asyncio.sleep(1.0)
    return False


async def read_dead_letters(
    bootstrap: str, topic: str, partitions: int
) -> tuple[collections.Counter[int], collections.Counter[str], int]:
    """(fuzz id -> letters naming it, code -> letters, letters in all) of the whole dead-letter topic."""
    consumer = kafka_clients.consumer(
        bootstrap=bootstrap, group_id=None, auto_offset_reset="earliest", enable_auto_commit=False,
        max_partition_fetch_bytes=8 << 20, fetch_max_bytes=64 << 20,
    )
    await consumer.start()
    consumer.assign(_partitions(topic, partitions))
    ids: collections.Counter[int] = collections.Counter()
    codes: collections.Counter[str] = collections.Counter()
    total = 0
    try:
        ends = await consumer.end_offsets(_partitions(topic, partitions))
        while True:
            batches = await consumer.getmany(timeout_ms=500, max_records=20_000)
            for records in batches.values():
                for rec in records:
                    letter = orjson.loads(rec.value)
                    total += 1
                    codes[letter.get("code", "?")] += 1
                    if letter.get("code") == "output_failed":
                        continue
                    found = FUZZ_ID.search(letter.get("payload", ""))
                    if found:
                        ids[int(found.group(1))] += 1
            positions = [await consumer.position(tp) for tp in ends]
            if all(pos >= end for pos, end in zip(positions, ends.values(), strict=True)):
                return ids, codes, total
    finally:
        await consumer.stop()


async def run_soak(
    bootstrap: str,
    records: int = 1_000_000,
    rounds: int = 3,
    partitions: int = 4,
    seed: int = 7,
    trace_malloc: bool = False,
    log: Callable[[str], None] = print,
    settle_timeout_s: float = 3600.0,
) -> dict[str, Any]:
    from pipeline.localinfra.procs import free_port

    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"soak-{tag}-", f"soak-{tag}"
    topics = TopicNames(prefix=prefix)
    await ensure_topics(bootstrap, worker_topics(app_id, topics), partitions)
    port = free_port()
    tmp = Path(tempfile.mkdtemp(prefix="xidflow-soak-"))
    env = {
        **os.environ,
        "XIDFLOW_TOPIC_PREFIX": prefix,
        "XIDFLOW_METRICS_PORT": str(port),
        "XIDFLOW_WORKER_TICK_INTERVAL_S": "1",
        "XIDFLOW_PARSE_MAX_KEY_BYTES_PER_BATCH": str(1 << 30),  # shapes, not volume (the module's docstring)
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    trace_out = tmp / "tracemalloc.txt"
    if trace_malloc:
        (tmp / "sitecustomize.py").write_text(_TRACE_HOOK)
        env["PYTHONPATH"] = os.pathsep.join([str(tmp), env["PYTHONPATH"]])
        env["XIDFLOW_SOAK_TRACE_OUT"] = str(trace_out)
    log_path = tmp / "worker.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(  # noqa: ASYNC220 - started once; the soak watches it for its whole run
            [sys.executable, "-m", "pipeline.cli", "worker", "--bootstrap", bootstrap, "--app-id", app_id,
             "--partitions", str(partitions), "--session-timeout", "10", "--loglevel", "warning",
             # One process: the RSS and the allocation trace read are the worker's own, not a supervisor's.
             "--no-supervise"],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
        )

    def alive() -> bool:
        return proc.poll() is None

    result: dict[str, Any] = {"records": records, "rounds": rounds, "worker_log": str(log_path)}
    health: collections.Counter[int] = collections.Counter()
    stop_health = asyncio.Event()

    async def watch_health() -> None:
        while not stop_health.is_set():
            status, _ = await asyncio.to_thread(http_get, f"http://127.0.0.1:{port}/healthz")
            health[status] += 1
            try:
                await asyncio.wait_for(stop_health.wait(), 5.0)
            except TimeoutError:
                pass

    producer = kafka_clients.producer(bootstrap, acks=1, linger_ms=20, max_request_size=1 << 20)
    await producer.start()
    incidents = kafka_clients.consumer(topics.name("incidents"), bootstrap=bootstrap, group_id=None,
                                       auto_offset_reset="latest")
    await incidents.start()
    watcher: asyncio.Task | None = None
    try:
        first = await fault_to_incident(producer, incidents, topics, f"soak-warmup-{tag}", 180.0, alive)
        if first is None:
            raise RuntimeError(f"worker not ready:\n{log_path.read_text(errors='replace')[-3000:]}")
        watcher = asyncio.create_task(watch_health())
        result["rss_kib_start"] = rss_kib(proc.pid)
        if trace_malloc:
            await asyncio.to_thread(Path(f"{trace_out}.now").touch)
        malformed: set[int] = set()
        per_round = records // rounds
        started = time.monotonic()
        result["rss_kib_after_round"] = []
        for r in range(rounds):
            begin = r * per_round
            count = per_round if r < rounds - 1 else records - begin
            pending = []
            for value, key, bad in fuzz_records(count, seed, begin):
                if bad:
                    malformed.add(begin + len(pending))
                topic = topics.name("logs_kernel")
                pending.append(await producer.send(topic, value, key=key))
                if len(pending) >= 5000:
                    await asyncio.gather(*pending)
                    begin += len(pending)
                    pending = []
            await asyncio.gather(*pending)
            settled = await wait_settled(bootstrap, f"{app_id}-parse", [topics.name("logs_kernel")], partitions,
                                         settle_timeout_s, alive)
            if not settled:
                result["error"] = "the parse group did not reach the end of the input" if alive() else "worker died"
                break
            rss = rss_kib(proc.pid)
            result["rss_kib_after_round"].append(rss)
            if trace_malloc:
                await asyncio.to_thread(Path(f"{trace_out}.now").touch)  # the hook appends a snapshot
            log(f"round {r + 1}/{rounds}: {count} records settled; worker RSS {rss / 1024:.0f} MiB")
        result["seconds"] = round(time.monotonic() - started, 1)
        result["records_per_s"] = round(records / max(result["seconds"], 1e-9))
        await asyncio.sleep(10)
        result["rss_kib_after_idle_10s"] = rss_kib(proc.pid) if alive() else None
        await asyncio.sleep(30)  # the worker gives freed memory back every 30 s
        result["rss_kib_after_idle"] = rss_kib(proc.pid) if alive() else None
        result["alive"] = alive()
        took = await fault_to_incident(producer, incidents, topics, f"soak-after-{tag}", 60.0, alive)
        result["fault_to_incident_after_soak_s"] = None if took is None else round(took, 2)
        status, body = http_get(f"http://127.0.0.1:{port}/metrics")
        result["metrics_bytes"] = len(body)
        result["metrics_series"] = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
        ids, codes, total = await read_dead_letters(bootstrap, topics.name("deadletter"), partitions)
        result["dead_letters"] = total
        result["dead_letters_by_code"] = dict(codes)
        result["malformed_records"] = len(malformed)
        result["malformed_missing"] = len(malformed - set(ids))
        result["malformed_duplicated"] = sum(1 for n, c in ids.items() if c > 1)
        result["harmless_dead_lettered"] = len(set(ids) - malformed)
    finally:
        stop_health.set()
        if watcher is not None:
            await watcher
        result["healthz"] = {str(k): v for k, v in health.items()}
        await producer.stop()
        await incidents.stop()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    if trace_malloc and trace_out.exists():
        result["tracemalloc"] = str(trace_out)
    return result


async def fault_to_incident(producer: Any, incidents: Any, topics: TopicNames, node: str, within_s: float,
                            alive: Callable[[], bool]) -> float | None:
    """Seconds from a fresh node's fault line to its incident, or None."""
    line = XID.format(bus="4e", code=79, text="GPU has fallen off the bus.")
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline and alive():
        sent = time.monotonic()
        value = orjson.dumps({"priority": 3, "sec": 5, "msg": line, "hostname": node, "@timestamp": time.time()})
        await producer.send_and_wait(topics.name("logs_kernel"), value, key=node.encode())
        until = time.monotonic() + 10
        while time.monotonic() < until:
            for batch in (await incidents.getmany(timeout_ms=200)).values():
                if any(node.encode() in r.value for r in batch):
                    return time.monotonic() - sent
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    parser.add_argument("--trace-malloc", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.ERROR)  # the driver's own clients: only what is wrong
    infra = tmp = None
    bootstrap = args.bootstrap
    if not bootstrap:
        from pipeline.localinfra.kafka import KafkaCluster

        tmp = tempfile.TemporaryDirectory(prefix="xidflow-soak-kafka-")
        infra = KafkaCluster(Path(tmp.name), brokers=1, log=print).start()
        bootstrap = infra.bootstrap
    try:
        result = asyncio.run(run_soak(bootstrap, args.records, args.rounds, seed=args.seed,
                                      trace_malloc=args.trace_malloc))
    finally:
        if infra is not None:
            infra.stop()
        if tmp is not None:
            tmp.cleanup()
    data = orjson.dumps(result, option=orjson.OPT_INDENT_2)
    print(data.decode())
    if args.json:
        args.json.write_bytes(data)
    ok = result.get("alive") and not result.get("error") and not result.get("malformed_missing") \
        and not result.get("malformed_duplicated") and result.get("fault_to_incident_after_soak_s") is not None
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
