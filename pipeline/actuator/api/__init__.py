"""The decision API for third-party systems: ``POST /api/v1/rescue-actions`` (Kingsoft-seed format).

One module per concern: :mod:`.settings` (``XIDFLOW_API_*``), :mod:`.auth` (Bearer tokens),
:mod:`.preconditions` (the node exists and is a GPU node), :mod:`.plans` (the cluster-wide pending-plans
ledger and Idempotency-Keys), :mod:`.openapi` (the served document) and :mod:`.app` (the aiohttp
application and its start-up). Every Kubernetes call goes through :class:`pipeline.actuator.kube.Kube`.
"""

from pipeline.actuator.api.app import (
    ApiStartError,
    RunningApi,
    check_tokens,
    create_app,
    make_producer,
    run_api,
    serve,
    start_api,
)
from pipeline.actuator.api.auth import TokenFileError, TokenStore, parse_token_file, read_token_file
from pipeline.actuator.api.openapi import (
    API_VERSION,
    IDEMPOTENCY_KEY_HEADER,
    REQUEST_ID_HEADER,
    RESCUE_ACTIONS_PATH,
    ApiAnswer,
    Health,
    openapi_document,
)
from pipeline.actuator.api.plans import (
    ConfigMapPlanLedger,
    PendingPlan,
    PlanLedger,
    PlanLedgerContention,
    PlanReservation,
    live_plans,
    release_plan,
    request_fingerprint,
    reserve_plan,
)
from pipeline.actuator.api.preconditions import (
    KubernetesNodeLookup,
    NodeLookup,
    NodeStatus,
    has_gpu_capacity,
    precondition_failure,
)
from pipeline.actuator.api.settings import ApiSettings

__all__ = [
    "API_VERSION",
    "IDEMPOTENCY_KEY_HEADER",
    "REQUEST_ID_HEADER",
    "RESCUE_ACTIONS_PATH",
    "ApiAnswer",
    "ApiSettings",
    "ApiStartError",
    "ConfigMapPlanLedger",
    "Health",
    "KubernetesNodeLookup",
    "NodeLookup",
    "NodeStatus",
    "PendingPlan",
    "PlanLedger",
    "PlanLedgerContention",
    "PlanReservation",
    "RunningApi",
    "TokenFileError",
    "TokenStore",
    "check_tokens",
    "create_app",
    "has_gpu_capacity",
    "live_plans",
    "make_producer",
    "openapi_document",
    "parse_token_file",
    "precondition_failure",
    "read_token_file",
    "release_plan",
    "request_fingerprint",
    "reserve_plan",
    "run_api",
    "serve",
    "start_api",
]
