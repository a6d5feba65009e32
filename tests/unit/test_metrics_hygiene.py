"""Metric hygiene, the pure parts: lag arithmetic, closed label sets, series initialised at start,
per-process registries, and the actuator's fleet gauges computed from node views."""

from __future__ import annotations

import re
from pathlib import Path

from aiokafka import TopicPartition
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.actuator import fleetmetrics
from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import CORDON, LEDGER_ANNOTATION, Ledger, taint_effect_key
from pipeline.kafka.lag import group_lag, partition_lag
from pipeline.runtime import metrics
from schemas.records import Action, DeadLetterCode, FaultKind, Outcome

ROOT = Path(__file__).resolve().parents[2]
T0, T1 = TopicPartition("t", 0), TopicPartition("t", 1)


# -- lag ----------------------------------------------------------------------------------------------
def test_lag_is_end_minus_committed() -> None:
    assert partition_lag([T0, T1], {T0: 40, T1: 100}, {T0: 0, T1: 0}, {T0: 100, T1: 100}) == {T0: 60, T1: 0}


def test_a_partition_never_committed_counts_from_its_first_retained_record() -> None:
    assert partition_lag([T0], {}, {T0: 30}, {T0: 100}) == {T0: 70}
    assert partition_lag([T0], {T0: -1}, {T0: 30}, {T0: 100}) == {T0: 70}  # "no offset" as the broker says it


def test_a_commit_behind_retention_counts_from_the_first_retained_record() -> None:
    assert partition_lag([T0], {T0: 5}, {T0: 30}, {T0: 100}) == {T0: 70}


def test_lag_is_never_negative_and_unknown_ends_are_left_out() -> None:
    assert partition_lag([T0, T1], {T0: 120}, {}, {T0: 100}) == {T0: 0}


def test_group_lag_covers_only_the_groups_topics() -> None:
    parts = {"a": [0, 1], "b": [0], "other": [0]}
    a0, a1, b0, o0 = (TopicPartition(*x) for x in (("a", 0), ("a", 1), ("b", 0), ("other", 0)))
    ends = {a0: 10, a1: 20, b0: 5, o0: 1000}
    lag = group_lag(["a", "b", "missing"], parts, {a0: 10, a1: 15}, {}, ends)
    assert lag == {("a", 0): 0, ("a", 1): 5, ("b", 0): 5}


# -- label sets ---------------------------------------------------------------------------------------
ALLOWED_LABELS = {"source", "kind", "stage", "reason", "action", "outcome", "group", "topic", "partition",
                  "webhook", "result"}
"""Label names whose values are closed sets (see each metric's docs); ``node`` and free text never appear."""

DECL = re.compile(r"\b(Counter|Gauge|Histogram|Summary)\(\s*\"(xidflow_[a-z0-9_]+)\"")


def test_every_metric_is_defined_in_pipeline_metrics_unregistered() -> None:
    """One place: no other module defines a metric (it would land in prometheus-client's global registry)."""
    elsewhere = []
    for path in [*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "agents").rglob("*.py")]:
        if path.name == "metrics.py" and path.parent.name == "runtime":
            continue
        elsewhere += [f"{path.relative_to(ROOT)}: {m[1]}" for m in DECL.findall(path.read_text())]
    assert not elsewhere
    import pipeline.actuator.app  # noqa: F401 - everything an actuator imports
    import pipeline.app  # noqa: F401 - everything a worker imports

    global_names = {n for names in REGISTRY._collector_to_names.values() for n in names}
    assert not [n for n in global_names if n.startswith("xidflow_")]


def _all_metrics() -> list:
    return [m for m in vars(metrics).values() if hasattr(m, "_labelnames") and hasattr(m, "_type")]


def test_label_names_are_closed_sets_and_every_metric_belongs_to_a_process() -> None:
    exported = {m for ms in metrics.COMPONENT_METRICS.values() for m in ms}
    for metric in _all_metrics():
        assert set(metric._labelnames) <= ALLOWED_LABELS, metric._name
        assert metric in exported, f"{metric._name} is exported by no process"


def test_worker_label_values_cover_every_enum_value() -> None:
    values = metrics.worker_label_values(["gpu.logs.kernel", "gpu.logs.pods", "gpu.logs.kernel"])
    assert values[metrics.LINES_IN] == [("gpu.logs.kernel",), ("gpu.logs.pods",)]
    assert {v for (v,) in values[metrics.FAULT_EVENTS]} == {k.value for k in FaultKind}
    assert {v for (v,) in values[metrics.INCIDENTS]} == {a.value for a in Action}
    assert {v for (v,) in values[metrics.RECOVERIES]} == {"reboot", "quiet", "manual", "cancelled"}
    assert set(values[metrics.DEADLETTERS]) == {
        (s, c.value) for s in ("adapter", "parse", "aggregate") for c in DeadLetterCode
    }


def test_remediation_action_label_is_bounded() -> None:
    assert fleetmetrics.remediation_action("drain#2") == "drain"
    assert fleetmetrics.remediation_action("cordon") == "cordon"
    assert fleetmetrics.remediation_action("breaker-trip") == "breaker-trip"
    assert fleetmetrics.remediation_action("gpu-node-0042") == "other"
    assert fleetmetrics.remediation_action("drain#2; rm -rf") == "drain"
    assert metrics.bounded("anything at all", {"a"}) == metrics.OTHER


def test_actuator_label_values_cover_every_action_and_outcome() -> None:
    values = fleetmetrics.label_values(["pager"])
    combos = set(values[metrics.REMEDIATIONS])
    for action in ("cordon", "taint", "drain", "reboot", "resetGpu", "decide", "undo", "other"):
        assert {(action, o.value) for o in Outcome} <= combos
    assert ("drain",) in values[metrics.FLOW_STEP_AGE] and ("quarantine",) not in values[metrics.FLOW_STEP_AGE]
    assert set(values[metrics.NOTIFICATIONS]) == {("pager", r) for r in ("delivered", "failed", "dropped")}


# -- per-process registries ---------------------------------------------------------------------------
def _series(registry) -> dict[tuple[str, tuple], float]:  # noqa: ANN001
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_each_process_registry_holds_only_its_own_metrics() -> None:
    worker = {n for n, _ in _series(metrics.build_registry(metrics.WORKER)) if n.startswith("xidflow_")}
    actuator = {n for n, _ in _series(metrics.build_registry(metrics.ACTUATOR)) if n.startswith("xidflow_")}
    assert "xidflow_remediations_total" not in worker and "xidflow_quarantined_nodes" not in worker
    assert "xidflow_lines_total" not in actuator and "xidflow_fault_events_total" not in actuator
    # Both export xidflow_deadletters_total, each from its own counter: only its own stages.
    metrics.initialise({metrics.DEADLETTERS: metrics.worker_label_values([])[metrics.DEADLETTERS]})
    metrics.initialise({metrics.ACTUATOR_DEADLETTERS: fleetmetrics.label_values()[metrics.ACTUATOR_DEADLETTERS]})
    stages = {dict(labels)["stage"] for n, labels in _series(metrics.build_registry(metrics.ACTUATOR))
              if n == "xidflow_deadletters_total"}
    assert stages == {"actuator"}
    probe = _series(metrics.build_registry(metrics.PROBE))
    assert not [n for n, _ in probe if n.startswith("xidflow_")]
    assert any(n.startswith("process_") for n, _ in probe)


def test_counters_exist_at_zero_before_anything_happens() -> None:
    reg = metrics.build_registry(metrics.WORKER, metrics.worker_label_values(["k.topic"]))
    series = _series(reg)
    assert series[("xidflow_lines_total", (("source", "k.topic"),))] == 0
    assert ("xidflow_deadletters_total", (("reason", "unknown_shape"), ("stage", "parse"))) in series
    assert ("xidflow_incidents_total", (("action", "CONTACT_SUPPORT"),)) in series
    assert not [n for n, _ in series if n.endswith("_created")]
    act = _series(metrics.build_registry(metrics.ACTUATOR, fleetmetrics.label_values()))
    assert ("xidflow_remediations_total", (("action", "drain"), ("outcome", "failed"))) in act
    assert ("xidflow_flow_oldest_step_age_seconds", (("action", "reboot"),)) in act


# -- fleet gauges -------------------------------------------------------------------------------------
def view(name: str, ledger: Ledger, unschedulable: bool = False, taints: tuple = ()) -> NodeView:
    return NodeView(name=name, labels={}, annotations={LEDGER_ANNOTATION: ledger.to_annotation()},
                    unschedulable=unschedulable, taints=taints, ready=True, boot_id="b", resource_version="1")


def flow(ledger: Ledger, key: str, steps: list[dict], at: float) -> None:
    ledger.open_flow(key, {"rec": {}, "rule": "r", "esc": False, "steps": steps}, at)


def test_open_step_age_runs_from_the_previous_step_and_its_wait() -> None:
    ledger = Ledger()
    flow(ledger, "inc-1", [{"name": "cordon", "waittime": 60}, {"name": "drain", "timeout": 600},
                           {"name": "reboot"}], at=1000)
    ledger.mark_done("inc-1", "cordon", 1010)
    (step,) = fleetmetrics.open_steps(view("n1", ledger), now=2000)
    assert (step.action, step.age_s, step.timeout_s) == ("drain", 2000 - 1070, 600)
    ledger.mark_done("inc-1", "drain", 1500)
    (step,) = fleetmetrics.open_steps(view("n1", ledger), now=2000)
    assert (step.action, step.age_s, step.timeout_s) == ("reboot", 500, fleetmetrics.DEFAULT_STEP_TIMEOUTS["reboot"])


def test_repeated_actions_use_the_plans_step_keys_and_finished_flows_are_not_open() -> None:
    ledger = Ledger()
    flow(ledger, "f", [{"name": "event"}, {"name": "event"}], at=100)
    ledger.mark_done("f", "event", 110)
    (step,) = fleetmetrics.open_steps(view("n", ledger), now=200)
    assert (step.action, step.age_s, step.timeout_s) == ("event", 90, fleetmetrics.STEP_TIMEOUT_S)
    ledger.finish("f", "done", 120)
    assert fleetmetrics.open_steps(view("n", ledger), now=200) == []


def test_fleet_figures_count_xidflow_quarantines_only_and_the_oldest_step_per_action() -> None:
    ours = Ledger()
    ours.own(CORDON, "a")
    human = view("human-cordon", Ledger(), unschedulable=True)
    cordoned = view("ours-cordon", ours, unschedulable=True)
    tainted_ledger = Ledger()
    tainted_ledger.own(taint_effect_key("nvidia.com/gpu-fault", "NoSchedule"), "b")
    tainted = view("ours-taint", tainted_ledger,
                   taints=({"key": "nvidia.com/gpu-fault", "effect": "NoSchedule"},))
    gone = view("uncordoned-by-person", ours, unschedulable=False)  # ledger says ours, node says not cordoned
    d1, d2 = Ledger(), Ledger()
    flow(d1, "x", [{"name": "drain"}], at=100)
    flow(d2, "y", [{"name": "drain"}], at=50)
    figures = fleetmetrics.fleet_figures([human, cordoned, tainted, gone, view("d1", d1), view("d2", d2)], now=400)
    assert figures.gpu_nodes == 6
    assert figures.quarantined == {"ours-cordon", "ours-taint"}
    assert figures.oldest["drain"].node == "d2" and figures.oldest["drain"].age_s == 350
    assert figures.open_steps == {"drain": 2}
    # The reconciler counted the fleet already: only the nodes with open flows are walked, same figures.
    counted = fleetmetrics.fleet_figures([view("d1", d1), view("d2", d2)], now=400, fleet=(6, figures.quarantined))
    assert counted == figures


def test_breaker_window_counts_quarantined_and_admitted_within_the_window_once() -> None:
    state = {"admitted": {"a": 900.0, "b": 100.0, "c": 950.0}}
    counted, share = fleetmetrics.breaker_window(state, frozenset({"c", "d"}), fleet=8, window=300, now=1000)
    assert (counted, share) == (3, 3 / 8)  # a (in window), c (both), d (quarantined); b fell out
    assert fleetmetrics.breaker_window({}, frozenset(), fleet=0, window=300, now=0) == (0, 0)


def test_use_keeps_one_registry_per_component_and_adds_label_values() -> None:
    first = metrics.use(metrics.WORKER)
    again = metrics.use(metrics.WORKER, {metrics.LINES_IN: [("late.topic",)]})
    assert again is first and metrics.registry() is first
    assert ("xidflow_lines_total", (("source", "late.topic"),)) in _series(first)
    other = metrics.use(metrics.ACTUATOR)  # a later command in the same process (tests) serves its own set
    assert other is not first and metrics.registry() is other
