"""The one place that builds Kafka clients: every producer, consumer and admin client of every component.

Components never call ``AIOKafkaProducer(...)``/``AIOKafkaConsumer(...)``/``AIOKafkaAdminClient(...)``
themselves: they ask this module, which adds the connection settings (bootstrap servers and, where
the cluster needs them, TLS and SASL credentials) read from the environment by ``KafkaSettings``.
Call-site keyword arguments (acks, group ids, poll sizes) are the component's own business and are
passed through unchanged.
"""

from __future__ import annotations

from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from pipeline.settings import KafkaSettings


def connection_options(bootstrap: str | None = None, settings: KafkaSettings | None = None) -> dict[str, Any]:
    """Keyword arguments every aiokafka client needs to reach and authenticate to the cluster.

    ``bootstrap`` overrides the configured servers (tests and the local launcher pass their own).
    """
    settings = settings or KafkaSettings()
    return {"bootstrap_servers": bootstrap or settings.bootstrap_servers}


def producer(bootstrap: str | None = None, **kwargs: Any) -> AIOKafkaProducer:
    return AIOKafkaProducer(**connection_options(bootstrap), **kwargs)


def consumer(*topics: str, bootstrap: str | None = None, **kwargs: Any) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(*topics, **connection_options(bootstrap), **kwargs)


def admin(bootstrap: str | None = None, **kwargs: Any) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(**connection_options(bootstrap), **kwargs)
