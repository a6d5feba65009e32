"""drain: evict every pod that may go, honouring PodDisruptionBudgets; force only when the rule allows.

Which pods stay is decided by small filters, each one reason to leave a pod alone (``default_filters``): DaemonSet
pods (the shippers and the probe keep running on a quarantined node), mirror pods, xidflow's own pods
(``own_pods``) and the rule's excluded namespaces. A drain holds one of the cluster-wide drain slots while it runs.

``scope: gpu`` (what the per-GPU quarantine adds after taintDevice): the drain is about the pods holding the GPUs
this flow tainted (``pipeline.actuator.claims``), not about the node; every other pod stays, and nothing is evicted
when the flow tainted no GPU (a node quarantine) or only as a dry run (effect None).

A drain ends when no pod it must move is left on the node. A pod already terminating (evicted, or
deleted by Kubernetes' own taint eviction) is waited for while the node's kubelet answers; on a node the
node lifecycle controller judged unreachable (``NodeView.unreachable``: Ready ``Unknown``) nothing confirms
its end until the machine is back, so it is reported as ``stranded`` and not waited for: the eviction was
accepted (PDBs honoured), the pod's controller has been told, and what remains is the kubelet's part.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.actuator import claims
from pipeline.actuator.actions.base import ActionDef, ActionSpecLike, Kind, StepContext, StepLike, StepResult
from pipeline.actuator.actions.taint_device import flow_devices
from pipeline.actuator.checkpoint_wait import before_drain
from pipeline.actuator.kube import Kube, NotFound, TooManyRequests
from pipeline.actuator.nodeview import NodeView
from schemas.records import Outcome

MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
DEFAULT_DRAIN_TIMEOUT = 300.0
OWN_LABEL = ("app.kubernetes.io/part-of", "xidflow")
"""The label the chart puts on every xidflow pod (worker, actuator, loki-tail, probe, Fluent Bit)."""

Pod = Mapping[str, Any]
PodFilter = Callable[[Pod], bool]
"""True when the pod is left alone."""


def daemonset_pods(pod: Pod) -> bool:
    return any(o.get("kind") == "DaemonSet" for o in (pod.get("metadata") or {}).get("ownerReferences") or [])


def mirror_pods(pod: Pod) -> bool:
    return MIRROR_ANNOTATION in ((pod.get("metadata") or {}).get("annotations") or {})


def in_namespaces(namespaces: Iterable[str]) -> PodFilter:
    excluded = frozenset(namespaces)
    return lambda pod: (pod.get("metadata") or {}).get("namespace") in excluded


def own_pods(namespace: str) -> PodFilter:
    """xidflow's own pods: labelled ``app.kubernetes.io/part-of: xidflow`` in the actuator's namespace. A drain
    never evicts the replica running it, the other replicas or the worker that feeds them (the chart keeps them off
    GPU nodes too: ``avoidGpuNodes``)."""
    key, value = OWN_LABEL

    def own(pod: Pod) -> bool:
        meta = pod.get("metadata") or {}
        return meta.get("namespace") == namespace and (meta.get("labels") or {}).get(key) == value

    return own


def finished_pods(pod: Pod) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def terminating(pod: Pod) -> bool:
    return bool((pod.get("metadata") or {}).get("deletionTimestamp"))


def default_filters(excluded_namespaces: Iterable[str] = (), own_namespace: str | None = None) -> list[PodFilter]:
    own = [own_pods(own_namespace)] if own_namespace else []
    return [daemonset_pods, mirror_pods, *own, in_namespaces(excluded_namespaces)]


def drain_candidates(
    pods: list[Pod], excluded: set[str], filters: list[PodFilter] | None = None
) -> tuple[list[Pod], list[str]]:
    """Pods to evict, and the ones left alone (reported); finished pods are neither."""
    keep_out = filters if filters is not None else default_filters(excluded)
    evict: list[Pod] = []
    alone: list[str] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        if any(f(pod) for f in keep_out):
            alone.append(f"{meta.get('namespace')}/{meta.get('name')}")
        elif not finished_pods(pod):
            evict.append(pod)
    return evict, alone


def _namespace(pod: Pod) -> str:
    return str((pod.get("metadata") or {}).get("namespace"))


@dataclass
class DrainResult:
    evicted: list[str] = field(default_factory=list)
    forced: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)
    left_alone: list[str] = field(default_factory=list)
    stranded: list[str] = field(default_factory=list)
    """Pods terminating on an unreachable node: evicted or deleted, their end unconfirmable until it is back."""
    ok: bool = True
    reason: str = ""


async def drain(
    kube: Kube, node: str, spec: ActionSpecLike, max_backoff: float = 5.0, *,
    own_namespace: str | None = None, only: PodFilter | None = None,
) -> DrainResult:
    """Evict every pod that may go, honouring PDBs (429 -> backoff), then force only if allowed.

    ``only``: the pods this drain is about (``scope: gpu``: those holding the flow's tainted GPUs); the node's
    other pods are neither evicted nor reported."""
    start = time.monotonic()
    timeout = spec.timeout or DEFAULT_DRAIN_TIMEOUT
    filters = default_filters(spec.excluded_namespaces, own_namespace)
    result = DrainResult()
    backoff = 0.25
    while True:
        on_node = [p for p in await kube.list_pods_on_node(node) if only is None or only(p)]
        pods, result.left_alone = drain_candidates(on_node, set(), filters)
        elapsed = time.monotonic() - start
        force = spec.force_after is not None and elapsed >= spec.force_after
        waiting = [p for p in pods if terminating(p) and not (force and _namespace(p) in spec.force_namespaces)]
        if waiting and NodeView.from_object(await kube.get_node(node)).unreachable:
            result.stranded = [f"{_namespace(p)}/{p['metadata']['name']}" for p in waiting]
            pods = [p for p in pods if p not in waiting]
        if not pods:
            result.ok = True
            result.blocked = []
            return result
        blocked: list[str] = []

        async def one(pod: Pod, force: bool = force, blocked: list[str] = blocked) -> None:
            meta = pod["metadata"]
            ns, name = meta["namespace"], meta["name"]
            grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
            if spec.grace_period_cap is not None:
                grace = min(grace if grace is not None else 30, spec.grace_period_cap)
            try:
                if force and ns in spec.force_namespaces:  # the policy names where deletion may be forced
                    await kube.delete_pod(ns, name, 0)
                    result.forced.append(f"{ns}/{name}")
                elif meta.get("deletionTimestamp"):
                    blocked.append(f"{ns}/{name} (terminating)")
                else:
                    await kube.evict_pod(ns, name, grace)
                    result.evicted.append(f"{ns}/{name}")
            except TooManyRequests:
                blocked.append(f"{ns}/{name}")
            except NotFound:
                pass

        await asyncio.gather(*(one(p) for p in pods))
        result.blocked = blocked
        if time.monotonic() - start >= timeout:
            result.ok = False
            result.reason = f"drain timed out after {timeout:g}s; blocked: {', '.join(blocked[:10])}"
            return result
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, max_backoff)


async def _gpu_holders(ctx: StepContext) -> tuple[PodFilter | None, dict[str, Any], str]:
    """``scope: gpu``: the pods holding a GPU this flow's taintDevice took out of service (their uids, fixed now: a
    replacement that lands on another GPU of the node is not theirs); the audit details; and, when there is nothing
    to evict, why."""
    devices, dry = await flow_devices(ctx.kube, ctx.view.ledger, ctx.plan.flow_key)
    details: dict[str, Any] = {"gpu_devices": sorted("/".join(d) for d in devices)}
    if not devices:
        why = (f"its GPU taint is a dry run (effect None: {', '.join(dry)})" if dry
               else "the flow tainted no GPU (a node quarantine, or no DRA device)")
        return None, details, f"scope gpu: nothing to evict, {why}"
    held = await claims.holders(ctx.kube, await ctx.kube.list_pods_on_node(ctx.plan.node), devices)
    details["holders"] = sorted(f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in held)
    if not held:
        return None, details, f"scope gpu: no pod holds {', '.join(details['gpu_devices'])}: nothing to evict"
    uids = {p["metadata"].get("uid") for p in held}
    return (lambda pod: (pod.get("metadata") or {}).get("uid") in uids), details, ""


async def run(ctx: StepContext, step: StepLike) -> StepResult:
    node, spec = ctx.plan.node, step.spec
    own = ctx.settings.namespace
    only: PodFilter | None = None
    scoped: dict[str, Any] = {}
    if spec.scope == "gpu":
        only, scoped, nothing = await _gpu_holders(ctx)
        if nothing:
            return StepResult(Outcome.APPLIED, nothing, scoped)
    filters = default_filters(spec.excluded_namespaces, own)

    def select(pods: list[Pod]) -> list[Pod]:
        return [p for p in drain_candidates(pods, set(), filters)[0] if only is None or only(p)]

    # The checkpoint wait (checkpointGrace) comes before the drain slot: waiting evicts nothing, so it
    # must not keep another node's drain waiting for the slot.
    waited, details = await before_drain(ctx, step, select)
    await ctx.drains.acquire(node, ctx.worker)
    try:
        res = await drain(ctx.kube, node, spec, own_namespace=own, only=only)
    finally:
        await ctx.drains.release(node)
    details |= scoped | {"evicted": res.evicted, "forced": res.forced, "left_alone": res.left_alone}
    if res.stranded:
        details["stranded"] = res.stranded
    prefix = f"{waited}; " if waited else ""
    if only is not None:
        prefix += f"the pods holding {', '.join(scoped['gpu_devices'])}: "
    if not res.ok:
        return StepResult(Outcome.FAILED, prefix + res.reason, details | {"blocked": res.blocked})
    stranded = (f"; {len(res.stranded)} left terminating on the unreachable node (no kubelet to end them)"
                if res.stranded else "")
    return StepResult(Outcome.APPLIED, f"{prefix}{len(res.evicted)} evicted, {len(res.forced)} forced{stranded}",
                      details)


ACTION = ActionDef(
    name="drain",
    kind=Kind.LONG,
    attrs=frozenset(
        {"grace_period_cap", "excluded_namespaces", "force_after", "force_namespaces", "timeout", "checkpoint_grace",
         "scope"}
    ),
    disruptive=True,
    requestable=True,
    uses_drain_slot=True,
    uses_repair_budget=True,
    run=run,
)
