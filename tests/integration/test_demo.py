"""The README's run command, end to end: `xidflow demo` on the session's real Kafka and API server."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_demo_completes_with_every_expectation_met(kafka_bootstrap: str, kubeconfig: str, tmp_path) -> None:
    env = dict(
        os.environ,
        KAFKA_BOOTSTRAP_SERVERS=kafka_bootstrap,
        KUBECONFIG=kubeconfig,
        COLUMNS="200",
        XIDFLOW_STATE_DIR=str(tmp_path),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "demo", "--step-timeout", "60"],
        capture_output=True,
        text=True,
        env=env,
        timeout=540,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "demo passed" in out
    assert "WRONG" not in out
    assert "went through Loki -> xidflow loki-tail -> Kafka" in out  # the Konduktor path, on screen
