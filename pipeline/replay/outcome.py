"""What one policy would have done over the window (``Simulation``): steps taken, breaker trips, counts.

Filled by ``pipeline.replay.run.simulate`` and ``pipeline.replay.fleet``; read by
``pipeline.replay.report``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.aggregate.sharedparts import PartState


@dataclass(frozen=True)
class Taken:
    """One step that would have been applied."""

    node: str
    action: str
    at: float
    incident: str
    rule: str
    gpu: str | None
    fault: str
    quarantining: bool


@dataclass
class Trip:
    """The breaker tripping, and the nodes it then refused."""

    at: float
    tripped_by: str
    reason: str
    refused: list[str] = field(default_factory=list)
    refusals: int = 0


@dataclass
class Simulation:
    """What one policy would have done over the window."""

    taken: list[Taken] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    trips: list[Trip] = field(default_factory=list)
    refused: list[dict[str, Any]] = field(default_factory=list)
    recovered: list[dict[str, Any]] = field(default_factory=list)
    records: int = 0
    outside_window: int = 0
    events: int = 0
    dead_letters: int = 0
    incidents: int = 0
    fleet_size: int = 0
    fleet_source: str = ""
    first_ts: float | None = None
    last_ts: float | None = None
    parts: dict[str, PartState] = field(default_factory=dict)
    """Shared-part correlation by ``label=value`` (``pipeline.aggregate.sharedparts``)."""

