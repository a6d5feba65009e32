"""An outage is a few sentences, not a flood: the broker stopped for ~40 s under a running worker and actuator,
and the API server cut off for ~40 s under a running actuator.

Each process logs its lost dependency as state changes (``pipeline.runtime.reachability``): one line when it
becomes unreachable, one a minute while it stays so, one when it is back; the Kafka client's own retries
(aiokafka's and Faust's lines, one per attempt) go into that count instead of the log. Before this, the worker
wrote ~7,000 ERROR lines in a 42 s outage and each actuator ~3,000. The processes log at ``info`` here, the
chart's level, so every line a production log would get is counted.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from pipeline.actuator.app import actuator_topics
from pipeline.app import worker_topics
from pipeline.kafka.admin import ensure_topics
from pipeline.localinfra import procs
from pipeline.runtime.settings import TopicNames
from tests.integration.relay import Relay
from tests.integration.test_pipeline import PARTITIONS, Pipeline, Worker, wait_ready

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

OUTAGE_S = 40
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (?P<level>[A-Z]+) (?P<logger>[^:\s]+): ")


def count(text: str) -> collections.Counter[tuple[str, str]]:
    """Log lines by (level, logger)."""
    return collections.Counter((m["level"], m["logger"]) for m in map(LINE.match, text.splitlines()) if m)


class Actuator:
    """A real ``xidflow actuator`` process (no decision API) on the broker and the session's API server."""

    def __init__(self, bootstrap: str, kubeconfig: str, prefix: str, unique: Callable[[str], str], log: Path,
                 resync_s: float = 10) -> None:
        policy = log.with_suffix(".policy.yaml")
        policy.write_text("kind: RescuePolicy\nmetadata: {name: p}\nspec:\n  rules:\n"
                          "  - {priority: 1, codes: [79], actions: [{name: event}]}\n")
        self.log = log
        self.env = {
            **os.environ, "KUBECONFIG": kubeconfig, "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "XIDFLOW_TOPIC_PREFIX": prefix,
            "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": f"xidflow.test/fleet={unique('fleet')}",
            "XIDFLOW_ACTUATOR_NAMESPACE": unique("ns"), "XIDFLOW_ACTUATOR_GROUP_ID": unique("g"),
            "XIDFLOW_ACTUATOR_POLICY_SOURCE": "file", "XIDFLOW_ACTUATOR_POLICY_FILE": str(policy),
            "XIDFLOW_METRICS_PORT": "0", "XIDFLOW_HEALTH_PORT": "0", "XIDFLOW_ACTUATOR_RESYNC_SECONDS": str(resync_s),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Actuator:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "actuator", "--no-api",
                                          "--log-level", "info"], env=self.env, stdout=out, stderr=subprocess.STDOUT)
        return self

    def stop(self) -> None:
        procs.terminate(self.proc)


async def test_a_broker_outage_is_a_few_sentences_per_process(
    private_kafka: Callable[..., object], kubeconfig: str, unique: Callable[[str], str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = private_kafka(brokers=1)
    bootstrap = cluster.bootstrap  # type: ignore[attr-defined]
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"t-outage-{tag}-", f"t-outage-{tag}"
    topics = TopicNames(prefix=prefix)
    await ensure_topics(bootstrap, worker_topics(app_id, topics) + actuator_topics(topics), PARTITIONS)
    monkeypatch.setenv("XIDFLOW_TEST_WORKER_LOGLEVEL", "info")  # Worker.start reads it
    worker = Worker(bootstrap, app_id, prefix, tmp_path)
    actuator = Actuator(bootstrap, kubeconfig, prefix, unique, tmp_path / "actuator.log")
    worker.start()
    actuator.start()
    try:
        async with Pipeline(bootstrap, prefix) as pipe:
            await wait_ready(pipe, worker)
        await asyncio.sleep(5)  # the actuator's group settles too
        before = {"worker": worker.log_path.stat().st_size, "actuator": actuator.log.stat().st_size}
        await asyncio.to_thread(cluster.stop_broker, 1)  # type: ignore[attr-defined]
        stopped = time.monotonic()
        await asyncio.sleep(OUTAGE_S)
        await asyncio.to_thread(cluster.start_broker, 1)  # type: ignore[attr-defined]
        outage = time.monotonic() - stopped
        async with Pipeline(bootstrap, prefix) as pipe:
            await wait_ready(pipe, worker, within_s=180)
        await asyncio.sleep(10)  # the actuator is back in its group and says so
        assert worker.alive(), worker.log_tail()
        assert actuator.proc is not None and actuator.proc.poll() is None, actuator.log.read_text()[-3000:]
        logs = {  # up to here: what the processes said of the outage, not of their shutdown
            "worker": worker.log_path.read_bytes()[before["worker"]:].decode(errors="replace"),
            "actuator": actuator.log.read_bytes()[before["actuator"]:].decode(errors="replace"),
        }
    finally:
        worker.stop()
        actuator.stop()
    report = {name: count(text) for name, text in logs.items()}
    summary = {name: {"lines": sum(c.values()), "errors": sum(n for (lvl, _), n in c.items() if lvl == "ERROR"),
                      "by logger": dict(c.most_common(8))} for name, c in report.items()}
    print(f"broker down {outage:.0f} s; log lines from the stop to 10 s after the pipeline worked again: {summary}")
    for name, text in logs.items():
        lost = [line for line in text.splitlines() if "Kafka broker unreachable" in line]
        back = [line for line in text.splitlines() if "Kafka broker reachable again" in line]
        assert len(lost) == 1 and len(back) == 1, f"{name}: {lost} {back}\n{text[-3000:]}"
        assert summary[name]["lines"] <= 25, f"{name}: {summary[name]}\n{text[-6000:]}"


def relayed_kubeconfig(kubeconfig: str, path: Path) -> tuple[Relay, Path]:
    """A relay to the kubeconfig's API server, and a copy of the kubeconfig that goes through it."""
    config = yaml.safe_load(Path(kubeconfig).read_text())
    server = urlparse(config["clusters"][0]["cluster"]["server"])
    relay = Relay((server.hostname or "127.0.0.1", server.port or 443))
    config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{relay.port}"
    path.write_text(yaml.safe_dump(config))
    return relay, path


async def test_an_api_server_outage_is_a_few_sentences(
    kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    prefix = f"t-apioutage-{uuid.uuid4().hex[:8]}-"
    await ensure_topics(kafka_bootstrap, actuator_topics(TopicNames(prefix=prefix)), PARTITIONS)
    relay, relayed = relayed_kubeconfig(kubeconfig, tmp_path / "kubeconfig")
    relay.start()
    actuator = Actuator(kafka_bootstrap, str(relayed), prefix, unique, tmp_path / "actuator.log", resync_s=2)
    actuator.start()
    try:
        await asyncio.sleep(15)  # started, watching nodes, in its group
        assert actuator.proc is not None and actuator.proc.poll() is None, actuator.log.read_text()[-3000:]
        before = actuator.log.stat().st_size
        relay.cut()
        await asyncio.sleep(OUTAGE_S)
        relay.start()
        await asyncio.sleep(15)  # the watch and the resync are back, and say so
        assert actuator.proc.poll() is None, actuator.log.read_text()[-3000:]
        text = actuator.log.read_bytes()[before:].decode(errors="replace")
    finally:
        actuator.stop()
        relay.cut()
    counted = count(text)
    summary = {"lines": sum(counted.values()), "by logger": dict(counted.most_common(8))}
    print(f"API server cut off {OUTAGE_S} s; actuator log lines from the cut to 15 s after: {summary}")
    lost = [line for line in text.splitlines() if "Kubernetes API server unreachable" in line]
    back = [line for line in text.splitlines() if "Kubernetes API server reachable again" in line]
    assert len(lost) == 1 and len(back) == 1, f"{lost} {back}\n{text[-3000:]}"
    assert summary["lines"] <= 10, f"{summary}\n{text[-6000:]}"
