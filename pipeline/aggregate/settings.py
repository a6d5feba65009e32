"""Windows and thresholds of the aggregation rules (``XIDFLOW_AGG_<FIELD>``).

A module of its own because both halves of the rules read it: ``pipeline.aggregate.aggregator.Aggregator``
(incidents, evidence) and ``pipeline.aggregate.rules`` (escalation, recovery, expiry). The state they
act on is ``pipeline.aggregate.state``.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.records import Action


class AggregationSettings(BaseSettings):
    """Windows and thresholds of the aggregation rules (environment: ``XIDFLOW_AGG_<FIELD>``)."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_AGG_", extra="ignore")

    debounce_window_s: float = Field(
        default=60.0, ge=0, le=604_800,
        description="Default 60. Occurrences of one signature closer than this (event time) are one burst: "
        "they raise the count and last-seen only.",
    )
    summary_interval_s: float = Field(
        default=300.0, ge=0, le=604_800,
        description="Default 300. An open incident whose count grew is re-emitted (revision+1) at most once "
        "per this many seconds of wall time; 0 disables count updates.",
    )
    quiet_period_s: float = Field(
        default=900.0, gt=0, le=2_592_000,
        description="Default 900. A transient (non-quarantining) incident with no new occurrence for this "
        "long (wall time) is closed with NodeRecovered(reason='quiet').",
    )
    escalation_window_s: float = Field(
        default=86400.0, gt=0, le=31_536_000,
        description="Default 86400 (24 h). Bursts older than this no longer count as repeats.",
    )
    sticky_codes: frozenset[int] = Field(
        default=frozenset(),
        description="Default empty. Xid codes whose repeats point to hardware, in addition to the catalog's "
        "sticky rows (the catalog is the source: set `sticky: true` there through catalog overrides).",
    )
    sticky_repeat_threshold: int = Field(
        default=2, ge=1, le=10_000,
        description="Default 2. Bursts of a sticky code on one GPU that escalate its incident."
    )
    sticky_escalated_action: Action = Field(
        default=Action.CONTACT_SUPPORT,
        description="Default CONTACT_SUPPORT. Action of a repeating sticky code (repeated -> replace).",
    )
    xid13_repeat_threshold: int = Field(
        default=3, ge=1, le=10_000,
        description="Default 3. Bursts of Xid 13 on the same GPU, GPC and TPC that escalate."
    )
    xid13_escalated_action: Action = Field(
        default=Action.RESET_GPU, description="Default RESET_GPU. Action of Xid 13 repeating on one GPC/TPC."
    )
    xid31_repeat_threshold: int = Field(
        default=3, ge=1, le=10_000, description="Default 3. Bursts of Xid 31 on the same GPU that escalate."
    )
    xid31_escalated_action: Action = Field(
        default=Action.RESET_GPU, description="Default RESET_GPU. Action of Xid 31 repeating on one GPU."
    )
    corroboration_window_s: float = Field(
        default=300.0, ge=0, le=604_800,
        description="Default 300. Sympathetic pod errors within this (event time) of kernel evidence on the "
        "node are attached to it as evidence; alone they open nothing.",
    )
    xid45_follow_window_s: float = Field(
        default=300.0, ge=0, le=604_800,
        description="Default 300. Xid 45 within this of another Xid on the node joins that incident; alone "
        "it is noise.",
    )
    fallen_off_bus_merge_window_s: float = Field(
        default=300.0, ge=0, le=604_800,
        description="Default 300. 'Fallen off the bus' and Xid 79 for one PCI within this are one burst of "
        "one incident.",
    )
    reboot_min_passing_checks: int = Field(
        default=1, ge=1, le=100,
        description="Default 1. After a new boot id, this many distinct health checks must pass (and none "
        "fail) before the incidents of the old boot are closed with NodeRecovered(reason='reboot').",
    )
    max_evidence_ids: int = Field(default=32, ge=1, le=10_000,
    description="Default 32. Evidence ids kept per incident.")
    max_pending_evidence: int = Field(
        default=64, ge=1, le=10_000,
        description="Default 64. Xid 45 / sympathetic events held per node waiting for a kernel Xid.",
    )
    max_signatures: int = Field(default=16, ge=1, le=1000,
    description="Default 16. Distinct signatures kept per incident.")
    fabric_signals: bool = Field(
        default=True,
        description="Default true. Fabric-class events (NCCL transport, NVLink, SXid, fallen off the bus) also "
        "emit a FabricSignal (at most one per node per debounce window) for the actuator's shared-part "
        "correlation (pipeline.aggregate.sharedparts); the node's own incidents are unchanged.",
    )
    recent_ids: int = Field(
        default=64, ge=1, le=100_000,
        description="Default 64. Recent event ids remembered per node to drop redelivered events."
    )
