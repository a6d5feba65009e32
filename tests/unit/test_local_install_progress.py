"""`xidflow local install` shows step n of m, a spinner and elapsed time; a failing step stops the rest."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from pipeline.cli import cli
from pipeline.localinfra import install
from pipeline.localinfra.install import InstallError, InstallStep, run_steps


def steps(record: list[str], fail_at: int | None = None) -> list[InstallStep]:
    def make(n: int) -> InstallStep:
        def run(log: install.Log) -> None:
            record.append(f"ran {n}")
            log(f"working on {n}")
            if n == fail_at:
                raise InstallError(f"step {n} broke")

        return InstallStep(f"thing number {n}", run)

    return [make(n) for n in (1, 2, 3)]


def test_terminal_shows_spinner_step_numbers_and_elapsed_time() -> None:
    out = io.StringIO()
    ran: list[str] = []
    run_steps(steps(ran), Console(file=out, force_terminal=True, width=100, color_system=None))
    text = out.getvalue()
    assert ran == ["ran 1", "ran 2", "ran 3"]
    for n in (1, 2, 3):
        assert f"step {n}/3" in text and f"thing number {n}" in text and f"working on {n}" in text
    assert "0:00:0" in text  # the elapsed-time column
    assert "✓" in text  # finished steps


def test_piped_output_is_one_line_per_step_start_and_end() -> None:
    out = io.StringIO()
    run_steps(steps([]), Console(file=out, force_terminal=False, width=80))
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 1/3: thing number 1 ..."
    assert lines[1] == "  working on 1"
    assert lines[2].startswith("step 1/3: thing number 1 done in ") and lines[2].endswith("s")
    assert lines[-1].startswith("step 3/3: thing number 3 done in ")


def test_a_failing_step_stops_the_rest() -> None:
    ran: list[str] = []
    with pytest.raises(InstallError, match="step 2 broke"):
        run_steps(steps(ran, fail_at=2), Console(file=io.StringIO(), force_terminal=True))
    assert ran == ["ran 1", "ran 2"]


def test_the_install_steps_are_the_real_installers() -> None:
    titles = [s.title for s in install.install_steps()]
    assert titles[:3] == ["Kafka broker jars (Maven)", "Kubernetes control plane and etcd (Go build)",
                          "KWOK, the node and pod simulator (Go build)"]
    runs = [s.run for s in install.install_steps()[:3]]
    assert runs == [install.ensure_kafka, install.ensure_controlplane, install.ensure_kwok]


# What a complete control-plane cache entry holds (one Go build; the test fails at once if this falls behind).
CONTROLPLANE_BINARIES = ("kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler", "kubectl")


def test_local_install_with_a_warm_cache_reports_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A cache whose Kafka, control-plane and KWOK entries are complete: those installers return at once (what a
    # second run does). Only those three steps run here, whatever steps are added later; a cache entry this
    # test failed to fake fails it at once instead of building for minutes.
    import pipeline.commands.local as local_command

    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"the fake cache is incomplete: a real build started: {args[:2]}")

    monkeypatch.setattr(install, "run_logged", no_build)
    monkeypatch.setattr(install, "go_build", no_build)
    monkeypatch.setenv("XIDFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(local_command, "install_steps", lambda: install.install_steps()[:3])
    kwok_dir = tmp_path / "kwok" / f"{install.kwok_version()}-{install._digest(install.KWOK_GOMOD, install.KWOK_GOSUM)}"
    for step_dir, parts in (
        (tmp_path / "kafka" / f"{install.kafka_version()}-{install._digest(install.POM)}", ["libs"]),
        (install.controlplane_target(), list(CONTROLPLANE_BINARIES)),
        (kwok_dir, ["kwok", *(f"module/{d}" for d in install.KWOK_MODULE_DIRS)]),
    ):
        for part in parts:
            (step_dir / part).parent.mkdir(parents=True, exist_ok=True)
            (step_dir / part).touch()
        (step_dir / ".complete").write_text("x")
    result = CliRunner(env={"XIDFLOW_CACHE_DIR": str(tmp_path)}).invoke(cli, ["local", "install", "--no-loki"])
    assert result.exit_code == 0, result.output
    assert "step 1/3: Kafka broker jars (Maven) done in" in result.stderr
    assert "step 2/3: Kubernetes control plane and etcd (Go build) done in" in result.stderr
    assert "step 3/3: KWOK, the node and pod simulator (Go build) done in" in result.stderr
    assert "installed in" in result.stderr
