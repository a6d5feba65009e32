"""A (small) fuzz soak through a real worker on the real broker: pipeline.benchmarks.soak.

Random bytes, wrong shapes, truncated and deeply nested JSON, a huge kernel line: the worker stays
alive and live, every malformed record is dead-lettered exactly once, harmless lines are not, the
metric series stay a fixed set, and a fault after the soak still becomes an incident. The local run
with a million records gives the figures (``python -m pipeline.benchmarks.soak``).
"""

from __future__ import annotations

import pytest

from pipeline.benchmarks.soak import HUGE_EVERY, run_soak

pytestmark = pytest.mark.integration


async def test_fuzzed_records_through_a_real_worker(kafka_bootstrap: str) -> None:
    result = await run_soak(kafka_bootstrap, records=HUGE_EVERY + 2000, rounds=1, settle_timeout_s=600)
    assert not result.get("error"), result
    assert result["alive"], result
    assert result["malformed_records"] > 8000
    assert result["malformed_missing"] == 0 and result["malformed_duplicated"] == 0, result
    assert result["harmless_dead_lettered"] == 0, result
    assert result["dead_letters_by_code"].get("truncated") == 1, result
    assert result["fault_to_incident_after_soak_s"] is not None, result
    assert "503" not in result["healthz"], result
    assert result["metrics_series"] < 400, result
