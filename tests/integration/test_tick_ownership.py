"""A worker stops asking for ticks of the nodes whose partition a rebalance moved away (real broker, two real
worker processes).

The aggregation's timer asks for a tick of every node its ``TickIndex`` holds as due. The index is per process:
before it forgot the nodes of revoked partitions, a worker kept asking for their ticks at every timer run, for
ever (their state in its table is frozen once another worker owns them, so it never stops being due), on top of
the ticks their new owner asks for.

Every node here has a failing health check that the catalog (an operator override) does not quarantine for: such
an incident keeps its node due at every tick, so each owner asks for a tick of each of its nodes at every timer
run. Worker A owns all partitions and learns every node; worker B joins and takes some partitions; the health
checks of B's nodes then pass (B closes their incidents, so B stops asking). From then on A's own nodes still
get a tick at each of A's timer runs (A's clock), and B's nodes must get none from anyone.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from aiokafka import TopicPartition

from pipeline.aggregate.copartition import ticks_topic_name
from pipeline.app import worker_topics
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.membership import describe_group
from pipeline.runtime.settings import TopicNames
from tests.integration.test_pipeline import PARTITIONS, Pipeline, Worker, wait_ready
from tests.integration.test_pipeline_resilience import _partition

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CHECK = "tickclock"
OVERRIDES = f"health_checks:\n  {CHECK}: {{name: TICK_CLOCK, action: RESTART_APP, severity: warning}}\n"
BOOT = "boot-1"
NODES_PER_PARTITION = 3
CLOCK_RUNS = 5  # A's timer runs seen (ticks of each of A's nodes) before B's nodes are judged


async def _assignment(bootstrap: str, app_id: str, fault_events: str) -> dict[str, set[int]]:
    """group.instance.id -> the fault-event partitions it owns, once the group is stable with two members."""
    deadline = time.monotonic() + 120
    while True:
        try:
            view = await describe_group(bootstrap, app_id)
        except Exception:  # noqa: BLE001 - a coordinator still loading answers with a retryable error
            view = None
        if view is not None and view.state == "Stable" and len(view.members) == 2:
            owned = {m.instance_id or m.member_id: {p for t, p in m.partitions if t == fault_events}
                     for m in view.members}
            if all(owned.values()) and set().union(*owned.values()) == set(range(PARTITIONS)):
                return owned
        assert time.monotonic() < deadline, f"the two workers did not share the partitions: {view}"
        await asyncio.sleep(0.5)


async def test_a_worker_asks_no_tick_for_the_nodes_of_a_partition_it_lost(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"t-tick-{tag}-", f"t-tick-{tag}"
    topics = TopicNames(prefix=prefix)
    await ensure_topics(kafka_bootstrap, worker_topics(app_id, topics), PARTITIONS)
    by_partition: dict[int, list[str]] = {p: [] for p in range(PARTITIONS)}
    i = 0
    while any(len(v) < NODES_PER_PARTITION for v in by_partition.values()):
        node = f"n-tick-{tag}-{i}"
        i += 1
        if len(by_partition[_partition(node)]) < NODES_PER_PARTITION:
            by_partition[_partition(node)].append(node)
    nodes = [n for ns in by_partition.values() for n in ns]
    overrides = tmp_path / "catalog-overrides.yaml"
    overrides.write_text(OVERRIDES)
    env = {"XIDFLOW_CATALOG_OVERRIDES": str(overrides)}
    ticks = ticks_topic_name(app_id)
    async with Pipeline(kafka_bootstrap, prefix) as pipe:
        a = Worker(kafka_bootstrap, app_id, prefix, tmp_path,
                   extra_env={**env, "XIDFLOW_GROUP_INSTANCE_ID": f"a-{tag}"}).start()
        b = Worker(kafka_bootstrap, app_id, prefix, tmp_path,
                   extra_env={**env, "XIDFLOW_GROUP_INSTANCE_ID": f"b-{tag}"})
        reader = kafka_clients.consumer(bootstrap=kafka_bootstrap, enable_auto_commit=False)
        await reader.start()
        try:
            await wait_ready(pipe, a)
            for node in nodes:
                await pipe.health(node, CHECK, False, BOOT)
            await pipe.wait_for(lambda: all(pipe.incidents(n) for n in nodes), 60, "an incident for every node")

            b.start()
            owned = await _assignment(kafka_bootstrap, app_id, topics.name("fault_events"))
            kept = [n for p in sorted(owned[f"a-{tag}"]) for n in by_partition[p]]
            moved = [n for p in sorted(owned[f"b-{tag}"]) for n in by_partition[p]]
            for node in moved:  # B owns them now: their checks pass, B closes their incidents
                await pipe.health(node, CHECK, True, BOOT)
            await pipe.wait_for(
                lambda: all(any(r.get("type") == "recovered" for r in pipe.incidents(n)) for n in moved), 90,
                "B closing the incidents of its nodes")

            # From here on: count the ticks of each node.
            tps = [TopicPartition(ticks, p) for p in range(PARTITIONS)]
            reader.assign(tps)
            for tp, end in (await reader.end_offsets(tps)).items():
                reader.seek(tp, end)
            counts: Counter[str] = Counter()
            deadline = time.monotonic() + 120
            while min(counts[n] for n in kept) < CLOCK_RUNS:
                assert time.monotonic() < deadline, f"A's timer did not tick its own nodes: {counts}"
                assert a.alive() and b.alive(), a.log_tail() + b.log_tail()
                for records in (await reader.getmany(timeout_ms=500)).values():
                    counts.update(r.key.decode() for r in records)
        finally:
            await reader.stop()
            b.stop()
            a.stop()
    # B asked for at most one tick of each of its nodes that was on its way when their incidents closed.
    stale = {n: counts[n] for n in moved if counts[n] > 1}
    assert not stale, (f"ticks of nodes whose partition moved away, while A ran its timer {CLOCK_RUNS} times: "
                       f"{stale}")
