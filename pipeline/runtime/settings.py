"""Process-wide settings read from the environment (``XIDFLOW_*``), with documented defaults.

Each stage keeps its own settings class next to its code; this module holds what every stage
shares: where Kafka is and what the topics are called.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, Field, SecretStr, ValidationError, field_validator, model_validator
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
    fabric_signals: str = Field(
        default="gpu.fabric.signals",
        description="FabricSignal records (fabric-class faults per node) for the actuator's shared-part correlation",
    )
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
    """Where the Kafka cluster is and how to authenticate to it (every process, every client).

    ``KAFKA_BOOTSTRAP_SERVERS`` (and, on a secured broker, the credentials) is what `xidflow local
    env` prints. A combination that cannot work (SASL without a mechanism, a client key without
    its certificate, two password sources, ...) is refused at start, naming the variable.
    """

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True, env_ignore_empty=True)

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

    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT",
        validation_alias="KAFKA_SECURITY_PROTOCOL",
        description="PLAINTEXT, SSL (TLS, optionally mTLS), SASL_PLAINTEXT or SASL_SSL",
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = Field(
        default=None,
        validation_alias="KAFKA_SASL_MECHANISM",
        description="SASL mechanism (required with SASL_*): PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER",
    )
    sasl_username: str | None = Field(
        default=None, validation_alias="KAFKA_SASL_USERNAME", description="SASL user (PLAIN, SCRAM-*)"
    )
    sasl_password: SecretStr | None = Field(
        default=None, validation_alias="KAFKA_SASL_PASSWORD",
        description="SASL password (PLAIN, SCRAM-*); or use KAFKA_SASL_PASSWORD_FILE",
    )
    sasl_password_file: Path | None = Field(
        default=None, validation_alias="KAFKA_SASL_PASSWORD_FILE",
        description="File holding the SASL password (a mounted Secret); read at start",
    )
    sasl_oauth_token_file: Path | None = Field(
        default=None, validation_alias="KAFKA_SASL_OAUTH_TOKEN_FILE",
        description="OAUTHBEARER: file holding the token (JWT, or JSON token+expiry); re-read before expiry",
    )
    sasl_oauth_token_command: str | None = Field(
        default=None, validation_alias="KAFKA_SASL_OAUTH_TOKEN_COMMAND",
        description="OAUTHBEARER: shell command printing a token (same formats as the file); re-run before expiry",
    )
    sasl_oauth_refresh_margin_s: float = Field(
        default=60.0, ge=0, validation_alias="KAFKA_SASL_OAUTH_REFRESH_MARGIN_S",
        description="Fetch a new OAUTHBEARER token this long before the current one expires",
    )
    sasl_oauth_default_lifetime_s: float = Field(
        default=300.0, gt=0, validation_alias="KAFKA_SASL_OAUTH_DEFAULT_LIFETIME_S",
        description="Lifetime assumed for an OAUTHBEARER token that carries no expiry",
    )
    ssl_cafile: Path | None = Field(
        default=None, validation_alias="KAFKA_SSL_CAFILE",
        description="PEM CA bundle that signed the brokers' certificates (default: the system CAs)",
    )
    ssl_certfile: Path | None = Field(
        default=None, validation_alias="KAFKA_SSL_CERTFILE", description="PEM client certificate (mTLS)",
    )
    ssl_keyfile: Path | None = Field(
        default=None, validation_alias="KAFKA_SSL_KEYFILE", description="PEM client private key (mTLS)",
    )
    ssl_check_hostname: bool = Field(
        default=True, validation_alias="KAFKA_SSL_CHECK_HOSTNAME",
        description="Verify that the broker certificate names the host connected to",
    )

    api_sasl_username: str | None = Field(
        default=None, validation_alias="KAFKA_API_SASL_USERNAME",
        description="The decision API's own SASL user (the only writer of rescue requests); default: the process's",
    )
    api_sasl_password_file: Path | None = Field(
        default=None, validation_alias="KAFKA_API_SASL_PASSWORD_FILE",
        description="Password file of KAFKA_API_SASL_USERNAME (a mounted Secret)",
    )

    def for_api(self) -> KafkaSettings:
        """The settings of the decision API's producer: its own principal when one is configured."""
        if self.api_sasl_username is None:
            return self
        return self.model_copy(update={"sasl_username": self.api_sasl_username, "sasl_password": None,
                                       "sasl_password_file": self.api_sasl_password_file})

    @property
    def uses_ssl(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    @model_validator(mode="after")
    def _coherent(self) -> KafkaSettings:
        problems = kafka_settings_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @field_validator("security_protocol", "sasl_mechanism", mode="before")
    @classmethod
    def _upper(cls, v: object) -> object:
        return v.strip().upper() if isinstance(v, str) else v


def kafka_settings_problems(s: KafkaSettings) -> list[str]:
    """Every reason the combination cannot work, each naming the variable to fix."""
    out: list[str] = []
    proto = s.security_protocol
    oauth_sources = [n for n, v in (("KAFKA_SASL_OAUTH_TOKEN_FILE", s.sasl_oauth_token_file),
                                    ("KAFKA_SASL_OAUTH_TOKEN_COMMAND", s.sasl_oauth_token_command)) if v]
    has_user = bool(s.sasl_username or s.sasl_password or s.sasl_password_file)
    if s.uses_sasl:
        if s.sasl_mechanism is None:
            out.append(f"KAFKA_SASL_MECHANISM is required with KAFKA_SECURITY_PROTOCOL={proto}")
        elif s.sasl_mechanism == "OAUTHBEARER":
            if len(oauth_sources) != 1:
                out.append("KAFKA_SASL_MECHANISM=OAUTHBEARER needs exactly one of KAFKA_SASL_OAUTH_TOKEN_FILE"
                           f" or KAFKA_SASL_OAUTH_TOKEN_COMMAND (got {oauth_sources or 'neither'})")
            if has_user:
                out.append("KAFKA_SASL_USERNAME/KAFKA_SASL_PASSWORD[_FILE] do not apply to OAUTHBEARER; unset them")
        else:
            if not s.sasl_username:
                out.append(f"KAFKA_SASL_USERNAME is required with KAFKA_SASL_MECHANISM={s.sasl_mechanism}")
            if s.sasl_password is None and s.sasl_password_file is None:
                out.append(f"KAFKA_SASL_PASSWORD or KAFKA_SASL_PASSWORD_FILE is required with "
                           f"KAFKA_SASL_MECHANISM={s.sasl_mechanism}")
            if s.sasl_password is not None and s.sasl_password_file is not None:
                out.append("set only one of KAFKA_SASL_PASSWORD and KAFKA_SASL_PASSWORD_FILE")
            if oauth_sources:
                out.append(f"{oauth_sources[0]} applies only to KAFKA_SASL_MECHANISM=OAUTHBEARER")
    else:
        extra = [n for n, v in (("KAFKA_SASL_MECHANISM", s.sasl_mechanism), ("KAFKA_SASL_USERNAME", s.sasl_username),
                                ("KAFKA_SASL_PASSWORD", s.sasl_password),
                                ("KAFKA_SASL_PASSWORD_FILE", s.sasl_password_file)) if v] + oauth_sources
        if extra:
            out.append(f"{extra[0]} is set but KAFKA_SECURITY_PROTOCOL={proto} does not use SASL "
                       "(use SASL_SSL or SASL_PLAINTEXT)")
    if not s.uses_ssl:
        extra = [n for n, v in (("KAFKA_SSL_CAFILE", s.ssl_cafile), ("KAFKA_SSL_CERTFILE", s.ssl_certfile),
                                ("KAFKA_SSL_KEYFILE", s.ssl_keyfile)) if v]
        if extra:
            out.append(f"{extra[0]} is set but KAFKA_SECURITY_PROTOCOL={proto} does not use TLS (use SSL or SASL_SSL)")
    if bool(s.ssl_certfile) != bool(s.ssl_keyfile):
        have, need = ("KAFKA_SSL_CERTFILE", "KAFKA_SSL_KEYFILE") if s.ssl_certfile else (
            "KAFKA_SSL_KEYFILE", "KAFKA_SSL_CERTFILE")
        out.append(f"{need} is required with {have} (mTLS needs both the certificate and its key)")
    if bool(s.api_sasl_username) != bool(s.api_sasl_password_file):
        out.append("KAFKA_API_SASL_USERNAME and KAFKA_API_SASL_PASSWORD_FILE go together")
    elif s.api_sasl_username and s.sasl_mechanism not in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
        out.append("KAFKA_API_SASL_USERNAME needs KAFKA_SASL_MECHANISM PLAIN or SCRAM-*")
    for name, path in (("KAFKA_SASL_PASSWORD_FILE", s.sasl_password_file),
                       ("KAFKA_SASL_OAUTH_TOKEN_FILE", s.sasl_oauth_token_file),
                       ("KAFKA_API_SASL_PASSWORD_FILE", s.api_sasl_password_file),
                       ("KAFKA_SSL_CAFILE", s.ssl_cafile), ("KAFKA_SSL_CERTFILE", s.ssl_certfile),
                       ("KAFKA_SSL_KEYFILE", s.ssl_keyfile)):
        if path is not None and not path.is_file():
            out.append(f"{name}={path}: no such file")
    return out


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
        default=0.3,
        gt=0,
        description="Default 0.3. Heartbeat interval; at most a third of the session timeout. A member learns of a "
        "rebalance only from its next heartbeat, and the partitions that move wait until every member has: a "
        "shorter interval shortens every rebalance (deploy/README.md, Failover).",
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
