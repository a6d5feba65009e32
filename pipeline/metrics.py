"""Prometheus metrics of every xidflow process (the names are a contract: dashboards use them).

Each process serves them at ``:$XIDFLOW_METRICS_PORT/metrics`` (default 9400; 0 disables).
"""

from __future__ import annotations

import logging
import os

from prometheus_client import Counter, Gauge, Histogram, start_http_server

LINES_IN = Counter("xidflow_lines_total", "Raw log records read from the input topics", ["source"])
FAULT_EVENTS = Counter("xidflow_fault_events_total", "Recognised fault events", ["kind"])
DEADLETTERS = Counter("xidflow_deadletters_total", "Records sent to the dead-letter topic", ["stage", "reason"])
INCIDENTS = Counter("xidflow_incidents_total", "Node incidents opened or escalated", ["action"])
RECOVERIES = Counter("xidflow_recoveries_total", "NodeRecovered records emitted", ["reason"])
REMEDIATIONS = Counter("xidflow_remediations_total", "Actuator decisions and effects", ["action", "outcome"])
CONSUMER_LAG = Gauge("xidflow_consumer_lag", "Records behind the end of the partition", ["topic", "partition"])
BREAKER_OPEN = Gauge("xidflow_breaker_open", "1 while the quarantine circuit breaker is open")
E2E_LATENCY = Histogram(
    "xidflow_e2e_latency_seconds", "Time from a line's log timestamp to its incident record",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)

_started: set[int] = set()


def serve_metrics(port: int | None = None) -> int | None:
    """Start the /metrics endpoint once per process; returns the port or None when disabled."""
    if port is None:
        port = int(os.environ.get("XIDFLOW_METRICS_PORT", "9400"))
    if port <= 0:
        return None
    if port not in _started:
        try:
            start_http_server(port, addr=os.environ.get("XIDFLOW_METRICS_ADDR", "0.0.0.0"))
        except OSError as exc:
            # Metrics are for observing; a busy port (another process on this host) must not stop the work.
            logging.getLogger("xidflow.metrics").warning("metrics not served on port %d: %s", port, exc)
            return None
        _started.add(port)
    return port
