"""Audit records in a burst: held while this actuator takes nodes out of scheduling, then sent together,
in order, and durable before the flow that wrote them is done (``pipeline.actuator.audit``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from pipeline.actuator.audit import Auditor, make_record
from pipeline.actuator.testing import make_incident, read_audit, wait_until
from pipeline.kafka.admin import ensure_topics
from schemas.records import Outcome
from tests.integration.test_actuator_effects import Env, outcomes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


async def test_a_flows_audit_waits_for_the_other_quarantines_then_comes_whole_and_in_order(env: Env) -> None:
    a, b = await env.make_nodes(2)
    act = await env.actuator()
    # Only the other quarantine's end releases what is held (not the limiter's no-progress bound).
    act.kube._limiter.hold_s = act.kube._limiter.max_hold_s = 600
    other_over = asyncio.Event()

    async def other_quarantine() -> None:  # node b's quarantine, in flight in this process meanwhile
        act.kube.quarantining(True)
        try:
            await other_over.wait()
        finally:
            act.kube.quarantining(False)

    other = asyncio.create_task(other_quarantine())
    await asyncio.sleep(0)
    flow = asyncio.create_task(act.engine.handle(make_incident(a, "inc-a")))

    async def tainted() -> bool:
        node = await env.node(a)
        return bool(node["spec"].get("unschedulable")) and any(
            t["key"] == "nvidia.com/gpu-fault" for t in node["spec"].get("taints") or []
        )

    await wait_until(tainted, what="node a quarantined")
    # The taint went ahead; its flow's records (decide, cordon, taint) wait for the other quarantine, and
    # the flow is not done without them.
    assert outcomes(await env.audit(), a) == []
    assert not flow.done()
    other_over.set()
    await other
    await flow
    assert outcomes(await env.audit(), a) == [
        ("decide", "applied"),
        ("cordon", "applied"),
        ("taint", "applied"),
        ("condition", "applied"),
        ("event", "applied"),
        ("notifyWorkload", "skipped"),  # no workload on the node
    ]


async def test_emit_is_not_held_and_does_not_overtake_queued_records(
    kafka_bootstrap: str, unique: Callable[[str], str]
) -> None:
    topic = unique("audit")
    await ensure_topics(kafka_bootstrap, [topic], partitions=2)
    never = asyncio.Event()
    auditor = Auditor(kafka_bootstrap, topic, hold=never.wait)
    await auditor.start()
    try:
        queued = auditor.submit(make_record(node="n1", flow_key="f", action="decide", outcome=Outcome.APPLIED))
        await auditor.emit(make_record(node="n1", flow_key="f", action="cancel", outcome=Outcome.APPLIED))
        assert queued.done() and queued.exception() is None
        assert [r.action for r in await read_audit(kafka_bootstrap, topic)] == ["decide", "cancel"]
    finally:
        await auditor.stop()
