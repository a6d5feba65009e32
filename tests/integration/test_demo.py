"""The README's run command, end to end: `xidflow demo` on the session's real Kafka and API server."""

from __future__ import annotations

import os
import re
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
    # The pods a user sees moving were moved by Kubernetes: evicted by the drains, re-created by their
    # controllers, placed by the scheduler on nodes in service; the PDBs kept by the disruption controller.
    assert "Drained pods re-created by Kubernetes" in out and "PDBs kept by the disruption controller" in out
    moved = re.findall(r"pods moved by Kubernetes: (\d+)", out)
    assert moved and int(moved[-1]) >= 4, out[-6000:]  # both pods of each of the two drained nodes
    # The Fluent Bit path: real processes, every line delivered, pod lines resolved by the kubernetes filter.
    assert "Fluent Bit 5.1.1 processes (one per node" in out and "Shipped by Fluent Bit" in out
    fluent_bits = sorted((tmp_path / "demo" / "fluent-bit").glob("*/fluent-bit.log"))
    assert len(fluent_bits) == 9, fluent_bits  # 8 GPU nodes + the standby, one process each
    for log in fluent_bits:
        text = log.read_text(errors="replace")
        assert "[engine] started" in text or "version=" in text, text[-2000:]
        assert "[error]" not in text, text[-3000:]
