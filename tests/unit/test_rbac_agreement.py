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


def test_the_chart_renders_the_shipped_hook_jobs_admission_policy() -> None:
    text = helm_template(CHART, release="xidflow", namespace="xidflow-system", values_files=(), set_values={},
                         log=lambda _m: None)
    rendered = [d for d in yaml.safe_load_all(text) if d and d["metadata"]["name"].endswith("-hook-jobs")]
    for doc in rendered:
        doc["metadata"].pop("labels")
    shipped = [d for d in yaml.safe_load_all((ROOT / "deploy" / "rbac" / "hook-jobs-admission.yaml").read_text()) if d]
    assert rendered == shipped
