"""Every Kafka codec is read, and a batch the worker cannot decode is reported, not a restart loop (issue 21).

- aiokafka's own producer, each codec, through the project's consumer factory (``pipeline.kafka.clients``).
- A REAL librdkafka producer per codec (Debian's rsyslogd + omkafka, ``compression.codec=X``, each
  to its own partition) and a real ``xidflow worker``: each codec's lines become incidents. Which codec
  each partition's batches really carry is checked by reading them with every codec turned off.
- The field failure itself: a real worker whose environment cannot import ``cramjam`` (a
  ``sitecustomize`` makes the import fail, exactly like an image built without the extras) gets lz4
  batches on one partition and plain ones on the others: the others become incidents, the held
  partition is logged once with topic/partition/offset, ``/healthz`` is red, the metrics say so, and a
  worker restarted with the library processes the held lines (nothing lost).
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka import codec as aiokafka_codec
from aiokafka.errors import UnsupportedCodecError

from pipeline.app import worker_topics
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from pipeline.localinfra.procs import free_port
from pipeline.localinfra.rsyslog import RsyslogDist
from pipeline.runtime.liveness import LIVENESS
from pipeline.runtime.settings import TopicNames
from tests.integration.test_pipeline import PARTITIONS, XID, Pipeline, Worker, healthz, kmsg, wait_ready
from tests.integration.test_rsyslog import Rsyslogd
from tests.integration.test_undecodable_neighbours import _corrupt_on_disk

pytestmark = pytest.mark.integration

CODECS = ("gzip", "snappy", "lz4", "zstd")
NO_CRAMJAM = '''
import sys


class _NoCramjam:
    """What an image built without aiokafka's codec extras looks like: cramjam cannot be imported."""

    def find_spec(self, name, path=None, target=None):
        if name == "cramjam" or name.startswith("cramjam."):
            raise ModuleNotFoundError("No module named 'cramjam'")
        return None


sys.meta_path.insert(0, _NoCramjam())
'''


async def batch_codecs(bootstrap: str, topic: str, partition: int) -> set[str]:
    """The codecs of the partition's batches, read with every codec turned off: aiokafka then names the
    codec of the first compressed batch it meets (each partition here carries one codec)."""
    names = ("gzip", "snappy", "lz4", "zstd")
    saved = {n: getattr(aiokafka_codec, f"has_{n}") for n in names}
    for n in names:
        setattr(aiokafka_codec, f"has_{n}", lambda: False)
    consumer = kafka_clients.consumer(bootstrap=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(topic, partition)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        try:
            for _ in range(10):
                await consumer.getmany(tp, timeout_ms=500)
        except UnsupportedCodecError as exc:
            found = re.search(r"for (\w+) compression", str(exc))
            return {found.group(1)} if found else {str(exc)}
        return {"none"}
    finally:
        await consumer.stop()
        for n, fn in saved.items():
            setattr(aiokafka_codec, f"has_{n}", fn)


# -- aiokafka's producer, each codec, through the consumer factory ---------------------------------------
async def test_every_codec_round_trips_through_the_consumer_factory(kafka_bootstrap: str) -> None:
    topic = f"t-codec-{uuid.uuid4().hex[:8]}"
    await ensure_topics(kafka_bootstrap, [topic], len(CODECS))
    for partition, codec in enumerate(CODECS):
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, compression_type=codec, linger_ms=5)
        await producer.start()
        try:
            for i in range(20):
                await producer.send(topic, f"{codec} line {i}".encode(), partition=partition)
            await producer.flush()
        finally:
            await producer.stop()
    consumer = kafka_clients.consumer(topic, bootstrap=kafka_bootstrap, group_id=f"g-{uuid.uuid4().hex[:6]}",
                                      auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    got: dict[int, list[bytes]] = {p: [] for p in range(len(CODECS))}
    try:
        deadline = time.monotonic() + 30
        while sum(map(len, got.values())) < 20 * len(CODECS) and time.monotonic() < deadline:
            for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                got[tp.partition] += [r.value for r in records]
    finally:
        await consumer.stop()
    for partition, codec in enumerate(CODECS):
        assert got[partition] == [f"{codec} line {i}".encode() for i in range(20)], codec
        assert await batch_codecs(kafka_bootstrap, topic, partition) == {codec}


# -- a real librdkafka producer per codec, a real worker ------------------------------------------------
async def _world(bootstrap: str, label: str) -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"t-{label}-{tag}-", f"t-{label}-{tag}"
    await ensure_topics(bootstrap, worker_topics(app_id, TopicNames(prefix=prefix)), PARTITIONS)
    return prefix, app_id


def _ready(bootstrap: str, prefix: str, worker: Worker) -> None:
    async def ready() -> None:
        async with Pipeline(bootstrap, prefix) as pipe:
            await wait_ready(pipe, worker)

    asyncio.run(ready())


@pytest.fixture(scope="module")
def codec_worker(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    prefix, app_id = asyncio.run(_world(kafka_bootstrap, "codec"))
    worker = Worker(kafka_bootstrap, app_id, prefix, tmp_path_factory.mktemp("codec-worker")).start()
    try:
        _ready(kafka_bootstrap, prefix, worker)
        yield prefix
        assert worker.alive(), f"the worker died:\n{worker.log_tail()}"
    finally:
        worker.stop()


async def test_every_codec_from_librdkafka_becomes_incidents(
    rsyslog: RsyslogDist, kafka_bootstrap: str, codec_worker: str, tmp_path: Path
) -> None:
    assert PARTITIONS >= len(CODECS)
    raw_topic = TopicNames(prefix=codec_worker).name("logs_kernel")
    nodes = {codec: f"rsys-{codec}-{uuid.uuid4().hex[:6]}" for codec in CODECS}
    daemons = {
        codec: Rsyslogd(rsyslog, tmp_path / codec, nodes[codec], kafka_bootstrap, raw_topic, None,
                        partition=partition, codec=codec).start()
        for partition, codec in enumerate(CODECS)
    }
    line = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    try:
        async with Pipeline(kafka_bootstrap, codec_worker) as pipe:
            uptime = 538441.007373
            for d in daemons.values():
                # Noise and the fault in one burst: several records per batch, as a shipper sends them.
                d.write(*[f"[{uptime:12.6f}] usb 1-1: new high-speed USB device number {i}" for i in range(20)],
                        f"[{uptime:12.6f}] {line}")

            def incident_of(node: str) -> bool:
                return any(i.get("type") == "incident" and i.get("code") == 79 for i in pipe.incidents(node))

            deadline = time.monotonic() + 90
            while not all(incident_of(n) for n in nodes.values()):
                for codec, d in daemons.items():
                    assert d.proc and d.proc.poll() is None, f"rsyslogd ({codec}) exited:\n{d.output()}"
                missing = [c for c, n in nodes.items() if not incident_of(n)]
                assert time.monotonic() < deadline, (
                    f"no incidents for codecs {missing}; dead letters {pipe.seen['deadletter'][-3:]}; "
                    f"rsyslogd: {[daemons[c].output() for c in missing]}"
                )
                await pipe.poll()
            assert not [d for d in pipe.seen["deadletter"] if any(n in str(d) for n in nodes.values())]
    finally:
        for d in daemons.values():
            d.stop()
    # What librdkafka really sent: each partition's batches carry its codec.
    for partition, codec in enumerate(CODECS):
        assert await batch_codecs(kafka_bootstrap, raw_topic, partition) == {codec}


# -- the field failure: no codec library in the worker's environment -------------------------------------
def _get(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return resp.read().decode()


def _healthz_body(port: int) -> str:
    import urllib.error

    try:
        return _get(port, "/healthz")
    except urllib.error.HTTPError as exc:
        return exc.read().decode()


def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


async def test_lz4_without_its_library_is_held_loudly_and_read_after_the_fix(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    prefix, app_id = await _world(kafka_bootstrap, "held")
    raw_topic = TopicNames(prefix=prefix).name("logs_kernel")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_CRAMJAM)
    port, probe_port = free_port(), free_port()  # metrics; the chart's liveness and readiness probes
    broken = Worker(kafka_bootstrap, app_id, prefix, tmp_path,
                    extra_env={"PYTHONPATH": str(site), "XIDFLOW_METRICS_PORT": str(port),
                               "XIDFLOW_HEALTH_PORT": str(probe_port)}).start()
    held_nodes = [f"held-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    before_node = f"before-{uuid.uuid4().hex[:6]}"  # plain, on the held partition, before the lz4 batch
    plain_nodes = {p: f"plain-{p}-{uuid.uuid4().hex[:6]}" for p in range(1, PARTITIONS)}
    later_nodes = {p: f"later-{p}-{uuid.uuid4().hex[:6]}" for p in range(1, PARTITIONS)}

    def xid(node: str, bus: str = "4e") -> bytes:
        return kmsg(node, XID.format(bus=bus, code=79, text="GPU has fallen off the bus."), time.time())

    try:
        async with Pipeline(kafka_bootstrap, prefix) as pipe:
            await wait_ready(pipe, broken)
            plain = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=50)
            lz4 = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, compression_type="lz4", linger_ms=50)
            await plain.start()
            await lz4.start()
            try:
                # Partition 0: a plain batch, then lz4 batches (one fetch holds both).
                before = await plain.send_and_wait(raw_topic, xid(before_node), key=before_node.encode(), partition=0)
                for node in held_nodes:
                    await lz4.send(raw_topic, b'{"msg": "noise", "hostname": "x"}', key=node.encode(), partition=0)
                    await lz4.send(raw_topic, xid(node), key=node.encode(), partition=0)
                await lz4.flush()
                for p, node in plain_nodes.items():
                    await plain.send(raw_topic, xid(node), key=node.encode(), partition=p)
                await plain.flush()

                await pipe.wait_for(lambda: all(pipe.incidents(n) for n in plain_nodes.values()), 60,
                                    "incidents of the plain partitions")
                await pipe.wait_for(lambda: bool(pipe.incidents(before_node)), 60,
                                    "the plain record before the lz4 batch on the held partition")
                # Held: logged once, health red, metrics say so; the other partitions keep flowing.
                deadline = time.monotonic() + 30
                while "undecodable record batch" not in broken.log_path.read_text(errors="replace"):
                    assert time.monotonic() < deadline, broken.log_tail()
                    await asyncio.sleep(0.5)
                for p, node in later_nodes.items():
                    await plain.send(raw_topic, xid(node, "4f"), key=node.encode(), partition=p)
                await plain.flush()
                await pipe.wait_for(lambda: all(pipe.incidents(n) for n in later_nodes.values()), 60,
                                    "incidents of the plain partitions after the hold")
            finally:
                await plain.stop()
                await lz4.stop()
            await asyncio.sleep(5)  # several more polls: still one log line
            assert broken.alive(), broken.log_tail()
            log_text = broken.log_path.read_text(errors="replace")
            held_lines = [ln for ln in log_text.splitlines() if "undecodable record batch" in ln]
            assert len(held_lines) == 1, held_lines
            assert f"{raw_topic}[0] offset {before.offset + 1}-" in held_lines[0], held_lines[0]
            assert "Libraries for lz4 compression codec not found" in held_lines[0]
            assert "HELD" in held_lines[0] and "cramjam" in held_lines[0]
            assert "restarting in" not in log_text, "the parse stage restarted"
            assert healthz(port) == 503
            assert "Libraries for lz4" in _healthz_body(port)
            # Not a liveness failure: a kubelet restart cannot install the library and would stop the rest.
            assert _get(port, "/livez") == "ok\n"
            assert healthz(probe_port) == 503 and _get(probe_port, "/livez") == "ok\n"  # what the probes read
            exported = _get(port, "/metrics")
            assert _metric(exported, "xidflow_held_partitions", stage="parse", topic=raw_topic) == 1
            assert _metric(exported, "xidflow_undecodable_batches_total", stage="parse", topic=raw_topic,
                           reason="unsupported_codec") == 1
            assert _metric(exported, "xidflow_stage_restarts_total", stage="parse") == 0
            assert not any(pipe.incidents(n) for n in held_nodes)

            # The aggregation's own consumer (Faust) meets an lz4 batch of fault events: held the same way.
            fault_topic = TopicNames(prefix=prefix).name("fault_events")
            agg_node = f"agg-held-{uuid.uuid4().hex[:6]}"
            template = next(e for e in pipe.seen["fault_events"] if e.get("node") == before_node)
            event = {k: v for k, v in template.items() if k != "_at"} | {"node": agg_node, "id": uuid.uuid4().hex}
            lz4 = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, compression_type="lz4")
            await lz4.start()
            try:
                await lz4.send_and_wait(fault_topic, orjson.dumps(event), key=agg_node.encode())
            finally:
                await lz4.stop()
            deadline = time.monotonic() + 60
            while "aggregate: undecodable record batch" not in broken.log_path.read_text(errors="replace"):
                assert time.monotonic() < deadline, broken.log_tail()
                await asyncio.sleep(0.5)
            await asyncio.sleep(3)
            log_text = broken.log_path.read_text(errors="replace")
            agg_lines = [ln for ln in log_text.splitlines() if "aggregate: undecodable record batch" in ln]
            assert len(agg_lines) == 1 and f"{fault_topic}[" in agg_lines[0], agg_lines
            exported = _get(port, "/metrics")
            assert _metric(exported, "xidflow_held_partitions", stage="aggregate", topic=fault_topic) == 1
            assert broken.alive(), broken.log_tail()
            held_nodes.append(agg_node)  # its incident must come after the fix
            print("\n".join(["held log line:", held_lines[0], agg_lines[0], "healthz:", _healthz_body(port).strip()]))

            # The fix: the same worker with the library. It reads the held partition from where it stopped.
            broken.stop()
            fixed = Worker(kafka_bootstrap, app_id, prefix, tmp_path,
                           extra_env={"XIDFLOW_METRICS_PORT": str(port)}).start()
            try:
                await pipe.wait_for(lambda: all(pipe.incidents(n) for n in held_nodes), 120,
                                    "incidents of the held lz4 lines after the fix")
                deadline = time.monotonic() + 30
                while healthz(port) != 200:
                    assert time.monotonic() < deadline, fixed.log_tail()
                    await asyncio.sleep(0.5)
                assert "undecodable" not in fixed.log_path.read_text(errors="replace")
            finally:
                fixed.stop()
    finally:
        broken.stop()


# -- a batch nobody can decode: skipped behind a dead letter naming its offsets ---------------------------
async def test_a_corrupt_batch_is_skipped_with_a_dead_letter_and_the_partition_goes_on(
    private_kafka, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch whose bytes changed on the broker's disk after its CRC was written (real corruption, read
    through the real broker): the stage re-fetches it once, then dead-letters its offsets and reads on."""
    from pipeline.detection.parse_settings import ParseSettings
    from pipeline.detection.parse_stage import ParseStage

    cluster = private_kafka(1)
    bootstrap = cluster.bootstrap
    topics = TopicNames(prefix=f"t-crc-{uuid.uuid4().hex[:6]}-")
    raw = topics.name("logs_kernel")
    await ensure_topics(bootstrap, [raw, topics.name("fault_events"), topics.name("deadletter")], 1)
    nodes = [f"crc-{c}-{uuid.uuid4().hex[:6]}" for c in "abc"]
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        offsets = [(await producer.send_and_wait(raw, kmsg(n, XID.format(bus="4e", code=79, text="GPU has fallen "
                                                                          "off the bus."), time.time()),
                                                 key=n.encode(), partition=0)).offset for n in nodes]
    finally:
        await producer.stop()
    _corrupt_on_disk(Path(cluster.root), raw, 0, nodes[1].encode())

    stage = ParseStage(bootstrap, f"crc-{uuid.uuid4().hex[:6]}", topics=topics,
                       settings=ParseSettings(poll_timeout_ms=50), input_topics=[raw])
    task = asyncio.ensure_future(stage.run())
    events: list[dict] = []
    letters: list[dict] = []
    reader = kafka_clients.consumer(topics.name("fault_events"), topics.name("deadletter"), bootstrap=bootstrap,
                                    auto_offset_reset="earliest")
    await reader.start()
    try:
        deadline = time.monotonic() + 60
        while not (any(e["node"] == nodes[2] for e in events) and letters):
            assert not task.done(), task.exception() if task.done() else None
            assert time.monotonic() < deadline, (events, letters)
            for tp, records in (await reader.getmany(timeout_ms=200)).items():
                target = letters if tp.topic == topics.name("deadletter") else events
                target += [orjson.loads(r.value) for r in records]
        await asyncio.sleep(1)
        for tp, records in (await reader.getmany(timeout_ms=200)).items():
            (letters if tp.topic == topics.name("deadletter") else events).extend(
                orjson.loads(r.value) for r in records)
    finally:
        await reader.stop()
        stage.stop()
        await asyncio.wait_for(task, 30)
        LIVENESS.remove(stage.live.name)  # this process goes on (the test session): the stopped stage is gone
    assert {e["node"] for e in events} == {nodes[0], nodes[2]}
    assert len(letters) == 1, letters
    letter = letters[0]
    assert (letter["code"], letter["topic"], letter["partition"], letter["offset"]) == (
        "undecodable", raw, 0, offsets[1])
    assert f"{raw}[0] offset {offsets[1]}" in letter["reason"] and "CorruptRecordException" in letter["reason"]
    assert "SKIPPED" in letter["reason"]
    logged = [r.getMessage() for r in caplog.records if "undecodable record batch" in r.getMessage()]
    assert len(logged) == 1, logged
    print("dead letter reason:", letter["reason"])
