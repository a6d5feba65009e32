"""Process-wide settings read from the environment (``XIDFLOW_*``), with documented defaults.

Each stage keeps its own settings class next to its code; this module holds what every stage
shares: where Kafka is and what the topics are called.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class TopicNames(BaseSettings):
    """Topic names. ``XIDFLOW_TOPIC_PREFIX`` is put in front of every name."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_TOPIC_", extra="ignore")

    prefix: str = Field(default="", description="Prepended to every topic name")
    logs_kernel: str = "gpu.logs.kernel"
    logs_pods: str = "gpu.logs.pods"
    health_checks: str = "gpu.health.checks"
    deadletter: str = "gpu.logs.deadletter"
    fault_events: str = "gpu.fault.events"
    incidents: str = "gpu.node.incidents"
    remediation_audit: str = "gpu.remediation.audit"
    remediation_requests: str = "gpu.remediation.requests"

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
