"""The Kafka broker's reachability in every process (``pipeline.runtime.reachability.BROKER``).

aiokafka logs every failed attempt of every client (connect, metadata, fetch, coordinator, heartbeat: about
200 lines a second for a worker without its broker), and Faust's consumer its own. Those records are routed to
``BROKER``'s count: a record of the ``aiokafka`` and ``faust`` loggers is a failed attempt when it carries one of
``CONNECTION_ERRORS`` (the exception aiokafka logs it with: an argument, or its ``exc_info``), and while the broker
is down whatever else they say ("Unable to update metadata", which carries none; "Discovered coordinator" again and
again as it comes back) is counted with it.

The broker is back when a client gets a metadata answer: ``aiokafka.cluster.ClusterMetadata.update_metadata``,
which every client of the process (ours, Faust's) calls with each answer, is wrapped once to say so. aiokafka
has no public hook for it across clients; ``tests/unit/test_reachability.py`` pins that the method is there.
Installed when ``pipeline.kafka.clients`` is imported, which every process that talks to Kafka does first.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from aiokafka import errors
from aiokafka.cluster import ClusterMetadata

from pipeline.runtime.reachability import BROKER, carries, route

CLIENT_LOGGERS = ("aiokafka", "faust")
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,  # ConnectionRefusedError and the other socket errors
    asyncio.TimeoutError,
    errors.KafkaConnectionError,
    errors.NodeNotReadyError,
    errors.RequestTimedOutError,
    errors.KafkaTimeoutError,
    errors.GroupCoordinatorNotAvailableError,
)
"""What aiokafka reports a failed attempt to reach a broker with."""


def is_attempt_failure(record: logging.LogRecord) -> bool:
    return carries(record, CONNECTION_ERRORS)


def install() -> None:
    """Route the Kafka clients' failed attempts to ``BROKER`` and tell it of every metadata answer (once)."""
    route(CLIENT_LOGGERS, BROKER, is_attempt_failure)
    original = ClusterMetadata.update_metadata
    if getattr(original, "_xidflow_reachability", False):
        return

    @functools.wraps(original)
    def update_metadata(self: ClusterMetadata, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        BROKER.reachable()
        return result

    update_metadata._xidflow_reachability = True  # type: ignore[attr-defined]
    ClusterMetadata.update_metadata = update_metadata  # type: ignore[method-assign]
