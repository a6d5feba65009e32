"""The typed contracts of every record on every xidflow topic.

Each model is the wire format of one topic (see ``TOPIC_RECORDS``): JSON encoded with orjson,
UTF-8, keyed by node name. Downstream consumers in other languages read the JSON Schema files
generated from these models into ``schemas/json/`` (``python -m schemas.generate``).

Compatibility rule: fields are only ever added (with defaults); ``schema_version`` is bumped when
a field's meaning changes. Unknown fields are ignored on read so that old readers keep working.

One module (about 510 lines) on purpose: the contracts of all topics are read together by downstream
consumers and generate the JSON Schema files in one pass; each model is short.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, TypeAdapter

SCHEMA_VERSION = 1


class Source(StrEnum):
    """Where a raw line came from."""

    KERNEL = "kernel"
    POD = "pod"
    PROBE = "probe"


class FaultKind(StrEnum):
    XID = "xid"
    SXID = "sxid"
    GPU_FALLEN_OFF_BUS = "gpu_fallen_off_bus"
    POD_ERROR = "pod_error"
    HEALTH_CHECK = "health_check"
    KERNEL_SEGFAULT = "kernel_segfault"


class Reporter(StrEnum):
    """Who printed an SXid report: the NVSwitch driver (its kernel line) or Fabric Manager (its own log)."""

    DRIVER = "driver"
    FABRIC_MANAGER = "fabric_manager"


class Action(StrEnum):
    """NVIDIA's immediate-resolution buckets, in increasing order of disruption."""

    IGNORE = "IGNORE"
    RESTART_APP = "RESTART_APP"
    ALERT = "ALERT"
    """Tell a person (Warning Event and node condition), keep the node in service: codes NVIDIA left unbucketed."""
    RESET_GPU = "RESET_GPU"
    REBOOT_NODE = "REBOOT_NODE"
    CONTACT_SUPPORT = "CONTACT_SUPPORT"

    @property
    def rank(self) -> int:
        return _ACTION_RANK[self]

    @property
    def quarantines(self) -> bool:
        """True when the default policy takes the node out of scheduling for this action."""
        return self in (Action.RESET_GPU, Action.REBOOT_NODE, Action.CONTACT_SUPPORT)

    @staticmethod
    def most_severe(*actions: Action) -> Action:
        return max(actions, key=lambda a: a.rank)


_ACTION_RANK = {
    Action.IGNORE: 0,
    Action.RESTART_APP: 1,
    Action.ALERT: 2,
    Action.RESET_GPU: 3,
    Action.REBOOT_NODE: 4,
    Action.CONTACT_SUPPORT: 5,
}


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return list(Severity).index(self)


class SignalGrade(StrEnum):
    """How much a pod-log signal says about the node's hardware."""

    HARDWARE = "hardware"
    APPLICATION = "application"
    SYMPATHETIC = "sympathetic"


class Outcome(StrEnum):
    APPLIED = "applied"
    ALREADY_APPLIED = "already-applied"
    SKIPPED = "skipped"
    DRY_RUN = "dry-run"
    FAILED = "failed"


def utcnow() -> datetime:
    return datetime.now(UTC)


def _aware(v: Any) -> Any:
    # Naive datetimes are taken as UTC so that records from shippers that drop the zone compare.
    if isinstance(v, datetime) and v.tzinfo is None:
        return v.replace(tzinfo=UTC)
    return v


UtcDateTime = Annotated[datetime, BeforeValidator(_aware)]
"""The type of every datetime field of a record: a naive datetime given to a model is taken as UTC.

On the datetime fields only, not as a validator of every field (``field_validator("*")``): that one was
a Python call per field per record, about half the time of decoding a ``FaultEvent`` or building a
``NodeIncident``, for the two to four fields it could change. A string (JSON input) is parsed as before.
"""


def stable_id(*parts: object) -> str:
    """A deterministic 32-hex-digit id: the same inputs give the same id on every replica.

    The BLAKE2b-128 of each part's ``str`` followed by a unit separator (0x1F), in UTF-8 (surrogates
    passed through). Hashed as one joined string: the aggregation takes two per incident, and one
    ``update`` per part and separator cost 40% more (tests/unit/test_stable_id.py pins the bytes).
    """
    if not parts:
        return _blake2b(digest_size=16).hexdigest()
    text = "\x1f".join(map(str, parts)) + "\x1f"
    return _blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


_blake2b = hashlib.blake2b


class Record(BaseModel):
    """Base of every wire record: JSON via orjson, unknown fields ignored on read."""

    model_config = ConfigDict(extra="ignore", use_enum_values=False, frozen=False)

    schema_version: int = SCHEMA_VERSION

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.model_dump(mode="json"))

    @classmethod
    def from_bytes(cls: type[R], data: bytes | str) -> R:
        return cls.model_validate_json(data)


R = TypeVar("R", bound=Record)


class CompiledJsonRecord(Record):
    """A record whose ``to_bytes`` is pydantic's compiled JSON encoder instead of orjson over ``model_dump``.

    The same bytes for records without a float or ``Any`` field (the two encoders agree on strings, integers,
    null, lists and the datetimes pydantic formats either way; tests/unit/test_record_encoding.py checks both
    the bytes and that no subclass has such a field), in about 60% of the time and without the intermediate
    dict. The aggregation encodes one or two of them per fault event. Records that may carry floats
    (``FaultEvent.detail``) keep orjson: their digits are not proven equal.
    """

    def to_bytes(self) -> bytes:
        return self.__pydantic_serializer__.to_json(self)


class LogRecord(Record):
    """One normalised input line, whatever shipper produced it."""

    type: Literal["log"] = "log"
    node: str = Field(min_length=1, max_length=253, description="Kubernetes node name")
    source: Source
    ts: UtcDateTime = Field(description="When the line was logged (shipper's timestamp), UTC")
    line: str = Field(description="The raw log line, prefixes included")
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    boot_id: str | None = Field(default=None, description="Node boot id when the shipper knows it")
    shipper: str = Field(default="plain", description="Adapter that produced the record")
    replay_key: str | None = Field(
        default=None,
        description="What a shipper's replay of the line repeats exactly (kmsg: boot id, sequence, time since "
        "boot); event ids use it in place of the timestamp, which a replay may shift",
    )

    @property
    def record_id(self) -> str:
        return stable_id(self.node, self.source, self.ts.isoformat(), self.pod, self.line)


class FaultEvent(Record):
    """One recognised fault signal, classified by the catalog."""

    type: Literal["fault"] = "fault"
    id: str = Field(description="Deterministic id: same input line, same id")
    node: str
    kind: FaultKind
    source: Source = Source.KERNEL
    code: int | None = Field(default=None, description="Xid/SXid code")
    subcode: int | None = Field(default=None, description="Xid 144-150 subcode, Xid 154 recovery action")
    pci: str | None = Field(default=None, description="PCI address, lowercase dddd:bb:dd.f")
    gpu_uuid: str | None = None
    nvswitch: str | None = Field(default=None, description="nvidia-nvswitchN device for SXid")
    link: int | None = None
    fatal: bool | None = Field(default=None, description="Fatality printed in the line (SXid, NVLink5)")
    gpu_instance: int | None = Field(
        default=None, description="MIG GPU instance the driver attributed the Xid to (GPU-I:<n> in the line)"
    )
    compute_instance: int | None = Field(
        default=None, description="MIG compute instance the driver attributed the Xid to (GPU-CI:<n> in the line)"
    )
    reporter: Reporter | None = Field(
        default=None,
        description="SXid: who printed the report (driver: the kernel line; fabric_manager: Fabric Manager's log). "
        "One fault both print is one incident (the aggregation counts the fuller reporter's reports)",
    )
    pid: int | None = None
    process: str | None = None
    grade: SignalGrade | None = Field(default=None, description="Pod signals: hardware/application/sympathetic")
    action: Action
    severity: Severity
    sticky: bool = Field(default=False, description="Catalog says repeats point to hardware")
    name: str = Field(default="", description="Catalog name of the code")
    detail: dict[str, Any] = Field(
        default_factory=dict,
        description="Code-specific fields (GPC/TPC/SM, registers; Fabric Manager's physical_id and fid; a pod "
        "signal's cuda_error name and cuda_error_code number)",
    )
    ts: UtcDateTime = Field(description="When the line was logged")
    ingested_at: UtcDateTime = Field(default_factory=utcnow)
    line: str = ""
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    boot_id: str | None = None

    @property
    def quarantine(self) -> bool:
        return self.action.quarantines


class NodeIncident(CompiledJsonRecord):
    """A debounced, classified decision about one node."""

    type: Literal["incident"] = "incident"
    incident_id: str
    node: str
    signature: str = Field(description="Primary signature, e.g. 'xid:79:0000:4e:00.0'")
    signatures: list[str] = Field(default_factory=list)
    kind: FaultKind
    code: int | None = None
    pci: str | None = None
    gpu_uuid: str | None = None
    gpu_instance: int | None = Field(
        default=None, description="MIG GPU instance the incident's faults were attributed to (None: the whole GPU)"
    )
    compute_instance: int | None = Field(
        default=None, description="MIG compute instance of the event that opened the incident, when printed"
    )
    count: int = 1
    first_seen: UtcDateTime
    last_seen: UtcDateTime
    opened_at: UtcDateTime = Field(default_factory=utcnow)
    revision: int = Field(default=0, description="Bumped when an open incident is escalated")
    severity: Severity
    action: Action
    quarantine: bool
    escalation_reason: str | None = None
    evidence_ids: list[str] = Field(default_factory=list)
    boot_id: str | None = None
    line: str = Field(default="", description="First log line of the incident")
    source_ts: UtcDateTime | None = Field(default=None, description="Log time of the line that opened it")


class NodeRecovered(CompiledJsonRecord):
    """An incident is over: a reboot whose checks passed, a quiet period, a person's reset, or a later code that
    cancels it (NVIDIA's catalog: Xid 162, power smoothing re-engaged, cancels Xid 163)."""

    type: Literal["recovered"] = "recovered"
    incident_id: str
    node: str
    reason: Literal["reboot", "quiet", "manual", "cancelled"]
    boot_id: str | None = None
    recovered_at: UtcDateTime = Field(default_factory=utcnow)
    detail: str = ""
    cancelled_by: str | None = Field(
        default=None, description="cancelled: the signature of the event that cancels the incident (xid:162:...)"
    )
    evidence_ids: list[str] = Field(
        default_factory=list, description="cancelled: the fault event ids that cancel it (the evidence)"
    )


class FabricSignal(CompiledJsonRecord):
    """A node reported a fabric-class fault (NCCL transport, NVLink, SXid, fallen off the bus).

    Emitted by the aggregation on ``gpu.fabric.signals``, keyed by node, at most once per node per
    ``debounce_window_s`` of event time while the faults go on: the input of the shared-part
    correlation (``pipeline.aggregate.sharedparts``), which groups nodes by the topology labels the policy
    names. It says nothing about the node alone; the node's own incidents are separate records.
    """

    type: Literal["fabric_signal"] = "fabric_signal"
    signal_id: str = Field(description="Deterministic: from the node and the first event id of the burst")
    node: str
    kind: FaultKind
    code: int | None = None
    signature: str = Field(description="Signature of the event that started the burst")
    fault_class: str = Field(description="nccl_transport, nvlink, sxid or gpu_lost")
    ts: UtcDateTime = Field(description="Log time of the event that started the burst")
    event_ids: list[str] = Field(default_factory=list)


class SharedPartIncident(Record):
    """Fabric-class faults from at least ``min_nodes`` nodes sharing a topology label value within
    ``window_s``: one incident about the part (switch, tray, rack), not one per node.

    The actuator opens it (``pipeline.actuator.sharedparts``) and applies the policy's shared-part rule;
    it travels in the audit record of each of its effects (``RemediationRecord.shared_part``).
    ``revision`` is bumped when more nodes join.
    """

    type: Literal["shared_part"] = "shared_part"
    incident_id: str = Field(description="Deterministic: from the label, the value and the opening signal")
    label: str = Field(description="Topology label key, e.g. topology.kubernetes.io/rack")
    value: str = Field(description="The shared value of that label")
    part: str = Field(description="Short name of the label in the policy (the taint key's suffix)")
    nodes: list[str] = Field(description="Nodes that reported fabric faults within the window, sorted")
    fault_classes: list[str] = Field(default_factory=list)
    signatures: list[str] = Field(default_factory=list)
    first_seen: UtcDateTime
    last_seen: UtcDateTime
    opened_at: UtcDateTime = Field(default_factory=utcnow)
    revision: int = 0
    min_nodes: int
    window_s: float
    rule: str = Field(default="", description="Name of the policy's shared-part rule")


RescueActionName = Literal["cordon", "drain", "reboot", "enableWarmStandby", "unCordon"]
"""Actions a third party may request; the actuator's action registry checks it offers each of them."""


class RescueAction(BaseModel):
    """One step of a plan in the record: the action and the seconds to wait after it."""

    model_config = ConfigDict(extra="ignore")

    name: RescueActionName
    waittime: int = Field(default=0, ge=0)


class RescueActionRequest(Record):
    """A third-party plan for one node, on ``gpu.remediation.requests`` keyed by ``node_name``.

    ``request_id`` is the idempotency key of the whole plan: the actuator executes each id once, so a
    client retry (same ``Idempotency-Key``) or a redelivery never runs a plan twice.
    """

    type: Literal["rescue_request"] = "rescue_request"
    request_id: str = Field(description="Deterministic: from the Idempotency-Key, else from the body and received_at")
    node_name: str
    xid: int
    escalate_time: UtcDateTime
    actions: list[RescueAction] = Field(min_length=1)
    received_at: UtcDateTime
    requested_by: str = Field(description="Name of the API token that made the request")
    idempotency_key: str | None = None

    @property
    def node(self) -> str:
        return self.node_name

    @property
    def total_wait_seconds(self) -> int:
        return sum(action.waittime for action in self.actions)


def _record_type(value: Any) -> str | None:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


ActuatorInput = Annotated[
    Annotated[NodeIncident, Tag("incident")]
    | Annotated[NodeRecovered, Tag("recovered")]
    | Annotated[RescueActionRequest, Tag("rescue_request")]
    | Annotated[FabricSignal, Tag("fabric_signal")],
    Discriminator(_record_type),
]
"""Everything the actuator consumes: incidents and recoveries (incidents topic), fabric signals, rescue requests."""

ACTUATOR_INPUT: TypeAdapter[NodeIncident | NodeRecovered | RescueActionRequest | FabricSignal] = TypeAdapter(
    ActuatorInput
)


class HealthCheckResult(Record):
    """One node-side check (NVML), produced by ``xidflow probe``."""

    type: Literal["health_check"] = "health_check"
    node: str
    check: str = Field(description="gpu_count, nvlink, ecc, remapped_rows, driver")
    passed: bool
    severity: Severity = Severity.INFO
    message: str = ""
    gpu_index: int | None = None
    gpu_uuid: str | None = None
    pci: str | None = None
    values: dict[str, Any] = Field(default_factory=dict)
    boot_id: str | None = None
    ts: UtcDateTime = Field(default_factory=utcnow)


class RemediationRecord(Record):
    """What the actuator decided or did, one per decision and per effect."""

    type: Literal["remediation"] = "remediation"
    record_id: str
    node: str
    incident_id: str | None = None
    action: str
    outcome: Outcome
    reason: str = ""
    started_at: UtcDateTime = Field(default_factory=utcnow)
    finished_at: UtcDateTime = Field(default_factory=utcnow)
    worker_id: str = ""
    dry_run: bool = False
    details: dict[str, Any] = Field(default_factory=dict)
    workload: WorkloadSummary | None = Field(
        default=None, description="notifyWorkload: the pods on the node, their owners, which are on the faulty GPU"
    )
    shared_part: SharedPartIncident | None = Field(
        default=None, description="Shared-part rule: the part blamed (label, value, nodes) instead of the node"
    )


class DeadLetterCode(StrEnum):
    """Why a record became a dead letter: a closed set (metric label values); the free text is ``reason``."""

    EMPTY = "empty"
    OVERSIZE = "oversize"
    INVALID_JSON = "invalid_json"
    UNKNOWN_SHAPE = "unknown_shape"
    NO_NODE = "no_node"
    INVALID_RECORD = "invalid_record"
    UPSTREAM_LOSS = "upstream_loss"
    TRUNCATED = "truncated"
    PARSE_ERROR = "parse_error"
    OUTPUT_FAILED = "output_failed"
    MORE_PROBLEMS = "more_problems"
    UNDECODABLE = "undecodable"  # a record batch no client can decode (corrupt): the marker names its offsets
    TOO_MANY_LINES = "too_many_lines"  # a record past XIDFLOW_PARSE_MAX_LINES_PER_RECORD: its first lines parsed
    NODE_OVER_BUDGET = "node_over_budget"  # a node's records past XIDFLOW_PARSE_MAX_KEY_BYTES_PER_BATCH in a batch
    OTHER = "other"


DEAD_LETTER_MAX_PAYLOAD = 65536
"""Characters of the input kept in a dead letter (a dead letter stays far below Kafka's 1 MiB limit)."""
DEAD_LETTER_MAX_TEXT = 2048
"""Characters kept of a dead letter's reason and key."""


class DeadLetter(Record):
    """Input that could not be understood, with why. Nothing is dropped silently."""

    type: Literal["dead_letter"] = "dead_letter"
    stage: str = Field(description="Which stage rejected it (adapter, parse, actuator, ...)")
    reason: str
    code: DeadLetterCode = Field(
        default=DeadLetterCode.OTHER, description="Why, as one of a closed set (the metric label); reason says more"
    )
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None
    key: str | None = None
    payload: str = Field(default="", description="The input, UTF-8 with replacement, truncated to 64 KiB")
    payload_truncated: bool = False
    received_at: UtcDateTime = Field(default_factory=utcnow)

    @classmethod
    def of(
        cls,
        stage: str,
        reason: str,
        payload: bytes | str | None,
        code: DeadLetterCode = DeadLetterCode.OTHER,
        max_payload: int = DEAD_LETTER_MAX_PAYLOAD,
        **kw: Any,
    ) -> DeadLetter:
        if payload is None:
            text = ""
        elif isinstance(payload, bytes):
            text = payload[:max_payload].decode("utf-8", "replace")
        else:
            text = payload[:max_payload]
        size = len(payload) if payload is not None else 0
        key = kw.pop("key", None)
        if isinstance(key, str):
            key = _clip(key)
        return cls(
            stage=stage, reason=_clip(reason), code=code, payload=text, payload_truncated=size > max_payload,
            key=key, **kw,
        )


def _clip(text: str, limit: int = DEAD_LETTER_MAX_TEXT) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text) - limit} more characters]"


ALL_RECORDS: tuple[type[Record], ...] = (
    LogRecord,
    FaultEvent,
    NodeIncident,
    NodeRecovered,
    HealthCheckResult,
    RemediationRecord,
    DeadLetter,
    FabricSignal,
    SharedPartIncident,
    RescueActionRequest,
)


# -- the workload on a faulty node (issue 15): typed part of a RemediationRecord ---------------------------
class WorkloadOwner(BaseModel):
    """The top-level owner of a pod as its ownerReferences name it (ReplicaSet -> Deployment and
    Job -> JobSet/CronJob/... are followed one step; custom kinds are reported, never read)."""

    model_config = ConfigDict(extra="ignore")

    kind: str
    name: str
    api_version: str = ""


class WorkloadPod(BaseModel):
    model_config = ConfigDict(extra="ignore")

    namespace: str
    name: str
    owner: WorkloadOwner | None = Field(default=None, description="None: a bare pod with no controller")
    uses_gpu: bool = Field(description="Requests an nvidia.com/ resource or has DRA resource claims")
    on_faulty_gpu: bool | None = Field(
        description="True/False from the pod's DRA allocations; None when it cannot be known (see gpu_attribution)"
    )
    affected: bool = Field(description="Gets the Warning Event and the GPU-fault pod condition")


class WorkloadSummary(BaseModel):
    """The pods on the node when the actuator handled the incident, capped at ``len(pods)``."""

    model_config = ConfigDict(extra="ignore")

    pci: str | None = Field(default=None, description="The faulty GPU's PCI address, from the incident")
    gpu_attribution: Literal["dra", "unknown"] = Field(
        description="dra: the faulty GPU was found in the node's ResourceSlices and on_faulty_gpu is known "
        "for pods with DRA allocations; unknown: which pod uses the faulty GPU cannot be known"
    )
    unknown_reason: str | None = Field(default=None, description="Why gpu_attribution is unknown")
    total: int = Field(ge=0, description="Pods on the node")
    affected: int = Field(ge=0, description="Pods that got the Event and the condition")
    omitted: int = Field(default=0, ge=0, description="Pods left out of ``pods`` by the cap")
    pods: list[WorkloadPod] = Field(default_factory=list)


RemediationRecord.model_rebuild()  # its ``workload`` field names the models above
