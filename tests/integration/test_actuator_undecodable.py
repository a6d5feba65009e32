"""An incidents batch the actuator cannot decode is dead-lettered and skipped, not a crash loop (real
broker, real API server, the real ``Actuator``).

Every partition of the incidents topic is written before the actuator starts (one fetch carries them
all), one batch of one partition is corrupted on the broker's disk (its CRC no longer matches), with
good incidents before and after it in its partition. aiokafka's ``getmany`` raises on that batch on
every fetch; an actuator that lets it escape exits and meets it again after each restart. Here every
good incident must be acted on exactly once, the bad batch be one dead letter naming its offsets, the
offsets be committed past it, and the actuator keep running.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from pipeline.actuator.app import actuator_topics
from pipeline.actuator.testing import make_incident, node_events, wait_until
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from schemas.records import Outcome
from tests.integration.test_actuator_effects import Env
from tests.integration.test_actuator_kafka import committed, consuming
from tests.integration.test_undecodable_neighbours import _corrupt_on_disk

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PARTITIONS = 4
PER_PARTITION = 3
TAINT = "nvidia.com/gpu-fault"


async def test_a_corrupt_incidents_batch_is_dead_lettered_once_and_the_actuator_goes_on(
    private_kafka, kubeconfig: str, unique: Callable[[str], str]
) -> None:
    cluster = private_kafka(1)
    env = Env(cluster.bootstrap, kubeconfig, unique)
    incidents = env.topics.name("incidents")
    await ensure_topics(env.bootstrap, [incidents], PARTITIONS)
    await ensure_topics(env.bootstrap, [n for n in actuator_topics(env.topics) if n != incidents], 1)
    try:
        names = await env.make_nodes(PARTITIONS * PER_PARTITION)
        nodes = {p: names[p * PER_PARTITION:(p + 1) * PER_PARTITION] for p in range(PARTITIONS)}
        bad_partition = 1
        bad_node = nodes[bad_partition][1]  # good incidents before and after it in its own partition
        offsets: dict[str, int] = {}
        producer = kafka_clients.producer(bootstrap=env.bootstrap, acks="all")
        await producer.start()
        try:
            for i in range(PER_PARTITION):  # one batch per record: the corruption hits one incident's batch
                for p in range(PARTITIONS):
                    node = nodes[p][i]
                    meta = await producer.send_and_wait(incidents, make_incident(node, f"inc-{node}").to_bytes(),
                                                        key=node.encode(), partition=p)
                    offsets[node] = meta.offset
        finally:
            await producer.stop()
        _corrupt_on_disk(Path(cluster.root), incidents, bad_partition, f"inc-{bad_node}".encode())
        good = [n for n in names if n != bad_node]

        act = await env.actuator()
        letters: list[dict] = []
        reader = kafka_clients.consumer(env.topics.name("deadletter"), bootstrap=env.bootstrap,
                                        auto_offset_reset="earliest")
        await reader.start()
        try:
            async with consuming(act):
                # consuming() runs act.run() in a task: the one that must never finish here.
                run_task = next(t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Actuator.run")

                async def settled() -> bool:
                    assert not run_task.done(), run_task.exception()  # the actuator must not exit
                    for records in (await reader.getmany(timeout_ms=100)).values():
                        letters.extend(orjson.loads(r.value) for r in records)
                    tainted = [any(t["key"] == TAINT for t in (await env.node(n))["spec"].get("taints") or [])
                               for n in good]
                    got, ends = await committed(env.bootstrap, act.settings.group_id, incidents)
                    return bool(letters) and all(tainted) and bool(ends) and all(
                        got.get(p) == e for p, e in ends.items())

                await wait_until(settled, 90, poll=0.5, what="good incidents acted on, batch dead-lettered, "
                                 "offsets committed to the end")
                until = time.monotonic() + 2  # a doubled dead letter comes now
                while time.monotonic() < until:
                    for records in (await reader.getmany(timeout_ms=200)).values():
                        letters.extend(orjson.loads(r.value) for r in records)
                assert not run_task.done()
        finally:
            await reader.stop()
        audit = await env.audit()
        for name in good:
            applied = [r.action for r in audit if r.node == name and r.outcome == Outcome.APPLIED]
            assert applied.count("cordon") == 1, (name, applied)
            assert len(await node_events(env.kube, name)) == 1, name
        assert not [r for r in audit if r.node == bad_node]
        assert not [t for t in (await env.node(bad_node))["spec"].get("taints") or [] if t["key"] == TAINT]
        assert len(letters) == 1, letters
        letter = letters[0]
        assert (letter["code"], letter["stage"], letter["topic"], letter["partition"], letter["offset"]) == (
            "undecodable", "actuator", incidents, bad_partition, offsets[bad_node])
        assert f"{incidents}[{bad_partition}] offset {offsets[bad_node]}" in letter["reason"], letter["reason"]
    finally:
        await env.close()


async def test_an_lz4_batch_without_its_codec_library_holds_its_partition_and_the_rest_flows(
    kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    """The actuator process in an image without ``cramjam`` (lz4 cannot be decoded): the lz4 batch's
    partition is held (not skipped, not committed past: the data is fine, a restart with the library reads
    it), the process keeps running and every other partition's incident is acted on."""
    from tests.integration.test_codecs import NO_CRAMJAM
    from tests.integration.test_metrics_processes import Process, actuator_env, eventually, free_port, value

    env = Env(kafka_bootstrap, kubeconfig, unique)
    incidents = env.topics.name("incidents")
    await ensure_topics(env.bootstrap, [incidents], PARTITIONS)
    await ensure_topics(env.bootstrap, [n for n in actuator_topics(env.topics) if n != incidents], 1)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(NO_CRAMJAM)
    policy = tmp_path / "policy.yaml"
    policy.write_text("kind: RescuePolicy\nmetadata: {name: held}\nspec:\n  rules:\n"
                      "  - {priority: 10, codes: [79], actions: [{name: cordon}]}\n")
    group, port = unique("g"), free_port()
    proc: Process | None = None
    try:
        names = await env.make_nodes(PARTITIONS)
        held, plain = names[0], names[1:]
        lz4 = kafka_clients.producer(bootstrap=env.bootstrap, acks="all", compression_type="lz4")
        await lz4.start()
        try:
            await lz4.send_and_wait(incidents, make_incident(held, f"inc-{held}").to_bytes(), key=held.encode(),
                                    partition=0)
        finally:
            await lz4.stop()
        producer = kafka_clients.producer(bootstrap=env.bootstrap, acks="all")
        await producer.start()
        try:
            for p, node in enumerate(plain, start=1):
                await producer.send_and_wait(incidents, make_incident(node, f"inc-{node}").to_bytes(),
                                             key=node.encode(), partition=p)
        finally:
            await producer.stop()
        proc = Process("actuator", ["actuator", "--no-api", "--log-level", "warning"],
                       {**actuator_env(env, kubeconfig, group, policy, port), "PYTHONPATH": str(site)}, tmp_path)

        async def plain_cordoned() -> bool:
            assert proc.proc.poll() is None, proc.tail()
            return all([(await env.node(n))["spec"].get("unschedulable") for n in plain])

        await wait_until(plain_cordoned, 90, poll=0.5, what="incidents of the other partitions acted on")
        samples = await eventually(proc, port, lambda s: value(
            s, "xidflow_held_partitions", stage="actuator", topic=incidents) == 1, "the held partition")
        assert value(samples, "xidflow_undecodable_batches_total", stage="actuator", topic=incidents,
                     reason="unsupported_codec") == 1
        log_text = proc.log.read_text(errors="replace")
        assert f"actuator: undecodable record batch at {incidents}[0] offset 0" in log_text, proc.tail()
        assert "partition HELD" in log_text
        assert not (await env.node(held))["spec"].get("unschedulable")
        got, _ = await committed(env.bootstrap, group, incidents)
        assert got.get(0, -1) <= 0, got  # nothing committed past the held batch
        # As in the worker: the process's /healthz names the held partition and its fix; /livez stays green
        # (a restart cannot install a library and would stop the partitions that flow).
        status, body = _get(port, "/healthz")
        assert status == 503 and f"{incidents}[0] offset 0" in body and "install the codec library" in body, body
        assert _get(port, "/livez") == (200, "ok\n")
        assert proc.proc.poll() is None, proc.tail()
    finally:
        if proc is not None:
            proc.stop()
        await env.close()


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
