"""Reboot, GPU-reset and diagnostics Jobs: operator-fixed templates that xidflow validates before creating them.

A hook Job runs privileged on a node, so what it runs is the operator's decision alone: its image,
command and privileges come from the template the operator installed with the actuator
(``XIDFLOW_ACTUATOR_REBOOT_JOB_TEMPLATE`` / ``..._RESET_JOB_TEMPLATE`` / ``..._DIAGNOSTICS_JOB_TEMPLATE``, else
the built-in one), never
from a rescue request or a policy. Before a Job is created xidflow checks that the template cannot
reach the cluster's credentials: the pod runs as the dedicated hook ServiceAccount
(``XIDFLOW_ACTUATOR_HOOK_SERVICE_ACCOUNT``, which holds no RBAC) with no API token mounted, and it
mounts no Secret, projected token or Secret-backed environment. Everything here is pure.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import yaml

ALLOWED_VOLUME_SOURCES = frozenset({"hostPath", "emptyDir", "downwardAPI", "configMap"})
ALLOWED_ENV_REFS = frozenset({"fieldRef", "resourceFieldRef"})


class JobTemplateError(ValueError):
    """A hook Job template that xidflow refuses; the message names the template and the field."""


class _TemplateSettings(Protocol):
    reboot_job_template: str
    reset_job_template: str
    diagnostics_job_template: str
    hook_service_account: str


def _pod_spec(job: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = job.get("spec")
    template = spec.get("template") if isinstance(spec, Mapping) else None
    pod_spec = template.get("spec") if isinstance(template, Mapping) else None
    if not isinstance(pod_spec, Mapping):
        raise JobTemplateError("spec.template.spec: required")
    return pod_spec


def _check_container(path: str, container: Any) -> None:
    if not isinstance(container, Mapping):
        raise JobTemplateError(f"{path}: must be a mapping")
    image = container.get("image")
    if not isinstance(image, str) or not image.strip():
        raise JobTemplateError(f"{path}.image: required (the operator fixes the image)")
    command = container.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(c, str) and c for c in command):
        raise JobTemplateError(f"{path}.command: required list of strings (the operator fixes the command)")
    if container.get("envFrom"):
        raise JobTemplateError(f"{path}.envFrom: not allowed (it can expose Secrets)")
    for i, env in enumerate(container.get("env") or []):
        source = (env or {}).get("valueFrom") if isinstance(env, Mapping) else None
        if source and not set(source) <= ALLOWED_ENV_REFS:
            raise JobTemplateError(f"{path}.env[{i}].valueFrom: only fieldRef/resourceFieldRef are allowed")


def validate_job_template(job: Mapping[str, Any], hook_service_account: str | None = None) -> None:
    """Raise :class:`JobTemplateError` unless ``job`` is a Job xidflow may create on a node."""
    if not isinstance(job, Mapping):
        raise JobTemplateError("template: must be a mapping (a batch/v1 Job)")
    if job.get("apiVersion", "batch/v1") != "batch/v1" or job.get("kind", "Job") != "Job":
        raise JobTemplateError("template: must be a batch/v1 Job")
    pod = _pod_spec(job)
    containers = pod.get("containers")
    if not isinstance(containers, list) or not containers:
        raise JobTemplateError("spec.template.spec.containers: at least one container is required")
    for i, container in enumerate(containers):
        _check_container(f"spec.template.spec.containers[{i}]", container)
    for i, container in enumerate(pod.get("initContainers") or []):
        _check_container(f"spec.template.spec.initContainers[{i}]", container)
    if pod.get("ephemeralContainers"):
        raise JobTemplateError("spec.template.spec.ephemeralContainers: not allowed")
    for i, volume in enumerate(pod.get("volumes") or []):
        sources = set(volume or {}) - {"name"} if isinstance(volume, Mapping) else {"?"}
        if not sources <= ALLOWED_VOLUME_SOURCES:
            raise JobTemplateError(
                f"spec.template.spec.volumes[{i}]: only {', '.join(sorted(ALLOWED_VOLUME_SOURCES))} volumes are "
                "allowed (no Secret or projected service-account token)"
            )
    if pod.get("automountServiceAccountToken") is True:
        raise JobTemplateError("spec.template.spec.automountServiceAccountToken: must not be true")
    for key in ("serviceAccountName", "serviceAccount"):
        name = pod.get(key)
        if name and name != hook_service_account:
            raise JobTemplateError(
                f"spec.template.spec.{key}: hook Jobs run as the hook ServiceAccount "
                f"({hook_service_account or 'XIDFLOW_ACTUATOR_HOOK_SERVICE_ACCOUNT'}), not {name!r}"
            )


def enforce(job: dict[str, Any], hook_service_account: str) -> dict[str, Any]:
    """The rendered Job, validated, running as the hook ServiceAccount without an API token."""
    try:
        validate_job_template(job, hook_service_account)
    except JobTemplateError as exc:
        raise JobTemplateError(f"hook Job {job.get('metadata', {}).get('name', '?')} refused: {exc}") from None
    out = copy.deepcopy(job)
    pod = out["spec"]["template"]["spec"]
    pod.pop("serviceAccount", None)
    pod["serviceAccountName"] = hook_service_account
    pod["automountServiceAccountToken"] = False
    return out


def load_template(path: str | Path, what: str, hook_service_account: str | None = None) -> dict[str, Any]:
    """An operator's template file, parsed and validated; errors name the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise JobTemplateError(f"{what} Job template {path} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise JobTemplateError(f"{what} Job template {path} is not UTF-8 text") from None
    try:
        job = yaml.safe_load(text)
    except yaml.YAMLError:
        raise JobTemplateError(f"{what} Job template {path} is not valid YAML") from None
    try:
        validate_job_template(job, hook_service_account)
    except JobTemplateError as exc:
        raise JobTemplateError(f"{what} Job template {path}: {exc}") from None
    return job


def check_operator_templates(settings: _TemplateSettings) -> None:
    """Refuse at start-up a configured reboot/reset template that is missing or unsafe."""
    account = settings.hook_service_account
    templates = ((settings.reboot_job_template, "reboot"), (settings.reset_job_template, "GPU-reset"),
                 (settings.diagnostics_job_template, "diagnostics"))
    for path, what in templates:
        if path:
            load_template(path, what, account)
