"""After ``xidflow breaker reset`` the breaker counts the GPU nodes quarantined NOW (real API server).

The issue's case: with a limit of 50%, 10 of 20 nodes were quarantined and the breaker tripped; a
person reset it and 4 more nodes were quarantined in the same window (14 of 20, 70%). Now the
reset closes the breaker but the 10 nodes still quarantined keep counting, so the next node trips
it again; once a person returns nodes to service, new quarantines are admitted up to the limit.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest
from click.testing import CliRunner

from pipeline.actuator.testing import make_incident
from pipeline.cli import cli
from tests.integration.test_actuator_effects import Env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]



async def cordoned(env: Env, names: list[str]) -> list[str]:
    return [n for n in names if (await env.node(n))["spec"].get("unschedulable")]


async def test_a_reset_breaker_counts_the_nodes_still_quarantined(env: Env, kubeconfig: str) -> None:
    names = await env.make_nodes(20)
    act = await env.actuator(breaker_max_share=0.5)
    await asyncio.gather(*(act.engine.handle(make_incident(n, f"inc-{i}")) for i, n in enumerate(names[:10])))
    assert len(await cordoned(env, names)) == 10
    await act.engine.handle(make_incident(names[10], "inc-10"))
    assert (await act.breaker.status())["tripped"] is True

    cli_env = {
        "KUBECONFIG": kubeconfig,
        "XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR": env.selector,
        "XIDFLOW_ACTUATOR_NAMESPACE": env.namespace,
        "XIDFLOW_ACTUATOR_BREAKER_MAX_SHARE": "0.5",
    }
    runner = CliRunner(env=cli_env)
    result = await asyncio.to_thread(runner.invoke, cli, ["breaker", "reset"], catch_exceptions=False)
    assert "breaker closed" in result.output

    # The same window, right after the reset (the replica's fleet cache still predates it).
    for i, n in enumerate(names[11:15], start=11):
        await act.engine.handle(make_incident(n, f"inc-{i}"))
    assert len(await cordoned(env, names)) == 10  # not 14 of 20
    status = (await act.breaker.status())
    assert status["tripped"] is True and status["quarantined_now"] == 10
    assert "11 of 20" in status["reason"]
    result = await asyncio.to_thread(runner.invoke, cli, ["breaker", "status"], catch_exceptions=False)
    assert orjson.loads(result.output)["quarantined_now"] == 10

    # A person returns two nodes to service and resets: two new quarantines fit (10 of 20), a third does not.
    for n in names[:2]:
        await env.kube.patch_node(n, {"spec": {"unschedulable": False, "taints": []}})
    assert await act.breaker.reset(by="tests") is True
    for i, n in enumerate(names[15:18], start=15):
        await act.engine.handle(make_incident(n, f"inc-r-{i}"))
    assert await cordoned(env, names[15:18]) == names[15:17]
    assert len(await cordoned(env, names)) == 10
