"""The CloudEvents Kafka protocol binding (binary content mode) on incidents, recoveries and audit records. Pure.

A fleet-wide collector reads every cluster's incident and audit topics through the ``ce_*`` headers alone
(CloudEvents 1.0, Kafka protocol binding, binary mode: the record's value is the event's data, its
attributes are headers named ``ce_<attribute>``, the data's media type is the ``content-type`` header). What
each record carries is a contract (docs/repair.md, "CloudEvents headers"; tests/unit/test_cloudevents.py):

==========  ====================================================================================================
header      value
==========  ====================================================================================================
ce_specversion  ``1.0``
ce_id       incident: ``<incident id>.<revision>``; recovery: ``<incident id>.recovered``; audit: the record id
            (deterministic: a record sent twice has one id, as CloudEvents asks of a duplicate)
ce_source   ``XIDFLOW_CLOUDEVENTS_SOURCE`` (default ``/xidflow``) + ``/aggregation`` or ``/actuator``
ce_type     ``dev.xidflow.incident.v1``, ``dev.xidflow.recovered.v1``, ``dev.xidflow.remediation.v1``
ce_time     incident: ``opened_at``; recovery: ``recovered_at``; audit: ``finished_at`` (RFC 3339, UTC)
ce_subject  the node name
content-type  ``application/json``
==========  ====================================================================================================
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

SPEC_VERSION = "1.0"
CONTENT_TYPE = b"application/json"
TYPES = {
    "incident": "dev.xidflow.incident.v1",
    "recovered": "dev.xidflow.recovered.v1",
    "remediation": "dev.xidflow.remediation.v1",
}
"""``ce_type`` by the record's ``type``; the suffix is the schema's version (a breaking change is a new type)."""
STAGES = {"incident": "aggregation", "recovered": "aggregation", "remediation": "actuator"}


class CloudEventsSettings(BaseSettings):
    """The CloudEvents source of this deployment."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_CLOUDEVENTS_", extra="ignore")

    source: str = Field(default="/xidflow", min_length=1, max_length=200)
    """``ce_source`` prefix of incidents (``<source>/aggregation``) and audit records (``<source>/actuator``): a
    URI reference naming this deployment, e.g. ``/clusters/prod-east/xidflow``. Default ``/xidflow``."""

    @field_validator("source")
    @classmethod
    def _uri_reference(cls, value: str) -> str:
        if any(c.isspace() for c in value) or not value.isascii():
            raise ValueError("must be a URI reference (ASCII, no spaces), e.g. /clusters/prod-east/xidflow")
        return value.rstrip("/") or "/"


def source_of(prefix: str, stage: str) -> str:
    return f"{prefix.rstrip('/')}/{stage}"


def _time(value: datetime) -> str:
    value = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat().replace("+00:00", "Z")


def headers(record: Any, prefix: str) -> list[tuple[str, bytes]]:
    """The ``ce_*`` headers (and ``content-type``) of an incident, a recovery or an audit record (pure)."""
    kind = record.type
    if kind == "incident":
        event_id, at = f"{record.incident_id}.{record.revision}", record.opened_at
    elif kind == "recovered":
        event_id, at = f"{record.incident_id}.recovered", record.recovered_at
    elif kind == "remediation":
        event_id, at = record.record_id, record.finished_at
    else:
        raise ValueError(f"no CloudEvents type for records of type {kind!r}")
    return [
        ("ce_specversion", SPEC_VERSION.encode()),
        ("ce_id", event_id.encode()),
        ("ce_source", source_of(prefix, STAGES[kind]).encode()),
        ("ce_type", TYPES[kind].encode()),
        ("ce_time", _time(at).encode()),
        ("ce_subject", record.node.encode("utf-8", "surrogatepass")),
        ("content-type", CONTENT_TYPE),
    ]
