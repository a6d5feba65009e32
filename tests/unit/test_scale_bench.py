"""The scale bench's pure parts: /proc parsing, CPU windows, the fleet's Node objects, the ratios."""

from __future__ import annotations

import os

from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.testing import node_object
from pipeline.benchmarks import procstat
from pipeline.benchmarks.procstat import ProcSample
from pipeline.benchmarks.scale import ratios, rebalance_marks

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


def test_fleet_nodes_are_registered_as_a_kubelet_would_with_gpus() -> None:
    obj = node_object("gpu-1", {"xidflow.bench/burst": "t"}, boot_id="b-7", gpu=True)
    labels = obj["metadata"]["labels"]
    assert labels["nvidia.com/gpu.present"] == "true" and labels["xidflow.bench/burst"] == "t"
    assert obj["status"]["capacity"]["nvidia.com/gpu"] == "8"
    view = NodeView.from_object(obj)
    assert view.ready and view.boot_id == "b-7"
    plain = node_object("n", {"a": "b"})
    assert plain["metadata"]["labels"] == {"a": "b"} and "capacity" not in plain["status"]


def test_ratios_say_how_costs_grow_per_node() -> None:
    r = ratios({
        "scale_fleet": 10_004, "scale_base_fleet": 504,
        "scale_burst_p99_ms": 3300.0, "scale_raw_burst_ms": 3000.0,
        "scale_base_burst_p99_ms": 2000.0, "scale_base2_burst_p99_ms": 4000.0,
        "scale_base_raw_burst_ms": 1000.0, "scale_base2_raw_burst_ms": 4000.0,
        "scale_steady_s": 60.0, "scale_base_steady_s": 3.0,
    })
    assert r["scale_burst_vs_base_ratio"] == 1.1 and r["scale_burst_vs_raw_ratio"] == 1.1
    assert r["scale_base_burst_vs_raw_ratio"] == 1.5 and r["scale_burst_vs_base_raw_normalized"] == round(1.1 / 1.5, 3)
    assert r["scale_steady_s_growth_per_node"] == round(20.0 / round(10_004 / 504, 3), 3)
    assert r["scale_status_s_growth_per_node"] is None
    assert ratios({"scale_burst_p99_ms": 1.0})["scale_burst_vs_base_ratio"] is None


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
