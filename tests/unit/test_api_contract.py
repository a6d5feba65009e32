"""The decision API's contract, pure parts: every escalateTime is a request or a 400 naming the field,
and an Idempotency-Key reused with another body is a conflict, also after the plan was released."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.actuator.api import PlanReservation, release_plan, reserve_plan
from pipeline.actuator.requests import ParameterError, RescueActionRequest, parse_rescue_request

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def body(escalate_time: object, actions: list[dict[str, object]] | None = None) -> bytes:
    # The standard library writes integers of any size, as a client might.
    return json.dumps({"nodeName": "gpu-1", "xid": 79, "escalateTime": escalate_time,
                       "actions": actions or [{"name": "cordon", "waittime": 0}]}).encode()


def parse(raw: bytes, key: str | None = "k") -> RescueActionRequest | ParameterError:
    return parse_rescue_request(raw, received_at=NOW, requested_by="ops", idempotency_key=key)


two = st.integers(0, 99).map(lambda n: f"{n:02d}")
rfc3339_shaped = st.builds(
    lambda y, mo, d, h, mi, s, frac, off: f"{y:04d}-{mo}-{d}T{h}:{mi}:{s}{frac}{off}",
    st.integers(0, 9999), two, two, two, two, two,
    st.sampled_from(["", ".5", ".123456789"]),
    st.one_of(st.just("Z"), st.builds(lambda sign, hh, mm: f"{sign}{hh}:{mm}", st.sampled_from("+-"), two, two)),
)


@settings(max_examples=400)
@given(rfc3339_shaped)
def test_every_rfc3339_shaped_escalate_time_is_a_request_or_a_parameter_error(value: str) -> None:
    got = parse(body(value))
    if isinstance(got, ParameterError):
        assert got.message.startswith("Parameter error: escalateTime"), got.message
    else:
        assert got.escalate_time.tzinfo is not None


@settings(max_examples=200)
@given(st.one_of(st.integers(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
                 st.booleans(), st.none()))
def test_any_other_escalate_time_is_a_request_or_a_parameter_error(value: object) -> None:
    got = parse(body(value))
    assert not isinstance(got, ParameterError) or got.message.startswith("Parameter error: escalateTime")


def request(actions: list[dict[str, object]], key: str = "k") -> RescueActionRequest:
    got = parse(body("2026-01-01T00:00:00Z", actions), key)
    assert isinstance(got, RescueActionRequest)
    return got


def test_a_key_reused_with_another_body_conflicts_even_after_release() -> None:
    first = request([{"name": "cordon", "waittime": 0}])
    other = request([{"name": "reboot", "waittime": 0}])
    assert first.request_id == other.request_id  # same client and key: same request id
    outcome, data = reserve_plan({}, first, now=NOW, max_pending=1, grace_seconds=60)
    assert outcome is PlanReservation.RESERVED and data is not None
    limits = {"max_pending": 1, "grace_seconds": 60}
    assert reserve_plan(data, first, now=NOW, **limits)[0] is PlanReservation.ALREADY_RESERVED
    assert reserve_plan(data, other, now=NOW, **limits)[0] is PlanReservation.IDEMPOTENCY_CONFLICT
    released = release_plan(data, first.request_id, NOW)
    assert released is not None
    # Released: it no longer counts against the limit, but its body is remembered until it expires.
    second = request([{"name": "cordon", "waittime": 0}], key="k2")
    assert reserve_plan(released, second, now=NOW, **limits)[0] is PlanReservation.RESERVED
    assert reserve_plan(released, other, now=NOW, **limits)[0] is PlanReservation.IDEMPOTENCY_CONFLICT
    later = NOW + timedelta(seconds=61)
    assert reserve_plan(released, other, now=later, **limits)[0] is PlanReservation.RESERVED
    assert release_plan(released, first.request_id, NOW) is None  # releasing twice changes nothing
