"""The decision API's aiohttp application and its start-up: ``POST /api/v1/rescue-actions``.

A request is answered ``Success`` only once it is durable: validated, checked against the cluster,
counted against the plans limit and acknowledged by every in-sync Kafka replica on
``gpu.remediation.requests`` (keyed by node). Any actuator replica then executes it; the API never
touches a node itself, so it needs only read access to Nodes and write access to one ConfigMap.

Answers keep the seed's body, ``{"code": "Success"|"Error", "message": ...}``, with HTTP statuses a
REST client can act on:

=====  ==========================================================================================
200    ``Success`` (header ``X-Request-Id`` carries the plan's request id)
400    ``Parameter error: <field> ...``
401    missing or wrong Bearer token
413    body larger than ``max_body_bytes``
404    ``Failures to meet preconditions: node N does not exist``
409    ``Failures to meet preconditions: node N is not a GPU node ...``, or an ``Idempotency-Key``
       reused with a different body (refused and audited)
429    ``Exceed the maximum plans limit N``
503    Kafka or the Kubernetes API could not be reached; retrying with the same ``Idempotency-Key``
       is safe (the actuator executes each request id once)
=====  ==========================================================================================
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from aiokafka import AIOKafkaProducer

from pipeline.actuator import signing
from pipeline.actuator.api.auth import TokenFileError, TokenStore
from pipeline.actuator.api.openapi import (
    IDEMPOTENCY_KEY_HEADER,
    REQUEST_ID_HEADER,
    RESCUE_ACTIONS_PATH,
    openapi_document,
)
from pipeline.actuator.api.plans import ConfigMapPlanLedger, PlanLedger, PlanReservation
from pipeline.actuator.api.preconditions import KubernetesNodeLookup, NodeLookup, NodeStatus, precondition_failure
from pipeline.actuator.api.settings import ApiSettings
from pipeline.actuator.audit import make_record
from pipeline.actuator.kube import Kube
from pipeline.actuator.ownership import request_flow_key
from pipeline.actuator.requests import ParameterError, RescueActionRequest, parse_rescue_request
from pipeline.kafka import clients as kafka_clients
from pipeline.runtime.settings import TopicNames
from schemas.records import Outcome, utcnow

log = logging.getLogger("pipeline.actuator.api")

IDEMPOTENCY_CONFLICT_ACTION = "api-idempotency-conflict"


class ApiStartError(RuntimeError):
    """The API cannot serve as configured; the message is one sentence for the operator."""


def _answer(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    code = "Success" if status == 200 else "Error"
    return web.json_response(
        {"code": code, "message": message},
        status=status,
        headers=headers,
        dumps=lambda v: orjson.dumps(v).decode(),
    )


def idempotency_conflict_record(request: RescueActionRequest) -> bytes:
    """The audit record of a refused reuse of an Idempotency-Key (who, which key, which node)."""
    return make_record(
        node=request.node_name,
        flow_key=request_flow_key(request.request_id),
        action=IDEMPOTENCY_CONFLICT_ACTION,
        outcome=Outcome.SKIPPED,
        reason="Idempotency-Key reused with a different body; refused with 409",
        worker_id="decision-api",
        details={
            "request_id": request.request_id,
            "requested_by": request.requested_by,
            "idempotency_key": request.idempotency_key,
            "xid": request.xid,
            "actions": [a.name for a in request.actions],
        },
    ).to_bytes()


def create_app(
    settings: ApiSettings,
    producer: AIOKafkaProducer,
    node_lookup: NodeLookup,
    *,
    plan_ledger: PlanLedger,
    topics: TopicNames | None = None,
    tokens: TokenStore | None = None,
) -> web.Application:
    """The aiohttp application.

    ``producer`` must be started and configured with ``acks="all"`` (see :func:`make_producer`);
    ``topics`` defaults to the environment's topic names; ``tokens`` to the settings' tokens.
    """
    tokens = tokens or TokenStore.from_settings(settings)
    if not tokens.has_sources():
        raise ValueError("no API tokens configured: set XIDFLOW_API_TOKENS or XIDFLOW_API_TOKEN_FILE")
    names = topics or TopicNames()
    topic = names.name("remediation_requests")
    audit_topic = names.name("remediation_audit")
    document = openapi_document(settings)
    signer = signing.Signer.from_settings()  # proof of origin (issue 12): every request record is signed

    async def audit_conflict(request: RescueActionRequest) -> None:
        log.warning(
            "rescue request %s from %s for node %s refused: Idempotency-Key reused with a different body",
            request.request_id,
            request.requested_by,
            request.node_name,
        )
        try:
            await asyncio.wait_for(
                producer.send_and_wait(
                    audit_topic, value=idempotency_conflict_record(request), key=request.node_name.encode()
                ),
                timeout=settings.produce_timeout_seconds,
            )
        except Exception:  # noqa: BLE001 - the refusal stands even when its audit record is lost
            log.exception("auditing the Idempotency-Key conflict of %s failed", request.request_id)

    async def rescue_actions(request: web.Request) -> web.Response:
        requested_by = tokens.identify(request.headers.get("Authorization"))
        if requested_by is None:
            return _answer(401, "Unauthorized", {"WWW-Authenticate": 'Bearer realm="xidflow"'})
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _answer(413, f"Parameter error: body is larger than {settings.max_body_bytes} bytes")
        parsed = parse_rescue_request(
            body,
            received_at=utcnow(),
            requested_by=requested_by,
            idempotency_key=request.headers.get(IDEMPOTENCY_KEY_HEADER),
        )
        if isinstance(parsed, ParameterError):
            return _answer(400, parsed.message)
        try:
            node_status = await node_lookup(parsed.node_name)
        except Exception:
            log.exception("node lookup failed for %s", parsed.node_name)
            return _answer(503, "Service unavailable: the Kubernetes API could not be reached")
        failure = precondition_failure(parsed.node_name, node_status, settings)
        if failure is not None:
            return _answer(404 if node_status is NodeStatus.MISSING else 409, failure)
        try:
            reservation = await plan_ledger.reserve(parsed)
        except Exception:
            log.exception("reserving plan %s failed", parsed.request_id)
            return _answer(503, "Service unavailable: pending plans could not be counted")
        if reservation is PlanReservation.IDEMPOTENCY_CONFLICT:
            await audit_conflict(parsed)
            return _answer(
                409,
                f"Parameter error: {IDEMPOTENCY_KEY_HEADER} was already used with a different request body; "
                "use a new key for a new request",
            )
        if reservation is PlanReservation.LIMIT_EXCEEDED:
            return _answer(429, f"Exceed the maximum plans limit {plan_ledger.max_pending}")
        try:
            await asyncio.wait_for(
                producer.send_and_wait(
                    topic,
                    value=parsed.to_bytes(),
                    key=parsed.node_name.encode(),
                    headers=[("type", b"rescue_request"), ("request_id", parsed.request_id.encode()),
                             *signer.headers(parsed.node_name.encode(), parsed.to_bytes())],
                ),
                timeout=settings.produce_timeout_seconds,
            )
        except Exception:
            log.exception("publishing rescue request %s to %s failed", parsed.request_id, topic)
            if reservation is PlanReservation.RESERVED:
                with contextlib.suppress(Exception):
                    await plan_ledger.release(parsed.request_id)
            return _answer(503, "Service unavailable: the request could not be queued; retry with an Idempotency-Key")
        log.info(
            "rescue request %s for node %s from %s queued (%s)",
            parsed.request_id,
            parsed.node_name,
            requested_by,
            ", ".join(a.name for a in parsed.actions),
        )
        return _answer(200, "Success", {REQUEST_ID_HEADER: parsed.request_id})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def openapi(request: web.Request) -> web.Response:
        return web.json_response(document, dumps=lambda v: orjson.dumps(v).decode())

    app = web.Application(client_max_size=settings.max_body_bytes)
    app.router.add_post(RESCUE_ACTIONS_PATH, rescue_actions)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/openapi.json", openapi)
    return app


def make_producer(bootstrap: str | None = None) -> AIOKafkaProducer:
    """A producer whose acknowledgement means durable: acks from all in-sync replicas, idempotent."""
    # The API produces as its own principal: only it may write gpu.remediation.requests (issue 12's ACLs).
    return kafka_clients.producer(
        bootstrap, settings=kafka_clients.load_settings().for_api(), acks="all", enable_idempotence=True
    )


async def serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, list[tuple[str, int]]]:
    """Start serving ``app``; the runner (to clean up) and the bound addresses (port 0 picks one).

    A port that cannot be bound raises :class:`ApiStartError` naming the address and why.
    """
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        why = "the port is already in use" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise ApiStartError(f"the decision API cannot listen on {host}:{port}: {why}") from None
    addresses: Iterable[Any] = runner.addresses
    return runner, [(str(a[0]), int(a[1])) for a in addresses]


def check_tokens(settings: ApiSettings) -> TokenStore:
    """The token store, read once at start-up; :class:`ApiStartError` when the API cannot serve as configured."""
    tokens = TokenStore.from_settings(settings)
    if not tokens.has_sources():
        raise ApiStartError(
            "the decision API has no tokens: set XIDFLOW_API_TOKENS or XIDFLOW_API_TOKEN_FILE, "
            "or start with --no-api"
        )
    try:
        count = tokens.load()
    except TokenFileError as exc:
        raise ApiStartError(str(exc)) from None
    if count == 0:
        log.warning(
            "the decision API has no usable token yet (token file %s is missing or empty): every request is "
            "answered 401 until a token is configured; the file is re-read when it changes",
            settings.token_file,
        )
    return tokens


@dataclass
class RunningApi:
    """A started decision API: where it listens, and how to stop it."""

    addresses: list[tuple[str, int]]
    runner: web.AppRunner
    producer: AIOKafkaProducer

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.producer.stop()


async def start_api(
    settings: ApiSettings,
    kube: Kube,
    bootstrap: str | None = None,
    topics: TopicNames | None = None,
    tokens: TokenStore | None = None,
) -> RunningApi:
    """Serve the decision API; returns once it listens. :class:`ApiStartError` when it cannot.

    ``tokens``: the store :func:`check_tokens` returned, when the caller checked them already.
    """
    tokens = tokens or check_tokens(settings)
    producer = make_producer(bootstrap)
    try:
        await producer.start()
    except Exception as exc:  # noqa: BLE001 - one sentence for the operator, not a traceback
        with contextlib.suppress(Exception):
            await producer.stop()
        raise ApiStartError(f"the decision API cannot reach Kafka: {type(exc).__name__}: {exc}") from None
    try:
        node_lookup = KubernetesNodeLookup(
            kube, gpu_node_selector=settings.gpu_node_selector, gpu_resource_name=settings.gpu_resource_name
        )
        app = create_app(
            settings,
            producer,
            node_lookup,
            plan_ledger=ConfigMapPlanLedger.from_settings(kube, settings),
            topics=topics,
            tokens=tokens,
        )
        runner, addresses = await serve(app, settings.host, settings.port)
    except BaseException:
        await producer.stop()
        raise
    log.info("decision API listening on %s (manual_only=%s)", addresses, settings.manual_only)
    return RunningApi(addresses, runner, producer)


async def run_api(settings: ApiSettings, kube: Kube, bootstrap: str | None = None) -> None:
    """Serve the decision API until cancelled."""
    running = await start_api(settings, kube, bootstrap)
    try:
        await asyncio.Event().wait()
    finally:
        await running.stop()
