"""The diagnostics gate's Job and its result: the built-in template and how a verdict is read. Pure.

The Job runs on the node the way the reboot and GPU-reset hooks do (``jobtemplates``: the operator's
template, else the built-in one, pinned to the node, run once as the token-less hook ServiceAccount). The
built-in one runs NVIDIA DCGM's diagnostics at level 2 (``dcgmi diag -r 2``, what NVIDIA's DCGM guide
calls the level for an epilogue after a failure, a few minutes on a node) and writes a one-line summary
to the container's termination message.

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

RESULT_FORMAT = "xidflow.dev/diagnostics-result/v1"
"""Name of the termination-message format (docs/repair.md, "The diagnostics result")."""
DEFAULT_TIMEOUT = 1800.0
"""Seconds the diagnostics Job may run (its activeDeadlineSeconds) when the rule sets no timeout."""
DEADLINE_GRACE = 120.0
"""Seconds past the deadline the step waits for the Job controller's verdict before it calls it a timeout."""
RESULT_KEYS = ("result", "level", "exitCode", "tests", "message")
MAX_TESTS = 16

# The summary the built-in Job writes: dcgmi's exit status decides (0: every test passed).
_SCRIPT = (
    "nv-hostengine >/dev/null 2>&1; "
    "dcgmi diag -r 2 >/tmp/diag.txt 2>&1; rc=$?; "
    "if [ $rc -eq 0 ]; then r=pass; else r=fail; fi; "
    "printf '{\"result\":\"%s\",\"level\":2,\"exitCode\":%d,\"message\":\"dcgmi diag -r 2\"}' \"$r\" \"$rc\" "
    ">/dev/termination-log; "
    "tail -n 40 /tmp/diag.txt; exit $rc"
)

DEFAULT_DIAGNOSTICS_JOB = f"""
apiVersion: batch/v1
kind: Job
spec:
  backoffLimit: 0
  ttlSecondsAfterFinished: 86400
  template:
    spec:
      restartPolicy: Never
      tolerations: [{{operator: Exists}}]
      containers:
      - name: diagnostics
        image: nvcr.io/nvidia/cloud-native/dcgm:4.2.3-1-ubuntu22.04
        command: ["/bin/bash", "-c", {orjson.dumps(_SCRIPT).decode()}]
        securityContext: {{privileged: true}}
"""
"""The built-in diagnostics Job: DCGM level 2 (XIDFLOW_ACTUATOR_DIAGNOSTICS_JOB_TEMPLATE replaces it)."""

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


def _condition(job: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind and cond.get("status") == "True":
            return cond
    return None


def verdict(job: Mapping[str, Any], message: str | None, overdue: bool) -> GateResult:
    """The verdict of a diagnostics Job from its status and its pod's termination message (pure).

    ``overdue``: the step's deadline and grace have passed; a Job without a verdict then is a timeout.
    """
    result = read_message(message)
    said = result.get("result")
    if _condition(job, "Complete") is not None:
        if said == "fail":
            return GateResult("fail", "the Job completed but its result says fail", result)
        return GateResult("pass", "the Job completed" + (" and its result says pass" if said == "pass" else ""), result)
    failed = _condition(job, "Failed")
    if failed is not None:
        if failed.get("reason") == "DeadlineExceeded":
            return GateResult("timeout", "the Job ran past its deadline (activeDeadlineSeconds)", result)
        why = failed.get("reason") or "Failed"
        return GateResult("fail", f"the Job failed ({why})", result)
    if overdue:
        return GateResult("timeout", "no verdict from the Job controller by the deadline", result)
    return GateResult(None)
