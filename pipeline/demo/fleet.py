"""The demo's GPU fleet, made as a user makes one: KWOK-managed GPU nodes and training workloads with PDBs.

The nodes are registered the way :mod:`pipeline.actuator.machines` registers a machine's node (its GPU
labels and capacity, its boot id, KWOK's label): KWOK heartbeats them and runs their pods. The workloads
are what a user submits: a StatefulSet (the ranks of a distributed training job) and a Deployment (the
evaluation workers that score its checkpoints), each with a PodDisruptionBudget. From then on nothing
here plays Kubernetes: the scheduler places the pods, KWOK runs them, the disruption controller keeps the
PDBs' status, the StatefulSet and ReplicaSet controllers re-create what a drain evicted, and KWOK
finalises deleted pods. What stays simulated is only what a machine does (``machines.reboot``: a new boot
id). Nodes first boot on ``first_boot_id`` when given: the demo passes this machine's boot id, the one its
Fluent Bits stamp on kernel lines.

Each workload spreads one pod per node (``topologySpreadConstraints`` on ``kubernetes.io/hostname``,
``maxSkew: 1``, ``DoNotSchedule``) and counts only the nodes it may land on (``nodeTaintsPolicy:
Honor``: a cordoned or quarantined node is no spreading domain); the pods ask for a quarter of a node's
GPUs, so a drained node's pods find room on the others, and where the spreading sends them (a node
with fewest of their kind, e.g. a warm standby just brought into service) is the scheduler's choice.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from pipeline.actuator import machines
from pipeline.actuator.kube import AlreadyExists, Kube, NotFound
from pipeline.actuator.nodeview import CORDON_ANSWER_TAINT as UNSCHEDULABLE_TAINT

DEMO_LABEL = "xidflow.dev/demo"
STANDBY_LABEL = "xidflow.dev/standby"
APP_LABEL = "app"
CONTAINER = "trainer"
HOSTNAME = "kubernetes.io/hostname"


@dataclass(frozen=True)
class Workload:
    """A training workload as a user writes it: its kind, name, size and GPUs per pod."""

    kind: str  # StatefulSet or Deployment
    name: str
    what: str
    gpus: int = 2
    max_unavailable: int = 1  # its PodDisruptionBudget

    @property
    def labels(self) -> dict[str, str]:
        return {APP_LABEL: self.name}


WORKLOADS = (
    Workload("StatefulSet", "llm-train", "the ranks of a distributed training job"),
    Workload("Deployment", "llm-eval", "evaluation workers scoring the job's checkpoints"),
)


def pod_template(w: Workload, run_id: str) -> dict[str, Any]:
    """The workload's pod template (pure): ``w.gpus`` GPUs, on the demo's nodes, one pod per node."""
    labels = {**w.labels, DEMO_LABEL: run_id}
    return {
        "metadata": {"labels": labels},
        "spec": {
            "nodeSelector": {DEMO_LABEL: run_id},  # the demo's nodes only (a shared cluster has others)
            "terminationGracePeriodSeconds": 5,
            "topologySpreadConstraints": [{
                "maxSkew": 1, "topologyKey": HOSTNAME, "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": w.labels}, "nodeTaintsPolicy": "Honor",
            }],
            "containers": [{
                "name": CONTAINER, "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                "resources": {"limits": {"nvidia.com/gpu": str(w.gpus)}},
            }],
        },
    }


def workload_body(w: Workload, run_id: str, replicas: int) -> dict[str, Any]:
    """The StatefulSet or Deployment object (pure)."""
    spec: dict[str, Any] = {"replicas": replicas, "selector": {"matchLabels": w.labels},
                            "template": pod_template(w, run_id)}
    if w.kind == "StatefulSet":
        spec |= {"serviceName": w.name, "podManagementPolicy": "Parallel"}
    return {"apiVersion": "apps/v1", "kind": w.kind, "metadata": {"name": w.name}, "spec": spec}


def pdb_body(w: Workload) -> dict[str, Any]:
    """The workload's PodDisruptionBudget (pure): at most ``w.max_unavailable`` of its pods disrupted at once."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": w.name},
            "spec": {"maxUnavailable": w.max_unavailable, "selector": {"matchLabels": w.labels}}}


def running(pod: Mapping[str, Any]) -> bool:
    """Running and Ready (as KWOK reports a pod it runs), not being deleted. Pure."""
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return status.get("phase") == "Running" and ready and not (pod.get("metadata") or {}).get("deletionTimestamp")


def pods_by_node(pods: Iterable[Mapping[str, Any]], nodes: Iterable[str]) -> dict[str, list[str]]:
    """The names of the running pods on each node, oldest first (pods that started there first). Pure."""
    out: dict[str, list[tuple[str, str]]] = {n: [] for n in nodes}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if node in out and running(pod):
            meta = pod["metadata"]
            out[node].append((meta.get("creationTimestamp") or "", meta["name"]))
    return {n: [name for _, name in sorted(v)] for n, v in out.items()}


@dataclass
class Fleet:
    kube: Kube
    run_id: str
    nodes: list[str] = field(default_factory=list)
    standby: list[str] = field(default_factory=list)
    namespace: str = ""
    boot_ids: dict[str, str] = field(default_factory=dict)
    first_boot_id: str | None = None  # every node's boot id before its first reboot (else a random one)
    workloads: Sequence[Workload] = WORKLOADS

    @property
    def selector(self) -> str:
        return f"{DEMO_LABEL}={self.run_id}"

    @property
    def apps(self) -> client.AppsV1Api:
        return client.AppsV1Api(self.kube.api_client)

    @property
    def policy(self) -> client.PolicyV1Api:
        return client.PolicyV1Api(self.kube.api_client)

    async def create_nodes(self, workers: int = 8, standby: int = 1) -> None:
        """Register the machines' nodes (KWOK's); returns when KWOK made them Ready and the standby is cordoned."""
        self.nodes = [f"gpu-{self.run_id}-{i:02d}" for i in range(1, workers + 1)]
        self.standby = [f"gpu-{self.run_id}-standby-{i}" for i in range(1, standby + 1)]
        boot_id = self.first_boot_id or str(uuid.uuid4())
        labels = {DEMO_LABEL: self.run_id}

        def standby_node(name: str) -> dict[str, Any]:
            # A warm standby registers cordoned (the node's kubelet --register-with-taints or an operator's
            # cordon at once): nothing lands on it until the warm-standby policy brings it into service.
            node = machines.node_object(name, {**labels, STANDBY_LABEL: "true"}, boot_id, gpu=True)
            return node | {"spec": {"unschedulable": True}}

        await asyncio.gather(
            machines.create_nodes(self.kube, self.nodes, labels, boot_id, gpu=True),
            machines.create_nodes(self.kube, self.standby, labels, boot_id, gpu=True, body=standby_node),
        )
        self.boot_ids = dict.fromkeys(self.nodes + self.standby, boot_id)
        # The spreading counts only untainted nodes: the standby must carry the lifecycle controller's
        # cordon taint before the first pod is placed, or it would count as an empty node.
        await asyncio.gather(*(self._until_tainted(n, UNSCHEDULABLE_TAINT) for n in self.standby))

    async def _until_tainted(self, node: str, key: str, limit_s: float = 60.0) -> None:
        deadline = time.monotonic() + limit_s
        while not any(t.get("key") == key for t in ((await self.kube.get_node(node)).get("spec") or {}).get("taints")
                      or []):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the node lifecycle controller did not taint the cordoned {node} {key} "
                                   f"within {limit_s:g}s (is kube-controller-manager running?)")
            await asyncio.sleep(0.2)

    async def create_workloads(self, progress: Callable[[str], None] | None = None, limit_s: float = 120.0) -> None:
        """The namespace, the workloads and their PDBs; returns once every pod runs (placed by the scheduler,
        run by KWOK) and the disruption controller has computed every PDB's status. ``progress(how_far)`` is
        called at every look."""
        self.namespace = f"training-{self.run_id}"
        try:
            await self.kube._call(self.kube.core.create_namespace, {"metadata": {"name": self.namespace}})
        except AlreadyExists:
            pass
        replicas = len(self.nodes)
        for w in self.workloads:
            body = workload_body(w, self.run_id, replicas)
            create = (self.apps.create_namespaced_stateful_set if w.kind == "StatefulSet"
                      else self.apps.create_namespaced_deployment)
            await self.kube._call(create, self.namespace, body)
            await self.kube._call(self.policy.create_namespaced_pod_disruption_budget, self.namespace, pdb_body(w))
        want = replicas * len(self.workloads)
        deadline = time.monotonic() + limit_s
        while True:
            pods = await self.pods()
            up = sum(1 for p in pods if running(p))
            pdbs = await self.pdbs()
            computed = sum(1 for p in pdbs if (p.get("status") or {}).get("observedGeneration")
                           and (p.get("status") or {}).get("currentHealthy") == replicas)
            if progress is not None:
                progress(f"{up}/{want} pods running, {computed}/{len(self.workloads)} PDBs computed")
            if up >= want and computed == len(self.workloads):
                return
            if time.monotonic() >= deadline:
                states = sorted(((p["metadata"]["name"], (p.get("spec") or {}).get("nodeName"),
                                  (p.get("status") or {}).get("phase")) for p in pods), key=str)
                raise RuntimeError(f"{up}/{want} training pods running and {computed}/{len(self.workloads)} PDBs "
                                   f"computed within {limit_s:g}s (the scheduler places them, KWOK runs them, the "
                                   f"disruption controller computes the PDBs): {states}")
            await asyncio.sleep(0.3)

    async def pods(self) -> list[dict[str, Any]]:
        """The workloads' pods (every phase), as the API server lists them."""
        if not self.namespace:
            return []
        page = await self.kube._call(self.kube.core.list_namespaced_pod, self.namespace, label_selector=self.selector)
        return page.get("items") or []

    async def pdbs(self) -> list[dict[str, Any]]:
        if not self.namespace:
            return []
        page = await self.kube._call(self.policy.list_namespaced_pod_disruption_budget, self.namespace)
        return page.get("items") or []

    async def ready(self) -> dict[tuple[str, str], tuple[int, int]]:
        """What each workload's controller reports: (kind, name) -> (ready replicas, replicas)."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for w in self.workloads:
            read = (self.apps.read_namespaced_stateful_set if w.kind == "StatefulSet"
                    else self.apps.read_namespaced_deployment)
            found = await self.kube._call(read, w.name, self.namespace)
            out[(w.kind, w.name)] = (int((found.get("status") or {}).get("readyReplicas") or 0),
                                     int((found.get("spec") or {}).get("replicas") or 0))
        return out

    async def reboot(self, name: str) -> str:
        """The machine reboots (``machines.reboot``): a new boot id; returns it once KWOK reports the node Ready."""
        boot_id = str(uuid.uuid4())
        await machines.reboot(self.kube, name, boot_id)
        self.boot_ids[name] = boot_id
        return boot_id

    async def delete(self) -> None:
        """The namespace (its workloads; the namespace controller deletes what is in it), then the nodes."""
        if self.namespace:
            try:
                await self.kube._call(self.kube.core.delete_namespace, self.namespace)
            except NotFound:
                pass
        await machines.delete_nodes(self.kube, self.nodes + self.standby)
