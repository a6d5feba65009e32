"""Notifications of incidents and remediation actions to webhooks (generic JSON or Slack-compatible).

Remediation must never wait on a chat server. :meth:`Notifier.notify` is a plain, non-async call that
renders the body and puts it on one bounded queue per webhook; a background task per webhook posts
them in order, retrying transient failures (connection errors, timeouts, 408/425/429/5xx, honouring
``Retry-After``) with capped exponential backoff. When a webhook's queue is full the notification is
dropped, counted (``xidflow_notifications_total{result="dropped"}``) and logged: losing a chat message
is acceptable, stalling a quarantine is not.

Each body carries an ``Idempotency-Key`` header (the record's id) so that a receiver can discard the
duplicate a retry after a lost response produces. Webhook URLs are secrets (Slack's embed the
credential), so logs and metrics name a webhook by its ``name`` or host only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from enum import StrEnum
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import orjson
from pydantic import BaseModel, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.runtime import metrics
from schemas.records import NodeIncident, Outcome, RemediationRecord, Severity

if TYPE_CHECKING:  # aiohttp is imported when a webhook is delivered to: not at the actuator's start
    import aiohttp

log = logging.getLogger(__name__)

NOTIFICATIONS = metrics.NOTIFICATIONS  # defined with the actuator's other metrics (pipeline.runtime.metrics)
NOTIFICATION_ATTEMPTS = metrics.NOTIFICATION_ATTEMPTS

Notifiable = RemediationRecord | NodeIncident
RETRYABLE_STATUSES = frozenset({408, 425, 429})


class WebhookFormat(StrEnum):
    JSON = "json"
    SLACK = "slack"


class Webhook(BaseModel):
    """One notification target."""

    url: SecretStr = Field(description="http(s) URL; secret, never logged")
    format: WebhookFormat = WebhookFormat.JSON
    name: str = Field(default="", description="Name in logs and metrics (default: the URL's host)")
    headers: dict[str, str] = Field(default_factory=dict, description="Extra headers, e.g. Authorization")

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: SecretStr) -> SecretStr:
        parts = urlsplit(value.get_secret_value())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL")
        return value

    @property
    def label(self) -> str:
        return self.name or (urlsplit(self.url.get_secret_value()).hostname or "webhook")


class NotifySettings(BaseSettings):
    """Settings of webhook notifications, from ``XIDFLOW_NOTIFY_*`` variables.

    ``XIDFLOW_NOTIFY_WEBHOOKS`` is JSON, for example
    ``[{"url": "https://hooks.slack.com/services/...", "format": "slack", "name": "oncall"}]``.
    """

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_NOTIFY_", extra="ignore")

    webhooks: list[Webhook] = Field(default_factory=list, description="Targets (default none: notifications off)")
    queue_size: int = Field(default=1000, ge=1, description="Notifications waiting per webhook before dropping")
    max_attempts: int = Field(default=6, ge=1, description="HTTP attempts per notification (default 6)")
    backoff_initial_seconds: float = Field(default=1.0, gt=0, description="First retry delay (default 1 s)")
    backoff_max_seconds: float = Field(default=60.0, gt=0, description="Retry delay ceiling (default 60 s)")
    timeout_seconds: float = Field(default=10.0, gt=0, description="Per-attempt HTTP timeout (default 10 s)")
    outcomes: set[Outcome] = Field(
        default_factory=lambda: {Outcome.APPLIED, Outcome.FAILED, Outcome.DRY_RUN},
        description="Remediation outcomes notified (default applied, failed, dry-run: redeliveries' "
        "already-applied and opt-out skips would be noise)",
    )
    incident_min_severity: Severity = Field(
        default=Severity.WARNING, description="Least severe incident notified (default warning)"
    )
    stop_drain_seconds: float = Field(
        default=5.0, ge=0, description="On stop, how long queued notifications may still be sent"
    )


# --------------------------------------------------------------------------------------------------
# Pure: what to send


def wants_notification(record: Notifiable, settings: NotifySettings) -> bool:
    if isinstance(record, NodeIncident):
        return record.severity.rank >= settings.incident_min_severity.rank
    return record.outcome in settings.outcomes


def notification_id(record: Notifiable) -> str:
    """Stable per notified fact: an escalated incident (new revision) is a new notification."""
    if isinstance(record, NodeIncident):
        return f"incident:{record.incident_id}:{record.revision}"
    return f"remediation:{record.record_id}"


def summary(record: Notifiable) -> str:
    """One line a person reads first."""
    if isinstance(record, NodeIncident):
        what = f"{record.kind.value} {record.code}" if record.code is not None else record.kind.value
        where = f" on GPU {record.pci}" if record.pci else ""
        verb = "escalated" if record.revision else "opened"
        return (
            f"[{record.severity.value.upper()}] incident {verb} on node {record.node}: {what}{where}, "
            f"{record.count}x; recommended {record.action.value}"
        )
    dry = " (dry-run)" if record.dry_run or record.outcome is Outcome.DRY_RUN else ""
    reason = f": {record.reason}" if record.reason else ""
    return f"xidflow {record.action} on node {record.node} {record.outcome.value}{dry}{reason}"


def generic_body(record: Notifiable) -> dict[str, Any]:
    """Generic JSON: the summary plus the full record, as it is on Kafka."""
    return {
        "event": "incident" if isinstance(record, NodeIncident) else "remediation",
        "id": notification_id(record),
        "node": record.node,
        "summary": summary(record),
        "record": record.model_dump(mode="json"),
    }


def slack_escape(text: str) -> str:
    """Slack mrkdwn treats &, < and > as control characters."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _fields(record: Notifiable) -> list[tuple[str, str]]:
    if isinstance(record, NodeIncident):
        fields = [
            ("Node", record.node),
            ("Severity", record.severity.value),
            ("Action", record.action.value),
            ("Signature", record.signature),
            ("Count", str(record.count)),
            ("Last seen", record.last_seen.isoformat()),
        ]
        if record.escalation_reason:
            fields.append(("Escalation", record.escalation_reason))
        return fields
    fields = [
        ("Node", record.node),
        ("Action", record.action),
        ("Outcome", record.outcome.value),
        ("Finished", record.finished_at.isoformat()),
    ]
    if record.incident_id:
        fields.append(("Incident", record.incident_id))
    if record.worker_id:
        fields.append(("Worker", record.worker_id))
    return fields


def slack_body(record: Notifiable) -> dict[str, Any]:
    """Slack incoming-webhook body: ``text`` (notification fallback) and Block Kit ``blocks``."""
    text = summary(record)
    # Slack limits a section's fields to 10 and each text to 2,000 characters.
    fields = [{"type": "mrkdwn", "text": slack_escape(f"*{k}*\n{v}")[:2000]} for k, v in _fields(record)][:10]
    blocks: list[dict[str, Any]] = [
        {"type": "section", "text": {"type": "mrkdwn", "text": slack_escape(text)[:3000]}},
        {"type": "section", "fields": fields},
    ]
    line = record.line if isinstance(record, NodeIncident) else record.reason
    if line:
        blocks.append(
            {"type": "section", "text": {"type": "mrkdwn", "text": "```" + slack_escape(line)[:2900] + "```"}}
        )
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": slack_escape(notification_id(record))}]})
    return {"text": text, "blocks": blocks}


def render(record: Notifiable, body_format: WebhookFormat) -> bytes:
    body = slack_body(record) if body_format is WebhookFormat.SLACK else generic_body(record)
    return orjson.dumps(body)


def is_retryable(status: int) -> bool:
    return status in RETRYABLE_STATUSES or status >= 500


def retry_after_seconds(value: str | None, now: datetime | None = None) -> float | None:
    """A ``Retry-After`` header (delta seconds or HTTP date) in seconds, or None."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - (now or datetime.now(UTC))).total_seconds())


def backoff_delay(
    attempt: int, *, initial: float, maximum: float, retry_after: float | None, rng: random.Random
) -> float:
    """Delay before attempt ``attempt + 1``: capped exponential with jitter, or the server's Retry-After."""
    if retry_after is not None:
        return min(retry_after, maximum)
    ceiling = min(maximum, initial * 2 ** (attempt - 1))
    # Half fixed, half random: spreads retries of many notifiers without ever retrying at once.
    return ceiling / 2 + rng.uniform(0, ceiling / 2)


# --------------------------------------------------------------------------------------------------
# I/O: the background delivery


@dataclass(frozen=True, slots=True)
class _Notification:
    notification_id: str
    body: bytes


@dataclass(slots=True)
class WebhookStats:
    delivered: int = 0
    failed: int = 0
    dropped: int = 0
    attempts: int = 0


class Notifier:
    """Posts notifications to every configured webhook in the background; ``notify`` never waits."""

    def __init__(
        self,
        settings: NotifySettings,
        *,
        session: aiohttp.ClientSession | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._settings = settings
        self._session = session
        self._owns_session = session is None
        self._rng = rng or random.Random()
        # Queues exist before start() so that notifications raised during startup are kept.
        self._queues: list[asyncio.Queue[_Notification]] = [
            asyncio.Queue(maxsize=settings.queue_size) for _ in settings.webhooks
        ]
        self._tasks: list[asyncio.Task[None]] = []
        self.stats: dict[str, WebhookStats] = {w.label: WebhookStats() for w in settings.webhooks}

    async def start(self) -> None:
        if self._tasks:
            return
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession()
        for webhook, queue in zip(self._settings.webhooks, self._queues, strict=True):
            task = asyncio.create_task(self._deliver_forever(webhook, queue), name=f"notify-{webhook.label}")
            self._tasks.append(task)

    async def stop(self) -> None:
        """Send what is queued for up to ``stop_drain_seconds``, then stop; a slow webhook never blocks it."""
        if self._tasks:
            drained = asyncio.gather(*(queue.join() for queue in self._queues))
            try:
                await asyncio.wait_for(drained, timeout=self._settings.stop_drain_seconds)
            except TimeoutError:
                left = sum(queue.qsize() for queue in self._queues)
                log.warning("notifier stopping with %d notification(s) unsent", left)
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self._tasks.clear()
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None

    def notify(self, record: Notifiable) -> None:
        """Queue ``record`` for every webhook; drops (counted, logged) where a queue is full."""
        if not self._queues or not wants_notification(record, self._settings):
            return
        notification_key = notification_id(record)
        bodies: dict[WebhookFormat, bytes] = {}
        for webhook, queue in zip(self._settings.webhooks, self._queues, strict=True):
            if webhook.format not in bodies:
                bodies[webhook.format] = render(record, webhook.format)
            try:
                queue.put_nowait(_Notification(notification_key, bodies[webhook.format]))
            except asyncio.QueueFull:
                self.stats[webhook.label].dropped += 1
                NOTIFICATIONS.labels(webhook.label, "dropped").inc()
                log.warning(
                    "notification %s to webhook %s dropped: queue full (%d waiting)",
                    notification_key,
                    webhook.label,
                    queue.qsize(),
                )

    async def _deliver_forever(self, webhook: Webhook, queue: asyncio.Queue[_Notification]) -> None:
        while True:
            notification = await queue.get()
            try:
                await self._deliver(webhook, notification)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("notification %s to webhook %s failed", notification.notification_id, webhook.label)
            finally:
                queue.task_done()

    async def _deliver(self, webhook: Webhook, notification: _Notification) -> None:
        import aiohttp

        assert self._session is not None
        settings = self._settings
        stats = self.stats[webhook.label]
        headers = {
            "Content-Type": "application/json",
            "Idempotency-Key": notification.notification_id,
            **webhook.headers,
        }
        timeout = aiohttp.ClientTimeout(total=settings.timeout_seconds)
        problem = ""
        for attempt in range(1, settings.max_attempts + 1):
            retry_after: float | None = None
            stats.attempts += 1
            NOTIFICATION_ATTEMPTS.labels(webhook.label).inc()
            try:
                async with self._session.post(
                    webhook.url.get_secret_value(), data=notification.body, headers=headers, timeout=timeout
                ) as response:
                    if response.status < 300:
                        stats.delivered += 1
                        NOTIFICATIONS.labels(webhook.label, "delivered").inc()
                        return
                    problem = f"HTTP {response.status}"
                    if not is_retryable(response.status):
                        break
                    retry_after = retry_after_seconds(response.headers.get("Retry-After"))
            except (aiohttp.ClientError, TimeoutError) as exc:
                problem = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if attempt < settings.max_attempts:
                delay = backoff_delay(
                    attempt,
                    initial=settings.backoff_initial_seconds,
                    maximum=settings.backoff_max_seconds,
                    retry_after=retry_after,
                    rng=self._rng,
                )
                log.info(
                    "notification %s to webhook %s: %s (attempt %d), retrying in %.1fs",
                    notification.notification_id,
                    webhook.label,
                    problem,
                    attempt,
                    delay,
                )
                await asyncio.sleep(delay)
        stats.failed += 1
        NOTIFICATIONS.labels(webhook.label, "failed").inc()
        log.warning("notification %s to webhook %s given up: %s", notification.notification_id, webhook.label, problem)


@contextlib.asynccontextmanager
async def running_notifier(settings: NotifySettings) -> AsyncIterator[Notifier]:
    """``async with running_notifier(settings) as notifier:`` starts and stops one."""
    notifier = Notifier(settings)
    await notifier.start()
    try:
        yield notifier
    finally:
        await notifier.stop()
