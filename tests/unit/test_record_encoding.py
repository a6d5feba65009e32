"""The records encoded by pydantic's compiled encoder (``schemas.records.CompiledJsonRecord``) give byte for byte
what orjson over ``model_dump(mode="json")`` gives (every record's encoding before, and still the other
records'): consumers of the incident and fabric-signal topics see the same bytes."""

from __future__ import annotations

import typing
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import records
from schemas.records import FabricSignal, NodeIncident, NodeRecovered, Record

# Any text a log line may hold: control characters, quotes, backslashes, non-BMP characters (no lone
# surrogates: neither encoder writes those, both raise).
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
OPT_TEXT = st.none() | TEXT
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)  # orjson's range (it raises beyond)
TIMES = st.datetimes(
    min_value=datetime(1970, 1, 2), max_value=datetime(2200, 1, 1),
    timezones=st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=30)), timezone(timedelta(hours=-8))]),
)


def _orjson_bytes(record: Record) -> bytes:
    return orjson.dumps(record.model_dump(mode="json"))


@settings(max_examples=300)
@given(
    text=TEXT, opt=OPT_TEXT, lists=st.lists(TEXT, max_size=4), code=st.none() | INT64, count=INT64,
    times=st.lists(TIMES, min_size=4, max_size=4), source_ts=st.none() | TIMES,
    kind=st.sampled_from(list(records.FaultKind)), severity=st.sampled_from(list(records.Severity)),
    action=st.sampled_from(list(records.Action)), flag=st.booleans(),
)
def test_incident_bytes_are_orjsons(
    text: str, opt: str | None, lists: list[str], code: int | None, count: int, times: list[datetime],
    source_ts: datetime | None, kind: Any, severity: Any, action: Any, flag: bool,
) -> None:
    inc = NodeIncident(
        incident_id=text, node=text or "n", signature=text, signatures=lists, kind=kind, code=code, pci=opt,
        gpu_uuid=opt, count=count, first_seen=times[0], last_seen=times[1], opened_at=times[2], revision=count,
        severity=severity, action=action, quarantine=flag, escalation_reason=opt, evidence_ids=lists,
        boot_id=opt, line=text, source_ts=source_ts,
    )
    assert inc.to_bytes() == _orjson_bytes(inc)
    assert NodeIncident.from_bytes(inc.to_bytes()) == inc


@settings(max_examples=200)
@given(text=TEXT, opt=OPT_TEXT, lists=st.lists(TEXT, max_size=4), code=st.none() | INT64, ts=TIMES,
       kind=st.sampled_from(list(records.FaultKind)),
       reason=st.sampled_from(["reboot", "quiet", "manual", "cancelled"]))
def test_recovered_and_fabric_signal_bytes_are_orjsons(
    text: str, opt: str | None, lists: list[str], code: int | None, ts: datetime, kind: Any, reason: Any
) -> None:
    recovered = NodeRecovered(incident_id=text, node=text, reason=reason, boot_id=opt, recovered_at=ts, detail=text,
                              cancelled_by=opt, evidence_ids=lists)
    signal = FabricSignal(signal_id=text, node=text, kind=kind, code=code, signature=text, fault_class=text, ts=ts,
                          event_ids=lists)
    for record in (recovered, signal):
        assert record.to_bytes() == _orjson_bytes(record)


def test_naive_microseconds_and_defaults_encode_alike() -> None:
    naive = datetime(2026, 1, 2, 3, 4, 5, 1)
    inc = NodeIncident(incident_id="i", node="n", signature="s", kind=records.FaultKind.XID, first_seen=naive,
                       last_seen=naive, severity=records.Severity.CRITICAL, action=records.Action.REBOOT_NODE,
                       quarantine=True)
    assert inc.to_bytes() == _orjson_bytes(inc)
    recovered = NodeRecovered(incident_id="i", node="n", reason="quiet")  # recovered_at: now, aware
    assert recovered.to_bytes() == _orjson_bytes(recovered)


def _no_float_or_any(tp: object) -> bool:
    if tp in (float, Any, object) or tp is typing.Any:
        return False
    return all(_no_float_or_any(arg) for arg in typing.get_args(tp))


def test_compiled_encoder_only_where_no_float_or_any_field() -> None:
    # The equality above rests on it: the two encoders may print a float's digits differently.
    compiled = records.CompiledJsonRecord.__subclasses__()
    assert {cls.__name__ for cls in compiled} >= {"NodeIncident", "NodeRecovered", "FabricSignal"}
    for cls in compiled:
        assert cls.to_bytes is not Record.to_bytes
        for field, info in cls.model_fields.items():
            assert _no_float_or_any(info.annotation), (cls.__name__, field, info.annotation)
