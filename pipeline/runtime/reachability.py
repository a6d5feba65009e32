"""A dependency's reachability, logged as state changes: a few sentences per outage, not a line per attempt.

Every process talks to dependencies it cannot do without (the Kafka broker; the actuator also the Kubernetes API
server, the Loki bridge also Loki) and retries while one is gone. A line per failed attempt made an outage a
flood (a worker wrote ~7,000 ERROR lines in 42 s without a broker, each actuator ~3,000). Here each dependency
is one ``Dependency``, and its outage is three kinds of line, the same in every process:

- ``WARNING <what> unreachable: <the first failure>`` when the first attempt fails;
- ``ERROR <what> still unreachable after <s> s: <n> failed attempts, the last: <...>`` once a minute while it
  lasts (a short blip stays a warning);
- ``INFO <what> reachable again after <s> s (<n> failed attempts)`` when an attempt succeeds and none failed
  for ``settle_s`` (one broker of three down keeps failing while the others answer: that is not "back").

Client libraries log every attempt themselves (aiokafka, Faust, urllib3). ``ClientRetries`` is a filter on the
handlers of every process (``pipeline.runtime.logconfig``): a record of a registered client logger that
carries a connection failure (by the exception it carries, never by its text) is counted by its dependency
instead of written, and so is anything else that logger says while the dependency is down (its metadata and
coordinator retries, its rediscoveries as the dependency comes back). The modules that own a
client register its loggers with ``route`` (``pipeline.kafka.reachability`` for the broker,
``pipeline.actuator.kube`` for the API server); ``failed`` and ``reachable`` are called where the code itself
knows (``Kube``'s calls, the Loki bridge's connection).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("xidflow.reachability")

REMIND_EVERY_S = 60.0
SETTLE_S = 5.0


class Dependency:
    """The reachability of one dependency of this process; thread-safe (client threads report too)."""

    def __init__(
        self,
        what: str,
        remind_every_s: float = REMIND_EVERY_S,
        settle_s: float = SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        self.what, self.remind_every_s, self.settle_s = what, remind_every_s, settle_s
        self.clock, self.log = clock, logger
        self._lock = threading.Lock()
        self.down = False
        self.failures = 0
        self._since = self._last_failure = self._reminded = self._last_ok = 0.0
        self._detail = ""
        self._recheck_loop: asyncio.AbstractEventLoop | None = None  # where a look at "back yet?" is booked

    def failed(self, detail: str) -> None:
        """An attempt to reach it failed (``detail``: what the client said, for people)."""
        with self._lock:
            now = self.clock()
            self._last_failure, self._detail = now, detail
            if not self.down:
                self.down, self.failures, self._since, self._reminded = True, 1, now, now
                self.log.warning("%s unreachable: %s (said again once a minute while it lasts, and when it is back)",
                                 self.what, detail)
                return
            self.failures += 1
            if now - self._reminded >= self.remind_every_s:
                self._reminded = now
                self.log.error("%s still unreachable after %.0f s: %d failed attempts, the last: %s",
                               self.what, now - self._since, self.failures, detail)

    def reachable(self) -> None:
        """An attempt succeeded. Cheap while up: one attribute read."""
        if not self.down:
            return
        with self._lock:
            if not self.down:
                return
            now = self.clock()
            self._last_ok = now
            if now - self._last_failure < self.settle_s:
                self._recheck_later(self._last_failure + self.settle_s - now)
                return
            self._back(now)

    def _back(self, now: float) -> None:
        self.down = False
        self.log.info("%s reachable again after %.0f s (%d failed attempts)", self.what, now - self._since,
                      self.failures)

    def _recheck_later(self, delay: float) -> None:
        """Look again once the settling time is over (from the event loop, when this thread runs one)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # a client thread: the next success on the loop looks again
        # One look pending is enough, but only on this loop: these objects outlive an event loop (a
        # process that runs ``asyncio.run`` twice, each test's own loop), and a look booked on a loop
        # that has closed never comes, which left the dependency "unreachable" while it answered.
        if self._recheck_loop is loop and not loop.is_closed():
            return
        self._recheck_loop = loop
        loop.call_later(max(0.0, delay) + 0.01, self._recheck)

    def _recheck(self) -> None:
        with self._lock:
            self._recheck_loop = None
            if not self.down:
                return
            now = self.clock()
            if self._last_ok > self._last_failure and now - self._last_failure >= self.settle_s:
                self._back(now)
            elif self._last_ok > self._last_failure:
                self._recheck_later(self._last_failure + self.settle_s - now)


BROKER = Dependency("Kafka broker")
API_SERVER = Dependency("Kubernetes API server")
LOKI = Dependency("Loki")


@dataclass(frozen=True)
class Route:
    """Records of the loggers under ``prefix`` that ``is_failure`` recognises are ``dependency``'s attempts."""

    prefix: str
    dependency: Dependency
    is_failure: Callable[[logging.LogRecord], bool]

    def owns(self, name: str) -> bool:
        return name == self.prefix or name.startswith(self.prefix + ".")


_ROUTES: dict[str, Route] = {}


def route(prefixes: tuple[str, ...], dependency: Dependency, is_failure: Callable[[logging.LogRecord], bool]) -> None:
    """Count the failed attempts these client loggers report as ``dependency``'s (idempotent)."""
    for prefix in prefixes:
        _ROUTES[prefix] = Route(prefix, dependency, is_failure)


def carries(record: logging.LogRecord, types: tuple[type[BaseException], ...]) -> bool:
    """Whether the record's arguments or its exception are one of ``types`` (what a client logs a failure with)."""
    if record.exc_info and isinstance(record.exc_info[1], types):
        return True
    args = record.args if isinstance(record.args, tuple) else ()
    return any(isinstance(arg, types) for arg in args)


class ClientRetries(logging.Filter):
    """On a handler: client records of failed attempts go to their dependency's count, not to the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _ROUTES:
            return True
        for candidate in _ROUTES.values():
            if candidate.owns(record.name):
                if candidate.is_failure(record) or candidate.dependency.down:
                    candidate.dependency.failed(f"{record.name}: {record.getMessage()}")
                    return False
                return True
        return True
