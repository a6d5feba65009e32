"""How the Job controller ended a Job: its terminal condition, read one way for every Job xidflow creates. Pure.

The reboot and GPU-reset hook Jobs (``pipeline.actuator.effects``) and the diagnostics Job
(``pipeline.actuator.diagnostics``) all end when the Job controller gives them a ``Complete`` or ``Failed``
condition with status ``True``; ``FailureTarget`` and ``SuccessCriteriaMet`` come before those and are not an end.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JobEnd:
    """How the Job controller ended a hook Job: its ``Complete`` or ``Failed`` condition."""

    succeeded: bool
    reason: str = ""
    """The Job controller's reason (``BackoffLimitExceeded``, ``DeadlineExceeded``, ...); empty for Complete."""
    message: str = ""

    def describe(self) -> str:
        if self.succeeded:
            return "Complete"
        return ": ".join(p for p in ("Failed", self.reason, self.message) if p)


def job_end(job: Mapping[str, Any]) -> JobEnd | None:
    """The Job's end as its controller recorded it (its terminal condition), None while it runs. Pure."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("status") != "True":
            continue
        if cond.get("type") == "Complete":
            return JobEnd(True)
        if cond.get("type") == "Failed":
            return JobEnd(False, str(cond.get("reason") or ""), str(cond.get("message") or ""))
    return None


JOB_GONE = JobEnd(False, "Deleted", "the Job was deleted before xidflow saw it end")
