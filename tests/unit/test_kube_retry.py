"""A read the API server asked to retry (5xx with ``retryAfterSeconds``) is sent again; a write is not.

The bench's 10,000-node fleet on this 2-core machine met the API server's answer below on a plain node list
(its watch cache lagging etcd under load) and stopped; client-go retries it.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from pipeline.actuator import kube as kube_mod
from pipeline.actuator.kube import Kube, KubeUnavailable, server_retry_after


def status(code: int, reason: str, message: str, retry_after: object = None) -> bytes:
    """A ``Status`` body as the API server writes it."""
    body: dict = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
                  "reason": reason, "code": code}
    if retry_after is not None:
        body["details"] = {"retryAfterSeconds": retry_after}
    return orjson.dumps(body)


TOO_LARGE = status(504, "Timeout", "Timeout: Too large resource version: 29112, current: 26363", 1)


def test_the_servers_retry_answers_are_read() -> None:
    assert server_retry_after(ApiException(status=504, reason="Gateway Timeout")) is None  # no body
    too_large = ApiException(status=504, reason="Gateway Timeout")
    too_large.body = TOO_LARGE
    assert server_retry_after(too_large) == 1.0
    for code, reason, after, expected in [
        (503, "ServiceUnavailable", 3, 3.0),
        (500, "InternalError", None, None),  # no retryAfterSeconds: not an invitation
        (429, "TooManyRequests", 1, None),  # a PDB's refusal or APF: the callers' own handling
        (504, "Timeout", 3600, kube_mod.SERVER_RETRY_CAP_S),
        (504, "Timeout", True, None),
        (504, "Timeout", -1, None),
    ]:
        exc = ApiException(status=code, reason=reason)
        exc.body = status(code, reason, "m", after)
        assert server_retry_after(exc) == expected, (code, after)
    garbled = ApiException(status=503, reason="x")
    garbled.body = b"<html>503</html>"
    assert server_retry_after(garbled) is None


class _Answer:
    def __init__(self, data: bytes) -> None:
        self.data = data


def _kube() -> Kube:
    configuration = client.Configuration()
    configuration.host = "http://127.0.0.1:9"  # nothing is sent: the calls below are local functions
    return Kube(client.ApiClient(configuration), concurrency=2)


def _failing(name: str, failures: int, body: bytes) -> tuple[object, list[int]]:
    calls: list[int] = []

    def call(**_: object) -> _Answer:
        calls.append(1)
        if len(calls) <= failures:
            exc = ApiException(status=504, reason="Gateway Timeout")
            exc.body = body
            raise exc
        return _Answer(b'{"items": []}')

    call.__name__ = name
    return call, calls


def test_a_read_is_sent_again_until_the_server_answers() -> None:
    fast = status(504, "Timeout", "Timeout: Too large resource version: 2, current: 1", 0)
    read, calls = _failing("list_node", 2, fast)
    assert asyncio.run(_kube()._call(read)) == {"items": []}
    assert len(calls) == 3


def test_a_read_gives_up_after_the_retries() -> None:
    fast = status(504, "Timeout", "Timeout: Too large resource version: 2, current: 1", 0)
    read, calls = _failing("read_node", 100, fast)
    with pytest.raises(KubeUnavailable, match="Too large resource version"):
        asyncio.run(_kube()._call(read))
    assert len(calls) == kube_mod.SERVER_RETRIES + 1


def test_a_write_is_not_sent_again() -> None:
    timed_out = status(504, "Timeout", "Timeout: request did not complete within the allotted timeout", 0)
    write, calls = _failing("patch_node", 1, timed_out)
    with pytest.raises(KubeUnavailable):
        asyncio.run(_kube()._call(write))
    assert len(calls) == 1
