"""docs/configuration.md is generated from the settings classes; it must not go stale."""

from pipeline.runtime import configdoc


def test_configuration_reference_is_fresh() -> None:
    assert configdoc.OUT.read_text() == configdoc.render(), "run: python -m pipeline.runtime.configdoc"


def test_every_setting_is_documented() -> None:
    rows = [line for line in configdoc.render().splitlines() if line.startswith("| `")]
    undocumented = [row for row in rows if row.endswith("| - |")]
    assert not undocumented, undocumented
