"""Liveness answered by the event loop itself: ``GET /livez`` on ``XIDFLOW_HEALTH_PORT``.

It also fails while a stage registered in :data:`pipeline.runtime.liveness.LIVENESS` has stopped making progress
(the parse stage, the aggregation agent). ``GET /healthz`` on the same port (the readiness probe) answers
the same and also fails while a stage reports a fault only an operator can fix (a partition held at a
record batch it cannot decode): a restart would not fix that and would stop the partitions that flow.

``/metrics`` is served from a thread (prometheus_client), so it keeps answering while the asyncio
loop that does the work is stuck. This endpoint is an asyncio server on the work loop: a blocked
loop cannot answer, and a ticker that must run every second also turns a loop that was recently
stalled for longer than ``XIDFLOW_HEALTH_MAX_LAG_S`` into a 503. Kubernetes' liveness probe restarts
the container either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.runtime.liveness import LIVENESS

log = logging.getLogger("xidflow.heartbeat")
T = TypeVar("T")
TICK_S = 1.0


class HealthSettings(BaseSettings):
    """Event-loop liveness endpoint (environment: ``XIDFLOW_HEALTH_<FIELD>``)."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_HEALTH_", extra="ignore")

    port: int = Field(default=0, description="Default 0 (off). Port of GET /livez, answered by the event loop.")
    addr: str = Field(default="0.0.0.0", description="Default 0.0.0.0. Address the /livez server binds.")
    max_lag_s: float = Field(
        default=10.0, gt=0, description="Default 10. /livez answers 503 when the loop missed its ticks this long."
    )


class Heartbeat:
    """The ticker and the HTTP handler; ``lag()`` is how late the loop is now."""

    def __init__(self, max_lag_s: float) -> None:
        self.max_lag_s = max_lag_s
        self.last_tick = time.monotonic()

    def lag(self) -> float:
        return max(0.0, time.monotonic() - self.last_tick - TICK_S)

    async def tick_forever(self) -> None:
        while True:
            self.last_tick = time.monotonic()
            await asyncio.sleep(TICK_S)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            path = request.split(b" ")[1] if request.count(b" ") >= 2 else b""
            path = path.split(b"?")[0]
            if path not in (b"/livez", b"/healthz"):
                status, body = b"404 Not Found", b"not found\n"
            elif self.lag() > self.max_lag_s:
                status, body = b"503 Service Unavailable", f"event loop lag {self.lag():.1f}s\n".encode()
            # A loop that runs but a stage that stopped progressing; /healthz (readiness) also reports what
            # only an operator fixes (a partition held at an undecodable batch), which a restart would not.
            elif not (progress := LIVENESS.check(faults=path == b"/healthz"))[0]:
                status, body = b"503 Service Unavailable", ("; ".join(progress[1]) + "\n").encode()
            else:
                status, body = b"200 OK", b"ok\n"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()


async def serve(settings: HealthSettings | None = None, beat: Heartbeat | None = None) -> None:
    """Serve /livez on the running loop until cancelled (returns at once when the port is 0 or busy)."""
    settings = settings or HealthSettings()
    if settings.port <= 0:
        return
    beat = beat or Heartbeat(settings.max_lag_s)
    try:
        server = await asyncio.start_server(beat.handle, settings.addr, settings.port)
    except OSError as exc:
        log.warning("liveness endpoint not served on port %d: %s", settings.port, exc)
        return
    ticker = asyncio.create_task(beat.tick_forever())
    try:
        async with server:
            await server.serve_forever()
    finally:
        ticker.cancel()


async def with_liveness(work: Awaitable[T]) -> T:
    """Run ``work`` with /livez served on the same loop."""
    server = asyncio.create_task(serve())
    try:
        return await work
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


def install_faust(app: Any) -> None:
    """Serve /livez from a Faust app's loop (an app task, started with the worker)."""

    async def serve_livez() -> None:  # no parameter: Faust passes the app to a task that takes one
        await serve()

    app.task(serve_livez)
