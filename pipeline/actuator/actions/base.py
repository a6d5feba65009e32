"""What an action is: its traits, its runner, the typed result of a step, and what a runner may use.

Pure declarations; nothing here talks to the cluster. Each action module builds one ``ActionDef``
and the package registers it (``pipeline.actuator.actions.REGISTRY``).

The actions are the layer below ``plan``, ``policy`` and ``policystore``, which derive their lists
from the registry: so this package imports none of them. What a runner reads of a policy entry, a
step, a plan and the policy store is declared here as Protocols, and a macro expands to plain data
(``Expansion``) that ``plan`` turns into validated ``ActionSpec`` objects.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from schemas.records import Outcome

if TYPE_CHECKING:
    from pipeline.actuator.breaker import Breaker, DrainSlots
    from pipeline.actuator.effects import NodeChange
    from pipeline.actuator.kube import Kube
    from pipeline.actuator.nodestate import NodeWriter
    from pipeline.actuator.nodeview import NodeView
    from pipeline.actuator.ownership import Ledger
    from pipeline.actuator.problems import Problem
    from pipeline.actuator.settings import ActuatorSettings
    from schemas.records import NodeIncident


class Kind(StrEnum):
    """How the engine runs an action."""

    NODE = "node"
    """A change of the Node object, written in one conditional patch with the ledger (with its neighbours)."""
    INSTANT = "instant"
    """A short, idempotent call of its own (condition, Event); neighbours run concurrently."""
    LONG = "long"
    """Minutes of work (drain, reboot): claimed with a renewed lease so one replica runs it, and resumed."""
    MACRO = "macro"
    """Expands into other actions when planned; never runs itself."""


class StopReason(StrEnum):
    """Why a step ended the flow's progress here."""

    CANCELLED = "cancelled"
    """A person took over (manual uncordon) or the flow was cancelled: the flow ends."""
    FAILED = "failed"
    """The step failed: the flow ends, the node stays as it is."""
    HELD = "held"
    """Another live replica holds the step's lease: it drives the flow; this run stops without ending it."""
    LEASE_LOST = "lease-lost"
    """Our lease was retaken while the step ran (we were presumed dead): the new holder drives the flow."""


class ActionSpecLike(Protocol):
    """What an action reads of its policy entry (``pipeline.actuator.policy.ActionSpec``)."""

    @property
    def timeout(self) -> float | None: ...
    # taint, taintDevice, quarantine
    @property
    def key(self) -> str | None: ...
    @property
    def value(self) -> str | None: ...
    @property
    def effect(self) -> str | None: ...
    @property
    def max_tainted_devices(self) -> int | None: ...
    @property
    def per_gpu(self) -> bool: ...
    # drain
    @property
    def grace_period_cap(self) -> int | None: ...
    @property
    def excluded_namespaces(self) -> tuple[str, ...]: ...
    @property
    def force_after(self) -> float | None: ...
    @property
    def force_namespaces(self) -> tuple[str, ...]: ...
    @property
    def checkpoint_grace(self) -> float | None: ...
    # reboot, resetGpu
    @property
    def hook(self) -> str | None: ...
    @property
    def webhook_url(self) -> str | None: ...
    @property
    def job_template(self) -> dict[str, Any] | None: ...
    @property
    def uncordon_after(self) -> bool: ...
    # condition
    @property
    def condition_type(self) -> str | None: ...
    @property
    def status(self) -> str | None: ...
    @property
    def reason(self) -> str | None: ...


class StepLike(Protocol):
    """What an action reads of the step it runs (``pipeline.actuator.plan.Step``)."""

    @property
    def key(self) -> str: ...
    @property
    def spec(self) -> ActionSpecLike: ...


class PlanLike(Protocol):
    """What an action reads of the flow it runs in (``pipeline.actuator.plan.Plan``)."""

    @property
    def flow_key(self) -> str: ...
    @property
    def node(self) -> str: ...
    @property
    def escalated(self) -> bool: ...
    @property
    def problem(self) -> Problem | None: ...


class PolicySetLike(Protocol):
    """What an action reads of the policies in force (``pipeline.actuator.policy.PolicySet``)."""

    def standby_targets(self, node_labels: Mapping[str, str]) -> list[dict[str, str]]: ...


class PolicySource(Protocol):
    """Where the policies in force are read (``pipeline.actuator.policystore.PolicyStore``)."""

    @property
    def current(self) -> PolicySetLike: ...


Expansion = list[tuple[str, dict[str, Any]]]
"""What a macro stands for: (action name, ``ActionSpec`` attributes by field name), in order."""


@dataclass
class StepResult:
    outcome: Outcome
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    stop: StopReason | None = None
    owns: tuple[str, ...] = ()
    """Effect keys the step now owns (recorded with its done mark)."""
    values: dict[str, Any] = field(default_factory=dict)
    """Flow values to keep in the ledger (e.g. the standby node chosen)."""
    ledger_update: Callable[[Ledger, float], None] | None = None
    """Applied to the ledger (with the time) in the write that records the step done: what the step's verdict
    changes in the node's repair case (``pipeline.actuator.repaircase``). Pure and idempotent: it may run again
    on a 409 or after a crash."""


@dataclass
class StepContext:
    """What a runner may use: the cluster, the settings, and the flow it runs in."""

    kube: Kube
    writer: NodeWriter
    settings: ActuatorSettings
    worker: str
    plan: PlanLike
    view: NodeView
    incident: NodeIncident | None
    drains: DrainSlots
    policies: PolicySource
    breaker: Breaker | None = None
    """For a step that may take the node out of scheduling on its own (taintDevice's escalation)."""


NodeChangeFn = Callable[["NodeView", "Ledger", StepLike, "StepContext"], "NodeChange"]
RunFn = Callable[["StepContext", StepLike], Awaitable[StepResult]]
ExpandFn = Callable[[ActionSpecLike, "NodeIncident"], Expansion]
StatusChangeFn = Callable[["NodeView", StepLike, "StepContext"], "tuple[dict[str, Any] | None, StepResult]"]
EffectKeyFn = Callable[[ActionSpecLike, "ActuatorSettings", "Problem | None"], "str | None"]


@dataclass(frozen=True)
class ActionDef:
    """One action: its name in policies and requests, its traits and its runner."""

    name: str
    kind: Kind
    attrs: frozenset[str] = frozenset()
    """``ActionSpec`` attributes meaningful for it (besides ``name`` and ``waittime``)."""
    quarantining: bool = False
    """Takes the node out of scheduling: goes through the circuit breaker."""
    disruptive: bool = False
    """Disrupts workloads or hardware: counts against the per-node attempt cap."""
    requestable: bool = False
    """A third party may ask for it through the decision API."""
    dropped_on_escalation: bool = False
    """Under CONTACT_SUPPORT a person takes over: the action is left out."""
    allowed_when_breaker_open: bool = False
    """Information only: still runs while the circuit breaker is open."""
    owns: str = ""
    """What it leaves on the node and the ledger records as xidflow's (empty: nothing)."""
    undo: str = ""
    """How recovery removes it (empty: nothing to undo)."""
    effect_key: EffectKeyFn | None = None
    """Ledger ownership key of what it leaves on the node."""
    change: NodeChangeFn | None = None
    """For ``Kind.NODE``: the change to the Node (pure)."""
    run: RunFn | None = None
    """For ``Kind.INSTANT`` and ``Kind.LONG``: the runner."""
    claim_values: Callable[[NodeView], dict[str, Any]] | None = None
    """For ``Kind.LONG``: flow values recorded with the first claim (e.g. the bootID before a reboot)."""
    uses_drain_slot: bool = False
    """Holds one of the cluster-wide drain slots while it runs (renewed with its lease)."""
    uses_repair_budget: bool = False
    """Holds a slot of every repair budget the node's groups have while it runs (``pipeline.actuator.budgets``)."""
    repairs: bool = False
    """A repair: recorded in the node's repair case (``pipeline.actuator.repaircase``) when it is done."""
    expand: ExpandFn | None = None
    """For ``Kind.MACRO``: the actions it stands for, given the incident (``plan`` validates them)."""
    status_change: StatusChangeFn | None = None
    """For ``Kind.INSTANT``: the step as a status entry (pure), written with the ledger in one status write."""

    @property
    def needs_claim(self) -> bool:
        return self.kind == Kind.LONG
