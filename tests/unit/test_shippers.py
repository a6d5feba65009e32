"""Other shippers' record shapes (pipeline.ingest.shippers, dispatched by pipeline.ingest.adapters), from their
documented forms.

- OTLP JSON: the opentelemetry-proto repository's ``examples/logs.json`` (an ExportLogsServiceRequest,
  what the Collector's Kafka exporter writes with ``encoding: otlp_json``), with the node attributes of
  the k8sattributes/resourcedetection processors added.
- Filebeat: the Kafka output's default ``codec.json`` event: ECS fields (``@timestamp``, ``@metadata``,
  ``message``, ``host.name``, ``log.file.path``, ``log.offset``, ``input.type``, ``agent``, ``ecs``).
- rsyslog: ``RSYSLOG_FileFormat`` / ``RSYSLOG_TraditionalFileFormat`` / RFC 5424 lines (the real
  rsyslogd is exercised in tests/integration/test_rsyslog.py).
"""

from __future__ import annotations

from datetime import UTC, datetime

import orjson

from pipeline.detection.detector import Detector
from pipeline.ingest.adapters import decode_record
from pipeline.ingest.shippers import kmsg_replay_key, parse_syslog
from schemas.records import LogRecord, Source

XID = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
TOPIC = "gpu.logs.kernel"


def decoded(value: bytes, key: bytes | None = None, topic: str = TOPIC) -> list[LogRecord]:
    records, dead = decode_record(value, key, None, topic, timestamp_ms=1_763_800_000_000)
    assert dead == [], [d.reason for d in dead]
    return records


def otlp(resource_attrs: dict[str, str], body: dict, time_ns: int | str = 1544712660300000000) -> dict:
    """The shape of opentelemetry-proto's examples/logs.json, with the given resource attributes and body."""
    return {
        "resourceLogs": [
            {
                "resource": {"attributes": [{"key": k, "value": {"stringValue": v}} for k, v in
                                            {"service.name": "my.service", **resource_attrs}.items()]},
                "scopeLogs": [
                    {
                        "scope": {"name": "my.library", "version": "1.0.0"},
                        "logRecords": [
                            {
                                "timeUnixNano": time_ns,
                                "observedTimeUnixNano": 1544712660300000000,
                                "severityText": "Information",
                                "traceId": "5B8EFFF798038103D269B633813FC60C",
                                "spanId": "EEE19B7EC3C1B174",
                                "body": body,
                                "attributes": [
                                    {"key": "string.attribute", "value": {"stringValue": "some string"}},
                                    {"key": "int.attribute", "value": {"intValue": 10}},
                                ],
                            }
                        ],
                    }
                ],
            }
        ]
    }


# -- OpenTelemetry Collector ------------------------------------------------------------------------


def test_otlp_json_node_from_k8s_node_name() -> None:
    value = orjson.dumps(otlp({"k8s.node.name": "gpu-node-1", "host.name": "ip-10-0-0-1"}, {"stringValue": XID}))
    (rec,) = decoded(value)
    assert (rec.node, rec.line, rec.shipper, rec.source) == ("gpu-node-1", XID, "otel-collector", Source.KERNEL)
    assert rec.ts == datetime(2018, 12, 13, 14, 51, 0, 300000, tzinfo=UTC)


def test_otlp_json_node_from_host_name_and_string_nanoseconds() -> None:
    value = orjson.dumps(otlp({"host.name": "gpu-node-2"}, {"stringValue": XID}, time_ns="1544712660300000000"))
    (rec,) = decoded(value)
    assert rec.node == "gpu-node-2" and rec.ts.year == 2018


def test_otlp_json_pod_attributes_make_a_pod_line() -> None:
    attrs = {"k8s.node.name": "gpu-node-3", "k8s.pod.name": "trainer-0", "k8s.namespace.name": "ml",
             "k8s.container.name": "main"}
    (rec,) = decoded(orjson.dumps(otlp(attrs, {"stringValue": "NCCL WARN Cuda failure"})), topic="gpu.logs.any")
    assert (rec.source, rec.pod, rec.namespace, rec.container) == (Source.POD, "trainer-0", "ml", "main")


def test_otlp_json_journald_body_and_zero_time_uses_observed_time() -> None:
    body = {"kvlistValue": {"values": [{"key": "MESSAGE", "value": {"stringValue": XID}},
                                       {"key": "_TRANSPORT", "value": {"stringValue": "kernel"}}]}}
    (rec,) = decoded(orjson.dumps(otlp({"host.name": "gpu-node-4"}, body, time_ns=0)))
    assert rec.line == XID and rec.ts.year == 2018


def test_otlp_json_without_node_falls_back_to_the_key_else_dead_letter() -> None:
    value = orjson.dumps(otlp({}, {"stringValue": XID}))
    assert decoded(value, key=b"gpu-node-5")[0].node == "gpu-node-5"
    records, dead = decode_record(value, None, None, TOPIC)
    assert records == [] and len(dead) == 1 and "no node" in dead[0].reason


def test_otlp_json_structural_problems_are_dead_letters() -> None:
    records, dead = decode_record(orjson.dumps({"resourceLogs": [{"scopeLogs": [{"scope": {}}]}]}), b"n", None, TOPIC)
    assert records == [] and "logRecords" in dead[0].reason
    records, dead = decode_record(orjson.dumps({"resourceLogs": "x"}), b"n", None, TOPIC)
    assert records == [] and "resourceLogs" in dead[0].reason
    # A body that is not text cannot be a log line.
    records, dead = decode_record(orjson.dumps(otlp({"host.name": "n"}, {"intValue": 3})), None, None, TOPIC)
    assert records == [] and "not a string" in dead[0].reason


# -- Filebeat -------------------------------------------------------------------------------------


def filebeat_event(message: str, **extra: object) -> dict:
    return {
        "@timestamp": "2026-11-22T10:15:30.123Z",
        "@metadata": {"beat": "filebeat", "type": "_doc", "version": "8.17.0"},
        "message": message,
        "log": {"offset": 1042, "file": {"path": "/var/log/kern.log"}},
        "input": {"type": "filestream"},
        "host": {"name": "gpu-node-6"},
        "agent": {"type": "filebeat", "version": "8.17.0", "name": "gpu-node-6"},
        "ecs": {"version": "8.0.0"},
        **extra,
    }


def test_filebeat_default_json_node_from_host_object() -> None:
    (rec,) = decoded(orjson.dumps(filebeat_event(XID)), topic="gpu.logs.any")
    assert (rec.node, rec.line, rec.shipper, rec.source) == ("gpu-node-6", XID, "filebeat", Source.KERNEL)
    assert rec.ts == datetime(2026, 11, 22, 10, 15, 30, 123000, tzinfo=UTC)


def test_filebeat_with_kubernetes_metadata() -> None:
    event = filebeat_event("NCCL WARN Cuda failure 'unspecified launch failure'",
                           kubernetes={"node": {"name": "gpu-node-7"}, "pod": {"name": "job-1"},
                                       "namespace": "ml", "container": {"name": "main"}})
    event["log"] = {"offset": 5, "file": {"path": "/var/log/containers/job-1_ml_main-abc.log"}}
    (rec,) = decoded(orjson.dumps(event), topic="gpu.logs.any")
    assert (rec.node, rec.pod, rec.namespace, rec.container, rec.source) == (
        "gpu-node-7", "job-1", "ml", "main", Source.POD)


def test_filebeat_without_metadata_still_recognised_by_host_object() -> None:
    event = filebeat_event(XID)
    del event["@metadata"], event["agent"]
    (rec,) = decoded(orjson.dumps(event))
    assert rec.node == "gpu-node-6"


# -- syslog text (rsyslog) --------------------------------------------------------------------------


def test_rsyslog_file_format_without_key_takes_the_node_from_the_header() -> None:
    value = f"2026-11-22T10:15:30.123456+00:00 gpu-node-8 kernel: {XID}\n".encode()
    (rec,) = decoded(value)
    assert (rec.node, rec.line, rec.shipper, rec.source) == ("gpu-node-8", XID, "syslog", Source.KERNEL)
    assert rec.ts == datetime(2026, 11, 22, 10, 15, 30, 123456, tzinfo=UTC)


def test_traditional_and_rfc5424_forms() -> None:
    (rec,) = decoded(f"Nov 22 10:15:30 gpu-node-9 kernel: [ 5.1] {XID}".encode())
    assert rec.node == "gpu-node-9" and rec.line == f"[ 5.1] {XID}" and rec.ts.month == 11
    (rec,) = decoded(f"<4>1 2026-11-22T10:15:30.1Z gpu-node-10 kernel - - - {XID}".encode())
    assert rec.node == "gpu-node-10" and rec.line == XID
    (rec,) = decoded(f'<4>1 2026-11-22T10:15:30Z gpu-node-11 kernel - - [x@1 a="b"] {XID}'.encode())
    assert rec.node == "gpu-node-11" and rec.line == XID


def test_traditional_timestamp_year_rolls_back_over_new_year() -> None:
    parsed = parse_syslog("Dec 31 23:59:59 n kernel: x", datetime(2027, 1, 1, 0, 0, 5, tzinfo=UTC))
    assert parsed is not None and parsed.ts.year == 2026


def test_plain_text_without_syslog_header_is_unchanged() -> None:
    line = f"[538441.007373] {XID}"
    (rec,) = decoded(line.encode(), key=b"gpu-node-12")
    assert (rec.node, rec.line, rec.shipper) == ("gpu-node-12", line, "plain")
    records, dead = decode_record(line.encode(), None, None, TOPIC)
    assert records == [] and len(dead) == 1


# -- CRI container log lines sent raw ------------------------------------------------------------------

NCCL = ("[rank40]:[E1121 23:11:05.123456 ProcessGroupNCCL.cpp:616] [Rank 40] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=2411, OpType=ALLREDUCE) ran for 600046 milliseconds before timing out.")


def test_raw_cri_line_keeps_the_node_from_the_key_not_the_stream_name() -> None:
    """A container log file's line as the kubelet's runtime writes it ("<RFC 3339 nano> stderr F <text>"), sent
    as is (rsyslog imfile or Vector on /var/log/containers): the stream name is no host and the flag no text."""
    value = f"2026-11-22T10:15:30.123456789Z stderr F {NCCL}".encode()
    (rec,) = decoded(value, key=b"gpu-node-13", topic="gpu.logs.pods")
    assert (rec.node, rec.line, rec.source) == ("gpu-node-13", NCCL, Source.POD)
    assert rec.ts == datetime(2026, 11, 22, 10, 15, 30, 123456, tzinfo=UTC)
    events = Detector().process(rec)
    assert [e.node for e in events] == ["gpu-node-13"]


def test_raw_cri_line_on_the_kernel_topic_is_still_a_pod_line() -> None:
    """A pod that prints dmesg output: the runtime's CRI header says the text is the workload's, not the kernel's."""
    value = f"2026-11-22T10:15:30.5Z stdout F {XID}".encode()
    (rec,) = decoded(value, key=b"gpu-node-15", topic=TOPIC)
    assert (rec.node, rec.line, rec.source) == ("gpu-node-15", XID, Source.POD)
    assert [e for e in Detector().process(rec) if e.kind.value in ("xid", "gpu_fallen_off_bus")] == []


def test_raw_cri_partial_lines_are_joined_and_need_a_node() -> None:
    value = (f"2026-11-22T10:15:30.1Z stdout P {NCCL[:40]}\n2026-11-22T10:15:30.1Z stdout F {NCCL[40:]}\n"
             "2026-11-22T10:15:31Z stdout F \n").encode()
    (rec,) = decoded(value, key=b"gpu-node-14", topic="gpu.logs.pods")
    assert (rec.node, rec.line) == ("gpu-node-14", NCCL)
    records, dead = decode_record(value, None, None, "gpu.logs.pods")
    assert records == [] and len(dead) == 1 and "stdout" not in str(dead[0].reason)


# -- kmsg replays -------------------------------------------------------------------------------------


def test_replayed_kmsg_line_with_shifted_time_gives_the_same_event_id() -> None:
    first = {"priority": 3, "sequence": 1841, "sec": 538441, "usec": 7373, "msg": XID, "node": "gpu-node-13",
             "boot_id": "6f1c", "@timestamp": "2026-11-22T10:15:30.007373Z"}
    replay = {**first, "@timestamp": "2026-11-22T10:15:31.007373Z"}  # in_kmsg's coarse boot time moved
    a, b = decoded(orjson.dumps(first))[0], decoded(orjson.dumps(replay))[0]
    assert a.ts != b.ts and a.replay_key == b.replay_key == "kmsg:6f1c:1841:538441.007373"
    ev_a, ev_b = Detector().process(a), Detector().process(b)
    assert ev_a and [e.id for e in ev_a] == [e.id for e in ev_b]
    # Another boot (same sequence number and text) is another event.
    other_boot = decoded(orjson.dumps({**first, "boot_id": "9a2e"}))[0]
    assert Detector().process(other_boot)[0].id != ev_a[0].id


def test_kmsg_replay_key_needs_the_kernel_fields() -> None:
    assert kmsg_replay_key({"sequence": 1, "sec": 2, "usec": 3}) == "kmsg:-:1:2.000003"
    assert kmsg_replay_key({"sequence": "1", "sec": 2, "usec": 3}) is None
    assert kmsg_replay_key({"msg": "x"}) is None
