"""Shared fixtures: real Kafka and a real Kubernetes control plane, started once per test session.

Endpoints in the environment (``KAFKA_BOOTSTRAP_SERVERS``, ``KUBECONFIG``) are used as they are;
otherwise the session starts its own private instance (testcontainers when Docker answers, else
the local builds: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK) in a
temporary state directory and stops it at the end. Infrastructure that cannot start fails the tests
that need it, loudly; nothing is skipped.

The session's control plane judges node heartbeats faster than a cluster's defaults
(``NODE_MONITOR_GRACE_S``, ``NODE_LEASE_S``) so that a test watching a silent node go ``Unknown``
waits about half a minute, not a minute: KWOK renews each Lease every 2.5 s, so a node is judged
silent only after 7 renewals in a row were missed (a KWOK stalled for 17 s on a loaded machine).

Per-test isolation comes from ``unique(prefix)``: unique topic, group, namespace and node names.
"""

from __future__ import annotations

import itertools
import os
import re
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from pipeline.localinfra.kafka import KafkaCluster
from pipeline.localinfra.launcher import Endpoints, LocalInfra

_SESSION_TAG = uuid.uuid4().hex[:6]
NODE_MONITOR_GRACE_S = 20
NODE_LEASE_S = 10
_counter = itertools.count(1)

# Speed is measured in the bench, not asserted in tests: Hypothesis's per-example deadline and its
# "input generation is slow" check are timings, and they failed property tests on a busy 2-core machine.
settings.register_profile("xidflow", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("xidflow")


def _log(msg: str) -> None:
    print(f"[xidflow-infra] {msg}", flush=True)


@pytest.fixture(scope="session")
def local_infra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Endpoints]:
    state_dir = tmp_path_factory.mktemp("xidflow-infra")
    infra = LocalInfra(state_dir=state_dir, log=_log)
    try:
        endpoints = infra.up(kafka_brokers=1, detach=False, node_monitor_grace_s=NODE_MONITOR_GRACE_S,
                             node_lease_s=NODE_LEASE_S)
    except Exception as exc:  # noqa: BLE001 - any failure to start must fail loudly, with its cause
        infra.down(quiet=True)
        pytest.fail(f"test infrastructure could not start (Kafka / Kubernetes control plane): {exc}", pytrace=False)
    _log(f"Kafka from {endpoints.kafka_source}; Kubernetes from {endpoints.kube_source}")
    yield endpoints
    infra.down(quiet=True)


@pytest.fixture(scope="session")
def kafka_bootstrap(local_infra: Endpoints) -> str:
    return local_infra.kafka_bootstrap


@pytest.fixture(scope="session")
def kubeconfig(local_infra: Endpoints) -> str:
    return local_infra.kubeconfig


@pytest.fixture(scope="session")
def k8s(kubeconfig: str):  # noqa: ANN201 - kubernetes.client.ApiClient
    from kubernetes import client, config

    cfg = client.Configuration()
    config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    api = client.ApiClient(cfg)
    try:
        client.VersionApi(api).get_code()
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"kube-apiserver at {cfg.host} does not answer: {exc}", pytrace=False)
    yield api
    api.close()


@pytest.fixture
def unique(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """``unique("node")`` -> e.g. ``node-3f2a1c-test-cordon-7``: DNS-1123 safe, unique per call."""
    test = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:20].strip("-")

    def make(prefix: str = "x") -> str:
        base = re.sub(r"[^a-z0-9-]+", "-", prefix.lower()).strip("-") or "x"
        return f"{base}-{_SESSION_TAG}-{test}-{next(_counter)}"[:63].rstrip("-")

    return make


@pytest.fixture
def private_kafka() -> Iterator[Callable[..., KafkaCluster]]:
    """A factory for Kafka clusters of the test's own (for broker failure tests)."""
    clusters: list[tuple[KafkaCluster, tempfile.TemporaryDirectory]] = []

    def make(brokers: int = 1) -> KafkaCluster:
        tmp = tempfile.TemporaryDirectory(prefix="xidflow-kafka-")
        cluster = KafkaCluster(Path(tmp.name), brokers=brokers, log=_log)
        clusters.append((cluster, tmp))
        try:
            return cluster.start()
        except Exception as exc:  # noqa: BLE001
            pytest.fail(f"private Kafka cluster ({brokers} broker(s)) could not start: {exc}", pytrace=False)

    yield make
    for cluster, tmp in clusters:
        cluster.stop()
        tmp.cleanup()


def pytest_report_header(config: pytest.Config) -> list[str]:
    given = [v for v in ("KAFKA_BOOTSTRAP_SERVERS", "KUBECONFIG") if os.environ.get(v)]
    if given:
        return [f"xidflow: using endpoints from the environment: {', '.join(given)}"]
    return ["xidflow: integration tests start a private Kafka + Kubernetes control plane (with KWOK) for this session"]
