"""The catalog data file, its validation, lookups and operator overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.detection.catalog import DEFAULT_CATALOG_PATH, Catalog, CatalogError, CatalogSettings
from schemas.records import Action, Severity

# NVIDIA's immediate-resolution buckets as tabulated in shared/reference/gpu-faults.md.
NVIDIA_IGNORE = [14, 37, 38, 43, 44, 63, 66, 67, 92, 93, 106, 107, 108, 121, 137, 141, 152, 153, 157, 160, 161]
NVIDIA_RESTART_APP = [8, 11, 13, 25, 31, 32, 39, 40, 41, 60, 68, 69, 70, 71, 72, 75, 76, 77, 80, 82, 83, 84, 85,
                      86, 88, 89, 94, *range(96, 106), *range(126, 136), 139]
NVIDIA_RESET_GPU = [46, 48, 62, 64, 95, 109, 110, 119, 120, 136, 140, 143, 155, 156, 158]


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return Catalog.load()


def test_buckets_follow_nvidia(catalog: Catalog) -> None:
    for code in NVIDIA_IGNORE:
        assert catalog.xid(code).action is Action.IGNORE, code
    for code in NVIDIA_RESTART_APP:
        assert catalog.xid(code).action is Action.RESTART_APP, code
    for code in NVIDIA_RESET_GPU:
        assert catalog.xid(code).action is Action.RESET_GPU, code
    assert catalog.xid(79).action is Action.REBOOT_NODE
    assert catalog.xid(151).action is Action.REBOOT_NODE
    assert catalog.xid(45).action is Action.IGNORE  # alone it is noise


def test_every_row_names_its_bucket(catalog: Catalog) -> None:
    for code in catalog.xid_codes():
        entry = catalog.xid_entry(code)
        assert entry and entry["name"] and entry["bucket"], code


def test_sticky_codes(catalog: Catalog) -> None:
    for code in (74, 79, 95, 109, 119):
        assert catalog.xid(code).sticky, code
    assert not catalog.xid(43).sticky


def test_unknown_codes_alert_without_quarantine(catalog: Catalog) -> None:
    unknown = catalog.xid(4242)
    assert (unknown.action, unknown.known, unknown.quarantine) == (Action.ALERT, False, False)
    # SXid codes outside the Fabric Manager tables: the printed severity decides.
    assert catalog.sxid(99999, printed_fatal=False).action is Action.IGNORE
    assert catalog.sxid(99999, printed_fatal=True).action is Action.RESET_GPU
    assert catalog.sxid(99999).action is Action.ALERT
    # An unknown Xid 154 recovery action: the driver asks for a recovery we cannot name.
    assert catalog.recovery_action(42).action is Action.CONTACT_SUPPORT


def test_sxid_fatality(catalog: Catalog) -> None:
    assert catalog.sxid(22013).fatal is False and catalog.sxid(22013).action is Action.IGNORE
    assert catalog.sxid(24007).fatal is True and catalog.sxid(24007).action is Action.RESET_GPU
    assert catalog.sxid(23005).action is Action.REBOOT_NODE  # always fatal to the fabric
    # A printed "Fatal" wins over a non-fatal catalog row.
    escalated = catalog.sxid(22013, printed_fatal=True)
    assert escalated.fatal is True and escalated.action is Action.RESET_GPU
    assert escalated.severity.rank >= Severity.ERROR.rank


def test_recovery_actions_and_nvlink5(catalog: Catalog) -> None:
    expected = {0: Action.IGNORE, 1: Action.RESET_GPU, 2: Action.REBOOT_NODE, 3: Action.RESET_GPU, 4: Action.RESET_GPU}
    assert {n: catalog.recovery_action(n).action for n in expected} == expected
    assert catalog.nvlink5(149, True).action is Action.RESET_GPU
    assert catalog.nvlink5(145, False).action is Action.IGNORE
    assert catalog.nvlink5(145, None).action is catalog.xid(145).action


def test_signals_and_health_checks(catalog: Catalog) -> None:
    assert catalog.signal("gpu_fallen_off_bus").action is Action.REBOOT_NODE
    for grade in ("hardware", "application", "sympathetic"):
        assert not catalog.signal(f"pod_{grade}").quarantine, "pod text alone never quarantines"
    assert catalog.health_check("remapped_rows", {"failed": True}).action is Action.CONTACT_SUPPORT
    assert catalog.health_check("remapped_rows", {"pending": True}).action is Action.RESET_GPU
    assert catalog.health_check("brand-new-check").known is False


def test_override_mapping_changes_only_given_fields(catalog: Catalog) -> None:
    overridden = Catalog.load(overrides={"xid": {13: {"action": "RESET_GPU"}, 300: {
        "name": "NEW", "action": "IGNORE", "severity": "info"}}})
    assert overridden.xid(13).action is Action.RESET_GPU
    assert overridden.xid(13).name == catalog.xid(13).name  # untouched fields keep their values
    assert overridden.xid(300).action is Action.IGNORE and overridden.xid(300).known
    assert catalog.xid(13).action is Action.RESTART_APP  # the default catalog is not mutated


def test_override_file_via_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "overrides.yaml"
    path.write_text("sxid:\n  20009: {fatal: false, action: IGNORE, severity: warning}\n")
    monkeypatch.setenv("XIDFLOW_CATALOG_OVERRIDES", str(path))
    catalog = Catalog.from_settings(CatalogSettings())
    assert catalog.sxid(20009, printed_fatal=False).action is Action.IGNORE


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"xid": {13: {"action": "REBOOT"}}}, "xid 13: action"),
        ({"xid": {13: {"severity": "loud"}}}, "xid 13: severity"),
        ({"xid": {13: {"colour": "red"}}}, "xid 13: colour"),
        ({"xid": {"thirteen": {"action": "IGNORE", "severity": "info"}}}, "xid 'thirteen'"),
        ({"sxid": {12028: "fatal"}}, "sxid 12028: expected a mapping"),
        ({"xid": {500: {"name": "X"}}}, "xid 500: action"),
    ],
)
def test_invalid_entries_name_the_entry(override: dict, message: str) -> None:
    with pytest.raises(CatalogError, match=message):
        Catalog.load(overrides=override)


def test_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="missing.yaml"):
        Catalog.load(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("xid: [unclosed\n")
    with pytest.raises(CatalogError, match="not valid YAML"):
        Catalog.load(bad)
    partial = tmp_path / "partial.yaml"
    partial.write_text(yaml.safe_dump({"xid": {}}))
    with pytest.raises(CatalogError, match="section 'defaults'"):
        Catalog.load(partial)


def test_data_file_names_its_sources() -> None:
    text = DEFAULT_CATALOG_PATH.read_text()
    assert "docs.nvidia.com/deploy/xid-errors" in text and "fabric-manager" in text
