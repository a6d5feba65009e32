"""The chart installed with the project's helm (``helm install``) into the session's cluster: the scheduler places
its pods, the DaemonSet, Deployment and disruption controllers keep them, KWOK runs them (no container starts).

- Three KWOK GPU nodes and one CPU node, default values: the worker and the actuator land on the CPU node only
  (``avoidGpuNodes``), the probe and Fluent Bit DaemonSets put one pod on each GPU node and none on the CPU node
  (no RuntimeClass is needed by default), the PDBs get their status from the disruption controller, and the
  node agents' ``system-node-critical`` class is resolved to its priority. Naming a RuntimeClass the cluster does
  not have (``probe.runtimeClassName: nvidia`` without the GPU Operator) makes the DaemonSet create no pod at all.
- A GPU node on which an operator let xidflow itself run (``avoidGpuNodes: ""``, pinned there): a quarantine and
  drain evicts the user's pod and leaves xidflow's own pods and every DaemonSet pod; a NoExecute quarantine taint
  then makes Kubernetes evict a DaemonSet pod without the toleration, while xidflow's pods and its DaemonSets stay.

Each test has its own release in its own namespace, its own nodes (a fleet label every selector of the release
names, so nothing of it lands on another test's node), and uninstalls it at the end. The fixed-name admission
policy for RescuePolicies (``policies.admissionPolicy``) is left out: it is cluster-wide, and other tests own it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from pipeline.actuator.actions.drain import OWN_LABEL
from pipeline.actuator.machines import create_nodes, hostname
from pipeline.actuator.policy import load_yaml_text
from pipeline.actuator.testing import make_incident, wait_until
from pipeline.localinfra.helm import helm, value_args
from schemas.records import Action, Outcome
from tests.integration.test_actuator_effects import Env
from tests.integration.workloads import daemonset, deployment, ensure_ns, list_pods, pdb_status, wait_running

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "xidflow"
SYSTEM_NODE_CRITICAL = 2000001000


@pytest.fixture
async def env(kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]) -> AsyncIterator[Env]:
    world = Env(kafka_bootstrap, kubeconfig, unique)
    await ensure_ns(world.kube, world.namespace)
    yield world
    await world.close()


class Release:
    """One ``helm install`` of the chart into the test's namespace, its selectors narrowed to the test's fleet."""

    def __init__(self, env: Env, kubeconfig: str, **values: object) -> None:
        self.env, self.kubeconfig = env, kubeconfig
        self.name = env.unique("xf")[:20].rstrip("-")
        fleet = "xidflow\\.test/fleet"
        self.values: dict[str, object] = {
            f"gpuNodeSelector.{fleet}": env.tag,
            f"worker.nodeSelector.{fleet}": env.tag,
            f"actuator.nodeSelector.{fleet}": env.tag,
            "policies.admissionPolicy": False,
            **values,
        }

    def install(self) -> None:
        helm("install", self.name, str(CHART), "--namespace", self.env.namespace, *value_args((), self.values),
             kubeconfig=self.kubeconfig, log=lambda _m: None)

    def upgrade(self, **values: object) -> None:
        helm("upgrade", self.name, str(CHART), "--namespace", self.env.namespace, "--reuse-values",
             *value_args((), values), kubeconfig=self.kubeconfig, log=lambda _m: None)

    def uninstall(self) -> None:
        helm("uninstall", self.name, "--namespace", self.env.namespace, kubeconfig=self.kubeconfig,
             log=lambda _m: None)

    def labels(self, component: str) -> dict[str, str]:
        return {"app.kubernetes.io/instance": self.name, "app.kubernetes.io/component": component}

    def object_name(self, component: str) -> str:
        return f"{self.name}-xidflow-{component}"

    async def pods(self, component: str, count: int) -> dict[str, dict[str, Any]]:
        """The component's running pods (name -> pod) once ``count`` run."""
        await wait_running(self.env.kube, self.env.namespace, self.labels(component), count, limit_s=120)
        pods = await list_pods(self.env.kube, self.env.namespace, self.labels(component))
        return {p["metadata"]["name"]: p for p in pods if not p["metadata"].get("deletionTimestamp")}


async def cpu_node(env: Env) -> str:
    """A KWOK node without GPUs (a cluster's system pool), in the test's fleet."""
    name = env.unique("cpu")
    env.nodes.append(name)
    await create_nodes(env.kube, [name], env.fleet_label)
    return name


async def test_the_chart_runs_its_control_components_off_the_gpu_nodes_and_its_agents_on_each(
    env: Env, kubeconfig: str
) -> None:
    gpus = await env.make_nodes(3)
    cpu = await cpu_node(env)
    release = Release(env, kubeconfig)
    started = time.monotonic()
    release.install()
    try:
        workers = await release.pods("worker", 2)
        actuators = await release.pods("actuator", 3)
        probes = await release.pods("probe", 3)
        shippers = await release.pods("fluent-bit", 3)
        placed = time.monotonic() - started
        # The control components on the CPU node only: none on a machine they may quarantine.
        assert {p["spec"]["nodeName"] for p in (*workers.values(), *actuators.values())} == {cpu}
        # One probe and one Fluent Bit per GPU node, none on the CPU node; no RuntimeClass needed to get them.
        for agents in (probes, shippers):
            assert sorted(p["spec"]["nodeName"] for p in agents.values()) == sorted(gpus)
            for pod in agents.values():
                assert pod["spec"]["priorityClassName"] == "system-node-critical"
                assert pod["spec"]["priority"] == SYSTEM_NODE_CRITICAL  # resolved by the Priority admission plugin
        assert all("runtimeClassName" not in p["spec"] for p in probes.values())
        key, value = OWN_LABEL
        assert all(p["metadata"]["labels"][key] == value for p in (*workers.values(), *actuators.values()))
        # The budgets are the disruption controller's.
        for component, replicas in (("worker", 2), ("actuator", 3)):
            status = await pdb_status(env.kube, env.namespace, release.object_name(component), 1)
            assert (status["currentHealthy"], status["expectedPods"], status["disruptionsAllowed"]) == (
                replicas, replicas, 1), status
        print(f"chart installed: 2 workers, 3 actuators on {cpu}, 3 probes and 3 Fluent Bits on the GPU nodes "
              f"running in {placed:.1f}s")

        # Where the GPU Operator did not install RuntimeClass "nvidia", naming it leaves the probe without a pod.
        release.upgrade(**{"probe.runtimeClassName": "nvidia"})

        async def refused() -> bool:
            selector = f"involvedObject.name={release.object_name('probe')},reason=FailedCreate"
            page = await env.kube._call(env.kube.core.list_namespaced_event, env.namespace, field_selector=selector)
            return any('RuntimeClass "nvidia" not found' in e.get("message", "") for e in page.get("items") or [])

        await wait_until(refused, 60, poll=0.5, what="the DaemonSet's FailedCreate for the missing RuntimeClass")
    finally:
        release.uninstall()


async def test_a_drain_never_evicts_xidflow_or_the_daemonsets_and_no_execute_spares_what_tolerates_it(
    env: Env, kubeconfig: str
) -> None:
    (node,) = await env.make_nodes(1)
    users = env.unique("users")
    pinned = {"kubernetes.io/hostname": hostname(node)}
    # An operator who lets xidflow run on GPU nodes (and here pins it to this one).
    release = Release(env, kubeconfig, avoidGpuNodes="", **{"worker.replicas": 1, "actuator.replicas": 2},
                      **{f"{c}.nodeSelector.kubernetes\\.io/hostname": pinned["kubernetes.io/hostname"]
                         for c in ("worker", "actuator")})
    release.install()
    try:
        own = {**await release.pods("worker", 1), **await release.pods("actuator", 2),
               **await release.pods("probe", 1), **await release.pods("fluent-bit", 1)}
        assert {p["spec"]["nodeName"] for p in own.values()} == {node}
        await ensure_ns(env.kube, users)
        (train,) = await deployment(env.kube, users, "train", node, 1, {"app": "train"}, gpus=1)
        agent = await daemonset(env.kube, users, "agent", node, {"app": "agent"})
        act = await env.actuator(load_yaml_text(
            "kind: RescuePolicy\nmetadata: {name: t}\nspec:\n  rules:\n"
            "  - {name: drain, priority: 10, codes: [79], actions: [{name: quarantine}, {name: drain, timeout: 60}]}\n"
            "  - {name: evict, priority: 10, codes: [48], actions: [{name: taint, effect: NoExecute}]}\n"
        ))
        await act.engine.handle(make_incident(node, "inc-drain"))
        records = [r for r in await env.audit() if r.node == node and r.action == "drain"]
        (drain,) = records
        assert drain.outcome == Outcome.APPLIED, drain.reason
        assert drain.details["evicted"] == [f"{users}/{train}"]
        left = set(drain.details["left_alone"])
        assert {f"{env.namespace}/{name}" for name in own} | {f"{users}/{agent}"} <= left
        still = {p["metadata"]["name"]: p["metadata"]["uid"] for p in await env.kube.list_pods_on_node(node)}
        assert {name: still.get(name) for name in own} == {name: p["metadata"]["uid"] for name, p in own.items()}

        # xidflow's taint with effect NoExecute: the taint-eviction controller evicts what does not tolerate it.
        await act.engine.handle(make_incident(node, "inc-noexecute", code=48, action=Action.RESET_GPU))
        taints = {(t["key"], t["effect"]) for t in (await env.node(node))["spec"]["taints"]}
        assert ("nvidia.com/gpu-fault", "NoExecute") in taints

        async def agent_gone() -> bool:
            return agent not in {p["metadata"]["name"] for p in await env.kube.list_pods_on_node(node)}

        await wait_until(agent_gone, 60, poll=0.2, what="the user's DaemonSet pod evicted by the taint")
        await asyncio.sleep(3)  # the controller has acted; what tolerates the taint must still be there
        after = {p["metadata"]["name"]: p for p in await env.kube.list_pods_on_node(node)}
        for name, pod in own.items():
            assert name in after and after[name]["metadata"]["uid"] == pod["metadata"]["uid"], name
            assert not after[name]["metadata"].get("deletionTimestamp"), name
        # ... and the DaemonSet controller does not put the user's agent back on it.
        assert not [name for name in after if name.startswith("agent-")]
    finally:
        release.uninstall()
        with contextlib.suppress(Exception):
            await env.kube._call(env.kube.core.delete_namespace, users)
