"""deploy/rbac/actuator.yaml and the chart grant the actuator the same rights; the admission policy
shipped with the CRDs is the one the chart installs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pipeline.localinfra.helm import helm_template

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "xidflow"
ADMISSION = ROOT / "deploy" / "crds" / "admission" / "rescuepolicy-validation.yaml"


def render(**set_values: object) -> list[dict[str, Any]]:
    text = helm_template(CHART, release="rel", namespace="xidflow-system", values_files=(),
                         set_values=set_values, log=lambda _m: None)
    return [d for d in yaml.safe_load_all(text) if d]


def standalone() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((ROOT / "deploy" / "rbac" / "actuator.yaml").read_text()) if d]


def grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    return {
        (group, resource, name, verb)
        for rule in rules
        for group in rule.get("apiGroups", [])
        for resource in rule.get("resources", [])
        for name in rule.get("resourceNames") or ["*"]
        for verb in rule["verbs"]
    }


def only(docs: list[dict[str, Any]], kind: str, name_suffix: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, (kind, name_suffix, [d["metadata"]["name"] for d in found])
    return found[0]


def test_the_standalone_rbac_grants_exactly_what_the_chart_grants() -> None:
    chart, shipped = render(), standalone()
    for kind in ("ClusterRole", "Role"):
        ours = grants(only(chart, kind, "-actuator")["rules"])
        assert ours == grants(only(shipped, kind, "-actuator")["rules"]), kind
    # Including the decision API's pending-plans ConfigMap (its absence made every API request a 503).
    assert ("", "configmaps", "xidflow-rescue-plans", "update") in grants(only(shipped, "Role", "-actuator")["rules"])


def test_both_have_a_hook_service_account_without_token_or_bindings() -> None:
    for docs in (render(), standalone()):
        hook = only(docs, "ServiceAccount", "-node-ops")
        assert hook["automountServiceAccountToken"] is False
        bound = {s["name"] for d in docs if d["kind"].endswith("RoleBinding") for s in d["subjects"]}
        assert hook["metadata"]["name"] not in bound
    actuator = only(render(), "Deployment", "-actuator")
    env = {e["name"]: e.get("value") for e in actuator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["XIDFLOW_ACTUATOR_HOOK_SERVICE_ACCOUNT"] == "rel-xidflow-node-ops"


def test_the_chart_installs_the_shipped_admission_policy() -> None:
    shipped = [d for d in yaml.safe_load_all(ADMISSION.read_text()) if d]
    rendered = [d for d in render() if d["kind"].startswith("ValidatingAdmissionPolicy")
                and d["metadata"]["name"] == "rescuepolicies.xidflow.dev"]
    assert rendered == shipped
    assert (CHART / "files" / ADMISSION.name).read_bytes() == ADMISSION.read_bytes()
    off = render(**{"policies.admissionPolicy": False})
    assert not [d for d in off if d["metadata"]["name"] == "rescuepolicies.xidflow.dev"]


ADMISSION_FILES = ("hook-jobs-admission.yaml", "actuator-admission.yaml")


def shipped_actuator_admission() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name in ADMISSION_FILES:
        docs += [d for d in yaml.safe_load_all((ROOT / "deploy" / "rbac" / name).read_text()) if d]
    return docs


def test_the_chart_renders_the_shipped_actuator_admission_policies() -> None:
    text = helm_template(CHART, release="xidflow", namespace="xidflow-system", values_files=(), set_values={},
                         log=lambda _m: None)
    rendered = [d for d in yaml.safe_load_all(text) if d and d["kind"].startswith("ValidatingAdmissionPolicy")
                and d["metadata"]["name"].startswith("xidflow-actuator-")]
    for doc in rendered:
        doc["metadata"].pop("labels")
    shipped = shipped_actuator_admission()

    def by_name(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:  # helm orders documents by kind
        return sorted(docs, key=lambda d: (d["kind"], d["metadata"]["name"]))

    assert [d["metadata"]["name"] for d in by_name(rendered)] == [d["metadata"]["name"] for d in by_name(shipped)]
    assert by_name(rendered) == by_name(shipped)
    off = render(**{"actuator.hookJobsAdmissionPolicy": False, "actuator.writesAdmissionPolicy": False})
    assert not [d for d in off if d["kind"].startswith("ValidatingAdmissionPolicy")
                and d["metadata"]["name"].startswith("rel-xidflow-actuator-")]


def _expressions(name: str) -> str:
    policy = next(d for d in shipped_actuator_admission()
                  if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"] == name)
    spec = policy["spec"]
    return "\n".join(v["expression"] for v in spec.get("validations", []) + spec.get("variables", []))


def test_the_admission_policies_name_what_the_code_does() -> None:
    """One source each: the hooks, the taint, the opt-out label, the condition types and labels the actuator
    writes, as the code has them, are what the shipped policies admit."""
    import json

    from pipeline.actuator import checkpoint, conditions, effects
    from pipeline.actuator.actions.taint_device import MANAGED_BY, MANAGED_BY_VALUE
    from pipeline.actuator.settings import ActuatorSettings
    from pipeline.actuator.workload import GPU_FAULT_CONDITION

    values = yaml.safe_load((CHART / "values.yaml").read_text())["actuator"]
    assert [(h["image"], tuple(h["command"])) for h in values["hookJobs"]["allowed"]] == list(effects.DOCUMENTED_HOOKS)
    hooks = _expressions("xidflow-actuator-hook-jobs")
    for image, command in effects.DOCUMENTED_HOOKS:
        assert f"variables.container.image == {json.dumps(image)}" in hooks
        assert f"variables.container.command == {json.dumps(list(command), separators=(',', ':'))}" in hooks
    defaults = ActuatorSettings()
    node = _expressions("xidflow-actuator-hook-jobs-node")
    assert values["taint"]["key"] == defaults.taint_key and f'"{defaults.taint_key}"' in node
    assert values["optOutLabel"] == defaults.opt_out_label and f'"{defaults.opt_out_label}"' in node
    kubelet = sorted(conditions.KUBELET_TYPES)
    assert f"[{', '.join(repr(t) for t in sorted(kubelet, key=_expressions('xidflow-actuator-node-writes').find))}]" \
        in _expressions("xidflow-actuator-node-writes")
    ours = {GPU_FAULT_CONDITION, checkpoint.REQUESTED, checkpoint.DONE}
    pods = _expressions("xidflow-actuator-pod-status")
    assert f"[{', '.join(repr(t) for t in sorted(ours, key=pods.find))}]" in pods
    rules = _expressions("xidflow-actuator-device-taints")
    assert f"'{MANAGED_BY}' in object.metadata.labels" in rules and f"== '{MANAGED_BY_VALUE}'" in rules
