"""Process-wide settings read from the environment (``XIDFLOW_*``), with documented defaults.

Each stage keeps its own settings class next to its code; this module holds what every stage
shares: where Kafka is and what the topics are called.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_TOPIC_CHARS = re.compile(r"^[A-Za-z0-9._-]*$")
_HOST_PORT = re.compile(r"^\[?[A-Za-z0-9._:-]+\]?:\d{1,5}$")


class TopicNames(BaseSettings):
    """Topic names. ``XIDFLOW_TOPIC_PREFIX`` is put in front of every name."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_TOPIC_", extra="ignore")

    prefix: str = Field(default="", description="Prepended to every topic name")
    logs_kernel: str = Field(default="gpu.logs.kernel", description="Raw kernel lines (kmsg/journald/syslog)")
    logs_pods: str = Field(default="gpu.logs.pods", description="Raw pod/container log lines")
    health_checks: str = Field(default="gpu.health.checks", description="HealthCheckResult records from the probe")
    deadletter: str = Field(default="gpu.logs.deadletter", description="DeadLetter records: input nobody understood")
    fault_events: str = Field(default="gpu.fault.events", description="FaultEvent records, keyed by node")
    incidents: str = Field(default="gpu.node.incidents", description="NodeIncident and NodeRecovered records")
    remediation_audit: str = Field(default="gpu.remediation.audit", description="RemediationRecord audit trail")
    remediation_requests: str = Field(
        default="gpu.remediation.requests", description="RescueActionRequest records from the decision API")

    @field_validator("*")
    @classmethod
    def _kafka_topic_name(cls, value: str, info: Any) -> str:
        if not _TOPIC_CHARS.match(value):
            raise ValueError("a Kafka topic name may only hold letters, digits, '.', '_' and '-'")
        if info.field_name != "prefix" and not value:
            raise ValueError("a topic name cannot be empty")
        if len(value) > 200:
            raise ValueError("longer than 200 characters (Kafka allows 249 with the prefix)")
        return value

    def name(self, field: str) -> str:
        return self.prefix + getattr(self, field)

    @property
    def raw_inputs(self) -> list[str]:
        return [self.name("logs_kernel"), self.name("logs_pods"), self.name("health_checks")]


class KafkaSettings(BaseSettings):
    """Where the Kafka cluster is. ``KAFKA_BOOTSTRAP_SERVERS`` is the variable `xidflow local env` sets."""

    model_config = SettingsConfigDict(extra="ignore")

    bootstrap_servers: str = Field(
        default="127.0.0.1:9092",
        validation_alias="KAFKA_BOOTSTRAP_SERVERS",
        description="Comma-separated host:port list",
    )

    @field_validator("bootstrap_servers")
    @classmethod
    def _host_port_list(cls, value: str) -> str:
        servers = [v.strip() for v in value.split(",") if v.strip()]
        if not servers:
            raise ValueError("no host:port given")
        for server in servers:
            if not _HOST_PORT.match(server) or not 0 < int(server.rsplit(":", 1)[1]) < 65536:
                raise ValueError(f"{server!r} is not host:port")
        return value


SECRET_HINTS = ("token", "secret", "password", "credential", "sasl", "api_key", "private")
"""Settings whose names hold one of these never have their value printed."""


def _env_name(model: type[BaseModel] | None, field: str) -> str:
    if model is None or field not in model.model_fields:
        return field
    alias = model.model_fields[field].validation_alias
    if isinstance(alias, str):
        return alias
    prefix = str(model.model_config.get("env_prefix", "")) if issubclass(model, BaseSettings) else ""
    return (prefix + field).upper()


def _settings_class(title: str) -> type[BaseModel] | None:
    stack: list[type] = [BaseSettings]
    while stack:
        cls = stack.pop()
        if cls.__name__ == title:
            return cls
        stack.extend(cls.__subclasses__())
    return None


def describe_validation_error(exc: ValidationError, model: type[BaseModel] | None = None) -> str:
    """One sentence per refused setting, naming its environment variable; secrets are never shown.

    ``model``: the settings class (found by the error's title when not given).
    """
    model = model or _settings_class(exc.title)
    lines = []
    for err in exc.errors(include_url=False):
        loc = [str(part) for part in err.get("loc", ())]
        msg = str(err.get("msg", "invalid"))
        if not loc:
            prefix = str(model.model_config.get("env_prefix", "")) if model is not None else ""
            lines.append(f"invalid settings {prefix.upper()}*: {msg}")
            continue
        name = _env_name(model, loc[0])
        where = name + ("." + ".".join(loc[1:]) if len(loc) > 1 else "")
        value = err.get("input")
        shown = ""
        secret = any(hint in name.lower() for hint in SECRET_HINTS)
        if not secret and isinstance(value, str | int | float) and not isinstance(value, bool):
            text = str(value)
            shown = f"={text[:80]!r}" if isinstance(value, str) else f"={text[:80]}"
        lines.append(f"invalid setting {where}{shown}: {msg}")
    return "\n".join(lines) or f"invalid settings: {exc.title}"
