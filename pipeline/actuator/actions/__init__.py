"""Every action xidflow can take, one module each, registered here.

A module declares ``ACTION = ActionDef(...)``: its name (as policies and rescue requests spell it),
its traits (how it runs, whether it is claimed, what it owns, how it is undone, breaker/cap/escalation
behaviour) and its runner. The registry imports every module of this package, so adding an action
is adding one file; ``policy``, ``plan``, ``requests`` and the engine derive their lists from here.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import get_args

from pipeline.actuator.actions.base import ActionDef, Kind, StepContext, StepResult, StopReason
from schemas.records import RescueActionName

__all__ = [
    "ACTION_NAMES",
    "REGISTRY",
    "ActionDef",
    "Kind",
    "StepContext",
    "StepResult",
    "StopReason",
    "get",
    "names",
]


def _discover() -> dict[str, ActionDef]:
    found: dict[str, ActionDef] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        action: ActionDef = module.ACTION
        if action.name in found:
            raise RuntimeError(f"action {action.name!r} registered twice")
        found[action.name] = action
    return found


REGISTRY: dict[str, ActionDef] = _discover()

# Policy order: the macro first, then the rest as an operator reads a flow.
_ORDER = ("quarantine", "cordon", "taint", "taintDevice", "condition", "event", "notifyWorkload", "drain", "reboot",
          "resetGpu", "diagnose", "hardwareInspection", "enableWarmStandby", "unCordon")
ACTION_NAMES: tuple[str, ...] = tuple(n for n in _ORDER if n in REGISTRY) + tuple(
    sorted(n for n in REGISTRY if n not in _ORDER)
)


def get(name: str) -> ActionDef:
    return REGISTRY[name]


def names(**traits: object) -> frozenset[str]:
    """Names of the actions whose traits have the given values: ``names(disruptive=True)``."""
    return frozenset(
        n for n, a in REGISTRY.items() if all(getattr(a, t) == v for t, v in traits.items())
    )


def attrs_by_action() -> dict[str, set[str]]:
    return {n: set(a.attrs) for n, a in REGISTRY.items()}


_requestable = names(requestable=True)
if _requestable != frozenset(get_args(RescueActionName)):
    raise RuntimeError(f"schemas.records.RescueActionName must list the requestable actions {sorted(_requestable)}")
