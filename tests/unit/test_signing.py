"""Proof of origin for rescue requests: what the decision API signs, the actuator accepts; nothing else."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.actuator.signing import SIGNATURE_HEADER, Signer, SigningSettings, Verifier, refusal, sign, verify
from schemas.records import Outcome

KEY, OTHER = b"k" * 32, b"o" * 32
VALUE = b'{"type":"rescue_request","node_name":"gpu-1","requested_by":"ops"}'


def test_a_signed_record_verifies() -> None:
    assert verify([KEY], b"gpu-1", VALUE, [("type", b"x"), sign(KEY, b"gpu-1", VALUE)]) is None


@pytest.mark.parametrize(
    ("record_key", "value", "headers", "why"),
    [
        (b"gpu-1", VALUE, [], "unsigned"),
        (b"gpu-1", VALUE, None, "unsigned"),
        (b"gpu-1", VALUE, [sign(OTHER, b"gpu-1", VALUE)], "does not verify"),
        (b"gpu-2", VALUE, [sign(KEY, b"gpu-1", VALUE)], "does not verify"),  # moved to another node
        (b"gpu-1", VALUE.replace(b"ops", b"eve"), [sign(KEY, b"gpu-1", VALUE)], "does not verify"),  # identity
        (b"gpu-1", VALUE, [(SIGNATURE_HEADER, b"v0=abc")], "unknown signature format"),
        (b"gpu-1", VALUE, [sign(KEY, b"gpu-1", VALUE)] * 2, "more than one"),
    ],
)
def test_unsigned_forged_or_altered_records_are_refused(
    record_key: bytes, value: bytes, headers: list | None, why: str
) -> None:
    reason = verify([KEY], record_key, value, headers)
    assert reason is not None and why in reason


def test_key_file_rotation(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("new-key\nold-key\n")
    settings = SigningSettings(key_file=f)
    signer, verifier = Signer.from_settings(settings), Verifier.from_settings(settings)
    (header,) = signer.headers(b"n", VALUE)
    assert header == sign(b"new-key", b"n", VALUE)
    assert verifier.check(b"n", VALUE, [sign(b"old-key", b"n", VALUE)]) is None
    assert verifier.check(b"n", VALUE, []) is not None


def test_an_empty_key_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("\n")
    with pytest.raises(ValueError, match="XIDFLOW_SIGNING_KEY_FILE"):
        SigningSettings(key_file=tmp_path / "keys").keys()


def test_without_a_key_nothing_is_signed_or_checked() -> None:
    assert Signer(None).headers(b"n", VALUE) == []
    assert Verifier([]).check(b"n", VALUE, []) is None


def test_refusal_is_an_audit_record_that_names_the_reason() -> None:
    rec = refusal("gpu-1", "req-1", "eve", "unsigned rescue request", "w1")
    assert rec.node == "gpu-1" and rec.outcome is Outcome.SKIPPED and "refused: unsigned" in rec.reason
    assert rec.details["request_id"] == "req-1" and rec.details["claimed_requested_by"] == "eve"
