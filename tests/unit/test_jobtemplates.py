"""Hook Job templates: the operator's image (by digest) and command and nothing else, the hook ServiceAccount,
no credentials, one pod once: the shape the hook-jobs admission policy demands."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from pipeline.actuator import effects
from pipeline.actuator.jobtemplates import JobTemplateError, enforce, validate_job_template

SA = "xidflow-node-ops"


def rendered(template: str = effects.DEFAULT_REBOOT_JOB) -> dict[str, Any]:
    return effects.render_job(template, "xidflow-reboot-abc", "xidflow-system", "gpu-1", {"xidflow.dev/flow": "f"})


@pytest.mark.parametrize("template", [effects.DEFAULT_REBOOT_JOB, effects.DEFAULT_RESET_JOB])
def test_built_in_templates_pass_and_run_as_the_hook_service_account_without_a_token(template: str) -> None:
    job = enforce(rendered(template), SA)
    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == SA
    assert pod["automountServiceAccountToken"] is False
    assert pod["nodeName"] == "gpu-1"
    # The operator's image and command are kept as they are.
    original = yaml.safe_load(template)["spec"]["template"]["spec"]["containers"]
    assert [(c["image"], c["command"]) for c in pod["containers"]] == [(c["image"], c["command"]) for c in original]


def _with(mutate: Any) -> dict[str, Any]:
    job = copy.deepcopy(rendered())
    mutate(job["spec"]["template"]["spec"])
    return job


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda p: p["volumes"].append({"name": "t", "secret": {"secretName": "api"}}) if "volumes" in p
         else p.update(volumes=[{"name": "t", "secret": {"secretName": "api"}}]), "volumes"),
        (lambda p: p.update(volumes=[{"name": "t", "projected": {"sources": []}}]), "volumes"),
        (lambda p: p.update(volumes=[{"name": "h", "hostPath": {"path": "/"}}]), "volumes"),
        (lambda p: p.update(serviceAccountName="xidflow-actuator"), "serviceAccountName"),
        (lambda p: p.update(serviceAccount="default"), "serviceAccount"),
        (lambda p: p.update(automountServiceAccountToken=True), "automountServiceAccountToken"),
        (lambda p: p["containers"][0].pop("image"), "containers[0].image"),
        (lambda p: p["containers"][0].pop("command"), "containers[0].command"),
        (lambda p: p["containers"][0].update(envFrom=[{"secretRef": {"name": "api"}}]), "containers[0].envFrom"),
        (lambda p: p["containers"][0].update(env=[{"name": "T", "valueFrom": {"secretKeyRef": {"name": "a",
                                                                                              "key": "b"}}}]),
         "containers[0].env[0]"),
        (lambda p: p["containers"][0].update(env=[{"name": "LD_PRELOAD", "value": "/tmp/x.so"}]),
         "containers[0].env[0]"),
        (lambda p: p.update(initContainers=[{"name": "i", "image": "x"}]), "initContainers"),
        (lambda p: p["containers"][0].update(args=["--force"]), "containers[0].args"),
        (lambda p: p["containers"][0].update(lifecycle={"postStart": {"exec": {"command": ["sh"]}}}),
         "containers[0].lifecycle"),
        (lambda p: p["containers"][0].update(livenessProbe={"exec": {"command": ["sh"]}}),
         "containers[0].livenessProbe"),
        (lambda p: p["containers"][0].update(volumeMounts=[{"name": "h", "mountPath": "/h"}]),
         "containers[0].volumeMounts"),
        (lambda p: p["containers"][0].update(image="busybox:1.36"), "containers[0].image"),
        (lambda p: p.update(hostNetwork=True), "hostNetwork"),
        (lambda p: p.update(hostIPC=True), "hostIPC"),
        (lambda p: p["containers"].append(dict(p["containers"][0], name="two")), "containers"),
        (lambda p: p.update(ephemeralContainers=[{"name": "e"}]), "ephemeralContainers"),
        (lambda p: p.update(containers=[]), "containers"),
    ],
)
def test_unsafe_templates_are_refused_naming_the_field(mutate: Any, field: str) -> None:
    with pytest.raises(JobTemplateError, match=f"spec.template.spec.{field}".replace("[", r"\[").replace("]", r"\]")):
        enforce(_with(mutate), SA)


@pytest.mark.parametrize(("change", "field"), [
    ({"backoffLimit": 6}, "spec.backoffLimit"), ({"parallelism": 3}, "spec.parallelism"),
    ({"completions": 2}, "spec.completions"),
])
def test_a_hook_runs_one_pod_once(change: dict[str, int], field: str) -> None:
    job = copy.deepcopy(rendered())
    job["spec"].update(change)
    with pytest.raises(JobTemplateError, match=field):
        enforce(job, SA)


def test_the_built_in_hooks_are_the_documented_ones_pinned_by_digest() -> None:
    for template, (image, command) in zip((effects.DEFAULT_REBOOT_JOB, effects.DEFAULT_RESET_JOB,
                                           effects.DEFAULT_DIAGNOSTICS_JOB),
                                          effects.DOCUMENTED_HOOKS, strict=True):
        [container] = yaml.safe_load(template)["spec"]["template"]["spec"]["containers"]
        assert (container["image"], tuple(container["command"])) == (image, command)
        assert "@sha256:" in image


def test_only_jobs_are_templates() -> None:
    with pytest.raises(JobTemplateError, match="batch/v1 Job"):
        validate_job_template({"apiVersion": "v1", "kind": "Pod", "spec": {}})
    with pytest.raises(JobTemplateError, match="spec.template.spec"):
        validate_job_template({"kind": "Job", "spec": {}})


def test_a_template_naming_the_hook_service_account_itself_is_accepted() -> None:
    job = enforce(_with(lambda p: p.update(serviceAccountName=SA, automountServiceAccountToken=False)), SA)
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == SA
