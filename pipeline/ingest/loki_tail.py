"""Bridge a Loki tail query into Kafka, without gaps or duplicates across reconnects.

Loki's ``GET /loki/api/v1/tail`` is a websocket. Query parameters: ``query`` (LogQL), ``start``
(nanosecond epoch, inclusive, default one hour ago), ``delay_for`` (seconds, at most 5) and ``limit``
(how many past entries to replay). Each text message is
``{"streams": [{"stream": {labels}, "values": [["<ts_ns>", "<line>"], ...]}], "dropped_entries":
[{"labels": {...}, "timestamp": "<ts_ns>"}]}``. On connect Loki first replays the most recent
``limit`` entries at or after ``start`` (a backward query, reversed into forward order), then streams
new entries as ingesters receive them.

Resuming: ``start`` is inclusive, so after a disconnect we reconnect with ``start`` = the newest
timestamp already produced and drop the replayed entries at exactly that timestamp that we already
produced, recognised by (timestamp, digest of stream labels + line). Entries are marked produced only
after Kafka acknowledged them (acks=all, idempotent producer), so a Kafka failure replays rather than
loses. Every record carries a ``xidflow-loki-tail`` header naming the tail (a digest of tenant and
query), so a restarted bridge rebuilds the cursor from the newest records of its own on the topic
(scanning back at most ``resume_scan`` records per partition) and resumes where it was.
Known limits: if more than ``limit`` entries arrived while disconnected, Loki's replay cannot return
the oldest of them (we log an error when a replay fills ``limit``); entries that Loki itself delivers
late and out of order across streams are produced but do not move the resume point.

One module (about 490 lines) on purpose: the websocket reader, the producer and the cursor keep one
invariant together (the cursor moves only past what Kafka acknowledged); split, it would span files.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import random
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import orjson
from aiokafka.errors import KafkaError
from websockets.exceptions import InvalidStatus

from pipeline.kafka import clients as kafka_clients
from pipeline.kafka import undecodable as undecodable_mod
from pipeline.kafka import undecodable_fetch, upstream
from pipeline.kafka.undecodable import Failure, Undecodable
from pipeline.runtime import metrics
from pipeline.runtime.deadletter_log import DeadLetterReporter
from pipeline.runtime.reachability import BROKER, LOKI
from schemas.records import DeadLetter, DeadLetterCode

log = logging.getLogger(__name__)
STAGE = metrics.LOKI_TAIL
"""The stage its dead letters name (the metric label ``stage``): the process's own name."""


class LokiRequestRejected(Exception):
    """Loki answered the tail request with a client error (bad query, auth): retrying cannot help."""


TAIL_PATH = "/loki/api/v1/tail"
MAX_DELAY_FOR_S = 5  # Loki rejects delay_for above 5 seconds
# Entries replayed on (re)connect: Loki's default max_entries_limit_per_query, which bounds queries but not a
# tail's replay (Loki 3.7 takes a larger tail limit; tests/integration/test_loki_tail.py asks the real one).
DEFAULT_LIMIT = 5000
RESUME_HEADER = "xidflow-loki-tail"
DEFAULT_RESUME_SCAN = 10_000
RESUME_APPROACH_RECORDS = 500
"""Records per fetch while the resume scan reads a partition up to a batch it cannot decode."""
RESUME_STALL_S = 20.0
"""How long the resume scan waits for a partition's position to move before it stops reading it: a broker
that cannot serve a partition past a batch (its length field broken on disk) answers with no records and
no error, so the scan (and the start) waited for ever."""


@dataclass(frozen=True)
class LokiAuth:
    """How the bridge authenticates to Loki (or the gateway in front of it) and trusts its certificate.

    Loki itself only reads the tenant header; basic auth and bearer tokens are checked by the gateway
    (nginx, Grafana Cloud, an auth proxy). The bearer token file is read again on every connection, so
    a rotated (projected service-account) token is picked up without a restart.
    """

    org_id: str | None = None
    username: str | None = None
    password: str | None = None
    bearer_token_file: Path | None = None
    ca_file: Path | None = None

    def __post_init__(self) -> None:
        if self.username is not None and self.bearer_token_file is not None:
            raise ValueError("use basic auth (username/password) or a bearer token file, not both")
        if self.password is not None and self.username is None:
            raise ValueError("a password needs a username")

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.org_id:
            out["X-Scope-OrgID"] = self.org_id
        if self.username is not None:
            pair = f"{self.username}:{self.password or ''}".encode()
            out["Authorization"] = "Basic " + base64.b64encode(pair).decode("ascii")
        elif self.bearer_token_file is not None:
            token = Path(self.bearer_token_file).read_text().strip()
            if not token:
                raise ValueError(f"bearer token file {self.bearer_token_file} is empty")
            out["Authorization"] = f"Bearer {token}"
        return out

    def ssl_context(self) -> ssl.SSLContext | None:
        """A context trusting ``ca_file`` (in addition to nothing else), or None for the system's trust."""
        if self.ca_file is None:
            return None
        return ssl.create_default_context(cafile=str(self.ca_file))


def tail_identity(query: str, org_id: str | None) -> str:
    """Names one tail (tenant + query) in the records' resume header."""
    return hashlib.blake2b(f"{org_id or ''}\x1f{query}".encode(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class TailEntry:
    """One log entry from a tail message."""

    ts_ns: int
    labels: Mapping[str, str]
    line: str

    @property
    def identity(self) -> str:
        return entry_identity(self.labels, self.line)


@dataclass(slots=True)
class TailMessage:
    entries: list[TailEntry]
    dropped: int
    malformed: list[str] = field(default_factory=list)


DERIVED_LABELS = frozenset({"detected_level"})
"""Labels Loki derives at query time and shows inconsistently: a query (the replay on connect) returns
``detected_level`` (structured metadata from ``discover_log_levels``), a live tail does not. They are
left out of an entry's identity so a replayed entry is recognised."""


def entry_identity(labels: Mapping[str, str], line: str) -> str:
    """A short digest of an entry's stream labels and line; two streams may log the same line at once."""
    h = hashlib.blake2b(digest_size=12)
    for name in sorted(labels):
        if name in DERIVED_LABELS:
            continue
        h.update(str(name).encode("utf-8", "surrogatepass"))
        h.update(b"=")
        h.update(str(labels[name]).encode("utf-8", "surrogatepass"))
        h.update(b"\x1f")
    h.update(b"\x1e")
    h.update(line.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


class TailCursor:
    """Where to resume: the newest timestamp produced, and which entries at exactly it were produced."""

    __slots__ = ("last_ts_ns", "seen_at_last")

    def __init__(self, last_ts_ns: int | None = None) -> None:
        self.last_ts_ns = last_ts_ns
        self.seen_at_last: set[str] = set()

    def is_new(self, entry: TailEntry) -> bool:
        """False for an entry already produced (a replay at the resume timestamp)."""
        if self.last_ts_ns is None or entry.ts_ns != self.last_ts_ns:
            return True
        return entry.identity not in self.seen_at_last

    def mark(self, entry: TailEntry) -> None:
        """Record that the entry is durably produced."""
        if self.last_ts_ns is None or entry.ts_ns > self.last_ts_ns:
            self.last_ts_ns = entry.ts_ns
            self.seen_at_last = {entry.identity}
        elif entry.ts_ns == self.last_ts_ns:
            self.seen_at_last.add(entry.identity)
        # Older (late, out-of-order) entries are produced but cannot move the resume point.

    def select_new(self, entries: Iterable[TailEntry]) -> list[TailEntry]:
        """The entries of one message not produced before, without duplicates inside the message."""
        fresh: list[TailEntry] = []
        pending: set[tuple[int, str]] = set()
        for entry in entries:
            if not self.is_new(entry):
                continue
            key = (entry.ts_ns, entry.identity)
            if key in pending:
                continue
            pending.add(key)
            fresh.append(entry)
        return fresh


def parse_tail_message(raw: str | bytes) -> TailMessage:
    """Entries of one tail websocket message, in the order Loki sent them; bad parts are named."""
    msg = TailMessage(entries=[], dropped=0)
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        msg.malformed.append(f"invalid JSON: {exc}")
        return msg
    if not isinstance(obj, dict):
        msg.malformed.append("message is not a JSON object")
        return msg
    dropped = obj.get("dropped_entries")
    if isinstance(dropped, list):
        msg.dropped = len(dropped)
    streams = obj.get("streams") or []
    if not isinstance(streams, list):
        msg.malformed.append("'streams' is not a list")
        return msg
    for i, stream in enumerate(streams):
        labels = stream.get("stream") if isinstance(stream, dict) else None
        values = stream.get("values") if isinstance(stream, dict) else None
        if not isinstance(labels, dict) or not isinstance(values, list):
            msg.malformed.append(f"streams[{i}] lacks 'stream' labels or 'values'")
            continue
        str_labels = {str(k): str(v) for k, v in labels.items()}
        for j, value in enumerate(values):
            if (
                not isinstance(value, list)
                or len(value) < 2
                or not isinstance(value[0], str)
                or not value[0].isdigit()
                or not isinstance(value[1], str)
            ):
                msg.malformed.append(f'streams[{i}].values[{j}] is not ["<ts_ns>", "<line>"]')
                continue
            msg.entries.append(TailEntry(int(value[0]), str_labels, value[1]))
    return msg


def tail_url(
    loki_url: str,
    query: str,
    *,
    start_ns: int | None = None,
    delay_for_s: int = 0,
    limit: int = DEFAULT_LIMIT,
) -> str:
    """The websocket URL of a tail request (http -> ws, https -> wss; a path prefix is kept)."""
    parts = urlsplit(loki_url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"Loki URL must be http(s)://host[:port][/prefix], got {loki_url!r}")
    params: dict[str, Any] = {"query": query, "limit": limit}
    if delay_for_s:
        params["delay_for"] = min(int(delay_for_s), MAX_DELAY_FOR_S)
    if start_ns is not None:
        params["start"] = start_ns
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + TAIL_PATH, urlencode(params), ""))


def encode_entry(entry: TailEntry) -> bytes:
    """The Kafka value for one entry: a Loki push body with one stream and one value (adapters read it)."""
    return orjson.dumps({"streams": [{"stream": dict(entry.labels), "values": [[str(entry.ts_ns), entry.line]]}]})


def node_of(entry: TailEntry, node_label: str) -> str | None:
    node = entry.labels.get(node_label, "").strip()
    return node or None


class Backoff:
    """Exponential backoff with full jitter; reset after a connection delivered something."""

    def __init__(self, initial_s: float = 0.5, maximum_s: float = 30.0) -> None:
        self.initial_s = initial_s
        self.maximum_s = maximum_s
        self.attempt = 0

    def next_delay(self) -> float:
        ceiling = min(self.maximum_s, self.initial_s * (2**self.attempt))
        self.attempt += 1
        return random.uniform(ceiling / 2, ceiling)

    def reset(self) -> None:
        self.attempt = 0


@dataclass(slots=True)
class BridgeStats:
    connections: int = 0
    produced: int = 0
    skipped_replays: int = 0
    dropped_upstream: int = 0
    dead_letters: int = 0


class LokiTailBridge:
    """Reads a Loki tail websocket and produces every entry to Kafka keyed by its node label."""

    def __init__(
        self,
        *,
        loki_url: str,
        query: str,
        topic: str,
        bootstrap_servers: str,
        deadletter_topic: str,
        node_label: str = "node",
        start_ns: int | None = None,
        delay_for_s: int = 0,
        limit: int = DEFAULT_LIMIT,
        headers: Mapping[str, str] | None = None,
        backoff: Backoff | None = None,
        auth: LokiAuth | None = None,
        resume_scan: int = DEFAULT_RESUME_SCAN,
        resume_stall_s: float = RESUME_STALL_S,
    ) -> None:
        tail_url(loki_url, query)  # validate early: a bad URL is a usage error, not a reconnect loop
        self.loki_url = loki_url
        self.query = query
        self.topic = topic
        self.bootstrap_servers = bootstrap_servers
        self.deadletter_topic = deadletter_topic
        self._dead_letters = DeadLetterReporter(metrics.LOKI_TAIL_DEADLETTERS)
        self.node_label = node_label
        self.first_start_ns = start_ns
        self.delay_for_s = delay_for_s
        self.limit = limit
        self.headers = dict(headers or {})
        self.auth = auth or LokiAuth()
        self.backoff = backoff or Backoff()
        self.cursor = TailCursor()
        self.stats = BridgeStats()
        self.resume_scan = resume_scan
        self.resume_stall_s = resume_stall_s
        org_id = self.auth.org_id or self.headers.get("X-Scope-OrgID")
        self.identity = tail_identity(query, org_id)
        self._record_headers = [(RESUME_HEADER, self.identity.encode())]

    def current_url(self) -> str:
        start = self.cursor.last_ts_ns if self.cursor.last_ts_ns is not None else self.first_start_ns
        return tail_url(self.loki_url, self.query, start_ns=start, delay_for_s=self.delay_for_s, limit=self.limit)

    async def resume_from_kafka(self) -> int:
        """Rebuild the cursor from this tail's newest records on the topic; returns how many were read."""
        consumer = kafka_clients.consumer(bootstrap=self.bootstrap_servers, enable_auto_commit=False)
        await consumer.start()
        found = 0
        try:
            if self.topic not in await consumer.topics():
                return 0
            from aiokafka import TopicPartition

            ids = consumer.partitions_for_topic(self.topic)
            if not ids:  # topics() fetched metadata apart; the client's own view needs a refresh
                await upstream.refresh_metadata(consumer)
                ids = consumer.partitions_for_topic(self.topic) or set()
            partitions = [TopicPartition(self.topic, p) for p in sorted(ids)]
            if not partitions:
                return 0
            consumer.assign(partitions)
            ends = await consumer.end_offsets(partitions)
            begins = await consumer.beginning_offsets(partitions)
            for tp in partitions:
                consumer.seek(tp, max(begins[tp], ends[tp] - self.resume_scan))
            pending = {tp for tp in partitions if ends[tp] > begins[tp]}
            ours = (RESUME_HEADER, self.identity.encode())
            # Corrupt batches are skipped at the first failure, and a batch whose codec library is missing
            # is skipped too instead of held: the scan only looks for the cursor, it cannot wait for a fix.
            undecodable = Undecodable(attempts_before_skip=1)

            async def take(batch: dict[Any, list[Any]]) -> None:
                nonlocal found
                for records in batch.values():
                    for rec in records:
                        if ours in list(rec.headers or ()):
                            for entry in parse_tail_message(rec.value).entries:
                                self.cursor.mark(entry)
                                found += 1

            # Where each partition's position last moved: a broker that cannot serve a partition past a
            # batch (its length field is broken) answers with no records, and no error, for ever.
            moved = {tp: (await consumer.position(tp), time.monotonic()) for tp in pending}
            while pending:
                try:
                    batch = await consumer.getmany(*pending, timeout_ms=1000)
                except Exception as exc:
                    failure = upstream.locate_undecodable(exc)
                    if failure is None:
                        if undecodable_mod.unreadable(exc):
                            # A batch nobody can place (no partition, no offset): give up the rest of the scan.
                            await self._give_up(consumer, pending, ends, exc)
                            break
                        raise
                    # Other partitions' records taken before the failure: their positions moved past them.
                    await take(upstream.drained_before(exc))
                    await self._skip_undecodable(consumer, undecodable, failure, take)
                    continue
                await take(batch)
                now = time.monotonic()
                for tp in list(pending):
                    position = await consumer.position(tp)
                    if position >= ends[tp]:
                        pending.discard(tp)
                    elif position != moved[tp][0]:
                        moved[tp] = (position, now)
                    elif now - moved[tp][1] >= self.resume_stall_s:
                        log.warning(
                            "loki-tail resume scan: %s[%d] returned no record at offset %d for %.0fs though it ends at "
                            "%d (the broker cannot serve what follows: a record batch with a broken header?); the "
                            "cursor is taken from the records before it (Loki replays the rest, nothing is missed)",
                            tp.topic, tp.partition, position, now - moved[tp][1], ends[tp])
                        pending.discard(tp)
        finally:
            await consumer.stop()
        if found:
            log.info("resuming tail %s after %d records of ours, from start=%s", self.identity, found,
                     self.cursor.last_ts_ns)
        return found

    async def resume_or_start_over(self) -> int:
        """``resume_from_kafka``, or, when the broker refuses this principal Read on the topic, the first
        start's position: a bridge that cannot find where it was still ships (Loki may send again what
        was produced before), it does not exit at every start."""
        from aiokafka.errors import TopicAuthorizationFailedError

        try:
            return await self.resume_from_kafka()
        except TopicAuthorizationFailedError as exc:
            log.error(
                "loki-tail may not read %s to find where it stopped (%s); starting from start=%s instead, so "
                "entries produced before this start may be sent again. Give this principal Read on the topic "
                "(the xidflow-loki-tail user of deploy/strimzi/users.yaml has it) or start with --resume-scan 0",
                self.topic, exc, self.first_start_ns)
            return 0

    @staticmethod
    async def _give_up(consumer: Any, pending: set[Any], ends: dict[Any, int], exc: BaseException) -> None:
        where = ", ".join(f"{tp.topic}[{tp.partition}] at offset {await consumer.position(tp)} of {ends[tp]}"
                          for tp in sorted(pending))
        log.warning("loki-tail resume scan: a record batch could not be read (%s: %s) while scanning %s; the "
                    "cursor is taken from the records read so far (Loki replays the rest, nothing is missed)",
                    type(exc).__name__, exc, where)

    async def _skip_undecodable(
        self,
        consumer: Any,
        undecodable: Undecodable,
        failure: Failure,
        take: Callable[[dict[Any, list[Any]]], Awaitable[None]],
    ) -> None:
        """Take the partition's good records before a batch nobody here can decode, then seek past it.

        Any other producer may write this topic with any codec, so such a batch is legal and must not stop
        the start (it would meet the batch again after every restart). No dead letter here: the scan only
        looks for the cursor, and the parse stage dead-letters (or holds) the batch when it reads the topic.
        A batch of ours lost this way only makes the cursor older: Loki replays, nothing is missed.
        """
        decision = await undecodable_fetch.approach(consumer, undecodable, failure, take,
                                                    poll_timeout_ms=1000, max_records=RESUME_APPROACH_RECORDS)
        if decision is None:
            return  # not reached yet: the next getmany meets the batch again and approaches further
        failure = decision.failure
        if undecodable.first_report(failure):
            log.warning("loki-tail resume scan: undecodable record batch at %s[%d] offset %s (%s, %s); "
                        "skipped for the cursor (the parse stage dead-letters or holds it when it reads the topic)",
                        failure.topic, failure.partition, failure.offsets, failure.reason.value, failure.error)
        from aiokafka import TopicPartition

        consumer.seek(TopicPartition(failure.topic, failure.partition), undecodable.resume_after(failure))

    async def run(self, stop: asyncio.Event | None = None) -> BridgeStats:
        """Tail until ``stop`` is set, reconnecting with backoff; returns the counters."""
        stop = stop or asyncio.Event()
        if self.cursor.last_ts_ns is None and self.resume_scan > 0:
            await self.resume_or_start_over()
        producer = kafka_clients.producer(
            bootstrap=self.bootstrap_servers,
            acks="all",
            enable_idempotence=True,
            linger_ms=5,
        )
        await producer.start()
        try:
            while not stop.is_set():
                try:
                    await self._one_connection(producer, stop)
                except asyncio.CancelledError:
                    raise
                except InvalidStatus as exc:
                    status = exc.response.status_code
                    if 400 <= status < 500 and status != 429:
                        # A rejected query or auth never fixes itself: fail instead of retrying forever.
                        body = exc.response.body.decode("utf-8", "replace").strip() if exc.response.body else ""
                        raise LokiRequestRejected(f"Loki rejected the tail request: HTTP {status} {body}") from exc
                    await self._pause(stop, exc)
                except Exception as exc:  # any transport or Kafka failure: back off and resume from cursor
                    await self._pause(stop, exc)
        finally:
            await producer.stop()
        return self.stats

    async def _pause(self, stop: asyncio.Event, exc: BaseException) -> None:
        delay = self.backoff.next_delay()
        if isinstance(exc, KafkaError):  # the broker's outage is logged as such by its clients' records
            BROKER.failed(f"loki-tail: {type(exc).__name__}: {exc}")
        else:  # Loki's: one line when it is lost, one a minute, one when it is back (reachability.LOKI)
            LOKI.failed(f"{type(exc).__name__}: {exc} (reconnecting from start={self.cursor.last_ts_ns})")
        try:
            await asyncio.wait_for(stop.wait(), timeout=delay)
        except TimeoutError:
            pass

    async def _one_connection(self, producer: Any, stop: asyncio.Event) -> None:
        from websockets.asyncio.client import connect

        url = self.current_url()
        connected_ns = time.time_ns()
        replayed = 0
        warned_replay_full = False
        headers = {**self.headers, **self.auth.headers()}
        tls = self.auth.ssl_context() if url.startswith("wss:") else None
        async with connect(url, additional_headers=headers, max_size=64 * 1024 * 1024, ssl=tls) as ws:
            self.stats.connections += 1
            LOKI.reachable()
            log.info("tailing %s", url)
            stop_task = asyncio.ensure_future(stop.wait())
            try:
                while True:
                    recv_task = asyncio.ensure_future(ws.recv())
                    done, _ = await asyncio.wait({recv_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
                    if stop_task in done:
                        recv_task.cancel()
                        return
                    raw = recv_task.result()  # raises ConnectionClosed on disconnect -> reconnect
                    message = parse_tail_message(raw)
                    replayed += sum(1 for e in message.entries if e.ts_ns <= connected_ns)
                    if replayed >= self.limit and not warned_replay_full:
                        log.error("replay filled limit=%d: entries older than those may be missing", self.limit)
                        warned_replay_full = True  # once per connection
                    await self._handle(producer, message, raw)
                    self.backoff.reset()
            finally:
                stop_task.cancel()

    async def _handle(self, producer: Any, message: TailMessage, raw: str | bytes) -> None:
        if message.dropped:
            self.stats.dropped_upstream += message.dropped
            log.warning(
                "Loki dropped %d entries before sending them (slow consumer or ingester limits)",
                message.dropped,
            )
        futures = []
        sent = 0
        for problem in message.malformed:
            futures.append(await self._dead_letter(
                producer, f"malformed Loki tail message: {problem}", raw, DeadLetterCode.UNKNOWN_SHAPE
            ))
        fresh = self.cursor.select_new(message.entries)
        self.stats.skipped_replays += len(message.entries) - len(fresh)
        for entry in fresh:
            node = node_of(entry, self.node_label)
            if node is None:
                reason = f"Loki stream has no '{self.node_label}' label: {dict(entry.labels)}"
                futures.append(await self._dead_letter(producer, reason, encode_entry(entry), DeadLetterCode.NO_NODE))
                continue
            futures.append(
                await producer.send(
                    self.topic, encode_entry(entry), key=node.encode("utf-8"), headers=self._record_headers
                )
            )
            sent += 1
        if futures:
            # Mark entries produced only once Kafka acknowledged all of them: a failure here replays.
            await asyncio.gather(*futures)
        for entry in fresh:
            self.cursor.mark(entry)
        self.stats.produced += sent

    async def _dead_letter(self, producer: Any, reason: str, payload: str | bytes, code: DeadLetterCode) -> Any:
        self.stats.dead_letters += 1
        letter = DeadLetter.of(STAGE, reason, payload, code)
        self._dead_letters.report(letter)
        return await producer.send(self.deadletter_topic, letter.to_bytes())
