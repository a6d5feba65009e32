"""One policy's what-if (``ReplayConfig``) and the catalog in force for a run (``catalog_in_force``).

``pipeline.replay.run.simulate`` takes a ``ReplayConfig``; ``pipeline.replay.fleet`` reads its policy,
actuator settings and fleet labels.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from pipeline.actuator.policy import PolicySet
from pipeline.actuator.settings import ActuatorSettings
from pipeline.aggregate.settings import AggregationSettings
from pipeline.detection.catalog import Catalog
from pipeline.detection.parse_settings import ParseSettings
from pipeline.runtime.settings import TopicNames

DEFAULT_TICK_INTERVAL_S = 10.0
"""The worker's default ``XIDFLOW_WORKER_TICK_INTERVAL_S``."""


@dataclass
class ReplayConfig:
    """One policy's what-if: the policy, the catalog overrides file, and the worker/actuator settings."""

    policies: PolicySet
    catalog_overrides: str | None = None
    """A catalog overrides file for this run (None: the catalog in force, ``XIDFLOW_CATALOG_OVERRIDES``)."""
    actuator: ActuatorSettings = field(default_factory=ActuatorSettings)
    aggregation: AggregationSettings = field(default_factory=AggregationSettings)
    parse: ParseSettings = field(default_factory=ParseSettings)
    topics: TopicNames = field(default_factory=TopicNames)
    tick_interval_s: float = DEFAULT_TICK_INTERVAL_S
    fleet_labels: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """Labels of the GPU nodes known (from the cluster): rules' node selectors and opt-out read them."""
    fleet_size: int | None = None
    """The breaker's denominator; None: the GPU nodes known, else the nodes seen in the history."""


@contextlib.contextmanager
def catalog_in_force(overrides: str | None) -> Iterator[Catalog]:
    """The catalog every stage uses for this run (``Catalog.configured``): the overrides file, if given.

    The worker and actuator reach the catalog through ``XIDFLOW_CATALOG_OVERRIDES`` (the detector, the
    aggregator, the actuator's problem mapping and policy matching all read it), so the run sets it for
    its duration instead of threading a second catalog through code that has one way to get it.
    """
    if overrides is None:
        yield Catalog.configured()
        return
    previous = os.environ.get("XIDFLOW_CATALOG_OVERRIDES")
    os.environ["XIDFLOW_CATALOG_OVERRIDES"] = os.path.abspath(overrides)
    try:
        yield Catalog.configured()
    finally:
        if previous is None:
            os.environ.pop("XIDFLOW_CATALOG_OVERRIDES", None)
        else:
            os.environ["XIDFLOW_CATALOG_OVERRIDES"] = previous

