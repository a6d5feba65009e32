"""Node conditions as xidflow writes them: names, statuses, transitions, ownership keys. Pure.

Two families of condition types:

- xidflow's own (``GpuXid``, ``GpuEcc``, ``GpuFellOffBus``, ... see ``problems.ProblemClass``) follow
  node-problem-detector's convention: present on every GPU node, ``False`` while healthy, ``True``
  while a fault of that class is present.
- well-known types other tools act on, set by a policy's ``condition`` action with ``type`` and
  ``status``: ``AcceleratedHardwareReady=False`` is what Karpenter node repair and EKS node auto
  repair replace a node on. Such "Ready"-style types are healthy when ``True``.

A condition's ``lastTransitionTime`` changes only when its status changes (``next_condition``); a
write that keeps the status only refreshes ``lastHeartbeatTime``, reason and message.

Ownership: the ledger key of a condition xidflow set is ``condition:<type>`` when it set it ``True``
(the only form older ledgers hold) and ``condition:<type>=<status>`` otherwise, so undo knows what it
set and puts back the opposite (``recovered_status``), and only while the condition still says what
xidflow wrote.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pipeline.actuator.ownership import condition_effect_key

ConditionStatus = Literal["True", "False", "Unknown"]
STATUSES: tuple[str, ...] = ("True", "False", "Unknown")

# metav1.Condition's rules (apimachinery): an optional DNS subdomain prefix and '/', then a name.
_TYPE = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
)
TYPE_MAX = 316
_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
REASON_MAX = 1024
MESSAGE_MAX = 1024

# The kubelet rewrites these on every status update: a value xidflow wrote would not last (and Ready=False
# would make the node lifecycle controller evict everything). Policies may not set them.
KUBELET_TYPES = frozenset({"Ready", "MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable"})

RECOVERED_REASON = "XidflowRecovered"


def type_error(name: str) -> str | None:
    """Why ``name`` cannot be a node condition type set by a policy (None: it can)."""
    if len(name) > TYPE_MAX or not _TYPE.match(name):
        return (
            f"{name!r} is not a valid condition type (letters, digits, '-', '_', '.', starting and ending "
            f"with a letter or digit, optionally prefixed by a DNS subdomain and '/'; at most {TYPE_MAX} characters)"
        )
    if name in KUBELET_TYPES:
        return f"{name!r} is written by the kubelet; xidflow will not set it"
    return None


def reason_error(reason: str) -> str | None:
    """Why ``reason`` cannot be a condition reason (None: it can): CamelCase, as Kubernetes requires."""
    if len(reason) > REASON_MAX or not _REASON.match(reason):
        return f"{reason!r} is not a valid condition reason (a letter, then letters, digits, '_', ',' or ':')"
    return None


def status_text(status: bool | str) -> str:
    """``True``/``False``/``Unknown`` from a bool or a status string (YAML reads ``False`` as a bool)."""
    if isinstance(status, bool):
        return "True" if status else "False"
    if status not in STATUSES:
        raise ValueError(f"condition status must be one of {', '.join(STATUSES)}, got {status!r}")
    return status


def recovered_status(set_status: str) -> str:
    """What undo puts back: ``False`` after ``True`` (a problem condition), else ``True`` (a Ready-style one)."""
    return "False" if set_status == "True" else "True"


def next_condition(
    current: Mapping[str, Any] | None,
    condition_type: str,
    status: bool | str,
    reason: str,
    message: str,
    now: str,
) -> dict[str, Any]:
    """The condition to write: ``lastTransitionTime`` kept unless the status changes."""
    text = status_text(status)
    transition = now
    if current is not None and current.get("status") == text and current.get("lastTransitionTime"):
        transition = str(current["lastTransitionTime"])
    return {
        "type": condition_type,
        "status": text,
        "reason": reason,
        "message": message[:MESSAGE_MAX],
        "lastHeartbeatTime": now,
        "lastTransitionTime": transition,
    }


def effect_key(condition_type: str, status: str = "True") -> str:
    """Ledger key of a condition xidflow set to ``status``."""
    key = condition_effect_key(condition_type)
    return key if status == "True" else f"{key}={status}"


def parse_owned(entry: str) -> tuple[str, str]:
    """(type, status xidflow set) from what follows ``condition:`` in a ledger key."""
    condition_type, _, status = entry.partition("=")
    return condition_type, status or "True"
