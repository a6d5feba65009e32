"""Actuator settings, read from ``XIDFLOW_ACTUATOR_*`` environment variables.

Each field's docstring is its description and states the default. ``python -m pipeline.runtime.configdoc``
reads them from the source (``configdoc.attribute_docstrings``); pydantic's ``use_attribute_docstrings``
cost ~50 ms of CPU at every import, a restarted actuator's start.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def is_taint_key(key: str) -> bool:
    """Whether Kubernetes accepts ``key`` as a taint key: ``[prefix/]name``, a qualified name.

    The one copy of this rule: the actuator's default taint key and policies' taint keys both use it.
    """
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return False
    return bool(_QUALIFIED_NAME.match(name))


class ActuatorSettings(BaseSettings):
    """Every knob of ``xidflow actuator``."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_ACTUATOR_", extra="ignore")

    group_id: str = "xidflow-actuator"
    """Kafka consumer group. Default ``xidflow-actuator``."""
    worker_id: str = ""
    """Written into audit records and claims. Default empty: ``<hostname>-<pid>``."""
    gpu_node_selector: str = "nvidia.com/gpu.present=true"
    """GPU fleet label selector (breaker denominator, status). Default ``nvidia.com/gpu.present=true``."""
    opt_out_label: str = "xidflow.dev/opt-out"
    """Nodes whose label has value ``true`` are never touched. Default ``xidflow.dev/opt-out``."""
    standby_label: str = "xidflow.dev/standby"
    """Label (value ``true``) of warm-standby nodes. Default ``xidflow.dev/standby``."""
    namespace: str = "xidflow-system"
    """Namespace of the breaker/drain ConfigMaps, hook Jobs and breaker Events. Default ``xidflow-system``."""
    breaker_configmap: str = "xidflow-breaker"
    """ConfigMap holding the circuit-breaker state. Default ``xidflow-breaker``."""
    drains_configmap: str = "xidflow-drains"
    """ConfigMap holding the cluster-wide drain slots. Default ``xidflow-drains``."""
    repair_budgets_configmap: str = "xidflow-repair-budgets"
    """ConfigMap holding the repair-budget slots of the RescuePolicies' ``repairBudgets`` (per node-group label
    value). Default ``xidflow-repair-budgets``."""
    shared_parts_configmap: str = "xidflow-shared-parts"
    """ConfigMap holding the shared-part correlation (one entry per topology label value). Default
    ``xidflow-shared-parts``."""
    breaker_max_share: float = Field(default=0.5, gt=0, le=1)
    """Largest share of GPU nodes quarantined within the window before the breaker trips. Default 0.5."""
    breaker_window_seconds: float = Field(default=300, gt=0)
    """Breaker window in seconds. Default 300."""
    breaker_max_nodes: int = Field(default=0, ge=0)
    """Absolute bound next to the share: the breaker trips before more than this many GPU nodes are counted
    (quarantined now or admitted within the window). Default 0: no absolute bound, the share alone."""
    breaker_reserve_block: int = Field(default=0, ge=0, le=100_000)
    """Headroom slots each replica reserves in the breaker's ConfigMap and admits from without a write
    (``pipeline.actuator.breaker``). Default 0: none, every admission batch is one conditional write. More
    saves a burst the replicas' write conflicts on that ConfigMap, but the block of a SIGKILLed replica is
    held until it lapses (20 s): nodes that need it wait that long (measured: failover p99 2 s -> 20 s)."""
    fleet_cache_seconds: float = Field(default=10, ge=0)
    """How long the GPU node count is cached, in seconds. Default 10."""
    attempt_cap: int = Field(default=3, ge=1)
    """Disruptive flows (drain/reboot/reset) per node in the window before CONTACT_SUPPORT. Default 3."""
    attempt_window_seconds: float = Field(default=86400, gt=0)
    """Attempt-cap window in seconds. Default 86400."""
    max_concurrent_drains: int = Field(default=5, ge=1)
    """Cluster-wide limit on nodes draining at once. Default 5."""
    dry_run: bool = False
    """Audit every decision as ``dry-run`` and mutate nothing. Default false."""
    manual_only: bool = False
    """Automatic policies off: incidents are audited as skipped, only rescue requests act. Default false."""
    policy_source: Literal["auto", "crd", "file"] = "auto"
    """``crd``, ``file``, or ``auto`` (the CRDs when installed, else the file). Default ``auto``."""
    policy_file: str = ""
    """YAML file of RescuePolicy/WarmStandbyPolicy documents. Default empty: built-in global rule only."""
    policy_label_selector: str = ""
    """Only CRD policies carrying these labels are loaded. Default empty: all."""
    policy_refresh_seconds: float = Field(default=30, gt=0)
    """How often CRD policies are reloaded, in seconds. Default 30."""
    taint_key: str = "nvidia.com/gpu-fault"
    """Quarantine taint key when a rule does not set one. Default ``nvidia.com/gpu-fault``."""
    taint_effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"
    """Quarantine taint effect when a rule does not set one. Default ``NoSchedule``."""
    api_concurrency: int = Field(default=32, ge=1)
    """Parallel Kubernetes API calls (thread pool size). Default 32."""
    api_keep_warm_seconds: float = Field(default=30, ge=0)
    """How often the connections to the API server of idle call slots are used (a ``GET /version`` each),
    so that each slot keeps one open and a burst's first calls pay no TLS handshake, in seconds; 0: never.
    Default 30 (the API server closes a connection idle for 90 s)."""
    max_in_flight: int = Field(default=5000, ge=1)
    """Records fetched but not finished before the consumer pauses fetching. Default 5000."""
    commit_interval_seconds: float = Field(default=0.5, gt=0)
    """How often finished offsets are committed, in seconds. Default 0.5."""
    retry_initial_seconds: float = Field(default=0.5, gt=0)
    """First backoff when the API server is unreachable or answers 5xx, in seconds. Default 0.5."""
    retry_max_seconds: float = Field(default=30, gt=0)
    """Backoff ceiling in seconds. Default 30."""
    claim_timeout_seconds: float = Field(default=15, gt=0)
    """Lease period of a long step (drain, reboot, resetGpu, enableWarmStandby) and of a drain slot: the holder
    renews it every third of it while the step runs, and a claim not renewed for this long is retaken by the
    replica that owns the node. Default 15."""
    resync_seconds: float = Field(default=10, gt=0)
    """How often every owned node is looked at again, besides the Node watch (informer resync). Default 10."""
    ledger_max_flows: int = Field(default=20, ge=1)
    """Flows remembered in a node's ledger annotation. Default 20."""
    reboot_job_template: str = ""
    """YAML file of the default privileged reboot Job template. Default empty: built-in template."""
    reset_job_template: str = ""
    """YAML file of the default GPU-reset Job template. Default empty: built-in template."""
    diagnostics_job_template: str = ""
    """YAML file of the diagnostics Job template (the ``diagnose`` gate; its container writes the result to its
    termination message, docs/repair.md). Default empty: built-in template, DCGM diagnostics level 2
    (``dcgmi diag -r 2``)."""
    hook_service_account: str = "xidflow-node-ops"
    """ServiceAccount (no RBAC, no token) that reboot/GPU-reset Jobs run as. Default ``xidflow-node-ops``."""

    @field_validator("taint_key")
    @classmethod
    def _taint_key_kubernetes_accepts(cls, value: str) -> str:
        if not is_taint_key(value):
            raise ValueError(
                "not a Kubernetes taint key: at most 63 letters, digits, '-', '_' or '.' after an optional "
                "'prefix/' (a lowercase DNS subdomain), starting and ending with a letter or digit"
            )
        return value

    @field_validator("reboot_job_template", "reset_job_template", "diagnostics_job_template")
    @classmethod
    def _template_file_exists(cls, value: str) -> str:
        if value and not Path(value).is_file():
            raise ValueError(f"no such file: {value}")
        return value

