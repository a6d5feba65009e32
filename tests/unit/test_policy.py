"""RescuePolicy / WarmStandbyPolicy: loading, validation messages naming the field, rule matching."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.actuator.policy import DEFAULT_RULE, PolicyError, PolicySet, load_yaml_file, load_yaml_text
from schemas.records import FaultKind

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "policies.yaml"


def rescue(rules: str, name: str = "p") -> str:
    return f"apiVersion: xidflow.dev/v1alpha1\nkind: RescuePolicy\nmetadata: {{name: {name}}}\nspec:\n  rules:\n{rules}"


def test_example_file_loads_and_sorts_by_priority() -> None:
    policies = load_yaml_file(EXAMPLES)
    assert [r.priority for r in policies.rules] == sorted((r.priority for r in policies.rules), reverse=True)
    assert policies.standby and policies.standby[0].name == "h100-training"


def test_empty_policy_set_falls_back_to_global_default() -> None:
    rule = PolicySet().select(FaultKind.XID, 79, {})
    assert rule is DEFAULT_RULE
    assert rule.priority == 0 and not rule.codes and rule.node_selector is None
    assert [a.name for a in rule.actions] == ["quarantine"]


def test_highest_priority_wins_on_overlap() -> None:
    text = rescue(
        "  - {name: low, priority: 5, codes: [79], actions: [{name: cordon}]}\n"
        "  - {name: high, priority: 9, codes: [79], actions: [{name: event}]}\n"
    )
    assert load_yaml_text(text).select(FaultKind.XID, 79, {}).name == "high"


def test_equal_priority_prefers_the_more_specific_rule() -> None:
    text = rescue(
        "  - {name: broad, priority: 5, actions: [{name: cordon}]}\n"
        "  - {name: narrow, priority: 5, codes: [79], kinds: [xid], actions: [{name: event}]}\n"
    )
    policies = load_yaml_text(text)
    assert policies.select(FaultKind.XID, 79, {}).name == "narrow"
    assert policies.select(FaultKind.XID, 13, {}).name == "broad"


def test_codes_and_kinds_must_both_match() -> None:
    text = rescue("  - {name: sx, priority: 5, codes: [12020], kinds: [sxid], actions: [{name: cordon}]}\n")
    policies = load_yaml_text(text)
    assert policies.select(FaultKind.SXID, 12020, {}).name == "sx"
    assert policies.select(FaultKind.XID, 12020, {}) is DEFAULT_RULE


@pytest.mark.parametrize(
    ("operator", "labels", "expected"),
    [
        ("all", {"a": "1", "b": "2"}, True),
        ("all", {"a": "1"}, False),
        ("any", {"a": "1"}, True),
        ("any", {"b": "2"}, True),
        ("any", {"a": "x", "b": "y"}, False),
    ],
)
def test_node_selector_any_all(operator: str, labels: dict[str, str], expected: bool) -> None:
    text = rescue(
        f"  - name: sel\n    priority: 3\n    nodeSelector: {{operator: {operator}, labels: {{a: '1', b: '2'}}}}\n"
        "    actions: [{name: cordon}]\n"
    )
    assert (load_yaml_text(text).select(FaultKind.XID, 79, labels).name == "sel") is expected


@pytest.mark.parametrize(
    ("rules", "field"),
    [
        ("  - {priority: -1, actions: [{name: cordon}]}\n", "spec.rules[0].priority"),
        ("  - {priority: 1, actions: [{name: dance}]}\n", "spec.rules[0].actions[0].name"),
        ("  - {priority: 1, actions: []}\n", "spec.rules[0].actions"),
        ("  - {priority: 1, actions: [{name: cordon}, {name: drain, hook: job}]}\n", "spec.rules[0].actions[1].hook"),
        ("  - {priority: 1, actions: [{name: taint, effect: Sometimes}]}\n", "spec.rules[0].actions[0].effect"),
        ("  - {priority: 1, actions: [{name: reboot, hook: webhook}]}\n", "spec.rules[0].actions[0].webhookUrl"),
        ("  - {priority: 1, kinds: [xyz], actions: [{name: cordon}]}\n", "spec.rules[0].kinds[0]"),
        ("  - {priority: 1, surprise: 1, actions: [{name: cordon}]}\n", "spec.rules[0].surprise"),
        ("  - {priority: 1, actions: [{name: drain, waittime: -5}]}\n", "spec.rules[0].actions[0].waittime"),
        (
            "  - {priority: 1, nodeSelector: {operator: some}, actions: [{name: cordon}]}\n",
            "spec.rules[0].nodeSelector.operator",
        ),
        # Hook Job templates are the operator's, never a policy's.
        ("  - {actions: [{name: reboot, jobTemplate: {spec: {}}}]}\n", "spec.rules[0].actions[0].jobTemplate"),
        ("  - {actions: [{name: resetGpu, jobTemplate: {}}]}\n", "spec.rules[0].actions[0].jobTemplate"),
        # Forced deletion only where the policy names the namespaces (RBAC grants delete only there).
        ("  - {actions: [{name: drain, forceAfter: 60}]}\n", "spec.rules[0].actions[0].forceNamespaces"),
        ("  - {actions: [{name: drain, forceNamespaces: [a]}]}\n", "spec.rules[0].actions[0].forceNamespaces"),
        (
            "  - {actions: [{name: drain, forceAfter: 1, forceNamespaces: [Not_A_NS]}]}\n",
            "spec.rules[0].actions[0].forceNamespaces",
        ),
        ("  - {actions: [{name: cordon, forceNamespaces: [a]}]}\n", "spec.rules[0].actions[0].forceNamespaces"),
        ("  - {actions: [{name: taint, key: 'bad key!'}]}\n", "spec.rules[0].actions[0].key"),
        ("  - {actions: [{name: quarantine, key: '/x'}]}\n", "spec.rules[0].actions[0].key"),
    ],
)
def test_invalid_policy_is_rejected_naming_the_field(rules: str, field: str) -> None:
    with pytest.raises(PolicyError) as err:
        load_yaml_text(rescue(rules))
    assert f"RescuePolicy/p {field}:" in str(err.value)


def test_invalid_documents_name_their_problem() -> None:
    with pytest.raises(PolicyError, match=r"^kind:"):
        load_yaml_text("kind: Something\nmetadata: {name: x}\nspec: {}\n")
    with pytest.raises(PolicyError, match=r"^apiVersion:"):
        load_yaml_text("apiVersion: other/v1\nkind: RescuePolicy\nmetadata: {name: x}\nspec: {}\n")
    with pytest.raises(PolicyError, match=r"^metadata.name:"):
        load_yaml_text("kind: RescuePolicy\nspec: {rules: []}\n")
    with pytest.raises(PolicyError, match=r"spec.originLabels"):
        load_yaml_text("kind: WarmStandbyPolicy\nmetadata: {name: w}\nspec: {targetLabels: {a: b}}\n")
    with pytest.raises(PolicyError, match="duplicate rule name"):
        load_yaml_text(
            rescue("  - {name: a, actions: [{name: cordon}]}\n")
            + "\n---\n"
            + rescue("  - {name: a, actions: [{name: cordon}]}\n", name="q")
        )


def test_unnamed_rules_are_named_after_their_policy() -> None:
    policies = load_yaml_text(rescue("  - {priority: 1, actions: [{name: cordon}]}\n", name="mine"))
    assert policies.rules[0].name == "mine[0]"


def test_warm_standby_targets_follow_origin_labels() -> None:
    text = (
        "kind: WarmStandbyPolicy\nmetadata: {name: w}\n"
        "spec: {originLabels: {pool: train}, targetLabels: {pool: spare}}\n"
    )
    policies = load_yaml_text(text)
    assert policies.standby_targets({"pool": "train", "x": "y"}) == [{"pool": "spare"}]
    assert policies.standby_targets({"pool": "infer"}) == []


def test_kubectl_list_wrapper_is_unpacked() -> None:
    text = (
        "kind: List\nitems:\n"
        "- {apiVersion: xidflow.dev/v1alpha1, kind: RescuePolicy, metadata: {name: a},"
        " spec: {rules: [{priority: 2, actions: [{name: cordon}]}]}}\n"
    )
    assert load_yaml_text(text).rules[0].name == "a[0]"


def test_forced_deletion_with_its_namespaces_and_valid_taint_keys_load() -> None:
    text = rescue(
        "  - {name: d, actions: [{name: drain, forceAfter: 30, forceNamespaces: [batch, ml-train]},"
        " {name: taint, key: example.com/gpu-fault}, {name: quarantine, key: gpu_fault.v2}]}\n"
    )
    rule = load_yaml_text(text).rules[0]
    assert rule.actions[0].force_namespaces == ("batch", "ml-train")
    assert rule.actions[1].key == "example.com/gpu-fault"


# -- the store's status reporting (pure parts) --------------------------------------------------------
def _doc(generation: int, actions: list[dict[str, object]], status: dict[str, object] | None = None) -> dict:
    doc: dict = {
        "apiVersion": "xidflow.dev/v1alpha1",
        "kind": "RescuePolicy",
        "metadata": {"name": "p", "generation": generation},
        "spec": {"rules": [{"name": "r", "actions": actions}]},
    }
    if status is not None:
        doc["status"] = status
    return doc


def test_status_of_a_refused_generation_names_the_version_in_force() -> None:
    from pipeline.actuator.policystore import Tracked, desired_status, status_matches, version_in_force_from_status

    good, bad = _doc(1, [{"name": "event"}]), _doc(2, [{"name": "drain", "hook": "job"}])
    tracked = Tracked(doc=bad, valid=good, error="RescuePolicy/p spec.rules[0].actions[0].hook: not valid")
    status = desired_status(tracked)
    assert status["observedGeneration"] == 2 and status["inForceGeneration"] == 1
    condition = status["conditions"][0]
    assert (condition["type"], condition["status"], condition["reason"]) == ("Accepted", "False", "InvalidPolicy")
    assert condition["message"].endswith("generation 1 stays in force")
    assert status_matches({**status, "conditions": [{**condition, "lastTransitionTime": "t"}]}, status)
    assert not status_matches({**status, "observedGeneration": 1}, status)
    # A replica started later finds the version in force in the status and keeps it.
    recorded = version_in_force_from_status({**bad, "status": status})
    assert recorded is not None and recorded["spec"] == good["spec"] and recorded["metadata"]["generation"] == 1
    assert version_in_force_from_status({**bad, "status": {"inForceSpec": "{not json", "inForceGeneration": 1}}) is None


def test_status_of_an_accepted_generation() -> None:
    from pipeline.actuator.policystore import Tracked, desired_status

    doc = _doc(3, [{"name": "cordon"}])
    status = desired_status(Tracked(doc=doc, valid=doc))
    assert status["inForceGeneration"] == 3 and status["conditions"][0]["status"] == "True"
    assert desired_status(Tracked(doc=doc, error="bad"))["conditions"][0]["message"].endswith("not in force")
