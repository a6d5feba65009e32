"""Unknown XIDFLOW_* variables are reported with the closest known name; one logging flag set everywhere."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import orjson
import pytest
import yaml
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.runtime import envcheck, logconfig

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "xidflow"


def test_a_typo_is_reported_with_the_closest_name_in_its_group() -> None:
    known = envcheck.known_names()
    env = {"XIDFLOW_AGG_WINDOW_SECONDS": "600", "XIDFLOW_ACTUATOR_DRYRUN": "true", "XIDFLOW_LOG_LEVEL": "debug",
           "PATH": "/bin"}
    assert envcheck.unknown(env, known) == [
        ("XIDFLOW_ACTUATOR_DRYRUN", "XIDFLOW_ACTUATOR_DRY_RUN"),
        ("XIDFLOW_AGG_WINDOW_SECONDS", "XIDFLOW_AGG_DEBOUNCE_WINDOW_S"),
    ]


def test_known_names_come_from_every_settings_class() -> None:
    known = envcheck.known_names()
    for name in ("KAFKA_BOOTSTRAP_SERVERS",):
        assert name not in known  # only XIDFLOW_* names are checked
    for name in ("XIDFLOW_TOPIC_PREFIX", "XIDFLOW_WORKER_APP_ID", "XIDFLOW_ACTUATOR_DRY_RUN", "XIDFLOW_API_PORT",
                 "XIDFLOW_NOTIFY_WEBHOOKS", "XIDFLOW_CATALOG_OVERRIDES", "XIDFLOW_PARSE_MAX_RECORDS",
                 "XIDFLOW_AGG_QUIET_PERIOD_S", "XIDFLOW_LOG_LEVEL", "XIDFLOW_LOG_FORMAT", "XIDFLOW_METRICS_PORT"):
        assert name in known, name


def test_the_cli_warns_at_start_and_still_runs() -> None:
    result = CliRunner(env={"XIDFLOW_TOPIC_PREFX": "prod."}).invoke(cli, ["classify", "-"], input="")
    assert result.exit_code == 0
    assert "XIDFLOW_TOPIC_PREFX" in result.stderr and "did you mean XIDFLOW_TOPIC_PREFIX?" in result.stderr


def test_no_xidflow_variable_means_no_check() -> None:
    assert envcheck.warnings({"PATH": "/bin"}) == []


def _chart_env_names() -> set[str]:
    names: set[str] = set()
    for values in (CHART / "values.yaml", *sorted((CHART / "ci").glob("*.yaml"))):
        doc = yaml.safe_load(values.read_text()) or {}
        blocks = [doc.get("env") or {}] + [
            (v.get("env") or {}) for v in doc.values() if isinstance(v, dict) and isinstance(v.get("env"), dict)
        ]
        for block in blocks:
            names |= {k for k in block if k.startswith("XIDFLOW_")}
    for template in (CHART / "templates").rglob("*"):
        if template.is_file():
            names |= set(re.findall(r"name: (XIDFLOW_[A-Z0-9_]+)", template.read_text()))
    return names


def test_every_variable_the_chart_sets_is_read_by_something() -> None:
    names = _chart_env_names()
    assert "XIDFLOW_LOG_LEVEL" in names and "XIDFLOW_ACTUATOR_DRY_RUN" in names
    assert envcheck.unknown(dict.fromkeys(names, "x"), envcheck.known_names()) == []


PROCESSES = ["worker", "actuator", "loki-tail", "probe"]


@pytest.mark.parametrize("name", PROCESSES)
def test_every_process_has_the_same_logging_flags(name: str) -> None:
    command = cli.get_command(None, name)  # type: ignore[arg-type]
    opts = {o for p in command.params for o in p.opts}
    assert {"--log-level", "--log-format"} <= opts
    help_text = CliRunner().invoke(cli, [name, "--help"]).output
    assert "XIDFLOW_LOG_LEVEL" in help_text and "XIDFLOW_LOG_FORMAT" in help_text


def test_json_log_format_writes_one_object_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        logconfig.configure("info", "json")
        logging.getLogger("xidflow.test").info("hello %s", "world")
        logging.getLogger("xidflow.test").debug("not shown")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("xidflow.test").exception("failed")
        lines = capsys.readouterr().err.strip().splitlines()
        docs = [orjson.loads(line) for line in lines]
        assert [(d["level"], d["logger"], d["msg"]) for d in docs] == [
            ("info", "xidflow.test", "hello world"), ("error", "xidflow.test", "failed")]
        assert "ValueError: boom" in docs[1]["exc"] and docs[0]["ts"].endswith("Z")
    finally:
        logconfig.configure("warning", "text")


def test_flags_configure_logging_and_env_is_the_default() -> None:
    seen: list[tuple[str, str]] = []

    import click

    @click.command()
    @logconfig.log_options
    def probe_like() -> None:
        seen.append(logconfig.current())

    CliRunner(env={"XIDFLOW_LOG_FORMAT": "json"}).invoke(probe_like, ["--log-level", "WARNING"])
    assert seen == [("warning", "json")]
    assert logging.getLogger().level == logging.WARNING
    result = CliRunner(env={"XIDFLOW_LOG_LEVEL": "loud"}).invoke(probe_like, [])
    assert result.exit_code == 2 and "--log-level" in result.output and "loud" in result.output
    logconfig.configure("warning", "text")


def test_dict_config_is_accepted_by_logging() -> None:
    import logging.config

    for fmt in logconfig.FORMATS:
        logging.config.dictConfig(logconfig.dict_config("info", fmt))
    logconfig.configure("warning", "text")


def test_reading_settings_from_source_equals_pydantic() -> None:
    import subprocess
    import sys

    # In a fresh interpreter (nothing imported yet), the source reading must give what pydantic gives.
    code = ("from pipeline.runtime import envcheck; import sys; a = envcheck.known_names(); "
            "assert 'faust' not in sys.modules and 'kubernetes' not in sys.modules, 'imported heavy modules'; "
            "b = envcheck.known_names(imported=True); print(sorted(a ^ b)); assert a == b")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
