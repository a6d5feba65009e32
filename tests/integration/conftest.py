"""Fixtures shared by the integration tests: the actuator's world (a module with its own ``env`` keeps its own) and
a worker for the shipper tests."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from pipeline.actuator.app import actuator_topics
from pipeline.app import worker_topics
from pipeline.kafka.admin import ensure_topics
from pipeline.localinfra.kafka import ADMIN_USER, KafkaCluster
from pipeline.localinfra.loki import LokiServer
from pipeline.localinfra.rsyslog import RsyslogDist, ensure_rsyslog_kafka
from pipeline.runtime.settings import TopicNames
from tests.integration.test_actuator_effects import Env
from tests.integration.test_pipeline import PARTITIONS, Pipeline, Worker, wait_ready
from tests.integration.workloads import ensure_ns


@pytest.fixture
async def env(kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]) -> AsyncIterator[Env]:
    """A fresh actuator world (nodes, namespace, topics) on the session's Kafka and API server."""
    world = Env(kafka_bootstrap, kubeconfig, unique)
    await ensure_topics(kafka_bootstrap, [world.topics.name("remediation_audit")], partitions=1)
    yield world
    await world.close()


@pytest.fixture
async def consuming_env(kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]) -> AsyncIterator[Env]:
    """A fresh actuator world for actuators that consume: every actuator topic exists (one partition, so one replica
    owns each node at a time) and so does its namespace."""
    world = Env(kafka_bootstrap, kubeconfig, unique)
    await ensure_topics(kafka_bootstrap, actuator_topics(world.topics), partitions=1)
    await ensure_ns(world.kube, world.namespace)
    yield world
    await world.close()


@pytest.fixture(scope="module")
def worker_prefix(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real worker for one shipper test module, on its own topic prefix; yields the prefix."""
    tag = uuid.uuid4().hex[:8]
    prefix, app_id = f"t-ship-{tag}-", f"t-ship-{tag}"
    asyncio.run(ensure_topics(kafka_bootstrap, worker_topics(app_id, TopicNames(prefix=prefix)), PARTITIONS))
    worker = Worker(kafka_bootstrap, app_id, prefix, tmp_path_factory.mktemp("shipper-worker")).start()

    async def ready() -> None:
        async with Pipeline(kafka_bootstrap, prefix) as pipe:
            await wait_ready(pipe, worker)

    try:
        asyncio.run(ready())
        yield prefix
        assert worker.alive(), f"the worker died:\n{worker.log_tail()}"
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def rsyslog() -> RsyslogDist:
    """Debian's rsyslogd with omkafka (librdkafka), installed when missing; fails loudly, never skips."""
    try:
        return ensure_rsyslog_kafka(lambda m: print(f"[rsyslog] {m}", flush=True))
    except Exception as exc:  # noqa: BLE001 - fail loudly, never skip
        pytest.fail(f"rsyslogd with omkafka is not available and could not be installed: {exc}", pytrace=False)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    """A private SASL_SSL broker with the ACL table and one user per component, its topics created (prefix "")."""
    topics = TopicNames(prefix="")
    cluster = KafkaCluster(tmp_path_factory.mktemp("kafka-sasl-ssl"), security="sasl_ssl",
                           log=lambda m: print(f"[secured-kafka] {m}", flush=True))
    try:
        cluster.start()
        names = list(dict.fromkeys([*worker_topics("xidflow", topics), *actuator_topics(topics)]))
        asyncio.run(ensure_topics(cluster.bootstrap, names, 4, settings=cluster.client_settings(ADMIN_USER)))
    except Exception as exc:  # noqa: BLE001 - a broker that cannot start fails the tests, loudly
        cluster.stop()
        pytest.fail(f"secured Kafka could not start: {exc}", pytrace=False)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def loki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LokiServer]:
    """A real single-binary Loki (built once from Go modules, cached); never skipped."""
    server = LokiServer(tmp_path_factory.mktemp("loki"), log=lambda m: print(f"[loki] {m}", flush=True))
    try:
        server.start(timeout=180)
    except Exception as exc:  # noqa: BLE001 - fail loudly with the cause
        server.stop()
        pytest.fail(f"Loki could not be built or started: {exc}", pytrace=False)
    yield server
    server.stop()
