"""CI runs the README's two commands and nothing else: a fresh machine that follows the README gets what CI got."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CI = (ROOT / ".ci" / "run").read_text()
README = (ROOT / "README.md").read_text()
MAKEFILE = (ROOT / "Makefile").read_text()

INSTALLERS = r"\b(apt-get|apt|pip3?|python3? -m pip|curl|wget|go install|npm|mvn|brew|dnf|yum)\b"


def _commands(script: str) -> list[str]:
    return [line.strip() for line in script.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_ci_runs_the_readme_test_command_then_the_demo() -> None:
    """`make test` first, then `make demo` exactly as the README writes it (no arguments, default paths)."""
    assert "make test" in README and "make demo" in README
    assert [c for c in _commands(CI) if c.startswith("make")] == ["make test", "make demo"]
    assert "XIDFLOW_STATE_DIR" not in CI and "XIDFLOW_CACHE_DIR" not in CI


def test_ci_stops_what_the_demo_leaves_running_with_the_readmes_command() -> None:
    assert "local down" in README
    assert any(c.startswith(".venv/bin/xidflow local down") for c in _commands(CI))


def test_ci_installs_nothing_of_its_own() -> None:
    offending = [c for c in _commands(CI) if re.search(INSTALLERS, c)]
    assert offending == [], f".ci/run installs what `make test` does not: {offending}"


def test_make_test_installs_every_real_part_the_tests_run() -> None:
    """Each real program the tests start is installed by `make test`'s own targets."""
    recipe = "\n".join(line for line in MAKEFILE.splitlines() if "xidflow local install" in line)
    for flag in ("--loki", "--fluent-bit", "--otelcol", "--rsyslog", "--promtool"):
        assert flag in recipe, f"`make test` does not install {flag[2:]}"
    assert re.search(r"^test: .*test-infra", MAKEFILE, re.M)
