"""The Loki tail bridge against a websocket server speaking Loki's tail protocol, into real Kafka.

Loki itself cannot be installed on this machine, so ``LokiTailServer`` below implements the
documented ``GET /loki/api/v1/tail`` contract from a store of entries: ``query`` (a LogQL stream
selector with ``=`` matchers), ``start`` (ns, inclusive, default one hour ago), ``limit`` (the most
recent ``limit`` entries since ``start``, sent oldest first, as Loki's querier does with a backward
query reversed), ``delay_for`` (<= 5), HTTP 400 on bad parameters, then live entries as they are
pushed; messages ``{"streams": [{"stream": labels, "values": [[ts, line]]}], "dropped_entries": [...]}``.
It drops connections abruptly at configured points, mid-way through a group of entries sharing a
timestamp, so that resuming must skip exactly what was already produced.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import defaultdict
from collections.abc import Callable
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from websockets.asyncio.server import ServerConnection, serve
from websockets.http11 import Request, Response

from pipeline.adapters import decode_record
from pipeline.kafka_admin import ensure_topics
from pipeline.loki_tail import Backoff, LokiRequestRejected, LokiTailBridge
from schemas.records import DeadLetter

pytestmark = pytest.mark.integration

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
            limit = int(params.get("limit", ["100"])[0])
            delay_for = int(params.get("delay_for", ["0"])[0])
            int(params.get("start", ["0"])[0])
        except (KeyError, ValueError) as exc:
            return connection.respond(HTTPStatus.BAD_REQUEST, f"bad request: {exc}\n")
        if delay_for > 5:
            return connection.respond(HTTPStatus.BAD_REQUEST, "delay_for can't be greater than 5\n")
        if limit > 5000:
            return connection.respond(HTTPStatus.BAD_REQUEST, "max entries limit per query exceeded\n")
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


async def test_server_rejects_what_loki_rejects() -> None:
    """The test server's request checks, so the bridge is exercised against Loki's real contract."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidStatus

    async with LokiTailServer(batch_size=10, drop_after_messages=[]) as server:
        base = f"ws://127.0.0.1:{server.port}"
        for path, status in [
            ("/loki/api/v1/tail?query=%7Bjob%3D%22x%22%7D&delay_for=6", 400),
            ("/loki/api/v1/tail?limit=5", 400),
            ("/loki/api/v1/tail?query=%7Bjob%3D%22x%22%7D&limit=5001", 400),
            ("/loki/api/v1/query?query=%7Bjob%3D%22x%22%7D", 404),
        ]:
            with pytest.raises(InvalidStatus) as err:
                async with connect(base + path):
                    pass
            assert err.value.response.status_code == status, path


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
