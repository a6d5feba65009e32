"""The demo's last line says how long a newcomer waited: set-up (builds, installs) and the demo itself."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.commands.demo import timing_line

MAKEFILE = (Path(__file__).resolve().parents[2] / "Makefile").read_text()


def test_with_make_demos_start_the_line_gives_set_up_demo_and_total() -> None:
    line = timing_line(1000.0, 1000.0 + 15 * 60 + 10, 1000.0 + 17 * 60 + 32)
    assert line.startswith("time: 17m 32s in all"), line
    assert "set-up 15m 10s" in line and "demo 2m 22s" in line


def test_without_it_only_the_demo_is_timed() -> None:
    assert timing_line(None, 50.0, 95.0) == "time: demo 45s (infrastructure start included)"
    # A start after the demo's own (a clock that moved back) is not believed.
    assert timing_line(200.0, 50.0, 95.0).startswith("time: demo 45s")


def test_make_demo_passes_its_start_to_the_demo() -> None:
    recipe = MAKEFILE.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"xidflow demo --setup-started \$\(DEMO_STARTED\)", recipe), recipe
    assert "DEMO_STARTED := $(shell date +%s)" in MAKEFILE
