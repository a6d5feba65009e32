"""What a stolen actuator token can do, asked of the real API server with server-side dry runs as the actuator's
ServiceAccount, under exactly the RBAC and admission policies shipped in deploy/rbac/ (deploy/README.md, "A stolen
actuator token").

A dry run goes through authentication, RBAC and admission like the real request and stores nothing, so every
attack is tried for real and leaves no trace. Each answer is "admitted" or the API server's refusal. The last test
runs the actuator itself as that ServiceAccount under the same policies: they refuse nothing xidflow does.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from pipeline.actuator import effects, jobtemplates
from pipeline.actuator.actions.taint_device import MANAGED_BY, MANAGED_BY_VALUE
from pipeline.actuator.kube import MERGE_PATCH, STRATEGIC_PATCH, Forbidden, Invalid, Kube
from pipeline.actuator.policy import load_yaml_text
from pipeline.actuator.testing import make_incident
from pipeline.actuator.workload import GPU_FAULT_CONDITION
from tests.integration.test_actuator_effects import Env, outcomes
from tests.integration.test_actuator_rbac import apply_docs, delete_cluster_rbac, service_account_kube, shipped_rbac
from tests.integration.test_notify_workload import GPU, make_pod

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RBAC_DIR = Path(__file__).resolve().parents[2] / "deploy" / "rbac"
ADMISSION_FILES = ("hook-jobs-admission.yaml", "actuator-admission.yaml")
TAINT = "nvidia.com/gpu-fault"
OPT_OUT = "xidflow.dev/opt-out"
ADMITTED = "admitted"


def shipped_admission(home: str, suffix: str) -> list[dict[str, Any]]:
    """The shipped policies and bindings, for the actuator of namespace ``home``, named ``<name>-<suffix>``."""
    docs: list[dict[str, Any]] = []
    for name in ADMISSION_FILES:
        for doc in yaml.safe_load_all((RBAC_DIR / name).read_text()):
            if not doc:
                continue
            doc["metadata"]["name"] = f"{doc['metadata']['name']}-{suffix}"
            if doc["kind"] == "ValidatingAdmissionPolicyBinding":
                doc["spec"]["policyName"] = f"{doc['spec']['policyName']}-{suffix}"
            for condition in doc["spec"].get("matchConditions", []):
                condition["expression"] = condition["expression"].replace(":xidflow-system:", f":{home}:")
            docs.append(doc)
    return docs


class Guarded:
    """The shipped RBAC and admission policies for a home namespace, and a token of its actuator."""

    def __init__(self, env: Env, kubeconfig: str) -> None:
        self.env, self.kubeconfig = env, kubeconfig
        self.home = env.unique("home")
        self.cluster_name = env.unique("xidflow-actuator")
        self.policies = shipped_admission(self.home, env.unique("p")[-24:])
        self.api = client.AdmissionregistrationV1Api(env.kube.api_client)
        self.sa: Kube | None = None

    async def __aenter__(self) -> Guarded:
        await apply_docs(self.env.kube, shipped_rbac(self.home, self.cluster_name))
        for doc in self.policies:
            create = (self.api.create_validating_admission_policy if doc["kind"] == "ValidatingAdmissionPolicy"
                      else self.api.create_validating_admission_policy_binding)
            await self.env.kube._call(create, doc)
        self.sa = await service_account_kube(self.env.kube, self.kubeconfig, self.home, "xidflow-actuator")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.sa is not None:
            self.sa.close()
        for doc in reversed(self.policies):
            delete = (self.api.delete_validating_admission_policy if doc["kind"] == "ValidatingAdmissionPolicy"
                      else self.api.delete_validating_admission_policy_binding)
            try:
                await self.env.kube._call(delete, doc["metadata"]["name"])
            except Exception:  # noqa: BLE001 - best-effort cleanup of what this test made
                pass
        await delete_cluster_rbac(self.env.kube, self.cluster_name)
        await self.env.kube._call(self.env.kube.core.delete_namespace, self.home)


async def answer(call: Awaitable[Any]) -> str:
    try:
        await call
    except (Forbidden, Invalid) as exc:
        return f"refused: {exc.message}"
    return ADMITTED


async def until_in_force(probe: Callable[[], Awaitable[str]], refusal: str) -> None:
    """The API server needs a moment for a new policy, its binding and (for params) its informer."""
    for _ in range(300):
        if refusal in await probe():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the shipped admission policies never refused with {refusal!r}")


def hook_job(home: str, node: str, template: str = effects.DEFAULT_REBOOT_JOB, name: str = "xidflow-reboot-x") -> dict:
    """A hook Job exactly as the actuator makes it (render + enforce)."""
    job = effects.render_job(template, name, home, node, {"xidflow.dev/flow": "f"})
    return jobtemplates.enforce(job, "xidflow-node-ops")


def the_issues_job(home: str, node: str) -> dict[str, Any]:
    """What issue 37 created as the actuator: privileged, host PID and network, the host's / mounted, any node."""
    return {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "root", "namespace": home},
        "spec": {"template": {"spec": {
            "nodeName": node, "restartPolicy": "Never", "hostPID": True, "hostNetwork": True,
            "serviceAccountName": "xidflow-node-ops", "automountServiceAccountToken": False,
            "volumes": [{"name": "host", "hostPath": {"path": "/"}}],
            "containers": [{"name": "sh", "image": "alpine:3.20", "command": ["sh", "-c", "chroot /host sh"],
                            "securityContext": {"privileged": True},
                            "volumeMounts": [{"name": "host", "mountPath": "/host"}]}]}}},
    }


def variant(job: dict[str, Any], change: Callable[[dict[str, Any], dict[str, Any]], Any]) -> dict[str, Any]:
    out = copy.deepcopy(job)
    change(out, out["spec"]["template"]["spec"])
    return out


def container(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["containers"][0]


@pytest.fixture
async def world(env: Env, kubeconfig: str) -> AsyncIterator[tuple[Guarded, dict[str, str]]]:
    plain, tainted, opted_out = await env.make_nodes(3)
    await env.kube.patch_node(tainted, {"spec": {"taints": [{"key": TAINT, "effect": "NoSchedule", "value": "x"}]}})
    await env.kube.patch_node(opted_out, {"metadata": {"labels": {OPT_OUT: "true"}},
                                          "spec": {"taints": [{"key": TAINT, "effect": "NoSchedule"}]}})
    async with Guarded(env, kubeconfig) as guarded:
        yield guarded, {"plain": plain, "tainted": tainted, "opted-out": opted_out}


async def test_a_stolen_token_creates_only_documented_hook_jobs_on_quarantined_nodes(
    world: tuple[Guarded, dict[str, str]],
) -> None:
    guarded, nodes = world
    sa, home = guarded.sa, guarded.home
    assert sa is not None

    def dry_job(job: dict[str, Any]) -> Awaitable[Any]:
        return sa._call(sa.batch.create_namespaced_job, home, job, dry_run="All")

    await until_in_force(lambda: answer(dry_job(hook_job(home, nodes["plain"]))), "does not carry the taint")
    reboot = hook_job(home, nodes["tainted"])
    attempts: dict[str, dict[str, Any]] = {
        "the issue's root Job (privileged, host PID and network, host / mounted)":
            the_issues_job(home, nodes["tainted"]),
        "the reboot hook on a node in service": hook_job(home, nodes["plain"]),
        "the reboot hook on a node that opted out": hook_job(home, nodes["opted-out"]),
        "the reboot hook with args": variant(reboot, lambda j, p: container(p).update(args=["--force"])),
        "the reboot hook with a postStart hook": variant(reboot, lambda j, p: container(p).update(
            lifecycle={"postStart": {"exec": {"command": ["sh", "-c", "id"]}}})),
        "the reboot hook by tag": variant(reboot, lambda j, p: container(p).update(image="busybox:1.36")),
        "the reboot hook's image, another command": variant(reboot, lambda j, p: container(p).update(
            command=["nsenter", "-t", "1", "-a", "--", "sh"])),
        "the reboot hook with LD_PRELOAD": variant(reboot, lambda j, p: container(p).update(
            env=[{"name": "LD_PRELOAD", "value": "/tmp/x.so"}])),
        "the reboot hook mounting the host": variant(reboot, lambda j, p: (
            p.update(volumes=[{"name": "h", "hostPath": {"path": "/"}}]),
            container(p).update(volumeMounts=[{"name": "h", "mountPath": "/h"}]))),
        "the reboot hook with an init container": variant(reboot, lambda j, p: p.update(initContainers=[
            {"name": "i", "image": effects.REBOOT_IMAGE, "command": list(effects.REBOOT_COMMAND)}])),
        "the reboot hook on the host network": variant(reboot, lambda j, p: p.update(hostNetwork=True)),
        "the reboot hook retried (backoffLimit 6)": variant(reboot, lambda j, p: j["spec"].update(backoffLimit=6)),
        "the reboot hook as the namespace's default account": variant(reboot, lambda j, p: p.update(
            serviceAccountName="default", automountServiceAccountToken=True)),
        "the reboot hook left to the scheduler (no nodeName)": variant(reboot, lambda j, p: p.pop("nodeName")),
        "the diagnostics hook on a node in service": hook_job(home, nodes["plain"], effects.DEFAULT_DIAGNOSTICS_JOB,
                                                              "xidflow-diag-x"),
        "the diagnostics hook's image, another script": variant(
            hook_job(home, nodes["tainted"], effects.DEFAULT_DIAGNOSTICS_JOB, "xidflow-diag-x"),
            lambda j, p: container(p).update(command=["sh", "-c", "nsenter -t 1 -a -- sh"])),
    }
    answers = {what: await answer(dry_job(job)) for what, job in attempts.items()}
    for what, said in answers.items():
        assert said.startswith("refused:"), f"{what}: {said}"
    assert "does not carry the taint nvidia.com/gpu-fault" in answers["the reboot hook on a node in service"]
    assert "opted out" in answers["the reboot hook on a node that opted out"]
    assert "documented hook" in answers["the reboot hook by tag"]
    # What the actuator itself makes, on a node it quarantined: admitted.
    reset = hook_job(home, nodes["tainted"], effects.DEFAULT_RESET_JOB, "xidflow-gpureset-x")
    container(reset["spec"]["template"]["spec"])["env"] = [{"name": "XIDFLOW_GPU_PCI", "value": "0000:4e:00.0"}]
    diagnostics = hook_job(home, nodes["tainted"], effects.DEFAULT_DIAGNOSTICS_JOB, "xidflow-diag-x")
    diagnostics["spec"]["activeDeadlineSeconds"] = 1800  # the gate's deadline
    assert await answer(dry_job(reboot)) == ADMITTED
    assert await answer(dry_job(reset)) == ADMITTED
    assert await answer(dry_job(diagnostics)) == ADMITTED
    # RBAC: still only the home namespace.
    with pytest.raises(Forbidden):
        await sa._call(sa.batch.create_namespaced_job, "default", reboot, dry_run="All")
    # The policies bind the actuator only: an administrator's Job is not theirs to judge.
    admin = guarded.env.kube
    issue = the_issues_job(home, nodes["plain"])
    assert await answer(admin._call(admin.batch.create_namespaced_job, home, issue, dry_run="All")) == ADMITTED


async def test_a_stolen_token_cannot_relabel_nodes_or_fake_what_the_kubelet_reports(
    world: tuple[Guarded, dict[str, str]],
) -> None:
    guarded, nodes = world
    sa = guarded.sa
    assert sa is not None

    def patch(node: str, body: dict[str, Any]) -> Awaitable[Any]:
        return sa._call(sa.core.patch_node, node, body, dry_run="All", _content_type=MERGE_PATCH)

    def patch_status(node: str, body: dict[str, Any]) -> Awaitable[Any]:
        return sa._call(sa.core.patch_node_status, node, body, dry_run="All", _content_type=STRATEGIC_PATCH)

    plain = nodes["plain"]
    await until_in_force(lambda: answer(patch(plain, {"metadata": {"labels": {"x": "y"}}})), "no node labels")
    refused = {
        "lift a node's opt-out": patch(nodes["opted-out"], {"metadata": {"labels": {OPT_OUT: None}}}),
        "label a node": patch(plain, {"metadata": {"labels": {"node-role.kubernetes.io/secure": ""}}}),
        "label a node through its status": patch_status(plain, {"metadata": {"labels": {"x": "y"}}}),
        "raise a node's GPU capacity": patch_status(plain, {"status": {"capacity": {"nvidia.com/gpu": "64"}}}),
        "set a node NotReady": patch_status(plain, {"status": {"conditions": [
            {"type": "Ready", "status": "False", "reason": "Stolen", "message": "x"}]}}),
    }
    for what, call in refused.items():
        said = await answer(call)
        assert said.startswith("refused:"), f"{what}: {said}"
    admitted = {
        "cordon": patch(plain, {"spec": {"unschedulable": True}}),
        "taint": patch(plain, {"spec": {"taints": [{"key": TAINT, "effect": "NoSchedule"}]}}),
        "annotate (the ledger)": patch(plain, {"metadata": {"annotations": {"xidflow.dev/ledger": "{}"}}}),
        "set xidflow's condition": patch_status(plain, {"status": {"conditions": [
            {"type": "GpuXid", "status": "True", "reason": "XidError", "message": "x"}]}}),
    }
    for what, call in admitted.items():
        assert await answer(call) == ADMITTED, what
    with pytest.raises(Forbidden):  # RBAC: `nodes update` is no longer granted
        node = await guarded.env.kube.get_node(plain)
        await sa._call(sa.core.replace_node, plain, node, dry_run="All")


async def test_a_stolen_token_writes_only_xidflows_pod_conditions_events_and_single_device_taints(
    world: tuple[Guarded, dict[str, str]],
) -> None:
    guarded, nodes = world
    env, sa = guarded.env, guarded.sa
    assert sa is not None
    ns = env.namespace
    await env.kube._call(env.kube.core.create_namespace, {"metadata": {"name": ns}})
    await make_pod(env.kube, ns, nodes["plain"], "train-0", [], GPU)

    def pod_status(body: dict[str, Any]) -> Awaitable[Any]:
        return sa._call(sa.core.patch_namespaced_pod_status, "train-0", ns, body, dry_run="All",
                        _content_type=STRATEGIC_PATCH)

    def event(source: str, kind: str = "Pod") -> Awaitable[Any]:
        body = {"metadata": {"name": env.unique("e"), "namespace": ns}, "reason": "R", "message": "m",
                "type": "Warning", "source": {"component": source},
                "involvedObject": {"apiVersion": "v1", "kind": kind, "name": "train-0", "namespace": ns}}
        return sa._call(sa.core.create_namespaced_event, ns, body, dry_run="All")

    sa_rules = client.CustomObjectsApi(sa.api_client)  # the group/version/plural path serves built-in kinds too

    def device_rule(selector: dict[str, str]) -> Awaitable[Any]:
        body = {"apiVersion": "resource.k8s.io/v1beta2", "kind": "DeviceTaintRule",
                "metadata": {"name": env.unique("r"), "labels": {MANAGED_BY: MANAGED_BY_VALUE}},
                "spec": {"deviceSelector": selector, "taint": {"key": TAINT, "effect": "NoExecute"}}}
        return sa._call(sa_rules.create_cluster_custom_object, "resource.k8s.io", "v1beta2", "devicetaintrules",
                        body, dry_run="All")

    condition = {"type": GPU_FAULT_CONDITION, "status": "True", "reason": "XidError", "message": "m"}
    await until_in_force(lambda: answer(pod_status({"status": {"phase": "Failed"}})), "no pod phase")
    refused = {
        "fail a pod": pod_status({"status": {"phase": "Failed"}}),
        "set a pod not Ready": pod_status({"status": {"conditions": [
            {"type": "Ready", "status": "False", "reason": "Stolen"}]}}),
        "relabel a pod through its status": pod_status({"metadata": {"labels": {"app": "other"}}}),
        "an Event as the kubelet": event("kubelet"),
        "an Event about a Secret": event("xidflow-actuator", kind="Secret"),
        "a DeviceTaintRule for a whole driver": device_rule({"driver": "gpu.nvidia.com"}),
    }
    for what, call in refused.items():
        said = await answer(call)
        assert said.startswith("refused:"), f"{what}: {said}"
    assert await answer(pod_status({"status": {"conditions": [condition]}})) == ADMITTED
    assert await answer(event("xidflow-actuator")) == ADMITTED
    one = {"driver": "gpu.nvidia.com", "pool": nodes["plain"], "device": "gpu-0"}
    assert await answer(device_rule(one)) == ADMITTED


async def test_the_actuator_does_its_work_under_the_shipped_policies(
    world: tuple[Guarded, dict[str, str]],
) -> None:
    """Quarantine (cordon, taint, condition, Events, the pods' condition) and a GPU reset, as the ServiceAccount
    with every shipped policy in force; the reset's Job is admitted because the step put xidflow's taint first."""
    from pipeline.actuator.app import Actuator
    from pipeline.runtime.settings import KafkaSettings

    guarded, nodes = world
    env, sa, home = guarded.env, guarded.sa, guarded.home
    assert sa is not None
    node = nodes["plain"]
    await env.kube._call(env.kube.core.create_namespace, {"metadata": {"name": env.namespace}})
    await make_pod(env.kube, env.namespace, node, "train-0", [], GPU)
    probe = hook_job(home, node)
    await until_in_force(lambda: answer(sa._call(sa.batch.create_namespaced_job, home, probe, dry_run="All")),
                         "does not carry the taint")
    policy = load_yaml_text(
        "apiVersion: xidflow.dev/v1alpha1\nkind: RescuePolicy\nmetadata: {name: p}\nspec:\n  rules:\n"
        "  - {priority: 5, codes: [79], actions: [{name: cordon}, {name: condition}, {name: event},"
        " {name: notifyWorkload}, {name: resetGpu}]}\n"
    )
    act = Actuator(env.settings(worker_id="sa", namespace=home), KafkaSettings(KAFKA_BOOTSTRAP_SERVERS=env.bootstrap),
                   env.topics, env.kubeconfig, policy)
    act.kube.close()
    act.kube = sa
    act.engine.kube = act.breaker.kube = act.drains.kube = act.policies.kube = sa
    await act.start(consume=False)
    env.actuators.append(act)
    guarded.sa = None  # the actuator closes it
    await act.engine.handle(make_incident(node, "inc-guarded"))
    seen = outcomes(await env.audit(), node)
    for step in ("cordon", "condition", "event", "notifyWorkload", "resetGpu"):
        assert (step, "applied") in seen, seen
    after = await env.node(node)
    assert after["spec"]["unschedulable"] is True
    assert any(t["key"] == TAINT for t in after["spec"]["taints"])  # the reset step's own
    jobs = await env.kube._call(env.kube.batch.list_namespaced_job, home)
    [job] = jobs["items"]
    assert job["spec"]["template"]["spec"]["nodeName"] == node
