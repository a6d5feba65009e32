"""Every Kubernetes API call the actuator makes, behind one small class.

The official client is synchronous; its calls run in a bounded thread pool so that many nodes are
handled at once without blocking the event loop. The few calls a quarantine makes (a Node, its status,
an Event, the breaker's ConfigMap) go over aiohttp on the loop instead (``pipeline.actuator.kube_http``):
in a burst the thread hops and the official client's per-call work were most of the actuator's CPU.
Responses are read raw and parsed with orjson (``_preload_content=False``): the client's model
deserialisation would cost more than the call.
Errors are mapped to a few exception types the engine decides on (conflict, gone, throttled,
forbidden, unavailable).

One module (about 500 lines) on purpose: it is the one Kubernetes client layer; its length is one short
method per API call plus the shared retry, priority and error mapping every call goes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import heapq
import itertools
import socket
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiohttp
import orjson
import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from pipeline.actuator.kube_http import HttpCalls, auth_headers
from pipeline.runtime.reachability import API_SERVER, carries, route

T = TypeVar("T")

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_PATCH = "application/strategic-merge-patch+json"


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class Conflict(KubeError):
    """409 on update: the object changed since it was read (resourceVersion precondition)."""


class AlreadyExists(KubeError):
    """409 on create: an object of that name exists (our deterministic names make this 'done')."""


class NotFound(KubeError):
    pass


class TooManyRequests(KubeError):
    """429: for evictions, a PodDisruptionBudget refuses the disruption now."""


class Forbidden(KubeError):
    pass


class Invalid(KubeError):
    """422 (or 400): the request itself is wrong; retrying will not help."""


class KubeUnavailable(Exception):
    """The API server could not be reached or answered 5xx: retry later, skip nothing."""

    unreachable: bool = False
    """Not reached at all (a transport error): counted by ``reachability.API_SERVER``, which logs the outage."""


TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (
    urllib3.exceptions.HTTPError, aiohttp.ClientError, TimeoutError, OSError,
)
"""What the clients raise when the API server is not reached (no answer at all)."""


def _not_reached(exc: BaseException) -> KubeUnavailable:
    """The call's error, counted by ``API_SERVER`` (which says when the API server is lost and back)."""
    API_SERVER.failed(f"{type(exc).__name__}: {exc}")
    error = KubeUnavailable(f"{type(exc).__name__}: {exc}")
    error.unreachable = True
    return error


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the API server was not reached: its outage is logged by ``API_SERVER``, not per call."""
    return isinstance(exc, TRANSPORT_ERRORS) or getattr(exc, "unreachable", False)


# urllib3 warns of every retry of the official client's calls ("Retrying (...) after connection broken"): they are
# the API server's failed attempts.
route(("urllib3",), API_SERVER, lambda record: carries(record, TRANSPORT_ERRORS))


def _map_error(exc: ApiException) -> Exception:
    status = exc.status or 0
    reason, message = "", str(exc.reason or "")
    if exc.body:
        try:
            body = orjson.loads(exc.body)
            reason, message = body.get("reason", "") or "", body.get("message", message) or message
        except (orjson.JSONDecodeError, AttributeError):
            pass
    if status == 0 or status >= 500:
        return KubeUnavailable(f"{status} {reason}: {message}")
    if status == 409:
        return (AlreadyExists if reason == "AlreadyExists" else Conflict)(status, reason, message)
    mapping: dict[int, type[KubeError]] = {
        404: NotFound,
        429: TooManyRequests,
        403: Forbidden,
        401: Forbidden,
    }
    return mapping.get(status, Invalid)(status, reason, message)


SERVER_RETRIES = 5
"""Times a read is sent again after the API server answered 5xx asking to retry (``server_retry_after``).
client-go's REST client retries such answers up to 10 times; five waits of its usual 1 s cover a watch cache
that lags etcd by seconds on a busy server, and a read that still fails then is the caller's to retry."""
SERVER_RETRY_CAP_S = 5.0
"""The longest wait taken for one such answer, whatever ``retryAfterSeconds`` says."""


def server_retry_after(exc: ApiException) -> float | None:
    """Seconds the API server asked for before the same call again, or None. Pure.

    A 5xx ``Status`` whose ``details.retryAfterSeconds`` is set: the API server's 504 "Too large resource
    version" (a list or get at a resourceVersion its watch cache has not reached yet: on a busy server the cache
    lags etcd by seconds, seen at 10,000 KWOK nodes on 2 cores), its other timeouts and 503s. Nothing else."""
    if not exc.status or exc.status < 500 or not exc.body:
        return None
    try:
        body = orjson.loads(exc.body)
    except orjson.JSONDecodeError:
        return None
    details = body.get("details") if isinstance(body, dict) else None
    seconds = details.get("retryAfterSeconds") if isinstance(details, dict) else None
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        return None
    return min(float(seconds), SERVER_RETRY_CAP_S)


def _reads(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is a GET: the generated API and ``kube_http`` name their reads ``list_*`` and ``read_*``.
    Only reads are sent again: a write the server timed out on may still be applied."""
    return getattr(fn, "__name__", "").startswith(("list_", "read_"))


class _RetryLater(Exception):
    def __init__(self, after_s: float, error: Exception) -> None:
        super().__init__(str(error))
        self.after_s, self.error = after_s, error


API_PRIORITY: contextvars.ContextVar[int] = contextvars.ContextVar("xidflow_api_priority", default=1)
"""Priority of the API calls made in this context: lower goes first. The engine sets 0 while it takes a node
out of scheduling (``Kube.quarantining``), so that in a storm every node is quarantined before Events and
conditions are written; the breaker's admissions, which every quarantine waits for, run at -1 (and have a
slot of their own: ``PriorityLimiter``)."""

_QUARANTINING: contextvars.ContextVar[PriorityLimiter | None] = contextvars.ContextVar(
    "xidflow_quarantining", default=None
)
"""The limiter that counts this task as quarantining (None: it does not)."""

URGENT_HOLD_S = 5.0
"""Longest wait of one lower-priority call (priority 1 and up: Events, conditions, resumed flows) while this
process is taking nodes out of scheduling and none of its quarantines started or ended. In a burst the taints
then land before any Event or condition, instead of sharing the API server with them; the bound keeps a
quarantine that makes no progress (an API server that does not answer it) from holding everything else up.
It was once the whole wait: in a burst longer than it (a 500-node storm on a loaded machine, 13-24 s), a call
profile counted nearly every Event and the workload's pod list asked for before the last taint."""

URGENT_MAX_HOLD_S = 30.0
"""Longest wait of one lower-priority call while quarantines go on: incidents that never stop arriving do not
starve Events and conditions."""


CALM_AFTER_S = 0.25
"""How long no quarantine must have been in flight before the held calls go (``PriorityLimiter.urgency``)."""


class PriorityLimiter:
    """A semaphore whose waiters are served lowest priority number first, FIFO within a priority.

    While ``urgent`` flows are taking nodes out of scheduling, calls of priority 1 and up do not even
    queue for a slot (while those make progress, up to ``max_hold_s`` each): a slot they held would be one
    a taint waits for, and the API server's time they took would be the taints' too.

    Calls of negative priority (the breaker's read-modify-write) may take one of ``reserve`` extra slots
    when every regular slot is busy. Going first among the waiters is not enough for them: in a burst all
    regular slots hold taint patches, so an admission waited for one of those to return (a whole API call,
    about 240 ms in a profile of a 500-node burst) while every taint of its batch waited for the admission.
    """

    def __init__(
        self,
        limit: int,
        hold_s: float = URGENT_HOLD_S,
        reserve: int = 1,
        calm_after_s: float = CALM_AFTER_S,
        max_hold_s: float = URGENT_MAX_HOLD_S,
    ) -> None:
        self._free = limit
        self._reserve_free = reserve
        self._waiters: list[tuple[int, int, asyncio.Future[bool]]] = []
        self._seq = itertools.count()
        self.hold_s = hold_s
        self.calm_after_s = calm_after_s
        self.max_hold_s = max_hold_s
        self._progress = 0.0  # loop time a quarantine last started or ended
        self.urgent = 0
        self._calm = asyncio.Event()
        self._calm.set()
        self._settling: asyncio.TimerHandle | None = None

    def urgency(self, delta: int) -> None:
        """``delta`` more (or fewer) flows are taking a node out of scheduling now."""
        self.urgent = max(0, self.urgent + delta)
        loop = asyncio.get_running_loop()
        self._progress = loop.time()
        if self._settling is not None:
            self._settling.cancel()
            self._settling = None
        if self.urgent:
            self._calm.clear()
        elif self.calm_after_s <= 0 or self._calm.is_set():
            self._calm.set()
        else:
            # A burst's incidents reach a replica in waves (fetches, the worker's batches): between two waves
            # no quarantine is in flight for a moment, and calls released then would hold the slots and the
            # API server the next wave's taints need. Calm only once no quarantine started for a while.
            self._settling = loop.call_later(self.calm_after_s, self._settle)

    def _settle(self) -> None:
        self._settling = None
        if not self.urgent:
            self._calm.set()

    async def hold(self) -> None:
        """Until calm, while a quarantine started or ended within ``hold_s``; ``max_hold_s`` at most."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.max_hold_s
        while not self._calm.is_set():
            now = loop.time()
            left = min(self._progress + self.hold_s, give_up) - now
            if left <= 0:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._calm.wait(), left)

    async def acquire(self, priority: int) -> bool:
        """Wait for a slot; True when it is a reserved one (hand that back to ``release``)."""
        if priority >= 1 and not self._calm.is_set():
            await self.hold()
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return False
        if priority < 0 and self._reserve_free > 0:
            self._reserve_free -= 1
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._seq), fut))
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # we were handed the slot just as we were cancelled: pass it on
            raise

    def free_now(self) -> int:
        """Regular slots nobody holds or waits for right now (0 while quarantines are in flight)."""
        return 0 if self.urgent or self._waiters else self._free

    def release(self, reserved: bool = False) -> None:
        """Hand a slot back: to the first waiter (a reserved one only to a negative-priority waiter)."""
        while self._waiters and (not reserved or self._waiters[0][0] < 0):
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(reserved)
                return
        if reserved:
            self._reserve_free += 1
        else:
            self._free += 1


_CAMEL = {"label_selector": "labelSelector", "field_selector": "fieldSelector", "resource_version": "resourceVersion",
          "allow_watch_bookmarks": "allowWatchBookmarks", "timeout_seconds": "timeoutSeconds"}
"""The query parameters of ``Kube.open_nodes`` by their Python names, as the API server spells them."""

_RESERVED_SLOTS = 1
"""Calls a Kube may make beyond its concurrency, for negative priority only (the breaker flushes one at a time)."""


def _abort(response: Any) -> None:
    """Close a streaming response now. A plain close waits for the reading thread's lock, i.e. for the
    server's next bytes (up to the watch's timeout): shutting the socket down first wakes that thread."""
    sock = getattr(getattr(response, "connection", None), "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(Exception):
        response.close()


class _CallerGone(Exception):
    """A call not sent because its caller was cancelled while it waited for its thread (never seen by the
    caller, whose await was cancelled)."""


class LazyApi:
    """One of the official client's generated API objects, built (its module imported) at its first call.

    ``api.read_namespaced_pod`` is a stand-in that builds the object when called, on the calling thread:
    ``Kube._call`` and ``Kube._watch`` call it on a pool thread, so the import (~1 s of CPU for
    ``CoreV1Api``) never holds the event loop, whose quarantines go on meanwhile (a restarted replica's
    first drain). The stand-in has the method's name (``pipeline.benchmarks.storm`` counts calls by it).
    """

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._api: Any = None
        self._lock = threading.Lock()

    def built(self) -> Any:
        if self._api is None:
            with self._lock:
                if self._api is None:
                    self._api = self._make()
        return self._api

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return getattr(self.built(), name)(*args, **kwargs)

        call.__name__ = call.__qualname__ = name
        call.lazy_api = self  # type: ignore[attr-defined] - ``Kube._call`` builds it before deciding to send
        return call


class Kube:
    """Async facade over the sync client: one method per call the actuator needs."""

    def __init__(
        self, api_client: client.ApiClient, concurrency: int = 32, request_timeout: tuple[float, float] = (5, 60)
    ) -> None:
        self.api_client = api_client
        # One connection per call thread (the reserved slot's too), plus the long-lived watches (nodes,
        # policies) that hold one each:
        # with only ``concurrency`` connections a busy pool discards one at every return and the next call
        # pays a new TLS handshake (seen in a profile of a burst on a 10,000-node fleet).
        api_client.configuration.connection_pool_maxsize = max(concurrency, 4) + _RESERVED_SLOTS + 4
        # The pool was built with the old size when the client was made; rebuild it.
        api_client.rest_client = type(api_client.rest_client)(api_client.configuration)
        # The official client's API objects (``core``, ``batch``, ``custom``, ``ext``) are built on first use.
        # The hot calls on the loop (the same kubeconfig); the official client where it covers more settings.
        self.http: HttpCalls | None = (
            HttpCalls(api_client, max(concurrency, 4) + _RESERVED_SLOTS) if HttpCalls.usable(api_client) else None
        )
        self._limiter = PriorityLimiter(concurrency, reserve=_RESERVED_SLOTS)
        # A thread for every slot, the reserved one too: a reserved call queued behind busy threads
        # would wait just as long as one queued for a regular slot.
        self._pool = ThreadPoolExecutor(max_workers=concurrency + _RESERVED_SLOTS, thread_name_prefix="kube")
        # (connect, read) seconds: without it a stalled connection would hold a worker thread forever;
        # a timeout surfaces as KubeUnavailable and the record is retried.
        self.request_timeout = request_timeout

    # The generated API objects are built at their first call (``LazyApi``): importing their modules builds
    # hundreds of pydantic models (~1 s of CPU for ``core_v1_api`` alone), and a restarted actuator's first
    # records need none of them (their calls go through ``http``). A process start paid that before its
    # partitions flowed again; a drain's first pod list now pays it on a call thread.
    @functools.cached_property
    def core(self) -> Any:
        return LazyApi(lambda: client.CoreV1Api(self.api_client))

    @functools.cached_property
    def batch(self) -> Any:
        return LazyApi(lambda: client.BatchV1Api(self.api_client))

    @functools.cached_property
    def custom(self) -> Any:
        return LazyApi(lambda: client.CustomObjectsApi(self.api_client))

    @functools.cached_property
    def ext(self) -> Any:
        return LazyApi(lambda: client.ApiextensionsV1Api(self.api_client))

    @property
    def fast(self) -> Any:
        """Where the hot calls go: ``http`` (same method names as ``core``), else ``core``."""
        return self.http if self.http is not None else self.core

    @classmethod
    def from_config(cls, kubeconfig: str | None = None, concurrency: int = 32) -> Kube:
        """From a kubeconfig path, else $KUBECONFIG/~/.kube/config, else the in-cluster service account."""
        try:
            api_client = config.new_client_from_config(config_file=kubeconfig)
        except config.ConfigException:
            if kubeconfig:
                raise
            config.load_incluster_config()
            api_client = client.ApiClient()
        return cls(api_client, concurrency)

    def quarantining(self, on: bool) -> None:
        """This task starts (True) or ends (False) taking a node out of scheduling.

        Its calls then go first (``API_PRIORITY`` 0), and other calls of this process wait for it
        (``PriorityLimiter``). Counted once per task whatever the calls: ending twice is harmless, and
        a task must end it in a ``finally`` (a task cancelled while quarantining would hold others up).
        """
        counted = _QUARANTINING.get()
        if on and counted is None:
            self._limiter.urgency(1)
            _QUARANTINING.set(self._limiter)
        elif not on and counted is not None:
            counted.urgency(-1)  # the limiter that counted it, even if the client was swapped since
            _QUARANTINING.set(None)
        API_PRIORITY.set(0 if on else 1)

    async def until_calm(self) -> None:
        """What an Event or condition call waits for before it queues (``PriorityLimiter.hold``): until no
        quarantine of this process is in flight, bounded. The auditor holds its records on it too."""
        await self._limiter.hold()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.api_client.close()
        if self.http is not None:
            self.http.close()

    async def aclose(self) -> None:
        """``close``, waiting for the loop's HTTP connections to be closed (no unclosed-session warning)."""
        if self.http is not None:
            await self.http.aclose()
        self.close()

    async def keep_warm(self, every_s: float) -> None:
        """Keep a connection open for every call slot (``HttpCalls.warm``): now, then every ``every_s``
        for the slots idle at that moment (busy ones keep their connection warm by their calls). Never
        while a quarantine is in flight (``PriorityLimiter.free_now``): its calls must not wait behind
        these. Runs until cancelled; a failed round is tried again at the next."""
        if self.http is None:
            return
        while True:
            n = self._limiter.free_now()
            if n:
                with contextlib.suppress(Exception):  # an unreachable API server: the next round tries again
                    await self.http.warm(n)
            await asyncio.sleep(every_s)

    async def raw_get(self, path: str) -> bytes:
        """A GET outside the calls above, its body unparsed (the bench's read of the API server's ``/metrics``)."""
        if self.http is None:
            raise KubeUnavailable("raw_get needs the aiohttp transport (HttpCalls.usable)")
        try:
            return await self.http.get_raw(path)
        except ApiException as exc:
            raise _map_error(exc) from None

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """One API call with the limiter's slot; a read the API server asked to retry is sent again after the
        wait it asked for (``server_retry_after``, up to ``SERVER_RETRIES`` times), the slot given back meanwhile."""
        for _ in range(SERVER_RETRIES):
            try:
                return await self._call_once(fn, *args, **kwargs)
            except _RetryLater as later:
                await asyncio.sleep(later.after_s)
        try:
            return await self._call_once(fn, *args, **kwargs)
        except _RetryLater as later:
            raise later.error from None

    async def _call_once(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        reserved = await self._limiter.acquire(API_PRIORITY.get())
        try:
            call = functools.partial(fn, *args, _preload_content=False, _request_timeout=self.request_timeout, **kwargs)
            if self.http is not None and getattr(fn, "__self__", None) is self.http:
                resp = await call()  # kube_http: on the loop, no thread
            else:
                resp = await self._on_thread(loop, fn, call)
        except ApiException as exc:
            if exc.status:
                API_SERVER.reachable()  # it answered
            after = server_retry_after(exc) if _reads(fn) else None
            if after is not None:
                raise _RetryLater(after, _map_error(exc)) from None
            raise _map_error(exc) from None
        except TRANSPORT_ERRORS as exc:
            raise _not_reached(exc) from None
        finally:
            self._limiter.release(reserved)
        API_SERVER.reachable()
        data = resp.data
        return orjson.loads(data) if data else None

    async def _on_thread(self, loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], call: Callable[[], Any]) -> Any:
        """``call`` on a pool thread, not sent if its caller gave up first.

        A thread cannot be cancelled: a flow cancelled (a person's uncordon, a lost partition) while its
        eviction waited for a thread, or for the generated API's first build (about a second of import,
        ``LazyApi``), would otherwise still send it, into a cluster that has moved on (a PDB relaxed
        meanwhile let it through)."""
        gave_up = threading.Event()
        name = getattr(fn, "__name__", "call")

        def send() -> Any:
            lazy = getattr(fn, "lazy_api", None)
            if lazy is not None:
                lazy.built()
            if gave_up.is_set():
                raise _CallerGone(name)
            return call()

        send.__name__ = name  # what a spy on the pool sees (tests, the storm bench)
        try:
            return await loop.run_in_executor(self._pool, send)
        except asyncio.CancelledError:
            gave_up.set()
            raise

    # -- nodes -----------------------------------------------------------------------------------
    async def get_node(self, name: str) -> dict[str, Any]:
        return await self._call(self.fast.read_node, name)

    async def list_nodes(self, label_selector: str = "", limit: int = 500) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"label_selector": label_selector, "limit": limit}
            if token:
                kw["_continue"] = token
            page = await self._call(self.fast.list_node, **kw)
            items += page.get("items") or []
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items

    async def patch_node(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """JSON merge patch; put ``metadata.resourceVersion`` in the body to make it conditional."""
        return await self._call(self.fast.patch_node, name, body, _content_type=MERGE_PATCH)

    async def patch_node_status(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Strategic merge patch on the status subresource: conditions merge by type."""
        return await self._call(self.fast.patch_node_status, name, body, _content_type=STRATEGIC_PATCH)

    # -- events, pods, jobs ------------------------------------------------------------------------
    async def create_event(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call(self.fast.create_namespaced_event, namespace, body)

    async def list_pods_on_node(self, node: str) -> list[dict[str, Any]]:
        page = await self._call(self.fast.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node}")
        return page.get("items") or []

    async def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        return await self._call(self.core.read_namespaced_pod, name, namespace)

    async def evict_pod(self, namespace: str, name: str, grace_seconds: int | None) -> None:
        body: dict[str, Any] = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        if grace_seconds is not None:
            body["deleteOptions"] = {"gracePeriodSeconds": grace_seconds}
        await self._call(self.core.create_namespaced_pod_eviction, name, namespace, body)

    async def delete_pod(self, namespace: str, name: str, grace_seconds: int) -> None:
        await self._call(self.core.delete_namespaced_pod, name, namespace, grace_period_seconds=grace_seconds)

    async def create_job(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call(self.batch.create_namespaced_job, namespace, body)

    async def get_job(self, namespace: str, name: str) -> dict[str, Any]:
        return await self._call(self.batch.read_namespaced_job, name, namespace)

    async def list_pods(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """A namespace's pods matching a label selector (a hook Job's pods, by ``batch.kubernetes.io/job-name``)."""
        page = await self._call(self.core.list_namespaced_pod, namespace, label_selector=label_selector)
        return page.get("items") or []

    # -- configmaps (shared state) ---------------------------------------------------------------------
    async def get_configmap(self, namespace: str, name: str) -> dict[str, Any]:
        return await self._call(self.fast.read_namespaced_config_map, name, namespace)

    async def create_configmap(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call(self.fast.create_namespaced_config_map, namespace, body)

    async def replace_configmap(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """PUT with the read resourceVersion in the body: 409 when another replica wrote first."""
        return await self._call(self.fast.replace_namespaced_config_map, name, namespace, body)

    # -- policies -----------------------------------------------------------------------------------
    async def crd_installed(self, name: str) -> bool:
        try:
            await self._call(self.ext.read_custom_resource_definition, name)
        except NotFound:
            return False
        return True

    async def list_cluster_objects(
        self, group: str, version: str, plural: str, label_selector: str = ""
    ) -> list[dict[str, Any]]:
        page = await self._call(
            self.custom.list_cluster_custom_object, group, version, plural, label_selector=label_selector
        )
        return page.get("items") or []

    # -- decision API: node preconditions (the pending-plans ledger uses the ConfigMap calls above) -------
    async def node_matches(self, name: str, label_selector: str) -> bool:
        """Whether node ``name`` matches ``label_selector``, evaluated by the API server (full syntax)."""
        page = await self._call(
            self.core.list_node, field_selector=f"metadata.name={name}", label_selector=label_selector
        )
        return bool(page.get("items"))

    def open_nodes(self, timeout: tuple[float, float], **params: Any) -> Any:
        """GET /api/v1/nodes (a list or, with ``watch=True``, a watch) from a thread: the unread response.

        Made on the official client's connection pool with its TLS and auth (the token refresh hook
        too), not through its generated ``CoreV1Api``: the node watch lists as soon as a replica starts,
        and importing that module first (~1 s of CPU) held the list and competed with the first records.
        A status other than 2xx raises ``ApiException`` as the official client would. The caller reads
        the response (``.data`` or ``kubernetes.watch.watch.iter_resp_lines``) and releases it.
        """
        cfg = self.api_client.configuration
        headers = {"Accept": "application/json", **self.api_client.default_headers, **auth_headers(cfg)}
        query = {_CAMEL.get(k, k): str(v).lower() if isinstance(v, bool) else str(v)
                 for k, v in params.items() if v not in (None, "")}
        resp = self.api_client.rest_client.pool_manager.request(
            "GET", cfg.host.rstrip("/") + "/api/v1/nodes", fields=query, headers=headers, preload_content=False,
            timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]),
        )
        if not 200 <= resp.status < 300:
            body = resp.data.decode("utf-8", "replace")
            resp.release_conn()
            raise ApiException(status=resp.status, reason=resp.reason, body=body)
        return resp

    # -- policies: list with resourceVersion, watch, status --------------------------------------------
    async def list_cluster_objects_page(
        self, group: str, version: str, plural: str, label_selector: str = ""
    ) -> dict[str, Any]:
        """The whole list object (``items`` and ``metadata.resourceVersion``, where a watch starts)."""
        return await self._call(
            self.custom.list_cluster_custom_object, group, version, plural, label_selector=label_selector
        )

    async def patch_cluster_object_status(
        self, group: str, version: str, plural: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """JSON merge patch of a cluster-scoped custom object's status subresource."""
        return await self._call(
            self.custom.patch_cluster_custom_object_status,
            group,
            version,
            plural,
            name,
            body,
            _content_type=MERGE_PATCH,
        )

    async def watch_cluster_objects(
        self,
        group: str,
        version: str,
        plural: str,
        resource_version: str | None,
        label_selector: str = "",
        timeout_seconds: int = 300,
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events (``{"type", "object"}``) from ``resource_version`` until the server ends the watch.

        The stream is read on its own thread (not the call pool, which it would hold for minutes);
        leaving the iteration closes the connection. An ``ERROR`` event (410 Gone) means: list again.
        """
        kwargs: dict[str, Any] = {"label_selector": label_selector}
        if resource_version:
            kwargs["resource_version"] = resource_version
        opener = functools.partial(self.custom.list_cluster_custom_object, group, version, plural)
        async with contextlib.aclosing(self._watch(opener, plural, timeout_seconds, **kwargs)) as events:
            async for item in events:
                yield item

    async def watch_pods_on_node(
        self, node: str, resource_version: str | None, timeout_seconds: int = 60
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events of the pods bound to ``node`` from ``resource_version`` (a drain's checkpoint wait)."""
        kwargs: dict[str, Any] = {"field_selector": f"spec.nodeName={node}"}
        if resource_version:
            kwargs["resource_version"] = resource_version
        watch = self._watch(self.core.list_pod_for_all_namespaces, "pods", timeout_seconds, **kwargs)
        async with contextlib.aclosing(watch) as events:
            async for item in events:
                yield item

    async def list_pods_on_node_page(self, node: str) -> dict[str, Any]:
        """The node's pods as one list object (``items`` and ``metadata.resourceVersion``, where a watch starts)."""
        return await self._call(self.fast.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node}")

    async def _watch(
        self, list_fn: Callable[..., Any], what: str, timeout_seconds: int, **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events (``{"type", "object"}``) of a list call until the server ends the watch.

        The stream is read on its own thread (not the call pool, which it would hold for minutes);
        leaving the iteration closes the connection. An ``ERROR`` event (410 Gone) means: list again.
        """
        loop = asyncio.get_running_loop()
        kwargs.update({
            "watch": True,
            "allow_watch_bookmarks": True,
            "timeout_seconds": timeout_seconds,
            "_preload_content": False,
            "_request_timeout": (self.request_timeout[0], timeout_seconds + 30),
        })
        opener = functools.partial(list_fn, **kwargs)
        try:
            response = await loop.run_in_executor(None, opener)
        except ApiException as exc:
            raise _map_error(exc) from None
        except TRANSPORT_ERRORS as exc:
            raise _not_reached(exc) from None
        API_SERVER.reachable()
        queue: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()

        def hand_over(item: dict[str, Any] | BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening any more
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def pump() -> None:
            buffer = b""
            try:
                for chunk in response.stream(65536, decode_content=True):
                    buffer += chunk
                    while b"\n" in buffer:
                        line, buffer = buffer.split(b"\n", 1)
                        if line.strip():
                            hand_over(orjson.loads(line))
            except BaseException as exc:  # noqa: BLE001 - handed to the reader, which decides
                hand_over(exc)
            finally:
                hand_over(None)

        threading.Thread(target=pump, name=f"watch-{what}", daemon=True).start()
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise KubeUnavailable(f"watch of {what} broke: {type(item).__name__}: {item}")
                yield item
        finally:
            _abort(response)

    # -- any cluster-scoped API object by group/version/plural (built-in groups too: resource.k8s.io) -----
    async def list_cluster_objects_all(
        self, group: str, version: str, plural: str, *, label_selector: str = "", field_selector: str = "",
        limit: int = 500,
    ) -> list[dict[str, Any]]:
        """Every object of a cluster-scoped resource matching the selectors, page by page."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"label_selector": label_selector, "field_selector": field_selector, "limit": limit}
            if token:
                kw["_continue"] = token
            page = await self._call(self.custom.list_cluster_custom_object, group, version, plural, **kw)
            items += page.get("items") or []
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items

    async def get_cluster_object(self, group: str, version: str, plural: str, name: str) -> dict[str, Any]:
        return await self._call(self.custom.get_cluster_custom_object, group, version, plural, name)

    async def create_cluster_object(
        self, group: str, version: str, plural: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        return await self._call(self.custom.create_cluster_custom_object, group, version, plural, body)

    async def delete_cluster_object(self, group: str, version: str, plural: str, name: str) -> None:
        await self._call(self.custom.delete_cluster_custom_object, group, version, plural, name)

    async def patch_cluster_object(
        self, group: str, version: str, plural: str, name: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """JSON merge patch of a cluster-scoped custom object (not its status)."""
        return await self._call(
            self.custom.patch_cluster_custom_object, group, version, plural, name, body, _content_type=MERGE_PATCH
        )
    # -- the workload on a node (notifyWorkload) -------------------------------------------------------
    async def patch_pod_status(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """Strategic merge patch on the pod's status subresource: conditions merge by type."""
        return await self._call(
            self.core.patch_namespaced_pod_status, name, namespace, body, _content_type=STRATEGIC_PATCH
        )

    async def get_namespaced_object(
        self, group: str, version: str, namespace: str, plural: str, name: str
    ) -> dict[str, Any]:
        """GET any namespaced object by its REST path (a ReplicaSet, a Job, a ResourceClaim)."""
        return await self._call(self.custom.get_namespaced_custom_object, group, version, namespace, plural, name)

    async def list_resource_slices(self, node: str, version: str = "v1") -> list[dict[str, Any]]:
        """The node's ResourceSlices (``resource.k8s.io``); NotFound when the API server does not serve DRA."""
        page = await self._call(
            self.custom.list_cluster_custom_object,
            "resource.k8s.io",
            version,
            "resourceslices",
            field_selector=f"spec.nodeName={node}",
        )
        return page.get("items") or []
