"""What a remediated node costs: every process's CPU per quarantined node, against the bare client's (pure).

A burst's cost window runs from its first kernel line until every node is settled: tainted, its flow's
last write done (an own condition True) and the node lifecycle controller's answer to the cordon on it
(its ``node.kubernetes.io/unschedulable`` taint). The bare client's window runs from its first write
until the controller answered on every one of its nodes: the same cordons, the same answer. Each window
counts every process of the run (``burst.cpu_seconds``: worker, actuators, the bench's own process -
the shipper's producer and the watches, or the bare client itself -, API server, etcd, controller-manager,
scheduler, KWOK, Kafka broker), so work held back until after the last taint, or pushed onto another
process, is still counted.

``burst_cpu_per_node_ratio`` = the pipeline's CPU per node / the bare client's (goal <= 1.5): what a
user pays per remediated node for detection, decision, audit and the Kubernetes writes, against the
writes alone. ``_net`` figures first take off each process's CPU at rest (its idle rate, read just
before, times the window) and the bench's own reading of the API server's counters in each window
(``<prefix>_api_read_cpu_s``, one reading measured at rest): what the remediation itself costs, without the
processes' standing cost or the bench's.
"""

from __future__ import annotations

from typing import Any

NAMES = {"java": "kafka"}
"""Process names as the figures give them (the Kafka broker's command is ``java``)."""


def per_node_ms(cpu: dict[str, float], nodes: int) -> dict[str, float]:
    """Each process's CPU seconds as milliseconds per node, and ``total``. Pure."""
    if not nodes:
        return {}
    out = {k: round(v * 1000 / nodes, 3) for k, v in sorted(cpu.items())}
    out["total"] = round(sum(cpu.values()) * 1000 / nodes, 3)
    return out


def net_of_idle(cpu: dict[str, float], idle_rate: dict[str, float], window_s: float,
                less: dict[str, float] | None = None) -> dict[str, float]:
    """``cpu`` less each process's idle CPU (``idle_rate``, CPU seconds per second) over the window and its
    share of ``less`` (the bench's own reading inside the window); at least 0. A process without an idle
    reading is left as it is. Pure."""
    less = less or {}
    return {k: round(max(0.0, v - idle_rate.get(k, 0.0) * window_s - less.get(k, 0.0)), 3) for k, v in cpu.items()}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def cost_keys(
    prefix: str,
    nodes: int,
    pipeline_cpu: dict[str, float],
    pipeline_window_s: float,
    bare_cpu: dict[str, float],
    bare_window_s: float,
    idle_rate: dict[str, float] | None = None,
    bench_read: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The cost figures of one scenario from its two windows' CPU (process -> seconds). Pure.

    ``<prefix>_cpu_per_node_ms`` / ``_raw_cpu_per_node_ms`` (per process and total), the ratio
    ``<prefix>_cpu_per_node_ratio``, the same net of idle (``_net``), and ``<prefix>_cpu_split``: each
    process's milliseconds per node on both sides, largest first, where the difference lies. ``bench_read``:
    each process's CPU for the bench's one reading of the API server's counters inside each window
    (``burst.api_read_cpu``), taken off both windows in the ``_net`` figures with the idle use.
    """
    pipe, bare = per_node_ms(pipeline_cpu, nodes), per_node_ms(bare_cpu, nodes)
    out: dict[str, Any] = {
        f"{prefix}_cpu_per_node_ms": pipe,
        f"{prefix}_raw_cpu_per_node_ms": bare,
        f"{prefix}_cpu_ms_per_node": pipe.get("total"),
        f"{prefix}_raw_cpu_ms_per_node": bare.get("total"),
        f"{prefix}_cpu_per_node_ratio": ratio(pipe.get("total"), bare.get("total")),
        f"{prefix}_cost_window_s": round(pipeline_window_s, 2),
        f"{prefix}_raw_cost_window_s": round(bare_window_s, 2),
    }
    names = sorted((set(pipe) | set(bare)) - {"total"}, key=lambda k: -(pipe.get(k, 0.0) - bare.get(k, 0.0)))
    out[f"{prefix}_cpu_split"] = {k: {"pipeline": pipe.get(k, 0.0), "bare": bare.get(k, 0.0)}
                                  for k in names}
    if idle_rate:
        pipe_net = per_node_ms(net_of_idle(pipeline_cpu, idle_rate, pipeline_window_s, bench_read), nodes)
        bare_net = per_node_ms(net_of_idle(bare_cpu, idle_rate, bare_window_s, bench_read), nodes)
        out[f"{prefix}_cpu_per_node_net_ms"] = pipe_net
        out[f"{prefix}_raw_cpu_per_node_net_ms"] = bare_net
        out[f"{prefix}_cpu_per_node_net_ratio"] = ratio(pipe_net.get("total"), bare_net.get("total"))
    return out


def idle_rates(idle_cpu: dict[str, float], window_s: float) -> dict[str, float]:
    """CPU seconds per second of each process from a reading over ``window_s`` at rest. Pure."""
    return {k: v / window_s for k, v in idle_cpu.items()} if window_s > 0 else {}
