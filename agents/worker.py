"""The worker: a declared Faust app (``pipeline.app``) with the parse service and the aggregation agent wired on.

``xidflow worker`` runs what ``create_app`` returns. ``WorkerSettings.parse`` / ``.aggregate`` choose the
stages, so one worker can run both (the default) or either one alone.
"""

from __future__ import annotations

from agents import aggregate, parse
from pipeline.aggregate.settings import AggregationSettings
from pipeline.app import (
    WorkerSettings,
    XidflowApp,
    declare_app,
    install_aggregation_liveness,
    install_lag_monitor,
    install_memory_release,
)
from pipeline.detection.parse_settings import ParseSettings
from pipeline.kafka import fetch_watchdog
from pipeline.runtime.settings import ConsumerGroupSettings, TopicNames


def create_app(
    bootstrap: str | None = None,
    settings: WorkerSettings | None = None,
    topics: TopicNames | None = None,
    aggregation: AggregationSettings | None = None,
    parse_settings: ParseSettings | None = None,
    group: ConsumerGroupSettings | None = None,
) -> XidflowApp:
    """Declare the app and register the stages its settings ask for on it."""
    xapp = declare_app(bootstrap, settings, topics, aggregation, parse_settings, group)
    if xapp.settings.parse:
        parse.register(xapp)
    install_memory_release(xapp)
    install_lag_monitor(xapp)
    if xapp.settings.aggregate:
        aggregate.register(xapp)
        fetch_watchdog.install(
            xapp.app,
            {xapp.fault_events.get_topic_name(), xapp.ticks.get_topic_name()},
            fetch_max_wait_ms=xapp.settings.fetch_max_wait_ms,
        )
        install_aggregation_liveness(xapp)
    return xapp
