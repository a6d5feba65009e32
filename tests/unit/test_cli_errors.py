"""Bad configuration is refused before anything connects: a clear message, a non-zero exit."""

from __future__ import annotations

import gc
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
    assert "XIDFLOW_AGG_DEBOUNCE_WINDOW_S" in out and "invalid setting" in out


def test_actuator_refuses_an_out_of_range_breaker_share() -> None:
    code, out = run(["actuator"], {"XIDFLOW_ACTUATOR_BREAKER_MAX_SHARE": "2"})
    assert code != 0
    assert "XIDFLOW_ACTUATOR_BREAKER_MAX_SHARE" in out


@pytest.mark.parametrize("command", [["actuator"], ["worker", "--bootstrap", "127.0.0.1:1"]])
def test_a_refused_service_start_turns_the_garbage_collector_back_on(command: list[str]) -> None:
    # A service's start runs without the collector (pipeline.cli); a start that stops at a sentence must not
    # leave it off in the process that ran the command (this one, under the test runner).
    assert gc.isenabled()
    code, _ = run(command, {"XIDFLOW_GC_THRESHOLD0": "1"})  # below its minimum: refused before anything runs
    assert code != 0
    assert gc.isenabled()


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


@pytest.mark.parametrize(
    ("env", "args", "named"),
    [
        ({"XIDFLOW_PARSE_MAX_RECORDS": "-1"}, [], "XIDFLOW_PARSE_MAX_RECORDS"),
        ({"XIDFLOW_PARSE_MAX_UNSETTLED_BATCHES": "0"}, [], "XIDFLOW_PARSE_MAX_UNSETTLED_BATCHES"),
        ({"XIDFLOW_GROUP_SESSION_TIMEOUT_S": "-3"}, [], "XIDFLOW_GROUP_SESSION_TIMEOUT_S"),
        ({}, ["--session-timeout", "-5"], "XIDFLOW_GROUP_SESSION_TIMEOUT_S"),
        ({"XIDFLOW_GROUP_HEARTBEAT_INTERVAL_S": "60"}, [], "heartbeat_interval_s"),
        ({"XIDFLOW_AGG_QUIET_PERIOD_S": "-1"}, [], "XIDFLOW_AGG_QUIET_PERIOD_S"),
        ({"XIDFLOW_TOPIC_LOGS_KERNEL": "no spaces"}, [], "XIDFLOW_TOPIC_LOGS_KERNEL"),
        ({"XIDFLOW_WORKER_PARSE": "false", "XIDFLOW_WORKER_AGGREGATE": "false"}, [], "would do nothing"),
        ({"XIDFLOW_GC_THRESHOLD0": "5"}, [], "XIDFLOW_GC_THRESHOLD0"),
    ],
)
def test_worker_refuses_settings_that_disable_it_with_one_sentence(env: dict, args: list[str], named: str) -> None:
    code, out = run(["worker", "--bootstrap", "127.0.0.1:1", *args], env)
    assert code != 0
    assert named in out and "invalid setting" in out, out
    assert "Traceback" not in out and "errors.pydantic.dev" not in out


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"XIDFLOW_ACTUATOR_TAINT_KEY": "Not A/Taint Key"}, "XIDFLOW_ACTUATOR_TAINT_KEY"),
        ({"XIDFLOW_ACTUATOR_TAINT_KEY": "nvidia.com/" + "x" * 64}, "XIDFLOW_ACTUATOR_TAINT_KEY"),
        ({"XIDFLOW_ACTUATOR_REBOOT_JOB_TEMPLATE": "/nonexistent/reboot.yaml"}, "XIDFLOW_ACTUATOR_REBOOT_JOB_TEMPLATE"),
        ({"XIDFLOW_API_TOKEN_FILE": "/nonexistent/tokens"}, "XIDFLOW_API_TOKEN_FILE"),
        ({"XIDFLOW_GC_THRESHOLD2": "often"}, "XIDFLOW_GC_THRESHOLD2"),
    ],
)
def test_actuator_refuses_what_kubernetes_or_the_filesystem_would(env: dict, named: str) -> None:
    code, out = run(["actuator"], env)
    assert code != 0
    assert named in out and "Traceback" not in out, out


def test_a_refused_secret_is_never_printed() -> None:
    code, out = run(["actuator"], {"XIDFLOW_API_TOKENS": '{"portal": "s3cret-value", '})
    assert code != 0
    assert "invalid settings" in out and "tokens" in out and "s3cret" not in out, out


def test_an_unexpected_failure_is_one_sentence_not_a_traceback() -> None:
    # Python refusing an unexpected value deep inside: the group's handler turns it into one sentence.
    code, out = run(["classify", "--format", "json", "-"], {"XIDFLOW_CATALOG_OVERRIDES": "{not json"})
    assert code != 0
    assert "Traceback" not in out and out.strip().count("\n") <= 2, out


@pytest.mark.parametrize(
    ("variable", "content", "said"),
    [
        ("XIDFLOW_CATALOG_OVERRIDES", b"\xff\xfe\x00binary", "not UTF-8 text (byte 0"),
        ("XIDFLOW_CATALOG_PATH", b"xid:\n  13: {action: \xe9}\n", "not UTF-8 text (byte 20"),
        ("XIDFLOW_ACTUATOR_POLICY_FILE", b"kind: RescuePolicy\nmetadata: {name: \xe9}\n", "not UTF-8 text (byte 36"),
        ("XIDFLOW_ACTUATOR_POLICY_FILE", b"", "holds no RescuePolicy or WarmStandbyPolicy document"),
        ("XIDFLOW_ACTUATOR_POLICY_FILE", b"# every policy commented out\n---\n", "holds no RescuePolicy"),
    ],
)
def test_a_configuration_file_that_cannot_be_used_is_named_with_its_variable(
    tmp_path: Path, variable: str, content: bytes, said: str
) -> None:
    """Issue 37: a binary catalog override and a non-UTF-8 policy file named neither; an empty policy file
    was taken silently (the built-in rule alone in force)."""
    path = tmp_path / "file.yaml"
    path.write_bytes(content)
    code, out = run(["actuator", "--no-api"], {variable: str(path)})
    assert code != 0
    assert variable in out and str(path) in out and said in out and "Traceback" not in out, out
