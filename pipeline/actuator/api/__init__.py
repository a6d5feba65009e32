"""The decision API for third-party systems: ``POST /api/v1/rescue-actions`` (Kingsoft-seed format).

One module per concern: :mod:`.settings` (``XIDFLOW_API_*``), :mod:`.auth` (Bearer tokens),
:mod:`.preconditions` (the node exists and is a GPU node), :mod:`.plans` (the cluster-wide pending-plans
ledger and Idempotency-Keys), :mod:`.openapi` (the served document) and :mod:`.app` (the aiohttp
application and its start-up). Every Kubernetes call goes through :class:`pipeline.actuator.kube.Kube`.

The names below are loaded on first use (PEP 562): importing :mod:`.settings` alone (the actuator
reads ``ApiSettings`` at start) must not import the aiohttp application.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "API_VERSION": "openapi",
    "ApiAnswer": "openapi",
    "ApiSettings": "settings",
    "ApiStartError": "app",
    "ConfigMapPlanLedger": "plans",
    "Health": "openapi",
    "IDEMPOTENCY_KEY_HEADER": "openapi",
    "KubernetesNodeLookup": "preconditions",
    "NodeLookup": "preconditions",
    "NodeStatus": "preconditions",
    "PendingPlan": "plans",
    "PlanLedger": "plans",
    "PlanLedgerContention": "plans",
    "PlanReservation": "plans",
    "REQUEST_ID_HEADER": "openapi",
    "RESCUE_ACTIONS_PATH": "openapi",
    "RunningApi": "app",
    "TokenFileError": "auth",
    "TokenStore": "auth",
    "check_tokens": "app",
    "create_app": "app",
    "has_gpu_capacity": "preconditions",
    "live_plans": "plans",
    "make_producer": "app",
    "openapi_document": "openapi",
    "parse_token_file": "auth",
    "precondition_failure": "preconditions",
    "read_token_file": "auth",
    "release_plan": "plans",
    "request_fingerprint": "plans",
    "reserve_plan": "plans",
    "run_api": "app",
    "serve": "app",
    "start_api": "app",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
