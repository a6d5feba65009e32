"""The burst bench's pure helpers."""

from pipeline.benchmarks.burst import cpu_spent


def test_cpu_spent_counts_each_process_between_readings_and_leaves_out_a_restarted_one() -> None:
    before = {"bench": (1, 10.0), "worker-0": (2, 3.0), "actuator-0": (3, 5.0)}
    after = {"bench": (1, 10.5), "worker-0": (2, 3.25), "actuator-0": (9, 0.4), "actuator-1": (4, 1.0)}
    # actuator-0 was restarted (another pid): its reading says nothing about the window; actuator-1 was
    # not running at the first reading.
    assert cpu_spent(before, after) == {"bench": 0.5, "worker-0": 0.25}
