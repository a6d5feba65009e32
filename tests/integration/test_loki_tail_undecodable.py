"""loki-tail's resume scan gets past a batch it cannot decode on its output topic (real broker).

Any producer may write that topic with any codec; a batch the process cannot decode made ``getmany``
raise in ``resume_from_kafka`` at every start: ``xidflow loki-tail`` exited while the batch sat in the
scanned window, a crash loop. Here the topic holds records loki-tail wrote (with its resume header) in
every partition, one batch of one partition is corrupted on the broker's disk (its CRC no longer
matches) with good records before and after it, and the newest entry is after the bad batch: the
resume must not raise and must find the cursor from every good record.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pipeline.ingest.loki_tail import RESUME_HEADER, LokiTailBridge, TailEntry, encode_entry, tail_identity
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from tests.integration.test_loki_tail import REPO, LokiTailServer
from tests.integration.test_undecodable_neighbours import _corrupt_on_disk

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PARTITIONS = 3
PER_PARTITION = 4
QUERY = '{job="gpu-kmsg"}'


@dataclass(frozen=True)
class Written:
    topic: str
    dead: str
    bad_partition: int
    newest: TailEntry  # the newest good entry, after the bad batch
    twin: TailEntry  # another good entry at the same time, in another partition


async def write_with_a_corrupt_batch(cluster: Any, identity: str) -> Written:
    """The output topic as loki-tail (``identity``) left it, one of its batches corrupted on disk."""
    tag = uuid.uuid4().hex[:6]
    topic, dead = f"lt-undec-{tag}-logs", f"lt-undec-{tag}-dead"
    await ensure_topics(cluster.bootstrap, [topic, dead], PARTITIONS)
    headers = [(RESUME_HEADER, identity.encode())]
    base = time.time_ns() - 60 * 10**9
    bad_partition = 1
    entries: dict[int, list[TailEntry]] = {
        p: [TailEntry(base + (i * PARTITIONS + p) * 1000, {"job": "gpu-kmsg", "node": f"n-{tag}-{p}"},
                      f"Xid line {tag} p{p} i{i}")
            for i in range(PER_PARTITION)]
        for p in range(PARTITIONS)
    }
    # The bad record is the second of its partition (good ones before and after it) and claims the newest
    # time of all; the newest good entry is the last of its partition, after the bad batch.
    entries[bad_partition][1] = TailEntry(base + 10**9, entries[bad_partition][1].labels, f"BAD-{tag}")
    newest = TailEntry(base + 10**8, entries[bad_partition][-1].labels, f"newest {tag}")
    entries[bad_partition][-1] = newest
    twin = TailEntry(newest.ts_ns, entries[0][0].labels, f"twin {tag}")
    entries[0][-1] = twin
    producer = kafka_clients.producer(bootstrap=cluster.bootstrap, acks="all")
    await producer.start()
    try:
        for i in range(PER_PARTITION):  # one batch per record: the corruption hits one record's batch
            for p in range(PARTITIONS):
                await producer.send_and_wait(topic, encode_entry(entries[p][i]), partition=p, headers=headers)
        await producer.send_and_wait(topic, b"not ours", partition=2)  # no resume header: not read as ours
    finally:
        await producer.stop()
    _corrupt_on_disk(Path(cluster.root), topic, bad_partition, f"BAD-{tag}".encode())
    return Written(topic, dead, bad_partition, newest, twin)


def _break_batch_length(root: Path, topic: str, partition: int, needle: bytes) -> int:
    """Make the length field of the batch holding ``needle`` point past its end (into the next batch), on the
    broker's disk; returns the batch's base offset. The broker then serves nothing of the partition from that
    batch on (no records, no error): no client can place that failure."""
    (segment,) = list(root.glob(f"**/data/{topic}-{partition}/*.log"))
    data = bytearray(segment.read_bytes())
    at, pos = data.find(needle), 0
    while True:  # record batches: base offset (8 bytes), length (4), then length bytes
        length = struct.unpack_from(">i", data, pos + 8)[0]
        if pos + 12 + length > at:
            break
        pos += 12 + length
    struct.pack_into(">i", data, pos + 8, length + 30)
    segment.write_bytes(bytes(data))
    return struct.unpack_from(">q", data, pos)[0]


async def test_resume_scan_stops_reading_a_partition_the_broker_cannot_serve_and_finds_the_cursor(
    private_kafka, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch whose length field is broken: the broker answers that partition's fetches with no records and no
    error. The scan waited for its position to move for ever, so ``xidflow loki-tail`` never started tailing
    (and said nothing). It must give that partition up, say where, and take the cursor from the rest."""
    cluster = private_kafka(1)
    identity = tail_identity(QUERY, None)
    tag = uuid.uuid4().hex[:6]
    topic = f"lt-len-{tag}-logs"
    await ensure_topics(cluster.bootstrap, [topic], PARTITIONS)
    headers = [(RESUME_HEADER, identity.encode())]
    base = time.time_ns() - 60 * 10**9
    bad_partition = 1
    producer = kafka_clients.producer(bootstrap=cluster.bootstrap, acks="all")
    await producer.start()
    newest_good = None
    try:
        for i in range(PER_PARTITION):  # one batch per record
            for p in range(PARTITIONS):
                # The bad partition's entries after its first one are the newest of all: unreadable, so the
                # cursor must come from the newest of the others.
                ts = base + (10**9 + i if p == bad_partition and i >= 1 else i * PARTITIONS + p)
                entry = TailEntry(ts, {"job": "gpu-kmsg", "node": f"n-{tag}-{p}"}, f"L{tag}-p{p}-i{i}")
                if p != bad_partition and (newest_good is None or ts > newest_good.ts_ns):
                    newest_good = entry
                await producer.send_and_wait(topic, encode_entry(entry), partition=p, headers=headers)
    finally:
        await producer.stop()
    offset = _break_batch_length(Path(cluster.root), topic, bad_partition, f"L{tag}-p{bad_partition}-i1".encode())
    bridge = LokiTailBridge(loki_url="http://127.0.0.1:9", query=QUERY, topic=topic,
                            bootstrap_servers=cluster.bootstrap, deadletter_topic=f"{topic}-dead", resume_scan=100,
                            resume_stall_s=3)

    with caplog.at_level(logging.WARNING, logger="pipeline.ingest.loki_tail"):
        # Bounded only so that the old behaviour fails instead of hanging the suite.
        found = await asyncio.wait_for(bridge.resume_from_kafka(), 120)

    assert found == (PARTITIONS - 1) * PER_PARTITION + 1  # every record but the bad partition's from the batch on
    assert newest_good is not None and bridge.cursor.last_ts_ns == newest_good.ts_ns
    # aiokafka reads the broken batch with the length it claims, fails its CRC and the scan skips it; the
    # broker serves nothing from the next offset on (it cannot find that offset's batch any more).
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if f"undecodable record batch at {topic}[{bad_partition}] offset {offset}" in m]
    stalled = [m for m in messages if "returned no record" in m]
    assert len(stalled) == 1 and f"{topic}[{bad_partition}] returned no record at offset {offset + 1}" in stalled[0], (
        stalled)


async def test_resume_scan_skips_an_undecodable_batch_and_finds_the_cursor(
    private_kafka, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = private_kafka(1)
    written = await write_with_a_corrupt_batch(cluster, tail_identity(QUERY, None))
    bridge = LokiTailBridge(loki_url="http://127.0.0.1:9", query=QUERY, topic=written.topic,
                            bootstrap_servers=cluster.bootstrap, deadletter_topic=written.dead, resume_scan=100)

    with caplog.at_level(logging.WARNING, logger="pipeline.ingest.loki_tail"):
        found = await bridge.resume_from_kafka()

    assert found == PARTITIONS * PER_PARTITION - 1
    assert bridge.cursor.last_ts_ns == written.newest.ts_ns
    assert bridge.cursor.seen_at_last == {written.newest.identity, written.twin.identity}
    warnings = [r.getMessage() for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"{written.topic}[{written.bad_partition}] offset 1" in warnings[0]


async def test_the_loki_tail_command_stays_up_with_a_corrupt_batch_in_its_resume_window(
    private_kafka, tmp_path: Path
) -> None:
    """The real process: it resumes past the batch, then tails Loki from the cursor it found, and stays up."""
    cluster = private_kafka(1)
    written = await write_with_a_corrupt_batch(cluster, tail_identity(QUERY, None))
    log = tmp_path / "loki-tail.log"
    env = {**os.environ, "XIDFLOW_METRICS_PORT": "0"}
    env.pop("LOKI_ORG_ID", None)
    async with LokiTailServer(batch_size=100, drop_after_messages=[]) as loki:
        with log.open("wb") as out:
            proc = await asyncio.to_thread(
                subprocess.Popen,
                [sys.executable, "-m", "pipeline.cli", "loki-tail", "--loki-url", loki.url, "--query", QUERY,
                 "--topic", written.topic, "--bootstrap", cluster.bootstrap],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
            )

        def up() -> None:
            assert proc.poll() is None, f"loki-tail exited {proc.returncode}:\n{log.read_text(errors='replace')}"

        try:
            deadline = time.monotonic() + 90
            while not loki.requests:  # the resume scan is over once it asks Loki
                up()
                assert time.monotonic() < deadline, log.read_text(errors="replace")
                await asyncio.sleep(0.2)
            await asyncio.sleep(1)
            up()
            assert int(loki.requests[0]["start"][0]) == written.newest.ts_ns
            assert (f"undecodable record batch at {written.topic}[{written.bad_partition}] offset 1"
                    in log.read_text(errors="replace"))
        finally:
            proc.terminate()
            await asyncio.to_thread(proc.wait, 30)
