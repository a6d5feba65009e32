"""The real Fluent Bit on a secured broker: SASL_SSL with SCRAM-SHA-512 and the ACL table, as
``xidflow local up --kafka-security sasl_ssl`` starts it (``pipeline.localinfra.kafka``).

Fluent Bit runs the shipped configuration with the librdkafka security properties the Helm chart renders
from ``kafka.security`` (``ci/kafka-security-values.yaml``), only the CA's path moved to this machine's,
and authenticates as the shipper principal. A real worker authenticated as the worker principal turns its
lines into incidents; the shipper principal cannot write any other topic, and Fluent Bit says so.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from pipeline.localinfra.fluentbit_run import FluentBit, Render
from pipeline.localinfra.helm import helm_template
from pipeline.localinfra.kafka import ADMIN_USER, KafkaCluster
from pipeline.runtime.settings import TopicNames
from tests.integration.test_kafka_security import read_all
from tests.integration.test_pipeline import Worker

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "xidflow"
T = TopicNames(prefix="")  # the ACL table's names (pipeline.kafka.acls)
SHIPPER = "xidflow-shipper"
XID_79 = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID_48 = "NVRM: Xid (PCI:0000:b7:00): 48, pid=2331, name=python, An uncorrectable double bit error"


def chart_rdkafka_security() -> dict[str, str]:
    """The security properties the chart puts on Fluent Bit's kafka outputs for ci/kafka-security-values.yaml."""
    text = helm_template(CHART, release="rel", namespace="xf-system",
                         values_files=(CHART / "ci" / "kafka-security-values.yaml",), log=lambda _m: None)
    config_map = next(d for d in yaml.safe_load_all(text)
                      if d and d["kind"] == "ConfigMap" and d["metadata"]["name"] == "rel-xidflow-fluent-bit")
    outputs = yaml.safe_load(config_map["data"]["fluent-bit.yaml"])["pipeline"]["outputs"]
    props = [{k: v for k, v in o.items() if k.startswith(("rdkafka.security.", "rdkafka.sasl.", "rdkafka.ssl."))}
             for o in outputs]
    assert props[0] and all(p == props[0] for p in props), props
    return props[0]


@pytest.fixture(scope="module")
def secured_worker(secured: KafkaCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A real worker (app id ``xidflow``, the ACL table's) authenticated as the worker principal."""
    worker = Worker(secured.bootstrap, "xidflow", "", tmp_path_factory.mktemp("fb-secured-worker"),
                    extra_env=secured.client_env("xidflow-worker")).start()
    yield worker
    worker.stop()


def shipper_fluent_bit(secured: KafkaCluster, root: Path, node: str, kernel_topic: str) -> FluentBit:
    """Fluent Bit with the chart's security properties; the password comes from the environment, as the
    DaemonSet's secretKeyRef gives it."""
    rdkafka = {k.removeprefix("rdkafka."): v for k, v in chart_rdkafka_security().items()}
    assert rdkafka["sasl.username"] == SHIPPER and rdkafka["sasl.password"] == "${KAFKA_SASL_PASSWORD}"
    assert rdkafka["ssl.ca.location"].startswith("/etc/xidflow/kafka-tls/")  # the mounted Secret ...
    rdkafka["ssl.ca.location"] = str(secured.ca_file)  # ... is this machine's CA file
    render = Render(root=root, kernel_topic=kernel_topic, pods_topic=T.name("logs_pods"), rdkafka=rdkafka)
    password = secured.password_file(SHIPPER).read_text()
    return FluentBit(root, node, secured.bootstrap, render, extra_env={"KAFKA_SASL_PASSWORD": password})


def kmsg_lines(*lines: str) -> list[str]:
    uptime = 538441.007373
    return [f"[{uptime + n:12.6f}] {line}" for n, line in enumerate(lines)]


async def test_fluent_bit_ships_as_the_shipper_and_an_authenticated_worker_opens_the_incident(
    secured: KafkaCluster, secured_worker: Worker, tmp_path: Path
) -> None:
    node = f"gpu-fbsec-{uuid.uuid4().hex[:6]}"
    fb = shipper_fluent_bit(secured, tmp_path / "fb", node, T.name("logs_kernel")).start()
    reader = secured.client_settings("xidflow-reader")
    try:
        fb.write("kern.log", *kmsg_lines("usb 1-1: new high-speed USB device number 2", XID_79))
        fb.wait_delivered(1, timeout=90)
        deadline = time.monotonic() + 120
        while True:
            assert secured_worker.alive(), f"the worker exited:\n{secured_worker.log_tail()}"
            incidents = [orjson.loads(v) for v in await read_all(reader, T.name("incidents"))]
            mine = [i for i in incidents if i.get("node") == node and i.get("type") == "incident"]
            if mine:
                break
            assert time.monotonic() < deadline, (
                f"no incident for {node}; worker:\n{secured_worker.log_tail()}\nFluent Bit:\n{fb.log_tail()}")
            await asyncio.sleep(1)
        assert [(i["code"], i["action"]) for i in mine] == [(79, "REBOOT_NODE")], mine
    finally:
        fb.stop()
    assert "authorization" not in fb.log_tail(200).lower()
    # On the raw topic (read as the admin: no component principal reads it but the worker): the Xid line
    # only, keyed by node; the prefilter kept the USB line off the wire.
    raw = [orjson.loads(v) for v in await read_all(secured.client_settings(ADMIN_USER), T.name("logs_kernel"))]
    assert [r["msg"] for r in raw if r.get("node") == node] == [kmsg_lines("", XID_79)[1]]


async def test_the_shipper_principal_cannot_write_the_incidents_topic(
    secured: KafkaCluster, tmp_path: Path
) -> None:
    node = f"gpu-fbsec-{uuid.uuid4().hex[:6]}"
    fb = shipper_fluent_bit(secured, tmp_path / "fb", node, T.name("incidents")).start()
    try:
        fb.write("kern.log", *kmsg_lines(XID_48))
        deadline = time.monotonic() + 90
        refusal = f"failed to produce to topic {T.name('incidents')}: broker: topic authorization failed"

        def kernel_output() -> dict[str, int]:
            return fb.metrics()["output"]["kafka.0"]  # the first output: match kernel

        # The broker refuses at produce time: an error in the log and the record counted dropped, none taken.
        while refusal not in fb.log_tail(400).lower() or kernel_output()["dropped_records"] < 1:
            assert fb.alive(), f"Fluent Bit exited:\n{fb.log_tail()}"
            assert time.monotonic() < deadline, (
                f"no authorization error from Fluent Bit: {kernel_output()}\n{fb.log_tail()}")
            await asyncio.sleep(1)
        assert (kernel_output()["proc_records"], kernel_output()["dropped_records"]) == (0, 1), kernel_output()
    finally:
        fb.stop()
    records: list[Any] = [orjson.loads(v) for v in await read_all(secured.client_settings(ADMIN_USER),
                                                                   T.name("incidents"))]
    assert not [r for r in records if node in str(r)], records
