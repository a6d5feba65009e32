"""Prometheus metrics of every xidflow process (the names are a contract: dashboards and alerts use them).

Each process serves them at ``:$XIDFLOW_METRICS_PORT/metrics`` (default 9400; 0 disables), and its
liveness (``pipeline.runtime.liveness``) at ``/healthz`` on the same port: 200 while every registered stage
makes progress, 503 naming the stalled ones.

Hygiene:

- **Each process exports only its own metrics.** The metrics are defined here unregistered
  (``registry=None``); ``use(component)`` builds the process's own registry from the component's
  list (``COMPONENT_METRICS``) plus the process/platform/GC collectors, and ``/metrics`` serves that
  registry, not prometheus-client's global one (which would collect every metric any imported
  module defines).
- **Bounded labels.** Label values are closed sets: enum values, configured topic and group names,
  partition numbers, action names from the action registry. A value outside its set is counted as
  ``other`` (``bounded``); no label ever carries a node name or text that comes from input.
- **Initialised series.** ``use`` creates every known label combination at 0 when the process
  starts, so ``rate()`` and ``absent()`` work from the first scrape.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from socketserver import ThreadingMixIn
from typing import Any, get_args
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.metrics import MetricWrapperBase

from pipeline.runtime.liveness import LIVENESS
from schemas.records import Action, DeadLetterCode, FaultKind, NodeRecovered

disable_created_metrics()  # no *_created twin of every counter series: half the series, nothing reads them

# -- worker (parse stage and aggregation) -------------------------------------------------------------
LINES_IN = Counter("xidflow_lines_total", "Raw log records read from the input topics (source: the topic)",
                   ["source"], registry=None)
FAULT_EVENTS = Counter("xidflow_fault_events_total", "Recognised fault events", ["kind"], registry=None)


def _deadletters() -> Counter:
    return Counter(
        "xidflow_deadletters_total", "Records sent to the dead-letter topic (reason: a DeadLetterCode value)",
        ["stage", "reason"], registry=None,
    )


# One series name in every process that dead-letters, one object each: a process's counter only ever
# holds its own stages (pipeline.runtime.deadletter_log reports into the one it is given).
DEADLETTERS = _deadletters()
ACTUATOR_DEADLETTERS = _deadletters()
LOKI_TAIL_DEADLETTERS = _deadletters()
OUTPUT_FAILURES = Counter(
    "xidflow_output_failures_total", "Outputs refused by the producer or broker, replaced by a dead letter",
    registry=None,
)
OUTPUTS_LOST = Counter(
    "xidflow_outputs_lost_total", "Refused outputs whose replacement dead letter was refused too (logged)",
    registry=None,
)
INCIDENTS = Counter("xidflow_incidents_total", "Node incidents opened or escalated", ["action"], registry=None)
RECOVERIES = Counter("xidflow_recoveries_total", "NodeRecovered records emitted", ["reason"], registry=None)
UNDECODABLE_BATCHES = Counter(
    "xidflow_undecodable_batches_total",
    "Record batches a consumer could not decode, each counted once (reason: unsupported_codec, held; corrupt, "
    "skipped with a dead letter naming its offsets); see pipeline/kafka/undecodable.py",
    ["stage", "topic", "reason"], registry=None,
)
HELD_PARTITIONS = Gauge(
    "xidflow_held_partitions",
    "Partitions paused at a record batch this process cannot decode (its codec library is missing): "
    "nothing of them is read until the worker runs with the library",
    ["stage", "topic"], registry=None,
)
STAGE_RESTARTS = Counter(
    "xidflow_stage_restarts_total", "Restarts of a worker stage after a failure (connection, broker)",
    ["stage"], registry=None,
)
STAGE_RESTART_DELAY = Gauge(
    "xidflow_stage_restart_delay_seconds",
    "The pause before the stage's pending restart (0: running); doubles per failure up to a bound",
    ["stage"], registry=None,
)
E2E_LATENCY = Histogram(
    "xidflow_e2e_latency_seconds", "Time from a line's log timestamp to its incident record",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=None,
)

# -- every consumer (worker and actuator): pipeline.kafka.lag ----------------------------------------------
CONSUMER_LAG = Gauge(
    "xidflow_consumer_lag",
    "Records of the partition the consumer group has not committed yet (end offset - committed offset), "
    "refreshed on a timer whether or not records arrive",
    ["group", "topic", "partition"], registry=None,
)
LAG_REFRESHED = Gauge(
    "xidflow_consumer_lag_refreshed_timestamp_seconds", "When the consumer lag of the group was last read",
    ["group"], registry=None,
)

# -- actuator (pipeline.actuator.fleetmetrics) --------------------------------------------------------
REMEDIATIONS = Counter(
    "xidflow_remediations_total", "Actuator decisions and effects (action: the action's name, without '#n')",
    ["action", "outcome"], registry=None,
)
BREAKER_OPEN = Gauge("xidflow_breaker_open", "1 while the quarantine circuit breaker is open", registry=None)
BREAKER_WINDOW_NODES = Gauge(
    "xidflow_breaker_window_nodes",
    "GPU nodes the breaker counts now: quarantined by xidflow or admitted within its window",
    registry=None,
)
BREAKER_WINDOW_SHARE = Gauge(
    "xidflow_breaker_window_share",
    "Share of the GPU fleet the breaker counts now (it trips above XIDFLOW_ACTUATOR_BREAKER_MAX_SHARE)",
    registry=None,
)
BREAKER_MAX_SHARE = Gauge("xidflow_breaker_max_share", "The breaker's configured limit on the share",
                          registry=None)
GPU_NODES = Gauge("xidflow_gpu_nodes", "GPU nodes the actuator watches (its node selector)", registry=None)
QUARANTINED_NODES = Gauge(
    "xidflow_quarantined_nodes", "GPU nodes carrying xidflow's own cordon or taint now (its ledger owns it)",
    registry=None,
)
FLOW_STEP_AGE = Gauge(
    "xidflow_flow_oldest_step_age_seconds",
    "Age of the oldest open flow step of the action (0: none open), over every GPU node",
    ["action"], registry=None,
)
FLOW_STEP_TIMEOUT = Gauge(
    "xidflow_flow_oldest_step_timeout_seconds",
    "Timeout of that oldest open step (its policy's timeout or the action's default)",
    ["action"], registry=None,
)
FLOW_STEPS_OPEN = Gauge("xidflow_flow_open_steps", "Open flow steps of the action over every GPU node",
                        ["action"], registry=None)
CHECKPOINT_WAITS = Histogram(
    "xidflow_checkpoint_wait_seconds",
    "Checkpoint waits before drains (checkpointGrace), by how they ended (result: answered, grace-expired, "
    "no-gpu-pods, gpu-lost): seconds from the request to the end of the wait",
    ["result"], buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600), registry=None,
)
NOTIFICATIONS = Counter(
    "xidflow_notifications",
    "Webhook notifications by webhook (its configured name) and result (delivered, failed, dropped)",
    ["webhook", "result"], registry=None,
)
NOTIFICATION_ATTEMPTS = Counter(
    "xidflow_notification_attempts", "HTTP attempts to deliver webhook notifications", ["webhook"],
    registry=None,
)

# -- worker and actuator: pipeline.runtime.supervisor --------------------------------------------------------
SUPERVISOR_RESTARTS = Counter(
    "xidflow_supervisor_restarts_total",
    "Children the warm supervisor replaced after an unexpected death (a crash loop backs off, then gives up)",
    registry=None,
)

WORKER, ACTUATOR, PROBE, LOKI_TAIL = "worker", "actuator", "probe", "loki-tail"

COMPONENT_METRICS: dict[str, tuple[MetricWrapperBase, ...]] = {
    WORKER: (LINES_IN, FAULT_EVENTS, DEADLETTERS, OUTPUT_FAILURES, OUTPUTS_LOST, INCIDENTS, RECOVERIES,
             E2E_LATENCY, CONSUMER_LAG, LAG_REFRESHED, UNDECODABLE_BATCHES, HELD_PARTITIONS, STAGE_RESTARTS,
             STAGE_RESTART_DELAY, SUPERVISOR_RESTARTS),
    ACTUATOR: (REMEDIATIONS, BREAKER_OPEN, BREAKER_WINDOW_NODES, BREAKER_WINDOW_SHARE, BREAKER_MAX_SHARE,
               GPU_NODES, QUARANTINED_NODES, FLOW_STEP_AGE, FLOW_STEP_TIMEOUT, FLOW_STEPS_OPEN,
               NOTIFICATIONS, NOTIFICATION_ATTEMPTS, CONSUMER_LAG, LAG_REFRESHED, ACTUATOR_DEADLETTERS,
               CHECKPOINT_WAITS, SUPERVISOR_RESTARTS, UNDECODABLE_BATCHES, HELD_PARTITIONS),
    PROBE: (),
    LOKI_TAIL: (LOKI_TAIL_DEADLETTERS,),
}
"""What each process exports (besides process_*/python_* of its own): nothing else reaches its /metrics."""

OTHER = "other"
WORKER_DEADLETTER_STAGES = ("adapter", "parse", "aggregate")
"""Stages of the worker that dead-letter (``pipeline.ingest.adapters``, ``pipeline.detection.parse_stage``,
``agents.aggregate``)."""


def deadletter_label_values(*stages: str) -> list[tuple[str, str]]:
    """Every (stage, code) series of ``xidflow_deadletters_total`` for these stages (pure)."""
    return [(s, c.value) for s in stages for c in DeadLetterCode]

LabelValues = Mapping[MetricWrapperBase, Iterable[tuple[str, ...]]]


def bounded(value: str, allowed: Collection[str]) -> str:
    """``value`` when it is one of the known label values, else ``other``: a label never grows with input."""
    return value if value in allowed else OTHER


def worker_label_values(raw_topics: Iterable[str]) -> dict[MetricWrapperBase, list[tuple[str, ...]]]:
    """Every known label combination of the worker's counters (pure)."""
    from pipeline.kafka.undecodable import Reason

    topics = list(dict.fromkeys(raw_topics))
    return {
        UNDECODABLE_BATCHES: [("parse", t, r.value) for t in topics for r in Reason],
        HELD_PARTITIONS: [("parse", t) for t in topics],
        STAGE_RESTARTS: [("parse",)],
        STAGE_RESTART_DELAY: [("parse",)],
        LINES_IN: [(t,) for t in dict.fromkeys(raw_topics)],
        FAULT_EVENTS: [(k.value,) for k in FaultKind],
        DEADLETTERS: deadletter_label_values(*WORKER_DEADLETTER_STAGES),
        INCIDENTS: [(a.value,) for a in Action],
        RECOVERIES: [(r,) for r in get_args(NodeRecovered.model_fields["reason"].annotation)],
    }


def initialise(values: LabelValues) -> None:
    """Create each listed series now (at 0), so it is exported before anything happens."""
    for metric, combos in values.items():
        for combo in combos:
            metric.labels(*combo)


def build_registry(component: str, values: LabelValues | None = None) -> CollectorRegistry:
    """A registry of the component's own metrics (``COMPONENT_METRICS``) and process collectors."""
    if component not in COMPONENT_METRICS:
        raise ValueError(f"unknown component {component!r}; one of {sorted(COMPONENT_METRICS)}")
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    for metric in COMPONENT_METRICS[component]:
        registry.register(metric)
    if values:
        unknown = [m for m in values if m not in COMPONENT_METRICS[component]]
        if unknown:
            raise ValueError(f"{component} does not export {[m._name for m in unknown]}")
        initialise(values)
    return registry


_registry: CollectorRegistry | None = None
_component: str | None = None


def use(component: str, values: LabelValues | None = None) -> CollectorRegistry:
    """Make ``component``'s registry the one this process serves; a later call for the same component only
    adds label values. (A process runs one command; tests that run several in one process get the last.)"""
    global _registry, _component
    if _registry is None or component != _component:
        _registry, _component = build_registry(component, values), component
    elif values:
        initialise(values)
    return _registry


def registry() -> CollectorRegistry:
    """The registry /metrics serves (an empty one with the process collectors until ``use`` chose one)."""
    global _registry
    if _registry is None:
        _registry = build_registry(PROBE)
    return _registry


def refresh_interval_s() -> float:
    """How often gauges read from outside (consumer lag, fleet gauges) are refreshed:
    ``XIDFLOW_METRICS_REFRESH_S`` (default 15 s)."""
    try:
        value = float(os.environ.get("XIDFLOW_METRICS_REFRESH_S", "15"))
    except ValueError:
        value = 15.0
    return min(max(value, 0.5), 3600.0)


_started: set[int] = set()


def serve_metrics(port: int | None = None, component: str | None = None,
                  values: LabelValues | None = None) -> int | None:
    """Start the /metrics endpoint once per process; returns the port or None when disabled.

    ``component`` picks what it exports (``use``); without one, what an earlier ``use`` chose.
    """
    if component is not None:
        use(component, values)
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


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """``/livez``: stalls only (a restart can help); ``/healthz``: stalls and faults an operator must fix
    (``pipeline.runtime.liveness``); anything else: the Prometheus exposition of its registry."""
    path = environ.get("PATH_INFO")
    if path in ("/healthz", "/livez"):
        live, reasons = LIVENESS.check(faults=path == "/healthz")
        body = ("ok\n" if live else "stalled: " + "; ".join(reasons) + "\n").encode()
        start_response("200 OK" if live else "503 Service Unavailable",
                       [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))])
        return [body]
    return make_wsgi_app(registry())(environ, start_response)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


def _serve(port: int, addr: str) -> None:
    server = make_server(addr, port, app, _Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="xidflow-metrics", daemon=True).start()
