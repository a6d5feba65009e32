"""The Loki tail bridge into real Kafka: against a real Loki, and against a fault-injecting stand-in.

Real Loki (``pipeline.localinfra.loki``, built from Go modules and started by the ``loki`` fixture,
which fails when it cannot): lines pushed through ``POST /loki/api/v1/push`` reach the raw topic through
``xidflow loki-tail`` and a real worker turns them into incidents; Loki restarted mid-stream gives no
gap and no duplicate; a restarted bridge resumes where it was; tenants are kept apart by
``X-Scope-OrgID``; basic auth, a bearer token file and a custom CA go through a TLS auth gateway in
front of Loki (Loki itself does not authenticate; a gateway such as nginx does).

``LokiTailServer`` below stays for what a real Loki cannot be made to do on cue: it implements the
documented ``GET /loki/api/v1/tail`` contract from a store of entries: ``query`` (a LogQL stream
selector with ``=`` matchers), ``start`` (ns, inclusive, default one hour ago), ``limit`` (the most
recent ``limit`` entries since ``start``, sent oldest first, as Loki's querier does with a backward
query reversed), ``delay_for`` (<= 5), HTTP 400 on bad parameters, then live entries as they are
pushed; messages ``{"streams": [{"stream": labels, "values": [[ts, line]]}], "dropped_entries": [...]}``.
It drops connections abruptly at configured points, mid-way through a group of entries sharing a
timestamp, so that resuming must skip exactly what was already produced. Its selector matching and its
refusals are held against the real Loki (``test_the_stand_in_selects_and_refuses_as_the_real_loki``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import ssl
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from pipeline.ingest.adapters import decode_record
from pipeline.ingest.loki_tail import Backoff, LokiAuth, LokiRequestRejected, LokiTailBridge
from pipeline.kafka.admin import ensure_topics
from pipeline.localinfra.loki import LokiServer, push_lines
from pipeline.runtime.reachability import LOKI
from schemas.records import DeadLetter

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*')


def parse_selector(query: str) -> dict[str, str]:
    """``{a="b", c="d"}`` -> {"a": "b", "c": "d"}; only what this test's queries use (equality)."""
    query = query.strip()
    if not (query.startswith("{") and query.endswith("}")):
        raise ValueError(f"not a stream selector: {query!r}")
    body = query[1:-1]
    matchers: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in body.split(","))):
        m = _MATCHER.fullmatch(part)
        if m is None:
            raise ValueError(f"unsupported matcher {part!r}")
        matchers[m.group(1)] = m.group(2)
    if not matchers:
        raise ValueError("queries require at least one matcher")
    return matchers


class LokiTailServer:
    def __init__(self, batch_size: int, drop_after_messages: list[int]) -> None:
        self.store: list[tuple[int, dict[str, str], str]] = []
        self.batch_size = batch_size
        self.drop_after_messages = list(drop_after_messages)  # per connection, in order; then never
        self.requests: list[dict[str, list[str]]] = []
        self.dropped_notices: list[dict] = []
        self._changed = asyncio.Condition()
        self.port = 0
        self._server = None

    async def push(self, labels: dict[str, str], ts_ns: int, line: str) -> None:
        async with self._changed:
            self.store.append((ts_ns, labels, line))
            self._changed.notify_all()

    async def notify_dropped(self, labels: dict[str, str], ts_ns: int) -> None:
        async with self._changed:
            self.dropped_notices.append({"labels": labels, "timestamp": str(ts_ns)})
            self._changed.notify_all()

    async def _wait_for_change(self, known: int, notices_seen: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.store) > known or len(self.dropped_notices) > notices_seen)

    async def __aenter__(self) -> LokiTailServer:
        self._server = await serve(self._handle, "127.0.0.1", 0, process_request=self._check_request)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _check_request(self, connection: ServerConnection, request: Request) -> Response | None:
        parts = urlsplit(request.path)
        if parts.path != "/loki/api/v1/tail":
            return connection.respond(HTTPStatus.NOT_FOUND, "404 page not found\n")
        params = parse_qs(parts.query)
        try:
            parse_selector(params["query"][0])
            int(params.get("limit", ["100"])[0])
            delay_for = int(params.get("delay_for", ["0"])[0])
            int(params.get("start", ["0"])[0])
        except (KeyError, ValueError) as exc:
            return connection.respond(HTTPStatus.BAD_REQUEST, f"bad request: {exc}\n")
        if delay_for > 5:
            return connection.respond(HTTPStatus.BAD_REQUEST, "delay_for can't be greater than 5\n")
        return None

    async def _handle(self, ws: ServerConnection) -> None:
        params = parse_qs(urlsplit(ws.request.path).query)
        self.requests.append(params)
        matchers = parse_selector(params["query"][0])
        start = int(params.get("start", [str(time.time_ns() - 3600 * 10**9)])[0])
        limit = int(params.get("limit", ["100"])[0])
        drop_after = self.drop_after_messages.pop(0) if self.drop_after_messages else None

        def matches(labels: dict[str, str]) -> bool:
            return all(labels.get(k) == v for k, v in matchers.items())

        sent_messages = 0

        async def send(entries: list[tuple[int, dict[str, str], str]], dropped: list[dict]) -> bool:
            """Send one message; False once the connection was dropped on purpose."""
            nonlocal sent_messages
            streams: list[dict] = []
            for ts, labels, line in entries:  # consecutive entries of one stream share a stream object
                if streams and streams[-1]["stream"] == labels:
                    streams[-1]["values"].append([str(ts), line])
                else:
                    streams.append({"stream": labels, "values": [[str(ts), line]]})
            body: dict = {"streams": streams}
            if dropped:
                body["dropped_entries"] = dropped
            await ws.send(orjson.dumps(body).decode())
            sent_messages += 1
            if drop_after is not None and sent_messages >= drop_after:
                ws.transport.abort()  # abrupt: no close frame, as when a proxy or querier dies
                return False
            return True

        async with self._changed:
            known = len(self.store)
            notices_seen = len(self.dropped_notices)
            history = [e for e in self.store if e[0] >= start and matches(e[1])]
        history.sort(key=lambda e: e[0])  # stable: equal timestamps keep push order
        history = history[-limit:]  # the most recent `limit`, oldest first
        for i in range(0, len(history), self.batch_size):
            if not await send(history[i : i + self.batch_size], []):
                return
        while True:
            # Wait for new entries, or for the client to go away (server shutdown waits for handlers).
            changed = asyncio.ensure_future(self._wait_for_change(known, notices_seen))
            closed = asyncio.ensure_future(ws.wait_closed())
            done, _ = await asyncio.wait({changed, closed}, return_when=asyncio.FIRST_COMPLETED)
            if closed in done:
                changed.cancel()
                return
            closed.cancel()
            async with self._changed:
                fresh = [e for e in self.store[known:] if matches(e[1])]
                dropped = self.dropped_notices[notices_seen:]
                known = len(self.store)
                notices_seen = len(self.dropped_notices)
            for i in range(0, max(len(fresh), 1), self.batch_size):
                batch = fresh[i : i + self.batch_size]
                if not batch and not dropped:
                    break
                if not await send(batch, dropped if i == 0 else []):
                    return


async def read_all(bootstrap: str, topic: str) -> list[tuple[bytes | None, bytes]]:
    """Every record on the topic up to its current end offsets."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        if not partitions:
            await consumer._client.force_metadata_update()
            partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        out: list[tuple[bytes | None, bytes]] = []

        async def behind() -> bool:
            return any([await consumer.position(tp) < ends[tp] for tp in partitions])

        while await behind():
            batch = await consumer.getmany(*partitions, timeout_ms=1000)
            for records in batch.values():
                out.extend((r.key, r.value) for r in records)
        return out
    finally:
        await consumer.stop()


async def wait_until(predicate: Callable[[], bool], what: str, task: asyncio.Task, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if task.done():
            task.result()  # surface a crash of the bridge
            raise AssertionError(f"bridge stopped before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


async def test_bridge_resumes_without_gaps_or_duplicates(kafka_bootstrap: str, unique) -> None:
    topic, dead_topic = unique("loki-logs"), unique("loki-dead")
    await ensure_topics(kafka_bootstrap, [topic, dead_topic], partitions=3)
    nodes = [unique("gpu-a"), unique("gpu-b"), unique("gpu-c")]
    job = {"job": "gpu-kmsg"}
    base = time.time_ns() - 60 * 10**9

    # Batches of 4 entries, groups of 3 per timestamp: the first drop falls inside a group.
    async with LokiTailServer(batch_size=4, drop_after_messages=[2, 3]) as server:
        expected: list[tuple[int, str, str]] = []

        async def add(ts: int, node: str, line: str, labels: dict[str, str] | None = None) -> None:
            await server.push({**(labels or job), "node": node}, ts, line)
            if (labels or job) == job:
                expected.append((ts, node, line))

        for group in range(10):
            ts = base + group * 1000
            await add(ts, nodes[group % 3], f"NVRM: Xid (PCI:0000:4e:00): 79, history {group} first")
            await add(ts, nodes[(group + 1) % 3], f"NVRM: Xid (PCI:0000:4e:00): 79, history {group} other")
            await add(ts, nodes[group % 3], f"NVRM: Xid (PCI:0000:4e:00): 79, history {group} second")
            await add(ts + 1, nodes[0], "not for this query", labels={"job": "other"})

        bridge = LokiTailBridge(
            loki_url=server.url,
            query='{job="gpu-kmsg"}',
            topic=topic,
            bootstrap_servers=kafka_bootstrap,
            deadletter_topic=dead_topic,
            start_ns=base,
            limit=1000,
            backoff=Backoff(initial_s=0.05, maximum_s=0.2),
        )
        stop = asyncio.Event()
        task = asyncio.create_task(bridge.run(stop))
        try:
            await wait_until(lambda: bridge.stats.produced >= 30, "history to be produced", task)
            # Live entries, again sharing timestamps, with a notice that Loki dropped some.
            now = time.time_ns()
            for group in range(4):
                ts = now + group * 1000
                for k, node in enumerate(nodes):
                    await add(ts, node, f"NVRM: Xid (PCI:0000:4e:00): 79, live {group} {k}")
            await server.notify_dropped({**job, "node": nodes[0]}, now)
            await server.push({**job}, now + 10_000, "entry without a node label")
            await wait_until(lambda: bridge.stats.produced >= len(expected), "live entries to be produced", task)
            await wait_until(lambda: bridge.stats.dead_letters >= 1, "the dead letter", task)
        finally:
            stop.set()
            stats = await asyncio.wait_for(task, 30)

    # Three connections: two dropped on purpose; each resume asked for start = newest produced ts.
    assert stats.connections == 3
    starts = [int(r["start"][0]) for r in server.requests]
    assert starts[0] == base
    assert starts[1] == expected[7][0] and starts[2] > starts[1]
    assert stats.skipped_replays >= 2
    assert stats.dropped_upstream == 1

    records = await read_all(kafka_bootstrap, topic)
    got_by_node: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for key, value in records:
        logs, dead = decode_record(value, key, None, topic)
        assert dead == []
        for rec in logs:
            assert key == rec.node.encode()
            got_by_node[rec.node].append((rec.ts.timestamp(), rec.line))
    want_by_node: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for ts, node, line in expected:
        want_by_node[node].append((ts // 1000 / 1e6, line))
    # Exactly once and in order, per node.
    assert sum(len(v) for v in got_by_node.values()) == len(expected) == 42
    for node in nodes:
        assert [line for _, line in got_by_node[node]] == [line for _, line in want_by_node[node]], node
        assert [ts for ts, _ in got_by_node[node]] == pytest.approx([ts for ts, _ in want_by_node[node]])

    dead_records = [DeadLetter.from_bytes(v) for _, v in await read_all(kafka_bootstrap, dead_topic)]
    assert len(dead_records) == 1
    assert "no 'node' label" in dead_records[0].reason and dead_records[0].stage == "loki-tail"


async def _tail_answer(base: str, query: str, headers: dict[str, str], quiet_s: float = 2.0,
                       **params: int) -> tuple[int, set[str]]:
    """(HTTP status, lines sent) of a tail request from one hour ago, read until ``quiet_s`` pass without one."""
    from urllib.parse import urlencode

    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    query_string = urlencode({"query": query, "start": time.time_ns() - 3600 * 10**9, "limit": 100, **params})
    url = f"{base.replace('http', 'ws', 1)}/loki/api/v1/tail?{query_string}"
    lines: set[str] = set()
    try:
        async with connect(url, additional_headers=headers) as ws:
            with contextlib.suppress(TimeoutError):
                while True:
                    message = orjson.loads(await asyncio.wait_for(ws.recv(), quiet_s))
                    lines |= {line for s in message.get("streams", []) for _, line in s["values"]}
    except InvalidStatus as exc:
        return exc.response.status_code, lines
    return 101, lines


async def test_the_stand_in_selects_and_refuses_as_the_real_loki(loki: LokiServer) -> None:
    """``LokiTailServer`` imitates Loki's tail contract (its selector matching, its 400s), so what it does is
    asked of the real Loki too: the same streams pushed to both, the same requests, the same answers."""
    run = f"r{uuid.uuid4().hex[:8]}"
    streams = {"a-x": {"run": run, "node": "a", "job": "x"}, "b-x": {"run": run, "node": "b", "job": "x"},
               "a-y": {"run": run, "node": "a", "job": "y"}}
    now = time.time_ns()
    async with LokiTailServer(batch_size=10, drop_after_messages=[]) as stand_in:
        for n, (name, labels) in enumerate(streams.items()):
            push_lines(loki.url, labels, [(now + n, f"line of {name}")], tenant=TENANT)
            await stand_in.push(labels, now + n, f"line of {name}")
        real_headers = {"X-Scope-OrgID": TENANT}
        for query, want in [
            (f'{{run="{run}", node="a"}}', {"line of a-x", "line of a-y"}),
            (f'{{run="{run}",job="x"}}', {"line of a-x", "line of b-x"}),
            (f'{{ run = "{run}" , node="a", job="y" }}', {"line of a-y"}),
            (f'{{run="{run}", node="nobody"}}', set()),
        ]:
            real = await _tail_answer(loki.url, query, real_headers)
            imitated = await _tail_answer(stand_in.url, query, {})
            assert real == imitated == (101, want), (query, real, imitated)
        for query, extra, status in [
            (f'{{run="{run}"}}', {"delay_for": 6}, 400), ("not a selector", {}, 400), ("{}", {}, 400), ("", {}, 400),
            # Loki's max_entries_limit_per_query (5000) bounds queries, not a tail's replay: a larger limit is taken.
            (f'{{run="{run}"}}', {"limit": 5001}, 101),
        ]:
            real_status, _ = await _tail_answer(loki.url, query, real_headers, 0.5, **extra)
            imitated_status, _ = await _tail_answer(stand_in.url, query, {}, 0.5, **extra)
            assert real_status == imitated_status == status, (query, extra, real_status, imitated_status)


async def test_bridge_fails_fast_when_loki_rejects_the_query(kafka_bootstrap: str, unique) -> None:
    async with LokiTailServer(batch_size=10, drop_after_messages=[]) as server:
        bridge = LokiTailBridge(
            loki_url=server.url,
            query="job=gpu",  # not a stream selector: Loki answers 400
            topic=unique("loki-logs"),
            bootstrap_servers=kafka_bootstrap,
            deadletter_topic=unique("loki-dead"),
            backoff=Backoff(initial_s=0.05, maximum_s=0.1),
        )
        with pytest.raises(LokiRequestRejected, match="HTTP 400"):
            await asyncio.wait_for(bridge.run(), 30)
        assert server.requests == []


# -- against a real Loki --------------------------------------------------------------------------------

TENANT = "team-gpu"


def push(loki: LokiServer, node: str, run: str, lines: list[tuple[int, str]], tenant: str = TENANT) -> None:
    push_lines(loki.url, {"job": "kmsg", "run": run, "node": node}, lines, tenant=tenant)


def by_node(records: list[tuple[bytes | None, bytes]], topic: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for key, value in records:
        logs, dead = decode_record(value, key, None, topic)
        assert dead == []
        for rec in logs:
            assert key == rec.node.encode()
            out[rec.node].append(rec.line)
    return out


def real_bridge(loki: LokiServer, run: str, topic: str, bootstrap: str, dead: str, **kw) -> LokiTailBridge:
    return LokiTailBridge(
        loki_url=kw.pop("url", loki.url), query=f'{{job="kmsg", run="{run}"}}', topic=topic,
        bootstrap_servers=bootstrap, deadletter_topic=dead, start_ns=kw.pop("start_ns", time.time_ns() - 10**9),
        backoff=Backoff(initial_s=0.1, maximum_s=1.0), auth=kw.pop("auth", LokiAuth(org_id=TENANT)), **kw,
    )


def start_loki_tail(env: dict[str, str], run: str, bootstrap: str, log: Path) -> subprocess.Popen:
    """`xidflow loki-tail` as its own process, configured from LOKI_URL / LOKI_ORG_ID as a user would."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "loki-tail", "--query", f'{{job="kmsg", run="{run}"}}',
             "--bootstrap", bootstrap, "--start-ns", str(time.time_ns() - 10**9)],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
        )


async def test_real_loki_lines_reach_incidents_through_the_loki_tail_command(
    loki: LokiServer, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """Konduktor's path: node -> Loki -> `xidflow loki-tail` -> raw topic -> a real worker -> incidents."""
    from pipeline.app import worker_topics
    from pipeline.runtime.settings import TopicNames
    from tests.integration.test_pipeline import PARTITIONS, Pipeline, Worker, wait_ready

    tag = uuid.uuid4().hex[:8]
    prefix, app_id, run = f"t-loki-{tag}-", f"t-loki-{tag}", f"r{tag}"
    topics = TopicNames(prefix=prefix)
    await ensure_topics(kafka_bootstrap, worker_topics(app_id, topics), PARTITIONS)
    worker = Worker(kafka_bootstrap, app_id, prefix, tmp_path).start()
    env = {**os.environ, "XIDFLOW_METRICS_PORT": "0", "XIDFLOW_TOPIC_PREFIX": prefix, "LOKI_URL": loki.url,
           "LOKI_ORG_ID": TENANT}
    bridge = start_loki_tail(env, run, kafka_bootstrap, tmp_path / "loki-tail.log")
    nodes = [f"loki-a-{tag}", f"loki-b-{tag}", f"loki-other-tenant-{tag}"]
    try:
        async with Pipeline(kafka_bootstrap, prefix) as pipe:
            await wait_ready(pipe, worker)
            now = time.time_ns()
            push(loki, nodes[0], run, [(now, "[ 5.000001] usb 1-1: new device"),
                                      (now + 1, "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, "
                                                "GPU has fallen off the bus.")])
            push(loki, nodes[1], run, [(now + 2, "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Fatal, Link 30 "
                                                 "LTSSM Fault Up")])
            # Same labels in another tenant: the bridge's tenant must not see it.
            push(loki, nodes[2], run, [(now + 3, "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen "
                                                 "off the bus.")], tenant="someone-else")

            def incidents_for_both() -> bool:
                assert bridge.poll() is None, (tmp_path / "loki-tail.log").read_text()[-3000:]
                return all(any(i.get("type") == "incident" for i in pipe.incidents(n)) for n in nodes[:2])

            await pipe.wait_for(incidents_for_both, 120, "incidents from the Loki path")
            assert pipe.incidents(nodes[0])[0]["code"] == 79
            assert pipe.incidents(nodes[1])[0]["kind"] == "sxid"
            await asyncio.sleep(2)
            await pipe.poll()
            assert pipe.incidents(nodes[2]) == []
        raw = by_node(await read_all(kafka_bootstrap, topics.name("logs_kernel")), topics.name("logs_kernel"))
        assert nodes[2] not in raw and len(raw[nodes[0]]) == 2 and len(raw[nodes[1]]) == 1
    finally:
        bridge.terminate()
        bridge.wait(30)
        worker.stop()
    assert "stopped:" in (tmp_path / "loki-tail.log").read_text()


async def test_loki_restarted_mid_stream_no_gap_no_duplicate_and_bridge_resumes(
    loki: LokiServer, kafka_bootstrap: str, unique, caplog: pytest.LogCaptureFixture
) -> None:
    topic, dead_topic = unique("loki-real"), unique("loki-real-dead")
    await ensure_topics(kafka_bootstrap, [topic, dead_topic], partitions=3)
    run, nodes = uuid.uuid4().hex[:8], [unique("n1"), unique("n2")]
    expected: dict[str, list[str]] = defaultdict(list)
    counter = itertools.count()

    def batch(label: str, n: int = 5) -> None:
        base = time.time_ns()
        for node in nodes:
            lines = []
            for i in range(n):
                k = next(counter)
                line = f"NVRM: Xid (PCI:0000:4e:00): 13, pid={k}, name=p, {label} {i}"
                lines.append((base + k, line))
                expected[node].append(line)
            push(loki, node, run, lines)

    start = time.time_ns() - 10**9
    bridge = real_bridge(loki, run, topic, kafka_bootstrap, dead_topic, start_ns=start)
    stop = asyncio.Event()
    task = asyncio.create_task(bridge.run(stop))
    try:
        batch("before")
        await wait_until(lambda: bridge.stats.produced >= 10, "lines before the restart", task)
        caplog.clear()
        caplog.set_level(logging.INFO)
        await asyncio.to_thread(loki.stop)  # Loki goes away mid-stream...
        await asyncio.sleep(1)
        await asyncio.to_thread(loki.start)  # ...and comes back on the same data (WAL replayed)
        batch("after-loki-restart")
        await wait_until(lambda: bridge.stats.produced >= 20, "lines after Loki's restart", task)
        assert bridge.stats.connections >= 2
        # Its outage is said as a state change (pipeline.runtime.reachability.LOKI), not once per reconnection.
        said = [r.getMessage() for r in caplog.records if r.name.startswith("pipeline.ingest.loki_tail")
                and r.levelno >= logging.WARNING]
        assert not said, said
        await wait_until(lambda: not LOKI.down, "Loki said to be back", task)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)

    # The bridge itself restarts (a new process would be the same: nothing but Kafka is kept).
    batch("while-bridge-down")
    second = real_bridge(loki, run, topic, kafka_bootstrap, dead_topic, start_ns=start)
    stop2 = asyncio.Event()
    task2 = asyncio.create_task(second.run(stop2))
    try:
        await wait_until(lambda: second.stats.produced >= 10, "lines produced while the bridge was down", task2)
        batch("live-after-bridge-restart")
        await wait_until(lambda: second.stats.produced >= 20, "live lines after the bridge restart", task2)
        await asyncio.sleep(2)  # anything extra (a duplicate) would arrive now
    finally:
        stop2.set()
        await asyncio.wait_for(task2, 30)
    got = by_node(await read_all(kafka_bootstrap, topic), topic)
    assert second.stats.produced == 20 and second.stats.skipped_replays >= 1
    for node in nodes:
        assert got[node] == expected[node], node  # every line once, in order: no gap, no duplicate


class AuthGateway:
    """A TLS reverse proxy that admits a request only with an accepted Authorization header (nginx's job)."""

    def __init__(self, upstream_port: int, pki: Path, accept: set[str]) -> None:
        self.upstream_port, self.accept = upstream_port, accept
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(pki / "apiserver.crt", pki / "apiserver.key")  # SAN 127.0.0.1
        self.requests: list[dict[str, str]] = []
        self.port = 0

    async def __aenter__(self) -> AuthGateway:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ctx)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        headers = {}
        for raw in head.decode("latin-1").split("\r\n")[1:]:
            name, _, value = raw.partition(":")
            if name:
                headers[name.strip().lower()] = value.strip()
        self.requests.append(headers)
        if headers.get("authorization") not in self.accept:
            writer.write(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 13\r\nConnection: close\r\n\r\nunauthorized\n")
            await writer.drain()
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        up_writer.write(head)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


async def test_tenant_header_basic_auth_bearer_file_and_custom_ca(
    loki: LokiServer, kafka_bootstrap: str, unique, tmp_path: Path
) -> None:
    import base64

    from pipeline.localinfra.controlplane import write_pki

    pki = tmp_path / "pki"
    write_pki(pki)
    token = tmp_path / "token"
    token.write_text("t0ken-for-loki\n")
    basic = "Basic " + base64.b64encode(b"bridge:s3cret").decode()
    topic, dead_topic = unique("loki-auth"), unique("loki-auth-dead")
    await ensure_topics(kafka_bootstrap, [topic, dead_topic], partitions=1)
    run, node = uuid.uuid4().hex[:8], unique("n-auth")
    now = time.time_ns()
    push(loki, node, run, [(now, "NVRM: Xid (PCI:0000:4e:00): 13, pid=1, name=p, ours")])
    push(loki, node, run, [(now + 1, "NVRM: Xid (PCI:0000:4e:00): 13, pid=2, name=p, another tenant")],
         tenant="someone-else")

    async with AuthGateway(loki.http_port, pki, {basic, "Bearer t0ken-for-loki"}) as gw:
        url = f"https://127.0.0.1:{gw.port}"
        # Wrong password: the gateway answers 401 and the bridge stops instead of retrying forever.
        bad = real_bridge(loki, run, topic, kafka_bootstrap, dead_topic, url=url, start_ns=now - 10**9,
                          auth=LokiAuth(org_id=TENANT, username="bridge", password="wrong", ca_file=pki / "ca.crt"))
        with pytest.raises(LokiRequestRejected, match="HTTP 401"):
            await asyncio.wait_for(bad.run(), 30)
        for auth in (
            LokiAuth(org_id=TENANT, username="bridge", password="s3cret", ca_file=pki / "ca.crt"),
            LokiAuth(org_id=TENANT, bearer_token_file=token, ca_file=pki / "ca.crt"),
        ):
            bridge = real_bridge(loki, run, topic, kafka_bootstrap, dead_topic, url=url, start_ns=now - 10**9,
                                 auth=auth, resume_scan=0)
            stop = asyncio.Event()
            task = asyncio.create_task(bridge.run(stop))
            try:
                await wait_until(lambda b=bridge: b.stats.produced >= 1, "the tenant's line through the gateway",
                                 task)
                await asyncio.sleep(1)
            finally:
                stop.set()
                await asyncio.wait_for(task, 30)
            assert bridge.stats.produced == 1  # only its own tenant's line
        # Without the custom CA, the gateway's certificate is not trusted.
        untrusting = real_bridge(loki, run, topic, kafka_bootstrap, dead_topic, url=url, start_ns=now - 10**9,
                                 auth=LokiAuth(org_id=TENANT, bearer_token_file=token), resume_scan=0)
        stop = asyncio.Event()
        task = asyncio.create_task(untrusting.run(stop))
        await asyncio.sleep(3)
        stop.set()
        await asyncio.wait_for(task, 30)
        assert untrusting.stats.connections == 0
    assert {r.get("x-scope-orgid") for r in gw.requests} == {TENANT}
    assert {basic, "Bearer t0ken-for-loki"} <= {r.get("authorization") for r in gw.requests}
    got = by_node(await read_all(kafka_bootstrap, topic), topic)
    assert got[node] == ["NVRM: Xid (PCI:0000:4e:00): 13, pid=1, name=p, ours"] * 2
