"""The worker answers /livez from its Faust event loop and logs JSON lines with --log-format json."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_worker_livez_and_json_logs(kafka_bootstrap: str, unique: Callable[[str], str], tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "worker.log"
    env = {**os.environ, "XIDFLOW_HEALTH_PORT": str(port), "XIDFLOW_HEALTH_ADDR": "127.0.0.1",
           "XIDFLOW_METRICS_PORT": "0", "XIDFLOW_TOPIC_PREFIX": unique("t") + "."}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "worker", "--bootstrap", kafka_bootstrap, "--app-id", unique("app"),
             "--partitions", "2", "--log-level", "info", "--log-format", "json"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )
    try:
        status = None
        deadline = time.monotonic() + 240
        while status != 200:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the worker never answered /livez:\n" + log_path.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/livez", timeout=5) as r:
                    status = r.status
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.5)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    records = [orjson.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    assert records, log_path.read_text()[-3000:]
    assert all({"ts", "level", "logger", "msg"} <= r.keys() for r in records)
