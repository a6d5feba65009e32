"""Rescue and warm-standby policies: models, loading (YAML file or CRDs), validation, matching.

A ``RescuePolicy`` holds rules; each rule matches incidents by codes/kinds and a node selector and
lists ordered actions. The highest priority matching rule wins; the built-in global rule (priority
0, no codes, no selector, ``quarantine`` per the catalog's action) matches everything. A
``WarmStandbyPolicy`` maps origin-node labels to the labels of standby nodes that may replace it.
Everything here is pure: no I/O except reading a file handed in by path.

One module (about 520 lines): every model of a RescuePolicy document (rules, actions, the repair loop, shared
parts, repair budgets) is validated in one pass whose errors name the field path, and the set built from them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.actuator import checkpoint, conditions
from pipeline.actuator.actions import ACTION_NAMES, attrs_by_action
from pipeline.actuator.conditions import ConditionStatus
from pipeline.actuator.problems import OWN_CONDITION_TYPES
from pipeline.actuator.settings import is_taint_key
from pipeline.detection.catalog import Catalog
from schemas.records import FaultKind

API_GROUP = "xidflow.dev"
API_VERSION = "v1alpha1"
RESCUE_KIND = "RescuePolicy"
STANDBY_KIND = "WarmStandbyPolicy"
RESCUE_PLURAL = "rescuepolicies"
STANDBY_PLURAL = "warmstandbypolicies"

ActionName = Literal[ACTION_NAMES]  # type: ignore[valid-type]  # one list: pipeline.actuator.actions
TaintEffect = Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]
RebootHook = Literal["job", "annotation", "webhook"]


class PolicyError(ValueError):
    """An invalid policy; the message names the offending field (``spec.rules[0].actions[1].name``)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class ActionSpec(_Model):
    """One step of a rule. Attributes not meaningful for ``name`` are rejected by ``_check_attrs``."""

    name: ActionName
    waittime: float = Field(default=0, ge=0, description="Seconds to wait after this action before the next")
    timeout: float | None = Field(
        default=None, gt=0, description="Seconds drain/reboot/resetGpu may take (default per action)"
    )
    # taint
    key: str | None = Field(default=None, min_length=1, max_length=253)
    value: str | None = Field(default=None, max_length=63)
    effect: TaintEffect | None = None
    # drain
    grace_period_cap: int | None = Field(default=None, ge=0, alias="gracePeriodCap")
    excluded_namespaces: tuple[str, ...] = Field(default=(), alias="excludedNamespaces")
    force_after: float | None = Field(
        default=None, ge=0, alias="forceAfter", description="Seconds after which pods still there are deleted"
    )
    force_namespaces: tuple[str, ...] = Field(
        default=(),
        alias="forceNamespaces",
        description="The only namespaces where forceAfter may delete pods (RBAC grants delete there only)",
    )
    checkpoint_grace: float | None = Field(
        default=None, alias="checkpointGrace",
        description="drain: ask the GPU pods for a checkpoint first and evict each when it answers or after this "
        "many seconds (300, '300s', '5m'); only for faults where the GPU still runs",
    )

    @field_validator("checkpoint_grace", mode="before")
    @classmethod
    def _grace_seconds(cls, value: Any) -> Any:
        return None if value is None else checkpoint.parse_grace(value)
    # reboot / resetGpu
    hook: RebootHook | None = None
    webhook_url: str | None = Field(default=None, alias="webhookUrl")
    job_template: dict[str, Any] | None = Field(default=None, alias="jobTemplate")
    uncordon_after: bool = Field(default=False, alias="uncordonAfter")
    # condition: a well-known type other tools act on (AcceleratedHardwareReady), instead of the problem's own
    condition_type: str | None = Field(
        default=None, alias="type", description="Condition type to set instead of the problem's own (GpuXid, ...)"
    )
    status: ConditionStatus | None = Field(default=None, description="True, False or Unknown; required with type")
    reason: str | None = Field(default=None, description="CamelCase reason (default: the problem's, e.g. XidError)")

    @field_validator("status", mode="before")
    @classmethod
    def _status_text(cls, value: Any) -> Any:
        return conditions.status_text(value) if isinstance(value, bool) else value
    # taintDevice
    max_tainted_devices: int | None = Field(
        default=None, ge=0, alias="maxTaintedDevices",
        description="taintDevice: GPUs of one node xidflow may taint (default 2); one more cordons the node",
    )
    per_gpu: bool = Field(
        default=False, alias="perGpu",
        description="quarantine: take the faulty GPU out (taintDevice) instead of cordoning and tainting the node",
    )

    @model_validator(mode="after")
    def _check_attrs(self) -> ActionSpec:
        allowed = _ATTRS_BY_ACTION[self.name] | {"name", "waittime"}
        given = {f for f in self.model_fields_set}
        extra = sorted(given - allowed)
        if extra:
            alias = ActionSpec.model_fields[extra[0]].alias or extra[0]
            raise ValueError(f"{alias}: not valid for action '{self.name}'")
        if self.name == "reboot" and self.hook == "webhook" and not self.webhook_url:
            raise ValueError("webhookUrl: required when hook is 'webhook'")
        if self.job_template is not None:
            raise ValueError(
                "jobTemplate: not allowed; reboot and GPU-reset Jobs use the operator's template "
                "(XIDFLOW_ACTUATOR_REBOOT_JOB_TEMPLATE / XIDFLOW_ACTUATOR_RESET_JOB_TEMPLATE)"
            )
        if self.force_after is not None and not self.force_namespaces:
            raise ValueError("forceNamespaces: required with forceAfter (the namespaces where pods may be deleted)")
        if self.force_namespaces and self.force_after is None:
            raise ValueError("forceNamespaces: only meaningful with forceAfter")
        for namespace in self.force_namespaces:
            if not _DNS_LABEL.match(namespace):
                raise ValueError(f"forceNamespaces: {namespace!r} is not a namespace name")
        if self.key is not None and not is_taint_key(self.key):
            raise ValueError("key: not a valid taint key (an optional DNS subdomain prefix and '/', then a name)")
        self._check_condition()
        if (self.name == "taintDevice" or self.per_gpu) and self.effect == "PreferNoSchedule":
            raise ValueError("effect: a device taint is NoSchedule or NoExecute (PreferNoSchedule is for nodes)")
        if self.name == "quarantine" and self.max_tainted_devices is not None and not self.per_gpu:
            raise ValueError("maxTaintedDevices: only meaningful with perGpu")
        return self

    def _check_condition(self) -> None:
        if self.condition_type is not None:
            problem = conditions.type_error(self.condition_type)
            if problem:
                raise ValueError(f"type: {problem}")
            if self.status is None:
                raise ValueError("status: required with type (True, False or Unknown: its value on a fault)")
            if self.condition_type in OWN_CONDITION_TYPES and self.status != "True":
                raise ValueError(f"status: xidflow's own condition {self.condition_type} is True on a fault")
        elif self.status is not None:
            raise ValueError("type: required with status (the condition type to set)")
        if self.reason is not None:
            problem = conditions.reason_error(self.reason)
            if problem:
                raise ValueError(f"reason: {problem}")


_ATTRS_BY_ACTION: dict[str, set[str]] = attrs_by_action()


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
SHARED_PART_NAME_MAX = 56
"""The taint key is ``xidflow.dev/shared-<name>`` and a taint key's name is at most 63 characters."""


def label_key_error(key: str) -> str | None:
    """Why ``key`` is not a Kubernetes label key (None: it is): an optional DNS subdomain and '/', a name."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return f"{key!r}: the prefix before '/' must be a DNS subdomain"
    if not name or len(name) > 63 or not _LABEL_NAME.match(name):
        return f"{key!r} is not a label key (a name of at most 63 letters, digits, '-', '_', '.', optionally prefixed)"
    return None


def _label_key(value: str) -> str:
    problem = label_key_error(value)
    if problem:
        raise ValueError(problem)
    return value


LabelKey = Annotated[str, AfterValidator(_label_key)]
"""A Kubernetes label key (``label_key_error`` says why not)."""


class HandoffSpec(_Model):
    """Where a node goes when repairs did not hold (``hardwareInspection``): always a ``RepairRequest`` object
    (deploy/crds/repairrequests.xidflow.dev.yaml), whose status the external repair system answers; with
    ``webhookUrl`` also a CloudEvent POSTed there (docs/repair.md)."""

    webhook_url: str | None = Field(
        default=None, alias="webhookUrl", pattern=r"^https?://",
        description="Also POST the hand-off as a CloudEvent (structured JSON) to this URL",
    )


class RepairSpec(_Model):
    """The repair loop of a rule (docs/repair.md): one repair case per node and fault class in the node's ledger."""

    window: float = Field(
        default=86400, gt=0, le=30 * 86400,
        description="Seconds after a return to service within which a fault of the same class means the repair "
        "did not hold",
    )
    max_failed_repairs: int = Field(
        default=2, ge=1, le=20, alias="maxFailedRepairs",
        description="Repairs that did not hold (diagnostics failed, or the fault came back within window) before "
        "the next step is hardwareInspection instead of another repair",
    )
    handoff: HandoffSpec = Field(default_factory=HandoffSpec)


class RepairBudget(_Model):
    """At most ``maxNodes`` nodes (or ``maxShare`` of the GPU nodes) sharing a value of ``label`` in a repair step
    (drain, reboot, resetGpu, diagnose) at once, held across replicas in a ConfigMap (docs/repair.md)."""

    label: LabelKey = Field(min_length=1, max_length=317, description="Node label key that names the group")
    max_nodes: int | None = Field(default=None, ge=1, le=100_000, alias="maxNodes")
    max_share: float | None = Field(default=None, gt=0, le=1, alias="maxShare")

    @model_validator(mode="after")
    def _one_bound(self) -> RepairBudget:
        if (self.max_nodes is None) == (self.max_share is None):
            raise ValueError("maxNodes: give exactly one of maxNodes and maxShare")
        return self

    def cap(self, group_size: int) -> int:
        """Nodes of a group of ``group_size`` that may be in repair at once (a share rounds down, at least 1)."""
        if self.max_nodes is not None:
            return self.max_nodes
        assert self.max_share is not None
        return max(1, int(self.max_share * max(group_size, 0) + 1e-9))


class NodeSelector(_Model):
    operator: Literal["any", "all"] = "all"
    labels: dict[str, str] = Field(default_factory=dict)

    def matches(self, node_labels: Mapping[str, str]) -> bool:
        if not self.labels:
            return True
        hits = (node_labels.get(k) == v for k, v in self.labels.items())
        return any(hits) if self.operator == "any" else all(hits)


class Rule(_Model):
    name: str = Field(default="", description="Filled from the policy name and index when empty")
    priority: int = Field(default=0, ge=0, le=1_000_000)
    codes: tuple[int, ...] = Field(default=(), description="Xid/SXid codes; empty matches every code")
    kinds: tuple[FaultKind, ...] = Field(default=(), description="Fault kinds; empty matches every kind")
    node_selector: NodeSelector | None = Field(default=None, alias="nodeSelector")
    actions: tuple[ActionSpec, ...] = Field(min_length=1)
    repair: RepairSpec | None = Field(
        default=None, description="The repair loop (diagnostics gate, escalation, hand-off); implied by diagnose"
    )

    def matches(self, kind: FaultKind, code: int | None, node_labels: Mapping[str, str]) -> bool:
        if self.kinds and kind not in self.kinds:
            return False
        if self.codes and code not in self.codes:
            return False
        return self.node_selector is None or self.node_selector.matches(node_labels)

    @model_validator(mode="after")
    def _checkpoint_only_where_the_gpu_runs(self) -> Rule:
        # Judged against the catalog in force: what the rule names must leave a running GPU to save from.
        for index, spec in enumerate(self.actions):
            if spec.checkpoint_grace is None:
                continue
            why = checkpoint.rule_error(self.codes, self.kinds, Catalog.configured())
            if why:
                raise ValueError(
                    f"actions[{index}].checkpointGrace: not allowed for this rule's faults ({why}); "
                    "remove the option or the lost-GPU codes and kinds from the rule"
                )
        return self

    @model_validator(mode="after")
    def _repair_loop(self) -> Rule:
        names = [spec.name for spec in self.actions]
        gated = "diagnose" in names
        if self.repair is not None and not gated:
            raise ValueError("repair: needs a diagnose action (the gate that returns the node to service)")
        if gated:
            if "unCordon" in names:
                raise ValueError("actions: unCordon is not allowed with diagnose (a pass returns the node)")
            if any(spec.uncordon_after for spec in self.actions):
                raise ValueError("actions: uncordonAfter is not allowed with diagnose (a pass returns the node)")
        return self

    @property
    def repair_loop(self) -> RepairSpec | None:
        """The rule's repair loop: its ``repair`` block, the defaults when it only lists ``diagnose``, else None."""
        if self.repair is not None:
            return self.repair
        return RepairSpec() if any(spec.name == "diagnose" for spec in self.actions) else None

    @property
    def specificity(self) -> int:
        # Ties at equal priority go to the narrower rule, then to the name, so every replica agrees.
        return int(bool(self.codes)) + int(bool(self.kinds)) + int(self.node_selector is not None)


def default_part_name(label: str) -> str:
    """``topology.kubernetes.io/rack`` -> ``rack``: the label's name, lower case, as a taint key suffix."""
    name = re.sub(r"[^a-z0-9-]+", "-", label.rpartition("/")[2].lower()).strip("-")
    return (name or "part")[:SHARED_PART_NAME_MAX].rstrip("-") or "part"


class SharedPartRule(_Model):
    """Blame a shared part: fabric-class faults from ``minNodes`` nodes sharing a value of ``label`` within
    ``window`` seconds are one incident about the part (``pipeline.aggregate.sharedparts``). What happens then: a
    taint ``xidflow.dev/shared-<name>=<value>`` on each of those nodes (``taintEffect``, ``None`` for no
    taint), the node condition ``XidflowSharedPart`` naming the part (``condition``), one Warning Event and
    one audit record (which goes to the notification webhooks); never a cordon, drain or reboot, and the
    circuit breaker does not count those nodes as quarantined."""

    label: LabelKey = Field(min_length=1, max_length=317, description="Topology label key the nodes share")
    name: str = Field(default="", max_length=SHARED_PART_NAME_MAX, description="Short name; default from the label")
    min_nodes: int = Field(default=3, ge=2, le=100_000, alias="minNodes")
    window: float = Field(default=300.0, gt=0, le=86_400, description="Seconds (event time)")
    taint_effect: TaintEffect | Literal["None"] = Field(default="NoSchedule", alias="taintEffect")
    condition: bool = True

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if value and not _DNS_LABEL.match(value):
            raise ValueError(f"{value!r} must be lower-case letters, digits and '-' (a taint key suffix)")
        return value

    @property
    def part(self) -> str:
        return self.name or default_part_name(self.label)


class RescuePolicySpec(_Model):
    rules: tuple[Rule, ...] = Field(min_length=1)
    shared_parts: tuple[SharedPartRule, ...] = Field(default=(), alias="sharedParts", max_length=64)
    repair_budgets: tuple[RepairBudget, ...] = Field(default=(), alias="repairBudgets", max_length=64)


class WarmStandbySpec(_Model):
    origin_labels: dict[str, str] = Field(alias="originLabels", min_length=1)
    target_labels: dict[str, str] = Field(alias="targetLabels", min_length=1)


class WarmStandbyPolicy(_Model):
    name: str
    spec: WarmStandbySpec

    def applies_to(self, node_labels: Mapping[str, str]) -> bool:
        return all(node_labels.get(k) == v for k, v in self.spec.origin_labels.items())


DEFAULT_RULE = Rule(name="global-default", priority=0, actions=(ActionSpec(name="quarantine"),))


class PolicySet(_Model):
    """Every loaded rule (sorted, best first) and warm-standby policy."""

    rules: tuple[Rule, ...] = ()
    standby: tuple[WarmStandbyPolicy, ...] = ()
    shared_parts: tuple[SharedPartRule, ...] = ()
    """Shared-part rules of every RescuePolicy, by label (one rule per label fleet-wide)."""
    repair_budgets: tuple[RepairBudget, ...] = ()
    """Repair budgets of every RescuePolicy, by label (one budget per label fleet-wide)."""

    def select(self, kind: FaultKind, code: int | None, node_labels: Mapping[str, str]) -> Rule:
        """The rule that wins for this incident on this node: highest priority, then most specific.

        ``codes`` match the incident's Xid/SXid code. A code-less signal the catalog names as the same
        fault as an Xid counts as that Xid: "fallen off the bus" is Xid 79 (its events carry 79 already;
        this covers records that do not). Other code-less kinds match only rules without ``codes``.
        """
        if code is None:
            code = Catalog.configured().signal_xid(kind.value)
        for rule in self.rules:
            if rule.matches(kind, code, node_labels):
                return rule
        return DEFAULT_RULE

    def standby_targets(self, node_labels: Mapping[str, str]) -> list[dict[str, str]]:
        """Target label sets of every warm-standby policy whose origin labels the node carries."""
        return [p.spec.target_labels for p in self.standby if p.applies_to(node_labels)]


def _field_path(prefix: str, loc: Iterable[int | str]) -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.startswith(("function-after", "literal", "tagged-union")):
            continue
        else:
            path += f".{part}"
    return path


def _raise_for(prefix: str, exc: ValidationError) -> None:
    err = exc.errors()[0]
    path, msg = _field_path(prefix, err["loc"]), err["msg"]
    # Our own checks name the attribute first ("Value error, key: ..."): fold it into the path.
    own = re.match(r"Value error, ([\w.\[\]]+): (.*)", msg)
    if own:
        path, msg = f"{path}.{own.group(1)}", own.group(2)
    else:
        msg = msg.removeprefix("Value error, ")
    raise PolicyError(f"{path}: {msg}") from None


def parse_document(doc: Mapping[str, Any]) -> tuple[list[Rule], list[WarmStandbyPolicy]]:
    """Validate one RescuePolicy or WarmStandbyPolicy object (YAML document or CRD instance)."""
    rules, standby, _ = parse_document_parts(doc)
    return rules, standby


def parse_document_parts(
    doc: Mapping[str, Any],
) -> tuple[list[Rule], list[WarmStandbyPolicy], list[SharedPartRule]]:
    """``parse_document`` with the RescuePolicy's shared-part rules."""
    rules, standby, parts, _ = parse_document_all(doc)
    return rules, standby, parts


def parse_document_all(
    doc: Mapping[str, Any],
) -> tuple[list[Rule], list[WarmStandbyPolicy], list[SharedPartRule], list[RepairBudget]]:
    """``parse_document`` with the RescuePolicy's shared-part rules and repair budgets."""
    if not isinstance(doc, Mapping):
        raise PolicyError("document: expected a mapping")
    kind = doc.get("kind")
    api_version = doc.get("apiVersion", f"{API_GROUP}/{API_VERSION}")
    if api_version != f"{API_GROUP}/{API_VERSION}":
        raise PolicyError(f"apiVersion: expected {API_GROUP}/{API_VERSION}, got {api_version!r}")
    name = (doc.get("metadata") or {}).get("name")
    if not name or not isinstance(name, str):
        raise PolicyError("metadata.name: required")
    spec = doc.get("spec")
    if not isinstance(spec, Mapping):
        raise PolicyError(f"{kind}/{name} spec: required mapping")
    if kind == RESCUE_KIND:
        try:
            parsed = RescuePolicySpec.model_validate(spec)
        except ValidationError as exc:
            _raise_for(f"{kind}/{name} spec", exc)
        rules = [r if r.name else r.model_copy(update={"name": f"{name}[{i}]"}) for i, r in enumerate(parsed.rules)]
        parts = [p.model_copy(update={"name": p.part}) for p in parsed.shared_parts]
        return rules, [], parts, list(parsed.repair_budgets)
    if kind == STANDBY_KIND:
        try:
            return [], [WarmStandbyPolicy(name=name, spec=WarmStandbySpec.model_validate(spec))], [], []
        except ValidationError as exc:
            _raise_for(f"{kind}/{name} spec", exc)
    raise PolicyError(f"kind: expected {RESCUE_KIND} or {STANDBY_KIND}, got {kind!r}")


def build_policy_set(docs: Iterable[Mapping[str, Any]]) -> PolicySet:
    rules: list[Rule] = []
    standby: list[WarmStandbyPolicy] = []
    parts: dict[str, SharedPartRule] = {}
    budgets: dict[str, RepairBudget] = {}
    seen: set[str] = set()
    for doc in docs:
        r, s, p, b = parse_document_all(doc)
        for budget in b:
            if budget.label in budgets:  # two budgets on one label would hold two slots for one repair
                raise PolicyError(f"repairBudgets: label {budget.label!r} is named twice")
            budgets[budget.label] = budget
        for rule in r:
            if rule.name in seen:
                raise PolicyError(f"rules: duplicate rule name {rule.name!r}")
            seen.add(rule.name)
        for part in p:
            # One rule per label and per taint key: two would open two incidents about one part.
            if part.label in parts:
                raise PolicyError(f"sharedParts: label {part.label!r} is named twice")
            if any(other.part == part.part for other in parts.values()):
                raise PolicyError(f"sharedParts: name {part.part!r} is used twice (it names the taint key)")
            parts[part.label] = part
        rules += r
        standby += s
    rules.sort(key=lambda r: (-r.priority, -r.specificity, r.name))
    standby.sort(key=lambda p: p.name)
    return PolicySet(
        rules=tuple(rules), standby=tuple(standby), shared_parts=tuple(sorted(parts.values(), key=lambda p: p.label)),
        repair_budgets=tuple(sorted(budgets.values(), key=lambda b: b.label)),
    )


def load_yaml_text(text: str) -> PolicySet:
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise PolicyError(f"yaml: {exc}") from None
    flat: list[Mapping[str, Any]] = []
    for d in docs:
        # A `kind: List` wrapper (kubectl get -o yaml) is unpacked.
        flat += d.get("items", []) if isinstance(d, Mapping) and d.get("kind") == "List" else [d]
    return build_policy_set(flat)


def load_yaml_file(path: str | Path) -> PolicySet:
    """The policies of a file; :class:`PolicyError` names what is wrong (the caller names the file).

    A file that holds no document at all is refused: it is a mistake (a truncated mount, the wrong path), and
    taken as "no policies" it silently left the built-in rule alone in force. Without a policy file the
    built-in rule is what applies; say so by not setting one.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")  # OSError: the caller says it cannot read the file
    except UnicodeDecodeError as exc:
        raise PolicyError(f"not UTF-8 text (byte {exc.start} cannot be decoded)") from None
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise PolicyError(f"yaml: {exc}") from None
    if not documents:
        raise PolicyError(
            "holds no RescuePolicy or WarmStandbyPolicy document; to run with the built-in rule alone, set no "
            "policy file"
        )
    return load_yaml_text(text)
