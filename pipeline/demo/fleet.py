"""A simulated GPU fleet on a real API server: Node objects, training pods bound to them, a PDB.

There is no kubelet in the embedded default, so the fleet does what a kubelet would: it creates
Node objects with GPU labels and capacity, reports them Ready with a boot id, binds pods by
``spec.nodeName`` and reports them Running, and maintains the PDB status the disruption controller
would compute. A "reboot" is a new ``status.nodeInfo.bootID``. Nodes first boot on ``first_boot_id``
when given: the demo passes this machine's boot id, the one its Fluent Bits stamp on kernel lines.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from kubernetes import client
from kubernetes.client.rest import ApiException

DEMO_LABEL = "xidflow.dev/demo"
GPU_LABEL = "nvidia.com/gpu.present"
STANDBY_LABEL = "xidflow.dev/standby"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Fleet:
    api: client.ApiClient
    run_id: str
    nodes: list[str] = field(default_factory=list)
    standby: list[str] = field(default_factory=list)
    namespace: str = ""
    boot_ids: dict[str, str] = field(default_factory=dict)
    first_boot_id: str | None = None  # every node's boot id before its first reboot (else a random one)

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def selector(self) -> str:
        return f"{DEMO_LABEL}={self.run_id}"

    def create(self, workers: int = 8, standby: int = 1, pods_per_node: int = 2) -> None:
        self.nodes = [f"gpu-{self.run_id}-{i:02d}" for i in range(1, workers + 1)]
        self.standby = [f"gpu-{self.run_id}-standby-{i}" for i in range(1, standby + 1)]
        for name in self.nodes:
            self._create_node(name, standby=False)
        for name in self.standby:
            self._create_node(name, standby=True)
        self.namespace = f"training-{self.run_id}"
        self.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=self.namespace)))
        for name in self.nodes:
            for j in range(pods_per_node):
                self._create_pod(f"llm-{name.rsplit('-', 1)[1]}-{j}", name)
        policy = client.PolicyV1Api(self.api)
        policy.create_namespaced_pod_disruption_budget(self.namespace, client.V1PodDisruptionBudget(
            metadata=client.V1ObjectMeta(name="llm-training"),
            spec=client.V1PodDisruptionBudgetSpec(
                max_unavailable="50%", selector=client.V1LabelSelector(match_labels={"app": "llm-training"}))))
        self.sync_pdb()

    def _create_node(self, name: str, standby: bool) -> None:
        labels = {
            GPU_LABEL: "true", DEMO_LABEL: self.run_id, "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
            "nvidia.com/gpu.count": "8", "kubernetes.io/hostname": name,
        }
        if standby:
            labels[STANDBY_LABEL] = "true"
        self.core.create_node(client.V1Node(
            metadata=client.V1ObjectMeta(name=name, labels=labels),
            spec=client.V1NodeSpec(unschedulable=standby or None)))
        self.reboot(name, initial=True)

    def reboot(self, name: str, initial: bool = False) -> str:
        """Report the node Ready with a new boot id, as a kubelet does after a reboot."""
        boot_id = (self.first_boot_id if initial else None) or str(uuid.uuid4())
        self.boot_ids[name] = boot_id
        now = _now()
        self.core.patch_node_status(name, {"status": {
            "capacity": {"nvidia.com/gpu": "8", "cpu": "96", "memory": "1048576Mi", "pods": "110"},
            "allocatable": {"nvidia.com/gpu": "8", "cpu": "94", "memory": "1000000Mi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "kubelet is posting ready status", "lastHeartbeatTime": now,
                            "lastTransitionTime": now}],
            "nodeInfo": {"bootID": boot_id, "machineID": name, "systemUUID": name, "kernelVersion": "6.8.0",
                         "osImage": "Ubuntu 24.04", "containerRuntimeVersion": "containerd://2.0",
                         "kubeletVersion": "v1.36.3", "kubeProxyVersion": "", "operatingSystem": "linux",
                         "architecture": "amd64"},
        }})
        # The node lifecycle controller would lift the admission-time not-ready taint now; the write
        # carries the resourceVersion read, so it never clobbers a taint another writer just added.
        for _ in range(10):
            node = self.core.read_node(name)
            taints = [t for t in (node.spec.taints or []) if not t.key.startswith("node.kubernetes.io/")]
            if len(taints) == len(node.spec.taints or []):
                break
            try:
                self.core.patch_node(name, {
                    "metadata": {"resourceVersion": node.metadata.resource_version},
                    "spec": {"taints": [self.api.sanitize_for_serialization(t) for t in taints] or None}})
                break
            except ApiException as exc:
                if exc.status != 409:
                    raise
        return boot_id

    def finalize_terminating_pods(self) -> int:
        """What a kubelet does once containers stopped: remove pods marked for deletion on its node."""
        done = 0
        for pod in self.core.list_namespaced_pod(self.namespace).items:
            if pod.metadata.deletion_timestamp:
                try:
                    self.core.delete_namespaced_pod(pod.metadata.name, self.namespace, grace_period_seconds=0)
                    done += 1
                except ApiException as exc:
                    if exc.status != 404:
                        raise
        return done

    def _create_pod(self, name: str, node: str) -> None:
        self.core.create_namespaced_pod(self.namespace, client.V1Pod(
            metadata=client.V1ObjectMeta(name=name, labels={"app": "llm-training"}),
            spec=client.V1PodSpec(node_name=node, termination_grace_period_seconds=5, containers=[
                client.V1Container(name="trainer", image="nvcr.io/nvidia/pytorch:25.01-py3",
                                   resources=client.V1ResourceRequirements(limits={"nvidia.com/gpu": "4"}))])))
        self.core.patch_namespaced_pod_status(name, self.namespace, {"status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "True", "lastTransitionTime": _now()}]}})

    def pods_by_node(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {n: [] for n in self.nodes}
        for pod in self.core.list_namespaced_pod(self.namespace).items:
            if pod.spec.node_name in out and not pod.metadata.deletion_timestamp:
                out[pod.spec.node_name].append(pod.metadata.name)
        return out

    def sync_pdb(self) -> None:
        """Compute the PDB status as the disruption controller would (it is absent here)."""
        policy = client.PolicyV1Api(self.api)
        try:
            pdb = policy.read_namespaced_pod_disruption_budget("llm-training", self.namespace)
        except ApiException:
            return
        pods = [p for p in self.core.list_namespaced_pod(self.namespace, label_selector="app=llm-training").items
                if not p.metadata.deletion_timestamp]
        healthy = sum(1 for p in pods if p.status and p.status.phase == "Running")
        expected = len(pods)
        max_unavailable = (expected + 1) // 2
        desired = max(0, expected - max_unavailable)
        policy.patch_namespaced_pod_disruption_budget_status("llm-training", self.namespace, {"status": {
            "observedGeneration": pdb.metadata.generation, "currentHealthy": healthy, "desiredHealthy": desired,
            "expectedPods": expected, "disruptionsAllowed": max(0, healthy - desired)}})

    def delete(self) -> None:
        for name in self.nodes + self.standby:
            try:
                self.core.delete_node(name)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        if self.namespace:
            try:
                self.core.delete_namespace(self.namespace)
            except ApiException as exc:
                if exc.status != 404:
                    raise
