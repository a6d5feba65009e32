"""Settings of the decision API, from ``XIDFLOW_API_*`` variables."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ApiSettings(BaseSettings):
    """Settings of the decision API, from ``XIDFLOW_API_*`` variables; defaults are production defaults."""

    # A malformed XIDFLOW_API_TOKENS must never echo the tokens in an error message or a log line.
    model_config = SettingsConfigDict(env_prefix="XIDFLOW_API_", extra="ignore", hide_input_in_errors=True)

    host: str = Field(default="0.0.0.0", description="Address to listen on (default all interfaces)")
    port: int = Field(default=8080, ge=0, le=65535, description="TCP port (default 8080; 0 picks a free one)")
    tokens: dict[str, SecretStr] = Field(
        default_factory=dict,
        description='Bearer tokens by client name, as JSON: XIDFLOW_API_TOKENS=\'{"ops-portal": "s3cret"}\'',
    )
    token_file: Path | None = Field(
        default=None,
        description="File of tokens, one 'name:token' (or bare token) a line, '#' comments, UTF-8; re-read "
        "when it changes, so a mounted Secret can be rotated without a restart. While it is missing every "
        "request is answered 401. Its directory must exist (a typo is refused at start)",
    )
    manual_only: bool = Field(
        default=False,
        description="When true the actuator turns its automatic policies off and only rescue requests from "
        "this API act on nodes (incidents are still audited and notified). Default false",
    )
    max_pending_plans: int = Field(
        default=20,
        ge=1,
        le=1000,
        description="Cluster-wide pending plans before 'Exceed the maximum plans limit'",
    )
    plan_grace_seconds: float = Field(
        default=3600,
        gt=0,
        le=30 * 86400,
        description="A plan the actuator never released stops counting after its wait times plus this; an "
        "Idempotency-Key is remembered (and its reuse with another body refused) as long",
    )
    namespace: str = Field(default="xidflow-system", description="Namespace of the pending-plans ConfigMap")
    plans_configmap: str = Field(default="xidflow-rescue-plans", description="Name of the pending-plans ConfigMap")
    gpu_node_selector: str = Field(
        default="nvidia.com/gpu.present=true",
        description="Label selector of GPU nodes; a node with GPU capacity counts as a GPU node too",
    )
    gpu_resource_name: str = Field(default="nvidia.com/gpu", description="Extended resource a GPU node reports")
    produce_timeout_seconds: float = Field(
        default=15,
        gt=0,
        le=600,
        description="How long to wait for Kafka to acknowledge a request before answering 503",
    )
    max_body_bytes: int = Field(
        default=65536, ge=1024, le=16 * 1024 * 1024, description="Largest request body accepted"
    )

    @field_validator("token_file")
    @classmethod
    def _token_file_place(cls, value: Path | None) -> Path | None:
        # A file not there yet is an optional Secret not created yet (served as 401 and read when it
        # appears, as the chart documents); a directory that does not exist is a mistake in the setting.
        if value is not None and (value.is_dir() or not value.parent.is_dir()):
            raise ValueError(f"{value}: not a file in an existing directory")
        return value
