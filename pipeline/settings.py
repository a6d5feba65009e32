"""Process-wide settings read from the environment (``XIDFLOW_*``), with documented defaults.

Each stage keeps its own settings class next to its code; this module holds what every stage
shares: where Kafka is and what the topics are called.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field, model_validator
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


class ConsumerGroupSettings(BaseSettings):
    """How every consumer-group member of this process (worker: Faust + parse stage; actuator) joins its group.

    Static membership (KIP-345): with an ``instance_id`` a member that crashes and restarts (same pod
    name) takes its partitions back at once, without a rebalance, as long as it returns within the
    session timeout. Without one the member is dynamic. On an orderly shutdown (SIGTERM, SIGINT) a
    member leaves its group when ``leave_on_shutdown`` (so a rolling restart or scale-down moves its
    partitions at once); a crash sends nothing, so the restarted member finds its membership waiting.
    """

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_GROUP_", extra="ignore", populate_by_name=True)

    instance_id: str = Field(
        default="",
        validation_alias=AliasChoices("XIDFLOW_GROUP_INSTANCE_ID", "POD_NAME", "instance_id"),
        description="Default: the POD_NAME variable (the chart sets it from the pod name), else empty (dynamic "
        "membership). Static group.instance.id; unique per process within a group. HOSTNAME is not used: two "
        "processes on one machine would fence each other.",
    )
    session_timeout_s: float = Field(
        default=10.0,
        ge=1,
        le=1800,
        description="Default 10. A member not heard from this long is removed and its partitions move. The "
        "broker accepts group.min/max.session.timeout.ms (6 s to 30 min by default).",
    )
    heartbeat_interval_s: float = Field(
        default=1.0, gt=0, description="Default 1. Heartbeat interval; at most a third of the session timeout."
    )
    max_poll_interval_s: float = Field(
        default=300.0,
        ge=1,
        le=3600,
        description="Default 300. Longest pause between polls before the member is considered stuck; at least "
        "the session timeout.",
    )
    leave_on_shutdown: bool = Field(
        default=True,
        description="Default true. Leave the group on an orderly shutdown so partitions move at once (rolling "
        "restart, scale-down). False: keep the static membership until the session expires (one replica "
        "that restarts in place gains nothing from leaving).",
    )

    @model_validator(mode="after")
    def _bounds(self) -> ConsumerGroupSettings:
        if self.heartbeat_interval_s * 3 > self.session_timeout_s:
            raise ValueError(
                f"heartbeat_interval_s ({self.heartbeat_interval_s:g}) must be at most a third of "
                f"session_timeout_s ({self.session_timeout_s:g})"
            )
        if self.max_poll_interval_s < self.session_timeout_s:
            raise ValueError(
                f"max_poll_interval_s ({self.max_poll_interval_s:g}) must be at least "
                f"session_timeout_s ({self.session_timeout_s:g})"
            )
        return self

    def consumer_options(self) -> dict[str, int | str | None]:
        """aiokafka ``AIOKafkaConsumer`` keyword arguments for group membership and liveness."""
        return {
            "group_instance_id": self.instance_id or None,
            "session_timeout_ms": int(self.session_timeout_s * 1000),
            "heartbeat_interval_ms": int(self.heartbeat_interval_s * 1000),
            "max_poll_interval_ms": int(self.max_poll_interval_s * 1000),
            # A request must outlive the session (a JoinGroup waits up to it).
            "request_timeout_ms": int(max(40.0, self.session_timeout_s + 10) * 1000),
        }
