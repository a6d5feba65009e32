"""rsyslog for real: Debian's rsyslogd with omkafka reads a kernel-style log file (imfile) and produces to
the raw kernel topic, once in rsyslog's default form (no Kafka key; the host only in the syslog header)
and once with the shipped recipe (deploy/rsyslog/60-xidflow.conf: JSON, keyed by node, murmur2 partitions).
A real worker process turns both into incidents on the right node.

rsyslogd and omkafka come from Debian's ``rsyslog`` and ``rsyslog-kafka`` packages; the fixture installs
them when missing (``pipeline.localinfra.rsyslog``, what ``make infra`` runs) and fails if it cannot.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import pytest
from aiokafka.partitioner import DefaultPartitioner

from pipeline.localinfra import procs
from pipeline.localinfra.rsyslog import RsyslogDist, render_shipped_recipe
from pipeline.runtime.settings import TopicNames
from tests.integration.test_pipeline import Pipeline

pytestmark = pytest.mark.integration

XID_79 = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID_48 = "NVRM: Xid (PCI:0000:b7:00): 48, pid=2331, name=python, An uncorrectable double bit error"

class Rsyslogd:
    """One rsyslogd (foreground, own config/pid/work dir) shipping one file to Kafka as ``hostname``.

    ``form`` "shipped" runs the shipped recipe (deploy/rsyslog/60-xidflow.conf, only the broker list, topic and
    codec changed); None is omkafka's default form, as a user who wrote their own action without our recipe
    gets it (no Kafka key, the host only in the syslog header).
    """

    def __init__(self, dist: RsyslogDist, root: Path, hostname: str, bootstrap: str, topic: str,
                 form: str | None, *, partition: int | None = None, codec: str | None = None) -> None:
        self.dist, self.root, self.hostname = dist, root, hostname
        root.mkdir(parents=True)
        (root / "work").mkdir()
        self.log_file = root / "kern.log"
        self.log_file.touch()
        conf_params = [f"compression.codec={codec}"] if codec else []  # librdkafka compresses the batches
        conf_params += ["queue.buffering.max.ms=10"]
        if form == "shipped":
            assert partition is None, "the shipped recipe partitions by key"
            (root / "60-xidflow.conf").write_text(render_shipped_recipe(bootstrap, topic, conf_params))
            output = f'include(file="{root / "60-xidflow.conf"}")'
            ruleset = ""
        else:
            assert form is None, form
            fixed = f' partitions.usefixed="{partition}"' if partition is not None else ""
            params = ", ".join(f'"{p}"' for p in [*conf_params, "acks=all"])
            output = (f'module(load="omkafka")\nruleset(name="to_kafka") {{\n'
                      f'  action(type="omkafka" broker=["{bootstrap}"] topic="{topic}"'
                      f"{fixed} confParam=[{params}])\n}}")
            ruleset = ' ruleset="to_kafka"'
        (root / "rsyslog.conf").write_text(f"""
global(workDirectory="{root / 'work'}" localHostname="{hostname}")
module(load="imfile")
input(type="imfile" file="{self.log_file}" tag="kernel:" facility="kern" severity="err"{ruleset})
{output}
""")
        self.proc: subprocess.Popen | None = None

    def start(self) -> Rsyslogd:
        out = (self.root / "rsyslogd.out").open("wb")
        self.proc = subprocess.Popen(
            [str(self.dist.rsyslogd), "-n", "-f", str(self.root / "rsyslog.conf"), "-i", str(self.root / "pid")],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        out.close()
        return self

    def write(self, *lines: str) -> None:
        procs.append_lines(self.log_file, lines)

    def output(self) -> str:
        return (self.root / "rsyslogd.out").read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        procs.terminate(self.proc, 20)


async def test_rsyslog_default_form_and_the_shipped_recipe_become_incidents_on_the_right_node(
    rsyslog: RsyslogDist, kafka_bootstrap: str, worker_prefix: str, tmp_path: Path
) -> None:
    topics = TopicNames(prefix=worker_prefix)
    raw_topic = topics.name("logs_kernel")
    plain_node, json_node = f"rsys-plain-{uuid.uuid4().hex[:6]}", f"rsys-json-{uuid.uuid4().hex[:6]}"
    daemons = [
        Rsyslogd(rsyslog, tmp_path / "plain", plain_node, kafka_bootstrap, raw_topic, None).start(),
        Rsyslogd(rsyslog, tmp_path / "json", json_node, kafka_bootstrap, raw_topic, "shipped").start(),
    ]
    try:
        async with Pipeline(kafka_bootstrap, worker_prefix) as pipe:
            uptime = 538441.007373
            for d, line in zip(daemons, (XID_79, XID_48), strict=True):
                d.write(f"[{uptime:12.6f}] usb 1-1: new high-speed USB device number 2", f"[{uptime:12.6f}] {line}")

            def incident_of(node: str, code: int) -> bool:
                return any(i.get("type") == "incident" and i.get("code") == code for i in pipe.incidents(node))

            deadline = time.monotonic() + 90
            while not (incident_of(plain_node, 79) and incident_of(json_node, 48)):
                for d in daemons:
                    assert d.proc and d.proc.poll() is None, f"rsyslogd exited:\n{d.output()}"
                assert time.monotonic() < deadline, (
                    f"no incidents from rsyslog; seen {pipe.seen['incidents'][-5:]}, dead letters "
                    f"{pipe.seen['deadletter'][-3:]}; rsyslogd: {[d.output() for d in daemons]}"
                )
                await pipe.poll()
            # Exactly the right nodes, nothing for the rsyslog lines in the dead-letter topic.
            await pipe.poll()
            assert not [d for d in pipe.seen["deadletter"] if plain_node in str(d) or json_node in str(d)]
    finally:
        for d in daemons:
            d.stop()

    # What rsyslog actually produced: default form has no key and the host only in the header.
    from aiokafka import TopicPartition

    from pipeline.kafka import clients as kafka_clients
    consumer = kafka_clients.consumer(bootstrap=kafka_bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        parts = [TopicPartition(raw_topic, p) for p in sorted(consumer.partitions_for_topic(raw_topic) or range(4))]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        records = []
        for _ in range(10):
            for batch in (await consumer.getmany(*parts, timeout_ms=500)).values():
                records += batch
    finally:
        await consumer.stop()
    plain = [r for r in records if plain_node.encode() in r.value]
    as_json = [r for r in records if json_node.encode() in r.value]
    assert plain and all(r.key is None for r in plain)
    assert plain[0].value.split(b" ")[1] == plain_node.encode()  # "<rfc3339 time> <host> kernel: ..."
    assert as_json and as_json[0].value.startswith(b"{") and b'"host":' in as_json[0].value
    # The shipped recipe keys by node and partitions as Kafka's default partitioner does (murmur2), as the
    # shipped Fluent Bit does (tests/integration/test_shipper_partitions.py).
    every = list(range(len(parts)))
    assert all(r.key == json_node.encode() for r in as_json)
    assert {r.partition for r in as_json} == {DefaultPartitioner()(json_node.encode(), every, every)}
