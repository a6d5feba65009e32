"""Shared parts (issue 25 part 2): fabric signals, the per-label-value correlation, the policy's rule. Pure."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.actuator.breaker_rules import quarantined_by_xidflow
from pipeline.actuator.ownership import Ledger, taint_effect_key
from pipeline.actuator.policy import PolicyError, load_yaml_text
from pipeline.actuator.sharedparts import observe_all, taint_key
from pipeline.aggregate.aggregator import Aggregator
from pipeline.aggregate.sharedparts import PartState, fault_class, observe
from pipeline.detection.catalog import Catalog
from pipeline.detection.detector import Detector
from schemas.records import FabricSignal, FaultKind, LogRecord, SharedPartIncident, Source

T = datetime(2026, 11, 25, 10, 0, tzinfo=UTC)
NCCL = (
    "gpu-7:2211:2390 [5] transport/net_ib.cc:2211 NCCL WARN NET/IB : Got completion from peer 10.1.4.9<53520> "
    "with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:10.1.4.8 remoteGids::ffff:10.1.4.9"
)


def pod_event(node: str, at: datetime, line: str = NCCL) -> object:
    [event] = Detector().process(
        LogRecord(node=node, source=Source.POD, ts=at, line=line, pod="trainer-0", namespace="ml")
    )
    return event


def kernel_event(node: str, line: str, at: datetime = T) -> object:
    detector = Detector()
    return (detector.process(LogRecord(node=node, source=Source.KERNEL, ts=at, line=line)) + detector.flush())[0]


def signal(node: str, at: float, sid: str | None = None, cls: str = "nccl_transport") -> FabricSignal:
    return FabricSignal(
        signal_id=sid or f"{node}@{at}", node=node, kind=FaultKind.POD_ERROR, signature="pod_error:sympathetic:x",
        fault_class=cls, ts=T + timedelta(seconds=at),
    )


# -- which faults are fabric-class --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("line", "source", "expected"),
    [
        (NCCL, Source.POD, "nccl_transport"),
        ("spark01:2683:2826 [0] misc/ibvwrap.cc:268 NCCL WARN Call to ibv_create_cq failed", Source.POD,
         "nccl_transport"),
        ("[rank3]:[E ProcessGroupNCCL.cpp:563] [Rank 3] Watchdog caught collective operation timeout: "
         "WorkNCCL(SeqNum=1, OpType=ALLREDUCE) ran for 600041 milliseconds before timing out.", Source.POD, None),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", Source.POD, None),
        ("NVRM: Xid (PCI:0000:4e:00): 79, pid=1, GPU has fallen off the bus.", Source.KERNEL, "gpu_lost"),
        ("NVRM: Xid (PCI:0000:4e:00): 74, pid=1, NVLink: fatal error detected on link 3", Source.KERNEL, "nvlink"),
        ("NVRM: Xid (PCI:0000:4e:00): 48, pid=1, An uncorrectable double bit error", Source.KERNEL, None),
    ],
)
def test_fault_classes(line: str, source: Source, expected: str | None) -> None:
    if source is Source.POD:
        event = pod_event("n1", T, line)
    else:
        event = kernel_event("n1", line)
    assert fault_class(event, Catalog.configured()) == expected


def test_a_storm_on_one_node_is_one_signal_per_debounce_window_and_changes_no_incident() -> None:
    agg = Aggregator()
    state = agg.new_state("n1")
    signals: list[FabricSignal] = []
    outputs = []
    for i in range(200):  # 200 lines over 100 s: debounce 60 s gives two signals
        state, out = agg.step(state, pod_event("n1", T + timedelta(seconds=i / 2)), now=float(i), signals=signals)
        outputs += out
    assert outputs == []  # sympathetic errors alone still open nothing
    assert [s.ts for s in signals] == [T, T + timedelta(seconds=60)]
    assert {s.fault_class for s in signals} == {"nccl_transport"}
    # The node's own GPU falls off the bus in the middle of the storm: a class of its own, told at once.
    xid79 = kernel_event("n1", "NVRM: Xid (PCI:0000:4e:00): 79, pid=1, GPU has fallen off the bus.",
                         T + timedelta(seconds=70))
    state, out = agg.step(state, xid79, now=300.0, signals=signals)
    assert [i.code for i in out] == [79] and signals[-1].fault_class == "gpu_lost"
    # Without the list (tests, tools that want incidents only) nothing changes.
    again = agg.new_state("n1")
    again, out = agg.step(again, pod_event("n1", T), now=0.0)
    assert out == [] and again.fabric_emitted == {}


def test_xid79_is_still_the_nodes_own_incident_and_also_a_signal() -> None:
    agg = Aggregator()
    signals: list[FabricSignal] = []
    _, out = agg.step(agg.new_state("n1"), kernel_event("n1", "NVRM: Xid (PCI:0000:4e:00): 79, pid=1, GPU has "
                                                          "fallen off the bus."), now=0.0, signals=signals)
    [incident] = out
    assert incident.code == 79 and incident.quarantine
    assert [s.fault_class for s in signals] == ["gpu_lost"]


def test_a_redelivered_event_emits_no_second_signal() -> None:
    agg = Aggregator()
    state = agg.new_state("n1")
    event = pod_event("n1", T)
    signals: list[FabricSignal] = []
    state, _ = agg.step(state, event, now=0.0, position=(0, 5), signals=signals)
    state, _ = agg.step(state, event, now=1.0, position=(0, 5), signals=signals)
    assert len(signals) == 1


# -- the correlation ----------------------------------------------------------------------------------------
def new_part() -> PartState:
    return PartState(label="example.com/ib-switch", value="leaf-7")


def test_k_nodes_within_the_window_open_one_incident_and_later_nodes_join() -> None:
    part = new_part()
    results = [observe(part, signal(f"n{i}", i * 10.0), part="ib-switch", min_nodes=3, window_s=60) for i in range(5)]
    assert results == [None, None, "opened", "joined", "joined"]
    inc = part.incident
    assert inc is not None and inc.nodes == ["n0", "n1", "n2", "n3", "n4"] and inc.revision == 2
    assert (inc.label, inc.value, inc.part, inc.min_nodes) == ("example.com/ib-switch", "leaf-7", "ib-switch", 3)
    assert inc.first_seen == T and inc.last_seen == T + timedelta(seconds=40)
    # A node already named reports another class (its GPU fell off the bus): shown, no new revision.
    assert observe(part, signal("n1", 45.0, cls="gpu_lost"), part="ib-switch", min_nodes=3, window_s=60) is None
    assert inc.fault_classes == ["gpu_lost", "nccl_transport"] and inc.revision == 2


def test_nodes_further_apart_than_the_window_do_not_correlate() -> None:
    part = new_part()
    results = [observe(part, signal(f"n{i}", i * 100.0), part="p", min_nodes=3, window_s=60) for i in range(6)]
    assert results == [None] * 6 and part.incident is None
    assert list(part.members) == ["n5"]  # only what can still count is kept


def test_one_node_repeating_is_never_a_part() -> None:
    part = new_part()
    for i in range(50):
        assert observe(part, signal("n1", float(i)), part="p", min_nodes=2, window_s=600) is None
    assert part.incident is None


def test_a_redelivered_signal_changes_nothing() -> None:
    part = new_part()
    observe(part, signal("a", 0), part="p", min_nodes=2, window_s=60)
    before = part.model_dump()
    assert observe(part, signal("a", 0), part="p", min_nodes=2, window_s=60) is None
    assert part.model_dump() == before


@settings(max_examples=200)
@given(
    nodes=st.integers(min_value=1, max_value=20),
    k=st.integers(min_value=2, max_value=8),
    data=st.data(),
)
def test_any_order_and_redelivery_opens_at_most_one_incident(nodes: int, k: int, data: st.DataObject) -> None:
    """Signals within one window, in any order, each delivered one or more times: one incident iff there
    are at least K distinct nodes, naming every node; its revision counts the nodes that joined later."""
    signals = [signal(f"n{i}", float(data.draw(st.integers(0, 59)))) for i in range(nodes)]
    deliveries = data.draw(st.lists(st.sampled_from(signals), min_size=0, max_size=40))
    order = data.draw(st.permutations([*signals, *deliveries]))
    part = new_part()
    results = [observe(part, s, part="p", min_nodes=k, window_s=60) for s in order]
    if nodes < k:
        assert part.incident is None and set(results) == {None}
        return
    assert results.count("opened") == 1
    assert part.incident is not None and part.incident.nodes == sorted(f"n{i}" for i in range(nodes))
    assert part.incident.revision == results.count("joined") == nodes - k


def test_observe_all_reports_pending_work_and_keeps_a_part_per_label_value() -> None:
    policy = load_yaml_text(POLICY)
    rule = policy.shared_parts[0]  # example.com/ib-switch
    state: dict = {}
    pending = [observe_all(state, signal(f"n{i}", float(i)), [(rule, "leaf-7")], 0.0) for i in range(3)]
    assert pending == [[], [], ["example.com/ib-switch=leaf-7"]]
    other = observe_all(state, signal("m1", 3.0), [(rule, "leaf-8")], 0.0)
    assert other == [] and sorted(state["parts"]) == ["example.com/ib-switch=leaf-7", "example.com/ib-switch=leaf-8"]
    # Work recorded as done: nothing pending until a node joins.
    part = PartState.model_validate(state["parts"]["example.com/ib-switch=leaf-7"])
    assert part.incident is not None
    part.applied = dict.fromkeys(part.incident.nodes, 0)
    part.event_for = 0
    state["parts"]["example.com/ib-switch=leaf-7"] = part.model_dump(mode="json")
    assert observe_all(state, signal("n0", 4.0), [(rule, "leaf-7")], 0.0) == []
    assert observe_all(state, signal("n9", 5.0), [(rule, "leaf-7")], 0.0) == ["example.com/ib-switch=leaf-7"]


# -- the policy ---------------------------------------------------------------------------------------------
POLICY = """
apiVersion: xidflow.dev/v1alpha1
kind: RescuePolicy
metadata: {name: fabric}
spec:
  rules: [{actions: [{name: quarantine}]}]
  sharedParts:
  - {label: example.com/ib-switch, minNodes: 3, window: 120}
  - {label: topology.kubernetes.io/rack, name: rack, taintEffect: PreferNoSchedule, condition: false}
"""


def test_policy_shared_parts() -> None:
    a, b = load_yaml_text(POLICY).shared_parts
    assert (a.label, a.part, a.min_nodes, a.window, a.taint_effect) == ("example.com/ib-switch", "ib-switch", 3,
                                                                           120.0, "NoSchedule")
    assert (b.part, b.taint_effect, b.condition, b.min_nodes, b.window) == ("rack", "PreferNoSchedule", False, 3, 300)
    assert taint_key(a.part) == "xidflow.dev/shared-ib-switch"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("{label: 'not a label!'}", "sharedParts[0].label: 'not a label!' is not a label key"),
        ("{label: '/rack'}", "sharedParts[0].label: '/rack': the prefix before '/' must be a DNS subdomain"),
        ("{label: a.io/rack, minNodes: 1}", "sharedParts[0].minNodes: Input should be greater than or equal to 2"),
        ("{label: a.io/rack, window: 0}", "sharedParts[0].window: Input should be greater than 0"),
        ("{label: a.io/rack, window: 100000}", "sharedParts[0].window: Input should be less than or equal to 86400"),
        ("{label: a.io/rack, name: Rack}", "sharedParts[0].name: 'Rack' must be lower-case"),
        ("{label: a.io/rack, taintEffect: Sometimes}", "sharedParts[0].taintEffect: Input should be"),
        ("{label: a.io/rack, minNode: 3}", "sharedParts[0].minNode: Extra inputs are not permitted"),
    ],
)
def test_bad_shared_part_rules_are_refused_naming_the_field(entry: str, message: str) -> None:
    doc = (
        "apiVersion: xidflow.dev/v1alpha1\nkind: RescuePolicy\nmetadata: {name: f}\nspec:\n"
        f"  rules: [{{actions: [{{name: event}}]}}]\n  sharedParts:\n  - {entry}\n"
    )
    with pytest.raises(PolicyError) as err:
        load_yaml_text(doc)
    assert message in str(err.value)


def test_one_rule_per_label_and_per_name_across_policies() -> None:
    second = POLICY.replace("name: fabric}", "name: fabric2}").replace("name: rack, ", "name: rack2, ")
    with pytest.raises(PolicyError, match="label 'example.com/ib-switch' is named twice"):
        load_yaml_text(POLICY + "---\n" + second)
    clash = POLICY.replace("{label: example.com/ib-switch,", "{label: example.com/rack,")
    with pytest.raises(PolicyError, match="name 'rack' is used twice"):
        load_yaml_text(clash)


# -- the breaker --------------------------------------------------------------------------------------------
def test_the_breaker_does_not_count_a_shared_part_taint() -> None:
    ledger = Ledger()
    key = taint_key("ib-switch")
    ledger.own(taint_effect_key(key, "NoSchedule"), "part-incident")
    node = {"metadata": {"annotations": {"xidflow.dev/ledger": ledger.to_annotation()}},
            "spec": {"taints": [{"key": key, "value": "leaf-7", "effect": "NoSchedule"}]}}
    assert not quarantined_by_xidflow(node)
    ledger.own(taint_effect_key("xidflow.dev/gpu-fault", "NoSchedule"), "node-incident")
    node["metadata"]["annotations"]["xidflow.dev/ledger"] = ledger.to_annotation()
    node["spec"]["taints"].append({"key": "xidflow.dev/gpu-fault", "effect": "NoSchedule"})
    assert quarantined_by_xidflow(node)


def test_the_incident_round_trips_as_json() -> None:
    part = new_part()
    for i in range(3):
        observe(part, signal(f"n{i}", float(i)), part="p", min_nodes=3, window_s=60)
    assert part.incident is not None
    assert SharedPartIncident.from_bytes(part.incident.to_bytes()) == part.incident


# -- a node already blamed on a part ------------------------------------------------------------------------
def test_a_fabric_incident_on_a_node_blamed_on_an_open_part_is_not_a_node_quarantine() -> None:
    from pipeline.actuator.plan import plan_incident
    from pipeline.actuator.settings import ActuatorSettings
    from schemas.records import Action
    from tests.unit.test_actuator_plan import NOW, incident, node

    ledger = Ledger()
    ledger.flow("part-1", NOW)
    ledger.set_flow_value("part-1", "part", "example.com/ib-switch=leaf-7", NOW)
    ledger.own(taint_effect_key(taint_key("ib-switch"), "NoSchedule"), "part-1")
    policies = load_yaml_text(POLICY)
    settings = ActuatorSettings()
    sxid = incident(code=24007, action=Action.RESET_GPU, kind=FaultKind.SXID, iid="sxid-1")
    nvlink = incident(code=74, action=Action.RESET_GPU, iid="nvlink-1")
    xid79 = incident(code=79, iid="xid79-1")
    for inc in (sxid, nvlink):
        plan = plan_incident(inc, policies, node(ledger=ledger), settings, NOW)
        assert plan.skip_reason == "blamed on shared part example.com/ib-switch=leaf-7" and not plan.steps
        assert plan_incident(inc, policies, node(), settings, NOW).steps  # no part: the node's own rule
    # A lost GPU is the node's own fault, part or not.
    assert [s.name for s in plan_incident(xid79, policies, node(ledger=ledger), settings, NOW).steps][:2] == [
        "cordon", "taint"]
    # Once the part's effects are removed (xidflow reset), the node's rules apply again.
    ledger.owned.clear()
    assert plan_incident(sxid, policies, node(ledger=ledger), settings, NOW).skip_reason is None


def test_a_reset_node_leaves_the_part_and_the_last_one_closes_it() -> None:
    from pipeline.actuator.sharedparts import forget_node

    rule = load_yaml_text(POLICY).shared_parts[0]
    state: dict = {}
    for i in range(3):
        observe_all(state, signal(f"n{i}", float(i)), [(rule, "leaf-7")], 0.0)
    key = "example.com/ib-switch=leaf-7"
    assert forget_node(state, key, "n0")
    assert PartState.model_validate(state["parts"][key]).incident.nodes == ["n1", "n2"]
    assert not forget_node(state, key, "n0")  # already gone
    assert forget_node(state, key, "n1") and forget_node(state, key, "n2")
    assert key not in state["parts"]  # closed: a new storm opens a new incident
    pending = [observe_all(state, signal(f"n{i}", 100.0 + i), [(rule, "leaf-7")], 0.0) for i in range(3)]
    assert pending[-1] == [key]
