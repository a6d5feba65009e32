"""Dead letters are reported alike wherever they are made: a throttled log line and a bounded count."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Counter

from pipeline.runtime.deadletter_log import DeadLetterReporter
from schemas.records import DeadLetter, DeadLetterCode


def counter() -> Counter:
    return Counter("t_deadletters_total", "test", ["stage", "reason"], registry=CollectorRegistry())


def test_every_letter_is_counted_by_stage_and_code_and_the_log_is_throttled(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    c = counter()
    reporter = DeadLetterReporter(c, per_s=2, clock=lambda: now[0])
    letter = DeadLetter.of("actuator", "not JSON: unexpected character", b"nope", DeadLetterCode.INVALID_JSON,
                           topic="gpu.node.incidents")
    with caplog.at_level(logging.WARNING, logger="xidflow.deadletter"):
        for _ in range(10):
            reporter.report(letter)
        assert c.labels("actuator", "invalid_json")._value.get() == 10
        assert len(caplog.records) == 2  # the burst allowance; the other 8 are counted, not logged
        assert reporter.suppressed == 8
        now[0] = 1.0  # a second later the next line says how many were left out
        reporter.report(letter)
    last = caplog.records[-1].getMessage()
    assert last == ("dead letter from gpu.node.incidents (actuator, invalid_json): not JSON: unexpected character "
                    "(8 more not logged)")
    assert reporter.suppressed == 0


def test_a_letter_without_a_topic_says_input() -> None:
    c = counter()
    reporter = DeadLetterReporter(c, per_s=1)
    reporter.report(DeadLetter.of("loki-tail", "Loki stream has no 'node' label", "x", DeadLetterCode.NO_NODE))
    assert c.labels("loki-tail", "no_node")._value.get() == 1
