"""The diagnostics gate's Job and its result: the built-in template and how a verdict is read. Pure.

The Job runs on the node the way the reboot and GPU-reset hooks do (``reboot.start_hook_job``: the operator's
template, else the built-in one, ``effects.DEFAULT_DIAGNOSTICS_JOB``, pinned to the node, run once as the
token-less hook ServiceAccount, on a node carrying xidflow's taint). The built-in one runs NVIDIA DCGM's
diagnostics at level 2 (``dcgmi diag -r 2``, what NVIDIA's DCGM guide calls the level for an epilogue after a
failure, a few minutes on a node) with the node's own DCGM, and writes a one-line result to the container's
termination message.

The verdict (``verdict``), documented in docs/repair.md:

- the Job's ``Complete`` condition is a pass, unless the termination message is a result object whose
  ``result`` is ``fail`` (a wrapper that exits 0 and reports a failure);
- its ``Failed`` condition with reason ``DeadlineExceeded`` (the Job's ``activeDeadlineSeconds``, the step's
  timeout, enforced by the Job controller) is a timeout; any other ``Failed`` is a fail;
- no condition by the deadline (plus a grace for the Job controller) is a timeout.

The result format (optional, ``RESULT_FORMAT``): the container's termination message
(``/dev/termination-log``), a JSON object with ``result`` (``pass``/``fail``) and any of ``level``,
``exitCode``, ``tests`` (``[{name, result, gpu, message}]``), ``message``. It is kept, capped, in the
node's repair case and the audit record; a message that is not such an object is kept as text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from pipeline.actuator.jobstatus import job_end

RESULT_FORMAT = "xidflow.dev/diagnostics-result/v1"
"""Name of the termination-message format (docs/repair.md, "The diagnostics result")."""
DEFAULT_TIMEOUT = 1800.0
"""Seconds the diagnostics Job may run (its activeDeadlineSeconds) when the rule sets no timeout."""
DEADLINE_GRACE = 120.0
"""Seconds past the deadline the step waits for the Job controller's verdict before it calls it a timeout."""
RESULT_KEYS = ("result", "level", "exitCode", "tests", "message")
MAX_TESTS = 16

# The built-in Job's command: DCGM level 2 run on the node itself (the host's ``dcgmi`` and host engine, entered
# through the host's namespaces as the reboot hook does), then the result object on the termination message.
# No ``<``, ``>`` or ``&`` in it: the chart's admission policy carries it as JSON, where Helm would escape them.
DIAGNOSTICS_SCRIPT = (
    "nsenter -t 1 -m -u -i -n -p -- dcgmi diag -r 2; rc=$?; "
    "if [ $rc -eq 0 ]; then r=pass; else r=fail; fi; "
    "printf '{\"result\":\"%s\",\"level\":2,\"exitCode\":%d,\"message\":\"dcgmi diag -r 2 on the node\"}' "
    "\"$r\" \"$rc\" | tee /dev/termination-log; exit $rc"
)
DIAGNOSTICS_COMMAND = ("sh", "-c", DIAGNOSTICS_SCRIPT)
"""The built-in diagnostics hook's command (``effects.DEFAULT_DIAGNOSTICS_JOB``, in the documented hooks)."""

Verdict = Literal["pass", "fail", "timeout"]


@dataclass(frozen=True)
class GateResult:
    """A diagnostics Job's verdict, or None while it runs (``verdict``)."""

    verdict: Verdict | None
    reason: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    """The termination message's result object (``RESULT_KEYS``), capped; ``{"message": text}`` when it is not JSON."""


def read_message(message: str | None) -> dict[str, Any]:
    """The result object of a termination message (pure): its known keys, capped; text when it is not one."""
    if not message:
        return {}
    try:
        data = orjson.loads(message)
    except orjson.JSONDecodeError:
        return {"message": message.strip()[:512]}
    if not isinstance(data, dict):
        return {"message": message.strip()[:512]}
    out = {k: data[k] for k in RESULT_KEYS if k in data}
    if isinstance(out.get("tests"), list):
        out["tests"] = out["tests"][:MAX_TESTS]
    if isinstance(out.get("message"), str):
        out["message"] = out["message"][:512]
    return out


def termination_message(pod: Mapping[str, Any]) -> str | None:
    """The first terminated container's termination message of a pod, if any (pure)."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (status.get("state") or {}).get("terminated") or {}
        if terminated.get("message"):
            return str(terminated["message"])
    return None


def verdict(job: Mapping[str, Any], message: str | None, overdue: bool) -> GateResult:
    """The verdict of a diagnostics Job from its status and its pod's termination message (pure).

    ``overdue``: the step's deadline and grace have passed; a Job without a verdict then is a timeout.
    """
    result = read_message(message)
    said = result.get("result")
    end = job_end(job)
    if end is not None and end.succeeded:
        if said == "fail":
            return GateResult("fail", "the Job completed but its result says fail", result)
        return GateResult("pass", "the Job completed" + (" and its result says pass" if said == "pass" else ""), result)
    if end is not None:
        if end.reason == "DeadlineExceeded":
            return GateResult("timeout", "the Job ran past its deadline (activeDeadlineSeconds)", result)
        return GateResult("fail", f"the Job failed ({end.reason or 'Failed'})", result)
    if overdue:
        return GateResult("timeout", "no verdict from the Job controller by the deadline", result)
    return GateResult(None)
