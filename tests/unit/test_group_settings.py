"""Consumer-group membership settings: identity, bounds, and what the Kafka clients get."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline.runtime.settings import ConsumerGroupSettings


def test_defaults_are_dynamic_with_a_short_session(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAME", raising=False)
    monkeypatch.delenv("XIDFLOW_GROUP_INSTANCE_ID", raising=False)
    options = ConsumerGroupSettings().consumer_options()
    assert options["group_instance_id"] is None
    assert options["heartbeat_interval_ms"] * 3 <= options["session_timeout_ms"] <= options["max_poll_interval_ms"]
    assert options["request_timeout_ms"] > options["session_timeout_ms"]


def test_identity_from_the_pod_name_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XIDFLOW_GROUP_INSTANCE_ID", raising=False)
    monkeypatch.setenv("POD_NAME", "xidflow-worker-0")
    assert ConsumerGroupSettings().consumer_options()["group_instance_id"] == "xidflow-worker-0"
    monkeypatch.setenv("XIDFLOW_GROUP_INSTANCE_ID", "w-7")
    assert ConsumerGroupSettings().instance_id == "w-7"
    assert ConsumerGroupSettings(instance_id="flag").instance_id == "flag"


def test_hostname_is_not_an_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("POD_NAME", raising=False)
    monkeypatch.delenv("XIDFLOW_GROUP_INSTANCE_ID", raising=False)
    monkeypatch.setenv("HOSTNAME", "laptop")
    assert ConsumerGroupSettings().instance_id == ""


@pytest.mark.parametrize(
    "values",
    [
        {"session_timeout_s": 6, "heartbeat_interval_s": 3},  # heartbeat above a third of the session
        {"session_timeout_s": 30, "max_poll_interval_s": 10},  # poll interval below the session
        {"session_timeout_s": 0.5},
        {"heartbeat_interval_s": 0},
    ],
)
def test_out_of_bounds_values_are_refused(values: dict) -> None:
    with pytest.raises(ValidationError):
        ConsumerGroupSettings(**values)


def test_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XIDFLOW_GROUP_SESSION_TIMEOUT_S", "45")
    monkeypatch.setenv("XIDFLOW_GROUP_LEAVE_ON_SHUTDOWN", "false")
    s = ConsumerGroupSettings()
    assert s.session_timeout_s == 45 and s.leave_on_shutdown is False
