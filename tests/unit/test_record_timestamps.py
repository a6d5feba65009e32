"""Every datetime field of every wire record takes a naive datetime as UTC (``schemas.records.UtcDateTime``).

The rule was a validator of every field; it is now the type of the datetime fields. This walks all the
records, so a datetime field added later without the type fails here.
"""

from __future__ import annotations

import typing
from datetime import UTC, datetime, timedelta, timezone

import pytest

from schemas import records
from schemas.records import Record


def _records() -> list[type[Record]]:
    found: list[type[Record]] = []
    todo = list(Record.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: c.__name__)


def _datetime_fields(cls: type[Record]) -> list[str]:
    def has_datetime(tp: object) -> bool:
        return tp is datetime or any(has_datetime(arg) for arg in typing.get_args(tp))

    return [name for name, info in cls.model_fields.items() if has_datetime(info.annotation)]


def test_every_record_with_a_datetime_is_covered() -> None:
    covered = {cls.__name__ for cls in _records() if _datetime_fields(cls)}
    assert {"FaultEvent", "NodeIncident", "LogRecord", "RemediationRecord", "NodeRecovered"} <= covered


@pytest.mark.parametrize("cls", [c for c in _records() if _datetime_fields(c)], ids=lambda c: c.__name__)
def test_naive_datetimes_are_utc_and_aware_ones_kept(cls: type[Record]) -> None:
    naive = datetime(2026, 1, 2, 3, 4, 5, 678000)
    other = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=2)))
    for name in _datetime_fields(cls):
        for given, expected in ((naive, naive.replace(tzinfo=UTC)), (other, other)):
            # The model's own validation of that one field, its validators included.
            record = cls.model_construct()
            cls.__pydantic_validator__.validate_assignment(record, name, given)
            value = getattr(record, name)
            assert value == expected and value.utcoffset() == expected.utcoffset(), (cls.__name__, name, given)


def test_a_model_built_with_naive_datetimes_encodes_them_as_utc() -> None:
    naive = datetime(2026, 1, 2, 3, 4, 5)
    inc = records.NodeIncident(
        incident_id="i", node="n", signature="s", kind=records.FaultKind.XID, first_seen=naive, last_seen=naive,
        opened_at=naive, severity=records.Severity.CRITICAL, action=records.Action.REBOOT_NODE, quarantine=True,
        source_ts=naive,
    )
    assert inc.first_seen.tzinfo is UTC and inc.source_ts is not None and inc.source_ts.tzinfo is UTC
    assert b'"first_seen":"2026-01-02T03:04:05Z"' in inc.to_bytes()


def test_a_naive_timestamp_in_json_is_read_as_before() -> None:
    # JSON input is a string, which the rule never touched: it is parsed as pydantic parses it.
    data = records.LogRecord(node="n", source=records.Source.KERNEL, ts=datetime(2026, 1, 1, tzinfo=UTC),
                             line="x").model_dump(mode="json")
    data["ts"] = "2026-01-01T00:00:00"
    assert records.LogRecord.model_validate(data).ts.tzinfo is None
