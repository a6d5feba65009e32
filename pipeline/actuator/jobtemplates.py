"""Reboot, GPU-reset and diagnostics Jobs: operator-fixed templates that xidflow validates before creating them.

A hook Job runs privileged on a node, so what it runs is the operator's decision alone: its image,
command and privileges come from the template the operator installed with the actuator
(``XIDFLOW_ACTUATOR_REBOOT_JOB_TEMPLATE`` / ``..._RESET_JOB_TEMPLATE`` / ``..._DIAGNOSTICS_JOB_TEMPLATE``, else
the built-in one), never
from a rescue request or a policy. Before a Job is created xidflow checks that it has the hook's shape,
the same shape the admission policy of ``deploy/rbac/hook-jobs-admission.yaml`` demands of every Job the
actuator creates (so that the actuator refuses at start what the API server would refuse at the first
reboot):

- one container, no init or ephemeral containers; its image pinned by digest (``@sha256:`` and 64 hex
  digits) and its command a list of strings, with nothing that runs or feeds other code: no ``args``,
  ``workingDir``, ``lifecycle`` hooks, probes, ports, volume mounts or devices, ``envFrom``, and no
  environment but ``XIDFLOW_GPU_PCI`` with a plain value;
- no volumes, no host network or IPC (the host's PID namespace is what the hooks enter);
- run as the dedicated hook ServiceAccount (``XIDFLOW_ACTUATOR_HOOK_SERVICE_ACCOUNT``, which holds no
  RBAC) without an API token; one pod, never retried (``backoffLimit: 0``: a reboot is not repeated).

The admission policy adds what only the cluster can say: the (image, command) pair is one of the
documented ones, and the node carries xidflow's taint. Everything here is pure.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import yaml

HOOK_ENV = frozenset({"XIDFLOW_GPU_PCI"})
"""Environment variables a hook container may carry (plain values only)."""
FORBIDDEN_CONTAINER_FIELDS = (
    "args", "workingDir", "lifecycle", "livenessProbe", "readinessProbe", "startupProbe", "ports",
    "volumeMounts", "volumeDevices", "envFrom",
)
"""Container fields that would run or feed code other than the pinned command (or expose the host)."""
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


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
    if not DIGEST.search(image):
        raise JobTemplateError(f"{path}.image: must be pinned by digest (name@sha256:<64 hex digits>), not {image!r}")
    command = container.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(c, str) and c for c in command):
        raise JobTemplateError(f"{path}.command: required list of strings (the operator fixes the command)")
    for name in FORBIDDEN_CONTAINER_FIELDS:
        if container.get(name):
            raise JobTemplateError(f"{path}.{name}: not allowed (the hook runs its fixed command and nothing else)")
    for i, env in enumerate(container.get("env") or []):
        if not isinstance(env, Mapping) or env.get("name") not in HOOK_ENV or set(env) - {"name", "value"}:
            raise JobTemplateError(
                f"{path}.env[{i}]: only {', '.join(sorted(HOOK_ENV))} with a plain value is allowed"
            )


def _check_job(job: Mapping[str, Any]) -> None:
    spec = job["spec"]
    if spec.get("backoffLimit") != 0:
        raise JobTemplateError("spec.backoffLimit: must be 0 (a hook runs once; a failed reboot is not repeated)")
    for name in ("parallelism", "completions"):
        if spec.get(name, 1) != 1:
            raise JobTemplateError(f"spec.{name}: must be 1 (one pod on the node)")


def validate_job_template(job: Mapping[str, Any], hook_service_account: str | None = None) -> None:
    """Raise :class:`JobTemplateError` unless ``job`` is a Job xidflow may create on a node."""
    if not isinstance(job, Mapping):
        raise JobTemplateError("template: must be a mapping (a batch/v1 Job)")
    if job.get("apiVersion", "batch/v1") != "batch/v1" or job.get("kind", "Job") != "Job":
        raise JobTemplateError("template: must be a batch/v1 Job")
    pod = _pod_spec(job)
    _check_job(job)
    containers = pod.get("containers")
    if not isinstance(containers, list) or len(containers) != 1:
        raise JobTemplateError("spec.template.spec.containers: exactly one container (the hook's)")
    _check_container("spec.template.spec.containers[0]", containers[0])
    for name in ("initContainers", "ephemeralContainers", "volumes"):
        if pod.get(name):
            raise JobTemplateError(f"spec.template.spec.{name}: not allowed")
    for name in ("hostNetwork", "hostIPC"):
        if pod.get(name):
            raise JobTemplateError(f"spec.template.spec.{name}: not allowed (the hooks need the host's PIDs only)")
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
