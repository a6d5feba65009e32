"""An aggregation output the encoders refuse is its event's dead letter, not the end of the agent.

``agents.aggregate.encode_outputs`` encodes an event's outputs before any of them is handed to the
producer; the agent dead-letters the event when one cannot be encoded (``_apply_batch``). Before, the
encoding ran outside the per-event guard and its exception stopped the aggregation agent. No input a
producer can send reaches this today (the decoders refuse lone surrogates), so the record is built here.
"""

from __future__ import annotations

from datetime import UTC, datetime

from agents.aggregate import encode_outputs
from schemas.records import Action, FaultKind, NodeIncident, Severity

T = datetime(2026, 1, 1, tzinfo=UTC)


def _incident(line: str) -> NodeIncident:
    return NodeIncident(
        incident_id="i", node="n", signature="xid:79:-", signatures=["xid:79:-"],
        kind=FaultKind.XID, count=1, first_seen=T, last_seen=T, opened_at=T, revision=0,
        severity=Severity.CRITICAL, action=Action.REBOOT_NODE, quarantine=True, evidence_ids=["e"], line=line,
    )


def test_each_output_comes_with_its_bytes() -> None:
    a, b = _incident("one"), _incident("two")
    assert encode_outputs([a, b]) == ([(a, a.to_bytes()), (b, b.to_bytes())], None)


def test_a_lone_surrogate_is_a_failure_to_report_not_an_exception() -> None:
    good, bad = _incident("fine"), _incident("bad \ud800 line")
    encoded, failure = encode_outputs([good, bad])
    assert encoded == [(good, good.to_bytes())]
    assert failure is not None and "surrogate" in failure.lower()
