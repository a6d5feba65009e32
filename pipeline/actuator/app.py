"""Wiring: settings -> Kube, Auditor, PolicyStore, Breaker, DrainSlots, RepairBudgets, Engine, ActuatorConsumer,
Reconciler, AnswerWatch."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from typing import Any

from pipeline.actuator import signing
from pipeline.actuator.audit import Auditor, NotifierLike, default_worker_id, make_record
from pipeline.actuator.breaker import Breaker, DrainSlots
from pipeline.actuator.breaker_rules import Admission
from pipeline.actuator.budgets import RepairBudgets
from pipeline.actuator.consumer import ActuatorConsumer
from pipeline.actuator.effects import now_rfc3339, object_name
from pipeline.actuator.engine import Engine
from pipeline.actuator.fleetmetrics import FleetGauges
from pipeline.actuator.kube import AlreadyExists, Forbidden, Kube, NotFound
from pipeline.actuator.policy import PolicySet
from pipeline.actuator.policystore import PolicyStore
from pipeline.actuator.reconciler import Reconciler
from pipeline.actuator.repairrequest import AnswerWatch
from pipeline.actuator.settings import ActuatorSettings
from pipeline.actuator.sharedparts import SharedParts
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.lag import LagMonitor
from pipeline.runtime.settings import KafkaSettings, TopicNames
from pipeline.runtime.startmarks import mark
from schemas.records import FabricSignal, Outcome

log = logging.getLogger("xidflow.actuator")


ACTUATOR_TOPICS = ("incidents", "remediation_requests", "fabric_signals", "remediation_audit", "deadletter")
"""The topics an actuator reads (incidents, rescue requests, fabric signals) and writes (audit, dead letters)."""


def actuator_topics(topics: TopicNames) -> list[str]:
    """The names of ``ACTUATOR_TOPICS`` under ``topics``: what must exist before an actuator starts."""
    return [topics.name(n) for n in ACTUATOR_TOPICS]


def manual_only_from_api_settings() -> bool:
    """The decision API's ``ApiSettings.manual_only`` (``XIDFLOW_API_MANUAL_ONLY``) when that module is present."""
    try:
        api = importlib.import_module("pipeline.actuator.api.settings")  # not the aiohttp application
        settings_cls = api.ApiSettings
        return bool(settings_cls().manual_only)
    except (ImportError, AttributeError, ValueError) as exc:
        log.debug("ApiSettings not usable (%s); manual_only from XIDFLOW_ACTUATOR_MANUAL_ONLY only", exc)
        return False


def load_notifier() -> Any | None:
    """``pipeline.actuator.notify.Notifier`` when present and webhooks are configured; None otherwise."""
    try:
        notify = importlib.import_module("pipeline.actuator.notify")
    except ImportError:
        return None
    settings = notify.NotifySettings()
    if not settings.webhooks:
        return None
    return notify.Notifier(settings)


async def ensure_namespace(kube: Kube, namespace: str) -> None:
    """Create the actuator's namespace when missing (deployments create it; RBAC may forbid looking)."""
    try:
        await kube._call(kube.fast.read_namespace, namespace)
    except Forbidden:
        return
    except NotFound:
        try:
            await kube._call(
                kube.fast.create_namespace, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
            )
        except AlreadyExists:
            pass


class Actuator:
    """One actuator replica."""

    def __init__(
        self,
        settings: ActuatorSettings | None = None,
        kafka: KafkaSettings | None = None,
        topics: TopicNames | None = None,
        kubeconfig: str | None = None,
        policies: PolicySet | None = None,
        notifier: NotifierLike | None = None,
    ) -> None:
        self.settings = settings or ActuatorSettings()
        if not self.settings.worker_id:
            self.settings = self.settings.model_copy(update={"worker_id": default_worker_id()})
        if manual_only_from_api_settings():
            self.settings = self.settings.model_copy(update={"manual_only": True})
        self.kafka = kafka or kafka_clients.load_settings()  # refuses bad KAFKA_* naming the variable
        self.topics = topics or TopicNames()
        self.kube = Kube.from_config(kubeconfig, self.settings.api_concurrency)
        self._keep_warm: asyncio.Task[None] | None = None
        """``Kube.keep_warm`` while consuming."""
        self.notifier = notifier if notifier is not None else load_notifier()
        # Audit records wait for what Events and conditions wait for: the taints of a burst go first.
        self.auditor = Auditor(
            self.kafka.bootstrap_servers,
            self.topics.name("remediation_audit"),
            self.notifier,
            hold=lambda: self.engine.kube.until_calm(),
        )
        self.policies = PolicyStore(self.kube, self.settings, policies)
        s = self.settings
        self.breaker = Breaker(
            self.kube,
            s.namespace,
            s.breaker_configmap,
            s.gpu_node_selector,
            s.breaker_max_share,
            s.breaker_window_seconds,
            s.fleet_cache_seconds,
            on_trip=self._on_trip,
            block=s.breaker_reserve_block,
            max_nodes=s.breaker_max_nodes,
        )
        self.drains = DrainSlots(
            self.kube, s.namespace, s.drains_configmap, s.max_concurrent_drains, s.claim_timeout_seconds
        )
        self.budgets = RepairBudgets(
            self.kube, s.namespace, s.repair_budgets_configmap, s.claim_timeout_seconds,
            lambda: self.policies.current.repair_budgets, s.gpu_node_selector,
        )
        self.engine = Engine(self.kube, self.auditor, s, self.policies, self.breaker, self.drains, self.budgets)
        self.engine.on_request_done = self._release_plan
        self.shared_parts = SharedParts(self.kube, self.engine.writer, self.auditor, s, self.policies)
        self.consumer = ActuatorConsumer(
            self.kafka.bootstrap_servers,
            s.group_id,
            self.topics.name("incidents"),
            self.topics.name("remediation_requests"),
            self.topics.name("deadletter"),
            self.handle,
            s.max_in_flight,
            s.commit_interval_seconds,
            fabric_topic=self.topics.name("fabric_signals"),
        )
        self.consumer.refuse = lambda r, why: self.auditor.emit(  # issue 12: audit refused (unsigned) requests
            signing.refusal(r.node_name, r.request_id, r.requested_by, why, s.worker_id))
        self.reconciler = Reconciler(self.engine, self.kube, s.gpu_node_selector, s.resync_seconds)
        self.consumer.on_assigned = self.reconciler.assign
        self.engine.writer.peek = lambda name: self.reconciler.nodes.get(name)  # writes start from the watch cache
        self.breaker.cache = self.reconciler.fleet_snapshot  # the breaker counts the fleet from the watch too
        self.budgets.sizes = self.reconciler.group_size  # a budget's share of a group, counted from the watch
        # The external repair systems' answers (RepairRequest status), watched: the node is looked at at once.
        self.answers = AnswerWatch(self.kube, self.reconciler.look_at)
        self.engine.cases.answers = self.answers.answer
        self._given_policies = policies is not None
        # Metrics refreshed on timers: the group's lag, and fleet gauges from the reconciler's node cache.
        self.lag = LagMonitor({s.group_id: list(self.consumer.topics)}, self.kafka.bootstrap_servers)
        self.gauges = FleetGauges(self.reconciler.with_work, self.breaker, fleet=self.reconciler.fleet_snapshot)

    async def handle(self, record: Any, on_durable: Any = None) -> None:
        """One consumed record: fabric signals to the shared-part correlation, everything else to the engine."""
        if isinstance(record, FabricSignal):
            await self.shared_parts.handle(record)
            return
        await self.engine.handle(record, on_durable)

    def webhook_names(self) -> list[str]:
        """The configured webhooks' names (label values of the notification metrics)."""
        return list(getattr(self.notifier, "stats", None) or {})

    async def _release_plan(self, request_id: str) -> None:
        """Tell the decision API's shared pending-plans ledger that this request's plan is over."""
        from pipeline.actuator.api import ApiSettings, ConfigMapPlanLedger

        await ConfigMapPlanLedger.from_settings(self.kube, ApiSettings()).release(request_id)

    async def _on_trip(self, admission: Admission, node: str) -> None:
        """Audit the trip and raise a Warning Event on the breaker ConfigMap."""
        s = self.settings
        await self.auditor.emit(
            make_record(
                node=node,
                flow_key=None,
                action="breaker-trip",
                outcome=Outcome.APPLIED,
                reason=admission.reason,
                worker_id=s.worker_id,
            )
        )
        now = now_rfc3339()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": object_name("xidflow-breaker", admission.reason, now), "namespace": s.namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "name": s.breaker_configmap,
                "namespace": s.namespace,
            },
            "reason": "CircuitBreakerTripped",
            "message": admission.reason[:1024],
            "type": "Warning",
            "source": {"component": "xidflow-actuator"},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self.kube.create_event(s.namespace, body)
        except AlreadyExists:
            pass

    async def start(self, consume: bool = True) -> None:
        """Connect; ``consume=False`` readies only the engine (``self.engine.handle``), for tests and tools."""
        await ensure_namespace(self.kube, self.settings.namespace)
        mark("namespace")
        if not self._given_policies:
            await self.policies.refresh()
            self.policies.start_watching()  # policy edits are in force within moments, not at a poll
        mark("policies")
        await self.auditor.start()
        mark("auditor")
        if self.notifier is not None and hasattr(self.notifier, "start"):
            await self.notifier.start()
        self._consuming = consume
        if consume:
            if every := self.settings.api_keep_warm_seconds:
                self._keep_warm = asyncio.create_task(self.kube.keep_warm(every), name="kube-keep-warm")
            self.reconciler.start()
            self.answers.start()
            await self.consumer.start()
            mark("consumer")
            self.lag.start()
            self.gauges.start()

    async def run(self) -> None:
        await self.consumer.run()

    async def stop(self) -> None:
        self.auditor.hurry()  # the flows still running finish now: their records are not held for calm
        await self.policies.stop_watching()
        if getattr(self, "_consuming", False):
            keep_warm, self._keep_warm = self._keep_warm, None
            if keep_warm is not None:
                keep_warm.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keep_warm
            await self.gauges.stop()
            await self.lag.stop()
            # The reconciler first: the long steps it drives hand their leases over before we leave the group.
            await self.answers.stop()
            await self.reconciler.stop()
            await self.consumer.stop()
        await self.breaker.close()  # hands its reserved headroom back instead of letting it lapse
        await self.auditor.stop()
        if self.notifier is not None and hasattr(self.notifier, "stop"):
            await self.notifier.stop()
        await self.kube.aclose()

    async def run_forever(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set or the consumer gives up (a bug); then shut down cleanly.

        A consumer that stopped on its own leaves its unfinished records uncommitted and the process
        exits non-zero, so the orchestrator restarts it and the records are replayed, not skipped.
        """
        await self.start()
        runner = asyncio.create_task(self.run())
        stopper = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopper.cancel()
            self.consumer._stopping.set()
            failed = self.consumer.failed
            (ended,) = await asyncio.gather(runner, return_exceptions=True)
            # What escaped the consumer (not a node worker's failure, which sets ``failed``): said here, or
            # the process would exit 0 without a line (the Kafka client raising out of a fetch, say).
            error = ended if isinstance(ended, Exception) else None
            if error is not None:
                log.error("actuator: the consumer stopped: %s: %s", type(error).__name__, error, exc_info=error)
            await self.stop()
        if failed or self.consumer.failed or (error is not None and not stop.is_set()):
            raise RuntimeError("the actuator consumer stopped after an unexpected error; see the log") from error
