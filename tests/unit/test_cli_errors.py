"""Bad configuration is refused before anything connects: a clear message, a non-zero exit."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import cli


def run(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    result = CliRunner().invoke(cli, args, env=env)
    return result.exit_code, result.output


def test_worker_refuses_an_invalid_aggregation_setting() -> None:
    code, out = run(["worker", "--bootstrap", "127.0.0.1:1"], {"XIDFLOW_AGG_DEBOUNCE_WINDOW_S": "soon"})
    assert code != 0
    assert "debounce_window_s" in out and "invalid settings" in out


def test_actuator_refuses_an_out_of_range_breaker_share() -> None:
    code, out = run(["actuator"], {"XIDFLOW_ACTUATOR_BREAKER_MAX_SHARE": "2"})
    assert code != 0
    assert "breaker_max_share" in out


def test_actuator_refuses_a_policy_file_naming_the_bad_field(tmp_path: Path) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "apiVersion: xidflow.dev/v1alpha1\nkind: RescuePolicy\nmetadata: {name: p}\n"
        "spec:\n  rules:\n    - name: r\n      priority: 5\n      actions: [{name: explode}]\n"
    )
    code, out = run(["actuator", "--policy-file", str(policy)], {})
    assert code != 0
    assert "invalid policy file" in out and "actions" in out


@pytest.mark.parametrize("args", [["local", "up", "--kafka-brokers", "0"], ["classify", "/nonexistent/kern.log"]])
def test_bad_arguments_exit_non_zero(args: list[str]) -> None:
    code, _ = run(args, {})
    assert code != 0
