"""The replay core: a history of raw records in, what a policy would have done out (no Kafka, no cluster)."""

from __future__ import annotations

import socket
from collections.abc import Iterable

import orjson
import pytest
from click.testing import CliRunner

from pipeline.actuator.policy import PolicySet, load_yaml_text
from pipeline.actuator.settings import ActuatorSettings
from pipeline.cli import cli
from pipeline.replay.config import ReplayConfig
from pipeline.replay.outcome import Simulation
from pipeline.replay.report import node_rows, part_rows, trip_rows
from pipeline.replay.report import report as full_report
from pipeline.replay.run import simulate
from pipeline.replay.window import RawLog, Window, WindowError, make_window, merged, parse_bound

T0 = 1_790_000_000.0  # a fixed "now" (2026-09-21): record time is the clock, not the wall clock
X79 = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
X48 = ("NVRM: Xid (PCI:0000:1b:00): 48, pid=1234, name=python3, An uncorrectable double bit error (DBE) has "
       "been detected")
X13 = ("NVRM: Xid (PCI:0000:1b:00): 13, pid=48213, name=python3, Graphics Exception: ESR 0x504648=0x1000a "
       "(GPC 3, TPC 1, SM 0)")

CANDIDATE = """
apiVersion: xidflow.dev/v1alpha1
kind: RescuePolicy
metadata: {name: candidate}
spec:
  rules:
    - name: lost-gpu-reboot
      priority: 100
      codes: [79]
      actions:
        - name: quarantine
        - name: drain
        - name: reboot
          hook: annotation
    - name: dbe-reset
      priority: 90
      codes: [48]
      actions:
        - name: quarantine
        - name: resetGpu
"""


class Log:
    """Raw records as Fluent Bit's kmsg input ships them, keyed by node, with an offset per partition."""

    def __init__(self) -> None:
        self.records: list[RawLog] = []

    def kmsg(self, node: str, line: str, ts: float, repeat: int = 1) -> None:
        for i in range(repeat):
            at = ts + i * 0.001
            value = orjson.dumps({"priority": 3, "sec": 1, "usec": 0, "msg": line, "@timestamp": at})
            self.records.append(RawLog("gpu.logs.kernel", 0, len(self.records), node.encode(), value,
                                            int(at * 1000)))

    def health(self, node: str, boot_id: str, ts: float) -> None:
        from datetime import UTC, datetime

        from schemas.records import HealthCheckResult

        value = HealthCheckResult(node=node, check="gpu_count", passed=True, message="ok", boot_id=boot_id,
                                  ts=datetime.fromtimestamp(ts, UTC)).to_bytes()
        self.records.append(RawLog("gpu.health.checks", 0, len(self.records), node.encode(), value,
                                        int(ts * 1000)))

    def noise(self, node: str, ts: float) -> None:
        value = orjson.dumps({"priority": 6, "sec": 1, "usec": 0, "msg": "eth0: link up", "@timestamp": ts})
        self.records.append(RawLog("gpu.logs.kernel", 0, len(self.records), node.encode(), value, int(ts * 1000)))


def run(records: Iterable[RawLog], policies: PolicySet, since: float = T0 - 7 * 86400, until: float = T0,
        **config: object) -> Simulation:
    cfg = ReplayConfig(policies=policies, **config)  # type: ignore[arg-type]
    return simulate(sorted(records, key=lambda r: r.timestamp), cfg, Window(since, until))


def report(cand: Simulation, base: Simulation) -> dict:
    return full_report(cand, base, window=Window(T0 - 86400, T0), policy="candidate.yaml",
                       baseline_source="built-in", catalog="in force", topics=["gpu.logs.kernel"])


def test_quarantines_per_action_counts_and_the_diff_against_the_default() -> None:
    log = Log()
    log.kmsg("node-a", X79, T0 - 3600, repeat=200)  # a storm of one fault: one incident
    log.kmsg("node-b", X48, T0 - 1800)
    log.kmsg("node-c", X13, T0 - 900)  # an application Xid: one Warning Event, no quarantine
    log.noise("node-c", T0 - 800)
    candidate = load_yaml_text(CANDIDATE)
    cand = run(log.records, candidate, fleet_size=10)
    base = run(log.records, PolicySet(), fleet_size=10)
    rep = report(cand, base)

    nodes = {r["node"]: r for r in rep["nodes"]}
    assert nodes["node-a"]["quarantined"] and nodes["node-b"]["quarantined"] and not nodes["node-c"]["quarantined"]
    assert nodes["node-a"]["actions"] == ["cordon", "taint", "condition", "event", "notifyWorkload", "drain", "reboot"]
    assert nodes["node-a"]["rules"] == ["lost-gpu-reboot"] and nodes["node-a"]["gpus"] == ["0000:4e:00.0"]
    assert nodes["node-b"]["actions"] == ["cordon", "taint", "condition", "event", "notifyWorkload", "resetGpu"]
    assert nodes["node-c"]["actions"] == ["event"]
    assert nodes["node-a"]["incidents"] == 1  # 200 lines within the debounce window are one burst

    counts = {r["action"]: r for r in rep["actions"]}
    assert counts["cordon"]["applied"] == 2 and counts["cordon"]["nodes"] == 2
    assert counts["event"]["nodes"] == 3 and counts["reboot"]["nodes"] == 1 and counts["resetGpu"]["nodes"] == 1

    diff = {(r["node"], r["action"]): r["change"] for r in rep["diff"]}
    assert diff == {("node-a", "drain"): "added", ("node-a", "reboot"): "added", ("node-b", "resetGpu"): "added"}
    row = next(r for r in rep["diff"] if r["action"] == "reboot")
    assert row["candidate_rules"] == ["lost-gpu-reboot"] and row["baseline_rules"] == ["global-default"]
    assert rep["breaker_trips"] == []
    assert cand.records == len(log.records) and cand.incidents >= 3


def test_a_storm_trips_the_breaker_and_says_when_and_how_many_nodes_were_refused() -> None:
    log = Log()
    for i in range(6):
        log.kmsg(f"node-{i}", X79, T0 - 600 + i)
    settings = ActuatorSettings(breaker_max_share=0.5, breaker_window_seconds=300)
    cand = run(log.records, load_yaml_text(CANDIDATE), fleet_size=4, actuator=settings)
    assert len(cand.trips) == 1
    trip = cand.trips[0]
    assert trip.tripped_by == "node-2" and trip.at == pytest.approx(T0 - 598, abs=0.01)
    assert trip.refused == ["node-2", "node-3", "node-4", "node-5"] and trip.refusals == 4
    quarantined = {t.node for t in cand.taken if t.quarantining}
    assert quarantined == {"node-0", "node-1"}
    # A refused node still gets what runs while the breaker is open (the Event, telling the pods), nothing else.
    assert {t.action for t in cand.taken if t.node == "node-5"} == {"event", "notifyWorkload"}
    rows = trip_rows(cand, "candidate")
    assert rows[0]["nodes_refused"] == 4 and "2 of 4" not in rows[0]["reason"] and "limit 50%" in rows[0]["reason"]


def test_breaker_window_is_record_time_nodes_quarantined_long_ago_still_count() -> None:
    log = Log()
    log.kmsg("node-0", X79, T0 - 7200)
    log.kmsg("node-1", X79, T0 - 3600)  # 2 of 4: at the limit, admitted
    log.kmsg("node-2", X79, T0 - 60)  # 3 of 4: node-0 and node-1 are still quarantined
    settings = ActuatorSettings(breaker_max_share=0.5, breaker_window_seconds=300)
    sim = run(log.records, PolicySet(), fleet_size=4, actuator=settings)
    assert [t.tripped_by for t in sim.trips] == ["node-2"]


def test_since_excludes_older_records_and_until_newer_ones() -> None:
    log = Log()
    log.kmsg("old-node", X79, T0 - 3 * 86400)
    log.kmsg("node-a", X79, T0 - 3600)
    log.kmsg("late-node", X79, T0 + 60)
    sim = run(log.records, PolicySet(), since=T0 - 86400, until=T0)
    assert {t.node for t in sim.taken} == {"node-a"}
    assert sim.records == 1 and sim.outside_window == 2

    now = T0
    assert make_window("7d", None, now) == Window(now - 7 * 86400, now)
    assert make_window("2026-09-21T00:00:00Z", "1h", now).until == now - 3600
    assert parse_bound("2026-09-21T00:00:00", now) == parse_bound("2026-09-21T00:00:00+00:00", now)
    for bad in ("7 days", "-3d", "yesterday", ""):
        with pytest.raises(WindowError):
            make_window(bad, None, now)
    with pytest.raises(WindowError, match="not after"):
        make_window("1h", "2h", now)


def test_records_of_several_partitions_are_merged_in_time_order_each_keeping_its_own() -> None:
    a = [RawLog("t", 0, i, b"n", b"x", ts) for i, ts in enumerate((1, 5, 9))]
    b = [RawLog("t", 1, i, b"m", b"x", ts) for i, ts in enumerate((2, 3, 10))]
    assert [(r.partition, r.offset) for r in merged([a, b])] == [(0, 0), (1, 0), (1, 1), (0, 1), (0, 2), (1, 2)]


def test_node_selectors_and_opt_out_read_the_fleet_labels() -> None:
    policy = load_yaml_text("""
apiVersion: xidflow.dev/v1alpha1
kind: RescuePolicy
metadata: {name: pools}
spec:
  rules:
    - name: pool-a-reboot
      priority: 50
      nodeSelector: {labels: {pool: a}}
      actions: [{name: quarantine}, {name: reboot, hook: annotation}]
""")
    log = Log()
    log.kmsg("in-a", X79, T0 - 100)
    log.kmsg("in-b", X79, T0 - 90)
    log.kmsg("opted-out", X79, T0 - 80)
    labels = {"in-a": {"pool": "a"}, "in-b": {"pool": "b"}, "opted-out": {"xidflow.dev/opt-out": "true"}, "x": {}}
    sim = run(log.records, policy, fleet_labels=labels, fleet_size=100)
    by_node = {n: {t.action for t in sim.taken if t.node == n} for n in labels}
    assert "reboot" in by_node["in-a"] and "reboot" not in by_node["in-b"] and by_node["opted-out"] == set()
    assert sim.skipped and sim.skipped[0]["node"] == "opted-out" and "opt-out" in sim.skipped[0]["reason"]


def test_catalog_overrides_reach_the_run_and_only_that_run(tmp_path) -> None:  # noqa: ANN001
    overrides = tmp_path / "catalog.yaml"
    overrides.write_text("xid:\n  13:\n    action: IGNORE\n")
    log = Log()
    log.kmsg("node-c", X13, T0 - 900)
    quiet = run(log.records, PolicySet(), catalog_overrides=str(overrides))
    normal = run(log.records, PolicySet())
    assert quiet.taken == [] and [t.action for t in normal.taken] == ["event"]


# -- the command's sentences (no infrastructure needed) -------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def policy_file(tmp_path):  # noqa: ANN001, ANN201
    path = tmp_path / "candidate.yaml"
    path.write_text(CANDIDATE)
    return path


def _invoke(args: list[str], **env: str):  # noqa: ANN202
    base = {"KUBECONFIG": "/nonexistent/kubeconfig", "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{_free_port()}"}
    return CliRunner(env={**base, **env}).invoke(cli, ["replay", *args])


def test_bad_since_is_a_sentence(policy_file) -> None:  # noqa: ANN001
    result = _invoke(["--policy", str(policy_file), "--since", "a week"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "bad --since/--until: 'a week' is neither a duration" in result.output


def test_an_invalid_policy_names_the_field(tmp_path) -> None:  # noqa: ANN001
    bad = tmp_path / "bad.yaml"
    bad.write_text(CANDIDATE.replace("hook: annotation", "hook: telepathy"))
    result = _invoke(["--policy", str(bad), "--since", "7d"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"the policy {bad} is invalid: RescuePolicy/candidate spec.rules[0].actions[2].hook" in result.output
    missing = _invoke(["--policy", str(tmp_path / "nope.yaml"), "--since", "7d"])
    assert missing.exit_code == 1 and "cannot read the policy" in missing.output and "No such file" in missing.output


def test_kafka_down_is_a_sentence(policy_file) -> None:  # noqa: ANN001
    result = _invoke(["--policy", str(policy_file), "--since", "7d", "--no-cluster"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "cannot reach Kafka at 127.0.0.1:" in result.output
    assert "Nothing was read, nothing was changed" in result.output


def test_an_invalid_setting_is_named_before_anything_connects(policy_file) -> None:  # noqa: ANN001
    result = _invoke(["--policy", str(policy_file), "--since", "7d", "--no-cluster"],
                     XIDFLOW_AGG_DEBOUNCE_WINDOW_S="soon")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "XIDFLOW_AGG_DEBOUNCE_WINDOW_S" in result.output and "Kafka" not in result.output


def test_a_node_recovered_after_its_reboot_no_longer_counts_for_the_breaker() -> None:
    def history(reboot: bool) -> list[RawLog]:
        log = Log()
        log.health("node-0", "boot-1", T0 - 1000)
        log.kmsg("node-0", X79, T0 - 900)
        if reboot:
            log.health("node-0", "boot-2", T0 - 500)  # a new boot id with passing checks: recovered
        log.kmsg("node-1", X79, T0 - 100)
        return log.records

    settings = ActuatorSettings(breaker_max_share=0.5, breaker_window_seconds=300)
    recovered = run(history(True), PolicySet(), fleet_size=2, actuator=settings)
    assert [r["node"] for r in recovered.recovered] == ["node-0"] and recovered.trips == []
    assert {t.node for t in recovered.taken if t.action == "cordon"} == {"node-0", "node-1"}
    still = run(history(False), PolicySet(), fleet_size=2, actuator=settings)
    assert [t.tripped_by for t in still.trips] == ["node-1"]


def test_invalid_catalog_overrides_are_a_sentence(policy_file, tmp_path) -> None:  # noqa: ANN001
    bad = tmp_path / "catalog.yaml"
    bad.write_text("xid:\n  13:\n    action: EXPLODE\n")
    result = _invoke(["--policy", str(policy_file), "--since", "7d", "--catalog-overrides", str(bad)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"the catalog overrides {bad} are invalid: xid 13: action" in result.output
    missing = _invoke(["--policy", str(policy_file), "--since", "7d", "--catalog-overrides", str(tmp_path / "no")])
    assert missing.exit_code == 1 and "cannot read the catalog overrides" in missing.output


NCCL = ("{node}:2211:2390 [5] transport/net_ib.cc:2211 NCCL WARN NET/IB : Got completion from peer 10.1.4.9<53520> "
        "with status=12 opcode=0 len=0 vendor err 129 (Recv)")


def test_replay_shows_the_shared_part_the_policy_would_have_blamed() -> None:
    """Pod NCCL transport errors from four nodes behind one switch (labels from the cluster): one part, no node
    touched; the node behind another switch counts for nothing."""
    policy = load_yaml_text(CANDIDATE + "  sharedParts:\n    - {label: example.com/ib-switch, minNodes: 3}\n")
    log = Log()
    labels = {f"n{i}": {"example.com/ib-switch": "leaf-7"} for i in range(4)}
    labels["m0"] = {"example.com/ib-switch": "leaf-8"}
    for i, node in enumerate(labels):
        for k in range(5):
            at = T0 - 3600 + i + k * 0.1
            value = orjson.dumps({"log": NCCL.format(node=node), "time": at,
                                  "kubernetes": {"host": node, "pod_name": "trainer", "namespace_name": "ml"}})
            log.records.append(RawLog("gpu.logs.pods", 0, len(log.records), node.encode(), value, int(at * 1000)))
    sim = run(log.records, policy, fleet_labels=labels)
    [part] = part_rows(sim)
    assert part["part"] == "example.com/ib-switch=leaf-7" and part["nodes"] == ["n0", "n1", "n2", "n3"]
    assert part["faults"] == ["nccl_transport"] and node_rows(sim) == []
