"""Audit: one RemediationRecord on ``gpu.remediation.audit`` per decision and per effect.

``emit`` returns only once the broker has the record (acks=all, idempotent producer): the consumer
commits an incident's offset only after its effects *and* their audit records are durable. The
notifier (webhooks, ``pipeline.actuator.notify``), when configured, is told without waiting.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import datetime
from typing import Any, Protocol

from aiokafka import AIOKafkaProducer

from pipeline.actuator.fleetmetrics import remediation_action
from pipeline.actuator.workload import DETAILS_KEY as WORKLOAD_KEY
from pipeline.kafka import clients as kafka_clients
from pipeline.runtime import metrics
from schemas.records import NodeIncident, Outcome, RemediationRecord, WorkloadSummary, stable_id, utcnow

log = logging.getLogger("xidflow.actuator.audit")


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


class Auditor:
    """Publishes audit records durably and hands them to the notifier."""

    def __init__(self, bootstrap_servers: str, topic: str, notifier: NotifierLike | None = None) -> None:
        self.topic = topic
        self.notifier = notifier
        self.bootstrap_servers = bootstrap_servers
        self._producer: AIOKafkaProducer | None = None

    async def start(self) -> None:
        self._producer = kafka_clients.producer(
            bootstrap=self.bootstrap_servers,
            acks="all",
            enable_idempotence=True,
            linger_ms=5,
            request_timeout_ms=30000,
        )
        await self._producer.start()

    async def stop(self) -> None:
        if self._producer is not None:
            await self._producer.stop()

    async def emit(self, record: RemediationRecord, tell: bool = True) -> None:
        """Publish durably; ``tell=False`` keeps it from the notifier (a record a person was already told of)."""
        assert self._producer is not None, "Auditor.start() first"
        # pydantic's own JSON writer: the same bytes as ``Record.to_bytes`` for these records, without the
        # dict of Python objects that ``to_bytes`` builds for orjson first (a node's ~5 records add up in a burst).
        await self._producer.send_and_wait(self.topic, record.model_dump_json().encode(), key=record.node.encode())
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
