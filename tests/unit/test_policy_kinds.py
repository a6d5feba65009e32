"""The shipped example policies against incidents of every kind (issue 11, point 6).

Rule for kinds without a code, as documented in deploy/examples/policies.yaml and
``PolicySet.select``: "fallen off the bus" is the same fault as Xid 79 and counts as 79; other
code-less kinds (health_check, pod_error, kernel_segfault) match only rules without ``codes``.

Incidents are produced the real way: real log lines -> Detector -> Aggregator -> planner.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from pipeline.actuator.plan import NodeView, plan_incident
from pipeline.actuator.policy import PolicySet, load_yaml_file
from pipeline.actuator.settings import ActuatorSettings
from pipeline.aggregate.aggregator import Aggregator
from pipeline.detection.detector import Detector
from schemas.records import FaultKind, HealthCheckResult, LogRecord, NodeIncident, Source

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "policies.yaml"
T = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
BARE_METAL = {"node.kubernetes.io/instance-type": "bare-metal"}
TRAINING = {"xidflow.dev/pool": "training"}
QUARANTINE = ["cordon", "taint", "condition", "event", "notifyWorkload"]


@pytest.fixture(scope="module")
def policies() -> PolicySet:
    return load_yaml_file(EXAMPLES)


def incident_from(source: Source, *lines: str) -> NodeIncident:
    detector, agg = Detector(), Aggregator()
    state = agg.new_state("gpu-1")
    out = []
    for i, line in enumerate(lines):
        record = LogRecord(node="gpu-1", source=source, ts=T, line=line, pod="p" if source is Source.POD else None)
        for event in detector.process(record) + detector.flush():
            state, produced = agg.step(state, event, now=float(i))
            out += produced
    [incident] = [o for o in out if isinstance(o, NodeIncident)]
    return incident


def steps(policies: PolicySet, incident: NodeIncident, labels: dict[str, str]) -> tuple[str, list[str]]:
    node = NodeView.from_object(
        {"metadata": {"name": "gpu-1", "labels": labels}, "status": {"nodeInfo": {"bootID": "boot-a"}}}
    )
    plan = plan_incident(incident, policies, node, ActuatorSettings(), now=0.0)
    return plan.rule, [s.name for s in plan.steps]


FALLEN_THREE = ("NVRM: The NVIDIA GPU 0000:b3:00.0", "NVRM: (PCI ID: 10de:2330) installed in this system has",
                "NVRM: fallen off the bus and is not responding to commands.")
REBOOT_FLOW = [*QUARANTINE, "drain", "reboot"]

CASES = [
    # (id, source, lines, node labels, expected kind, expected rule, expected steps)
    ("xid79-bare-metal", Source.KERNEL, ["NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, "
                                         "GPU has fallen off the bus."], BARE_METAL, FaultKind.XID,
     "xid79-bare-metal", REBOOT_FLOW),
    ("fallen-off-three-lines-bare-metal", Source.KERNEL, list(FALLEN_THREE), BARE_METAL,
     FaultKind.GPU_FALLEN_OFF_BUS, "xid79-bare-metal", REBOOT_FLOW),
    ("fallen-off-one-line-bare-metal", Source.KERNEL, ["NVRM: GPU 0000:29:00.0: GPU has fallen off the bus."],
     BARE_METAL, FaultKind.GPU_FALLEN_OFF_BUS, "xid79-bare-metal", REBOOT_FLOW),
    ("fallen-off-kmsg-record-bare-metal", Source.KERNEL, [r"\x0a".join(FALLEN_THREE)], BARE_METAL,
     FaultKind.GPU_FALLEN_OFF_BUS, "xid79-bare-metal", REBOOT_FLOW),
    ("fallen-off-elsewhere", Source.KERNEL, list(FALLEN_THREE), {}, FaultKind.GPU_FALLEN_OFF_BUS,
     "global-default", QUARANTINE),
    ("xid48-reset", Source.KERNEL, ["NVRM: Xid (PCI:0000:4e:00): 48, pid=1, name=x, An uncorrectable double bit "
                                    "error"], {}, FaultKind.XID, "ecc-reset", [*QUARANTINE, "drain", "resetGpu"]),
    ("xid13-restart-app", Source.KERNEL, ["NVRM: Xid (PCI:0000:4e:00): 13, pid=1, name=x, Graphics Exception"],
     BARE_METAL, FaultKind.XID, "global-default", ["event"]),
    ("xid168-unbucketed-alerts", Source.KERNEL, ["NVRM: Xid (PCI:0000:4e:00): 168, pid=1, name=x, WPR errors"], {},
     FaultKind.XID, "global-default", ["condition", "event"]),
    ("sxid-fatal-training", Source.KERNEL, ["nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 28 "
                                            "sourcetrack timeout error (First)"], TRAINING, FaultKind.SXID,
     "sxid-fatal", [*QUARANTINE, "enableWarmStandby"]),
    ("sxid-fatal-elsewhere", Source.KERNEL, ["nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 28 "
                                             "sourcetrack timeout error (First)"], {}, FaultKind.SXID,
     "global-default", QUARANTINE),
    ("pod-hardware", Source.POD, ["RuntimeError: CUDA error: uncorrectable ECC error encountered"], BARE_METAL,
     FaultKind.POD_ERROR, "global-default", ["event"]),
    ("kernel-segfault", Source.KERNEL, ["pt_main_thread[2536443]: segfault at 7f79c5ffd000 ip 00007f7a1c0d4e42 "
                                        "sp 00007f79c5ffcf90 error 4 in libnccl.so.2[7f7a1bc00000+21a1000]"],
     BARE_METAL, FaultKind.KERNEL_SEGFAULT, "global-default", ["event"]),
]


@pytest.mark.parametrize(("case", "source", "lines", "labels", "kind", "rule", "expected"), CASES,
                         ids=[c[0] for c in CASES])
def test_example_policies_against_every_kind(
    policies: PolicySet, case: str, source: Source, lines: list[str], labels: dict[str, str], kind: FaultKind,
    rule: str, expected: list[str],
) -> None:
    incident = incident_from(source, *lines)
    assert incident.kind is kind, case
    assert steps(policies, incident, labels) == (rule, expected), case


def test_health_check_incident_takes_the_default_rule(policies: PolicySet) -> None:
    result = HealthCheckResult(node="gpu-1", check="gpu_count", passed=False, ts=T, values={"expected": 8, "found": 7})
    record = LogRecord(node="gpu-1", source=Source.PROBE, ts=T, line=result.to_bytes().decode())
    [event] = Detector().process(record)
    agg = Aggregator()
    _, [incident] = agg.step(agg.new_state("gpu-1"), event, now=0.0)
    assert incident.kind is FaultKind.HEALTH_CHECK and incident.code is None
    # A code-less kind never matches a rule with codes, even on a bare-metal node.
    assert steps(policies, incident, BARE_METAL) == ("global-default", QUARANTINE)


def test_a_fallen_off_incident_without_a_code_still_counts_as_xid79(policies: PolicySet) -> None:
    incident = incident_from(Source.KERNEL, *FALLEN_THREE).model_copy(update={"code": None})
    assert steps(policies, incident, BARE_METAL) == ("xid79-bare-metal", REBOOT_FLOW)


def test_rules_with_codes_do_not_match_other_codeless_kinds(policies: PolicySet) -> None:
    for kind in (FaultKind.POD_ERROR, FaultKind.HEALTH_CHECK, FaultKind.KERNEL_SEGFAULT):
        assert policies.select(kind, None, BARE_METAL).name == "global-default", kind
