"""Pending plans, counted cluster-wide in one ConfigMap (through :class:`Kube`), and Idempotency-Keys.

Each accepted request id has one entry: who asked, when it expires, and the fingerprint of the body
it was accepted with. The entry stays after the actuator releases the plan (it then stops counting
against the limit) until it expires, so that an ``Idempotency-Key`` reused with a *different* body is
recognised and refused (409, as the IETF idempotency-key draft describes) instead of running a second
plan under the same request id. A plan stops counting when the actuator calls
:meth:`ConfigMapPlanLedger.release`, or on its own once its wait times plus ``plan_grace_seconds``
have passed (so a lost release cannot block the API forever).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any, Protocol

import orjson

from pipeline.actuator.api.settings import ApiSettings
from pipeline.actuator.kube import AlreadyExists, Conflict, Kube, NotFound
from pipeline.actuator.requests import RescueActionRequest
from schemas.records import stable_id, utcnow

log = logging.getLogger("pipeline.actuator.api")


class PlanReservation(StrEnum):
    RESERVED = "reserved"
    ALREADY_RESERVED = "already-reserved"
    LIMIT_EXCEEDED = "limit-exceeded"
    IDEMPOTENCY_CONFLICT = "idempotency-conflict"


def request_fingerprint(request: RescueActionRequest) -> str:
    """What the client asked for, independent of spelling (``Z`` or ``+00:00``, key order)."""
    actions = [(a.name, a.waittime) for a in request.actions]
    return stable_id("rescue-body", request.node_name, request.xid, request.escalate_time.isoformat(), actions)


class PlanLedger(Protocol):
    """Counts pending plans across every API replica."""

    @property
    def max_pending(self) -> int: ...

    async def reserve(self, request: RescueActionRequest) -> PlanReservation: ...

    async def release(self, request_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class PendingPlan:
    """One ledger entry: a plan accepted by the API; ``released`` once the actuator is done with it."""

    request_id: str
    node: str
    requested_by: str
    received_at: datetime
    expires_at: datetime
    fingerprint: str = ""
    released: bool = False

    def to_json(self) -> str:
        fields: dict[str, Any] = {
            "node": self.node,
            "requested_by": self.requested_by,
            "received_at": self.received_at.isoformat(),
            "expires_at": self.expires_at.isoformat(),
            "fingerprint": self.fingerprint,
        }
        if self.released:
            fields["released"] = True
        return orjson.dumps(fields).decode()

    @classmethod
    def from_json(cls, request_id: str, text: str) -> PendingPlan:
        fields = orjson.loads(text)
        return cls(
            request_id=request_id,
            node=str(fields["node"]),
            requested_by=str(fields.get("requested_by", "")),
            received_at=datetime.fromisoformat(fields["received_at"]),
            expires_at=datetime.fromisoformat(fields["expires_at"]),
            fingerprint=str(fields.get("fingerprint", "")),
            released=bool(fields.get("released", False)),
        )


def live_entries(data: Mapping[str, str], now: datetime) -> dict[str, PendingPlan]:
    """The ledger's unexpired entries, released or not; unreadable ones are dropped (they would hold a slot)."""
    plans: dict[str, PendingPlan] = {}
    for request_id, text in data.items():
        try:
            plan = PendingPlan.from_json(request_id, text)
        except (ValueError, KeyError, TypeError):
            log.warning("dropping unreadable pending-plan entry %s", request_id)
            continue
        if plan.expires_at > now:
            plans[request_id] = plan
    return plans


def live_plans(data: Mapping[str, str], now: datetime) -> dict[str, PendingPlan]:
    """The plans that count against the limit now: unexpired and not released."""
    return {rid: plan for rid, plan in live_entries(data, now).items() if not plan.released}


def reserve_plan(
    data: Mapping[str, str],
    request: RescueActionRequest,
    *,
    now: datetime,
    max_pending: int,
    grace_seconds: float,
) -> tuple[PlanReservation, dict[str, str] | None]:
    """Decide a reservation against the ledger's data; the new data to write when it changed."""
    entries = live_entries(data, now)
    fingerprint = request_fingerprint(request)
    known = entries.get(request.request_id)
    if known is not None:
        if known.fingerprint and known.fingerprint != fingerprint:
            return PlanReservation.IDEMPOTENCY_CONFLICT, None
        return PlanReservation.ALREADY_RESERVED, None
    if sum(not plan.released for plan in entries.values()) >= max_pending:
        return PlanReservation.LIMIT_EXCEEDED, None
    expires_at = now + timedelta(seconds=request.total_wait_seconds + grace_seconds)
    entry = PendingPlan(request.request_id, request.node_name, request.requested_by, now, expires_at, fingerprint)
    new_data = {rid: data[rid] for rid in entries}
    new_data[request.request_id] = entry.to_json()
    return PlanReservation.RESERVED, new_data


def release_plan(data: Mapping[str, str], request_id: str, now: datetime) -> dict[str, str] | None:
    """The ledger with ``request_id`` released (kept for its fingerprint); None when nothing changes."""
    entries = live_entries(data, now)
    plan = entries.get(request_id)
    if plan is not None and plan.released:
        return None
    if plan is None:
        # Unknown: nothing to release. Expired (or unreadable): drop it while writing anyway.
        return {rid: data[rid] for rid in entries} if request_id in data else None
    new_data = {rid: data[rid] for rid in entries}
    new_data[request_id] = replace(plan, released=True).to_json()
    return new_data


class PlanLedgerContention(RuntimeError):
    """Too many writers changed the ledger at once; the caller answers 503 and the client retries."""


class ConfigMapPlanLedger:
    """:class:`PlanLedger` in one ConfigMap, updated with optimistic concurrency (409 -> re-read)."""

    def __init__(
        self,
        kube: Kube,
        *,
        namespace: str,
        name: str,
        max_pending: int,
        grace_seconds: float,
        clock: Callable[[], datetime] = utcnow,
        max_attempts: int = 20,
    ) -> None:
        self._kube = kube
        self._namespace = namespace
        self._name = name
        self._max_pending = max_pending
        self._grace_seconds = grace_seconds
        self._clock = clock
        self._max_attempts = max_attempts

    @classmethod
    def from_settings(cls, kube: Kube, settings: ApiSettings) -> ConfigMapPlanLedger:
        return cls(
            kube,
            namespace=settings.namespace,
            name=settings.plans_configmap,
            max_pending=settings.max_pending_plans,
            grace_seconds=settings.plan_grace_seconds,
        )

    @property
    def max_pending(self) -> int:
        return self._max_pending

    async def pending(self) -> dict[str, PendingPlan]:
        """The plans counted now."""
        config_map = await self._read()
        return live_plans(_data(config_map), self._clock())

    async def reserve(self, request: RescueActionRequest) -> PlanReservation:
        for _ in range(self._max_attempts):
            config_map = await self._read()
            outcome, new_data = reserve_plan(
                _data(config_map),
                request,
                now=self._clock(),
                max_pending=self._max_pending,
                grace_seconds=self._grace_seconds,
            )
            if new_data is None:
                return outcome
            if await self._write(config_map, new_data):
                return outcome
        raise PlanLedgerContention(f"gave up reserving after {self._max_attempts} conflicting writes")

    async def release(self, request_id: str) -> None:
        """Stop counting a plan (the actuator calls this once the plan is done or abandoned)."""
        for _ in range(self._max_attempts):
            config_map = await self._read()
            if config_map is None:
                return
            new_data = release_plan(_data(config_map), request_id, self._clock())
            if new_data is None or await self._write(config_map, new_data):
                return
        raise PlanLedgerContention(f"gave up releasing after {self._max_attempts} conflicting writes")

    async def _read(self) -> dict[str, Any] | None:
        try:
            return await self._kube.get_configmap(self._namespace, self._name)
        except NotFound:
            return None

    async def _write(self, config_map: dict[str, Any] | None, data: dict[str, str]) -> bool:
        """Create or conditionally replace the ConfigMap; False when another replica wrote first."""
        try:
            if config_map is None:
                body = {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {
                        "name": self._name,
                        "namespace": self._namespace,
                        "labels": {"app.kubernetes.io/managed-by": "xidflow", "app.kubernetes.io/component": "api"},
                    },
                    "data": data,
                }
                await self._kube.create_configmap(self._namespace, body)
            else:
                # The body carries metadata.resourceVersion: 409 if anyone wrote since it was read.
                await self._kube.replace_configmap(self._namespace, self._name, {**config_map, "data": data})
        except (Conflict, AlreadyExists):
            return False
        return True


def _data(config_map: Mapping[str, Any] | None) -> dict[str, str]:
    return dict((config_map or {}).get("data") or {})
