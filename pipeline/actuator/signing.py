"""Proof of origin for rescue requests: the decision API signs each record, the actuator checks it.

ACLs say who may write ``gpu.remediation.requests``; ACLs can be misconfigured. So the decision API
adds an HMAC-SHA256 over the record (its Kafka key and the exact value bytes, which carry the
caller's identity in ``requested_by``) in the ``xidflow-signature`` header, with a key only the
API and the actuator hold (a Secret mounted as a file). The actuator refuses and audits a request
that is unsigned or whose signature does not verify: a forged record does nothing.

Key file: one key per line; the first signs, every line verifies (add the new key as a second line,
roll the actuator, move it first, roll the API, drop the old one). Without any key configured the
actuator accepts unsigned requests and says so loudly at start (plain local development only; the
Helm chart always configures a key).

Pure: no Kafka, no Kubernetes; the hooks live in the API's produce path and the actuator's intake.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.actuator.audit import make_record
from schemas.records import Outcome, RemediationRecord

log = logging.getLogger("xidflow.signing")

SIGNATURE_HEADER = "xidflow-signature"
VERSION = "v1"
_DOMAIN = b"xidflow/rescue-request/v1\x00"


class SigningSettings(BaseSettings):
    """Request signing key, shared by the decision API (signs) and the actuator (verifies)."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_SIGNING_", extra="ignore", env_ignore_empty=True)

    key_file: Path | None = Field(
        default=None, description="File with the HMAC key(s), one per line; the first signs (a mounted Secret)")
    key: SecretStr | None = Field(default=None, description="The HMAC key itself (prefer key_file)")

    def keys(self) -> list[bytes]:
        if self.key_file is not None:
            keys = [line.strip().encode() for line in self.key_file.read_text().splitlines() if line.strip()]
            if not keys:
                raise ValueError(f"XIDFLOW_SIGNING_KEY_FILE={self.key_file} holds no key")
            return keys
        return [self.key.get_secret_value().encode()] if self.key is not None else []


def _mac(key: bytes, record_key: bytes | None, value: bytes) -> str:
    body = _DOMAIN + len(record_key or b"").to_bytes(4, "big") + (record_key or b"") + value
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def sign(key: bytes, record_key: bytes | None, value: bytes) -> tuple[str, bytes]:
    """The header to add to the record: ``(SIGNATURE_HEADER, b"v1=<hex>")``."""
    return SIGNATURE_HEADER, f"{VERSION}={_mac(key, record_key, value)}".encode()


def verify(keys: Sequence[bytes], record_key: bytes | None, value: bytes,
           headers: Sequence[tuple[str, bytes]] | None) -> str | None:
    """None when a key verifies the record; else why it is refused."""
    found = [v for k, v in (headers or ()) if k == SIGNATURE_HEADER]
    if not found:
        return "unsigned rescue request (no xidflow-signature header)"
    if len(found) > 1:
        return "rescue request carries more than one signature"
    version, _, mac = found[0].decode("ascii", "replace").partition("=")
    if version != VERSION or not mac:
        return f"unknown signature format {found[0][:16]!r}"
    if any(hmac.compare_digest(mac, _mac(k, record_key, value)) for k in keys):
        return None
    return "rescue request signature does not verify (forged, altered, or signed with another key)"


@dataclass
class Signer:
    """The decision API's side: headers for one record (none when no key is configured)."""

    key: bytes | None

    @classmethod
    def from_settings(cls, settings: SigningSettings | None = None) -> Signer:
        keys = (settings or SigningSettings()).keys()
        return cls(keys[0] if keys else None)

    def headers(self, record_key: bytes | None, value: bytes) -> list[tuple[str, bytes]]:
        return [sign(self.key, record_key, value)] if self.key else []


@dataclass
class Verifier:
    """The actuator's side: ``check`` returns None for an authentic request, else the refusal reason."""

    keys: list[bytes]

    @classmethod
    def from_settings(cls, settings: SigningSettings | None = None) -> Verifier:
        return cls((settings or SigningSettings()).keys())

    def say_if_unchecked(self) -> None:
        """Warn that requests go unchecked: once, by what reads them (not by a tool that never does)."""
        if not self.keys:
            log.warning("XIDFLOW_SIGNING_KEY_FILE is not set: rescue requests are NOT checked for proof of origin")

    def check(self, record_key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes]] | None) -> str | None:
        return verify(self.keys, record_key, value, headers) if self.keys else None


def refusal(node: str, request_id: str | None, requested_by: str | None, reason: str,
            worker_id: str = "") -> RemediationRecord:
    """The audit record of a refused request (what the actuator writes instead of acting)."""
    return make_record(
        node=node, flow_key=request_id, action="rescue-request", outcome=Outcome.SKIPPED,
        reason=f"refused: {reason}", worker_id=worker_id,
        details={"request_id": request_id, "claimed_requested_by": requested_by, "refused": "signature"},
    )
