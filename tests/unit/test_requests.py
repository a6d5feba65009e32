"""The Kingsoft-seed rescue request format: validation, error wording, ids, and the record's bytes."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.actuator.requests import (
    MAX_ACTIONS,
    MAX_WAIT_SECONDS,
    RESCUE_ACTION_NAMES,
    ParameterError,
    RescueActionBody,
    RescueActionRequest,
    field_path,
    parse_rescue_request,
)

RECEIVED = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)


def body(**overrides: object) -> bytes:
    fields: dict[str, object] = {
        "nodeName": "gpu-node-01",
        "xid": 79,
        "escalateTime": "2025-03-01T11:59:30Z",
        "actions": [{"name": "cordon", "waittime": 0}, {"name": "drain", "waittime": 60}],
    }
    fields.update(overrides)
    return orjson.dumps({k: v for k, v in fields.items() if v is not ...})


def parse(raw: bytes | str, **kw: object) -> RescueActionRequest | ParameterError:
    kw.setdefault("received_at", RECEIVED)
    kw.setdefault("requested_by", "ops-portal")
    return parse_rescue_request(raw, **kw)  # type: ignore[arg-type]


def error_of(raw: bytes | str, **kw: object) -> str:
    result = parse(raw, **kw)
    assert isinstance(result, ParameterError), f"expected a ParameterError, got {result!r}"
    assert result.message.startswith("Parameter error: ")
    return result.message


def test_valid_seed_body_becomes_a_request() -> None:
    request = parse(body())
    assert isinstance(request, RescueActionRequest)
    assert request.node_name == "gpu-node-01"
    assert request.xid == 79
    assert request.escalate_time == datetime(2025, 3, 1, 11, 59, 30, tzinfo=UTC)
    assert [(a.name, a.waittime) for a in request.actions] == [("cordon", 0), ("drain", 60)]
    assert request.received_at == RECEIVED
    assert request.requested_by == "ops-portal"
    assert request.total_wait_seconds == 60
    assert len(request.request_id) == 32


def test_integral_floats_are_integers_as_in_json_schema() -> None:
    request = parse(body(xid=79.0, escalateTime=1700000000.0, actions=[{"name": "drain", "waittime": 60.0}]))
    assert isinstance(request, RescueActionRequest)
    assert (request.xid, request.actions[0].waittime) == (79, 60)
    assert isinstance(request.xid, int) and isinstance(request.actions[0].waittime, int)


def test_every_seed_action_name_is_accepted_and_waittime_defaults_to_zero() -> None:
    request = parse(body(actions=[{"name": n} for n in RESCUE_ACTION_NAMES]))
    assert isinstance(request, RescueActionRequest)
    assert [a.name for a in request.actions] == list(RESCUE_ACTION_NAMES)
    assert all(a.waittime == 0 for a in request.actions)


@pytest.mark.parametrize(
    ("escalate_time", "expected"),
    [
        (1700000000, datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)),
        ("2024-07-04T11:09:40+02:00", datetime(2024, 7, 4, 9, 9, 40, tzinfo=UTC)),
        ("2024-07-04t11:09:40.5z", datetime(2024, 7, 4, 11, 9, 40, 500000, tzinfo=UTC)),
        ("2016-12-31T23:59:60Z", datetime(2016, 12, 31, 23, 59, 59, tzinfo=UTC)),
    ],
)
def test_escalate_time_accepts_rfc3339_and_unix_seconds(escalate_time: object, expected: datetime) -> None:
    request = parse(body(escalateTime=escalate_time))
    assert isinstance(request, RescueActionRequest)
    assert request.escalate_time == expected


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"nodeName": ...}, "Parameter error: nodeName is required"),
        ({"nodeName": ""}, "Parameter error: nodeName must not be empty"),
        ({"nodeName": "GPU_01"}, "Parameter error: nodeName must be a Kubernetes node name"),
        ({"nodeName": 7}, "Parameter error: nodeName must be a string"),
        ({"xid": "79"}, "Parameter error: xid must be an integer"),
        ({"xid": 79.5}, "Parameter error: xid must be an integer"),
        ({"xid": 1e400}, "Parameter error: xid must be an integer"),
        ({"xid": 1e20}, "Parameter error: xid must be <= 2147483647"),
        ({"xid": True}, "Parameter error: xid must be an integer"),
        ({"xid": 0}, "Parameter error: xid must be >= 1"),
        ({"escalateTime": ...}, "Parameter error: escalateTime is required"),
        ({"escalateTime": "yesterday"}, "Parameter error: escalateTime must be an RFC 3339 date-time"),
        ({"escalateTime": "2024-07-04 11:09:40"}, "Parameter error: escalateTime must be an RFC 3339"),
        ({"escalateTime": "2024-02-30T00:00:00Z"}, "Parameter error: escalateTime must be an RFC 3339"),
        ({"escalateTime": -5}, "Parameter error: escalateTime must be Unix seconds between 0 and"),
        ({"actions": ...}, "Parameter error: actions is required"),
        ({"actions": []}, "Parameter error: actions must not be empty"),
        ({"actions": {"name": "cordon"}}, "Parameter error: actions must be an array"),
        (
            {"actions": [{"name": "cordon"}] * (MAX_ACTIONS + 1)},
            f"actions must have at most {MAX_ACTIONS} items",
        ),
        ({"actions": [{"waittime": 3}]}, "Parameter error: actions[0].name is required"),
        (
            {"actions": [{"name": "cordon"}, {"name": "uncordon"}]},
            "actions[1].name must be one of cordon, drain, reboot, enableWarmStandby, unCordon",
        ),
        (
            {"actions": [{"name": "drain", "waittime": -1}]},
            "Parameter error: actions[0].waittime must be >= 0",
        ),
        (
            {"actions": [{"name": "drain", "waittime": MAX_WAIT_SECONDS + 1}]},
            f"Parameter error: actions[0].waittime must be <= {MAX_WAIT_SECONDS}",
        ),
        ({"actions": [{"name": "drain", "waittime": "60"}]}, "actions[0].waittime must be an integer"),
        ({"actions": ["cordon"]}, "Parameter error: actions[0] must be a JSON object"),
        ({"nodename": "gpu-node-01"}, "Parameter error: nodename is not a known field"),
        (
            {"actions": [{"name": "drain", "wait": 5}]},
            "Parameter error: actions[0].wait is not a known field",
        ),
    ],
)
def test_invalid_fields_are_named_in_the_seeds_words(overrides: dict[str, object], expected: str) -> None:
    assert expected in error_of(body(**overrides))


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"", "Parameter error: body is not valid JSON"),
        (b"{nodeName: x}", "Parameter error: body is not valid JSON"),
        (b"[1, 2]", "Parameter error: body must be a JSON object"),
        (b"null", "Parameter error: body must be a JSON object"),
        (
            b"{}",
            "Parameter error: nodeName is required; xid is required; escalateTime is required; actions is",
        ),
    ],
)
def test_malformed_bodies(raw: bytes, expected: str) -> None:
    assert error_of(raw).startswith(expected)


def test_many_errors_are_summarised() -> None:
    actions = [{"name": "bogus"} for _ in range(8)]
    message = error_of(body(actions=actions))
    assert message.count("must be one of") == 5
    assert message.endswith("and 3 more")


@pytest.mark.parametrize("key", ["", "has space", "x" * 256, "caf\u00e9"])
def test_bad_idempotency_keys_are_refused(key: str) -> None:
    assert "Idempotency-Key header" in error_of(body(), idempotency_key=key)


def test_request_id_is_deterministic_from_body_and_received_time() -> None:
    first = parse(body())
    again = parse(body())
    # Same fields, different key order and whitespace: the same request.
    reordered = parse(orjson.dumps(orjson.loads(body())).decode().replace(",", ", "))
    later = parse(body(), received_at=RECEIVED + timedelta(seconds=1))
    other_node = parse(body(nodeName="gpu-node-02"))
    other_client = parse(body(), requested_by="someone-else")
    assert isinstance(first, RescueActionRequest) and isinstance(again, RescueActionRequest)
    assert isinstance(reordered, RescueActionRequest)
    assert first.request_id == again.request_id == reordered.request_id
    ids = {r.request_id for r in (first, later, other_node, other_client) if isinstance(r, RescueActionRequest)}
    assert len(ids) == 4


def test_idempotency_key_makes_retries_one_request() -> None:
    first = parse(body(), idempotency_key="ticket-4711")
    retry = parse(body(), idempotency_key="ticket-4711", received_at=RECEIVED + timedelta(minutes=3))
    other_key = parse(body(), idempotency_key="ticket-4712")
    other_client = parse(body(), idempotency_key="ticket-4711", requested_by="another-system")
    assert isinstance(first, RescueActionRequest) and isinstance(retry, RescueActionRequest)
    assert first.request_id == retry.request_id
    assert first.idempotency_key == "ticket-4711"
    assert isinstance(other_key, RescueActionRequest) and isinstance(other_client, RescueActionRequest)
    assert len({first.request_id, other_key.request_id, other_client.request_id}) == 3


def test_naive_received_time_is_utc() -> None:
    request = parse(body(), received_at=datetime(2025, 3, 1, 12, 0, 0))
    assert isinstance(request, RescueActionRequest)
    assert request.received_at == RECEIVED


def test_record_round_trips_and_ignores_unknown_fields() -> None:
    request = parse(body(), idempotency_key="k-1")
    assert isinstance(request, RescueActionRequest)
    raw = request.to_bytes()
    assert orjson.loads(raw)["type"] == "rescue_request"
    assert RescueActionRequest.from_bytes(raw) == request
    newer = orjson.loads(raw) | {"field_from_the_future": 1}
    newer["actions"][0]["extra"] = True
    assert RescueActionRequest.from_bytes(orjson.dumps(newer)) == request


@pytest.mark.parametrize(
    ("loc", "expected"),
    [
        ((), "body"),
        (("xid",), "xid"),
        (("actions", 2, "name"), "actions[2].name"),
        (("actions", 0), "actions[0]"),
    ],
)
def test_field_path(loc: tuple[int | str, ...], expected: str) -> None:
    assert field_path(loc) == expected


node_names = st.from_regex(r"\A[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?(\.[a-z0-9]{1,10}){0,2}\Z")
valid_actions = st.lists(
    st.fixed_dictionaries(
        {"name": st.sampled_from(RESCUE_ACTION_NAMES)},
        optional={"waittime": st.integers(0, MAX_WAIT_SECONDS)},
    ),
    min_size=1,
    max_size=MAX_ACTIONS,
)
escalate_times = st.one_of(
    st.integers(0, 4_000_000_000),
    st.datetimes(min_value=datetime(1970, 1, 2), max_value=datetime(9999, 12, 30), timezones=st.just(UTC)).map(
        lambda d: d.isoformat().replace("+00:00", "Z")
    ),
)


@given(node=node_names, xid=st.integers(1, 2**31 - 1), escalate=escalate_times, actions=valid_actions)
def test_every_valid_body_parses_and_round_trips(node: str, xid: int, escalate: object, actions: list) -> None:
    raw = orjson.dumps({"nodeName": node, "xid": xid, "escalateTime": escalate, "actions": actions})
    request = parse(raw)
    assert isinstance(request, RescueActionRequest), request
    assert (request.node_name, request.xid) == (node, xid)
    assert [a.name for a in request.actions] == [a["name"] for a in actions]
    assert [a.waittime for a in request.actions] == [a.get("waittime", 0) for a in actions]
    assert RescueActionRequest.from_bytes(request.to_bytes()) == request


@given(garbage=st.dictionaries(st.text(max_size=12), st.none() | st.integers() | st.text(max_size=12), max_size=6))
def test_arbitrary_objects_never_raise(garbage: dict) -> None:
    # json, not orjson: Python ints beyond 64 bits must reach the parser too.
    result = parse(json.dumps(garbage))
    assert isinstance(result, ParameterError | RescueActionRequest)
    if isinstance(result, ParameterError):
        assert result.message.startswith("Parameter error: ")


@pytest.mark.parametrize(
    "raw",
    [
        b'{"nodeName": "gpu-1", "xid": 79, "xid": 13, "escalateTime": 1700000000, "actions": [{"name": "cordon"}]}',
        b'{"nodeName": "gpu-1", "xid": 79, "escalateTime": 1700000000,'
        b' "actions": [{"name": "cordon", "name": "reboot"}]}',
    ],
)
def test_a_key_repeated_in_one_object_is_refused(raw: bytes) -> None:
    """Issue 37: the last value won; JSON leaves it to the reader, and readers differ."""
    got = parse(raw)
    assert isinstance(got, ParameterError) and "twice in one object" in got.message, got


def test_an_instant_outside_the_years_1_to_9999_in_utc_is_refused_saying_so() -> None:
    """Issue 37: schema-valid (a date-time with an offset), yet no instant a datetime holds: documented, and said."""
    for value in ("0001-01-01T00:30:00+01:00", "9999-12-31T23:30:00-01:00"):
        got = parse(body(escalateTime=value))
        assert isinstance(got, ParameterError)
        assert got.message == f"Parameter error: escalateTime must be an instant within the years 1 to 9999 in UTC " \
                              f"({value} is outside)"
    accepted = parse(body(escalateTime="0001-01-01T00:30:00-01:00"))
    assert accepted.escalate_time == datetime(1, 1, 1, 1, 30, tzinfo=UTC)  # type: ignore[union-attr]
    assert "years 1 to 9999 in UTC" in RescueActionBody.model_json_schema()["properties"]["escalateTime"]["description"]
