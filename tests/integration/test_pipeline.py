"""The streaming pipeline end to end on the real broker: raw lines in, incidents out.

One real ``xidflow worker`` process (parse service + aggregation agent) serves all rule tests of this
module; each test uses its own node names, so they do not see each other's state. Per-node order is
what makes the checks exact: after the lines under test, a "sentinel" fault on the same node is
sent, and once its incident is out, everything before it on that node has been processed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from pipeline.app import worker_topics
from pipeline.kafka.admin import ensure_topics
from pipeline.localinfra import procs
from pipeline.localinfra.procs import free_port
from pipeline.runtime.settings import TopicNames
from schemas.records import HealthCheckResult

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 4
T0 = 1_750_000_000.0  # log time of the lines (epoch s); windows are on log time

XID = "NVRM: Xid (PCI:0000:{bus}:00): {code}, pid=1234, name=python3, {text}"
SENTINEL = "NVRM: Xid (PCI:0000:{bus:02x}:00): 62, pid=1, name=x, Internal micro-controller halt"
SENTINEL_BUSES = range(0xE0, 0x100)  # each sentinel of a node on its own GPU: a new signature each time
METRICS_PORT = free_port()
WORKER_ENV = {
    "XIDFLOW_WORKER_TICK_INTERVAL_S": "1",
    "XIDFLOW_AGG_QUIET_PERIOD_S": "3",
    "XIDFLOW_AGG_SUMMARY_INTERVAL_S": "0",
    "XIDFLOW_PARSE_POLL_TIMEOUT_MS": "20",
}


def kmsg(node: str, line: str, at: float, boot_id: str | None = None) -> bytes:
    record: dict[str, Any] = {"priority": 3, "sec": 5, "usec": 0, "msg": line, "hostname": node, "@timestamp": at}
    if boot_id:
        record["boot_id"] = boot_id
    return orjson.dumps(record)


class Worker:
    """A real worker process (``python -m pipeline.cli worker``)."""

    def __init__(self, bootstrap: str, app_id: str, prefix: str, log_dir: Path, extra_env: dict | None = None):
        self.bootstrap, self.app_id, self.prefix = bootstrap, app_id, prefix
        self.log_path = log_dir / f"{app_id}-{uuid.uuid4().hex[:4]}.log"
        self.env = {**os.environ, **WORKER_ENV, **(extra_env or {}), "XIDFLOW_TOPIC_PREFIX": prefix}
        self.proc: subprocess.Popen | None = None

    def start(self) -> Worker:
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pipeline.cli",
                "worker",
                "--bootstrap",
                self.bootstrap,
                "--app-id",
                self.app_id,
                "--partitions",
                str(PARTITIONS),
                "--session-timeout",
                "6",
                "--loglevel",
                os.environ.get("XIDFLOW_TEST_WORKER_LOGLEVEL", "warning"),
            ],
            cwd=REPO,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        procs.terminate(self.proc)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""


class Pipeline:
    """Produce raw lines and read incidents / dead letters for one topic prefix."""

    def __init__(self, bootstrap: str, prefix: str) -> None:
        self.bootstrap = bootstrap
        self.topics = TopicNames(prefix=prefix)
        self.producer: AIOKafkaProducer | None = None
        self.readers: dict[str, AIOKafkaConsumer] = {}
        self.seen: dict[str, list[dict]] = {"incidents": [], "deadletter": [], "fault_events": []}
        self.sentinels: dict[str, int] = {}
        self.headers: dict[tuple[str, int, int], dict[str, bytes]] = {}
        """Each record's Kafka headers, by (topic field, partition, offset)."""

    async def __aenter__(self) -> Pipeline:
        self.producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, acks="all", linger_ms=1)
        await self.producer.start()
        for field in self.seen:
            reader = AIOKafkaConsumer(
                self.topics.name(field), bootstrap_servers=self.bootstrap, auto_offset_reset="earliest", group_id=None
            )
            await reader.start()
            self.readers[field] = reader
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.producer is not None
        await self.producer.stop()
        for reader in self.readers.values():
            await reader.stop()

    async def kernel(self, node: str, line: str, at: float, boot_id: str | None = None) -> None:
        assert self.producer is not None
        await self.producer.send_and_wait(
            self.topics.name("logs_kernel"), kmsg(node, line, at, boot_id), key=node.encode()
        )

    async def raw(self, topic_field: str, value: bytes, key: bytes | None) -> None:
        assert self.producer is not None
        await self.producer.send_and_wait(self.topics.name(topic_field), value, key=key)

    async def pod(self, node: str, line: str, at: float) -> None:
        record = {
            "log": line,
            "time": at,
            "kubernetes": {"host": node, "pod_name": "trainer-0", "namespace_name": "ml", "container_name": "main"},
        }
        await self.raw("logs_pods", orjson.dumps(record), node.encode())

    async def health(self, node: str, check: str, passed: bool, boot_id: str) -> None:
        result = HealthCheckResult(node=node, check=check, passed=passed, boot_id=boot_id)
        await self.raw("health_checks", result.to_bytes(), node.encode())

    async def poll(self) -> None:
        for field, reader in self.readers.items():
            for records in (await reader.getmany(timeout_ms=100)).values():
                self.seen[field] += [{**_json_or_raw(r.value), "_at": (r.partition, r.offset)} for r in records]
                self.headers.update({(field, r.partition, r.offset): dict(r.headers or ()) for r in records})

    def incidents(self, node: str) -> list[dict]:
        return [r for r in self.seen["incidents"] if r.get("node") == node]

    async def wait_for(self, what: Any, within_s: float = 60.0, message: str = "") -> None:
        deadline = time.monotonic() + within_s
        while not what():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {within_s:.0f}s waiting for {message or what}")
            await self.poll()

    async def sentinel(self, node: str, at: float, within_s: float = 60.0) -> None:
        """Send a fault of a new signature and wait for it: all earlier lines of the node are done."""
        bus = SENTINEL_BUSES[self.sentinels.get(node, 0)]
        self.sentinels[node] = self.sentinels.get(node, 0) + 1
        await self.kernel(node, SENTINEL.format(bus=bus), at)
        pci = f"0000:{bus:02x}:00.0"
        await self.wait_for(
            lambda: any(i.get("pci") == pci for i in self.incidents(node)), within_s, f"sentinel of {node}"
        )

    def rule_incidents(self, node: str) -> list[dict]:
        return [i for i in self.incidents(node) if i.get("type") == "incident" and not _is_sentinel(i.get("pci"))]


def storm_accounted(pipe: Pipeline, node: str) -> int:
    """Lines of ``node`` parsed (its fault events) plus those its node_over_budget dead letters name."""
    parsed = sum(1 for e in pipe.seen["fault_events"] if e.get("node") == node)
    skipped = sum(int(d["reason"].split(": ", 1)[1].split(" records", 1)[0]) for d in pipe.seen["deadletter"]
                  if d.get("key") == node and d.get("code") == "node_over_budget")
    return parsed + skipped


def _json_or_raw(value: bytes | None) -> dict:
    try:
        decoded = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        return {"raw": value}  # the dead-letter test writes garbage to the fault-event topic on purpose
    return decoded if isinstance(decoded, dict) else {"raw": value}


def _is_sentinel(pci: str | None) -> bool:
    return bool(pci) and int(pci.split(":")[1], 16) in SENTINEL_BUSES


async def wait_ready(pipe: Pipeline, worker: Worker, within_s: float = 120.0) -> None:
    """The worker is ready when a fault line comes out as an incident."""
    node = f"warmup-{uuid.uuid4().hex[:6]}"
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not worker.alive():
            raise AssertionError(f"worker exited:\n{worker.log_tail()}")
        await pipe.kernel(node, XID.format(bus="4e", code=79, text="GPU has fallen off the bus."), time.time())
        try:
            await pipe.wait_for(lambda: bool(pipe.incidents(node)), 5.0)
            return
        except AssertionError:
            continue
    raise AssertionError(f"worker not ready after {within_s:.0f}s:\n{worker.log_tail()}")


@pytest.fixture(scope="module")
def shared_worker(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"t-pipe-{tag}-", f"t-pipe-{tag}"
    asyncio.run(ensure_topics(kafka_bootstrap, worker_topics(app_id, TopicNames(prefix=prefix)), PARTITIONS))
    worker = Worker(kafka_bootstrap, app_id, prefix, tmp_path_factory.mktemp("workers"),
                    extra_env={"XIDFLOW_METRICS_PORT": str(METRICS_PORT)}).start()

    async def ready() -> None:
        async with Pipeline(kafka_bootstrap, prefix) as pipe:
            await wait_ready(pipe, worker)

    try:
        asyncio.run(ready())
        yield kafka_bootstrap, prefix
        assert worker.alive(), f"the worker died during the tests:\n{worker.log_tail()}"
    finally:
        worker.stop()


def healthz(port: int) -> int:
    """The status code of the worker's /healthz (200 live, 503 stalled)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def node_name(label: str) -> str:
    return f"n-{label}-{uuid.uuid4().hex[:6]}"


# -- the rules, end to end -------------------------------------------------------------------------


async def test_first_fault_opens_at_once_and_a_storm_is_one_incident(shared_worker: tuple[str, str]) -> None:
    bootstrap, prefix = shared_worker
    node = node_name("storm")
    async with Pipeline(bootstrap, prefix) as pipe:
        line = XID.format(bus="4e", code=95, text="Uncontained ECC error")
        await pipe.kernel(node, line, T0)
        await pipe.wait_for(lambda: bool(pipe.incidents(node)), 30, "first incident")
        assert pipe.producer is not None
        futures = [
            await pipe.producer.send(
                pipe.topics.name("logs_kernel"), kmsg(node, line, T0 + i * 0.01), key=node.encode()
            )
            for i in range(1, 2000)
        ]
        await asyncio.gather(*futures)
        # The storm's lines past the node's bytes in a batch (XIDFLOW_PARSE_MAX_KEY_BYTES_PER_BATCH) are dead
        # letters, not faults (issue 37): once every line is one or the other, the sentinel comes after them all
        # (sent with them, it would share their batch and their fate).
        await pipe.wait_for(lambda: storm_accounted(pipe, node) >= 2000, 60, "every storm line parsed or dead-lettered")
        await pipe.sentinel(node, T0 + 30)
        incidents = pipe.rule_incidents(node)
    assert len(incidents) == 1, incidents
    assert incidents[0]["code"] == 95 and incidents[0]["action"] == "RESET_GPU" and incidents[0]["revision"] == 0


async def test_repeats_that_point_to_hardware_escalate_the_same_incident(shared_worker: tuple[str, str]) -> None:
    bootstrap, prefix = shared_worker
    node = node_name("xid13")
    line = XID.format(bus="4e", code=13, text="Graphics SM Warp Exception on (GPC 3, TPC 1, SM 0): Out Of Range")
    async with Pipeline(bootstrap, prefix) as pipe:
        for burst in range(3):  # bursts 2 minutes apart (log time): repeats, not one storm
            await pipe.kernel(node, line, T0 + burst * 120)
        await pipe.sentinel(node, T0 + 400)
        incidents = pipe.rule_incidents(node)
    assert [(i["revision"], i["action"]) for i in incidents] == [(0, "RESTART_APP"), (1, "RESET_GPU")]
    assert len({i["incident_id"] for i in incidents}) == 1
    assert "GPC 3 TPC 1" in incidents[1]["escalation_reason"]


async def test_sympathetic_pod_errors_alone_open_nothing_and_corroborate_kernel_evidence(
    shared_worker: tuple[str, str],
) -> None:
    bootstrap, prefix = shared_worker
    alone, backed = node_name("nccl-alone"), node_name("nccl-backed")
    nccl = "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE) ran for 600000"
    async with Pipeline(bootstrap, prefix) as pipe:
        for node in (alone, backed):
            for i in range(5):
                await pipe.pod(node, nccl, T0 + i)
        # Pod and kernel lines travel on different topics: wait until the pod errors are fault
        # events, so that the node's fault-event partition has them before the kernel line.
        await pipe.wait_for(
            lambda: len([e for e in pipe.seen["fault_events"] if e.get("node") == backed]) == 5, 30, "pod events"
        )
        await pipe.kernel(backed, XID.format(bus="4e", code=79, text="GPU has fallen off the bus."), T0 + 10)
        await pipe.sentinel(alone, T0 + 20)
        await pipe.sentinel(backed, T0 + 20)
        assert pipe.rule_incidents(alone) == []
        [incident] = pipe.rule_incidents(backed)
    assert incident["code"] == 79 and len(incident["evidence_ids"]) == 6
    assert any(sig.startswith("pod_error:sympathetic") for sig in incident["signatures"])


async def test_xid45_alone_is_noise_and_follows_other_xids(shared_worker: tuple[str, str]) -> None:
    bootstrap, prefix = shared_worker
    node = node_name("xid45")
    x45 = XID.format(bus="4e", code=45, text="Ch 00000010, errorString CTX SWITCH TIMEOUT, Info 0x3c046")
    async with Pipeline(bootstrap, prefix) as pipe:
        await pipe.kernel(node, x45, T0)
        await pipe.sentinel(node, T0 + 1)
        # The sentinel Xid 62 is on another GPU, but it is the node's only Xid: the 45 follows it.
        assert pipe.rule_incidents(node) == []
        await pipe.kernel(node, XID.format(bus="4e", code=48, text="An uncorrectable double bit error"), T0 + 2)
        await pipe.kernel(node, x45, T0 + 3)
        await pipe.sentinel(node, T0 + 4)
        incidents = pipe.rule_incidents(node)
    assert [i["code"] for i in incidents] == [48]


async def test_fallen_off_bus_and_xid79_within_five_minutes_are_one_incident(shared_worker: tuple[str, str]) -> None:
    bootstrap, prefix = shared_worker
    node = node_name("fob")
    async with Pipeline(bootstrap, prefix) as pipe:
        for line in (
            "NVRM: The NVIDIA GPU 0000:4e:00.0",
            "NVRM: (PCI ID: 10de:2330) installed in this system has",
            "NVRM: fallen off the bus and is not responding to commands.",
        ):
            await pipe.kernel(node, line, T0)
        await pipe.kernel(node, XID.format(bus="4e", code=79, text="GPU has fallen off the bus."), T0 + 200)
        await pipe.sentinel(node, T0 + 210)
        incidents = pipe.rule_incidents(node)
    assert len(incidents) == 1, incidents
    assert incidents[0]["action"] == "REBOOT_NODE"


async def test_recovery_after_reboot_with_passing_checks_and_after_a_quiet_period(
    shared_worker: tuple[str, str],
) -> None:
    bootstrap, prefix = shared_worker
    node = node_name("recover")
    async with Pipeline(bootstrap, prefix) as pipe:
        await pipe.kernel(node, XID.format(bus="4e", code=79, text="GPU has fallen off the bus."), T0, "boot-a")
        await pipe.kernel(node, XID.format(bus="4f", code=31, text="Ch 00000008, MMU Fault"), T0 + 1, "boot-a")
        await pipe.wait_for(lambda: len(pipe.incidents(node)) == 2, 30, "two incidents")
        by_code = {i["code"]: i["incident_id"] for i in pipe.incidents(node)}
        # The transient Xid 31 closes after the (test-configured) 3 s quiet period.
        await pipe.wait_for(
            lambda: any(r.get("type") == "recovered" and r["incident_id"] == by_code[31] for r in pipe.incidents(node)),
            30,
            "quiet recovery",
        )
        await pipe.health(node, "gpu_count", True, "boot-b")
        await pipe.wait_for(
            lambda: any(r.get("type") == "recovered" and r["incident_id"] == by_code[79] for r in pipe.incidents(node)),
            30,
            "reboot recovery",
        )
        reasons = {r["incident_id"]: r["reason"] for r in pipe.incidents(node) if r.get("type") == "recovered"}
    assert reasons == {by_code[31]: "quiet", by_code[79]: "reboot"}


async def test_a_later_code_that_cancels_closes_the_incident_with_its_evidence_and_cloudevents_headers(
    shared_worker: tuple[str, str],
) -> None:
    bootstrap, prefix = shared_worker
    node = node_name("cancel")
    async with Pipeline(bootstrap, prefix) as pipe:
        # NVIDIA's catalog: power smoothing disengaged (163), then re-engaged (162) on the same GPU.
        await pipe.kernel(node, XID.format(bus="4e", code=163, text="Power Smoothing HW Circuitry disengaged"), T0)
        await pipe.kernel(node, XID.format(bus="4e", code=162, text="Power Smoothing HW Circuitry reengaged"), T0 + 1)
        await pipe.wait_for(lambda: any(r.get("type") == "recovered" for r in pipe.incidents(node)), 30, "cancel")
        records = pipe.incidents(node)
        events = [e for e in pipe.seen["fault_events"] if e.get("node") == node and e.get("code") == 162]
    (opened,) = [r for r in records if r.get("type") == "incident"]  # 162 opened nothing of its own
    (closed,) = [r for r in records if r.get("type") == "recovered"]
    assert opened["code"] == 163 and closed["incident_id"] == opened["incident_id"]
    assert closed["reason"] == "cancelled" and closed["cancelled_by"] == "xid:162:0000:4e:00.0"
    assert closed["evidence_ids"] == [events[0]["id"]] and "PSHC_REENGAGED" in closed["detail"]
    for record, kind, event_id in ((opened, "incident", f"{opened['incident_id']}.0"),
                                   (closed, "recovered", f"{opened['incident_id']}.recovered")):
        headers = pipe.headers[("incidents", *record["_at"])]
        assert headers["ce_specversion"] == b"1.0" and headers["ce_type"] == f"dev.xidflow.{kind}.v1".encode()
        assert headers["ce_id"] == event_id.encode() and headers["ce_subject"] == node.encode()
        assert headers["ce_source"] == b"/xidflow/aggregation" and headers["content-type"] == b"application/json"


async def test_malformed_input_goes_to_the_dead_letter_topic_and_the_worker_lives(
    shared_worker: tuple[str, str],
) -> None:
    bootstrap, prefix = shared_worker
    node = node_name("dead")
    async with Pipeline(bootstrap, prefix) as pipe:
        await pipe.raw("logs_kernel", b'{"msg": "NVRM: Xid (PCI:0000:4e:00): 79, trunc', node.encode())
        await pipe.raw("logs_kernel", b"NVRM: Xid (PCI:0000:4e:00): 79, no node anywhere", None)
        await pipe.raw("health_checks", b'{"type": "health_check", "node": "x"}', node.encode())
        await pipe.raw("fault_events", b"not a fault event", node.encode())
        await pipe.sentinel(node, T0)
        await pipe.wait_for(
            lambda: len([d for d in pipe.seen["deadletter"] if d.get("key") in (node, None)]) >= 4, 30, "dead letters"
        )
        letters = [d for d in pipe.seen["deadletter"] if d.get("key") in (node, None)]
    reasons = " | ".join(d["reason"] for d in letters)
    assert "invalid JSON" in reasons and "without node" in reasons
    assert "HealthCheckResult" in reasons and "invalid fault event" in reasons
    assert {d["stage"] for d in letters} >= {"adapter", "parse", "aggregate"}


def test_worker_serves_the_contract_metrics(shared_worker: tuple[str, str]) -> None:
    """The worker's /metrics carries the dashboard's series, counting what it really processed."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}

    def total(name: str, **labels: str) -> float:
        return sum(v for (n, lab), v in samples.items()
                   if n == name and all(dict(lab).get(k) == val for k, val in labels.items()))

    assert total("xidflow_lines_total") > 0
    assert total("xidflow_fault_events_total", kind="xid") > 0
    assert total("xidflow_incidents_total", action="REBOOT_NODE") > 0
    assert total("xidflow_e2e_latency_seconds_count") > 0
    assert any(n == "xidflow_consumer_lag" for n, _ in samples)


async def test_an_oversized_line_is_cut_once_and_detection_goes_on(shared_worker: tuple[str, str]) -> None:
    """A 600 KB Xid line: its fault is still detected (line cut with a marker), its input is one dead
    letter, and another node's fault right after it is an incident within seconds."""
    bootstrap, prefix = shared_worker
    huge, other = node_name("huge"), node_name("after-huge")
    line = XID.format(bus="4e", code=79, text="GPU has fallen off the bus. " + "x" * 600_000)
    async with Pipeline(bootstrap, prefix) as pipe:
        await pipe.kernel(huge, line, T0)
        sent = time.monotonic()
        await pipe.kernel(other, XID.format(bus="4e", code=79, text="GPU has fallen off the bus."), T0)
        await pipe.wait_for(lambda: bool(pipe.incidents(other)), 30, "the other node's incident")
        took = time.monotonic() - sent
        await pipe.wait_for(lambda: bool(pipe.incidents(huge)), 30, "the oversized line's incident")
        await pipe.sentinel(huge, T0 + 1)
        await pipe.wait_for(
            lambda: any(d.get("key") == huge for d in pipe.seen["deadletter"]), 30, "the dead letter"
        )
        await asyncio.sleep(2)  # a duplicate letter would come right behind the first
        await pipe.poll()
        letters = [d for d in pipe.seen["deadletter"] if d.get("key") == huge]
        [incident] = [i for i in pipe.incidents(huge) if i.get("code") == 79]
    assert took < 30, took
    assert [d["code"] for d in letters] == ["truncated"], letters
    assert letters[0]["payload_truncated"] and len(letters[0]["payload"]) == 65536
    assert "characters truncated]" in incident["line"] and len(incident["line"]) < 20_000
    assert healthz(METRICS_PORT) == 200


async def test_one_record_yields_a_bounded_number_of_dead_letters(shared_worker: tuple[str, str]) -> None:
    """Newline-delimited JSON of 5000 bad lines: parsed up to 1000 lines (XIDFLOW_PARSE_MAX_LINES_PER_RECORD),
    10 dead letters (the last one summarises), no more."""
    bootstrap, prefix = shared_worker
    node = node_name("amplify")
    value = b"\n".join(b'{"oops": "NVRM: %d"}' % i for i in range(5000)) + b"\n{bad json"
    async with Pipeline(bootstrap, prefix) as pipe:
        await pipe.raw("logs_kernel", value, node.encode())
        await pipe.sentinel(node, T0)
        await pipe.wait_for(lambda: len([d for d in pipe.seen["deadletter"] if d.get("key") == node]) >= 10, 30)
        await asyncio.sleep(2)
        await pipe.poll()
        letters = [d for d in pipe.seen["deadletter"] if d.get("key") == node]
    assert len(letters) == 10, len(letters)
    assert letters[-1]["code"] == "more_problems"
    assert "992 more problems in this record (1 too_many_lines, 991 unknown_shape)" in letters[-1]["reason"]


async def test_a_held_multiline_start_does_not_hold_the_commit_once_the_input_is_quiet(
    shared_worker: tuple[str, str],
) -> None:
    """An NVRM line that might start a multi-line message holds its partition's commit, but only until
    the multi-line timeout: with no further input the commit still reaches the end, so a restart
    replays (and re-sends dead letters for) nothing that was settled."""
    from aiokafka.admin import AIOKafkaAdminClient

    bootstrap, prefix = shared_worker
    node = node_name("held")
    async with Pipeline(bootstrap, prefix) as pipe:
        await pipe.kernel(node, "NVRM: loading NVIDIA UNIX x86_64 Kernel Module", T0)
        await pipe.raw("logs_kernel", b'{"msg": "NVRM: broken', node.encode())
        assert pipe.producer is not None
        await pipe.producer.flush()
    topic = TopicNames(prefix=prefix).name("logs_kernel")
    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await reader.start()
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        from aiokafka import TopicPartition

        ends = await reader.end_offsets([TopicPartition(topic, p) for p in range(PARTITIONS)])
        deadline = time.monotonic() + 30
        while True:
            done = await admin.list_consumer_group_offsets(prefix.rstrip("-") + "-parse")
            lagging = {tp: end for tp, end in ends.items() if end and (tp not in done or done[tp].offset < end)}
            if not lagging:
                break
            assert time.monotonic() < deadline, f"commits still behind the input: {lagging} vs {done}"
            await asyncio.sleep(0.5)
    finally:
        await reader.stop()
        await admin.close()
