"""The simulated machines under the test cluster's nodes: the only simulated part of that cluster.

Everything Kubernetes does to a node and its pods is done by the real programs of the local control
plane (:mod:`pipeline.localinfra.controlplane`): KWOK is the kubelet (it makes a registered node
Ready, renews its Lease, runs the pods scheduled to it, finishes Job pods and deleted pods), the node
lifecycle controller judges its heartbeats, the scheduler and the controllers place and replace pods.
What no program here does is what the machine itself does, and that is simulated in this module:

- what the machine is: its GPUs (the labels GPU feature discovery puts on an 8-GPU node, the
  ``nvidia.com/gpu`` capacity the device plugin reports) and its boot id (``status.nodeInfo.bootID``),
  given when its node registers. KWOK's ``node-initialize`` stage keeps all three;
- what it says in its kernel log (``XID79_LINE``, the line the tests feed the pipeline);
- rebooting (``reboot``): the kubelet comes back with a new boot id, first NotReady as a starting
  kubelet reports; KWOK's ``node-initialize`` stage then makes it Ready, keeping the new boot id;
- going silent (``stop_heartbeats``): the machine is gone, so KWOK stops renewing its node's Lease and the
  node lifecycle controller, after its grace period, marks the node ``Unknown`` and taints it
  ``node.kubernetes.io/unreachable``; ``resume_heartbeats`` brings it back;
- what its programs do when xidflow's hook Jobs run on it: a reboot Job reboots it (``reboot_when_asked``), a
  diagnostics program passes or fails with a result (``finish_diagnostics``); KWOK ends their pods as the
  kubelet would and the Job controller gives the Jobs their conditions.

A node created with ``managed=False`` carries no KWOK label: no kubelet answers for it, so the node
lifecycle controller marks it ``Unknown`` after its startup grace, as on a cluster. The tests here need
none: a node that goes silent is a KWOK node whose machine stopped (``stop_heartbeats``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pipeline.actuator.kube import AlreadyExists, Kube, NotFound
from pipeline.localinfra.kwok import MANAGED_LABEL, POD_COMPLETE_LABEL, POD_FAIL_LABEL

XID79_LINE = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
"""A kernel line of a GPU that fell off the bus, as the NVIDIA driver writes it."""

GPU_LABELS = {
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.count": "8",
}
"""What GPU feature discovery puts on an 8-GPU node (the demo fleet's labels)."""
GPU_CAPACITY = {"nvidia.com/gpu": "8", "cpu": "96", "memory": "1048576Mi", "pods": "110"}
GPU_ALLOCATABLE = {"nvidia.com/gpu": "8", "cpu": "94", "memory": "1000000Mi", "pods": "110"}

KWOK_LABELS = dict([MANAGED_LABEL])
"""The label that hands a node to KWOK (its kubelet)."""
UNREADY_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
"""The node lifecycle controller's taints of a node that is not (or not yet) Ready."""


NODE_INFO_FIELDS = ("machineID", "systemUUID", "bootID", "kernelVersion", "osImage", "containerRuntimeVersion",
                    "kubeletVersion", "kubeProxyVersion", "operatingSystem", "architecture")
"""The fields of ``status.nodeInfo`` (all required by the API's schema)."""


def node_status(boot_id: str, gpu: bool = False) -> dict[str, Any]:
    """What the machine reports of itself when its node registers: the boot id and, with ``gpu``, 8 GPUs. Pure.

    No conditions: readiness is KWOK's to report. Its ``node-initialize`` stage keeps these fields and fills
    each empty ``nodeInfo`` field with its own (``amd64``, ``linux``, the kubelet version ``kwok-<version>``).
    """
    status: dict[str, Any] = {"nodeInfo": {**dict.fromkeys(NODE_INFO_FIELDS, ""), "bootID": boot_id}}
    if gpu:
        status["capacity"], status["allocatable"] = dict(GPU_CAPACITY), dict(GPU_ALLOCATABLE)
    return status


def hostname(name: str) -> str:
    """The machine's hostname, the ``kubernetes.io/hostname`` label of its node: its node's name, cut to a DNS
    label's 63 characters (a node's name may be longer; a label value may not). Pure."""
    return name[:63].rstrip("-.")


def node_object(
    name: str, labels: dict[str, str], boot_id: str = "boot-1", gpu: bool = False, managed: bool = True
) -> dict[str, Any]:
    """A Node as it registers: ``kubernetes.io/hostname`` (every kubelet sets it), KWOK's label unless
    ``managed=False``, ``labels``, and the machine's status. Pure."""
    all_labels = {"kubernetes.io/hostname": hostname(name), **(KWOK_LABELS if managed else {}),
                  **(GPU_LABELS if gpu else {}), **labels}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": all_labels},
        "status": node_status(boot_id, gpu=gpu),
    }


def node_usable(node: Mapping[str, Any]) -> bool:
    """Ready, and without the lifecycle controller's not-ready/unreachable taints: pods can land on it. Pure."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    taints = (node.get("spec") or {}).get("taints") or []
    return ready and not any(t.get("key") in UNREADY_TAINTS for t in taints)


def boot_id_of(node: Mapping[str, Any]) -> str:
    return ((node.get("status") or {}).get("nodeInfo") or {}).get("bootID", "")


async def create_nodes(
    kube: Kube,
    names: Iterable[str],
    labels: dict[str, str],
    boot_id: str = "boot-1",
    parallel: int = 32,
    gpu: bool = False,
    progress: Callable[[int], None] | None = None,
    body: Callable[[str], dict[str, Any]] | None = None,
    managed: bool = True,
    ready_within_s: float | None = None,
) -> None:
    """Register the machines' nodes, one create call each, and (``managed``) wait until KWOK made them usable.

    A node is KWOK's unless ``managed=False``; the call returns when every managed node is Ready and
    the node lifecycle controller has lifted its ``node.kubernetes.io/not-ready`` taint (the admission
    plugin TaintNodesByCondition puts it on every new node), i.e. when the scheduler may place pods
    there. A node that exists already reports ``boot_id`` (a reboot when it differs) and gains
    ``labels``. ``gpu``: GPU labels and capacity. ``progress(n)`` is called with the count of nodes
    created so far, every 100 nodes and at the end. ``body(name)``: the Node to create instead of
    ``node_object``'s (e.g. one made like another node); it is KWOK's if it carries KWOK's label.
    ``ready_within_s``: how long to wait; by default 2 minutes plus 0.1 s a node (the lifecycle controller
    lifts the taints at its client's rate, 20 writes/s by default: 10,000 nodes take about 8 minutes).
    """
    names = list(names)
    sem = asyncio.Semaphore(parallel)
    done = 0
    waited: list[str] = []
    shared = dict(labels)  # the labels every node waited for carries: the wait lists only those nodes

    async def one(name: str) -> None:
        nonlocal done
        async with sem:
            node = body(name) if body is not None else node_object(name, labels, boot_id, gpu, managed)
            if _kwoks(node):
                waited.append(name)
                node_labels = node["metadata"].get("labels") or {}
                for key in [k for k, v in shared.items() if node_labels.get(k) != v]:
                    del shared[key]
            try:
                await kube._call(kube.core.create_node, node)
            except AlreadyExists:
                await kube.patch_node(name, {"metadata": {"labels": node["metadata"].get("labels") or {}}})
                await reboot(kube, name, boot_id, wait=False)
        done += 1
        if progress is not None and done % 100 == 0:
            progress(done)

    await asyncio.gather(*(one(n) for n in names))
    if progress is not None:
        progress(done)
    if waited:
        await wait_nodes_usable(kube, waited, ready_within_s or 120.0 + 0.1 * len(waited), shared)


def _kwoks(node: Mapping[str, Any]) -> bool:
    node_labels = (node.get("metadata") or {}).get("labels") or {}
    return all(node_labels.get(k) == v for k, v in KWOK_LABELS.items())


async def wait_nodes_usable(
    kube: Kube, names: Iterable[str], limit_s: float = 120.0, labels: Mapping[str, str] | None = None
) -> None:
    """Until every named node is Ready and free of the lifecycle controller's not-ready/unreachable taints.

    ``labels``: labels all of them carry (a large fleet is then listed by them, not all of KWOK's nodes).
    """
    pending = set(names)
    selector = ",".join(f"{k}={v}" for k, v in {**KWOK_LABELS, **(labels or {})}.items())
    deadline = time.monotonic() + limit_s
    poll = 0.05
    while pending:
        if len(pending) <= 4:
            nodes = [await kube.get_node(n) for n in pending]
        else:
            nodes = await kube.list_nodes(selector)
        pending -= {n["metadata"]["name"] for n in nodes if node_usable(n)}
        if not pending:
            return
        if time.monotonic() >= deadline:
            sample = sorted(pending)[:5]
            raise AssertionError(f"{len(pending)} node(s) not Ready and untainted within {limit_s:g}s (KWOK "
                                 f"and the node lifecycle controller make them so): {sample}")
        await asyncio.sleep(poll)
        poll = min(poll * 2, 1.0)


async def delete_nodes(kube: Kube, names: Iterable[str], parallel: int = 32) -> None:
    sem = asyncio.Semaphore(parallel)

    async def one(name: str) -> None:
        async with sem:
            try:
                await kube._call(kube.core.delete_node, name)
            except NotFound:
                pass

    await asyncio.gather(*(one(n) for n in names))


async def reboot(kube: Kube, name: str, boot_id: str, wait: bool = True, limit_s: float = 60.0) -> None:
    """The machine reboots: its kubelet comes back reporting ``boot_id``, NotReady at first (as a starting
    kubelet does); KWOK's ``node-initialize`` stage makes it Ready again, keeping the boot id.

    With ``wait``, returns when the node is Ready with ``boot_id``. A node KWOK does not manage stays
    NotReady (nothing answers for it).
    """
    await kube.patch_node_status(name, {"status": {
        "nodeInfo": {"bootID": boot_id},
        "conditions": [{"type": "Ready", "status": "False", "reason": "KubeletNotReady",
                        "message": "the machine is starting (simulated reboot)"}],
    }})
    if wait:
        await _until_ready_with(kube, name, boot_id, limit_s)


async def _until_ready_with(kube: Kube, name: str, boot_id: str, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        node = await kube.get_node(name)
        if node_usable(node) and boot_id_of(node) == boot_id:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"node {name} not Ready with bootID {boot_id} within {limit_s:g}s of its reboot")
        await asyncio.sleep(0.05)


async def set_node_ready(kube: Kube, name: str, boot_id: str, ready: bool = True) -> None:
    """``ready``: the node is up with ``boot_id`` (a ``reboot`` when its boot id differs; waits until Ready).
    Not ``ready``: the machine stops (``stop_heartbeats``); the node lifecycle controller marks it ``Unknown``
    after its grace period."""
    if not ready:
        await stop_heartbeats(kube, name)
        return
    node = await kube.get_node(name)
    if boot_id_of(node) != boot_id:
        await reboot(kube, name, boot_id)
    else:
        await _until_ready_with(kube, name, boot_id, 60.0)


async def stop_heartbeats(kube: Kube, name: str) -> None:
    """The machine goes silent: its node leaves KWOK (the label goes), so nothing renews its Lease any more."""
    await kube.patch_node(name, {"metadata": {"labels": dict.fromkeys(KWOK_LABELS)}})


async def resume_heartbeats(kube: Kube, name: str) -> None:
    """The machine answers again: KWOK takes its node back and renews its Lease (Ready again once KWOK has)."""
    await kube.patch_node(name, {"metadata": {"labels": dict(KWOK_LABELS)}})


# -- what the machine's programs do when xidflow's hook Jobs run on it ----------------------------------------
HELD_POD_LABELS = {POD_COMPLETE_LABEL: "false"}
"""Pod labels of a hook Job whose program's outcome the simulated machine decides (``finish_diagnostics``): KWOK
runs the pod and leaves it running until then."""


def held_job(template: str) -> dict[str, Any]:
    """A hook Job template (YAML) whose pod the machine's program ends when a test says (``HELD_POD_LABELS``). Pure."""
    import yaml

    job = yaml.safe_load(template)
    job["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {}).update(HELD_POD_LABELS)
    return job


async def job_pods(kube: Kube, namespace: str, job: str) -> list[dict[str, Any]]:
    """The pods the Job controller made for a Job (its ``batch.kubernetes.io/job-name`` label)."""
    return await kube.list_pods(namespace, f"batch.kubernetes.io/job-name={job}")


async def finish_diagnostics(
    kube: Kube, namespace: str, job: str, passed: bool, result: Mapping[str, Any] | None = None,
    exit_code: int = 1, limit_s: float = 60.0,
) -> None:
    """The diagnostics program on the machine ends (a held diagnostics Job's pod: ``HELD_POD_LABELS``).

    Passed: the pod is let go and KWOK's ``pod-complete`` stage ends it (exit 0). Failed: KWOK's chaos stage ends
    it with ``exit_code`` and ``result`` (a JSON object) as the container's termination message, as the program
    writes it to /dev/termination-log; KWOK puts the message into its status template unquoted, so it is handed
    over YAML-quoted. Either way the Job controller reads the pod and sets the Job's condition.
    """
    deadline = time.monotonic() + limit_s
    while True:
        pods = [p for p in await job_pods(kube, namespace, job) if (p.get("status") or {}).get("phase") == "Running"]
        if pods:
            break
        if time.monotonic() >= deadline:
            raise AssertionError(f"no running pod of Job {namespace}/{job} within {limit_s:g}s")
        await asyncio.sleep(0.1)
    name = pods[0]["metadata"]["name"]
    if passed:
        body: dict[str, Any] = {"metadata": {"labels": {POD_COMPLETE_LABEL: "true"}}}
    else:
        message = json.dumps(dict(result or {"result": "fail"}), separators=(",", ":"))
        body = {"metadata": {
            "labels": {POD_FAIL_LABEL: "true"},
            "annotations": {f"{POD_FAIL_LABEL}/message": "'" + message.replace("'", "''") + "'",
                            f"{POD_FAIL_LABEL}/exit-code": str(exit_code),
                            f"{POD_FAIL_LABEL}/delay": "0", f"{POD_FAIL_LABEL}/jitter-delay": "0"},
        }}
    await kube._call(kube.core.patch_namespaced_pod, name, namespace, body)


async def reboot_when_asked(kube: Kube, namespace: str, node: str, boot_ids: Iterable[str], poll: float = 0.2) -> None:
    """The machine runs xidflow's reboot Jobs for real: each time one of them on ``node`` has run (the Job
    controller says Complete), the machine reboots with the next of ``boot_ids``. Runs until cancelled."""
    done: set[str] = set()
    ids = iter(boot_ids)
    while True:
        page = await kube._call(kube.batch.list_namespaced_job, namespace)
        for job in page.get("items") or []:
            name = job["metadata"]["name"]
            spec = job["spec"]["template"]["spec"]
            complete = any(c.get("type") == "Complete" and c.get("status") == "True"
                           for c in (job.get("status") or {}).get("conditions") or [])
            if name.startswith("xidflow-reboot-") and spec.get("nodeName") == node and complete and name not in done:
                done.add(name)
                await reboot(kube, node, next(ids))
        await asyncio.sleep(poll)
