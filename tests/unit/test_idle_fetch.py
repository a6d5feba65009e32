"""``upstream.long_poll_when_idle``: a fetch waits long on the broker only when it holds no partition back.

aiokafka leaves a partition with buffered records (or paused, or without a position) out of the fetch it
plans; a long poll then keeps such a partition waiting once drained. A fetch of every assigned partition
holds nothing back (the broker answers at the first record), so only that one may wait long.
"""

from __future__ import annotations

import collections
import inspect
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.consumer.fetcher import Fetcher
from aiokafka.consumer.subscription_state import SubscriptionState

from pipeline.kafka import upstream

T0, T1 = TopicPartition("xidflow-fault-events", 0), TopicPartition("xidflow-fault-events", 1)


def _assignment(*positioned: TopicPartition) -> Any:
    subscription = SubscriptionState()
    subscription.assign_from_user({T0, T1})
    assignment = subscription.subscription.assignment
    for tp in positioned:
        assignment.state_value(tp).seek(0)
    return assignment


def test_aiokafka_reads_the_fetch_wait_each_time_it_plans_its_fetches() -> None:
    routine = "".join(inspect.getsource(Fetcher._fetch_requests_routine).split())
    assert "=self._get_actions_per_node(assignment)" in routine, (
        "aiokafka: the fetch routine no longer plans through Fetcher._get_actions_per_node: "
        "upstream.long_poll_when_idle has no effect")
    plan = inspect.getsource(Fetcher._get_actions_per_node)
    assert "self._fetch_max_wait_ms," in plan and "self._records" in plan, (
        "aiokafka: Fetcher._get_actions_per_node no longer builds its FetchRequest with self._fetch_max_wait_ms")


async def test_a_fetch_covers_every_partition_only_with_nothing_buffered_paused_or_unpositioned() -> None:
    assert upstream.fetch_covers_every_partition({}, _assignment(T0, T1))
    assert not upstream.fetch_covers_every_partition({T0: object()}, _assignment(T0, T1))
    assert not upstream.fetch_covers_every_partition({}, _assignment(T0))  # T1 waits for its position
    paused = _assignment(T0, T1)
    paused.state_value(T1).pause()
    assert not upstream.fetch_covers_every_partition({}, paused)


async def test_the_fetch_waits_long_when_idle_and_briefly_while_records_are_buffered() -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers="localhost:1")
    with pytest.raises(RuntimeError):
        upstream.long_poll_when_idle(consumer, 500)  # not started: no fetcher yet
    fetcher = Fetcher.__new__(Fetcher)  # the attributes long_poll_when_idle reads, without a client
    fetcher._records = collections.OrderedDict()
    fetcher._fetch_max_wait_ms = 50
    fetcher._get_actions_per_node = lambda assignment: fetcher._fetch_max_wait_ms  # the wait it would ask for
    consumer._fetcher = fetcher
    upstream.long_poll_when_idle(consumer, 500)
    assignment = _assignment(T0, T1)
    assert fetcher._get_actions_per_node(assignment) == 500
    fetcher._records[T0] = object()  # records of T0 not yet handed out: T0 is left out of the fetch
    assert fetcher._get_actions_per_node(assignment) == 50
    del fetcher._records[T0]
    assert fetcher._get_actions_per_node(assignment) == 500
