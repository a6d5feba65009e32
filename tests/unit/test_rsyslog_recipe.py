"""The shipped rsyslog recipe (deploy/rsyslog/60-xidflow.conf) as the tests run it: only this machine's broker
list, topic and librdkafka properties differ (the real rsyslogd runs it in tests/integration/test_rsyslog.py)."""

from __future__ import annotations

import pytest

from pipeline.localinfra.rsyslog import SHIPPED_RECIPE, render_shipped_recipe


def test_the_rsyslog_recipe_rendering_changes_only_brokers_topic_and_librdkafka_properties() -> None:
    shipped = SHIPPED_RECIPE.read_text()
    rendered = render_shipped_recipe("127.0.0.1:19092", "t-gpu.logs.kernel", ["compression.codec=zstd"])
    changed = [(a, b) for a, b in zip(shipped.splitlines(), rendered.splitlines(), strict=True) if a != b]
    assert [b.strip() for _, b in changed] == [
        'broker=["127.0.0.1:19092"]', 'topic="t-gpu.logs.kernel"',
        'confParam=["compression.codec=lz4", "acks=all", "enable.idempotence=true", "compression.codec=zstd"]',
    ]
    # The key and partitioner that put a node's lines on one partition are the recipe's, not the test's.
    assert 'dynaKey="on" key="xidflow_node"' in rendered and "partitioner=murmur2_random" in rendered


def test_a_recipe_without_the_expected_setting_is_refused(tmp_path) -> None:  # noqa: ANN001
    edited = tmp_path / "60-xidflow.conf"
    edited.write_text(SHIPPED_RECIPE.read_text().replace('topic="gpu.logs.kernel"', ""))
    with pytest.raises(ValueError, match="topic"):
        render_shipped_recipe("127.0.0.1:1", "t", recipe=edited)
