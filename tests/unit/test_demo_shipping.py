"""The files the demo writes for its Fluent Bits are in the formats the shipped configuration reads."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.demo.shipping import container_log_name, cri_line, kmsg_record, rdkafka_credentials
from pipeline.localinfra.fluentbit_run import load_shipped
from pipeline.runtime.settings import KafkaSettings

# Fluent Bit's kubernetes filter reads pod, namespace, container and id from the file name with this regex
# (plugins/filter_kubernetes/kube_regex.h, KUBE_TAG_TO_REGEX, 5.1.1).
KUBE_TAG_TO_REGEX = (r"(?P<pod_name>[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*)_"
                     r"(?P<namespace_name>[^_]+)_(?P<container_name>.+)-(?P<docker_id>[a-z0-9]{64})\.log$")
# CRI log line: time, stream, partial/full tag, message (Fluent Bit's built-in `cri` multiline parser).
CRI = r"^(?P<time>\S+) (?P<stream>stdout|stderr) (?P<logtag>[^ ]*) (?P<log>.*)$"


def test_kernel_lines_parse_with_the_shipped_kmsg_record_parser() -> None:
    parsers = {p["name"]: p for p in load_shipped()["parsers"]}
    regex = parsers["xidflow-kmsg-record"]["regex"].replace("(?<", "(?P<")
    line = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    m = re.match(regex, kmsg_record(3, 2001, 538441007373, line))
    fields = (m["priority"], m["sequence"], m["sec"], m["usec"], m["msg"]) if m else None
    assert fields == ("3", "2001", "538441", "007373", line)


def test_container_log_names_resolve_to_the_pod_in_fluent_bits_tag_regex() -> None:
    name = container_log_name("llm-01-0", "training-ab12cd", "trainer", salt="run")
    m = re.search(KUBE_TAG_TO_REGEX, name)
    assert m and (m["pod_name"], m["namespace_name"], m["container_name"]) == ("llm-01-0", "training-ab12cd", "trainer")
    assert container_log_name("llm-01-0", "training-ab12cd", "trainer", salt="other") != name


def test_pod_lines_are_cri_lines() -> None:
    m = re.match(CRI, cri_line("NCCL error: unhandled system error"))
    assert m and m["stream"] == "stderr" and m["logtag"] == "F" and m["log"] == "NCCL error: unhandled system error"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z", m["time"])


def test_the_fluent_bits_use_the_demos_kafka_credentials(tmp_path: Path) -> None:
    assert rdkafka_credentials(KafkaSettings(KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:9092")) == {}
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    (tmp_path / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    props = rdkafka_credentials(KafkaSettings(
        KAFKA_BOOTSTRAP_SERVERS="127.0.0.1:9093", KAFKA_SECURITY_PROTOCOL="SASL_SSL",
        KAFKA_SASL_MECHANISM="SCRAM-SHA-512", KAFKA_SASL_USERNAME="xidflow-shipper",
        KAFKA_SASL_PASSWORD_FILE=str(secret), KAFKA_SSL_CAFILE=str(tmp_path / "ca.crt")))
    assert props == {"security.protocol": "sasl_ssl", "sasl.mechanisms": "SCRAM-SHA-512",
                     "sasl.username": "xidflow-shipper", "sasl.password": "s3cret",
                     "ssl.ca.location": str(tmp_path / "ca.crt")}
