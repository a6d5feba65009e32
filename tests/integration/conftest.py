"""Fixtures shared by the actuator's integration tests (a module with its own ``env`` keeps its own)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from pipeline.kafka_admin import ensure_topics
from tests.integration.test_actuator_effects import Env


@pytest.fixture
async def env(kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]) -> AsyncIterator[Env]:
    """A fresh actuator world (nodes, namespace, topics) on the session's Kafka and API server."""
    world = Env(kafka_bootstrap, kubeconfig, unique)
    await ensure_topics(kafka_bootstrap, [world.topics.name("remediation_audit")], partitions=1)
    yield world
    await world.close()
