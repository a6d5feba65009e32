"""The three-line fallen-off-the-bus message split by time and a worker SIGKILL, on the real broker.

The first two lines (which name the GPU) reach the worker, wait past the multi-line timeout and go out as
their event; the worker is SIGKILLed; the last line arrives while it is dead and alone after its restart (it
names no GPU). One fault: one incident, as an operator counts it (one Event, one flow on the node).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from pipeline.app import worker_topics
from pipeline.kafka.admin import ensure_topics
from pipeline.runtime.settings import TopicNames
from tests.integration.test_pipeline import PARTITIONS, Pipeline, Worker, wait_ready

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

OFF_THE_BUS = (
    "NVRM: The NVIDIA GPU 0000:3b:00.0",
    "NVRM: (PCI ID: 10de:2330) installed in this system has",
    "NVRM: fallen off the bus and is not responding to commands.",
)


async def test_last_line_after_a_worker_restart_joins_the_incident_of_the_first_lines(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:6]
    prefix, app_id = f"t-split-{tag}.", f"t-split-{tag}"
    await ensure_topics(kafka_bootstrap, worker_topics(app_id, TopicNames(prefix=prefix)), PARTITIONS)
    env = {"XIDFLOW_GROUP_INSTANCE_ID": f"w-{tag}", "XIDFLOW_METRICS_PORT": "0"}
    worker = Worker(kafka_bootstrap, app_id, prefix, tmp_path, extra_env=env).start()
    node = f"split-{tag}"
    try:
        async with Pipeline(kafka_bootstrap, prefix) as pipe:
            await wait_ready(pipe, worker, within_s=180)
            now = time.time()
            for i, line in enumerate(OFF_THE_BUS[:2]):
                await pipe.kernel(node, line, now + i * 0.001)
            # The first lines go out on their own once the multi-line timeout has passed.
            await pipe.wait_for(lambda: bool(pipe.incidents(node)), 120, "the first lines' incident")
            worker.kill()
            await pipe.kernel(node, OFF_THE_BUS[2], now + 0.002)
            worker = Worker(kafka_bootstrap, app_id, prefix, tmp_path, extra_env=env).start()
            # A fault of another signature after it: once its incident is out, the last line was handled.
            await pipe.sentinel(node, now + 1, within_s=180)
            lost = [i for i in pipe.rule_incidents(node)]
            assert len({i["incident_id"] for i in lost}) == 1, lost
            assert not [d for d in pipe.seen["deadletter"] if node in str(d)]
    finally:
        worker.stop()
