"""The action registry, the stored plan of an open flow, leases in the ledger, and node ownership (pure)."""

from __future__ import annotations

import dataclasses
from typing import Any, get_args

from aiokafka.partitioner import DefaultPartitioner

from pipeline.actuator import actions
from pipeline.actuator.actions import Kind, StopReason
from pipeline.actuator.actions.base import ActionSpecLike, PlanLike, PolicySetLike, PolicySource, StepLike
from pipeline.actuator.ownership import LEDGER_ANNOTATION, Ledger
from pipeline.actuator.plan import NodeView, Plan, Step, plan_from_ledger, plan_incident, stored
from pipeline.actuator.policy import ActionName, ActionSpec, PolicySet, load_yaml_text
from pipeline.actuator.policystore import PolicyStore
from pipeline.actuator.reconciler import needs_attention, partition_of
from pipeline.actuator.settings import ActuatorSettings
from schemas.records import RescueActionName
from tests.unit.test_actuator_plan import NOW, incident

SETTINGS = ActuatorSettings()


def view(ledger: Ledger | None = None, unschedulable: bool = False, name: str = "gpu-1") -> NodeView:
    obj: dict[str, Any] = {
        "metadata": {
            "name": name,
            "annotations": {LEDGER_ANNOTATION: ledger.to_annotation()} if ledger else {},
            "resourceVersion": "3",
        },
        "spec": {"unschedulable": unschedulable},
        "status": {"nodeInfo": {"bootID": "boot-a"}},
    }
    return NodeView.from_object(obj)


def test_every_action_is_one_registered_module_with_a_runner_for_its_kind() -> None:
    assert set(actions.ACTION_NAMES) == set(actions.REGISTRY)
    for name, action in actions.REGISTRY.items():
        assert action.name == name
        if action.kind == Kind.NODE:
            assert action.change is not None and action.run is None
        elif action.kind in (Kind.INSTANT, Kind.LONG):
            assert action.run is not None and action.change is None
        else:
            assert action.expand is not None
    assert actions.names(needs_claim=True) == {"drain", "reboot", "resetGpu", "diagnose", "enableWarmStandby"}
    assert actions.names(disruptive=True) == {"drain", "reboot", "resetGpu"}
    assert actions.names(repairs=True) == {"reboot", "resetGpu"}
    assert actions.names(uses_repair_budget=True) == {"drain", "reboot", "resetGpu", "diagnose"}
    assert actions.names(quarantining=True) == {"cordon", "taint"}


def test_policy_and_requests_take_their_action_names_from_the_registry() -> None:
    assert get_args(ActionName) == actions.ACTION_NAMES
    assert actions.names(requestable=True) == set(get_args(RescueActionName))


def _members(protocol: type) -> set[str]:
    return {n for n, v in vars(protocol).items() if isinstance(v, property) or (callable(v) and not n.startswith("_"))}


def test_what_actions_read_is_what_plan_policy_and_the_store_provide() -> None:
    # The actions package declares Protocols instead of importing plan/policy/policystore (which sit above
    # it): a renamed field there must fail here, since no type checker runs in CI.
    assert _members(ActionSpecLike) <= set(ActionSpec.model_fields)
    assert _members(StepLike) <= {f.name for f in dataclasses.fields(Step)}
    assert _members(PlanLike) <= {f.name for f in dataclasses.fields(Plan)}
    assert all(callable(getattr(PolicySet, n)) for n in _members(PolicySetLike))
    assert _members(PolicySource) == {"current"} and isinstance(PolicyStore(None, SETTINGS).current, PolicySet)


def test_an_open_flow_is_stored_and_replanned_the_same_way_after_a_policy_change() -> None:
    policies = load_yaml_text(
        "kind: RescuePolicy\nmetadata: {name: r}\nspec:\n  rules:\n"
        "  - {name: r79, priority: 10, codes: [79], actions: [{name: cordon, waittime: 5},"
        " {name: drain, gracePeriodCap: 0, excludedNamespaces: [kube-system]}, {name: reboot, hook: annotation}]}\n"
    )
    inc = incident()
    plan = plan_incident(inc, policies, view(), SETTINGS, NOW)
    ledger = Ledger()
    assert ledger.open_flow(inc.incident_id, stored(plan, inc), NOW)
    assert not ledger.open_flow(inc.incident_id, stored(plan, inc), NOW)  # kept as first recorded
    got = plan_from_ledger(view(ledger), inc.incident_id, SETTINGS)
    assert got is not None
    again, record = got
    assert record == inc
    assert [(s.key, s.spec) for s in again.steps] == [(s.key, s.spec) for s in plan.steps]
    assert again.rule == "r79" and again.problem == plan.problem
    # A new policy does not change the recorded plan; a finished flow has none.
    assert plan_incident(inc, PolicySet(), view(ledger), SETTINGS, NOW).steps != again.steps
    ledger.finish(inc.incident_id, "done", NOW + 1)
    assert ledger.open_flows() == [] and plan_from_ledger(view(ledger), inc.incident_id, SETTINGS) is None


def test_a_lease_is_renewed_by_its_holder_only_and_lapses_when_not_renewed() -> None:
    ledger = Ledger()
    ledger.claim("f", "drain", "rep-a", NOW)
    assert ledger.claim_holder("f", "drain", NOW + 10, 15) == "rep-a"
    assert ledger.renew("f", "drain", "rep-a", NOW + 10)
    assert ledger.claim_holder("f", "drain", NOW + 24, 15) == "rep-a"
    assert not ledger.renew("f", "drain", "rep-b", NOW + 24)
    assert ledger.claim_holder("f", "drain", NOW + 26, 15) is None  # rep-a stopped renewing
    ledger.claim("f", "drain", "rep-b", NOW + 26)
    assert not ledger.renew("f", "drain", "rep-a", NOW + 27)  # the old holder learns it lost the lease


def test_who_applied_a_step_is_kept_and_open_flows_survive_pruning() -> None:
    ledger = Ledger()
    ledger.open_flow("open", {"rec": {}, "steps": []}, NOW - 100)
    ledger.record_applied("open", "cordon", {"by": "rep-a", "at": NOW, "outcome": "applied"}, NOW)
    for i in range(5):
        ledger.flow(f"old-{i}", NOW + i)
    ledger.prune(2)
    assert "open" in ledger.flows and ledger.applied("open", "cordon") == {
        "by": "rep-a",
        "at": NOW,
        "outcome": "applied",
    }


def test_node_ownership_follows_kafkas_default_partitioner() -> None:
    partitioner = DefaultPartitioner()
    for i in range(200):
        node = f"gpu-node-{i}"
        assert partition_of(node, 12) == partitioner(node.encode(), list(range(12)), list(range(12)))


def test_a_node_needs_attention_for_an_open_flow_or_a_removed_cordon_of_ours() -> None:
    assert not needs_attention(view())
    ledger = Ledger()
    ledger.open_flow("f", {"rec": {}, "steps": []}, NOW)
    assert needs_attention(view(ledger))
    ledger.finish("f", "done", NOW)
    assert not needs_attention(view(ledger))
    ledger.own("cordon", "f")
    assert not needs_attention(view(ledger, unschedulable=True))
    assert needs_attention(view(ledger, unschedulable=False))


def test_stop_reasons_are_typed() -> None:
    assert {r.value for r in StopReason} == {"cancelled", "failed", "held", "lease-lost"}


def test_a_newer_revision_replaces_the_plan_and_reopens_a_finished_flow() -> None:
    ledger = Ledger()
    assert ledger.open_flow("f", {"steps": [1]}, NOW, rev=1)
    assert not ledger.open_flow("f", {"steps": [1]}, NOW, rev=1)  # a redelivery changes nothing
    ledger.finish("f", "done", NOW + 1)
    assert not ledger.open_flow("f", {"steps": [1]}, NOW + 2, rev=1)
    assert ledger.open_flow("f", {"steps": [1, 2]}, NOW + 3, rev=2, replace=True)
    assert ledger.is_open("f") and ledger.revision("f") == 2 and ledger.stored_plan("f") == {"steps": [1, 2]}
