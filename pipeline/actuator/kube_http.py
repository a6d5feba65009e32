"""The actuator's hot API calls over aiohttp, on the event loop: no call thread, no client models.

A profile of the 500-node burst put most of the actuator's CPU in the official client's call path: a
thread hop per call (and the GIL handed back and forth with the loop), urllib3, and the generated code
around it (parameter checks, a recursive walk of every body before ``json.dumps``). The calls a
quarantine makes - read and patch a Node or its status, create an Event, list the node's pods (the
workload notice: on the official client its thread hop, pydantic-checked arguments and urllib3 were the
dearest call of a flow), read-modify-write the breaker's ConfigMap - go through this instead, with the
same kubeconfig (TLS, client certificate, bearer token and its refresh hook) and the same outcome: a raw
body on success, else the official client's ``ApiException`` (status, reason, body), so
``kube._map_error`` keeps mapping errors as it did.

Each method has the name of the official client method it stands in for, and is handed to
``Kube._call`` like one (a counter of calls by method name sees no difference). Anything with a proxy
or settings this does not cover stays on the official client (``HttpCalls.usable``).
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from kubernetes import client
from kubernetes.client.exceptions import ApiException

_JSON = "application/json"

KEEPALIVE_S = 60.0
"""How long an idle pooled connection is kept. Under the API server's own idle limit (90 s: Go's
``http.Server.IdleTimeout`` as Kubernetes' secure serving sets it), so a call never picks a connection the
server is closing; aiohttp's default (15 s) dropped an idle actuator's pool between bursts."""


def _ssl_context(cfg: client.Configuration) -> ssl.SSLContext | bool:
    """The TLS settings the official client derives from the kubeconfig (``rest.RESTClientObject``)."""
    if not cfg.host.startswith("https"):
        return False
    ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert, cadata=cfg.ca_cert_data)
    if not cfg.verify_ssl:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    elif cfg.assert_hostname is False:
        ctx.check_hostname = False
    if cfg.cert_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    return ctx


def auth_headers(cfg: Any) -> dict[str, str]:
    """The credentials headers of a client configuration, for one request.

    ``auth_settings()`` runs the token refresh hook (in-cluster service account tokens rotate), as the
    official client does before each call."""
    found = cfg.auth_settings().values()
    return {a["key"]: a["value"] for a in found if a.get("in") == "header" and a.get("value")}


@functools.lru_cache(maxsize=16)
def _timeout(connect: float, read: float) -> aiohttp.ClientTimeout:
    """The (connect, read) limits of a call as aiohttp takes them: one frozen object per pair, not one per call (its
    construction was a visible share of the actuators' calls in a burst's profile)."""
    return aiohttp.ClientTimeout(sock_connect=connect, sock_read=read)


class HttpCalls:
    """One aiohttp session per event loop over the kubeconfig's API server; methods return raw bodies."""

    def __init__(self, api_client: client.ApiClient, connections: int) -> None:
        cfg = api_client.configuration
        self.cfg = cfg
        self.base = cfg.host.rstrip("/")
        self.connections = connections
        self.headers = {"Accept": _JSON, **api_client.default_headers}
        self._ssl = _ssl_context(cfg)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @staticmethod
    def usable(api_client: client.ApiClient) -> bool:
        """Whether this transport covers the client's settings (else every call stays on the official one)."""
        cfg = api_client.configuration
        return not cfg.proxy and not cfg.socket_options and cfg.host.startswith(("https://", "http://"))

    def _session_here(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            # A Kube may outlive the loop it first ran on (tests, tools): a session belongs to one loop.
            connector = aiohttp.TCPConnector(limit=self.connections, ssl=self._ssl, keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector)
            self._loop = loop
        return self._session

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            await session.close()

    def close(self) -> None:
        """Close the session from synchronous code: now when its loop runs here, else on that loop, else drop it."""
        session, loop, self._session = self._session, self._loop, None
        if session is None or session.closed or loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.create_task(session.close())
        elif loop.is_running():
            asyncio.run_coroutine_threadsafe(session.close(), loop)

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        content_type: str = _JSON,
        limits: tuple[float, float] = (5, 60),
        params: dict[str, str] | None = None,
    ) -> _Raw:
        """One call; ``limits``: (connect, read) seconds, as the official client's ``_request_timeout``."""
        headers = {**self.headers, **auth_headers(self.cfg)}
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = orjson.dumps(body)
        connect, read = limits
        async with self._session_here().request(
            method,
            self.base + path,
            data=data,
            headers=headers,
            params=params,
            timeout=_timeout(connect, read),
            server_hostname=self.cfg.tls_server_name or None,
        ) as resp:
            raw = await resp.read()
            if not 200 <= resp.status < 300:
                raise ApiException(status=resp.status, reason=resp.reason, body=raw.decode("utf-8", "replace"))
            return _Raw(raw)

    async def warm(self, n: int) -> int:
        """Have ``n`` pooled connections open: ``n`` concurrent ``GET /version`` (a static answer), each on
        a connection of its own, an idle one if there is one, else a new one. Returns how many answered.

        In a profile of the 500-node burst the actuators opened 50 new TLS connections (client
        certificate: a handshake costs CPU on both ends) in the window the taints wait for the API
        server's CPU; a warm pool pays them before, or never.
        """
        answers = await asyncio.gather(
            *(self._request("GET", "/version", limits=(5, 10)) for _ in range(n)), return_exceptions=True
        )
        return sum(not isinstance(a, BaseException) for a in answers)

    async def get_raw(self, path: str) -> bytes:
        """Any GET, its body as it came (the bench reads the API server's own ``/metrics``)."""
        return (await self._request("GET", path, limits=(5, 60))).data

    # -- the official client's method names and arguments (the subset ``Kube`` passes) ----------------------------
    async def read_node(self, name: str, *, _request_timeout: tuple[float, float], **_: Any) -> _Raw:
        return await self._request("GET", f"/api/v1/nodes/{_q(name)}", limits=_request_timeout)

    async def patch_node(
        self, name: str, body: Any, *, _content_type: str, _request_timeout: tuple[float, float], **_: Any
    ) -> _Raw:
        return await self._request("PATCH", f"/api/v1/nodes/{_q(name)}", body, _content_type, _request_timeout)

    async def patch_node_status(
        self, name: str, body: Any, *, _content_type: str, _request_timeout: tuple[float, float], **_: Any
    ) -> _Raw:
        return await self._request("PATCH", f"/api/v1/nodes/{_q(name)}/status", body, _content_type, _request_timeout)

    async def create_namespaced_event(
        self, namespace: str, body: Any, *, _request_timeout: tuple[float, float], **_: Any
    ) -> _Raw:
        return await self._request("POST", f"/api/v1/namespaces/{_q(namespace)}/events", body, limits=_request_timeout)

    async def list_pod_for_all_namespaces(
        self, *, field_selector: str, _request_timeout: tuple[float, float], **_: Any
    ) -> _Raw:
        return await self._request("GET", "/api/v1/pods", params={"fieldSelector": field_selector},
                                   limits=_request_timeout)

    async def list_node(
        self, *, _request_timeout: tuple[float, float], label_selector: str = "", limit: int | None = None,
        _continue: str | None = None, field_selector: str = "", **_: Any,
    ) -> _Raw:
        params = {"labelSelector": label_selector, "fieldSelector": field_selector,
                  "limit": str(limit) if limit else "", "continue": _continue or ""}
        return await self._request("GET", "/api/v1/nodes", limits=_request_timeout,
                                   params={k: v for k, v in params.items() if v})

    async def read_namespace(self, name: str, *, _request_timeout: tuple[float, float], **_: Any) -> _Raw:
        return await self._request("GET", f"/api/v1/namespaces/{_q(name)}", limits=_request_timeout)

    async def create_namespace(self, body: Any, *, _request_timeout: tuple[float, float], **_: Any) -> _Raw:
        return await self._request("POST", "/api/v1/namespaces", body, limits=_request_timeout)

    async def read_namespaced_config_map(
        self, name: str, namespace: str, *, _request_timeout: tuple[float, float], **_: Any
    ) -> _Raw:
        path = f"/api/v1/namespaces/{_q(namespace)}/configmaps/{_q(name)}"
        return await self._request("GET", path, limits=_request_timeout)

    async def create_namespaced_config_map(
        self, namespace: str, body: Any, *, _request_timeout: tuple[float, float], **_: Any
    ) -> _Raw:
        path = f"/api/v1/namespaces/{_q(namespace)}/configmaps"
        return await self._request("POST", path, body, limits=_request_timeout)

    async def replace_namespaced_config_map(
        self, name: str, namespace: str, body: Any, *, _request_timeout: tuple[float, float], **_: Any
    ) -> _Raw:
        path = f"/api/v1/namespaces/{_q(namespace)}/configmaps/{_q(name)}"
        return await self._request("PUT", path, body, limits=_request_timeout)


class _Raw:
    """A response body where ``Kube._call`` reads the official client's raw response (``.data``)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


def _q(part: str) -> str:
    return quote(part, safe="")
