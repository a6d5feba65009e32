"""Shared state of every replica kept as JSON in a ConfigMap, written with its resourceVersion.

Optimistic concurrency: a write is conditional on the version read, a 409 reads again and decides again.
The breaker, the drain slots and the shared-part correlation keep their state this way, so all replicas
see one state without a lock service.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from pipeline.actuator.kube import AlreadyExists, Conflict, Kube, KubeUnavailable, NotFound

T = TypeVar("T")
STATE_KEY = "state"
MANAGED_LABEL = {"app.kubernetes.io/managed-by": "xidflow"}


async def update_json_configmap(
    kube: Kube,
    namespace: str,
    name: str,
    mutate: Callable[[dict[str, Any]], T],
    attempts: int = 100,
    seen: dict[str, Any] | None = None,
) -> T:
    """Read-modify-write of the JSON in a ConfigMap; retried on 409 with fresh state.

    ``mutate`` changes the state in place and returns a result; it may run several times.
    ``seen`` keeps the ConfigMap as this caller last wrote it (under ``"cm"``): a write starts from it
    instead of reading first, conditional on its resourceVersion, so a writer nobody else interleaves
    with pays one call, not two; a 409 reads it fresh. A decision that writes nothing is always taken
    on a fresh read (nothing else would check it).
    """
    cached = seen.pop("cm", None) if seen is not None else None
    for _ in range(attempts):
        fresh = cached is None
        if cached is not None:
            cm, cached = cached, None
        else:
            try:
                cm = await kube.get_configmap(namespace, name)
            except NotFound:
                cm = None
        raw = ((cm or {}).get("data") or {}).get(STATE_KEY) or "{}"
        state = orjson.loads(raw)
        result = mutate(state)
        new_raw = orjson.dumps(state, option=orjson.OPT_SORT_KEYS).decode()
        if cm is not None and new_raw == raw:
            if not fresh:
                continue  # unchanged by our last write's view: decide on a fresh read
            if seen is not None:
                seen["cm"] = cm
            return result
        try:
            if cm is None:
                body = {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": name, "namespace": namespace, "labels": MANAGED_LABEL},
                    "data": {STATE_KEY: new_raw},
                }
                written = await kube.create_configmap(namespace, body)
            else:
                cm["data"] = {**(cm.get("data") or {}), STATE_KEY: new_raw}
                written = await kube.replace_configmap(namespace, name, cm)
        except (Conflict, AlreadyExists):
            if fresh:
                await asyncio.sleep(random.uniform(0.005, 0.05))
            continue
        if seen is not None and written:
            seen["cm"] = written
        return result
    raise KubeUnavailable(f"ConfigMap {namespace}/{name}: gave up after {attempts} conflicting writes")


async def read_json_configmap(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    try:
        cm = await kube.get_configmap(namespace, name)
    except NotFound:
        return {}
    return orjson.loads(((cm.get("data") or {}).get(STATE_KEY)) or "{}")
