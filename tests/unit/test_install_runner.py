"""The one runner of long install steps: streams a real child's output, logs progress on a timer, fails loudly."""

from __future__ import annotations

import io
import re
import stat
import sys
from pathlib import Path

import pytest
from rich.console import Console

from pipeline.localinfra.fluentbit import cmake_percent
from pipeline.localinfra.install import (
    InstallError,
    InstallStep,
    go_build,
    go_build_meter,
    maven_meter,
    run_logged,
    run_steps,
)

EVERY = 0.2


def python(script: str) -> list[str]:
    return [sys.executable, "-u", "-c", script]


# Prints like `go build -v`: a module download, then one package a line, 0.1 s apart.
GO_LIKE = """
import time
print("go: downloading k8s.io/apimachinery v0.36.0", flush=True)
for i in range(12):
    print(f"k8s.io/apiserver/pkg/p{i:02d}", flush=True)
    time.sleep(0.1)
"""


def test_progress_is_logged_while_the_child_runs_with_what_it_has_done(tmp_path: Path) -> None:
    logged: list[str] = []
    run_logged(python(GO_LIKE), tmp_path, "building things", logged.append, meter=go_build_meter(),
               cached_in=tmp_path / "cache", every=EVERY)
    assert logged[0].startswith("building things: ") and f"in {tmp_path}; cached in {tmp_path / 'cache'}" in logged[0]
    progress = logged[1:-1]
    assert len(progress) >= 3, logged  # ~1.2 s of work, a line every 0.2 s
    assert all(re.match(r"^  \.\.\. \d+s(, 1 modules downloaded, \d+ packages built)?$", line) for line in progress)
    counts = [int(m.group(1)) for line in progress if (m := re.search(r"(\d+) packages built", line))]
    assert len(counts) >= 2 and counts == sorted(counts) and counts[0] < 12, logged  # counted while it ran
    assert re.match(r"^  building things: done in \d+s \(1 modules downloaded, 12 packages built\)$", logged[-1])


def test_a_silent_child_still_gets_progress_lines(tmp_path: Path) -> None:
    # Maven -q or a long link prints nothing for minutes: the timer, not the output, drives the progress.
    logged: list[str] = []
    run_logged(python("import time; time.sleep(1.0)"), tmp_path, "resolving", logged.append, every=EVERY)
    assert sum(1 for line in logged if line.startswith("  ... ")) >= 3, logged
    assert logged[-1].startswith("  resolving: done in ")


def test_a_failure_raises_with_the_exit_status_and_the_end_of_the_output(tmp_path: Path) -> None:
    script = "import sys\nfor i in range(100): print(f'line {i}')\nprint('cannot find package x', file=sys.stderr)\n" \
             "sys.exit(3)"
    with pytest.raises(InstallError) as exc:
        run_logged(python(script), tmp_path, "building x", lambda _: None, every=EVERY)
    text = str(exc.value)
    assert text.startswith("building x failed (exit 3):")
    assert text.endswith("cannot find package x") and "line 99" in text and "line 0\n" not in text


def test_go_builds_ask_go_for_each_package_and_count_them(tmp_path: Path) -> None:
    # A stand-in `go` that records its arguments and prints packages only when given -v, as go does.
    fake = tmp_path / "go"
    fake.write_text(f"#!{sys.executable}\n" + "\n".join([
        "import sys, pathlib",
        "pathlib.Path(sys.argv[0] + '.args').write_text(' '.join(sys.argv[1:]))",
        "if '-v' in sys.argv:",
        "    [print(f'example.com/p{i}') for i in range(5)]",
    ]) + "\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    logged: list[str] = []
    go_build(str(fake), ["-trimpath", "-o", "out/", "example.com/cmd/x"], tmp_path, "building x", logged.append,
             {}, tmp_path / "cache")
    assert (tmp_path / "go.args").read_text() == "build -v -trimpath -o out/ example.com/cmd/x"
    assert "cached in" in logged[0] and logged[-1].endswith("(5 packages built)")


def test_meters_read_maven_and_cmake_lines() -> None:
    maven = maven_meter()
    assert maven("[INFO] Downloading from central: https://example.invalid/a.pom") is None
    assert maven("[INFO] Downloaded from central: https://example.invalid/a.pom (2 kB)") == "1 files downloaded"
    assert maven("[INFO] Downloaded from central: https://example.invalid/b.jar (1 MB)") == "2 files downloaded"
    assert cmake_percent("[ 45%] Building C object lib/foo.c.o") == "45% done"
    assert cmake_percent("[100%] Linking C executable bin/fluent-bit") == "100% done"
    assert cmake_percent("-- Configuring done") is None


def test_run_steps_piped_keeps_one_line_per_step_start_and_end_with_the_runner_lines(tmp_path: Path) -> None:
    def build(log: object) -> None:
        run_logged(python(GO_LIKE), tmp_path, "building things", log, meter=go_build_meter(), every=EVERY)  # type: ignore[arg-type]

    out = io.StringIO()
    run_steps([InstallStep("things (Go build)", build)], Console(file=out, force_terminal=False, width=80))
    lines = out.getvalue().splitlines()
    assert lines[0] == "step 1/1: things (Go build) ..."
    assert lines[1].startswith("  building things: ")
    assert any(line.startswith("    ... ") and "packages built" in line for line in lines[2:-2])
    assert lines[-2].startswith("    building things: done in ")
    assert lines[-1].startswith("step 1/1: things (Go build) done in ")
