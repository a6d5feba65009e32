"""On the real API server: ``xidflow status`` at 80 columns with four long-named nodes, and the error
sentences that need a cluster (an unknown node; Kafka down while the API server is up)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import orjson
import pytest
from click.testing import CliRunner

from pipeline.actuator.testing import create_nodes, make_incident
from pipeline.cli import cli
from pipeline.kafka.admin import ensure_topics
from tests.integration.test_actuator_effects import Env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

LONG = "-h100-sxm5-prod-us-east-1a-rack07-node-000"


def test_status_at_80_columns_piped_shows_four_long_names_whole(
    kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]
) -> None:
    env = Env(kafka_bootstrap, kubeconfig, unique)
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    prefix = unique("gpu") + LONG
    names = [f"{prefix}{i}" for i in range(1, 5)]
    try:
        run(ensure_topics(kafka_bootstrap, [env.topics.name("remediation_audit")], partitions=1))
        run(create_nodes(env.kube, names, env.fleet_label))
        env.nodes += names
        act = run(env.actuator())
        run(act.engine.handle(make_incident(names[0], "inc-long-1")))
        run(act.engine.handle(make_incident(names[2], "inc-long-3", code=48)))
        cli_env = {
            "KUBECONFIG": kubeconfig,
            "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": env.selector,
            "XIDFLOW_ACTUATOR_NAMESPACE": env.namespace,
            "COLUMNS": "80",
        }
        runner = CliRunner(env=cli_env)
        result = runner.invoke(cli, ["status"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        assert lines[0].split()[:7] == ["NODE", "STATUS", "FAULT", "AGE", "APPLIED", "WHY", "BREAKER"]
        assert [line.split()[0] for line in lines[1:]] == names  # whole, distinct, one line each
        first = lines[1].split()
        assert first[2:4] == ["xid", "79"] and "cordon" in first[5] and first[-2].startswith("closed")
        assert first[-1] == "-"  # REPAIR: the default rule has no repair loop
        third = lines[3].split()
        assert third[2:4] == ["xid", "48"]
        assert lines[2].split()[2:] == ["-", "-", "-", "-", "closed", "-"]

        wide = runner.invoke(cli, ["status", "-o", "wide"], catch_exceptions=False).stdout
        assert "inc-long-1" in wide and "LAST-ACTION" in wide
        rows = orjson.loads(runner.invoke(cli, ["status", "-o", "json"], catch_exceptions=False).stdout)
        assert [r["node"] for r in rows] == names
        assert rows[0]["incidents"][0]["id"] == "inc-long-1" and rows[0]["faults"][0]["fault"] == "xid 79"
        assert rows[1]["applied"] == {} and rows[1]["breaker"]["state"] == "closed"
    finally:
        run(env.close())
        loop.close()


def test_reset_of_an_unknown_node_is_a_sentence(kubeconfig: str, unique: Callable[[str], str]) -> None:
    ghost = unique("no-such-node")
    result = CliRunner(env={"KUBECONFIG": kubeconfig}).invoke(cli, ["reset", "--node", ghost])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"no such node: {ghost}" in result.output


def test_reset_with_kafka_down_changes_nothing(kafka_bootstrap: str, kubeconfig: str,
                                               unique: Callable[[str], str]) -> None:
    env = Env(kafka_bootstrap, kubeconfig, unique)
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    try:
        (name,) = run(env.make_nodes(1))
        result = CliRunner(env={"KUBECONFIG": kubeconfig, "KAFKA_BOOTSTRAP_SERVERS": dead}).invoke(
            cli, ["reset", "--node", name]
        )
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert f"cannot reach Kafka at {dead}" in result.output and "nothing was changed" in result.output
    finally:
        run(env.close())
        loop.close()
