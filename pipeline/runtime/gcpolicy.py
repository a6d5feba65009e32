"""How often the cyclic garbage collector runs in the long-lived services (worker, actuator).

CPython's default (a young collection every 700 net allocations) is tuned for short scripts. In the
worker every record read allocates a few dozen objects that die young (aiokafka's ConsumerRecord, the
decoded line, the event), so the collector ran every few dozen records and took about 0.8 of the
~1.9 us each record cost (``xidflow bench`` throughput section, ``pipeline_gc_ns_per_record``); in a
burst that CPU is latency, since the worker and the actuator are CPU-bound on a busy node. The
collector only exists for reference cycles, which this code rarely makes, so it can run far less
often: a larger first threshold, and fewer full collections over the tens of thousands of long-lived
objects a fleet cache holds. Memory held by garbage cycles waits longer; the RSS figures of the
bench's soak and scale sections are taken with this policy on.

``XIDFLOW_GC_THRESHOLD0=700 XIDFLOW_GC_THRESHOLD1=10 XIDFLOW_GC_THRESHOLD2=10`` restores CPython's default.
"""

from __future__ import annotations

import gc
import logging

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger("xidflow.gc")


class GcSettings(BaseSettings):
    """The garbage collector's thresholds in the worker and the actuator (environment ``XIDFLOW_GC_*``)."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_GC_", extra="ignore")

    threshold0: int = Field(
        default=50_000, ge=100, le=10_000_000,
        description="Default 50000 (CPython's: 700). Net allocations between young collections.",
    )
    threshold1: int = Field(
        default=20, ge=1, le=10_000,
        description="Default 20 (CPython's: 10). Young collections between middle-generation collections.",
    )
    threshold2: int = Field(
        default=100, ge=1, le=10_000,
        description="Default 100 (CPython's: 10). Middle-generation collections between full collections.",
    )


def tune(settings: GcSettings | None = None) -> tuple[int, int, int]:
    """Set the collector's thresholds for a long-lived service; returns them.

    Objects alive now (imports, settings, the app's declarations) are moved out of the collector's
    sight (``gc.freeze``): they live as long as the process, and every full collection would walk them.
    The collector is turned on if the start had it off.
    """
    s = settings or GcSettings()
    gc.enable()  # the service's start ran without it (``pipeline.cli.LazyGroup.get_command``)
    gc.collect()
    gc.freeze()
    gc.set_threshold(s.threshold0, s.threshold1, s.threshold2)
    log.debug("gc thresholds %s, %d objects frozen", gc.get_threshold(), gc.get_freeze_count())
    return gc.get_threshold()
