"""The OpenTelemetry Collector for real: the collector built from ``pipeline/localinfra/otelbuild/`` with the
collector builder (contrib filelog receiver, resource/batch processors, Kafka exporter, file_storage) runs
the configuration shipped in ``deploy/otel-collector/otel-collector.yaml``, rendered with only its two
host paths moved under the test's folder (the rest comes from the environment, as on a node). Two
collectors, one per node, tail dmesg-format kernel log files and produce OTLP JSON to the raw kernel topic;
a real worker process (``worker_prefix`` in conftest) turns the lines into incidents on the right node.
One collector is then stopped, a line written while it is down, and restarted: the line arrives (file
offsets kept in file_storage) and the lines read before the restart are not sent again.

The collector is built once into ``~/.cache/xidflow/otelcol/`` (``xidflow local install --otelcol``); a
cold build takes minutes. A collector that cannot be built fails these tests, loudly.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import orjson
import pytest
import yaml

from pipeline.localinfra import procs
from pipeline.localinfra.otelcol import ensure_otelcol
from pipeline.localinfra.procs import free_port
from pipeline.runtime.settings import TopicNames
from tests.integration.test_pipeline import PARTITIONS, Pipeline

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "deploy" / "otel-collector" / "otel-collector.yaml"
# The shipped file's host paths, and where each sits in the configuration; nothing else is changed.
KERNEL_LOG = "/var/log/kern.log"
STATE_DIR = "/var/lib/otelcol/xidflow"

XID_79 = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID_48 = "NVRM: Xid (PCI:0000:b7:00): 48, pid=2331, name=python, An uncorrectable double bit error"
XID_79_LATER = "NVRM: Xid (PCI:0000:ca:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
NOISE = "usb 1-1: new high-speed USB device number 2 using xhci_hcd"


def render(log_file: Path, state_dir: Path) -> str:
    """The shipped configuration with its two host paths replaced; fails when the shipped file moved them."""
    text = SHIPPED.read_text()
    for old in (KERNEL_LOG, STATE_DIR):
        assert text.count(old) == 1, f"{SHIPPED} no longer has {old} exactly once: update this test"
    rendered = text.replace(KERNEL_LOG, str(log_file)).replace(STATE_DIR, str(state_dir))
    shipped, ours = yaml.safe_load(text), yaml.safe_load(rendered)
    assert ours["receivers"]["file_log/kernel"]["include"] == [str(log_file)]
    assert ours["extensions"]["file_storage"]["directory"] == str(state_dir)
    ours["receivers"]["file_log/kernel"]["include"] = [KERNEL_LOG]
    ours["extensions"]["file_storage"]["directory"] = STATE_DIR
    assert ours == shipped, "the rendered configuration differs from the shipped one beyond the two paths"
    return rendered


@pytest.fixture(scope="module")
def otelcol() -> Path:
    try:
        return ensure_otelcol(lambda m: print(f"[otelcol] {m}", flush=True))
    except Exception as exc:  # noqa: BLE001 - fail loudly, never skip
        pytest.fail(f"the OpenTelemetry Collector could not be built: {exc}", pytrace=False)


class Collector:
    """One collector process running the shipped configuration as node ``node``."""

    def __init__(self, binary: Path, root: Path, node: str, bootstrap: str, topic: str) -> None:
        self.binary, self.root, self.node = binary, root, node
        root.mkdir(parents=True)
        self.log_file = root / "kern.log"
        self.log_file.touch()  # empty: the receiver starts reading it once it has a first line
        self.config = root / "otel-collector.yaml"
        self.config.write_text(render(self.log_file, root / "state"))
        self.env = {
            **os.environ, "NODE_NAME": node, "KAFKA_BROKERS": bootstrap, "XIDFLOW_KERNEL_TOPIC": topic,
            "OTELCOL_METRICS_PORT": str(free_port()),
        }
        self.out = root / "otelcol.out"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, within_s: float = 60.0) -> Collector:
        self.starts += 1
        with self.out.open("ab") as out:
            self.proc = subprocess.Popen([str(self.binary), f"--config={self.config}"], env=self.env,
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + within_s
        while self.output().count("Everything is ready") < self.starts:
            assert self.proc.poll() is None, f"otelcol exited:\n{self.output()}"
            assert time.monotonic() < deadline, f"otelcol not ready after {within_s:.0f}s:\n{self.output()}"
            time.sleep(0.2)
        time.sleep(1.0)  # the receiver's first poll (200 ms) has seen the file: later lines are all read
        return self

    def write(self, *lines: str) -> None:
        procs.append_lines(self.log_file, lines)

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        procs.terminate(self.proc)


def test_the_shipped_configuration_is_valid_for_the_built_collector(otelcol: Path, tmp_path: Path) -> None:
    config = tmp_path / "otel-collector.yaml"
    config.write_text(render(tmp_path / "kern.log", tmp_path / "state"))
    env = {**os.environ, "NODE_NAME": "n1", "KAFKA_BROKERS": "127.0.0.1:9092"}
    proc = subprocess.run([str(otelcol), "validate", f"--config={config}"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


async def test_collector_lines_become_incidents_on_the_right_node_and_survive_a_restart(
    otelcol: Path, kafka_bootstrap: str, worker_prefix: str, tmp_path: Path
) -> None:
    topics = TopicNames(prefix=worker_prefix)
    raw_topic = topics.name("logs_kernel")
    node_a, node_b = f"otel-a-{uuid.uuid4().hex[:6]}", f"otel-b-{uuid.uuid4().hex[:6]}"
    collectors = [
        Collector(otelcol, tmp_path / "a", node_a, kafka_bootstrap, raw_topic).start(),
        Collector(otelcol, tmp_path / "b", node_b, kafka_bootstrap, raw_topic).start(),
    ]
    a, b = collectors

    def output() -> str:
        return "\n".join(f"--- {c.node}:\n{c.output()[-2000:]}" for c in collectors)

    try:
        async with Pipeline(kafka_bootstrap, worker_prefix) as pipe:

            def incident(node: str, code: int, pci: str) -> bool:
                return any(i.get("type") == "incident" and i.get("code") == code and i.get("pci") == pci
                           for i in pipe.incidents(node))

            async def until(what, message: str, within_s: float = 90.0) -> None:  # noqa: ANN001
                deadline = time.monotonic() + within_s
                while not what():
                    for c in collectors:
                        assert c.alive(), f"otelcol of {c.node} exited:\n{output()}"
                    assert time.monotonic() < deadline, (
                        f"{message}; incidents {pipe.seen['incidents'][-5:]}, dead letters "
                        f"{pipe.seen['deadletter'][-3:]}\n{output()}")
                    await pipe.poll()

            uptime = 538441.007373
            a.write(f"[{uptime:12.6f}] {NOISE}", f"[{uptime:12.6f}] {XID_79}")
            b.write(f"[{uptime:12.6f}] {NOISE}", f"[{uptime + 1:12.6f}] {XID_48}")
            await until(lambda: incident(node_a, 79, "0000:4e:00.0") and incident(node_b, 48, "0000:b7:00.0"),
                        "no incidents from the collectors")
            assert not [i for i in pipe.incidents(node_a) if i.get("code") == 48]
            assert not [i for i in pipe.incidents(node_b) if i.get("code") == 79]

            # A restart: the line written while the collector is down arrives, the earlier ones do not again.
            a.stop()
            a.write(f"[{uptime + 60:12.6f}] {XID_79_LATER}")
            a.start()
            await until(lambda: incident(node_a, 79, "0000:ca:00.0"), "no incident for the line written "
                        "while the collector was down")
            await pipe.poll()
            first = [e for e in pipe.seen["fault_events"] if e.get("node") == node_a and
                     e.get("pci") == "0000:4e:00.0"]
            assert len(first) == 1, f"the line read before the restart was sent again: {first}"
            assert not [d for d in pipe.seen["deadletter"] if node_a in str(d) or node_b in str(d)]
    finally:
        for c in collectors:
            c.stop()

    records = await _read_all(kafka_bootstrap, raw_topic)
    ours = {node: [r for r in records if dict(r.headers).get("node") == node.encode()] for node in (node_a, node_b)}
    for node, recs in ours.items():
        assert recs, f"no record with header node={node} on {raw_topic}"
        # One key per node (a hash of the resource attributes): the node's lines stay on one partition, in order.
        assert len({r.key for r in recs}) == 1 and len({r.partition for r in recs}) == 1
        bodies = []
        for r in recs:
            request = orjson.loads(r.value)
            for rl in request["resourceLogs"]:
                attrs = {a["key"]: a["value"].get("stringValue") for a in rl["resource"]["attributes"]}
                assert attrs["k8s.node.name"] == node
                bodies += [lr["body"]["stringValue"] for sl in rl["scopeLogs"] for lr in sl["logRecords"]]
        assert not [line for line in bodies if NOISE in line], "the prefilter let a noise line through"
    assert ours[node_a][0].key != ours[node_b][0].key
    example = ours[node_b][0]
    print(f"example record: key={example.key!r} headers={example.headers} value={example.value.decode()}")


async def _read_all(bootstrap: str, topic: str) -> list:
    from aiokafka import TopicPartition

    from pipeline.kafka import clients as kafka_clients
    consumer = kafka_clients.consumer(bootstrap=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or range(PARTITIONS))]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        records = []
        for _ in range(10):
            for batch in (await consumer.getmany(*parts, timeout_ms=500)).values():
                records += batch
        return records
    finally:
        await consumer.stop()
