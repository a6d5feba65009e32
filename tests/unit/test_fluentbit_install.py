"""`xidflow local install --fluent-bit` says in one sentence what is missing, and takes a user's own binary."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pipeline.localinfra import fluentbit
from pipeline.localinfra.install import InstallError


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XIDFLOW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XIDFLOW_VENDOR_DIR", str(tmp_path / "vendor"))
    monkeypatch.delenv("FLUENT_BIT_BIN", raising=False)
    (tmp_path / "vendor").mkdir()
    return tmp_path


def test_a_missing_source_is_one_sentence_naming_it(empty_cache: Path) -> None:
    with pytest.raises(InstallError) as err:
        fluentbit.ensure_fluent_bit(lambda _: None)
    message = str(err.value)
    assert f"fluent-bit-{fluentbit.VERSION}.tar.xz" in message and "FLUENT_BIT_BIN" in message
    assert "\n" not in message


def test_a_changed_source_is_refused_before_building(empty_cache: Path) -> None:
    tarball = empty_cache / "vendor" / f"fluent-bit-{fluentbit.VERSION}.tar.xz"
    tarball.write_bytes(b"not the release")
    (tarball.parent / "SHA256SUMS").write_text(f"{hashlib.sha256(b'the release').hexdigest()}  {tarball.name}\n")
    with pytest.raises(InstallError, match="the source was changed"):
        fluentbit.ensure_fluent_bit(lambda _: None)


def test_fluent_bit_bin_must_be_fluent_bit(empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = empty_cache / "fluent-bit"
    fake.write_text("#!/bin/sh\necho 'something else'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("FLUENT_BIT_BIN", str(fake))
    with pytest.raises(InstallError, match="does not answer `--version` as Fluent Bit does"):
        fluentbit.ensure_fluent_bit(lambda _: None)
    fake.write_text("#!/bin/sh\necho 'Fluent Bit v9.9.9'\n")
    assert fluentbit.ensure_fluent_bit(lambda _: None) == fake


def test_the_vendored_source_is_found_beside_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XIDFLOW_VENDOR_DIR", raising=False)
    assert fluentbit.source_tarball().parent.parts[-2:] == ("shared", "vendor")


def test_a_user_binary_that_does_not_answer_is_one_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.localinfra.install import user_binary

    hangs = tmp_path / "otelcol"
    hangs.write_text("#!/bin/sh\nsleep 30\n")
    hangs.chmod(0o755)
    monkeypatch.setenv("OTELCOL_BIN", str(hangs))
    with pytest.raises(InstallError, match=r"OTELCOL_BIN=.* did not answer `otelcol components` within 1s"):
        user_binary("OTELCOL_BIN", ["components"], timeout=1)
    monkeypatch.delenv("OTELCOL_BIN")
    assert user_binary("OTELCOL_BIN", ["components"]) is None
