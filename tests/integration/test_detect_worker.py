"""Detection through a real ``xidflow worker`` process on the real broker (issue 11, points 1 and 2).

- The operator's catalog overrides (``XIDFLOW_CATALOG_OVERRIDES``) reach the stages the worker runs:
  what lands on ``gpu.node.incidents`` follows the override, not the built-in catalog.
- NVIDIA's three-line "fallen off the bus" printk arriving as ONE record -- with ``/dev/kmsg``'s
  literal ``\\x0a`` (Fluent Bit kmsg input, raw kmsg text), real newlines (journald) or rsyslog's
  ``#012`` -- is one incident, in every shipper shape the adapters accept.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from pipeline.app import worker_topics
from pipeline.kafka.admin import ensure_topics
from pipeline.runtime.settings import TopicNames
from tests.integration.test_pipeline import PARTITIONS, XID, Pipeline, Worker, wait_ready

pytestmark = pytest.mark.integration

OVERRIDES = """
xid:
  31: {action: REBOOT_NODE, severity: critical, note: "this fleet: Xid 31 has always been a bad board"}
defaults:
  unknown_xid: {action: CONTACT_SUPPORT, severity: error}
"""

# The driver's message (open-gpu-kernel-modules, nv-pci.c) as /dev/kmsg shows it: one record, \x0a inside.
FALLEN_KMSG = (
    r"NVRM: The NVIDIA GPU 0000:b3:00.0\x0aNVRM: (PCI ID: 10de:2330) installed in this system has\x0a"
    r"NVRM: fallen off the bus and is not responding to commands."
)
FALLEN_NEWLINES = FALLEN_KMSG.replace(r"\x0a", "\n")
FALLEN_RSYSLOG = FALLEN_KMSG.replace(r"\x0a", "#012")


@pytest.fixture(scope="module")
def override_worker(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"t-det-{tag}-", f"t-det-{tag}"
    asyncio.run(ensure_topics(kafka_bootstrap, worker_topics(app_id, TopicNames(prefix=prefix)), PARTITIONS))
    work = tmp_path_factory.mktemp("detect-worker")
    overrides = Path(work) / "catalog-overrides.yaml"
    overrides.write_text(OVERRIDES, encoding="utf-8")
    worker = Worker(
        kafka_bootstrap, app_id, prefix, work, extra_env={"XIDFLOW_CATALOG_OVERRIDES": str(overrides)}
    ).start()

    async def ready() -> None:
        async with Pipeline(kafka_bootstrap, prefix) as pipe:
            await wait_ready(pipe, worker)

    try:
        asyncio.run(ready())
        yield kafka_bootstrap, prefix
        assert worker.alive(), f"the worker died during the tests:\n{worker.log_tail()}"
    finally:
        worker.stop()


def node_name(label: str) -> str:
    return f"d-{label}-{uuid.uuid4().hex[:6]}"


async def test_catalog_overrides_change_what_lands_on_the_incident_topic(override_worker: tuple[str, str]) -> None:
    bootstrap, prefix = override_worker
    xid31, unknown = node_name("xid31"), node_name("unknown")
    now = time.time()
    async with Pipeline(bootstrap, prefix) as pipe:
        # Built in, Xid 31 is RESTART_APP (no quarantine) and an unknown code is ALERT (no quarantine).
        await pipe.kernel(xid31, XID.format(bus="4e", code=31, text="Ch 0000000b, intr 10000000. MMU Fault"), now)
        await pipe.kernel(unknown, XID.format(bus="4e", code=250, text="a code from a newer driver"), now)
        await pipe.wait_for(lambda: bool(pipe.incidents(xid31)) and bool(pipe.incidents(unknown)), 60, "incidents")

        def events() -> list[dict]:
            return [e for e in pipe.seen["fault_events"] if e.get("node") in (xid31, unknown)]

        # Each topic has its own reader: an incident can be read before the fault event that led to it.
        await pipe.wait_for(lambda: len(events()) >= 2, 30, "both fault events")
        [first] = pipe.incidents(xid31)
        [second] = pipe.incidents(unknown)
        seen_events = events()
    assert (first["code"], first["action"], first["quarantine"]) == (31, "REBOOT_NODE", True)
    assert (second["code"], second["action"], second["quarantine"]) == (250, "CONTACT_SUPPORT", True)
    # The parse stage classified with the override too (the fault events carry the action it gave).
    assert {e["code"]: e["action"] for e in seen_events} == {31: "REBOOT_NODE", 250: "CONTACT_SUPPORT"}


async def test_multiline_fallen_off_bus_in_one_record_is_one_incident_in_every_shipper_shape(
    override_worker: tuple[str, str],
) -> None:
    bootstrap, prefix = override_worker
    now = time.time()
    shapes = {
        "fluentbit-kmsg": ("logs_kernel", lambda n: orjson.dumps(
            {"priority": 4, "sequence": 812, "sec": 5, "usec": 0, "msg": FALLEN_KMSG, "hostname": n,
             "@timestamp": now})),
        "raw-kmsg-text": ("logs_kernel", lambda n: ("4,812,5000000,-;" + FALLEN_KMSG).encode()),
        "journald": ("logs_kernel", lambda n: orjson.dumps(
            {"MESSAGE": FALLEN_NEWLINES, "_HOSTNAME": n, "_TRANSPORT": "kernel",
             "__REALTIME_TIMESTAMP": str(int(now * 1e6))})),
        "loki-push": ("logs_kernel", lambda n: orjson.dumps(
            {"streams": [{"stream": {"node": n, "source": "kernel"},
                          "values": [[str(int(now * 1e9)), FALLEN_KMSG]]}]})),
        "rsyslog-text": ("logs_kernel", lambda n: f"Nov 22 10:00:00 {n} kernel: {FALLEN_RSYSLOG}".encode()),
    }
    nodes = {shape: node_name(shape) for shape in shapes}
    async with Pipeline(bootstrap, prefix) as pipe:
        for shape, (topic, build) in shapes.items():
            await pipe.raw(topic, build(nodes[shape]), nodes[shape].encode())
        await pipe.wait_for(lambda: all(pipe.incidents(n) for n in nodes.values()), 60, "one incident per shape")
        results = {shape: pipe.incidents(node) for shape, node in nodes.items()}
        dead = [d for d in pipe.seen["deadletter"] if any(n in str(d) for n in nodes.values())]
    for shape, incidents in results.items():
        assert len(incidents) == 1, (shape, incidents)
        incident = incidents[0]
        assert incident["kind"] == "gpu_fallen_off_bus", (shape, incident)
        assert (incident["pci"], incident["code"], incident["action"]) == ("0000:b3:00.0", 79, "REBOOT_NODE"), shape
    assert dead == []


# Issue 36 through a real worker: a MIG instance's Xid, a driver line re-logged under dmesg -x's user facility (as
# plain text, node from the key) and the CUDA error every rank prints when the GPU is gone (lines of
# tests/corpus/: kernel_corpus 'mig-*', 'dmesg-decode-*'; pod_corpus 'cuda-devices-busy-or-unavailable-46').
MIG_XID48 = ("NVRM: Xid (PCI:0000:3b:00 GPU-I:05 GPU-CI:00): 48, pid=2113, name=python3, An uncorrectable double "
             "bit error (DBE) has been detected on GPU in the framebuffer at partition 1, subpartition 0.")
RELOGGED_XID62 = ("user  :err   : [ 1331.000000] NVRM: Xid (PCI:0000:06:00): 62, pid='<unknown>', name=<unknown>, "
                  "0000(0000) 00000000 00000000")
GPU_GONE = "RuntimeError: CUDA error: all CUDA-capable devices are busy or unavailable"


async def test_mig_instances_relogged_driver_lines_and_a_jobs_cuda_errors_through_the_worker(
    override_worker: tuple[str, str],
) -> None:
    bootstrap, prefix = override_worker
    node, now = node_name("i36"), time.time()
    async with Pipeline(bootstrap, prefix) as pipe:

        def events(kind: str) -> list[dict]:
            return [e for e in pipe.seen["fault_events"] if e.get("node") == node and e.get("kind") == kind]

        # The job's error first: held by the aggregation until kernel evidence of the node arrives.
        await pipe.pod(node, GPU_GONE, now)
        await pipe.wait_for(lambda: events("pod_error"), 60, "the pod line as a fault event")
        [pod] = events("pod_error")
        assert (pod["grade"], pod["name"], pod["action"]) == ("sympathetic", "cuda_devices_unavailable", "IGNORE")
        assert (pod["detail"]["cuda_error"], pod["detail"]["cuda_error_code"]) == ("cudaErrorDevicesUnavailable", 46)
        await pipe.kernel(node, MIG_XID48, now + 1)
        await pipe.raw("logs_kernel", RELOGGED_XID62.encode(), node.encode())
        await pipe.wait_for(lambda: len(pipe.incidents(node)) >= 2, 60, "two incidents")
        by_code = {i["code"]: i for i in pipe.incidents(node)}
    assert set(by_code) == {48, 62}, pipe.incidents(node)
    mig = by_code[48]
    assert (mig["gpu_instance"], mig["compute_instance"], mig["pci"], mig["action"]) == (
        5, 0, "0000:3b:00.0", "RESET_GPU")
    assert mig["signature"] == "xid:48:0000:3b:00.0/gi5"
    # The job's error corroborates the first kernel evidence of the node; alone it opened nothing.
    assert pod["id"] in mig["evidence_ids"] and "pod_error:sympathetic:cuda_devices_unavailable" in mig["signatures"]
    relogged = by_code[62]
    assert (relogged["pci"], relogged["action"], relogged["gpu_instance"]) == ("0000:06:00.0", "RESET_GPU", None)
