"""The scale bench's pure parts: /proc parsing, CPU windows, the fleet's Node objects, the burst order, the ratios."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.testing import node_object
from pipeline.benchmarks import procstat
from pipeline.benchmarks.procstat import ProcSample
from pipeline.benchmarks.scale import burst_order, infra_pids, ratios, rebalance_marks, summarize_bursts

STATUS = "Name:\tpython\nVmPeak:\t  900000 kB\nVmHWM:\t  412345 kB\nVmRSS:\t  398000 kB\nThreads:\t12\n"
# comm with a space and a parenthesis; utime 250, stime 50 (fields 14, 15)
STAT = "4242 (py (x) thing) S 1 4242 4242 0 -1 4194560 9000 0 0 0 250 50 0 0 20 0 12 0 100 900000 99500"


def test_status_and_stat_are_parsed_past_a_command_name_with_spaces() -> None:
    assert procstat.parse_status(STATUS) == (398000, 412345)
    assert procstat.parse_stat_cpu(STAT, 100) == 3.0


def test_this_process_can_be_read() -> None:
    sample = procstat.read(os.getpid())
    assert sample.rss_kb > 0 and sample.hwm_kb >= sample.rss_kb and sample.cpu_s > 0


def test_cpu_windows_and_usage() -> None:
    # 0.1 s samples: idle, then one busy second (a resync), then idle again.
    cpu = 0.0
    samples = []
    for i in range(31):
        samples.append(ProcSample(at=i * 0.1, rss_kb=1024 * (100 + i), hwm_kb=1024 * 200, cpu_s=cpu))
        cpu += 0.08 if 10 <= i < 20 else 0.001
    windows = procstat.cpu_windows(samples, 1.0)
    assert len(windows) == 3 and round(windows[1]) == 80
    use = procstat.usage(samples)
    assert use.cpu_max_pct == 80.0 and use.cpu_median_pct == 1.0
    assert use.rss_mb == 130.0 and use.hwm_mb == 200.0


def test_fleet_nodes_are_registered_as_kwok_nodes_with_gpus() -> None:
    obj = node_object("gpu-1", {"xidflow.bench/burst": "t"}, boot_id="b-7", gpu=True)
    labels = obj["metadata"]["labels"]
    assert labels["nvidia.com/gpu.present"] == "true" and labels["xidflow.bench/burst"] == "t"
    assert labels["kwok.x-k8s.io/node"] == "fake"  # KWOK is their kubelet: it makes them Ready
    assert obj["status"]["capacity"]["nvidia.com/gpu"] == "8"
    view = NodeView.from_object(obj)
    assert not view.ready and view.boot_id == "b-7"
    plain = node_object("n", {"a": "b"})
    assert plain["metadata"]["labels"] == {"kubernetes.io/hostname": "n", "kwok.x-k8s.io/node": "fake", "a": "b"}
    assert "capacity" not in plain["status"]


def test_ratios_compare_each_pair_of_bursts_and_say_how_costs_grow_per_node() -> None:
    r = ratios({
        "scale_fleet": 10_004, "scale_base_fleet": 504,
        "scale_burst_p99_ms_rounds": [3300.0, 2000.0, 9000.0],
        "scale_base_burst_p99_ms_rounds": [3000.0, 2500.0, 3000.0],
        "scale_burst_p99_ms": 3300.0, "scale_raw_burst_ms": 3000.0,
        "scale_base_burst_p99_ms": 3000.0, "scale_base_raw_burst_ms": 2000.0,
        "scale_steady_s": 60.0, "scale_base_steady_s": 3.0,
    })
    # The median pair, not the one burst that met a disturbance (9000 / 3000).
    assert r["scale_burst_vs_base_pair_ratios"] == [1.1, 0.8, 3.0]
    assert r["scale_burst_vs_base_ratio"] == 1.1 and r["scale_burst_vs_base_medians_ratio"] == 1.1
    assert r["scale_burst_vs_raw_ratio"] == 1.1 and r["scale_base_burst_vs_raw_ratio"] == 1.5
    assert r["scale_burst_vs_base_raw_normalized"] == round(1.1 / 1.5, 3)
    assert r["scale_steady_s_growth_per_node"] == round(20.0 / round(10_004 / 504, 3), 3)
    assert r["scale_status_s_growth_per_node"] is None
    assert ratios({"scale_burst_p99_ms": 1.0})["scale_burst_vs_base_ratio"] is None
    together = ratios({"scale_together_burst_p99_ms_rounds": [1200.0, 1000.0],
                       "scale_base_together_burst_p99_ms_rounds": [1000.0, 1000.0]})
    assert together["scale_burst_vs_base_together_pair_ratios"] == [1.2, 1.0]
    assert together["scale_burst_vs_base_together_ratio"] == 1.1 and together["scale_burst_vs_base_ratio"] is None
    assert ratios({"scale_burst_p99_ms_rounds": [1.0], "scale_base_burst_p99_ms_rounds": [None]})[
        "scale_burst_vs_base_pair_ratios"] == [None]


def test_bursts_take_turns_with_the_order_flipped_every_pair() -> None:
    assert burst_order(3) == ["scale_base", "scale", "scale", "scale_base", "scale_base", "scale"]
    assert burst_order(0) == []
    order = burst_order(4)
    # Every pair holds one burst of each world, and each world goes first in half the pairs.
    pairs = [order[i:i + 2] for i in range(0, len(order), 2)]
    assert all(sorted(p) == ["scale", "scale_base"] for p in pairs)
    assert sum(p[0] == "scale" for p in pairs) == 2


def test_a_worlds_bursts_are_summarized_by_their_medians() -> None:
    bursts = [
        {"burst_p99_ms": 900.0, "burst_apply_p99_ms": 700.0, "burst_samples": 500, "burst_missing": 0,
         "burst_over_5s": 0, "unsettled": 0, "rebalances": 1, "cpu_s": {"actuator-0": 0.5, "etcd": 0.1}},
        {"burst_p99_ms": 5000.0, "burst_samples": 499, "burst_missing": 1, "burst_over_5s": 1,
         "unsettled": 2, "rebalances": 0, "cpu_s": {"actuator-0": 0.7}},
        {"burst_p99_ms": 1000.0, "burst_apply_p99_ms": 800.0, "burst_samples": 500, "burst_missing": 0,
         "burst_over_5s": 0, "unsettled": 0, "rebalances": 0, "cpu_s": {"actuator-0": 0.6, "etcd": 0.3}},
    ]
    out = summarize_bursts("scale", bursts)
    assert out["scale_burst_p99_ms"] == 1000.0 and out["scale_burst_p99_ms_rounds"] == [900.0, 5000.0, 1000.0]
    assert out["scale_burst_apply_p99_ms"] == 750.0  # the bursts that have the figure
    assert out["scale_burst_samples"] == 1499 and out["scale_burst_missing"] == 1
    assert out["scale_burst_over_5s"] == 1 and out["scale_burst_unsettled"] == 2 and out["scale_burst_rebalances"] == 1
    assert out["scale_burst_cpu_s"] == {"actuator-0": 0.6, "etcd": 0.2}


def test_rebalance_marks_count_what_aiokafka_logs_when_the_group_moves() -> None:
    log = (
        b"2026-11-25 11:16:01,281 WARNING xidflow.signing: XIDFLOW_SIGNING_KEY_FILE is not set\n"
        b"2026-11-25 11:16:02,852 WARNING aiokafka.consumer.group_coordinator: Heartbeat failed for group g"
        b" because it is rebalancing\n"
        b"2026-11-25 11:17:02,000 WARNING aiokafka.consumer.group_coordinator: Heartbeat failed: local member_id"
        b" was not recognized; resetting and re-joining group\n"
        b"2026-11-25 11:17:03,000 ERROR aiokafka.consumer.group_coordinator: Heartbeat session expired - marking"
        b" coordinator dead\n"
    )
    assert rebalance_marks(log) == 3
    assert rebalance_marks(b"") == 0


def test_infra_processes_are_found_by_the_run_directory_in_their_command_line(tmp_path: Path) -> None:
    run = tmp_path / "xidflow-bench-x"
    (run / "controlplane").mkdir(parents=True)
    proc = subprocess.Popen(["sh", "-c", f"sleep 30 # --data-dir={run}/controlplane/etcd"])
    try:
        # Until the child has exec'd, its command line is still this process's.
        deadline = time.monotonic() + 10
        while (found := infra_pids(str(run / "controlplane" / "kubeconfig"))) != {"sh": proc.pid}:
            assert time.monotonic() < deadline, found
            time.sleep(0.05)
        assert infra_pids(str(tmp_path / "elsewhere" / "controlplane" / "kubeconfig")) == {}
    finally:
        proc.kill()
        proc.wait()
