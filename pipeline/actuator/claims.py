"""The pods' DRA ResourceClaims, read from the cluster: which pods hold which devices.

What a claim's allocation means is ``pipeline.actuator.workload``'s (pure); this module is the I/O behind it, for
``notifyWorkload`` (which pods sit on the faulty GPU) and the per-GPU drain (``drain`` with ``scope: gpu``: only the
pods holding the GPUs the flow tainted are evicted).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

from pipeline.actuator import dra, workload
from pipeline.actuator.kube import Forbidden, Kube, NotFound

ClaimKey = tuple[str, str]
"""(namespace, name) of a ResourceClaim."""


async def read_claims(kube: Kube, pods: Iterable[Mapping[str, Any]]) -> dict[ClaimKey, dict[str, Any]]:
    """The ResourceClaims the pods name (generated from a template or named directly); one GET each. A claim that
    is gone or not ours to read is left out: that pod's devices stay unknown."""
    wanted = sorted({(workload.pod_key(p)[0], c) for p in pods for c in workload.pod_claim_names(p)})

    async def one(key: ClaimKey) -> tuple[ClaimKey, dict[str, Any] | None]:
        try:
            return key, await kube.get_namespaced_object(dra.GROUP, dra.SLICE_VERSION, key[0], "resourceclaims", key[1])
        except (NotFound, Forbidden):
            return key, None

    found = await asyncio.gather(*(one(k) for k in wanted))
    return {k: obj for k, obj in found if obj is not None}


async def holders(
    kube: Kube, pods: Iterable[Mapping[str, Any]], devices: set[workload.DeviceId]
) -> list[Mapping[str, Any]]:
    """The pods whose ResourceClaims are allocated any of ``devices`` (driver, pool, device)."""
    pods = list(pods)
    if not devices:
        return []
    found = await read_claims(kube, pods)
    return [p for p in pods if workload.pod_devices(p, found) & devices]
