"""The burst bench's pure helpers."""

from pipeline.benchmarks.burst import cpu_spent, stage_split


def test_cpu_spent_counts_each_process_between_readings_and_leaves_out_a_restarted_one() -> None:
    before = {"bench": (1, 10.0), "worker-0": (2, 3.0), "actuator-0": (3, 5.0)}
    after = {"bench": (1, 10.5), "worker-0": (2, 3.25), "actuator-0": (9, 0.4), "actuator-1": (4, 1.0)}
    # actuator-0 was restarted (another pid): its reading says nothing about the window; actuator-1 was
    # not running at the first reading.
    assert cpu_spent(before, after) == {"bench": 0.5, "worker-0": 0.25}


def test_stage_split_puts_the_wait_for_a_readable_incident_in_the_delivery_share() -> None:
    sent = {"a": 0.0, "b": 0.0}
    incident = {"a": 0.1, "b": 0.1}  # the worker's producer took both at 100 ms...
    delivered = {"a": 0.15, "b": 0.6}  # ...but b was readable only at 600 ms
    tainted = {"a": 1.0, "b": 1.0}
    out = stage_split("burst", sent, incident, tainted, delivered=delivered)
    assert out["burst_worker_p99_ms"] == 100.0
    assert out["burst_delivery_p99_ms"] == 600.0
    assert out["burst_apply_p99_ms"] == 850.0  # a: 1000 - 150
    assert out["burst_apply_p50_ms"] == 400.0  # b: 1000 - 600 (the lower middle of two)
    assert "burst_delivery_p99_ms" not in stage_split("burst", sent, incident, tainted)
