"""MIG (issue 36, deliverable 2): the GPU instance (and compute instance) the driver attributes an Xid to, in the
event, the incident and the per-GPU quarantine.

The driver's three forms come from its Xid printer (open-gpu-kernel-modules kernel_rc.c): ``(PCI:...)``,
``(PCI:... GPU-I:%02u)``, ``(PCI:... GPU-I:%02u GPU-CI:%02u)``. NVIDIA's DRA driver (k8s-dra-driver-gpu
deviceinfo.go, mig.go) publishes MIG devices named by parent, profile and placement with the parent's
``resource.kubernetes.io/pciBusID`` and no GPU instance id: the slices below are shaped like its.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from pipeline.actuator.actions import taint_device as td
from pipeline.aggregate.aggregator import Aggregator, event_signature
from pipeline.detection.catalog import Catalog
from pipeline.detection.detector import Detector
from pipeline.ingest.parsing.kernel import XidLine, parse_kernel_line
from schemas.records import Action, FaultEvent, LogRecord, NodeIncident, Source

T0 = datetime(2026, 1, 1, tzinfo=UTC)
MESSAGES = {
    13: "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter",
    43: "Ch 00000008",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 1",
    63: "Row Remapper: New row marked for remapping, reset gpu to activate.",
    94: "Contained: CE User Channel (0x9). RST: No, D-RST: No",
    95: "Uncontained: LTC TAG (0x2, 0x1). RST: Yes, D-RST: No",
    119: "Timeout after 6s of waiting for RPC response from GPU1 GSP! Expected function 76 (GSP_RM_CONTROL)",
    154: "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
}


def mig_line(code: int, gi: int | None, ci: int | None, pid: bool = True) -> str:
    attr = "PCI:0000:3b:00" + (f" GPU-I:{gi:02d}" if gi is not None else "")
    attr += f" GPU-CI:{ci:02d}" if ci is not None else ""
    who = "pid=9, name=python3, " if pid else ""
    return f"NVRM: Xid ({attr}): {code}, {who}{MESSAGES[code]}"


@pytest.mark.parametrize("code", sorted(MESSAGES))
@pytest.mark.parametrize(("gi", "ci"), [(None, None), (5, None), (1, 2), (13, 0)])
@pytest.mark.parametrize("pid", [True, False])
def test_every_code_in_every_form_keeps_its_catalog_action(code: int, gi: int | None, ci: int | None,
                                                           pid: bool) -> None:
    line = mig_line(code, gi, ci, pid)
    parsed = parse_kernel_line(line)
    assert isinstance(parsed, XidLine)
    assert (parsed.code, parsed.pci, parsed.gpu_instance, parsed.compute_instance) == (code, "0000:3b:00.0", gi, ci)
    [event] = Detector().process(LogRecord(node="n1", source=Source.KERNEL, ts=T0, line=line))
    [plain] = Detector().process(LogRecord(node="n1", source=Source.KERNEL, ts=T0, line=mig_line(code, None, None)))
    assert (event.gpu_instance, event.compute_instance) == (gi, ci)
    assert (event.action, event.severity, event.name, event.subcode) == (
        plain.action, plain.severity, plain.name, plain.subcode)


def run(events: list[FaultEvent]) -> tuple[Any, list[NodeIncident]]:
    agg = Aggregator()
    state, out = agg.new_state("n1"), []
    for event in events:
        state, emitted = agg.step(state, event, now=1_000.0)
        out += [o for o in emitted if isinstance(o, NodeIncident)]
    return state, out


def detect(*lines: str) -> list[FaultEvent]:
    detector = Detector()
    return [e for n, line in enumerate(lines)
            for e in detector.process(LogRecord(node="n1", source=Source.KERNEL, ts=T0 + timedelta(seconds=n),
                                                line=line))]


def test_each_mig_instance_is_its_own_incident_naming_it() -> None:
    events = detect(mig_line(48, 1, 0), mig_line(48, 2, 0), mig_line(48, 1, 1), mig_line(48, None, None))
    assert [event_signature(e) for e in events] == [
        "xid:48:0000:3b:00.0/gi1", "xid:48:0000:3b:00.0/gi2", "xid:48:0000:3b:00.0/gi1", "xid:48:0000:3b:00.0"]
    state, out = run(events)
    assert [(i.gpu_instance, i.compute_instance, i.pci) for i in out] == [
        (1, 0, "0000:3b:00.0"), (2, 0, "0000:3b:00.0"), (None, None, "0000:3b:00.0")]
    assert state.incidents["xid:48:0000:3b:00.0/gi1"].count == 2
    assert all(i.action is Action.RESET_GPU for i in out)


def test_the_lost_gpu_group_stays_the_whole_gpu() -> None:
    """Xid 79 is the GPU's, whatever instance a line names: one lost-GPU incident per PCI address."""
    events = detect("NVRM: Xid (PCI:0000:3b:00 GPU-I:01): 79, GPU has fallen off the bus.",
                    "NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.")
    state, out = run(events)
    assert list(state.incidents) == ["gpu_lost:0000:3b:00.0"] and len(out) == 1


# -- the per-GPU quarantine -------------------------------------------------------------------------------------
DRIVER = "gpu.nvidia.com"
PCI = "0000:3b:00.0"


def nvidia_slice(mig: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The full GPU and its MIG devices as NVIDIA's DRA driver publishes them: every one at the parent's address."""
    devices = [{"name": "gpu-0", "attributes": {"type": {"string": "gpu"}, td.PCI_ATTRIBUTE: {"string": PCI}}}]
    devices += [{"name": name, "attributes": {"type": {"string": "mig"}, "profile": {"string": "1g.10gb"},
                                              td.PCI_ATTRIBUTE: {"string": PCI}, **extra}} for name, extra in mig]
    return {"spec": {"driver": DRIVER, "nodeName": "n1", "pool": {"name": "n1", "generation": 1}, "devices": devices}}


def refs(*names: str) -> list[td.DeviceRef]:
    return sorted(td.DeviceRef(DRIVER, "n1", n) for n in names)


def test_without_a_published_instance_the_whole_gpu_is_named_and_the_reason_says_so() -> None:
    slices = [nvidia_slice([("gpu-0-mig-1g10gb-19-0", {}), ("gpu-0-mig-1g10gb-19-1", {})])]
    devices, note = td.pick_devices(slices, PCI, 5)
    assert devices == refs("gpu-0", "gpu-0-mig-1g10gb-19-0", "gpu-0-mig-1g10gb-19-1")
    assert "no device publishes gpuInstanceId=5" in note and "the whole GPU" in note
    decision = td.decide("gpu", "xid 48", PCI, devices, set(), 2, instance=note)
    assert decision.verdict is td.Verdict.DEVICE and "the whole GPU" in decision.reason
    assert td.pick_devices(slices, PCI, None) == (devices, "")  # not a MIG fault: the GPU, nothing to say


@pytest.mark.parametrize("attribute", ["gpuInstanceId", "gpu.example.com/gpuInstanceId"])
def test_a_published_instance_names_its_mig_device_only(attribute: str) -> None:
    slices = [nvidia_slice([("gpu-0-mig-a", {attribute: {"int": 5}}), ("gpu-0-mig-b", {attribute: {"int": 6}})])]
    devices, note = td.pick_devices(slices, PCI, 5)
    assert (devices, note) == (refs("gpu-0-mig-a"), "MIG GPU instance 5")
    decision = td.decide("gpu", "xid 48", PCI, devices, set(), 2, instance=note)
    assert decision.reason == (
        f"GPU {PCI} (gpu-0-mig-a; MIG GPU instance 5) tainted NoSchedule; 1 of at most 2 on the node"
    )
    # An instance no device publishes falls back to the whole GPU.
    assert td.pick_devices(slices, PCI, 7)[0] == refs("gpu-0", "gpu-0-mig-a", "gpu-0-mig-b")


def test_the_incident_carries_the_instance_to_the_quarantine() -> None:
    [event] = detect(mig_line(48, 5, 0))
    _, [inc] = run([event])
    assert (inc.gpu_instance, inc.compute_instance, inc.pci) == (5, 0, PCI)
    assert td.scope_of(inc, Catalog.default()) == "gpu"
    assert NodeIncident.from_bytes(inc.to_bytes()).gpu_instance == 5
