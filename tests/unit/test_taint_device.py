"""taintDevice's pure parts: catalog scope, PCI addresses, finding the device in ResourceSlices, rule names
and bodies, the device-or-node decision, undo planning and policy validation."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.actuator.actions import taint_device as td
from pipeline.actuator.ownership import CORDON, LEDGER_ANNOTATION, Ledger
from pipeline.actuator.plan import NodeView, plan_recovery_for
from pipeline.actuator.policy import PolicyError, load_yaml_text
from pipeline.detection.catalog import Catalog
from schemas.records import FaultKind
from tests.unit.test_actuator_plan import incident

DRIVER = "gpu.nvidia.com"


def gpu_slice(node: str, pcis: list[str], generation: int = 1, pool: str | None = None,
              driver: str = DRIVER) -> dict[str, Any]:
    """A ResourceSlice as a DRA GPU driver publishes it (resource.k8s.io/v1)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}-{generation}"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": pool or node, "generation": generation, "resourceSliceCount": 1},
            "devices": [
                {"name": f"gpu-{i}", "attributes": {
                    "type": {"string": "gpu"},
                    td.PCI_ATTRIBUTE: {"string": pci},
                }}
                for i, pci in enumerate(pcis)
            ],
        },
    }


EIGHT = [f"0000:{bus:02x}:00.0" for bus in (0x18, 0x2a, 0x3a, 0x4e, 0x9a, 0xab, 0xba, 0xdb)]


def test_the_catalog_scopes_gpu_faults_to_the_gpu_and_everything_else_to_the_node() -> None:
    catalog = Catalog.default()
    assert {code: catalog.scope("xid", code) for code in (48, 64, 95, 119)} == dict.fromkeys((48, 64, 95, 119), "gpu")
    # Fallen off the bus, the recovery-action Xid, NVLink, unknown codes: the node.
    assert {catalog.scope("xid", code) for code in (79, 154, 74, 144, 999)} == {"node"}
    assert catalog.scope("sxid", 12020) == catalog.scope("sxid", 11001) == "node"
    assert catalog.scope("gpu_fallen_off_bus") == "node"
    assert catalog.scope("health_check:gpu_count") == "node"
    # Data, not code: an override changes a row's scope and the default.
    changed = Catalog.load(overrides={"xid": {79: {"scope": "gpu"}}, "defaults": {"scope": "gpu"}})
    assert changed.scope("xid", 79) == "gpu" and changed.scope("xid", 999) == "gpu"


def test_scope_of_an_incident_follows_its_kind_and_code() -> None:
    assert td.scope_of(incident(code=48)) == "gpu"
    assert td.scope_of(incident(code=79)) == "node"
    assert td.scope_of(incident(code=79, kind=FaultKind.GPU_FALLEN_OFF_BUS)) == "node"
    assert td.scope_of(None) == "node"


@pytest.mark.parametrize(("raw", "want"), [
    ("0000:4E:00.0", "0000:4e:00.0"),
    ("0000:4e:00", "0000:4e:00.0"),
    ("00000000:4e:00.0", "0000:4e:00.0"),
    ("PCI:0000:4e:00", "0000:4e:00.0"),
    ("not-a-bdf", None),
])
def test_pci_addresses_are_compared_in_one_form(raw: str, want: str | None) -> None:
    assert td.normalise_bdf(raw) == want


def test_the_device_is_found_by_its_pci_bus_id_in_the_newest_generation_only() -> None:
    slices = [gpu_slice("n1", EIGHT, generation=2), gpu_slice("n1", list(reversed(EIGHT)), generation=1)]
    assert td.find_devices(slices, "0000:4e:00.0") == [td.DeviceRef(DRIVER, "n1", "gpu-3")]
    assert td.find_devices(slices, "0000:4E:00") == [td.DeviceRef(DRIVER, "n1", "gpu-3")]
    assert td.find_devices(slices, "0000:77:00.0") == []
    assert td.find_devices([], "0000:4e:00.0") == []
    # A device without the standard attribute (its driver publishes none) is never matched.
    bare = gpu_slice("n1", EIGHT)
    for device in bare["spec"]["devices"]:
        device["attributes"] = {"pciBusID": device["attributes"][td.PCI_ATTRIBUTE]}
    assert td.find_devices([bare], "0000:4e:00.0") == []


def test_rule_names_are_deterministic_dns_names_per_node_gpu_and_device() -> None:
    dev = td.DeviceRef(DRIVER, "n1", "gpu-3")
    name = td.rule_name("n1", "0000:4e:00.0", dev)
    assert name == td.rule_name("n1", "0000:4e:00.0", dev)
    assert name != td.rule_name("n2", "0000:4e:00.0", dev)
    assert name != td.rule_name("n1", "0000:18:00.0", td.DeviceRef(DRIVER, "n1", "gpu-0"))
    assert name.startswith("xidflow-gpu-") and len(name) <= 63 and name == name.lower()


def test_the_rule_selects_the_one_device_and_is_labelled_as_xidflows() -> None:
    dev = td.DeviceRef(DRIVER, "n1", "gpu-3")
    body = td.rule_body("r", "n1", "0000:4e:00.0", dev, "nvidia.com/gpu-fault", "xid-48", "NoExecute", "inc-1")
    assert body["apiVersion"] == "resource.k8s.io/v1beta2" and body["kind"] == "DeviceTaintRule"
    assert body["spec"]["deviceSelector"] == {"driver": DRIVER, "pool": "n1", "device": "gpu-3"}
    assert body["spec"]["taint"] == {"key": "nvidia.com/gpu-fault", "value": "xid-48", "effect": "NoExecute"}
    assert td.is_ours(body) and body["metadata"]["labels"][td.NODE_LABEL] == "n1"
    assert td.tainted_pcis([body]) == {"0000:4e:00.0"}
    foreign = {"metadata": {"name": "x", "annotations": {td.PCI_ANNOTATION: "0000:18:00.0"}}}
    assert not td.is_ours(foreign) and td.tainted_pcis([foreign]) == set()


def test_a_node_name_too_long_for_a_label_is_hashed() -> None:
    assert td.node_label_value("gpu-node-1") == "gpu-node-1"
    long = "a" * 70
    assert td.node_label_value(long).startswith("h-") and len(td.node_label_value(long)) <= 63


def test_device_or_node_decision() -> None:
    dev = [td.DeviceRef(DRIVER, "n1", "gpu-3")]
    pci = "0000:4e:00.0"
    assert td.decide("gpu", "xid 48", pci, dev, set(), 2).verdict == td.Verdict.DEVICE
    node_scoped = td.decide("node", "xid 79", pci, dev, set(), 2)
    assert node_scoped.verdict == td.Verdict.NODE and "scope node" in node_scoped.reason
    no_dra = td.decide("gpu", "xid 48", pci, [], set(), 2)
    assert no_dra.verdict == td.Verdict.NODE and "no ResourceSlice" in no_dra.reason
    assert td.decide("gpu", "xid 48", None, dev, set(), 2).verdict == td.Verdict.NODE
    assert td.decide("gpu", "xid 48", pci, dev, set(), 2, rules_served=False).verdict == td.Verdict.NODE
    # The cap counts distinct GPUs: the same GPU again is not one more; a third one escalates.
    assert td.decide("gpu", "xid 48", pci, dev, {pci, "0000:18:00.0"}, 2).verdict == td.Verdict.DEVICE
    over = td.decide("gpu", "xid 48", pci, dev, {"0000:18:00.0", "0000:2a:00.0"}, 2)
    assert over.verdict == td.Verdict.DEVICE_AND_NODE and "maxTaintedDevices=2" in over.reason
    assert td.decide("gpu", "xid 48", pci, dev, set(), 0).verdict == td.Verdict.DEVICE_AND_NODE


def test_device_taint_effect_is_the_rules_else_no_schedule() -> None:
    assert td.device_effect("NoExecute") == "NoExecute"
    assert td.device_effect("None") == "None"  # KEP-5055's dry run
    # Never the node taint's setting: NoExecute on a device deletes pods past their PDBs, only a rule asks for it.
    assert td.device_effect(None) == "NoSchedule"
    assert td.device_effect("PreferNoSchedule") == "NoSchedule"


def rule_of(name: str, device: str, effect: str, ours: bool = True) -> dict:
    body = td.rule_body(name, "n1", EIGHT[0], td.DeviceRef(DRIVER, "n1", device), "k", "v", effect, "inc-1")
    if not ours:
        body["metadata"]["labels"] = {}
    return body


def test_a_dry_run_rule_takes_nothing_out_and_never_counts_toward_the_cap() -> None:
    rules = [rule_of("a", "gpu-0", "NoSchedule"), rule_of("b", "gpu-1", "None"),
             rule_of("c", "gpu-2", "NoExecute"), rule_of("d", "gpu-3", "NoSchedule", ours=False)]
    devices, dry = td.rule_devices(rules)
    assert devices == {(DRIVER, "n1", "gpu-0"), (DRIVER, "n1", "gpu-2")} and dry == ["b"]
    rules[1]["metadata"]["annotations"][td.PCI_ANNOTATION] = "0000:2a:00.0"
    assert td.tainted_pcis(rules[:2]) == {EIGHT[0]}
    pci, dev = "0000:4e:00.0", [td.DeviceRef(DRIVER, "n1", "gpu-3")]
    over = {"0000:18:00.0", "0000:2a:00.0"}
    dry_run = td.decide("gpu", "xid 48", pci, dev, over, 2, effect="None")
    assert dry_run.verdict == td.Verdict.DEVICE and "dry run" in dry_run.reason  # never escalates to the node
    assert td.decide("gpu", "xid 48", pci, dev, over, 2, effect="NoSchedule").verdict == td.Verdict.DEVICE_AND_NODE


def test_undo_deletes_only_the_rules_this_flow_alone_owns() -> None:
    ledger = Ledger()
    ledger.own(td.effect_key("xidflow-gpu-a"), "inc-1")
    ledger.own(td.effect_key("xidflow-gpu-b"), "inc-1")
    ledger.own(td.effect_key("xidflow-gpu-b"), "inc-2")  # the same GPU is still another incident's
    ledger.own(CORDON, "inc-2")
    view = NodeView.from_object({
        "metadata": {"name": "n1", "annotations": {LEDGER_ANNOTATION: ledger.to_annotation()}, "resourceVersion": "1"},
        "spec": {"unschedulable": True},
    })
    undo = plan_recovery_for("inc-1", view)
    assert undo.delete_device_rules == ("xidflow-gpu-a",)
    assert not undo.uncordon


def policy(action: str) -> str:
    return f"kind: RescuePolicy\nmetadata: {{name: p}}\nspec:\n  rules:\n  - {{name: r, actions: [{action}]}}\n"


def test_policy_accepts_taint_device_with_its_attributes_and_refuses_the_rest() -> None:
    rule = load_yaml_text(policy("{name: taintDevice, effect: NoExecute, maxTaintedDevices: 3}")).rules[0]
    assert rule.actions[0].max_tainted_devices == 3 and rule.actions[0].effect == "NoExecute"
    with pytest.raises(PolicyError, match="effect"):
        load_yaml_text(policy("{name: taintDevice, effect: PreferNoSchedule}"))
    with pytest.raises(PolicyError, match="maxTaintedDevices"):
        load_yaml_text(policy("{name: cordon, maxTaintedDevices: 3}"))
    with pytest.raises(PolicyError, match="maxTaintedDevices"):
        load_yaml_text(policy("{name: taintDevice, maxTaintedDevices: -1}"))


def test_quarantine_per_gpu_expands_to_taint_device_for_quarantining_incidents_only() -> None:
    from pipeline.actuator.plan import expand_actions
    from schemas.records import Action

    text = policy("{name: quarantine, perGpu: true, maxTaintedDevices: 3, checkpointGrace: 5m}")
    rule = load_yaml_text(text).rules[0]
    specs = expand_actions(rule, incident(code=48, action=Action.RESET_GPU))
    # By default the GPU's pods leave through xidflow's drain (Eviction API, PDBs, checkpoint), scoped to the GPU.
    assert [s.name for s in specs] == ["taintDevice", "condition", "event", "notifyWorkload", "drain"]
    assert specs[0].effect is None and specs[0].max_tainted_devices == 3
    assert specs[-1].scope == "gpu" and specs[-1].checkpoint_grace == 300
    assert [s.name for s in expand_actions(rule, incident(code=13, action=Action.RESTART_APP))] == ["event"]
    # NoExecute: Kubernetes deletes the GPU's pods itself; None: a dry run. Neither gets a drain.
    for effect in ("NoExecute", "None"):
        explicit = load_yaml_text(policy(f"{{name: quarantine, perGpu: true, effect: {effect}}}")).rules[0]
        specs = expand_actions(explicit, incident(code=48, action=Action.RESET_GPU))
        assert [s.name for s in specs] == ["taintDevice", "condition", "event", "notifyWorkload"]
        assert specs[0].effect == effect
    plain = load_yaml_text(policy("{name: quarantine}")).rules[0]
    node_wide = expand_actions(plain, incident(code=48, action=Action.RESET_GPU))
    assert [s.name for s in node_wide][:2] == ["cordon", "taint"]


@pytest.mark.parametrize(("action", "message"), [
    ("{name: cordon, perGpu: true}", "perGpu"),
    ("{name: quarantine, maxTaintedDevices: 2}", "maxTaintedDevices"),
    ("{name: quarantine, perGpu: true, effect: PreferNoSchedule}", "effect"),
    ("{name: taint, effect: None}", "effect: None .* only for taintDevice"),
    ("{name: quarantine, effect: None}", "effect: None"),
    ("{name: quarantine, checkpointGrace: 60}", "checkpointGrace: only meaningful with perGpu"),
    ("{name: quarantine, perGpu: true, effect: NoExecute, checkpointGrace: 60}", "with effect NoExecute"),
    ("{name: cordon, scope: gpu}", "scope: not valid for action 'cordon'"),
    ("{name: drain, scope: rack}", "scope"),
])
def test_per_gpu_attributes_are_refused_where_they_mean_nothing(action: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        load_yaml_text(policy(action))


def test_drain_scope_and_the_dry_run_effect_load_where_they_mean_something() -> None:
    assert load_yaml_text(policy("{name: drain, scope: gpu}")).rules[0].actions[0].scope == "gpu"
    assert load_yaml_text(policy("{name: taintDevice, effect: None}")).rules[0].actions[0].effect == "None"
