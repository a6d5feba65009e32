"""The decision API for third-party systems: ``POST /api/v1/rescue-actions`` (Kingsoft-seed format).

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
409    ``Failures to meet preconditions: node N is not a GPU node ...``
429    ``Exceed the maximum plans limit N``
503    Kafka or the Kubernetes API could not be reached; retrying with the same ``Idempotency-Key``
       is safe (the actuator executes each request id once)
=====  ==========================================================================================

Pending plans are counted cluster-wide in one ConfigMap written with optimistic concurrency, so
several API replicas share one limit. A plan stops counting when the actuator calls
:meth:`ConfigMapPlanLedger.release` after executing it, or on its own once its wait times plus
``plan_grace_seconds`` have passed (so a lost release cannot block the API forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, Protocol

import orjson
from aiohttp import web
from aiokafka import AIOKafkaProducer
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException
from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.actuator.requests import (
    MAX_IDEMPOTENCY_KEY_LENGTH,
    ParameterError,
    RescueActionBody,
    RescueActionRequest,
    parse_rescue_request,
)
from pipeline.settings import TopicNames
from schemas.records import utcnow

log = logging.getLogger(__name__)

RESCUE_ACTIONS_PATH = "/api/v1/rescue-actions"
REQUEST_ID_HEADER = "X-Request-Id"
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
API_VERSION = "1.0.0"


class ApiSettings(BaseSettings):
    """Settings of the decision API, from ``XIDFLOW_API_*`` variables; defaults are production defaults."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_API_", extra="ignore")

    host: str = Field(default="0.0.0.0", description="Address to listen on (default all interfaces)")
    port: int = Field(default=8080, ge=0, le=65535, description="TCP port (default 8080; 0 picks a free one)")
    tokens: dict[str, SecretStr] = Field(
        default_factory=dict,
        description='Bearer tokens by client name, as JSON: XIDFLOW_API_TOKENS=\'{"ops-portal": "s3cret"}\'',
    )
    token_file: Path | None = Field(
        default=None,
        description="File of tokens, one 'name:token' (or bare token) a line, '#' comments; re-read when it "
        "changes, so a mounted Secret can be rotated without a restart",
    )
    manual_only: bool = Field(
        default=False,
        description="When true the actuator turns its automatic policies off and only rescue requests from "
        "this API act on nodes (incidents are still audited and notified). Default false",
    )
    max_pending_plans: int = Field(
        default=20,
        ge=1,
        le=1000,
        description="Cluster-wide pending plans before 'Exceed the maximum plans limit'",
    )
    plan_grace_seconds: float = Field(
        default=3600,
        gt=0,
        description="A plan the actuator never released stops counting after its wait times plus this",
    )
    namespace: str = Field(default="xidflow-system", description="Namespace of the pending-plans ConfigMap")
    plans_configmap: str = Field(default="xidflow-rescue-plans", description="Name of the pending-plans ConfigMap")
    gpu_node_selector: str = Field(
        default="nvidia.com/gpu.present=true",
        description="Label selector of GPU nodes; a node with GPU capacity counts as a GPU node too",
    )
    gpu_resource_name: str = Field(default="nvidia.com/gpu", description="Extended resource a GPU node reports")
    produce_timeout_seconds: float = Field(
        default=15,
        gt=0,
        description="How long to wait for Kafka to acknowledge a request before answering 503",
    )
    max_body_bytes: int = Field(default=65536, ge=1024, description="Largest request body accepted")

    @field_validator("token_file")
    @classmethod
    def _token_file_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"no such file: {value}")
        return value


# --------------------------------------------------------------------------------------------------
# Authentication


def parse_token_file(text: str) -> dict[str, str]:
    """Tokens by client name from ``name:token`` lines; a bare token is named after its line number."""
    tokens: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, token = line.partition(":")
        if not sep:
            name, token = f"token-file-line-{number}", line
        if token.strip():
            tokens[name.strip()] = token.strip()
    return tokens


class TokenStore:
    """Bearer tokens from settings and a file; answers which client a presented token belongs to."""

    def __init__(self, tokens: Mapping[str, str], token_file: Path | None = None) -> None:
        self._static = {name: _digest(token) for name, token in tokens.items() if token}
        self._file = token_file
        self._file_stamp: tuple[float, int] | None = None
        self._from_file: dict[str, bytes] = {}

    @classmethod
    def from_settings(cls, settings: ApiSettings) -> TokenStore:
        return cls({name: secret.get_secret_value() for name, secret in settings.tokens.items()}, settings.token_file)

    def configured(self) -> bool:
        return bool(self._all())

    def identify(self, authorization: str | None) -> str | None:
        """The client name for an ``Authorization: Bearer <token>`` header, or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        presented = _digest(token.strip())
        client_name = None
        # Compare against every token, without stopping early and on equal-length digests, so that
        # timing reveals neither which token matched nor how much of one did.
        for name, digest in self._all().items():
            if hmac.compare_digest(presented, digest):
                client_name = name
        return client_name

    def _all(self) -> dict[str, bytes]:
        if self._file is not None:
            self._reload_file()
        return {**self._from_file, **self._static}

    def _reload_file(self) -> None:
        assert self._file is not None
        try:
            stat = self._file.stat()
        except OSError as exc:
            if self._from_file:
                log.warning("token file %s unreadable (%s); keeping the tokens read before", self._file, exc)
            return
        stamp = (stat.st_mtime, stat.st_size)
        if stamp != self._file_stamp:
            text = self._file.read_text(encoding="utf-8")
            self._from_file = {name: _digest(token) for name, token in parse_token_file(text).items()}
            self._file_stamp = stamp


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


# --------------------------------------------------------------------------------------------------
# Preconditions: the node exists and is a GPU node


class NodeStatus(StrEnum):
    GPU = "gpu"
    NOT_GPU = "not-gpu"
    MISSING = "missing"


NodeLookup = Callable[[str], Awaitable[NodeStatus]]
"""Async function: node name -> whether it exists and is a GPU node. Raises when it cannot tell."""


def has_gpu_capacity(capacity: Mapping[str, Any] | None, resource_name: str) -> bool:
    """True when a node's capacity reports at least one unit of the GPU resource."""
    if not capacity or resource_name not in capacity:
        return False
    try:
        return int(str(capacity[resource_name])) > 0
    except ValueError:
        return False


class KubernetesNodeLookup:
    """:data:`NodeLookup` against the API server: GPU capacity, else the GPU label selector."""

    def __init__(self, api_client: k8s_client.ApiClient, *, gpu_node_selector: str, gpu_resource_name: str) -> None:
        self._core = k8s_client.CoreV1Api(api_client)
        self._selector = gpu_node_selector
        self._resource = gpu_resource_name

    async def __call__(self, node_name: str) -> NodeStatus:
        return await asyncio.to_thread(self._lookup, node_name)

    def _lookup(self, node_name: str) -> NodeStatus:
        try:
            node = self._core.read_node(node_name)
        except ApiException as exc:
            if exc.status == 404:
                return NodeStatus.MISSING
            raise
        if has_gpu_capacity(node.status.capacity if node.status else None, self._resource):
            return NodeStatus.GPU
        if not self._selector:
            return NodeStatus.NOT_GPU
        # The API server evaluates the selector, so its full syntax (in, notin, !key) is honoured.
        matching = self._core.list_node(field_selector=f"metadata.name={node_name}", label_selector=self._selector)
        return NodeStatus.GPU if matching.items else NodeStatus.NOT_GPU


# --------------------------------------------------------------------------------------------------
# Pending plans, counted cluster-wide


class PlanReservation(StrEnum):
    RESERVED = "reserved"
    ALREADY_RESERVED = "already-reserved"
    LIMIT_EXCEEDED = "limit-exceeded"


class PlanLedger(Protocol):
    """Counts pending plans across every API replica."""

    @property
    def max_pending(self) -> int: ...

    async def reserve(self, request: RescueActionRequest) -> PlanReservation: ...

    async def release(self, request_id: str) -> None: ...


@dataclass(frozen=True, slots=True)
class PendingPlan:
    """One ledger entry: a plan accepted by the API and not yet released by the actuator."""

    request_id: str
    node: str
    requested_by: str
    received_at: datetime
    expires_at: datetime

    def to_json(self) -> str:
        return orjson.dumps(
            {
                "node": self.node,
                "requested_by": self.requested_by,
                "received_at": self.received_at.isoformat(),
                "expires_at": self.expires_at.isoformat(),
            }
        ).decode()

    @classmethod
    def from_json(cls, request_id: str, text: str) -> PendingPlan:
        fields = orjson.loads(text)
        return cls(
            request_id=request_id,
            node=str(fields["node"]),
            requested_by=str(fields.get("requested_by", "")),
            received_at=datetime.fromisoformat(fields["received_at"]),
            expires_at=datetime.fromisoformat(fields["expires_at"]),
        )


def live_plans(data: Mapping[str, str], now: datetime) -> dict[str, PendingPlan]:
    """The ledger's unexpired entries; unreadable entries are dropped (they would hold a slot forever)."""
    plans: dict[str, PendingPlan] = {}
    for request_id, text in data.items():
        try:
            plan = PendingPlan.from_json(request_id, text)
        except (ValueError, KeyError, TypeError):
            log.warning("dropping unreadable pending-plan entry %s: %r", request_id, text[:200])
            continue
        if plan.expires_at > now:
            plans[request_id] = plan
    return plans


def reserve_plan(
    data: Mapping[str, str],
    request: RescueActionRequest,
    *,
    now: datetime,
    max_pending: int,
    grace_seconds: float,
) -> tuple[PlanReservation, dict[str, str] | None]:
    """Decide a reservation against the ledger's data; the new data to write when it changed."""
    plans = live_plans(data, now)
    if request.request_id in plans:
        return PlanReservation.ALREADY_RESERVED, None
    if len(plans) >= max_pending:
        return PlanReservation.LIMIT_EXCEEDED, None
    expires_at = now + timedelta(seconds=request.total_wait_seconds + grace_seconds)
    entry = PendingPlan(request.request_id, request.node_name, request.requested_by, now, expires_at)
    new_data = {rid: data[rid] for rid in plans}
    new_data[request.request_id] = entry.to_json()
    return PlanReservation.RESERVED, new_data


class PlanLedgerContention(RuntimeError):
    """Too many writers changed the ledger at once; the caller answers 503 and the client retries."""


class ConfigMapPlanLedger:
    """:class:`PlanLedger` in one ConfigMap, updated with optimistic concurrency (409 -> re-read)."""

    def __init__(
        self,
        api_client: k8s_client.ApiClient,
        *,
        namespace: str,
        name: str,
        max_pending: int,
        grace_seconds: float,
        clock: Callable[[], datetime] = utcnow,
        max_attempts: int = 20,
    ) -> None:
        self._core = k8s_client.CoreV1Api(api_client)
        self._namespace = namespace
        self._name = name
        self._max_pending = max_pending
        self._grace_seconds = grace_seconds
        self._clock = clock
        self._max_attempts = max_attempts

    @classmethod
    def from_settings(cls, api_client: k8s_client.ApiClient, settings: ApiSettings) -> ConfigMapPlanLedger:
        return cls(
            api_client,
            namespace=settings.namespace,
            name=settings.plans_configmap,
            max_pending=settings.max_pending_plans,
            grace_seconds=settings.plan_grace_seconds,
        )

    @property
    def max_pending(self) -> int:
        return self._max_pending

    async def reserve(self, request: RescueActionRequest) -> PlanReservation:
        return await asyncio.to_thread(self._reserve, request)

    async def release(self, request_id: str) -> None:
        """Stop counting a plan (the actuator calls this once the plan is done or abandoned)."""
        await asyncio.to_thread(self._release, request_id)

    async def pending(self) -> dict[str, PendingPlan]:
        """The plans counted now."""
        config_map = await asyncio.to_thread(self._read)
        return live_plans((config_map.data or {}) if config_map else {}, self._clock())

    def _read(self) -> k8s_client.V1ConfigMap | None:
        try:
            return self._core.read_namespaced_config_map(self._name, self._namespace)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _reserve(self, request: RescueActionRequest) -> PlanReservation:
        for _ in range(self._max_attempts):
            config_map = self._read()
            outcome, new_data = reserve_plan(
                (config_map.data or {}) if config_map else {},
                request,
                now=self._clock(),
                max_pending=self._max_pending,
                grace_seconds=self._grace_seconds,
            )
            if new_data is None:
                return outcome
            try:
                self._write(config_map, new_data)
            except ApiException as exc:
                if exc.status == 409:  # another replica wrote first: decide again on its data
                    continue
                raise
            return outcome
        raise PlanLedgerContention(f"gave up reserving after {self._max_attempts} conflicting writes")

    def _release(self, request_id: str) -> None:
        for _ in range(self._max_attempts):
            config_map = self._read()
            if config_map is None or request_id not in (config_map.data or {}):
                return
            new_data = {rid: text for rid, text in config_map.data.items() if rid != request_id}
            try:
                self._write(config_map, new_data)
            except ApiException as exc:
                if exc.status == 409:
                    continue
                raise
            return
        raise PlanLedgerContention(f"gave up releasing after {self._max_attempts} conflicting writes")

    def _write(self, config_map: k8s_client.V1ConfigMap | None, data: dict[str, str]) -> None:
        if config_map is None:
            # A concurrent create answers 409 too, and the caller re-reads.
            body = k8s_client.V1ConfigMap(
                metadata=k8s_client.V1ObjectMeta(
                    name=self._name,
                    namespace=self._namespace,
                    labels={"app.kubernetes.io/managed-by": "xidflow", "app.kubernetes.io/component": "api"},
                ),
                data=data,
            )
            self._core.create_namespaced_config_map(self._namespace, body)
        else:
            # replace carries metadata.resourceVersion: the API server refuses it (409) if anyone wrote since.
            config_map.data = data
            self._core.replace_namespaced_config_map(self._name, self._namespace, config_map)


# --------------------------------------------------------------------------------------------------
# OpenAPI document


class ApiAnswer(BaseModel):
    """Every answer of the rescue-actions endpoint (the seed's body)."""

    code: Literal["Success", "Error"]
    message: str = Field(
        description="'Success', or 'Parameter error: ...', 'Failures to meet preconditions: ...', "
        "'Exceed the maximum plans limit N', 'Unauthorized', 'Service unavailable: ...'"
    )


class Health(BaseModel):
    status: Literal["ok"]


def _component_schemas() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in (RescueActionBody, ApiAnswer, Health):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=True)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


def openapi_document(settings: ApiSettings) -> dict[str, Any]:
    """The OpenAPI 3.1 document of this API; schemas are generated from the models the code validates with."""

    def answer(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
        response: dict[str, Any] = {
            "description": description,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ApiAnswer"}}},
        }
        if headers:
            response["headers"] = headers
        return response

    return {
        "openapi": "3.1.0",
        "info": {
            "title": "xidflow decision API",
            "version": API_VERSION,
            "description": "Third-party systems ask xidflow's actuator to run a plan of actions on a GPU "
            "node. "
            "A request answered Success is durable on Kafka and executed once by some actuator replica.",
        },
        "paths": {
            RESCUE_ACTIONS_PATH: {
                "post": {
                    "operationId": "createRescueActions",
                    "summary": "Queue a rescue plan for one GPU node",
                    "security": [{"bearerAuth": []}],
                    "parameters": [
                        {
                            "name": IDEMPOTENCY_KEY_HEADER,
                            "in": "header",
                            "required": False,
                            "description": "Retries with one key from one client are one request",
                            "schema": {
                                "type": "string",
                                "pattern": f"^[\\x21-\\x7e]{{1,{MAX_IDEMPOTENCY_KEY_LENGTH}}}$",
                            },
                        }
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/RescueActionBody"}}},
                    },
                    "responses": {
                        "200": answer(
                            "Queued: durable on Kafka",
                            {
                                REQUEST_ID_HEADER: {
                                    "description": "Id of the plan (one id for retries with one key)",
                                    "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
                                }
                            },
                        ),
                        "400": answer("Parameter error: the message names the field"),
                        "401": answer(
                            "Missing or wrong Bearer token",
                            {"WWW-Authenticate": {"schema": {"type": "string"}}},
                        ),
                        "413": answer(f"Body larger than {settings.max_body_bytes} bytes"),
                        "404": answer("Failures to meet preconditions: the node does not exist"),
                        "409": answer("Failures to meet preconditions: the node is not a GPU node"),
                        "429": answer(f"Exceed the maximum plans limit {settings.max_pending_plans}"),
                        "503": answer("Kafka or the Kubernetes API unreachable; retry with the same Idempotency-Key"),
                    },
                }
            },
            "/healthz": {
                "get": {
                    "operationId": "health",
                    "summary": "Liveness",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "Serving",
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Health"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "operationId": "openapi",
                    "summary": "This document",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "OpenAPI 3.1 document",
                            "content": {"application/json": {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": _component_schemas(),
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }


# --------------------------------------------------------------------------------------------------
# The application


def _answer(status: int, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    code = "Success" if status == 200 else "Error"
    return web.json_response(
        {"code": code, "message": message},
        status=status,
        headers=headers,
        dumps=lambda v: orjson.dumps(v).decode(),
    )


def precondition_failure(node_name: str, status: NodeStatus, settings: ApiSettings) -> str | None:
    """The seed's precondition message for a node that cannot take a plan, or None when it can."""
    if status is NodeStatus.MISSING:
        return f"Failures to meet preconditions: node {node_name} does not exist"
    if status is NodeStatus.NOT_GPU:
        return (
            f"Failures to meet preconditions: node {node_name} is not a GPU node "
            f"(no {settings.gpu_resource_name} capacity and labels do not match "
            f"{settings.gpu_node_selector!r})"
        )
    return None


def create_app(
    settings: ApiSettings,
    producer: AIOKafkaProducer,
    node_lookup: NodeLookup,
    *,
    plan_ledger: PlanLedger,
    topics: TopicNames | None = None,
) -> web.Application:
    """The aiohttp application.

    ``producer`` must be started and configured with ``acks="all"`` (see :func:`make_producer`);
    ``topics`` defaults to the environment's topic names.
    """
    tokens = TokenStore.from_settings(settings)
    if not tokens.configured():
        raise ValueError("no API tokens configured: set XIDFLOW_API_TOKENS or XIDFLOW_API_TOKEN_FILE")
    topic = (topics or TopicNames()).name("remediation_requests")
    document = openapi_document(settings)

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
        if reservation is PlanReservation.LIMIT_EXCEEDED:
            return _answer(429, f"Exceed the maximum plans limit {plan_ledger.max_pending}")
        try:
            await asyncio.wait_for(
                producer.send_and_wait(
                    topic,
                    value=parsed.to_bytes(),
                    key=parsed.node_name.encode(),
                    headers=[("type", b"rescue_request"), ("request_id", parsed.request_id.encode())],
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


def make_producer(bootstrap: str) -> AIOKafkaProducer:
    """A producer whose acknowledgement means durable: acks from all in-sync replicas, idempotent."""
    return AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)


def load_kubernetes_client() -> k8s_client.ApiClient:
    """In-cluster credentials when running in a pod, else ``KUBECONFIG`` / ``~/.kube/config``."""
    configuration = k8s_client.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except k8s_config.ConfigException:
        k8s_config.load_kube_config(client_configuration=configuration)
    return k8s_client.ApiClient(configuration)


async def serve(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, list[tuple[str, int]]]:
    """Start serving ``app``; the runner (to clean up) and the bound addresses (port 0 picks one)."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    addresses: Iterable[Any] = runner.addresses
    return runner, [(str(a[0]), int(a[1])) for a in addresses]


async def run_api(settings: ApiSettings, bootstrap: str) -> None:
    """Serve the decision API until cancelled (the actuator command runs it as a task)."""
    producer = make_producer(bootstrap)
    await producer.start()
    api_client = load_kubernetes_client()
    try:
        node_lookup = KubernetesNodeLookup(
            api_client,
            gpu_node_selector=settings.gpu_node_selector,
            gpu_resource_name=settings.gpu_resource_name,
        )
        app = create_app(
            settings,
            producer,
            node_lookup,
            plan_ledger=ConfigMapPlanLedger.from_settings(api_client, settings),
        )
        runner, addresses = await serve(app, settings.host, settings.port)
        log.info("decision API listening on %s (manual_only=%s)", addresses, settings.manual_only)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
    finally:
        await producer.stop()
        api_client.close()
