"""The burst bench's pure helpers."""

from pipeline.benchmarks.burst import cpu_spent, stage_split
from pipeline.benchmarks.burst_floor import floor_figures
from pipeline.benchmarks.burst_watch import GroupSample, first_unsettled, takeover_split, unsettled_windows


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


def _looks(group: str, *looks: tuple[float, str, str]) -> list[GroupSample]:
    """(at, state, holders separated by commas) -> the GroupWatch's samples of one group."""
    return [GroupSample(at, group, state, frozenset(h for h in holders.split(",") if h))
            for at, state, holders in looks]


def test_unsettled_windows_span_each_rebalance_from_first_unsettled_look_to_stable_again() -> None:
    samples = [
        *_looks("act", (0.0, "Stable", "a,b"), (1.0, "PreparingRebalance", "a,b"), (1.2, "CompletingRebalance", ""),
                (1.3, "Stable", "a"), (5.0, "PreparingRebalance", "a"), (5.4, "Stable", "a,b"),
                (9.0, "PreparingRebalance", "a")),
        *_looks("work", (0.5, "Stable", "w"), (0.7, "PreparingRebalance", "w"), (0.8, "Stable", "w")),
    ]
    windows = unsettled_windows(samples)
    assert [(g, b, e) for g, b, e in windows] == [("work", 0.7, 0.8), ("act", 1.0, 1.3), ("act", 5.0, 5.4)]
    # the rebalance still open at the last look (act at 9.0) is not a window


def test_takeover_split_waits_for_every_group_of_the_lost_member() -> None:
    samples = [
        *_looks("w", (9.0, "Stable", "w0,w1"), (20.0, "Stable", "w0,w1"), (20.4, "PreparingRebalance", "w0,w1"),
                (20.7, "Stable", "w0")),
        *_looks("w-parse", (20.0, "Stable", "w0,w1"), (20.9, "PreparingRebalance", "w0"),
                (21.5, "CompletingRebalance", ""), (21.6, "Stable", "w0")),
    ]
    split = takeover_split(samples, "w1", killed_at=10.0)
    assert split == {"expired_s": 10.9, "rebalanced_s": 11.6}
    # a group the looks never saw settle without the lost member says nothing
    assert takeover_split(samples[:3], "w1", killed_at=10.0) == {}


def test_first_unsettled_is_the_first_rebalance_of_the_members_groups_after_its_signal() -> None:
    samples = [*_looks("w", (1.0, "PreparingRebalance", "w0"), (2.0, "Stable", "w0"),
                       (3.5, "PreparingRebalance", "w0")),
               *_looks("act", (2.5, "PreparingRebalance", "a0"))]
    assert first_unsettled(samples, ["w", "w-parse"], after=1.5) == 3.5  # not act's, not the one before
    assert first_unsettled(samples, ["w"], after=4.0) is None
    # a leave whose rebalance fell between two looks: the member is gone from the holders all the same
    quick = _looks("w", (1.0, "Stable", "w0,w1"), (1.2, "Stable", "w1"), (1.4, "PreparingRebalance", "w0,w1"))
    assert first_unsettled(quick, ["w"], after=0.5, member="w0") == 1.2
    assert first_unsettled(quick, ["w"], after=0.5) == 1.4


def test_storm_calls_are_split_at_the_last_taint() -> None:
    from pipeline.benchmarks.storm import calls_by_phase

    timeline = [(0.5, "list_node"), (1.0, "patch_node"), (1.5, "patch_node"), (2.0, "replace_namespaced_config_map"),
                (2.5, "patch_node_status"), (3.0, "create_namespaced_event")]
    phases = calls_by_phase(timeline, start=1.0, last_taint=2.0, nodes=2)
    assert phases == {
        "during": {"patch_node": 1.0, "replace_namespaced_config_map": 0.5},  # before the clock: not counted
        "after": {"patch_node_status": 0.5, "create_namespaced_event": 0.5},
    }


def test_floor_figures_time_line_to_taint_against_the_bare_client_and_count_a_missing_taint() -> None:
    sent = {f"n{i}": 10.0 for i in range(100)}
    tainted = {f"n{i}": 10.0 + (i + 1) / 100 for i in range(99)}  # 10 ms .. 990 ms; n99 never tainted
    out = floor_figures("burst", sent, tainted, {"floor": 0.5}, raw_ms=500.0)
    assert out["burst_floor_samples"] == 99 and out["burst_floor_missing"] == 1
    assert out["burst_floor_over_5s"] == 1  # a lost line is as slow as any
    assert out["burst_floor_p99_ms"] == 980.0
    assert out["burst_floor_vs_raw_ratio"] == 1.96  # 980 / 500
    assert out["burst_floor_cpu_s"] == {"floor": 0.5}
    assert "burst_floor_vs_raw_ratio" not in floor_figures("burst", sent, tainted, {}, raw_ms=None)


def test_the_bare_clients_alike_nodes_copy_the_fleets_shape_without_its_selector() -> None:
    from pipeline.benchmarks.burst import alike, node_bytes

    template = {
        "metadata": {
            "name": "bx-00000", "resourceVersion": "7", "uid": "u",
            "labels": {"xidflow.bench/burst": "x", "nvidia.com/gpu.count": "8", "kubernetes.io/hostname": "bx-00000"},
            "annotations": {"a": "b"}, "managedFields": [{"manager": "m"}],
        },
        "spec": {},
        "status": {"conditions": [{"type": "GpuXid", "status": "False"}], "capacity": {"nvidia.com/gpu": "8"},
                   "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}}},
    }
    node = alike(template, "raw-1", {"xidflow.bench/burst-raw": "x"}, "xidflow.bench/burst=x")
    # Not the actuators' (no selector label), its own hostname, no identity of the template's.
    assert node["metadata"] == {"name": "raw-1", "labels": {
        "nvidia.com/gpu.count": "8", "kubernetes.io/hostname": "raw-1", "xidflow.bench/burst-raw": "x"}}
    assert node["status"] == {"conditions": [{"type": "GpuXid", "status": "False"}],
                              "capacity": {"nvidia.com/gpu": "8"}}
    sizes = node_bytes(template)
    assert sizes["managedFields"] == len('[{"manager":"m"}]')
    assert sizes["total"] > sizes["labels"] + sizes["conditions"]
