"""notifyWorkload: tell the pods on the faulty node (issue 15).

Lists the node's pods, reads the ReplicaSets/Jobs they name (to report Deployment, JobSet, CronJob, a
training operator's kind, ...) and, when the incident has a PCI address and the API server serves DRA,
the node's ResourceSlices and the pods' ResourceClaims (``pipeline.actuator.claims``: to know which pods hold
the faulty GPU). Each
affected pod (see ``pipeline.actuator.workload``) gets one Warning Event (deterministic name per
incident and pod: a redelivery finds it) and the condition ``xidflow.dev/GPUFault`` through
``pods/status``, so a Job's ``podFailurePolicy`` can ignore the failure. The pods and their owners go
into the audit record's typed ``workload`` field. What is decided lives in ``workload``; here is the I/O.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from pipeline.actuator import claims, dra, effects, workload
from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepLike, StepResult
from pipeline.actuator.kube import Forbidden, Kube, NotFound
from schemas.records import NodeIncident, Outcome


async def _read_owners(kube: Kube, keys: set[workload.Key]) -> dict[workload.Key, dict[str, Any]]:
    async def one(key: workload.Key) -> tuple[workload.Key, dict[str, Any] | None]:
        namespace, kind, name = key
        group, version, plural = workload.OWNER_PATHS[kind]
        try:
            return key, await kube.get_namespaced_object(group, version, namespace, plural, name)
        except (NotFound, Forbidden):
            return key, None  # gone or not ours to read: the owner is reported as the pod names it

    found = await asyncio.gather(*(one(k) for k in sorted(keys)))
    return {k: obj for k, obj in found if obj is not None}


async def _attribution(
    kube: Kube, node: str, pci: str | None, pods: list[dict[str, Any]]
) -> tuple[set[workload.DeviceId], dict[tuple[str, str], dict[str, Any]], str | None]:
    """The faulty device(s), the pods' claims, or why which pod holds the faulty GPU cannot be known."""
    if not pci:
        return set(), {}, "the incident names no PCI address"
    if not any(workload.pod_claim_names(p) for p in pods):
        return set(), {}, "no pod on the node has a DRA resource claim (GPUs through the device plugin)"
    try:
        slices = await kube.list_resource_slices(node, dra.SLICE_VERSION)
    except NotFound:
        return set(), {}, f"the API server does not serve {dra.GROUP}/{dra.SLICE_VERSION}"
    except Forbidden:
        return set(), {}, "not allowed to list ResourceSlices"
    faulty = workload.devices_with_pci(slices, pci)
    if not faulty:
        return set(), {}, f"no ResourceSlice device on the node has {workload.PCI_ATTRIBUTE}={pci}"
    return faulty, await claims.read_claims(kube, pods), None


async def _create_pod_event(kube: Kube, pod: Mapping[str, Any], name: str, message: str) -> bool:
    meta = pod["metadata"]
    involved = {"apiVersion": "v1", "kind": "Pod", "namespace": meta["namespace"], "name": meta["name"],
                "uid": meta.get("uid", "")}
    return await effects.create_event_once(kube, meta["namespace"], name, involved, workload.EVENT_REASON, message)


async def _set_pod_condition(kube: Kube, pod: Mapping[str, Any], reason: str, message: str) -> bool:
    if workload.has_condition(pod, reason):
        return False
    now = effects.now_rfc3339()
    cond = {
        "type": workload.GPU_FAULT_CONDITION, "status": "True", "reason": reason, "message": message,
        "lastTransitionTime": now, "lastProbeTime": None,
    }
    namespace, name = workload.pod_key(pod)
    await kube.patch_pod_status(namespace, name, {"status": {"conditions": [cond]}})
    return True


async def _tell(
    ctx: StepContext, incident: NodeIncident, pod: Mapping[str, Any], reason: str, on_faulty: bool | None
) -> tuple[bool, bool, bool]:
    """(Event created, condition written, refused by RBAC)."""
    namespace, name = workload.pod_key(pod)
    message = workload.fault_message(incident, on_faulty)
    event = effects.object_name(name[:200], ctx.plan.flow_key, namespace, name, "gpu-fault")
    try:
        created = await _create_pod_event(ctx.kube, pod, event, message)
        written = await _set_pod_condition(ctx.kube, pod, reason, message)
    except NotFound:  # the pod (or its namespace) went away meanwhile: nothing left to tell
        return False, False, False
    except Forbidden:  # information only: an RBAC gap is audited, it does not stop the quarantine
        return False, False, True
    return created, written, False


async def run(ctx: StepContext, step: StepLike) -> StepResult:
    incident = ctx.incident
    if incident is None:
        return StepResult(Outcome.SKIPPED, "no incident: no GPU fault to tell the workload about")
    node = ctx.plan.node
    pods = await ctx.kube.list_pods_on_node(node)
    owners = await _read_owners(ctx.kube, workload.owners_to_read(pods))
    faulty, claims, unknown = await _attribution(ctx.kube, node, incident.pci, pods)
    summary, affected = workload.summarize(incident, pods, owners, faulty, claims, unknown)
    details: dict[str, Any] = {workload.DETAILS_KEY: summary.model_dump(mode="json")}
    if not affected:
        return StepResult(Outcome.SKIPPED, f"{summary.total} pods on the node, none affected", details)
    reason = workload.fault_reason(incident)
    told = await asyncio.gather(
        *(_tell(ctx, incident, p, reason, workload.on_faulty_gpu(p, claims, faulty)) for p in affected)
    )
    events, conditions, refused = (sum(t[i] for t in told) for i in range(3))
    details |= {"events": events, "conditions": conditions}
    text = f"{len(affected)} of {summary.total} pods affected: {events} Events, {conditions} conditions {reason}"
    if refused:
        details["forbidden"] = refused
        return StepResult(Outcome.FAILED, f"{text}; {refused} pods not told (forbidden)", details)
    return StepResult(Outcome.APPLIED if events or conditions else Outcome.ALREADY_APPLIED, text, details)


ACTION = ActionDef(name="notifyWorkload", kind=Kind.INSTANT, allowed_when_breaker_open=True, run=run)
