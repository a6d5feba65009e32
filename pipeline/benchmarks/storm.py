"""Storm benchmark: N GPU nodes each get a fatal Xid at once; how fast are they all quarantined?

The incidents go through Kafka to a real actuator (consumer group, engine, ledger, breaker, audit)
against the real API server; the clock stops when every node is cordoned and tainted as seen by the
API server. The breaker limit is raised for the run. Nodes, topics' consumers and the namespace the
run made are cleaned up. Not a test: it prints and returns numbers.
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
import uuid
from typing import Any

from pipeline.actuator.app import Actuator, actuator_topics
from pipeline.actuator.kube import Conflict, Kube
from pipeline.actuator.policy import PolicySet
from pipeline.actuator.settings import ActuatorSettings
from pipeline.actuator.testing import create_nodes, delete_nodes, make_incident, publish
from pipeline.benchmarks.burst_watch import NodeWatch
from pipeline.kafka.admin import ensure_topics
from pipeline.runtime.settings import KafkaSettings, TopicNames


async def raw_quarantine(kube: Kube, name: str, taint_key: str) -> None:
    """What a bare client does to quarantine one node: the read and the conditional write the actuator does.

    The write is the actuator's (``Engine._update_node``): one JSON merge patch with the node's
    resourceVersion, cordon, taint and a ledger-sized annotation. Refused (409: another writer of the node came
    between, on a cluster the controllers and the kubelet write nodes too), it reads and writes again, as any
    client that must not clobber a node's taints does.
    """
    while True:
        node = await kube.get_node(name)
        taints = [*(node.get("spec") or {}).get("taints", []), {"key": taint_key, "effect": "NoSchedule"}]
        body = {
            "metadata": {
                "resourceVersion": node["metadata"]["resourceVersion"],
                "annotations": {"xidflow.bench/ledger": LEDGER},
            },
            "spec": {"unschedulable": True, "taints": taints},
        }
        try:
            await kube.patch_node(name, body)
            return
        except Conflict:
            continue


LEDGER = "x" * 400


async def bare_client(kubeconfig: str, concurrency: int) -> Kube:
    """The baselines' bare client: a ``Kube`` with ``concurrency`` connections already open.

    Opened before any clock or API-server reading starts (``HttpCalls.warm``), as an actuator's are
    (``Kube.keep_warm``): a baseline is the API server's own time for the writes, not TLS handshakes
    (64 of them in a 500-node burst's baseline, where the actuators had opened none).
    """
    kube = Kube.from_config(kubeconfig, concurrency)
    if kube.http is not None:
        await kube.http.warm(concurrency)
    return kube


async def raw_quarantine_rate(kube: Kube, names: list[str], taint_key: str, concurrency: int) -> float:
    """Nodes/s a bare client (``bare_client``) quarantines (``raw_quarantine`` per node), ``concurrency`` at once."""
    sem = asyncio.Semaphore(concurrency)

    async def one(name: str) -> None:
        async with sem:
            await raw_quarantine(kube, name, taint_key)

    start = time.perf_counter()
    await asyncio.gather(*(one(n) for n in names))
    return len(names) / (time.perf_counter() - start)


def _count_calls(kube: Kube, calls: collections.Counter[str], timeline: list[tuple[float, str]] | None = None) -> None:
    """Count every API call this Kube makes, by client method (a profile of the storm).

    ``timeline``: each call's (time.time() when it returned, method), to place it before or after the
    storm's last taint (``calls_by_phase``). When it returned, not when it was asked for: a call held back
    behind the quarantines (``PriorityLimiter``) is asked for early and sent once they are done.
    """
    original = kube._call

    async def counted(fn: Any, *args: Any, **kwargs: Any) -> Any:
        name = getattr(fn, "__name__", str(fn))
        calls[name] += 1
        try:
            return await original(fn, *args, **kwargs)
        finally:
            if timeline is not None:
                timeline.append((time.time(), name))

    kube._call = counted  # type: ignore[method-assign]


def calls_by_phase(
    timeline: list[tuple[float, str]], start: float, last_taint: float, nodes: int
) -> dict[str, dict[str, float]]:
    """API calls per node done during the storm (up to its last taint) and after it, by method. Pure.

    What shares the API server with the taints while the clock runs, against what waits until they are done.
    """
    during: collections.Counter[str] = collections.Counter()
    after: collections.Counter[str] = collections.Counter()
    for at, name in timeline:
        if at < start:
            continue
        (during if at <= last_taint else after)[name] += 1
    per = max(nodes, 1)
    return {
        "during": {k: round(v / per, 3) for k, v in during.most_common()},
        "after": {k: round(v / per, 3) for k, v in after.most_common()},
    }


def _quarantined(node: dict[str, Any], taint_key: str) -> bool:
    spec = node.get("spec") or {}
    return bool(spec.get("unschedulable")) and any(t.get("key") == taint_key for t in spec.get("taints") or [])


class QuarantineWatch(NodeWatch):
    """When each node was first seen cordoned and carrying the taint (``tainted``: node -> time.time())."""

    def __init__(self, kube: Kube, selector: str, resource_version: str, taint_key: str) -> None:
        super().__init__(kube, selector, resource_version)
        self.taint_key = taint_key

    def _event(self, event: dict[str, Any], now: float) -> None:
        obj = event.get("object") or {}
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.rv = meta["resourceVersion"]
        name = meta.get("name")
        if event.get("type") in ("ADDED", "MODIFIED") and name and name not in self.tainted \
                and _quarantined(obj, self.taint_key):
            self.tainted[name] = now


async def storm(
    nodes: int = 500,
    bootstrap: str | None = None,
    kubeconfig: str | None = None,
    partitions: int = 8,
    api_concurrency: int = 32,
    replicas: int = 1,
    settle_s: float = 0.0,
) -> dict[str, Any]:
    bootstrap = bootstrap or KafkaSettings().bootstrap_servers
    kubeconfig = kubeconfig or os.environ.get("KUBECONFIG")
    tag = uuid.uuid4().hex[:8]
    fleet_label = {"xidflow.bench/storm": tag}
    selector = f"xidflow.bench/storm={tag}"
    topics = TopicNames(prefix=f"storm-{tag}.")
    settings = ActuatorSettings(
        gpu_node_selector=selector,
        namespace=f"xidflow-storm-{tag}",
        group_id=f"storm-{tag}",
        policy_source="file",
        breaker_max_share=1.0,  # the storm is the point: the breaker would (rightly) stop it at 50%
        api_concurrency=api_concurrency,
    )
    admin = Kube.from_config(kubeconfig, 32)
    names = [f"storm-{tag}-{i:05d}" for i in range(nodes)]
    raw_names = [f"storm-{tag}-raw-{i:05d}" for i in range(nodes)]
    actuators: list[Actuator] = []
    watch: QuarantineWatch | None = None
    calls: collections.Counter[str] = collections.Counter()
    timeline: list[tuple[float, str]] = []
    tasks: list[asyncio.Task[None]] = []
    try:
        await ensure_topics(bootstrap, actuator_topics(topics), partitions)
        await create_nodes(admin, names, fleet_label)
        for i in range(replicas):
            act = Actuator(
                settings.model_copy(update={"worker_id": f"storm-{i}"}),
                KafkaSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap),
                topics,
                kubeconfig,
                PolicySet(),
            )
            _count_calls(act.kube, calls, timeline)
            await act.start()
            actuators.append(act)
            tasks.append(asyncio.create_task(act.run()))
        # Wait for the group to settle so the clock measures remediation, not the join.
        while any(not a.consumer.consumer.assignment() for a in actuators):  # noqa: ASYNC110 - polling aiokafka state
            await asyncio.sleep(0.05)
        # And for the fleet's steady state: new actuators write xidflow's baseline conditions on every node
        # first; a storm timed meanwhile shared the API server with that sweep (a call profile counted its
        # writes as the storm's).
        await _wait_baseline(admin, selector)
        incidents = [make_incident(n, f"storm-{tag}-{i}") for i, n in enumerate(names)]
        # A watch, not a list of every node every 50 ms: those lists, parsed on this process's loop (the
        # actuators' own), were most of its orjson time in a cProfile of the storm, and loaded the API server.
        page = await admin._call(admin.core.list_node, label_selector=selector, limit=1)
        watch = QuarantineWatch(admin, selector, page["metadata"]["resourceVersion"], settings.taint_key)
        watch.start()
        await asyncio.sleep(0.3)  # the watch is established before the clock starts
        start = time.time()
        await publish(bootstrap, topics.name("incidents"), incidents)
        deadline = time.monotonic() + 300
        while len(watch.tainted) < nodes:
            if time.monotonic() > deadline:
                raise RuntimeError(f"storm: {len(watch.tainted)} of {nodes} nodes quarantined after 300 s")
            await asyncio.sleep(0.02)
        last_taint = max(watch.tainted.values())
        seconds = last_taint - start
        # The actuators still write Events and conditions after the taints: a baseline timed meanwhile
        # shared the API server (and this process) with them, which made the storm look faster than a
        # bare client (burst: ``World.wait_conditions``). They stop first (records in flight recorded, the
        # rest of their flows cancelled).
        settle = time.perf_counter()
        await asyncio.sleep(settle_s)  # the Events and conditions held behind the taints: counted, after
        await _stop(actuators, tasks)
        settled_s = time.perf_counter() - settle
        phases = calls_by_phase(timeline, start, last_taint, nodes)
        # The baseline, same run, same API server, same concurrency: a bare client's writes.
        await create_nodes(admin, raw_names, {"xidflow.bench/storm-raw": tag})
        raw_kube = await bare_client(kubeconfig, api_concurrency)
        try:
            raw_rate = await raw_quarantine_rate(raw_kube, raw_names, settings.taint_key, api_concurrency)
        finally:
            await raw_kube.aclose()
        return {
            "raw_nodes_per_s": round(raw_rate, 1),
            "storm_vs_raw_ratio": round(nodes / seconds / raw_rate, 3),
            "storm_nodes": nodes,
            "storm_seconds": round(seconds, 3),
            "storm_nodes_per_s": round(nodes / seconds, 1),
            "storm_api_concurrency": api_concurrency,
            # Profile: API calls the actuators made per quarantined node, by call (the raw client makes 2).
            "storm_api_calls_per_node": {k: round(v / nodes, 2) for k, v in calls.most_common()},
            # The same by phase: done up to the last taint (sharing the API server with the taints), and after.
            "storm_api_calls_per_node_during": phases["during"],
            "storm_api_calls_per_node_after": phases["after"],
            "storm_replicas": replicas,
            "storm_settled_s": round(settled_s, 2),
        }
    finally:
        if watch is not None:
            watch.stop()
        await _stop(actuators, tasks)
        await delete_nodes(admin, [*names, *raw_names])
        try:
            await admin._call(admin.core.delete_namespace, settings.namespace)
        except Exception:  # noqa: BLE001 - the namespace may not exist when setup failed early
            pass
        await admin.aclose()


async def _wait_baseline(kube: Kube, selector: str, limit_s: float = 300) -> None:
    """Until every node of the selector carries xidflow's own conditions (the actuators' first sweep is done)."""
    from pipeline.actuator.problems import ProblemClass
    from pipeline.benchmarks.burst_watch import condition_types

    wanted = {str(c) for c in ProblemClass}
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        page = await kube._call(kube.core.list_node, label_selector=selector)
        if all(wanted <= condition_types(n) for n in page.get("items") or []):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"storm: nodes still lack xidflow's conditions after {limit_s:.0f} s")


async def _stop(actuators: list[Actuator], tasks: list[asyncio.Task[None]]) -> None:
    """Stop the actuators (each finishes what it has in flight); a second call does nothing."""
    for act in actuators:
        act.consumer._stopping.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    while actuators:
        await actuators.pop().stop()


def run_storm(nodes: int = 500, bootstrap: str | None = None, kubeconfig: str | None = None) -> dict[str, Any]:
    """``{"storm_nodes", "storm_seconds", "storm_nodes_per_s", ...}`` for N nodes quarantined at once."""
    return asyncio.run(storm(nodes, bootstrap, kubeconfig))


if __name__ == "__main__":
    import sys

    import orjson

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    print(orjson.dumps(run_storm(count), option=orjson.OPT_INDENT_2).decode())
