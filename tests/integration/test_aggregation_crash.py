"""The aggregation loses no incident when its worker is killed or restarted at an awkward moment.

A burst of fatal kernel lines, one per node, goes in while the worker (a static group member, as in a
Deployment: the restarted process keeps its instance id) is SIGKILLed or SIGTERMed at several points
of the stream and restarted. Every node must end with at least one incident for its fault
(at-least-once: an incident re-sent with the same id is allowed, none may be missing), whatever the
moment of the kill. No timing is asserted: the waits are generous bounds, not measurements.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pipeline.app import worker_topics
from pipeline.kafka.admin import ensure_topics
from pipeline.runtime.settings import TopicNames
from tests.integration.test_pipeline import REPO, T0, XID, Pipeline, Worker, kmsg, wait_ready

pytestmark = pytest.mark.integration

X79 = XID.format(bus="4e", code=79, text="GPU has fallen off the bus.")
PARTITIONS = 8  # as deployed: most partitions of a fresh topic have no committed offset when the burst comes
NODES_PER_ROUND = 100
# Into each round's burst (the worker was restarted just before it): during its start-up, before,
# during and after most of the burst is processed; None: the burst comes while the worker is down,
# so its records wait for the restarted worker's first fetch.
KILL_AFTER_S = (0.05, 0.3, None, 1.0, 2.5)


class Worker8(Worker):
    """The test worker with this module's partition count (the node-state table follows the topics)."""

    def start(self) -> Worker8:
        log = self.log_path.open("ab")
        args = ["worker", "--bootstrap", self.bootstrap, "--app-id", self.app_id, "--partitions", str(PARTITIONS),
                "--session-timeout", "6", "--loglevel", os.environ.get("XIDFLOW_TEST_WORKER_LOGLEVEL", "info")]
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, env=self.env,
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        return self


def incident_nodes(pipe: Pipeline) -> set[str]:
    return {i["node"] for i in pipe.seen["incidents"] if i.get("type") == "incident" and i.get("code") == 79}


async def burst(pipe: Pipeline, nodes: list[str]) -> None:
    """Hand every node's line to the producer at once (a burst), then wait until the broker has them."""
    assert pipe.producer is not None
    topic = pipe.topics.name("logs_kernel")
    futures = [await pipe.producer.send(topic, kmsg(n, X79, T0 + i), key=n.encode()) for i, n in enumerate(nodes)]
    await asyncio.gather(*futures)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
async def test_worker_stopped_mid_burst_loses_no_incident(
    kafka_bootstrap: str, tmp_path: Path, sig: signal.Signals
) -> None:
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"t-aggcrash-{tag}-", f"t-aggcrash-{tag}"
    env = {"XIDFLOW_GROUP_INSTANCE_ID": f"worker-{tag}"}
    await ensure_topics(kafka_bootstrap, worker_topics(app_id, TopicNames(prefix=prefix)), PARTITIONS)
    sent: list[str] = []
    async with Pipeline(kafka_bootstrap, prefix) as pipe:
        worker = Worker8(kafka_bootstrap, app_id, prefix, tmp_path, extra_env=env).start()
        try:
            await wait_ready(pipe, worker, within_s=180)
            for r, delay in enumerate(KILL_AFTER_S):
                nodes = [f"n-{tag}-{r}-{i:03d}" for i in range(NODES_PER_ROUND)]
                sent += nodes
                if delay is not None:
                    sending = asyncio.ensure_future(burst(pipe, nodes))
                    await asyncio.sleep(delay)
                assert worker.proc is not None and worker.alive(), worker.log_tail()
                worker.proc.send_signal(sig)
                await asyncio.to_thread(worker.proc.wait, 60)
                await (sending if delay is not None else burst(pipe, nodes))
                worker = Worker8(kafka_bootstrap, app_id, prefix, tmp_path, extra_env=env).start()
            deadline = time.monotonic() + 300
            while not set(sent) <= incident_nodes(pipe):
                if time.monotonic() > deadline:
                    break
                assert worker.alive(), worker.log_tail()
                await pipe.poll()
            missing = sorted(set(sent) - incident_nodes(pipe))
            faults = {n: [e["_at"] for e in pipe.seen["fault_events"] if e.get("node") == n] for n in missing}
            assert not missing, f"no incident for {len(missing)} of {len(sent)} nodes; their fault events: {faults}"
            assert worker.alive(), worker.log_tail()
        finally:
            worker.stop()
