"""docs/configuration.md is generated from the settings classes; it must not go stale."""

import subprocess
import sys

from pipeline.runtime import configdoc


def test_configuration_reference_is_fresh() -> None:
    assert configdoc.OUT.read_text() == configdoc.render(), "run: python -m pipeline.runtime.configdoc"


def test_every_setting_is_documented() -> None:
    rows = [line for line in configdoc.render().splitlines() if line.startswith("| `")]
    undocumented = [row for row in rows if row.endswith("| - |")]
    assert not undocumented, undocumented


def test_importing_the_actuator_settings_reads_no_source() -> None:
    # Their descriptions are the strings under the fields, read by configdoc; pydantic's own extraction
    # (use_attribute_docstrings) found the source through every loaded module at each actuator start.
    script = (
        "import inspect\n"
        "read = []\n"
        "real = inspect.findsource\n"
        "inspect.findsource = lambda obj: read.append(obj) or real(obj)\n"
        "import pipeline.actuator.settings\n"
        "print(len(read))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "0"
