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
    logs_kernel: str = Field(default="gpu.logs.kernel", description="Raw kernel lines (kmsg/journald/syslog)")
    logs_pods: str = Field(default="gpu.logs.pods", description="Raw pod/container log lines")
    health_checks: str = Field(default="gpu.health.checks", description="HealthCheckResult records from the probe")
    deadletter: str = Field(default="gpu.logs.deadletter", description="DeadLetter records: input nobody understood")
    fault_events: str = Field(default="gpu.fault.events", description="FaultEvent records, keyed by node")
    incidents: str = Field(default="gpu.node.incidents", description="NodeIncident and NodeRecovered records")
    remediation_audit: str = Field(default="gpu.remediation.audit", description="RemediationRecord audit trail")
    remediation_requests: str = Field(
        default="gpu.remediation.requests", description="RescueActionRequest records from the decision API")

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
