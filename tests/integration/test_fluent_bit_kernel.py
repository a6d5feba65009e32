"""Fluent Bit for real, kernel lines: the shipped configuration (deploy/fluent-bit/fluent-bit.yaml) run by the
real Fluent Bit 5.1.1, built from the vendored source by ``xidflow local install --fluent-bit``, into the real
broker and a real ``xidflow worker``.

Only paths, ports, topic names and the kernel input differ from the shipped file (checked by
``shipped_config_drift``): tests never write to ``/dev/kmsg``, so kernel lines come from files through the
``tail`` input the shipped file documents for kernel lines in a file, in dmesg form and in /dev/kmsg's own
record form. What is proven here:

- dmesg and kmsg-record files become incidents on the right node; the Lua boot-id filter runs; the
  three-line fallen-off-the-bus message, which Fluent Bit ships as three records, is one fault;
- the prefilter regex as Fluent Bit's Onigmo runs it keeps every kernel fault line of the corpus and drops
  the noise;
- Fabric Manager's log, tailed at the path the shipped file names (here under the test's root): Fluent Bit runs
  while it does not exist, picks it up when it appears, ships its SXid report (not its INFO lines) to the kernel
  topic, and the fault the driver's line and Fabric Manager's report both describe is one incident;
- every Kafka codec librdkafka offers (gzip, snappy, lz4, zstd) reaches the worker and becomes an incident;
- Kafka stopped for 30 s while lines are written (one node's storm larger than librdkafka's queue): Fluent Bit
  keeps them (librdkafka's queue, then chunks on disk) and delivers every one after, every node gets exactly one
  incident; a Fluent Bit restart (tail database) re-sends nothing.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
import yaml

from pipeline.app import worker_topics
from pipeline.kafka.admin import ensure_topics
from pipeline.localinfra.fluentbit import ensure_fluent_bit
from pipeline.localinfra.fluentbit_run import FluentBit, Render, render_shipped_config, shipped_config_drift
from pipeline.localinfra.kafka import KafkaCluster
from pipeline.runtime.settings import TopicNames
from tests.integration.test_loki_tail import read_all
from tests.integration.test_pipeline import PARTITIONS, Pipeline, Worker, wait_ready
from tests.unit.test_deploy_fluentbit import NOISE

pytestmark = pytest.mark.integration

CORPUS = Path(__file__).resolve().parents[1] / "corpus" / "kernel_corpus.yaml"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id").read_text().strip()

XID_62 = "NVRM: Xid (PCI:0000:48:00): 62, pid=2331, name=python3, Internal micro-controller halt"
XID_48 = "NVRM: Xid (PCI:0000:b7:00): 48, pid=2331, name=python, An uncorrectable double bit error"
XID_79 = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
OFF_THE_BUS = (
    "NVRM: The NVIDIA GPU 0000:3b:00.0",
    "NVRM: (PCI ID: 10de:2330) installed in this system has",
    "NVRM: fallen off the bus and is not responding to commands.",
)


@pytest.fixture(scope="module")
def fluent_bit() -> Path:
    try:
        return ensure_fluent_bit(lambda m: print(f"[fluent-bit] {m}", flush=True))
    except Exception as exc:  # noqa: BLE001 - fail loudly, never skip
        pytest.fail(f"Fluent Bit is not available and could not be built: {exc}", pytrace=False)


def dmesg(uptime: float, line: str) -> str:
    return f"[{uptime:12.6f}] {line}"


def kmsg_record(seq: int, usec_since_boot: int, line: str, priority: int = 3) -> str:
    return f"{priority},{seq},{usec_since_boot},-;{line}"


def node_name(label: str) -> str:
    return f"fb-{label}-{uuid.uuid4().hex[:6]}"


def start(root: Path, node: str, brokers: str, prefix: str, **render: object) -> FluentBit:
    topics = TopicNames(prefix=prefix)
    spec = Render(root=root, kernel_topic=topics.name("logs_kernel"), pods_topic=topics.name("logs_pods"),
                  **render)  # type: ignore[arg-type]
    fb = FluentBit(root, node, brokers, spec, log=lambda m: print(f"[fluent-bit] {m}", flush=True))
    assert shipped_config_drift(render_shipped_config(spec)) == []
    return fb.start()


def incidents_of(pipe: Pipeline, node: str) -> list[dict]:
    return [i for i in pipe.incidents(node) if i.get("type") == "incident"]


async def wait_incidents(pipe: Pipeline, want: dict[str, Callable[[list[dict]], bool]], daemons: list[FluentBit],
                         within_s: float = 90.0) -> None:
    deadline = time.monotonic() + within_s
    while not all(check(incidents_of(pipe, node)) for node, check in want.items()):
        for d in daemons:
            assert d.alive(), f"Fluent Bit of {d.node} exited:\n{d.log_tail()}"
        assert time.monotonic() < deadline, (
            f"incidents missing: {[n for n, c in want.items() if not c(incidents_of(pipe, n))]}; "
            f"seen {pipe.seen['incidents'][-5:]}, dead letters {pipe.seen['deadletter'][-3:]}; "
            + "\n".join(f"{d.node}: {d.log_tail(15)}" for d in daemons)
        )
        await pipe.poll()


def has_code(code: int) -> Callable[[list[dict]], bool]:
    return lambda incs: any(i.get("code") == code for i in incs)


async def test_kernel_files_in_dmesg_and_kmsg_form_become_incidents_on_the_right_node(
    fluent_bit: Path, kafka_bootstrap: str, worker_prefix: str, tmp_path: Path
) -> None:
    dmesg_node, kmsg_node = node_name("dmesg"), node_name("kmsg")
    daemons = [
        start(tmp_path / "dmesg", dmesg_node, kafka_bootstrap, worker_prefix, kernel_source="file-lines"),
        start(tmp_path / "kmsg", kmsg_node, kafka_bootstrap, worker_prefix, kernel_source="file-kmsg"),
    ]
    try:
        async with Pipeline(kafka_bootstrap, worker_prefix) as pipe:
            daemons[0].write("kern.log", dmesg(538440.1, NOISE[0]), dmesg(538441.007373, XID_62),
                             *(dmesg(538442.5, part) for part in OFF_THE_BUS), dmesg(538443.0, NOISE[2]))
            daemons[1].write("kmsg.log", kmsg_record(1186, 538440100000, NOISE[1], priority=6),
                             kmsg_record(1187, 538441007373, XID_48))
            await wait_incidents(pipe, {
                dmesg_node: lambda incs: has_code(62)(incs) and len(incs) >= 2,
                kmsg_node: has_code(48),
            }, daemons)
            # The three records of the fallen-off-the-bus message are one fault on GPU 3b, not three.
            await pipe.sentinel(dmesg_node, time.time())
            bus = [i for i in incidents_of(pipe, dmesg_node) if i.get("pci") == "0000:3b:00.0"]
            assert len(bus) == 1, incidents_of(pipe, dmesg_node)
            assert not [d for d in pipe.seen["deadletter"] if dmesg_node in str(d) or kmsg_node in str(d)]
    finally:
        for d in daemons:
            d.stop()

    # What Fluent Bit put on Kafka: keyed by node, the kmsg form with its since-boot identity and the boot
    # id the shipped Lua filter read from /proc, and no noise (the prefilter ran before Kafka).
    records = await read_all(kafka_bootstrap, TopicNames(prefix=worker_prefix).name("logs_kernel"))
    mine = [(k, orjson.loads(v)) for k, v in records if k in (dmesg_node.encode(), kmsg_node.encode())]
    mine = [(k, r) for k, r in mine if "boot_id" in r]  # Fluent Bit's (the test's sentinel has none)
    assert len([r for k, r in mine if k == dmesg_node.encode()]) == 4
    kmsg_records = [r for k, r in mine if k == kmsg_node.encode()]
    assert len(kmsg_records) == 1
    assert {k: kmsg_records[0][k] for k in ("sequence", "sec", "usec", "boot_id", "node")} == {
        "sequence": 1187, "sec": 538441, "usec": 7373, "boot_id": BOOT_ID, "node": kmsg_node}
    assert not [r for _, r in mine if any(noise in r["msg"] for noise in NOISE)]


# One fault of the switch at 0000:86:00.0, as the NVSwitch driver prints it (constructed in its SXid format) and as
# Fabric Manager reports it (leptonai/gpud fabric-manager log_matcher.go), with Fabric Manager's own INFO noise.
SXID_DRIVER = "nvidia-nvswitch3: SXid (PCI:0000:86:00.0): 20034, Fatal, Link 33 LTSSM Fault Up"
SXID_FABRIC_MANAGER = ("[Jul 23 2024 07:53:55] [ERROR] [tid 841] detected NVSwitch fatal error 20034 on fid 0 on "
                       "NVSwitch pci bus id 00000000:86:00.0 physical id 3 port 33")
FABRIC_MANAGER_INFO = ("[Feb 27 2025 14:10:02] [INFO] [tid 1808] multicast group 1 is allocated.",
                       "Message payload details:Team release request: Team Handle:7be4cbdfbc4d0a3b Flags:0")


async def test_fabric_managers_log_is_shipped_when_it_appears_and_its_report_is_the_kernels_fault(
    fluent_bit: Path, kafka_bootstrap: str, worker_prefix: str, tmp_path: Path
) -> None:
    node = node_name("fm")
    fb = start(tmp_path / "fm", node, kafka_bootstrap, worker_prefix)
    fm_log = Path(fb.render.fabric_manager_log or fb.root / "fabricmanager" / "fabricmanager.log")
    # No Fabric Manager log (a node without NVSwitches, or before it starts): Fluent Bit runs and ships the kernel.
    assert not await asyncio.to_thread(fm_log.exists) and fb.alive()
    try:
        async with Pipeline(kafka_bootstrap, worker_prefix) as pipe:
            fb.write("kern.log", dmesg(1108.858286, SXID_DRIVER))
            await wait_incidents(pipe, {node: has_code(20034)}, [fb])
            # Fabric Manager starts and reports the same fault seconds later.
            fb.write(fm_log.name, *FABRIC_MANAGER_INFO, SXID_FABRIC_MANAGER, folder=fm_log.parent.name)

            def reports() -> list[dict]:
                return [e for e in pipe.seen["fault_events"] if e.get("node") == node and e.get("code") == 20034]

            await pipe.wait_for(lambda: len(reports()) == 2, 60, "Fabric Manager's report as a fault event")
            assert sorted(e["reporter"] for e in reports()) == ["driver", "fabric_manager"]
            assert {(e["kind"], e["pci"], e["link"], e["fatal"]) for e in reports()} == {
                ("sxid", "0000:86:00.0", 33, True)}
            await pipe.sentinel(node, time.time())
            assert [(i["code"], i["count"]) for i in incidents_of(pipe, node) if i.get("code") == 20034] == [(20034, 1)]
            assert fb.alive(), fb.log_tail()
    finally:
        fb.stop()
    # On the kernel topic, keyed by node: the report and the driver's line; none of Fabric Manager's INFO lines.
    records = await read_all(kafka_bootstrap, TopicNames(prefix=worker_prefix).name("logs_kernel"))
    mine = [orjson.loads(v) for k, v in records if k == node.encode()]
    mine = [r for r in mine if "hostname" not in r]  # Fluent Bit's (the test's sentinel names a hostname)
    shipped = [r["msg"] for r in mine]
    assert sorted(shipped) == sorted([dmesg(1108.858286, SXID_DRIVER), SXID_FABRIC_MANAGER]), shipped
    assert {r["node"] for r in mine} == {node}
    # The boot-id Lua filter runs on kmsg's tag only: Fabric Manager's file may hold lines of an earlier boot.
    assert [r.get("boot_id") for r in mine if r["msg"] == SXID_FABRIC_MANAGER] == [None]


def _corpus_fault_lines() -> list[str]:
    """Every line of the kernel corpus where a fault begins, and the continuation lines of multi-line faults."""
    lines: list[str] = []
    for case in yaml.safe_load(CORPUS.read_text())["cases"]:
        starts = {e["line"] for e in case["expect"]}
        if not starts:
            continue
        last = max(starts)
        # A fault's message may span the lines up to the next one (fallen off the bus): keep them all.
        lines += [line for n, line in enumerate(case["lines"], 1) if n in starts or (min(starts) < n <= last)]
    return list(dict.fromkeys(lines))


async def test_the_prefilter_as_fluent_bit_runs_it_keeps_every_corpus_fault_and_drops_noise(
    fluent_bit: Path, kafka_bootstrap: str, tmp_path: Path
) -> None:
    prefix = f"t-fbre-{uuid.uuid4().hex[:6]}-"
    topic = TopicNames(prefix=prefix).name("logs_kernel")
    await ensure_topics(kafka_bootstrap, [topic], 1)
    faults = _corpus_fault_lines()
    assert len(faults) > 60
    fb = start(tmp_path / "re", node_name("re"), kafka_bootstrap, prefix)
    try:
        fb.write("kern.log", *NOISE, *faults, *NOISE)
        await asyncio.to_thread(fb.wait_delivered, len(faults))
        await asyncio.sleep(3)  # anything more (noise) would have been flushed by now (flush: 1 s)
    finally:
        fb.stop()
    shipped = [orjson.loads(v)["msg"] for _, v in await read_all(kafka_bootstrap, topic)]
    assert sorted(shipped) == sorted(faults), (
        f"dropped: {sorted(set(faults) - set(shipped))[:5]}; kept noise: {sorted(set(shipped) - set(faults))[:5]}")


async def test_every_kafka_codec_librdkafka_sends_becomes_an_incident(
    fluent_bit: Path, kafka_bootstrap: str, worker_prefix: str, tmp_path: Path
) -> None:
    codecs = ("none", "gzip", "snappy", "lz4", "zstd")
    nodes = {codec: node_name(codec) for codec in codecs}
    daemons = [start(tmp_path / codec, nodes[codec], kafka_bootstrap, worker_prefix,
                     rdkafka={"compression.codec": codec}) for codec in codecs]
    try:
        async with Pipeline(kafka_bootstrap, worker_prefix) as pipe:
            for d in daemons:
                d.write("kern.log", dmesg(100.0, NOISE[0]), dmesg(101.5, XID_79))
            await wait_incidents(pipe, {node: has_code(79) for node in nodes.values()}, daemons)
    finally:
        for d in daemons:
            d.stop()


STORM = 12_000  # more than the shipped rdkafka.queue.buffering.max.messages (10,000): the rest waits on disk


async def _raw_lines(bootstrap: str, topic: str, nodes: list[str]) -> dict[str, list[str]]:
    """The kernel lines on the raw topic per node (Fluent Bit's records only: they carry the Lua boot id)."""
    out: dict[str, list[str]] = {n: [] for n in nodes}
    for key, value in await read_all(bootstrap, topic):
        record = orjson.loads(value)
        if key and key.decode() in out and record.get("boot_id") == BOOT_ID:
            out[key.decode()].append(record["msg"])
    return out


async def test_kafka_down_for_30s_loses_nothing_and_a_restart_duplicates_nothing(
    fluent_bit: Path, private_kafka: Callable[..., KafkaCluster], tmp_path: Path
) -> None:
    cluster = private_kafka(1)
    bootstrap = cluster.bootstrap
    tag = uuid.uuid4().hex[:6]
    prefix, app_id = f"t-fbout-{tag}-", f"t-fbout-{tag}"
    topics = TopicNames(prefix=prefix)
    raw_topic = topics.name("logs_kernel")
    await ensure_topics(bootstrap, worker_topics(app_id, topics), PARTITIONS)
    worker = Worker(bootstrap, app_id, prefix, tmp_path).start()
    nodes = [node_name(f"out{i}") for i in range(3)]
    written: dict[str, list[str]] = {n: [] for n in nodes}
    daemons: list[FluentBit] = []

    def write(d: FluentBit, *lines: str) -> None:
        d.write("kern.log", *lines)
        written[d.node] += [line for line in lines if "NVRM" in line]

    try:
        async with Pipeline(bootstrap, prefix) as pipe:
            await wait_ready(pipe, worker)
            daemons = [start(tmp_path / node, node, bootstrap, prefix) for node in nodes]
            # Before: one fault per node reaches Kafka while it is up.
            for d in daemons:
                write(d, dmesg(10.0, XID_62))
            await wait_incidents(pipe, {node: has_code(62) for node in nodes}, daemons)
            cluster.stop_broker(1)
            down_at = time.monotonic()
            # 30 s without Kafka: the first node logs a storm larger than librdkafka's queue at once, and
            # every node repeats its fault every second, with noise between.
            write(daemons[0], *(dmesg(11.0 + i / 1e6, XID_62) for i in range(STORM)))
            second = 0
            while time.monotonic() - down_at < 30:
                for d in daemons:
                    write(d, dmesg(20.0 + second, XID_62), dmesg(20.5 + second, NOISE[3]))
                second += 1
                await asyncio.sleep(1)
            for d in daemons:
                assert d.alive(), f"Fluent Bit of {d.node} died while Kafka was down:\n{d.log_tail()}"
            # What librdkafka's queue could not take waits in the storage path, on disk.
            on_disk = list((daemons[0].root / "flb-storage").rglob("*.flb"))
            assert on_disk, f"nothing buffered on disk:\n{daemons[0].log_tail()}"
            cluster.start_broker(1)
            up_at = time.monotonic()

            # Nothing lost: every fault line written reaches the raw topic.
            deadline = time.monotonic() + 240
            while True:
                shipped = await _raw_lines(bootstrap, raw_topic, nodes)
                missing = {n: len(set(written[n]) - set(shipped[n])) for n in nodes}
                if not any(missing.values()):
                    break
                assert time.monotonic() < deadline, f"lines never delivered after the outage: {missing}"
                await asyncio.sleep(3)
            delivered_s = time.monotonic() - up_at
            repeats = {n: len(shipped[n]) - len(set(shipped[n])) for n in nodes}
            # Nothing sent twice either: with the queue full the output waits for room (queue_full_retries: 0)
            # instead of giving the chunk back to be sent again whole.
            assert repeats == {n: 0 for n in nodes}, repeats
            for node in nodes:
                t0 = time.monotonic()
                await pipe.sentinel(node, time.time(), within_s=300)
                print(f"[fluent-bit outage] {node}: backlog worked off {time.monotonic() - t0:.1f}s after delivery")
                incs = [i for i in incidents_of(pipe, node) if i.get("pci") == "0000:48:00.0"]
                assert len(incs) == 1, incs

            # A Fluent Bit restart reads its files from where its tail database says: nothing twice.
            before = {n: len(v) for n, v in shipped.items()}
            for d in daemons:
                d.stop()
                d.start()
                write(d, dmesg(90.0, XID_48))
            for d in daemons:
                await asyncio.to_thread(d.wait_delivered, 1)
            await asyncio.sleep(3)
            after = {n: len(v) for n, v in (await _raw_lines(bootstrap, raw_topic, nodes)).items()}
            assert after == {n: before[n] + 1 for n in nodes}, (before, after)
            print(f"[fluent-bit outage] Kafka down 30 s: {sum(len(v) for v in written.values())} fault lines "
                  f"written ({STORM} of them one node's storm), all delivered {delivered_s:.1f} s after Kafka "
                  f"returned, {len(on_disk)} chunk files on disk during the outage; repeats per node {repeats}; "
                  "0 lines re-sent after a Fluent Bit restart")
    finally:
        for d in daemons:
            d.stop()
        worker.stop()
