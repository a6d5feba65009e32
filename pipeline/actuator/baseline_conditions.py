"""xidflow's own conditions on every GPU node, False while healthy (node-problem-detector's convention).

A node-repair tool or a dashboard that reads ``GpuXid`` or ``GpuFellOffBus`` sees ``False`` with a
healthy reason (``NoGpuXid``, ...) on a node without a fault, not a missing condition. The reconciler
hands every node it owns to ``BaselineConditions.consider``; a node that lacks one of the conditions
gets the missing ones, all in one conditional status patch. Present conditions are never touched
here (whatever their status: a fault's ``True`` belongs to its flow, and undo puts ``False`` back), so
the baseline cannot flap, and a node that has them all costs nothing. Dry-run and opted-out nodes get
nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from pipeline.actuator import conditions
from pipeline.actuator.effects import now_rfc3339
from pipeline.actuator.kube import Conflict, Kube, NotFound
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.problems import HEALTHY, OWN_CONDITION_TYPES, ProblemClass
from pipeline.actuator.settings import ActuatorSettings

log = logging.getLogger("xidflow.actuator.baseline")

_ATTEMPTS = 10


def lacks(view: NodeView) -> bool:
    """Whether the node lacks one of xidflow's own condition types. Pure.

    ``missing``'s cheap question, asked of every node at each watch event: a set of the node's types
    instead of a scan of its conditions per type and the healthy conditions built to be thrown away."""
    return not OWN_CONDITION_TYPES <= {c.get("type") for c in view.conditions}


def missing(view: NodeView, now: str) -> list[dict[str, Any]]:
    """The healthy (False) conditions to add: one per own condition type the node does not carry. Pure."""
    out = []
    for cls in ProblemClass:
        if view.condition(str(cls)) is None:
            reason, message = HEALTHY[cls]
            out.append(conditions.next_condition(None, str(cls), False, reason, message, now))
    return out


class BaselineConditions:
    """Adds the missing own conditions to the nodes it is shown, one patch per node, a few nodes at a time."""

    def __init__(
        self,
        kube: Kube,
        settings: ActuatorSettings,
        concurrency: int = 8,
        owns: Callable[[str], bool] | None = None,
        current: Callable[[str], NodeView | None] | None = None,
    ) -> None:
        self.kube, self.settings = kube, settings
        self.owns = owns
        """Whether this replica still owns the node when its turn comes (None: always)."""
        self.current = current
        """The node as the watch sees it now (None from it: the node is gone)."""
        self._slots = asyncio.Semaphore(concurrency)
        self._pending: dict[str, asyncio.Task[None]] = {}
        self.written = 0
        """Nodes patched so far (for tests and logs)."""

    def needed(self, view: NodeView) -> bool:
        """Whether ``consider`` would write this node (ownership aside). Pure; safe on any thread."""
        return not self.settings.dry_run and not view.opted_out(self.settings.opt_out_label) and lacks(view)

    def consider(self, view: NodeView) -> None:
        """Schedule the patch when the node lacks one of the conditions; nothing to do is the common case."""
        if view.name in self._pending or not self.needed(view):
            return
        self._pending[view.name] = asyncio.create_task(self._ensure(view))

    async def stop(self) -> None:
        tasks = list(self._pending.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _ensure(self, view: NodeView) -> None:
        try:
            async with self._slots:
                # A start queues every owned node, and the group usually rebalances right after: the first
                # replica to join owned the whole fleet for a moment. Looked at again when its turn comes, a
                # node another replica now owns (or already wrote) costs nothing here; written from the list's
                # old view it cost a conflict and a read, and the fleet reached steady state only when this
                # replica had gone through all of it (65 s at 10,000 nodes with 2 replicas).
                if self.owns is not None and not self.owns(view.name):
                    return
                if self.current is not None:
                    latest = self.current(view.name)
                    if latest is None:
                        return
                    view = latest
                await self._write(view)
        except NotFound:
            pass  # the node is gone
        except Exception as exc:  # noqa: BLE001 - the next event or resync of the node tries again
            log.warning("baseline conditions on %s not written yet: %s", view.name, exc)
        finally:
            self._pending.pop(view.name, None)

    async def _write(self, view: NodeView) -> None:
        for _ in range(_ATTEMPTS):
            writes = missing(view, now_rfc3339())
            if not writes:
                return
            body = {"metadata": {"resourceVersion": view.resource_version}, "status": {"conditions": writes}}
            try:
                await self.kube.patch_node_status(view.name, body)
            except Conflict:
                # Changed since we saw it (maybe a fault's condition just landed): look again, add only what lacks.
                view = NodeView.from_object(await self.kube.get_node(view.name))
                continue
            self.written += 1
            return
