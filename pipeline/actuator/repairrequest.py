"""The hand-off to an external repair system: the ``RepairRequest`` object and its CloudEvent.

``RepairRequest`` (``xidflow.dev/v1alpha1``, cluster-scoped, deploy/crds/repairrequests.xidflow.dev.yaml) names
the node, the fault class, the faults with their evidence, the repairs tried and the diagnostics run, and why
xidflow stopped repairing. The external system (people with a ticket queue, a vendor's RMA tool, a
replacement controller) answers in its ``status``: ``phase`` ``Repaired`` or ``Replaced`` hands the node back,
and xidflow runs the diagnostics gate again; until then xidflow does not touch the node. With the rule's
``handoff.webhookUrl`` the same request is also POSTed as a CloudEvent (structured JSON,
``dev.xidflow.repair.requested.v1``). The body builders are pure; ``create``, ``answer`` and ``AnswerWatch``
do the I/O. The schema is a contract: docs/repair.md, tests/unit/test_repairrequest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any

from pipeline.actuator import effects
from pipeline.actuator.kube import AlreadyExists, Kube, KubeError, KubeUnavailable, NotFound
from pipeline.kafka import cloudevents

log = logging.getLogger("xidflow.actuator.repairrequest")

GROUP, VERSION, KIND, PLURAL = "xidflow.dev", "v1alpha1", "RepairRequest", "repairrequests"
CRD_NAME = f"{PLURAL}.{GROUP}"
EVENT_TYPE = "dev.xidflow.repair.requested.v1"
"""The CloudEvent type of a hand-off (the data is the RepairRequest object)."""
NODE_LABEL = "xidflow.dev/node"
CASE_LABEL = "xidflow.dev/case"


def body(node: str, name: str, case: Mapping[str, Any], reason: str, worker: str) -> dict[str, Any]:
    """The RepairRequest for a node's repair case (pure)."""
    faults = [
        {
            "incidentId": f.get("incident"),
            "revision": f.get("rev"),
            "kind": f.get("kind"),
            "code": f.get("code"),
            "pci": f.get("pci"),
            "signature": f.get("signature"),
            "count": f.get("count"),
            "firstSeen": f.get("first_seen"),
            "lastSeen": f.get("last_seen"),
            "evidenceIds": list(f.get("evidence") or []),
            "line": f.get("line") or "",
        }
        for f in case.get("faults") or []
    ]
    repairs = [
        {"action": r.get("action"), "flow": r.get("flow"), "outcome": r.get("outcome"), "at": _rfc3339(r.get("at"))}
        for r in case.get("repairs") or []
    ]
    diagnostics = [
        {"job": d.get("job"), "verdict": d.get("verdict"), "message": d.get("message") or "",
         "at": _rfc3339(d.get("at"))}
        for d in case.get("diagnostics") or []
    ]
    spec = {
        "nodeName": node,
        "caseId": str(case.get("case")),
        "faultClass": str(case.get("class")),
        "reason": reason[:1024],
        "requestedAt": effects.now_rfc3339(),
        "requestedBy": worker,
        "rule": str(case.get("rule") or ""),
        "failedRepairs": int(case.get("failed") or 0),
        "faults": _clean(faults),
        "repairsTried": _clean(repairs),
        "diagnostics": _clean(diagnostics),
    }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {
            "name": name,
            "labels": {NODE_LABEL: node[:63].rstrip("-."), CASE_LABEL: str(case.get("case"))[:63],
                       "app.kubernetes.io/managed-by": "xidflow"},
        },
        "spec": spec,
    }


def _clean(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Without null fields (the CRD's schema types them; a null is no value)."""
    return [{k: v for k, v in item.items() if v is not None} for item in items]


def _rfc3339(epoch: Any) -> str | None:
    if epoch is None:
        return None
    from datetime import UTC, datetime

    return datetime.fromtimestamp(float(epoch), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def cloudevent(request: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The hand-off as a CloudEvent in structured JSON (pure): the RepairRequest is its data."""
    spec = request["spec"]
    return {
        "specversion": cloudevents.SPEC_VERSION,
        "id": request["metadata"]["name"],
        "source": cloudevents.source_of(source, "actuator"),
        "type": EVENT_TYPE,
        "subject": spec["nodeName"],
        "time": spec["requestedAt"],
        "datacontenttype": "application/json",
        "data": dict(request),
    }


async def create(kube: Kube, request: dict[str, Any]) -> bool:
    """Create the RepairRequest once: False when it exists already (a retry, a racing replica)."""
    try:
        await kube.create_cluster_object(GROUP, VERSION, PLURAL, request)
    except AlreadyExists:
        return False
    return True


async def post(url: str, event: dict[str, Any], limit_s: float = 10) -> int:
    """POST the CloudEvent (structured mode); the receiver dedupes on its ``id`` (also the Idempotency-Key)."""
    import aiohttp  # only a webhook hand-off needs it

    headers = {"Content-Type": "application/cloudevents+json", "Idempotency-Key": str(event["id"])}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=limit_s)) as session:
        async with session.post(url, json=event, headers=headers) as resp:
            resp.raise_for_status()
            return resp.status


def phase_of(obj: Mapping[str, Any] | None) -> tuple[str | None, str]:
    """(status.phase, status.updatedBy or '') of a RepairRequest (pure)."""
    status = (obj or {}).get("status") or {}
    phase = status.get("phase")
    return (str(phase) if phase else None), str(status.get("updatedBy") or status.get("by") or "")


class AnswerWatch:
    """A list+watch of RepairRequests: each one's phase, and a call for its node when an answer comes.

    The engine asks ``answer(name)``: the watch's view once it has listed, else a GET. A missing CRD is
    retried quietly (hand-offs fail loudly in their own step until it is installed).

    The watch starts at the first ``answer`` (a flow waiting on a hand-off, or one resumed by a restarted
    replica), not with the replica: its list is the first call of the generated custom-objects API
    (about a second of import), and a replica's first quarantines must not wait behind it (issue 22).
    A replica that never hands a node off never watches.
    """

    def __init__(self, kube: Kube, on_answer: Callable[[str], None]) -> None:
        self.kube, self.on_answer = kube, on_answer
        self.phases: dict[str, tuple[str | None, str]] = {}
        self.nodes: dict[str, str] = {}
        self.synced = False
        self._task: asyncio.Task[None] | None = None
        self._enabled = False

    def start(self) -> None:
        """Let the first ``answer`` start the watch (see the class docstring)."""
        self._enabled = True

    def _ensure_watching(self) -> None:
        if self._enabled and self._task is None:
            self._task = asyncio.create_task(self._run(), name="repairrequest-watch")

    async def stop(self) -> None:
        self._enabled = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def answer(self, name: str) -> tuple[str | None, str]:
        self._ensure_watching()
        if self.synced and name in self.phases:
            return self.phases[name]
        return await read_answer(self.kube, name)

    def _seen(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name"))
        before = self.phases.get(name)
        self.phases[name] = phase_of(obj)
        node = str((obj.get("spec") or {}).get("nodeName") or "")
        self.nodes[name] = node
        if self.phases[name] != before and self.phases[name][0] and node:
            self.on_answer(node)

    async def _run(self) -> None:
        while True:
            try:
                page = await self.kube.list_cluster_objects_page(GROUP, VERSION, PLURAL)
                for obj in page.get("items") or []:
                    self._seen(obj)
                self.synced = True
                rv = (page.get("metadata") or {}).get("resourceVersion")
                async for event in self.kube.watch_cluster_objects(GROUP, VERSION, PLURAL, rv):
                    if event.get("type") == "ERROR":
                        break
                    obj = event.get("object") or {}
                    if event.get("type") == "DELETED":
                        name = str((obj.get("metadata") or {}).get("name"))
                        self.phases.pop(name, None)
                        self.nodes.pop(name, None)
                    elif event.get("type") != "BOOKMARK":
                        self._seen(obj)
            except asyncio.CancelledError:
                raise
            except (KubeError, KubeUnavailable) as exc:
                self.synced = False
                log.debug("RepairRequest watch: %s; again shortly", exc)
                await asyncio.sleep(5)
            except Exception as exc:  # noqa: BLE001 - the watch must outlive API server restarts
                self.synced = False
                log.warning("RepairRequest watch failed: %s; again shortly", exc)
                await asyncio.sleep(5)


async def read_answer(kube: Kube, name: str) -> tuple[str | None, str]:
    """(phase, by) of one RepairRequest by a GET; (None, '') when it is missing."""
    with contextlib.suppress(NotFound):
        return phase_of(await kube.get_cluster_object(GROUP, VERSION, PLURAL, name))
    return None, ""
