"""Audit: one RemediationRecord on ``gpu.remediation.audit`` per decision and per effect.

``emit`` returns only once the broker has the record (acks=all, idempotent producer): the consumer
commits an incident's offset only after its effects *and* their audit records are durable. The
notifier (webhooks, ``pipeline.actuator.notify``), when configured, is told once the record is durable,
without waiting for it.

``submit`` queues a record and hands back a future the broker's acknowledgement resolves; the engine
gathers a flow's futures before its record counts as done, so the contract above holds for it too.
Queued records wait while this process is taking nodes out of scheduling (``hold``: the same calm the
API calls of Events and conditions wait for, ``Kube.until_calm``), then go out together, in the order
they were queued, as few large produce requests. In a 500-node burst the ~6 records per node were ~240
produce requests and their serialisation ran between the taints, on the actuators' and the broker's CPU
that the taints needed; now they follow the last taint. ``emit`` (and ``hurry``) send everything queued at
once: a record someone waits for is never held, and it never overtakes a node's earlier records.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, Protocol

from aiokafka import AIOKafkaProducer

from pipeline.actuator.fleetmetrics import remediation_action
from pipeline.actuator.workload import DETAILS_KEY as WORKLOAD_KEY
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.cloudevents import CloudEventsSettings
from pipeline.kafka.cloudevents import headers as ce_headers
from pipeline.runtime import metrics
from schemas.records import NodeIncident, Outcome, RemediationRecord, WorkloadSummary, stable_id, utcnow

log = logging.getLogger("xidflow.actuator.audit")

AUDIT_DETAILS: dict[str, str] = {
    # decide / resume
    "rule": "decide, resume: the policy rule that matched (its name, `<policy>[<index>]` when unnamed, "
    "`global-default`, or `rescue-request`).",
    "steps": "decide, resume: the steps of the plan, in order (`cordon`, `taint`, `drain#2`, ...).",
    "escalation": "decide: why the flow was escalated to CONTACT_SUPPORT (the attempt cap, or the incident's action).",
    "xid": "decide of a rescue request: the Xid the request names.",
    # steps in general
    "applied_by": "A step found done in the node's ledger (outcome `already-applied`): the replica that applied it; "
    "the ledger's details of that application follow.",
    "holder": "A long step held by another live replica (outcome `skipped`): that replica's id.",
    "lease_until": "With `holder`: when its lease lapses unless renewed (epoch seconds).",
    "retaken_from": "A long step whose holder vanished: the replica whose lease was retaken.",
    "event": "event, hardwareInspection: the Event's name (deterministic: a redelivery finds it).",
    # drain and its checkpoint wait
    "evicted": "drain: the pods evicted (namespace/name).",
    "forced": "drain: the pods deleted after `forceAfter` (only in `forceNamespaces`).",
    "left_alone": "drain: the pods the drain's filters leave on the node (excluded namespaces, xidflow's own pods and "
    "the kinds a drain never evicts).",
    "gpu_devices": "drain with `scope: gpu`: the DRA devices (driver/pool/device) this flow's DeviceTaintRules took "
    "out of service; only the pods holding them are evicted.",
    "holders": "drain with `scope: gpu`: the pods whose ResourceClaims hold those devices (namespace/name).",
    "blocked": "drain, failed: the pods still there at the timeout (PodDisruptionBudgets refused them).",
    "stranded": "drain: pods left terminating on a node whose kubelet is silent (Ready `Unknown`): their eviction or "
    "deletion was accepted, but nothing can end them until the machine is back (not waited for).",
    "checkpoint": "drain with `checkpointGrace`: the checkpoint wait: `result`, `grace_s`, `requested_at`, "
    "`deadline`, `waited_s`, `asked`, `answered`, `unanswered`, `forbidden`.",
    "result": "In `checkpoint`: answered, grace-expired, no-gpu-pods or gpu-lost. diagnose: the result object of the "
    "Job's termination message (docs/repair.md, `xidflow.dev/diagnostics-result/v1`).",
    "grace_s": "In `checkpoint`: the policy's checkpointGrace, in seconds.",
    "requested_at": "In `checkpoint`: when the pods were asked (RFC 3339).",
    "deadline": "In `checkpoint`: when each pod is evicted whatever it answered (RFC 3339).",
    "waited_s": "In `checkpoint`: seconds from the request to the last answer or the deadline.",
    "asked": "In `checkpoint`: how many pods were asked.",
    "answered": "In `checkpoint`: pods that answered (a few named).",
    "unanswered": "In `checkpoint`: pods that did not answer in time (a few named).",
    # reboot, resetGpu
    "hook": "reboot: how the reboot was asked for (`job`, `annotation`, `webhook`).",
    "boot_id_before": "reboot: the node's bootID before the reboot.",
    "boot_id_after": "reboot: the new bootID it came back with.",
    "job": "reboot (Job hook), resetGpu, diagnose: the hook Job's name.",
    "created": "reboot (Job hook), resetGpu, diagnose: whether this application created the Job (false: it existed); "
    "hardwareInspection: whether it created the RepairRequest.",
    "job_not_started": "reboot (Job hook): why no Job was created (the node was unreachable all along: a Job's pod "
    "cannot run there, and would reboot the machine again when it comes back).",
    "job_end": "resetGpu: how the Job controller ended the Job (`Complete`, or `Failed: <reason>: <message>`).",
    "taint": "reboot (Job hook), resetGpu, diagnose: xidflow's taint before the Job (the admission policy admits a "
    "hook Job only on a node carrying it): `node carries <key>`, or that the step tainted the node itself.",
    "status": "reboot (webhook hook): the HTTP status the webhook answered.",
    # diagnose, hardwareInspection and the repair loop (docs/repair.md)
    "verdict": "taintDevice: `device`, `device+node` (over maxTaintedDevices: the node is cordoned too) or `node`; "
    "diagnose: `pass`, `fail` or `timeout`.",
    "repair_request": "hardwareInspection, hand-back: the RepairRequest's name.",
    "reason": "hardwareInspection: why xidflow stopped repairing (the RepairRequest's `spec.reason`).",
    "webhook_status": "hardwareInspection with handoff.webhookUrl: the HTTP status the webhook answered the "
    "CloudEvent.",
    "fault_class": "return-to-service: the repair case's fault class (GpuFellOffBus, GpuEcc, ...).",
    "undone": "return-to-service: per flow of the case, what its undo removed.",
    "answer": "hand-back: the RepairRequest's phase (`Repaired` or `Replaced`).",
    "by": "hand-back: who answered (the RepairRequest's `status.updatedBy`).",
    "flow": "hand-back: the gate flow it opened (`<case>-<n>`).",
    "repair_budget": "drain, reboot, resetGpu, diagnose under a RescuePolicy's repairBudgets: the groups "
    "(`<label>=<value>`) whose slot the step held.",
    "budget_waited_s": "With `repair_budget`: seconds the step waited for a slot (a group was full).",
    "recovered": "undo: the NodeRecovered reason (`reboot`, `quiet`, `manual`, `cancelled`).",
    "detail": "undo: the NodeRecovered's detail (a cancelling code names itself and the line).",
    "evidence_ids": "undo of a cancelled incident: the fault event ids of the code that cancels it.",
    "cancelled_by": "undo of a cancelled incident: the signature of the event that cancels it (xid:162:...).",
    "uncordon": "reboot with uncordonAfter: what the uncordon after the reboot did.",
    # taintDevice
    "scope": "taintDevice: what the fault affects (`gpu` or `node`).",
    "pci": "taintDevice: the faulty GPU's PCI address.",
    "gpu_instance": "taintDevice: the MIG GPU instance the fault names (`GPU-I:<n>` in the Xid), when it names one: "
    "that instance's MIG device is tainted where the DRA driver publishes it, else the whole GPU.",
    "rules": "taintDevice: the DeviceTaintRules created (names).",
    "devices": "taintDevice: the DRA devices tainted (driver, pool, device).",
    "effect": "taintDevice: the device taint's effect: NoSchedule (the default), NoExecute (Kubernetes deletes the "
    "pods holding the device) or None (a dry run).",
    "node_quarantine": "taintDevice: what the node quarantine did, where the node was quarantined.",
    # notifyWorkload
    "events": "notifyWorkload: Warning Events written on affected pods.",
    "conditions": "notifyWorkload: pods given the xidflow.dev/GPUFault condition.",
    "forbidden": "notifyWorkload, checkpoint: pods the actuator was not allowed to write (RBAC, admission).",
    # enableWarmStandby
    "standby": "enableWarmStandby: the standby node made schedulable.",
    "targets": "enableWarmStandby, failed: the label sets a standby node had to match.",
    # shared parts
    "revision": "sharedPart: the shared-part incident's revision (nodes joining raise it).",
    "tainted": "sharedPart: the nodes carrying the part's taint.",
    "skipped": "sharedPart: nodes of the part that could not be marked now (gone, opted out, ...).",
    "notified": "sharedPart: true on the part's first record only: the notifier tells people once per part "
    "(\"switch X is faulty\"), later revisions are audited without a notification.",
    # refusals
    "refused": "rescue-request: what was refused (`signature`).",
    "request_id": "rescue-request, api-idempotency-conflict: the request's id.",
    "claimed_requested_by": "rescue-request: the client the refused record claims (not proven: it is unsigned or "
    "forged).",
    "requested_by": "api-idempotency-conflict: the authenticated client that reused the key.",
    "idempotency_key": "api-idempotency-conflict: the key reused.",
    "actions": "api-idempotency-conflict: the actions of the refused body.",
}
"""The keys of a record's ``details``, with what they mean: docs/audit.md is generated from it, and
tests/unit/test_contract_docs.py fails when the actuator's code writes a key that is not here (the actions:
``fleetmetrics.AUDIT_ACTIONS``). ``undo`` records
carry an ``UndoPlan`` (``pipeline.actuator.plan``): its fields are listed from the dataclass."""


class NotifierLike(Protocol):
    def notify(self, record: RemediationRecord | NodeIncident) -> None: ...


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def make_record(
    *,
    node: str,
    flow_key: str | None,
    action: str,
    outcome: Outcome,
    reason: str = "",
    worker_id: str = "",
    dry_run: bool = False,
    started_at: datetime | None = None,
    details: dict[str, Any] | None = None,
) -> RemediationRecord:
    """A record whose id is deterministic per (node, flow, action, outcome): consumers can dedupe.

    A step's ``details[WORKLOAD_KEY]`` (notifyWorkload) becomes the record's typed ``workload`` field."""
    details = dict(details or {})
    workload = details.pop(WORKLOAD_KEY, None)
    return RemediationRecord(
        record_id=stable_id("remediation", node, flow_key, action, outcome.value),
        node=node,
        incident_id=flow_key,
        action=action,
        outcome=outcome,
        reason=reason,
        started_at=started_at or utcnow(),
        finished_at=utcnow(),
        worker_id=worker_id,
        dry_run=dry_run,
        details=details,
        workload=WorkloadSummary.model_validate(workload) if workload is not None else None,
    )


# Records of one flush in one produce batch per partition (aiokafka's default is 16 KiB: a burst's flush of
# ~1.5 MB then took one acknowledgement round trip per 16 KiB of a partition).
_MAX_BATCH_BYTES = 1 << 18


class Auditor:
    """Publishes audit records durably and hands them to the notifier."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str,
        notifier: NotifierLike | None = None,
        hold: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.topic = topic
        self.notifier = notifier
        self.bootstrap_servers = bootstrap_servers
        self.hold = hold
        """Awaited before queued records are sent (``None``: sent at the next loop turn)."""
        self.ce_source = CloudEventsSettings().source
        """Prefix of the ``ce_source`` header every record carries (the CloudEvents Kafka binding)."""
        self._producer: AIOKafkaProducer | None = None
        self._queued: list[tuple[RemediationRecord, bool, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._now: asyncio.Event | None = None
        self._hurried = False

    async def start(self) -> None:
        self._producer = kafka_clients.producer(
            bootstrap=self.bootstrap_servers,
            acks="all",
            enable_idempotence=True,
            linger_ms=5,
            max_batch_size=_MAX_BATCH_BYTES,
            request_timeout_ms=30000,
        )
        await self._producer.start()

    async def stop(self) -> None:
        self.hurry()
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)
        if self._producer is not None:
            await self._producer.stop()

    def hurry(self) -> None:
        """From now on nothing waits for ``hold`` (shutdown: the records in flight are not held up)."""
        self._hurried = True
        if self._now is not None:
            self._now.set()

    async def emit(self, record: RemediationRecord, tell: bool = True) -> None:
        """Publish durably; ``tell=False`` keeps it from the notifier (a record a person was already told of)."""
        await self.submit(record, tell, now=True)

    def submit(self, record: RemediationRecord, tell: bool = True, now: bool = False) -> asyncio.Future[None]:
        """Queue a record; the future is done once the broker has it (or failed with the producer's error).

        ``now``: send it and everything queued before it without waiting for ``hold``."""
        assert self._producer is not None, "Auditor.start() first"
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._queued.append((record, tell, done))
        if self._now is None:
            self._now = asyncio.Event()
        if now or self._hurried:
            self._now.set()
        if self._flusher is None:
            self._flusher = loop.create_task(self._flush())
        return done

    async def _flush(self) -> None:
        assert self._now is not None
        try:
            while self._queued:
                if self.hold is not None and not self._now.is_set():
                    # Whichever comes first: calm, or a record someone waits for (``emit``, ``hurry``).
                    waits = [asyncio.ensure_future(self.hold()), asyncio.ensure_future(self._now.wait())]
                    try:
                        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        for w in waits:
                            w.cancel()
                else:
                    await asyncio.sleep(0)  # what this loop turn queues too
                if not self._hurried:
                    self._now.clear()
                batch, self._queued = self._queued, []
                await self._send(batch)
        finally:
            self._flusher = None
            if self._queued:  # queued while the last send was cancelled (shutdown): not dropped silently
                for _, _, done in self._queued:
                    if not done.done():
                        done.set_exception(RuntimeError("auditor stopped before the record was sent"))
                self._queued = []

    async def _send(self, batch: list[tuple[RemediationRecord, bool, asyncio.Future[None]]]) -> None:
        """Hand the batch to the producer in order; each record's future follows its acknowledgement (not
        awaited here: the next batch is appended meanwhile, after this one, so a node's records keep their order)."""
        producer = self._producer
        assert producer is not None
        for record, tell, done in batch:
            try:
                # pydantic's own JSON writer: the same bytes as ``Record.to_bytes`` for these records, without
                # the dict of Python objects that ``to_bytes`` builds for orjson first.
                ack = await producer.send(self.topic, record.model_dump_json().encode(), key=record.node.encode(),
                                          headers=ce_headers(record, self.ce_source))
            except Exception as exc:  # noqa: BLE001 - handed to whoever waits for this record
                if not done.done():
                    done.set_exception(exc)
                continue
            ack.add_done_callback(lambda f, r=record, t=tell, d=done: self._settle_record(f, r, t, d))

    def _settle_record(
        self, ack: asyncio.Future[Any], record: RemediationRecord, tell: bool, done: asyncio.Future[None]
    ) -> None:
        if done.done():
            return
        if ack.cancelled():
            done.set_exception(RuntimeError("audit record not acknowledged: the producer was stopped"))
        elif (exc := ack.exception()) is not None:
            done.set_exception(exc)
        else:
            self._published(record, tell)
            done.set_result(None)

    def _published(self, record: RemediationRecord, tell: bool) -> None:
        metrics.REMEDIATIONS.labels(remediation_action(record.action), record.outcome.value).inc()
        log.info(
            "%s %s %s %s %s",
            record.node,
            record.incident_id,
            record.action,
            record.outcome.value,
            record.reason,
        )
        if tell:
            self.tell(record)

    def tell(self, record: RemediationRecord | NodeIncident) -> None:
        if self.notifier is None:
            return
        try:
            self.notifier.notify(record)
        except Exception:  # a broken notifier must never stop remediation
            log.exception("notifier failed for %s", getattr(record, "node", "?"))
