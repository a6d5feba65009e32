"""Prometheus metrics of every xidflow process (the names are a contract: dashboards use them).

Each process serves them at ``:$XIDFLOW_METRICS_PORT/metrics`` (default 9400; 0 disables), and its
liveness (``pipeline.liveness``) at ``/healthz`` on the same port: 200 while every registered stage
makes progress, 503 naming the stalled ones.

Label values are closed sets (topic names, partitions, enum values): a label never carries text
that comes from input, so no input can grow the number of series.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app

from pipeline.liveness import LIVENESS

LINES_IN = Counter("xidflow_lines_total", "Raw log records read from the input topics", ["source"])
FAULT_EVENTS = Counter("xidflow_fault_events_total", "Recognised fault events", ["kind"])
DEADLETTERS = Counter(
    "xidflow_deadletters_total", "Records sent to the dead-letter topic (reason: a DeadLetterCode value)",
    ["stage", "reason"],
)
OUTPUT_FAILURES = Counter(
    "xidflow_output_failures_total", "Outputs refused by the producer or broker, replaced by a dead letter"
)
OUTPUTS_LOST = Counter(
    "xidflow_outputs_lost_total", "Refused outputs whose replacement dead letter was refused too (logged)"
)
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
            _serve(port, os.environ.get("XIDFLOW_METRICS_ADDR", "0.0.0.0"))
        except OSError as exc:
            # Metrics are for observing; a busy port (another process on this host) must not stop the work.
            logging.getLogger("xidflow.metrics").warning("metrics not served on port %d: %s", port, exc)
            return None
        _started.add(port)
    return port


_metrics_app = make_wsgi_app()


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """``/healthz``: the process's liveness; anything else: the Prometheus exposition."""
    if environ.get("PATH_INFO") in ("/healthz", "/livez"):
        live, reasons = LIVENESS.check()
        body = ("ok\n" if live else "stalled: " + "; ".join(reasons) + "\n").encode()
        start_response("200 OK" if live else "503 Service Unavailable",
                       [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
        return [body]
    return _metrics_app(environ, start_response)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


def _serve(port: int, addr: str) -> None:
    server = make_server(addr, port, app, _Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="xidflow-metrics", daemon=True).start()
