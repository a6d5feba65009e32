"""The bench's cost figures: CPU per quarantined node against the bare client's, the broker's counters (pure)."""

from __future__ import annotations

import pytest

from pipeline.benchmarks import kafkameter
from pipeline.benchmarks.cost import cost_keys, idle_rates, net_of_idle, per_node_ms
from pipeline.benchmarks.pipeline import heartbeat_grace_s, heartbeat_lease_s, largest_fleet


def test_cpu_per_node_counts_every_process_and_compares_totals() -> None:
    pipeline = {"kube-apiserver": 1.0, "kafka": 1.2, "actuator-0": 0.5, "actuator-1": 0.5, "worker-0": 0.3}
    bare = {"kube-apiserver": 1.0, "kafka": 0.1, "bench": 0.5}
    out = cost_keys("burst", 500, pipeline, 4.0, bare, 1.5)
    assert out["burst_cpu_ms_per_node"] == pytest.approx(7.0)
    assert out["burst_raw_cpu_ms_per_node"] == pytest.approx(3.2)
    assert out["burst_cpu_per_node_ratio"] == pytest.approx(7.0 / 3.2, abs=1e-3)
    split = out["burst_cpu_split"]
    assert list(split)[0] == "kafka"  # the largest difference first
    assert split["bench"] == {"pipeline": 0.0, "bare": 1.0}
    assert "total" not in split


def test_net_figures_take_each_process_idle_use_off_its_window() -> None:
    idle = idle_rates({"kafka": 0.2, "worker-0": 0.1}, 2.0)  # per second
    assert idle == {"kafka": 0.1, "worker-0": 0.05}
    assert net_of_idle({"kafka": 1.0, "worker-0": 0.1, "etcd": 0.3}, idle, 4.0) == {
        "kafka": 0.6, "worker-0": 0.0, "etcd": 0.3}
    out = cost_keys("burst", 100, {"kafka": 1.0}, 4.0, {"kafka": 0.5}, 1.0, idle)
    assert out["burst_cpu_per_node_net_ratio"] == pytest.approx(0.6 / 0.4)
    assert per_node_ms({}, 0) == {}
    # The bench's own reading of the API server's counters, one in each window, comes off both.
    read = {"kube-apiserver": 0.2, "bench": 0.1}
    out = cost_keys("burst", 100, {"kube-apiserver": 1.2, "bench": 0.3}, 4.0, {"kube-apiserver": 0.6, "bench": 0.2},
                    1.0, {"kube-apiserver": 0.0}, read)
    assert out["burst_cpu_per_node_net_ms"]["total"] == pytest.approx(12.0)
    assert out["burst_raw_cpu_per_node_net_ms"]["total"] == pytest.approx(5.0)
    assert out["burst_cpu_per_node_ratio"] == pytest.approx(1.5 / 0.8, abs=1e-3)  # the gross figures keep it


def test_broker_counters_per_node_leave_sub_meters_out_of_the_total() -> None:
    before = kafkameter.parse(b'{"requests": {"Produce": 10, "Fetch": 100, "FetchConsumer": 90}, "bytes_in": 1000,'
                              b' "bytes_out": 500, "net_in": 5000, "net_out": 7000}')
    after = kafkameter.parse(b'{"requests": {"Produce": 60, "Fetch": 300, "FetchConsumer": 280, "Heartbeat": 5},'
                             b' "bytes_in": 51000, "bytes_out": 20500, "net_in": 105000, "net_out": 57000}')
    d = kafkameter.delta(before, after, 50)
    assert d["requests"] == {"Fetch": 200, "FetchConsumer": 190, "Heartbeat": 5, "Produce": 50}
    assert d["requests_total"] == 255 and d["requests_per_node"] == pytest.approx(5.1)
    assert d["net_bytes_per_node"] == (100_000 + 50_000) // 50
    assert d["record_bytes_per_node"] == (50_000 + 20_000) // 50


def test_the_bench_control_plane_keeps_lease_renewals_within_what_two_cores_carry() -> None:
    assert heartbeat_lease_s(largest_fleet(["burst"], 500, 500, 10_000), 40) == 41
    assert heartbeat_lease_s(200, 40) == 40  # the kubelet's default for a small fleet
    lease = heartbeat_lease_s(largest_fleet(["scale"], 500, 500, 10_000), 40)
    assert (10_000 + 1_008) / (lease / 4) <= 100
    assert heartbeat_grace_s(lease, 40, 50) == lease + 10


def test_cost_marks_say_where_the_window_went_from_the_watch_and_the_bench_steps() -> None:
    from pipeline.benchmarks.burst import cost_marks
    seen = {"last_tainted": {"a": 101.0, "b": 103.0}, "last_settled": {"a": 105.0, "b": 104.0},
            "last_answered": {"a": 102.0}}  # b not answered yet: no mark
    marks = cost_marks({"lines_sent": 0.4, "taints_seen": 3.2}, seen, ["a", "b"], 100.0)
    assert marks == {"lines_sent": 0.4, "last_tainted": 3.0, "taints_seen": 3.2, "last_settled": 5.0}
    assert list(marks) == sorted(marks, key=marks.__getitem__)  # in the order they came
