"""How a dead letter is reported where it is made: one log line (throttled) and one metric count.

Every stage that dead-letters (the worker's adapters, parse stage and aggregation, the actuator's
consumer, the Loki bridge) reports through a ``DeadLetterReporter``, so an operator finds the same
log line ``dead letter from <topic> (<stage>, <code>): <reason>`` and the same
``xidflow_deadletters_total{stage, reason}`` series whichever process refused the record. The log is
throttled to a rate (a flood of bad input must not become a flood of log lines); what is not logged
is counted in the next line that is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from prometheus_client import Counter

from schemas.records import DeadLetter

log = logging.getLogger("xidflow.deadletter")


class DeadLetterReporter:
    """Logs (at most ``per_s`` lines a second, with a burst of as many) and counts dead letters."""

    def __init__(
        self, counter: Counter, per_s: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.counter = counter
        """The process's ``xidflow_deadletters_total`` (``pipeline.runtime.metrics``)."""
        self.per_s = per_s
        self._clock = clock
        self._budget = per_s
        self._at = clock()
        self.suppressed = 0
        """Dead letters not logged since the last line that was."""

    def report(self, letter: DeadLetter) -> None:
        self.counter.labels(letter.stage, letter.code.value).inc()
        if self._take():
            extra = f" ({self.suppressed} more not logged)" if self.suppressed else ""
            self.suppressed = 0
            where = letter.topic or "input"
            log.warning("dead letter from %s (%s, %s): %s%s", where, letter.stage, letter.code.value,
                        letter.reason, extra)
        else:
            self.suppressed += 1

    def _take(self) -> bool:
        now = self._clock()
        self._budget = min(self.per_s, self._budget + (now - self._at) * self.per_s)
        self._at = now
        if self._budget >= 1:
            self._budget -= 1
            return True
        return False
