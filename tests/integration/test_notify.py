"""Webhook notifications against real aiohttp receivers on localhost, and the bodies they get."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import orjson
import pytest
from aiohttp import web

from pipeline.actuator.notify import (
    Notifier,
    NotifySettings,
    Webhook,
    WebhookFormat,
    backoff_delay,
    generic_body,
    retry_after_seconds,
    slack_body,
    wants_notification,
)
from schemas.records import Action, FaultKind, NodeIncident, Outcome, RemediationRecord, Severity

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def incident(**overrides: object) -> NodeIncident:
    fields: dict[str, object] = {
        "incident_id": "inc-1",
        "node": "gpu-node-07",
        "signature": "xid:79:0000:4e:00.0",
        "kind": FaultKind.XID,
        "code": 79,
        "pci": "0000:4e:00.0",
        "count": 2,
        "first_seen": T0,
        "last_seen": T0,
        "opened_at": T0,
        "severity": Severity.CRITICAL,
        "action": Action.REBOOT_NODE,
        "quarantine": True,
        "line": "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    }
    return NodeIncident.model_validate(fields | overrides)


def remediation(**overrides: object) -> RemediationRecord:
    fields: dict[str, object] = {
        "record_id": "rem-1",
        "node": "gpu-node-07",
        "incident_id": "inc-1",
        "action": "cordon",
        "outcome": Outcome.APPLIED,
        "reason": "xid 79 <fallen off the bus> & quarantined",
        "worker_id": "actuator-0",
    }
    return RemediationRecord.model_validate(fields | overrides)


@dataclass
class Receiver:
    """A webhook receiver that answers ``fail_first`` requests with ``fail_status``, then 200."""

    fail_first: int = 0
    fail_status: int = 503
    hang: bool = False
    received: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    url: str = ""
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        self.received.append((dict(request.headers), await request.read()))
        self.arrived.set()
        if self.hang:
            await asyncio.Event().wait()
        if len(self.received) <= self.fail_first:
            return web.Response(status=self.fail_status, headers={"Retry-After": "0"})
        return web.Response(text="ok")

    async def wait_for(self, count: int) -> None:
        while len(self.received) < count:
            self.arrived.clear()
            await self.arrived.wait()

    @property
    def bodies(self) -> list[dict]:
        return [orjson.loads(body) for _, body in self.received]


@pytest.fixture
async def serve_receiver() -> AsyncIterator[Callable[..., Receiver]]:
    runners: list[web.AppRunner] = []

    async def start(**kw: object) -> Receiver:
        receiver = Receiver(**kw)  # type: ignore[arg-type]
        app = web.Application()
        app.router.add_post("/hook", receiver.handle)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        receiver.url = f"http://{host}:{port}/hook"
        runners.append(runner)
        return receiver

    yield start  # type: ignore[misc]
    for runner in runners:
        await runner.cleanup()


def fast_settings(*webhooks: Webhook, **overrides: object) -> NotifySettings:
    fields: dict[str, object] = {
        "webhooks": list(webhooks),
        "backoff_initial_seconds": 0.01,
        "backoff_max_seconds": 0.05,
        "timeout_seconds": 5,
        "stop_drain_seconds": 0.5,
    }
    return NotifySettings.model_validate(fields | overrides)


async def test_retries_until_the_receiver_recovers_with_one_idempotency_key(serve_receiver) -> None:
    receiver = await serve_receiver(fail_first=2, fail_status=503)
    notifier = Notifier(fast_settings(Webhook(url=receiver.url, name="ops")), rng=random.Random(1))
    await notifier.start()
    try:
        notifier.notify(remediation())
        await receiver.wait_for(3)
    finally:
        await notifier.stop()
    assert len(receiver.received) == 3
    keys = {headers["Idempotency-Key"] for headers, _ in receiver.received}
    assert keys == {"remediation:rem-1"}
    assert len({body for _, body in receiver.received}) == 1
    stats = notifier.stats["ops"]
    assert (stats.delivered, stats.failed, stats.attempts, stats.dropped) == (1, 0, 3, 0)


async def test_client_errors_are_not_retried_and_attempts_are_capped(serve_receiver) -> None:
    rejecting = await serve_receiver(fail_first=100, fail_status=400)
    failing = await serve_receiver(fail_first=100, fail_status=500)
    settings = fast_settings(
        Webhook(url=rejecting.url, name="rejecting"), Webhook(url=failing.url, name="failing"), max_attempts=3
    )
    notifier = Notifier(settings)
    await notifier.start()
    notifier.notify(remediation())
    await notifier.stop()  # drains: both deliveries finish (given up) within stop_drain_seconds
    assert len(rejecting.received) == 1
    assert len(failing.received) == 3
    assert notifier.stats["rejecting"].failed == notifier.stats["failing"].failed == 1


async def test_generic_and_slack_bodies_reach_their_webhooks(serve_receiver) -> None:
    generic = await serve_receiver()
    slack = await serve_receiver()
    settings = fast_settings(
        Webhook(url=generic.url, name="generic"),
        Webhook(url=slack.url, name="slack", format=WebhookFormat.SLACK, headers={"X-Team": "gpu"}),
    )
    notifier = Notifier(settings)
    await notifier.start()
    try:
        notifier.notify(incident())
        notifier.notify(remediation())
        await generic.wait_for(2)
        await slack.wait_for(2)
    finally:
        await notifier.stop()

    first, second = generic.bodies
    assert first["event"] == "incident" and second["event"] == "remediation"  # order kept per webhook
    assert first["id"] == "incident:inc-1:0"
    assert first["record"] == orjson.loads(incident().model_dump_json())
    assert "gpu-node-07" in first["summary"] and "REBOOT_NODE" in first["summary"]
    assert second["record"]["outcome"] == "applied"

    slack_incident, slack_remediation = slack.bodies
    assert set(slack_incident) == {"text", "blocks"}
    assert slack_incident["text"].startswith("[CRITICAL] incident opened on node gpu-node-07: xid 79")
    assert [b["type"] for b in slack_incident["blocks"]] == ["section", "section", "section", "context"]
    # Slack mrkdwn control characters in the remediation reason are escaped.
    rendered = orjson.dumps(slack_remediation["blocks"]).decode()
    assert "&lt;fallen off the bus&gt; &amp; quarantined" in rendered
    assert all(headers["X-Team"] == "gpu" for headers, _ in slack.received)
    assert all(headers["Content-Type"] == "application/json" for headers, _ in slack.received)


async def test_a_dead_receiver_never_blocks_notify(serve_receiver) -> None:
    hanging = await serve_receiver(hang=True)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed_url = f"http://127.0.0.1:{sock.getsockname()[1]}/hook"
    settings = fast_settings(
        Webhook(url=hanging.url, name="hanging"),
        Webhook(url=closed_url, name="closed"),
        queue_size=2,
        timeout_seconds=30,
        max_attempts=1000,
    )
    notifier = Notifier(settings)
    await notifier.start()
    # notify is synchronous: none of these calls can wait on the network.
    for i in range(10):
        notifier.notify(remediation(record_id=f"rem-{i}"))
    await hanging.wait_for(1)
    assert notifier.stats["hanging"].dropped == 8
    assert notifier.stats["closed"].dropped == 8
    # Queues drain into the dead receivers forever; stop() gives up after stop_drain_seconds.
    await notifier.stop()
    assert notifier.stats["hanging"].delivered == notifier.stats["closed"].delivered == 0
    assert notifier.stats["closed"].attempts >= 1


def test_filters_skip_noise() -> None:
    settings = NotifySettings()
    assert wants_notification(remediation(outcome=Outcome.APPLIED), settings)
    assert wants_notification(remediation(outcome=Outcome.FAILED), settings)
    assert not wants_notification(remediation(outcome=Outcome.ALREADY_APPLIED), settings)
    assert wants_notification(incident(severity=Severity.WARNING), settings)
    assert not wants_notification(incident(severity=Severity.INFO), settings)


def test_webhook_urls_must_be_http_and_are_not_shown() -> None:
    with pytest.raises(ValueError, match="http"):
        Webhook(url="ftp://example.com/x")
    hook = Webhook(url="https://hooks.slack.com/services/T000/B000/SECRET")
    assert hook.label == "hooks.slack.com"
    assert "SECRET" not in repr(NotifySettings(webhooks=[hook]))


def test_bodies_are_pure_functions_of_the_record() -> None:
    assert generic_body(incident(revision=2))["id"] == "incident:inc-1:2"
    assert "escalated" in slack_body(incident(revision=2))["text"]
    assert len(slack_body(incident(line="x" * 10000))["blocks"][2]["text"]["text"]) <= 3000


def test_backoff_and_retry_after() -> None:
    rng = random.Random(7)
    delays = [backoff_delay(n, initial=1, maximum=8, retry_after=None, rng=rng) for n in range(1, 7)]
    ceilings = [1, 2, 4, 8, 8, 8]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings, strict=True))
    assert backoff_delay(1, initial=1, maximum=8, retry_after=3, rng=rng) == 3
    assert backoff_delay(1, initial=1, maximum=8, retry_after=300, rng=rng) == 8
    assert retry_after_seconds("12") == 12
    now = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
    assert retry_after_seconds("Sat, 01 Mar 2025 12:00:30 GMT", now=now) == 30
    assert retry_after_seconds("soon") is None
    assert retry_after_seconds(None) is None
