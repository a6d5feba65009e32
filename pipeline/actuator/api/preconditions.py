"""Preconditions of a rescue plan: the node exists and is a GPU node (through :class:`Kube`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from enum import StrEnum
from typing import Any

from pipeline.actuator.api.settings import ApiSettings
from pipeline.actuator.kube import Kube, NotFound


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

    def __init__(self, kube: Kube, *, gpu_node_selector: str, gpu_resource_name: str) -> None:
        self._kube = kube
        self._selector = gpu_node_selector
        self._resource = gpu_resource_name

    async def __call__(self, node_name: str) -> NodeStatus:
        try:
            node = await self._kube.get_node(node_name)
        except NotFound:
            return NodeStatus.MISSING
        if has_gpu_capacity((node.get("status") or {}).get("capacity"), self._resource):
            return NodeStatus.GPU
        if not self._selector:
            return NodeStatus.NOT_GPU
        # The API server evaluates the selector, so its full syntax (in, notin, !key) is honoured.
        return NodeStatus.GPU if await self._kube.node_matches(node_name, self._selector) else NodeStatus.NOT_GPU


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
