"""``xidflow status``, ``xidflow reset`` and ``xidflow breaker status|reset`` on the real API server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import orjson
import pytest
from click.testing import CliRunner

from pipeline.actuator.app import actuator_topics
from pipeline.actuator.testing import make_incident
from pipeline.cli import cli
from pipeline.kafka.admin import ensure_topics
from tests.integration.test_actuator_effects import Env

# A hang (an unbounded retry against a broken API server) fails in minutes, with its stack, not at 600 s.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_status_reset_and_breaker_commands(kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]) -> None:
    env = Env(kafka_bootstrap, kubeconfig, unique)
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    try:
        run(ensure_topics(kafka_bootstrap, [env.topics.name("remediation_audit")], partitions=1))
        sick, human, healthy = run(env.make_nodes(3))
        act = run(env.actuator(breaker_max_share=0.5))
        run(env.kube.patch_node(human, {"spec": {"unschedulable": True}}))  # a person's cordon
        run(act.engine.handle(make_incident(sick, "inc-cli")))
        run(act.engine.handle(make_incident(human, "inc-cli-h")))
        run(act.engine.handle(make_incident(healthy, "inc-cli-trip")))  # 3 of 3 > 50%: trips

        cli_env = {
            "KUBECONFIG": kubeconfig,
            "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
            "XIDFLOW_TOPIC_PREFIX": env.topics.prefix,
            "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": env.selector,
            "XIDFLOW_ACTUATOR_NAMESPACE": env.namespace,
            "XIDFLOW_ACTUATOR_BREAKER_MAX_SHARE": "0.5",
            "COLUMNS": "400",
        }
        runner = CliRunner(env=cli_env)
        result = runner.invoke(cli, ["status", "--json"], catch_exceptions=False)
        rows = {r["node"]: r for r in orjson.loads(result.output)}
        assert set(rows) == {sick, human, healthy}
        assert [i["id"] for i in rows[sick]["incidents"]] == ["inc-cli"] and "cordon" in rows[sick]["applied"]
        assert "SchedulingDisabled" in rows[human]["status"] and "cordon" not in rows[human]["applied"]
        assert rows[healthy]["applied"] == {}
        table = runner.invoke(cli, ["status"], catch_exceptions=False)
        assert sick in table.output

        status = orjson.loads(runner.invoke(cli, ["breaker", "status"], catch_exceptions=False).output)
        assert status["tripped"] is True and status["fleet_size"] == 3
        assert "breaker closed" in runner.invoke(cli, ["breaker", "reset"], catch_exceptions=False).output
        status = orjson.loads(runner.invoke(cli, ["breaker", "status"], catch_exceptions=False).output)
        assert status["tripped"] is False and status["reset_by"]

        assert runner.invoke(cli, ["reset"]).exit_code != 0  # needs --node or --all
        out = runner.invoke(cli, ["reset", "--all"], catch_exceptions=False).output
        assert f"{sick}: inc-cli" in out
        assert not run(env.node(sick))["spec"].get("unschedulable")
        assert run(env.node(human))["spec"]["unschedulable"] is True  # the person's cordon stays
        assert not any(t["key"] == "nvidia.com/gpu-fault" for t in run(env.node(sick))["spec"].get("taints", []))
        assert "nothing applied" in runner.invoke(cli, ["reset", "--node", sick], catch_exceptions=False).output
    finally:
        run(env.close())
        loop.close()


def test_actuator_command_runs_consumes_and_stops_on_sigterm(
    kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]
) -> None:
    import os
    import signal
    import subprocess
    import sys
    import time

    env = Env(kafka_bootstrap, kubeconfig, unique)
    loop = asyncio.new_event_loop()
    run = loop.run_until_complete
    proc = None
    try:
        run(ensure_topics(kafka_bootstrap, actuator_topics(env.topics), partitions=2))
        (name,) = run(env.make_nodes(1))
        proc_env = {
            **os.environ,
            "KUBECONFIG": kubeconfig,
            "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
            "XIDFLOW_TOPIC_PREFIX": env.topics.prefix,
            "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": env.selector,
            "XIDFLOW_ACTUATOR_NAMESPACE": env.namespace,
            "XIDFLOW_ACTUATOR_GROUP_ID": unique("g"),
            "XIDFLOW_ACTUATOR_POLICY_SOURCE": "file",
            "XIDFLOW_ACTUATOR_BREAKER_MAX_SHARE": "1.0",
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "actuator", "--log-level", "WARNING"],
            env=proc_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        from pipeline.actuator.testing import publish

        run(publish(kafka_bootstrap, env.topics.name("incidents"), [make_incident(name, "inc-proc")]))
        deadline = time.monotonic() + 60
        while not run(env.node(name))["spec"].get("unschedulable"):
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "the actuator process did not cordon the node"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        run(env.close())
        loop.close()


def test_status_and_reset_say_nothing_but_their_answer(
    kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str]
) -> None:
    """Issue 37: both printed "Unclosed client session" (their HTTP session outlived its loop), and reset warned
    that the signing key it never uses was not set. Real processes: the warnings come at their exit."""
    import subprocess
    import sys

    env = Env(kafka_bootstrap, kubeconfig, unique)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(ensure_topics(kafka_bootstrap, [env.topics.name("remediation_audit")], partitions=1))
        (node,) = loop.run_until_complete(env.make_nodes(1))
        cli_env = {
            "PATH": "/usr/bin:/bin", "KUBECONFIG": kubeconfig, "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
            "XIDFLOW_TOPIC_PREFIX": env.topics.prefix, "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": env.selector,
            "XIDFLOW_ACTUATOR_NAMESPACE": env.namespace, "PYTHONWARNINGS": "default",
        }
        for args in (["status"], ["reset", "--node", node], ["breaker", "status"]):
            done = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], env=cli_env, capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0, (args, done.stdout, done.stderr)
            assert "Unclosed" not in done.stderr and "XIDFLOW_SIGNING_KEY_FILE" not in done.stderr, (args, done.stderr)
    finally:
        loop.run_until_complete(env.close())
        loop.close()
