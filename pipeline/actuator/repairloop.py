"""What the engine does for a repair case by itself, level-triggered: a return to service to finish, a hand-off's
answer to act on (``repaircase`` decides, this module writes and audits).

- ``returning`` (diagnostics passed): every flow of the case has what it applied removed (uncordon, taints,
  conditions; only what it owns and no other flow needs, as an incident's recovery does), then the case says
  ``returned``. A crash in between leaves ``returning``: the next look finishes it.
- ``handed-off``: the RepairRequest's status is read (the watch's view, else a GET); ``Repaired`` or ``Replaced``
  opens the gate flow (``diagnose``) in one ledger write, which the engine then drives like any flow.

Each transition is one audit record on the node (``return-to-service``, ``hand-back``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from pipeline.actuator import repaircase, repairrequest
from pipeline.actuator.effector import Effector
from pipeline.actuator.effects import NodeChange
from pipeline.actuator.nodestate import NodeWriter
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import Ledger
from pipeline.actuator.plan import plan_recovery_for
from schemas.records import Outcome

Audit = Callable[..., Awaitable[None]]
Answers = Callable[[str], Awaitable[tuple[str | None, str]]]


class RepairLoop:
    def __init__(self, writer: NodeWriter, effector: Effector, audit: Audit) -> None:
        self.writer, self.effector, self.audit = writer, effector, audit
        self.answers: Answers = lambda name: repairrequest.read_answer(self.writer.kube, name)
        """The external repair system's answer to a RepairRequest: (phase, by); the watch's when wired."""

    async def drive(self, view: NodeView) -> tuple[NodeView, bool]:
        """Move every case of the node that waits on xidflow; the node as written, and whether anything moved."""
        moved = False
        for cls, case in list(view.ledger.repairs.items()):
            stage = case.get("stage")
            if stage == repaircase.RETURNING:
                view = await self._return(view, cls, case)
                moved = True
            elif stage == repaircase.HANDED_OFF:
                view, answered = await self._answer(view, cls, case)
                moved = moved or answered
        return view, moved

    async def _return(self, view: NodeView, cls: str, case: dict[str, Any]) -> NodeView:
        reason = f"diagnostics passed: repair case {case.get('case')} ({cls}) back in service"
        undone: dict[str, Any] = {}
        for flow in case.get("flows") or []:
            fresh = await self.writer.read(view.name) or view
            undo = plan_recovery_for(flow, fresh)
            if undo.disown:
                result = await self.effector.undo(fresh, flow, reason, undo)
                undone[flow] = result.details

        def mutate(v: NodeView, ledger: Ledger) -> tuple[NodeChange | None, None]:
            found = repaircase.case_of(ledger, cls)
            if found is None or found.get("stage") != repaircase.RETURNING:
                return None, None
            repaircase.record_returned(ledger, cls, time.time())
            return NodeChange(), None

        _, written = await self.writer.update(view.name, mutate, f"return-to-service {case.get('case')}")
        await self.audit(view.name, str(case.get("case")), "return-to-service", Outcome.APPLIED, reason,
                         details={"fault_class": cls, "undone": undone})
        return written or await self.writer.read(view.name) or view

    async def _answer(self, view: NodeView, cls: str, case: dict[str, Any]) -> tuple[NodeView, bool]:
        name = str((case.get("handoff") or {}).get("name") or "")
        if not name:
            return view, False
        phase, by = await self.answers(name)
        if phase not in repaircase.ANSWERS:
            return view, False
        opened: list[str] = []

        def mutate(v: NodeView, ledger: Ledger) -> tuple[NodeChange | None, None]:
            key = repaircase.record_answer(ledger, cls, str(phase), by, time.time())
            if key is None:
                return None, None
            opened[:] = [key]
            return NodeChange(), None

        _, written = await self.writer.update(view.name, mutate, f"hand-back {name}")
        if written is None:
            return view, False
        await self.audit(view.name, str(case.get("case")), "hand-back", Outcome.APPLIED,
                         f"RepairRequest {name} says {phase}: diagnostics again ({opened[0]})",
                         details={"repair_request": name, "answer": phase, "by": by, "flow": opened[0]})
        return written, True
