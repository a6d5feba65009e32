"""taintDevice: quarantine one GPU, not the node, with a DRA ``DeviceTaintRule`` (KEP-5055).

A DRA driver publishes each GPU of a node as a device in a ``ResourceSlice`` with the standard
attribute ``resource.kubernetes.io/pciBusID``; the rule selects the faulty one by driver, pool and
device name. The node and its other GPUs keep serving. The taint's effect (``DEVICE_EFFECTS``):

- ``NoSchedule`` (the default): the scheduler keeps new claims off the GPU; the pods holding it keep running
  until xidflow's own drain (``drain`` with ``scope: gpu``, which the per-GPU quarantine adds) evicts them through
  the Eviction API: PodDisruptionBudgets hold and a checkpoint may be asked for first;
- ``NoExecute``: Kubernetes' device-taint eviction controller deletes the pods holding the GPU itself, within a
  second, with a plain delete: no PodDisruptionBudget, no checkpoint request (an explicit policy choice);
- ``None``: a dry run (KEP-5055): nothing is kept off or evicted, and the controller writes in the rule's status
  (condition ``EvictionInProgress``) how many pods ``NoExecute`` would evict. A dry-run rule never counts toward
  ``maxTaintedDevices``.

It escalates to the node quarantine (cordon + taint, as ``cordon`` and ``taint`` do, through the
circuit breaker) when the catalog scopes the fault to the node (``scope`` column: fallen off the
bus, Xid 154, NVLink/NVSwitch fabric, unknown codes), when no ResourceSlice of the node publishes
the PCI bus id (a cluster without DRA, an unknown device) or the API server does not serve
``DeviceTaintRule``, and when more GPUs of the node would be tainted by xidflow than the policy's
``maxTaintedDevices``. The step's reason says which.

A fault the driver attributed to a MIG GPU instance (``GPU-I:<n>`` in the Xid) taints that instance's MIG device
when the DRA driver publishes the instance on it (``pipeline.actuator.dra.mig_devices``), else the whole GPU.

Rules are named deterministically from (node, PCI bus id, device) and labelled as xidflow's: a
redelivery finds the rule it created, and undo deletes only the rules the ledger records as xidflow's
(a rule someone else made is never owned, so never deleted).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from pipeline.actuator import effects
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepLike, StepResult
from pipeline.actuator.dra import (
    GPU_INSTANCE_ATTRIBUTE,
    GROUP,
    PCI_ATTRIBUTE,
    SLICE_VERSION,
    DeviceRef,
    find_devices,
    mig_devices,
    normalise_bdf,
)
from pipeline.actuator.kube import AlreadyExists, Kube, NotFound
from pipeline.actuator.ownership import CORDON
from pipeline.detection.catalog import Catalog
from schemas.records import FaultKind, NodeIncident, Outcome, stable_id

if TYPE_CHECKING:
    from pipeline.actuator.nodeview import NodeView
    from pipeline.actuator.ownership import Ledger

RULE_VERSION = "v1beta2"
"""DeviceTaintRule: 1.36 serves it at v1beta2 only, behind the beta feature gate DRADeviceTaintRules (off by
default: ``--feature-gates=DRADeviceTaintRules=true --runtime-config=resource.k8s.io/v1beta2=true``)."""
RULES = "devicetaintrules"
MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY_VALUE = "xidflow"
NODE_LABEL = "xidflow.dev/node"
PCI_ANNOTATION = "xidflow.dev/pci-bus-id"
NODE_ANNOTATION = "xidflow.dev/node"
FLOW_ANNOTATION = "xidflow.dev/flow"
EFFECT_PREFIX = "devicetaintrule:"
DEFAULT_MAX_TAINTED_DEVICES = 2
DRY_RUN_EFFECT = "None"
DEFAULT_DEVICE_EFFECT = "NoSchedule"
DEVICE_EFFECTS = (DRY_RUN_EFFECT, "NoSchedule", "NoExecute")
"""What a DeviceTaintRule's taint may say (resource.k8s.io/v1beta2 ``DeviceTaintEffect``)."""

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


# -- pure parts ---------------------------------------------------------------------------------------
def node_label_value(node: str) -> str:
    """The node's name as a label value; a name that is no valid label value (over 63) becomes a hash."""
    return node if len(node) <= 63 and _LABEL_VALUE.match(node) else f"h-{stable_id(node)[:32]}"


def rule_name(node: str, pci: str, device: DeviceRef) -> str:
    """Deterministic per (node, PCI bus id, device): every replica and every redelivery names the same rule."""
    return effects.object_name("xidflow-gpu", node, pci, device.driver, device.pool, device.device, length=20)


def rule_body(
    name: str, node: str, pci: str, device: DeviceRef, key: str, value: str, effect: str, flow: str
) -> dict[str, Any]:
    """The DeviceTaintRule for one device, labelled as xidflow's and annotated with what it quarantines."""
    return {
        "apiVersion": f"{GROUP}/{RULE_VERSION}",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": name,
            "labels": {MANAGED_BY: MANAGED_BY_VALUE, NODE_LABEL: node_label_value(node)},
            "annotations": {NODE_ANNOTATION: node, PCI_ANNOTATION: pci, FLOW_ANNOTATION: flow},
        },
        "spec": {
            "deviceSelector": {"driver": device.driver, "pool": device.pool, "device": device.device},
            "taint": {"key": key, "value": value, "effect": effect},
        },
    }


def is_ours(rule: Mapping[str, Any]) -> bool:
    return ((rule.get("metadata") or {}).get("labels") or {}).get(MANAGED_BY) == MANAGED_BY_VALUE


def rule_effect(rule: Mapping[str, Any]) -> str:
    return str((((rule.get("spec") or {}).get("taint") or {}).get("effect")) or "")


def tainted_pcis(rules: Iterable[Mapping[str, Any]]) -> set[str]:
    """PCI bus ids of the GPUs xidflow's rules quarantine (rules of other tools and dry runs are not counted)."""
    return {
        str(annotations[PCI_ANNOTATION])
        for r in rules
        if is_ours(r) and rule_effect(r) != DRY_RUN_EFFECT
        and PCI_ANNOTATION in (annotations := (r.get("metadata") or {}).get("annotations") or {})
    }


def rule_devices(rules: Iterable[Mapping[str, Any]]) -> tuple[set[tuple[str, str, str]], list[str]]:
    """The devices (driver, pool, device) xidflow's rules take out of service, and the names of its dry-run rules
    (effect None: they take nothing out). Pure."""
    devices: set[tuple[str, str, str]] = set()
    dry: list[str] = []
    for rule in rules:
        if not is_ours(rule):
            continue
        if rule_effect(rule) == DRY_RUN_EFFECT:
            dry.append(str((rule.get("metadata") or {}).get("name")))
            continue
        selector = (rule.get("spec") or {}).get("deviceSelector") or {}
        devices.add((str(selector.get("driver", "")), str(selector.get("pool", "")), str(selector.get("device", ""))))
    return devices, sorted(dry)


class Verdict(StrEnum):
    DEVICE = "device"
    """Taint the device only."""
    DEVICE_AND_NODE = "device+node"
    """Taint the device, and the node is over its cap: cordon it too."""
    NODE = "node"
    """No device to taint (node-scoped fault, no DRA, unknown device): the node quarantine."""


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str


def pick_devices(
    slices: list[dict[str, Any]], pci: str, gpu_instance: int | None
) -> tuple[list[DeviceRef], str]:
    """The devices to taint for a fault at ``pci`` and what they are: the MIG device of ``gpu_instance`` when a
    device at the address publishes it (``gpuInstanceId``), else every device at the address (the whole GPU:
    the full GPU and its MIG devices), saying why."""
    devices = find_devices(slices, pci)
    if gpu_instance is None or not devices:
        return devices, ""
    mig = mig_devices(slices, pci, gpu_instance)
    if mig:
        return mig, f"MIG GPU instance {gpu_instance}"
    return devices, (
        f"MIG GPU instance {gpu_instance}, but no device publishes {GPU_INSTANCE_ATTRIBUTE}={gpu_instance}: "
        "the whole GPU"
    )


def decide(
    scope: str, what: str, pci: str | None, devices: list[DeviceRef], tainted: set[str], cap: int,
    rules_served: bool = True, instance: str = "", effect: str = DEFAULT_DEVICE_EFFECT,
) -> Decision:
    """Device or node quarantine, and why. ``what`` names the fault (``Xid 48``); ``tainted`` are the PCI ids
    xidflow's rules already quarantine on the node; ``instance`` says which MIG instance the devices are, if any
    (``pick_devices``); ``effect`` is the device taint's (a dry run, ``None``, never escalates over the cap)."""
    if scope != "gpu":
        return Decision(Verdict.NODE, f"{what} takes out the node (catalog scope {scope}): node quarantine")
    if not pci:
        return Decision(Verdict.NODE, f"{what} names no PCI address: node quarantine")
    if not devices:
        return Decision(
            Verdict.NODE,
            f"no ResourceSlice of the node publishes {PCI_ATTRIBUTE}={pci} (no DRA driver, or an unknown device): "
            "node quarantine",
        )
    if not rules_served:
        return Decision(Verdict.NODE, f"the API server does not serve {RULES}.{GROUP}/{RULE_VERSION}: node quarantine")
    devs = ", ".join(d.device for d in devices)
    which = f"; {instance}" if instance else ""
    if effect == DRY_RUN_EFFECT:
        return Decision(Verdict.DEVICE, f"GPU {pci} ({devs}{which}) tainted with effect None, a dry run: nothing kept "
                                        "off it or evicted; the rule's status says what NoExecute would evict")
    count = len(tainted | {pci})
    if count > cap:
        return Decision(
            Verdict.DEVICE_AND_NODE,
            f"{count} GPUs of the node tainted by xidflow, more than maxTaintedDevices={cap}: node quarantine too",
        )
    return Decision(Verdict.DEVICE, f"GPU {pci} ({devs}{which}) tainted {effect}; {count} of at most {cap} on the node")


def scope_of(incident: NodeIncident | None, catalog: Catalog | None = None) -> str:
    """The catalog's scope of the incident's fault (node when there is no incident)."""
    if incident is None:
        return "node"
    catalog = catalog or Catalog.configured()
    if incident.kind == FaultKind.HEALTH_CHECK:
        check = incident.signature.split(":", 2)[1] if ":" in incident.signature else ""
        return catalog.scope(f"health_check:{check}")
    return catalog.scope(incident.kind.value, incident.code)


def device_effect(spec_effect: str | None) -> str:
    """The device taint's effect: the rule's, else ``NoSchedule``. The node taint's setting
    (``XIDFLOW_ACTUATOR_TAINT_EFFECT``) does not apply: a NoExecute device taint deletes pods past their
    PodDisruptionBudgets, so only a rule that says so asks for it."""
    return spec_effect if spec_effect in DEVICE_EFFECTS else DEFAULT_DEVICE_EFFECT


def effect_key(name: str) -> str:
    return f"{EFFECT_PREFIX}{name}"


# -- the cluster ------------------------------------------------------------------------------------------
async def node_slices(kube: Kube, node: str) -> list[dict[str, Any]]:
    """The node's ResourceSlices; none when the API server does not serve them (no DRA)."""
    try:
        return await kube.list_resource_slices(node, SLICE_VERSION)
    except NotFound:
        return []


async def node_rules(kube: Kube, node: str) -> list[dict[str, Any]] | None:
    """xidflow's DeviceTaintRules of the node; None when the API server does not serve DeviceTaintRule."""
    selector = f"{MANAGED_BY}={MANAGED_BY_VALUE},{NODE_LABEL}={node_label_value(node)}"
    try:
        return await kube.list_cluster_objects_all(GROUP, RULE_VERSION, RULES, label_selector=selector)
    except NotFound:
        return None


async def flow_devices(kube: Kube, ledger: Ledger, flow: str) -> tuple[set[tuple[str, str, str]], list[str]]:
    """The devices the flow's DeviceTaintRules (those the ledger records the flow owns) take out of service, and
    the flow's dry-run rules (``rule_devices``). A rule deleted meanwhile counts for nothing."""
    names = [key.removeprefix(EFFECT_PREFIX) for key in ledger.effects_owned_by(flow) if key.startswith(EFFECT_PREFIX)]
    rules = []
    for name in names:
        try:
            rules.append(await kube.get_cluster_object(GROUP, RULE_VERSION, RULES, name))
        except NotFound:
            continue
    return rule_devices(rules)


async def create_rule(kube: Kube, body: dict[str, Any]) -> tuple[bool, bool]:
    """(created now, ours): an existing rule of that name is ours only when labelled so."""
    try:
        await kube.create_cluster_object(GROUP, RULE_VERSION, RULES, body)
        return True, True
    except AlreadyExists:
        existing = await kube.get_cluster_object(GROUP, RULE_VERSION, RULES, body["metadata"]["name"])
        return False, is_ours(existing)


async def delete_rules(kube: Kube, names: Iterable[str]) -> list[str]:
    """Delete the named rules (undo: the ledger says they are xidflow's); gone already is fine."""
    deleted: list[str] = []
    for name in names:
        try:
            await kube.delete_cluster_object(GROUP, RULE_VERSION, RULES, name)
            deleted.append(name)
        except NotFound:
            pass
    return deleted


async def _quarantine_node(ctx: StepContext, step: StepLike) -> tuple[str, bool]:
    """Cordon + taint the node as ``cordon`` and ``taint`` do (owned in the ledger), through the breaker.

    Returns what happened and whether the node changed."""
    plan, spec, settings, problem = ctx.plan, step.spec, ctx.settings, ctx.plan.problem
    ledger = ctx.view.ledger
    already = any(owners for e, owners in ledger.owned.items() if e == CORDON or e.startswith("taint:"))
    if ctx.breaker is not None and not already:
        admission = await ctx.breaker.admit(plan.node)
        if not admission.allowed:
            return f"node quarantine refused: {admission.reason}", False
    key = spec.key or settings.taint_key
    value = spec.value or (problem.taint_value if problem else "gpu-fault")
    # A device dry run (effect None) still quarantines a node it escalates to, with the node taint's setting.
    effect = spec.effect if spec.effect and spec.effect != DRY_RUN_EFFECT else settings.taint_effect

    def mutate(view: NodeView, led: Ledger) -> tuple[effects.NodeChange, tuple[str, bool]]:
        cordon = effects.cordon_change(view, led, plan.flow_key)
        cur = dataclasses.replace(view, unschedulable=cordon.spec.get("unschedulable", view.unschedulable))
        taint = effects.taint_change(cur, led, plan.flow_key, key, value, effect)
        notes = f"{cordon.note or 'cordoned'}; {taint.note or f'tainted {key}:{effect}'}"
        changed = {**cordon.spec, **taint.spec}
        return effects.NodeChange(spec=changed), (notes, bool(changed))

    (note, changed), written = await ctx.writer.update(
        plan.node, mutate, f"{step.key} node quarantine {plan.flow_key}", ctx.view
    )
    if written is not None:
        ctx.view = written
    return note, changed


async def run(ctx: StepContext, step: StepLike) -> StepResult:
    plan, spec, settings, incident = ctx.plan, step.spec, ctx.settings, ctx.incident
    pci = normalise_bdf(incident.pci) if incident is not None and incident.pci else None
    what = f"{incident.kind.value} {incident.code}" if incident is not None and incident.code is not None else (
        incident.kind.value if incident is not None else "the request"
    )
    scope = scope_of(incident)
    cap = spec.max_tainted_devices if spec.max_tainted_devices is not None else DEFAULT_MAX_TAINTED_DEVICES
    devices: list[DeviceRef] = []
    rules: list[dict[str, Any]] | None = []
    instance = ""
    gpu_instance = incident.gpu_instance if incident is not None else None
    if scope == "gpu" and pci:
        devices, instance = pick_devices(await node_slices(ctx.kube, plan.node), pci, gpu_instance)
        if devices:
            rules = await node_rules(ctx.kube, plan.node)
    effect = device_effect(spec.effect)
    decision = decide(scope, what, pci, devices, tainted_pcis(rules or []), cap, rules_served=rules is not None,
                      instance=instance, effect=effect)
    details: dict[str, Any] = {"scope": scope, "pci": pci, "verdict": decision.verdict.value}
    if gpu_instance is not None:
        details["gpu_instance"] = gpu_instance
    owns: list[str] = []
    created_any = False
    if decision.verdict in (Verdict.DEVICE, Verdict.DEVICE_AND_NODE):
        assert pci is not None
        problem = plan.problem
        key = spec.key or settings.taint_key
        value = spec.value or (problem.taint_value if problem else "gpu-fault")
        names = []
        for device in devices:
            name = rule_name(plan.node, pci, device)
            created, ours = await create_rule(
                ctx.kube, rule_body(name, plan.node, pci, device, key, value, effect, plan.flow_key)
            )
            created_any |= created
            names.append(name)
            if ours:
                owns.append(effect_key(name))
        details["rules"] = names
        details["effect"] = effect
        details["devices"] = [dataclasses.asdict(d) for d in devices]
    reason = decision.reason
    if decision.verdict in (Verdict.NODE, Verdict.DEVICE_AND_NODE):
        note, changed = await _quarantine_node(ctx, step)
        reason = f"{reason} ({note})"
        created_any |= changed
        details["node_quarantine"] = note
    outcome = Outcome.APPLIED if created_any else Outcome.ALREADY_APPLIED
    return StepResult(outcome, reason, details, owns=tuple(owns))


ACTION = ActionDef(
    name="taintDevice",
    kind=Kind.INSTANT,
    attrs=frozenset({"key", "value", "effect", "max_tainted_devices"}),
    owns="the DeviceTaintRule of the faulty GPU; when it escalates, the node's cordon and taint as cordon/taint",
    undo="delete the DeviceTaintRule (only xidflow's); lift the escalation's cordon/taint once no open flow owns them",
    run=run,
)
