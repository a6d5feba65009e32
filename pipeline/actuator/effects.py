"""The effects on the cluster, one function each.

Node-object effects (cordon, taint, uncordon, reboot annotation) are pure changes on a NodeView and
its Ledger: the engine writes the change and the ledger in one conditional patch, so the effect and
its record land together or not at all. The other effects (condition, Event, hooks, standby) do
their own I/O through ``Kube`` and are made idempotent by deterministic names or claims.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import yaml

from pipeline.actuator.diagnostics import DIAGNOSTICS_COMMAND
from pipeline.actuator.jobstatus import JOB_GONE, JobEnd, job_end
from pipeline.actuator.kube import AlreadyExists, Kube, NotFound
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import (
    CORDON,
    REBOOT_REQUEST_ANNOTATION,
    STANDBY_FOR_ANNOTATION,
    Ledger,
    taint_effect_key,
)
from schemas.records import stable_id

EVENT_NAMESPACE = "default"  # Events about cluster-scoped Nodes live in "default", as the kubelet's do.
DEFAULT_REBOOT_TIMEOUT = 1800.0
DEFAULT_RESET_TIMEOUT = 300.0
"""How long a GPU-reset Job may run when its step gives no ``timeout`` (a reset takes seconds)."""


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def object_name(prefix: str, *parts: object, length: int = 16) -> str:
    """A DNS-safe deterministic name: the same flow and step give the same object on every replica."""
    return f"{prefix}-{stable_id(*parts)[:length]}"


@dataclass
class NodeChange:
    """What one node-object effect changes: spec fields, extra annotations, and a note for the audit.

    ``status`` (e.g. ``{"conditions": [...]}``, merged by type) is written through the status
    subresource together with the ledger; a change has ``spec`` or ``status``, never both.
    """

    spec: dict[str, Any] = field(default_factory=dict)
    annotations: dict[str, str | None] = field(default_factory=dict)
    note: str = ""
    status: dict[str, Any] = field(default_factory=dict)


# -- pure node-object effects -------------------------------------------------------------------------
def cordon_change(view: NodeView, ledger: Ledger, flow_key: str) -> NodeChange:
    if view.unschedulable:
        if ledger.owners(CORDON):
            ledger.own(CORDON, flow_key)  # xidflow's own cordon, now also needed by this flow
            return NodeChange(note="already cordoned by xidflow")
        # Someone else cordoned the node: we do not own that cordon and will never undo it.
        return NodeChange(note="already cordoned by someone else; not owned")
    ledger.own(CORDON, flow_key)
    return NodeChange(spec={"unschedulable": True})


def uncordon_change(view: NodeView, ledger: Ledger, flow_key: str) -> NodeChange:
    owners = ledger.owners(CORDON)
    if not view.unschedulable:
        ledger.owned.pop(CORDON, None)
        return NodeChange(note="already schedulable")
    if not owners:
        return NodeChange(note="cordon not made by xidflow; left in place")
    if set(owners) - {flow_key}:
        ledger.disown(CORDON, flow_key)
        return NodeChange(note=f"cordon still needed by {sorted(set(owners) - {flow_key})}")
    ledger.owned.pop(CORDON, None)
    return NodeChange(spec={"unschedulable": False})


def taint_change(view: NodeView, ledger: Ledger, flow_key: str, key: str, value: str, effect: str) -> NodeChange:
    effect_key = taint_effect_key(key, effect)
    present = [t for t in view.taints if t.get("key") == key and t.get("effect") == effect]
    if present:
        if ledger.owners(effect_key):
            ledger.own(effect_key, flow_key)
            return NodeChange(note="taint already applied by xidflow")
        return NodeChange(note="taint already present, not made by xidflow; not owned")
    ledger.own(effect_key, flow_key)
    taints = [dict(t) for t in view.taints] + [
        {"key": key, "value": value, "effect": effect, "timeAdded": now_rfc3339()}
    ]
    return NodeChange(spec={"taints": taints})


def remove_taints_change(view: NodeView, remove: list[tuple[str, str]]) -> NodeChange:
    keep = [dict(t) for t in view.taints if (t.get("key"), t.get("effect")) not in set(remove)]
    if len(keep) == len(view.taints):
        return NodeChange(note="taints already gone")
    return NodeChange(spec={"taints": keep})


def reboot_annotation_change(flow_key: str) -> NodeChange:
    # An external reboot daemon watches this annotation, reboots, and removes it.
    return NodeChange(annotations={REBOOT_REQUEST_ANNOTATION: flow_key})


# -- Events (conditions: pipeline.actuator.conditions) ---------------------------------------------------
async def create_event_once(
    kube: Kube,
    namespace: str,
    name: str,
    involved: Mapping[str, Any],
    reason: str,
    message: str,
    event_type: str = "Warning",
) -> bool:
    """Create the Event once: False when an Event of that deterministic name already exists.

    The one shape of every Event xidflow writes (about a Node, a Pod, a policy object); the name is
    derived from what it reports, so a redelivered record or a racing replica finds it instead of doubling.
    """
    now = now_rfc3339()
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": namespace},
        "involvedObject": dict(involved),
        "reason": reason,
        "message": message[:1024],
        "type": event_type,
        "source": {"component": "xidflow-actuator"},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
        "reportingComponent": "xidflow.dev/actuator",
        "reportingInstance": "xidflow-actuator",
    }
    try:
        await kube.create_event(namespace, body)
    except AlreadyExists:
        return False
    return True


async def create_node_event(
    kube: Kube, node: NodeView, name: str, reason: str, message: str, event_type: str = "Warning"
) -> bool:
    """The node's Event, once (see ``create_event_once``)."""
    involved = {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": node.name}
    return await create_event_once(kube, EVENT_NAMESPACE, name, involved, reason, message, event_type)


# -- reboot, GPU reset and diagnostics hooks ---------------------------------------------------------------
# The documented hooks: each image pinned by digest (the tag is only for people), each command fixed. The
# admission policies of deploy/rbac/hook-jobs-admission.yaml (and the chart's, from actuator.hookJobs.allowed)
# admit a Job of the actuator only with one of these (image, command) pairs; tests/unit/test_rbac_agreement.py
# keeps them equal. The digests are those the public tags had when they were written here (the build machine
# reaches no container registry): an operator who mirrors the images pins the mirror's digests in both places.
REBOOT_IMAGE = "busybox:1.36@sha256:73aaf090f3d85aa34ee199857f03fa3a95c8ede2ffd4cc2cdb5b94e566b11662"
REBOOT_COMMAND = ("nsenter", "-t", "1", "-m", "-u", "-i", "-n", "-p", "--", "systemctl", "reboot")
RESET_IMAGE = (
    "nvidia/cuda:12.4.1-base-ubuntu22.04@sha256:0f6bfcbf267e65123bcc2287e2153dedfc0f24772fb5ce84afe16ac4b2fada95"
)
RESET_COMMAND = ("nvidia-smi", "--gpu-reset")
DIAGNOSTICS_IMAGE = REBOOT_IMAGE  # a shell and nsenter: DCGM is the node's own (docs/repair.md)
DOCUMENTED_HOOKS = (
    (REBOOT_IMAGE, REBOOT_COMMAND), (RESET_IMAGE, RESET_COMMAND), (DIAGNOSTICS_IMAGE, DIAGNOSTICS_COMMAND)
)
"""(image, command) of every hook Job xidflow ships: what the admission policy admits by default."""


def _hook_job(container: str, image: str, command: tuple[str, ...]) -> str:
    return f"""
apiVersion: batch/v1
kind: Job
spec:
  backoffLimit: 0
  ttlSecondsAfterFinished: 3600
  template:
    spec:
      restartPolicy: Never
      hostPID: true
      tolerations: [{{operator: Exists}}]
      containers:
      - name: {container}
        image: {image}
        command: {json.dumps(list(command))}
        securityContext: {{privileged: true}}
"""


DEFAULT_REBOOT_JOB = _hook_job("reboot", REBOOT_IMAGE, REBOOT_COMMAND)
DEFAULT_RESET_JOB = _hook_job("gpu-reset", RESET_IMAGE, RESET_COMMAND)
DEFAULT_DIAGNOSTICS_JOB = _hook_job("diagnostics", DIAGNOSTICS_IMAGE, DIAGNOSTICS_COMMAND)
"""The diagnostics gate's built-in Job: DCGM level 2 (XIDFLOW_ACTUATOR_DIAGNOSTICS_JOB_TEMPLATE replaces it)."""


def render_job(template: Mapping[str, Any] | str, name: str, namespace: str, node: str, labels: dict[str, str]) -> dict:
    """A hook Job pinned to the node (spec.nodeName) with a deterministic name."""
    job = copy.deepcopy(yaml.safe_load(template) if isinstance(template, str) else dict(template))
    job.setdefault("apiVersion", "batch/v1")
    job.setdefault("kind", "Job")
    meta = job.setdefault("metadata", {})
    meta.update({"name": name, "namespace": namespace})
    meta.setdefault("labels", {}).update(labels)
    pod_spec = job.setdefault("spec", {}).setdefault("template", {}).setdefault("spec", {})
    pod_spec["nodeName"] = node
    pod_spec.setdefault("restartPolicy", "Never")
    return job


async def create_hook_job(kube: Kube, job: dict[str, Any]) -> bool:
    try:
        await kube.create_job(job["metadata"]["namespace"], job)
    except AlreadyExists:
        return False
    return True


async def call_webhook(url: str, payload: dict[str, Any], idempotency_key: str, limit_s: float = 10) -> int:
    """POST the reboot request; the receiver dedupes on the Idempotency-Key header."""
    import aiohttp  # only a webhook reboot needs it: not imported at the actuator's start

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=limit_s)) as session:
        async with session.post(url, json=payload, headers={"Idempotency-Key": idempotency_key}) as resp:
            resp.raise_for_status()
            return resp.status


async def wait_for_reboot(
    kube: Kube, node: str, boot_id_before: str, limit_s: float, poll: float = 1.0,
    each_round: Callable[[NodeView], Awaitable[str | None]] | None = None,
) -> tuple[bool, NodeView, str | None]:
    """Wait until the Node is Ready with a bootID different from the one before the reboot.

    ``each_round``: called with the node each round while it keeps its old bootID (a Job hook starts and
    follows its Job there); a reason means the reboot request failed, and the wait ends with it once the
    node, read again after it, still reports the old bootID. Returns (rebooted, the node as last read, that
    reason).
    """
    deadline = time.monotonic() + limit_s
    while True:
        view = NodeView.from_object(await kube.get_node(node))
        if view.ready and view.boot_id and view.boot_id != boot_id_before:
            return True, view, None
        why = await each_round(view) if each_round is not None else None
        if why is not None:
            view = NodeView.from_object(await kube.get_node(node))
            if view.boot_id == boot_id_before:
                return False, view, why
        if time.monotonic() >= deadline:
            return False, view, None
        await asyncio.sleep(poll)


async def wait_for_job(kube: Kube, namespace: str, name: str, limit_s: float, poll: float = 1.0) -> JobEnd | None:
    """The Job's end (``Complete`` or ``Failed``, as the Job controller says), None on timeout; ``JOB_GONE`` when the
    Job was deleted before its end was seen (nothing says it worked)."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            end = job_end(await kube.get_job(namespace, name))
        except NotFound:
            return JOB_GONE
        if end is not None:
            return end
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(poll)


# -- warm standby ---------------------------------------------------------------------------------------
def _has_labels(labels: Mapping[str, str], wanted: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in wanted.items())


def choose_standby(
    standby_nodes: list[Mapping[str, Any]],
    target_label_sets: list[dict[str, str]],
    rng: random.Random | None = None,
) -> str | None:
    """A cordoned standby node: random among those matching a target label set, else any standby."""
    rng = rng or random.Random()
    idle = [NodeView.from_object(n) for n in standby_nodes]
    idle = [v for v in idle if v.unschedulable]
    matching = [v.name for v in idle if any(_has_labels(v.labels, t) for t in target_label_sets)]
    pool = sorted(matching) or sorted(v.name for v in idle)
    return rng.choice(pool) if pool else None


def standby_change(view: NodeView, origin: str, flow_key: str) -> NodeChange:
    return NodeChange(spec={"unschedulable": False}, annotations={STANDBY_FOR_ANNOTATION: f"{origin}/{flow_key}"})
