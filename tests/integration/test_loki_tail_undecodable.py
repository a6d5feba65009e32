"""loki-tail's resume scan gets past a batch it cannot decode on its output topic (real broker).

Any producer may write that topic with any codec; a batch the process cannot decode made ``getmany``
raise in ``resume_from_kafka`` at every start: ``xidflow loki-tail`` exited while the batch sat in the
scanned window, a crash loop. Here the topic holds records loki-tail wrote (with its resume header) in
every partition, one batch of one partition is corrupted on the broker's disk (its CRC no longer
matches) with good records before and after it, and the newest entry is after the bad batch: the
resume must not raise and must find the cursor from every good record.
"""

from __future__ import annotations

import logging
import time
import uuid
from pathlib import Path

import pytest

from pipeline.ingest.loki_tail import LokiTailBridge, TailEntry, encode_entry
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from tests.integration.test_undecodable_neighbours import _corrupt_on_disk

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PARTITIONS = 3
PER_PARTITION = 4
QUERY = '{job="gpu-kmsg"}'


async def test_resume_scan_skips_an_undecodable_batch_and_finds_the_cursor(
    private_kafka, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = private_kafka(1)
    tag = uuid.uuid4().hex[:6]
    topic, dead = f"lt-undec-{tag}-logs", f"lt-undec-{tag}-dead"
    await ensure_topics(cluster.bootstrap, [topic, dead], PARTITIONS)
    bridge = LokiTailBridge(loki_url="http://127.0.0.1:9", query=QUERY, topic=topic,
                            bootstrap_servers=cluster.bootstrap, deadletter_topic=dead, resume_scan=100)
    headers = [("xidflow-loki-tail", bridge.identity.encode())]
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
    bad = TailEntry(base + 10**9, entries[bad_partition][1].labels, f"BAD-{tag}")
    entries[bad_partition][1] = bad
    newest = TailEntry(base + 10**8, entries[bad_partition][-1].labels, f"newest {tag}")
    entries[bad_partition][-1] = newest
    twin = TailEntry(newest.ts_ns, entries[0][0].labels, f"twin {tag}")  # same time, another partition
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

    with caplog.at_level(logging.WARNING, logger="pipeline.ingest.loki_tail"):
        found = await bridge.resume_from_kafka()

    assert found == PARTITIONS * PER_PARTITION - 1
    assert bridge.cursor.last_ts_ns == newest.ts_ns
    assert bridge.cursor.seen_at_last == {newest.identity, twin.identity}
    warnings = [r.getMessage() for r in caplog.records if "undecodable" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"{topic}[{bad_partition}] offset 1" in warnings[0]
