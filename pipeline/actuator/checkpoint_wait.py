"""The checkpoint wait before a drain, against the cluster (the rules are in ``checkpoint``).

Asks each GPU pod the drain would evict for a checkpoint (pod condition and one Warning Event per
pod), then follows the node's pods with one watch until every asked pod answered, went away or
finished, or the deadline kept in the node's ledger passed. The drain step's lease covers the wait:
a replica that dies mid-wait is replaced by one that reads the same deadline and asks nobody twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any

from pipeline.actuator import checkpoint, effects
from pipeline.actuator.checkpoint import Progress, Wait
from pipeline.actuator.effects import NodeChange
from pipeline.actuator.kube import Forbidden, Invalid, Kube, KubeUnavailable, NotFound
from pipeline.actuator.workload import uses_gpu
from pipeline.detection.catalog import Catalog
from pipeline.runtime import metrics

if TYPE_CHECKING:
    from pipeline.actuator.actions.base import StepContext, StepLike
    from pipeline.actuator.nodeview import NodeView
    from pipeline.actuator.ownership import Ledger

log = logging.getLogger("xidflow.actuator.checkpoint")

Pod = Mapping[str, Any]
Select = Callable[[list[Pod]], list[Pod]]
"""The pods the drain would evict, from every pod on the node."""

_LISTED = 20
"""Pod names kept per list in the audit record (and the ledger): counts say the rest."""
_RELIST_PAUSE = 1.0
"""Pause before listing again after a broken watch: an API server restart is not a busy loop."""


def _waited_for(pods: Mapping[str, Pod], select: Select) -> list[Pod]:
    """GPU pods the drain would evict that are not already going away."""
    chosen = select(list(pods.values()))
    return [p for p in chosen if uses_gpu(p) and not (p.get("metadata") or {}).get("deletionTimestamp")]


async def _the_wait(ctx: StepContext, step: StepLike, grace: float) -> Wait:
    """The wait as the ledger keeps it; recorded now (before any pod is asked) when it is new."""
    flow, name = ctx.plan.flow_key, checkpoint.ledger_name(step.key)

    def mutate(view: NodeView, ledger: Ledger) -> tuple[NodeChange | None, Wait]:
        kept = Wait.from_value(ledger.flow_value(flow, name))
        if kept is not None:
            return None, kept  # a resumed drain: the same deadline
        now = time.time()
        wait = Wait.start(now, grace)
        ledger.set_flow_value(flow, name, wait.value(), now)
        return NodeChange(), wait

    wait, written = await ctx.writer.update(ctx.plan.node, mutate, f"checkpoint {step.key} {flow}", ctx.view)
    if written is not None:
        ctx.view = written
    return wait


async def _ask(ctx: StepContext, pod: Pod, message: str, event_only: bool) -> Pod | str:
    """Write the request (unless ``event_only``) and the pod's Event: the pod as written, or why not
    (``gone``; ``refused``: RBAC or the API server refused the write, nobody can answer it)."""
    meta = pod.get("metadata") or {}
    namespace, name = str(meta.get("namespace")), str(meta.get("name"))
    written: Pod = pod
    try:
        if not event_only:
            patch = checkpoint.request_patch(pod, message, time.time())
            written = await ctx.kube.patch_pod_status(namespace, name, patch)
        involved = {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": name,
                    "uid": meta.get("uid", "")}
        event = effects.object_name(name[:200], ctx.plan.flow_key, namespace, name, "checkpoint")
        await effects.create_event_once(ctx.kube, namespace, event, involved, checkpoint.EVENT_REASON, message)
    except NotFound:
        return "gone"
    except (Forbidden, Invalid) as exc:
        log.warning("cannot ask %s/%s for a checkpoint (%s): not waited for", namespace, name, exc)
        return "refused"
    return written


async def _changes(kube: Kube, node: str, pods: dict[str, Pod], rv: str) -> AsyncIterator[None]:
    """Keeps ``pods`` current from one watch of the node's pods; yields after each change."""
    while True:
        try:
            async with contextlib.aclosing(kube.watch_pods_on_node(node, rv, 300)) as events:
                async for event in events:
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        raise KubeUnavailable(str(obj.get("message") or "watch expired"))
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if event.get("type") == "BOOKMARK":
                        continue
                    if event.get("type") == "DELETED":
                        pods.pop(checkpoint.pod_name(obj), None)
                    else:
                        pods[checkpoint.pod_name(obj)] = obj
                    yield
            continue  # the server ended the watch: go on from where it was
        except KubeUnavailable as exc:
            log.info("pod watch of %s broke (%s); listing again", node, exc)
        await asyncio.sleep(_RELIST_PAUSE)
        page = await kube.list_pods_on_node_page(node)
        pods.clear()
        pods.update({checkpoint.pod_name(p): p for p in page.get("items") or []})
        rv = (page.get("metadata") or {}).get("resourceVersion") or ""
        yield


def _details(result: str, wait: Wait, grace: float, prog: Progress, asked: set[str], refused: set[str],
             now: float) -> dict[str, Any]:
    return {
        "result": result,
        "grace_s": grace,
        "requested_at": checkpoint.rfc3339(wait.at),
        "deadline": checkpoint.rfc3339(wait.until),
        "waited_s": round(max(0.0, min(now, wait.until) - wait.at), 2),
        "asked": len(asked | set(prog.answered) | set(prog.pending)),
        "answered": list(prog.answered[:_LISTED]),
        "unanswered": list((prog.pending + prog.to_ask)[:_LISTED]),
        "forbidden": sorted(refused)[:_LISTED],
    }


async def before_drain(ctx: StepContext, step: StepLike, select: Select) -> tuple[str, dict[str, Any]]:
    """Ask for checkpoints and wait as the drain's ``checkpointGrace`` says; (summary, audit details).

    Nothing at all when the drain has no grace. A fault that left no running GPU is drained at once,
    with the reason logged and audited.
    """
    grace = step.spec.checkpoint_grace
    if grace is None:
        return "", {}
    incident = ctx.incident
    lost = checkpoint.gpu_lost(incident, Catalog.configured()) if incident is not None else None
    if lost is not None:
        log.warning("drain of %s (%s) starts without a checkpoint wait: %s", ctx.plan.node, ctx.plan.flow_key, lost)
        metrics.CHECKPOINT_WAITS.labels("gpu-lost").observe(0)
        return f"no checkpoint wait ({lost})", {"checkpoint": {"result": "gpu-lost", "reason": lost}}
    node = ctx.plan.node
    wait = await _the_wait(ctx, step, grace)
    message = checkpoint.request_message(incident, node, wait)
    page = await ctx.kube.list_pods_on_node_page(node)
    pods: dict[str, Pod] = {checkpoint.pod_name(p): p for p in page.get("items") or []}
    asked: set[str] = set()
    refused: set[str] = set()
    first = True
    changes = _changes(ctx.kube, node, pods, (page.get("metadata") or {}).get("resourceVersion") or "")
    async with contextlib.aclosing(changes):
        while True:
            now = time.time()
            prog = checkpoint.progress(_waited_for(pods, select), wait, frozenset(refused))
            # Each pod is asked once per run: one whose written request does not show (yet) waits for the watch.
            fresh = [n for n in prog.to_ask if n not in asked]
            if now < wait.until and (fresh or first):
                # On a resumed wait the pods asked before get their Event only if it was lost (fixed name).
                todo = fresh + (list(prog.pending) if first else [])
                results = await asyncio.gather(*(_ask(ctx, pods[n], message, event_only=n not in fresh) for n in todo))
                for name, written in zip(todo, results, strict=True):
                    if written == "refused":
                        refused.add(name)
                    elif written == "gone":
                        pods.pop(name, None)
                    elif name in fresh:
                        asked.add(name)
                        pods[name] = written  # type: ignore[assignment]
                first = False
                continue  # look again with what was written
            if prog.over:
                result = "answered" if prog.answered else "no-gpu-pods"
                break
            remaining = wait.until - now
            if remaining <= 0:
                result = "grace-expired"
                break
            try:
                async with asyncio.timeout(remaining):
                    await anext(changes)
            except TimeoutError:
                prog = checkpoint.progress(_waited_for(pods, select), wait, frozenset(refused))
                result = "answered" if prog.over and prog.answered else "grace-expired"
                break
    end = time.time()
    details = _details(result, wait, grace, prog, asked, refused, end)
    metrics.CHECKPOINT_WAITS.labels(result).observe(details["waited_s"])
    if result == "answered":
        summary = f"checkpoint answered by {len(prog.answered)} pods after {details['waited_s']:g}s"
    elif result == "no-gpu-pods":
        summary = "no GPU pod to wait for"
    else:
        summary = (f"checkpoint grace {grace:g}s expired: {len(prog.pending) + len(prog.to_ask)} of "
                   f"{len(prog.pending) + len(prog.to_ask) + len(prog.answered)} pods did not answer")
    log.info("drain of %s (%s): %s", node, ctx.plan.flow_key, summary)
    return summary, {"checkpoint": details}
