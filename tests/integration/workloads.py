"""Workloads as users create them (Deployments, StatefulSets, DaemonSets, Jobs, PodDisruptionBudgets), placed on a
test's own nodes; the real scheduler, the controllers and KWOK do the rest, and the helpers wait for what they report.

Every workload is pinned to one node with a ``kubernetes.io/hostname`` node selector (the label each machine's node
registers with): the control plane is shared by the whole test session, and a pod of one test must never land on
another test's node. A replacement the scheduler cannot place (its node cordoned) stays Pending, unbound.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes import client

from pipeline.actuator.kube import AlreadyExists, Kube
from pipeline.actuator.machines import hostname
from pipeline.actuator.nodeview import CORDON_ANSWER_TAINT as UNSCHEDULABLE_TAINT
from pipeline.localinfra.kwok import POD_COMPLETE_LABEL, POD_FAIL_LABEL

HOSTNAME = "kubernetes.io/hostname"
UNSCHEDULABLE_TOLERATION = {"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}
"""What lets the scheduler place a pod on a cordoned node (DaemonSet pods carry it)."""


async def ensure_ns(kube: Kube, name: str) -> None:
    try:
        await kube._call(kube.core.create_namespace, {"metadata": {"name": name}})
    except AlreadyExists:
        pass


def pod_template(labels: dict[str, str], node: str | None, gpus: int = 0, *,
                 tolerations: list[dict[str, Any]] | None = None, restart: str | None = None,
                 annotations: dict[str, str] | None = None, container_name: str = "c",
                 claim_templates: tuple[str, ...] = (),
                 node_selector: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod template (pure): one container, ``gpus`` ``nvidia.com/gpu`` limit, pinned to ``node`` when given, else
    placed by ``node_selector`` (a test's fleet label: the scheduler chooses among the test's own nodes); with
    ``claim_templates``, one DRA ResourceClaim per pod from each named ResourceClaimTemplate (the resource claim
    controller creates them, the scheduler allocates them)."""
    container: dict[str, Any] = {"name": container_name, "image": "busybox"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    spec: dict[str, Any] = {"containers": [container], "terminationGracePeriodSeconds": 30}
    if claim_templates:
        spec["resourceClaims"] = [{"name": f"dev{i}", "resourceClaimTemplateName": t}
                                  for i, t in enumerate(claim_templates)]
        container["resources"] = {"claims": [{"name": f"dev{i}"} for i in range(len(claim_templates))]}
    if node:
        spec["nodeSelector"] = {HOSTNAME: hostname(node)}
    elif node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        spec["tolerations"] = tolerations
    if restart:
        spec["restartPolicy"] = restart
    meta: dict[str, Any] = {"labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    return {"metadata": meta, "spec": spec}


def selector_of(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def running(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return status.get("phase") == "Running" and ready and not pod["metadata"].get("deletionTimestamp")


async def list_pods(kube: Kube, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
    page = await kube._call(kube.core.list_namespaced_pod, namespace, label_selector=selector_of(labels))
    return page.get("items") or []


async def wait_running(kube: Kube, namespace: str, labels: dict[str, str], count: int, node: str | None = None,
                       limit_s: float = 90) -> list[str]:
    """Until ``count`` pods with ``labels`` run (scheduled, made Running and Ready by KWOK); their names, sorted."""
    deadline = time.monotonic() + limit_s
    while True:
        pods = [p for p in await list_pods(kube, namespace, labels)
                if running(p) and (node is None or p["spec"].get("nodeName") == node)]
        if len(pods) >= count:
            return sorted(p["metadata"]["name"] for p in pods)
        if time.monotonic() >= deadline:
            states = [(p["metadata"]["name"], p["spec"].get("nodeName"), (p.get("status") or {}).get("phase"))
                      for p in await list_pods(kube, namespace, labels)]
            raise AssertionError(f"{count} pod(s) {labels} not running{f' on {node}' if node else ''} within "
                                 f"{limit_s:g}s: {states}")
        await asyncio.sleep(0.2)


async def deployment(kube: Kube, namespace: str, name: str, node: str | None, replicas: int, labels: dict[str, str],
                     gpus: int = 0, tolerations: list[dict[str, Any]] | None = None,
                     claim_templates: tuple[str, ...] = (), node_selector: dict[str, str] | None = None) -> list[str]:
    """A Deployment on ``node`` (or where ``node_selector`` lets the scheduler put it); its running pods' names once
    the ReplicaSet, the scheduler and KWOK ran them."""
    apps = client.AppsV1Api(kube.api_client)
    template = pod_template(labels, node, gpus, tolerations=tolerations, claim_templates=claim_templates,
                            node_selector=node_selector)
    body = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": replicas, "selector": {"matchLabels": labels}, "template": template}}
    await kube._call(apps.create_namespaced_deployment, namespace, body)
    return await wait_running(kube, namespace, labels, replicas, node)


async def statefulset(kube: Kube, namespace: str, name: str, node: str, replicas: int, labels: dict[str, str],
                      gpus: int = 0, container_name: str = "c", claim_templates: tuple[str, ...] = ()) -> list[str]:
    """A StatefulSet on ``node`` (pods ``<name>-0`` ...), all pods started at once; returns their names when running."""
    apps = client.AppsV1Api(kube.api_client)
    template = pod_template(labels, node, gpus, container_name=container_name, claim_templates=claim_templates)
    body = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name, "namespace": namespace},
            "spec": {"replicas": replicas, "serviceName": name, "podManagementPolicy": "Parallel",
                     "selector": {"matchLabels": labels}, "template": template}}
    await kube._call(apps.create_namespaced_stateful_set, namespace, body)
    return await wait_running(kube, namespace, labels, replicas, node)


async def trainers(kube: Kube, namespace: str, node: str, replicas: int, gpus: int) -> list[str]:
    """A training StatefulSet ``<node>-trainer`` on ``node`` (pods ``<node>-trainer-0`` ...); their names."""
    name = f"{node}-trainer"
    return await statefulset(kube, namespace, name, node, replicas, {"app": "train", "xidflow.test/set": name}, gpus)


async def daemonset(kube: Kube, namespace: str, name: str, node: str, labels: dict[str, str],
                    tolerations: list[dict[str, Any]] | None = None) -> str:
    """A DaemonSet whose node selector matches ``node`` alone; returns the pod the DaemonSet controller put there."""
    apps = client.AppsV1Api(kube.api_client)
    template = pod_template(labels, node, tolerations=tolerations)
    body = {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"matchLabels": labels}, "template": template}}
    await kube._call(apps.create_namespaced_daemon_set, namespace, body)
    (pod,) = await wait_running(kube, namespace, labels, 1, node)
    return pod


async def mirror_pod(kube: Kube, namespace: str, name: str, node: str, labels: dict[str, str]) -> str:
    """The mirror of a static pod: what a kubelet posts for a pod it runs from a local manifest (bound to its node,
    annotated ``kubernetes.io/config.mirror``). KWOK posts none, so the test does, as the node's kubelet."""
    body = {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels,
                         "annotations": {"kubernetes.io/config.mirror": "static"}},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "busybox"}]}}
    await kube._call(kube.core.create_namespaced_pod, namespace, body)
    await wait_running(kube, namespace, labels, 1, node)
    return name


def job_body(namespace: str, name: str, node: str | None, labels: dict[str, str], *, complete: bool = True,
             fail: bool = False, backoff_limit: int = 0, gpus: int = 0,
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Job whose pod KWOK completes (``complete``), keeps running (not ``complete``) or fails (``fail``). Pure."""
    pod_labels = dict(labels)
    if not complete:
        pod_labels[POD_COMPLETE_LABEL] = "false"
    if fail:
        pod_labels[POD_FAIL_LABEL] = "true"
    template = pod_template(pod_labels, node, gpus, restart="Never")
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "namespace": namespace},
            "spec": {"backoffLimit": backoff_limit, "template": template, **(extra or {})}}


async def job(kube: Kube, namespace: str, name: str, node: str | None, labels: dict[str, str], **kw: Any) -> dict:
    return await kube.create_job(namespace, job_body(namespace, name, node, labels, **kw))


async def wait_job(kube: Kube, namespace: str, name: str, condition: str, limit_s: float = 60) -> dict[str, Any]:
    """Until the Job controller sets ``condition`` (``Complete``, ``Failed``) on the Job; the Job."""
    deadline = time.monotonic() + limit_s
    while True:
        found = await kube.get_job(namespace, name)
        conditions = (found.get("status") or {}).get("conditions") or []
        if any(c.get("type") == condition and c.get("status") == "True" for c in conditions):
            return found
        if time.monotonic() >= deadline:
            raise AssertionError(f"Job {namespace}/{name} not {condition} within {limit_s:g}s: {found.get('status')}")
        await asyncio.sleep(0.2)


async def pdb(kube: Kube, namespace: str, name: str, labels: dict[str, str], min_available: int,
              limit_s: float = 60) -> dict[str, Any]:
    """A PodDisruptionBudget; returns its status once the disruption controller has computed it."""
    policy = client.PolicyV1Api(kube.api_client)
    body = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": name},
            "spec": {"minAvailable": min_available, "selector": {"matchLabels": labels}}}
    created = await kube._call(policy.create_namespaced_pod_disruption_budget, namespace, body)
    return await pdb_status(kube, namespace, name, created["metadata"]["generation"], limit_s)


async def set_pdb_min_available(kube: Kube, namespace: str, name: str, min_available: int) -> dict[str, Any]:
    """Change the budget (as its owner does); returns the disruption controller's new status."""
    policy = client.PolicyV1Api(kube.api_client)
    patched = await kube._call(policy.patch_namespaced_pod_disruption_budget, name, namespace,
                               {"spec": {"minAvailable": min_available}})
    return await pdb_status(kube, namespace, name, patched["metadata"]["generation"])


async def pdb_status(kube: Kube, namespace: str, name: str, generation: int, limit_s: float = 60) -> dict[str, Any]:
    """The PDB's status once the disruption controller has observed ``generation``."""
    policy = client.PolicyV1Api(kube.api_client)
    deadline = time.monotonic() + limit_s
    while True:
        found = await kube._call(policy.read_namespaced_pod_disruption_budget, name, namespace)
        status = found.get("status") or {}
        if status.get("observedGeneration", 0) >= generation:
            return status
        if time.monotonic() >= deadline:
            raise AssertionError(f"the disruption controller did not compute PDB {namespace}/{name} within "
                                 f"{limit_s:g}s: {status}")
        await asyncio.sleep(0.2)


async def cordon_answered(kube: Kube, node: str, limit_s: float = 30) -> None:
    """Until the node lifecycle controller has answered a cordon with its ``node.kubernetes.io/unschedulable``
    taint: after that, nobody else writes the node (a test comparing resource versions starts here)."""
    deadline = time.monotonic() + limit_s
    while not any(t["key"] == UNSCHEDULABLE_TAINT for t in (await kube.get_node(node))["spec"].get("taints") or []):
        if time.monotonic() >= deadline:
            raise AssertionError(f"the node lifecycle controller did not taint the cordoned {node} in {limit_s:g}s")
        await asyncio.sleep(0.1)


async def pods_on(kube: Kube, node: str) -> list[str]:
    """The names of the pods bound to ``node`` (``spec.nodeName``), sorted."""
    return sorted(p["metadata"]["name"] for p in await kube.list_pods_on_node(node))


@dataclass(frozen=True)
class PodState:
    """One pod as one watch event showed it."""

    at: float
    """``time.time()`` when the event arrived."""
    kind: str
    """The watch event: ADDED, MODIFIED, DELETED."""
    name: str
    node: str | None
    phase: str | None
    ready: bool
    deleting: bool
    labels: dict[str, str]
    conditions: dict[str, tuple[str, str]]
    """Condition type -> (status, reason)."""

    @classmethod
    def of(cls, kind: str, pod: dict[str, Any], at: float) -> PodState:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        conditions = {c["type"]: (c.get("status", ""), c.get("reason") or "") for c in status.get("conditions") or []}
        return cls(at, kind, meta.get("name", ""), (pod.get("spec") or {}).get("nodeName"), status.get("phase"),
                   conditions.get("Ready", ("",))[0] == "True", bool(meta.get("deletionTimestamp")),
                   dict(meta.get("labels") or {}), conditions)

    @property
    def healthy(self) -> bool:
        """What the disruption controller counts as healthy: Ready, not being deleted, not gone."""
        return self.kind != "DELETED" and self.ready and not self.deleting


class Timeline:
    """Every change of a namespace's pods, as one watch from a list's resourceVersion delivers them (none missed
    between two looks), with the time each arrived: what the controllers, the scheduler and KWOK did, and when."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube, self.namespace = kube, namespace
        self.states: list[PodState] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Timeline:
        page = await self.kube._call(self.kube.core.list_namespaced_pod, self.namespace)
        now = time.time()
        self.states += [PodState.of("ADDED", p, now) for p in page.get("items") or []]
        self._task = asyncio.create_task(self._follow(page["metadata"]["resourceVersion"]))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _follow(self, rv: str) -> None:
        opener = functools.partial(self.kube.core.list_namespaced_pod, self.namespace)
        while True:
            events = self.kube._watch(opener, "pods", 300, resource_version=rv)
            async with contextlib.aclosing(events) as stream:
                async for event in stream:
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        raise AssertionError(f"the pod watch of {self.namespace} broke: {obj}")
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if event.get("type") != "BOOKMARK":
                        self.states.append(PodState.of(event["type"], obj, time.time()))

    def latest(self) -> dict[str, PodState]:
        """Each pod's last state (gone ones included, as ``DELETED``)."""
        return {state.name: state for state in self.states}

    def first(self, predicate: Callable[[PodState], bool]) -> dict[str, PodState]:
        """Each pod's first state that satisfies ``predicate``."""
        found: dict[str, PodState] = {}
        for state in self.states:
            if state.name not in found and predicate(state):
                found[state.name] = state
        return found

    def fewest_healthy(self, labels: dict[str, str], since: float) -> int:
        """The fewest pods with ``labels`` that were healthy at once, over every event after ``since``."""
        current: dict[str, PodState] = {}
        fewest: int | None = None
        for state in self.states:
            current[state.name] = state
            if state.at >= since:
                count = sum(1 for s in current.values() if s.healthy and labels.items() <= s.labels.items())
                fewest = count if fewest is None else min(fewest, count)
        return fewest if fewest is not None else 0
