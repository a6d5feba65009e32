"""A restarted actuator quarantines its first node without the Kubernetes client's generated API modules.

Importing ``kubernetes.client.api.core_v1_api`` (and its siblings) builds hundreds of pydantic models,
~1.2 s of CPU, and a whole ``xidflow actuator`` process restarted (a container restart) paid it before
its partitions flowed again (issue 22, ``failover_actuator_process``). Nothing the first records need
calls the generated APIs: the namespace check, the node list+watch, the breaker's count and the
quarantine's writes go through plain HTTP. This runs, in a fresh interpreter, what the command and
its supervisor import before the fork, then a replica against the real broker and API server, and
checks which generated API modules were loaded by the time its first incident's taint is on the node.
Not a timing: a module list.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from pipeline.actuator.app import actuator_topics
from pipeline.actuator.kube import Kube
from pipeline.actuator.testing import create_nodes, delete_nodes
from pipeline.kafka.admin import ensure_topics
from pipeline.runtime.settings import TopicNames

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    from pipeline.commands.actuator import ACTUATOR_MODULES
    from pipeline.runtime import supervisor
    supervisor.preload(ACTUATOR_MODULES)  # what the supervisor loads before its fork
    from pipeline.actuator.app import Actuator
    from pipeline.actuator.settings import ActuatorSettings
    from pipeline.actuator.testing import make_incident, publish, wait_until
    from pipeline.runtime.settings import KafkaSettings, TopicNames

    bootstrap, kubeconfig, prefix, selector, namespace, group, node, policy = sys.argv[1:]

    async def main() -> None:
        settings = ActuatorSettings(gpu_node_selector=selector, namespace=namespace, group_id=group,
                                    policy_source="file", policy_file=policy, breaker_max_share=1.0)
        replica = Actuator(settings, KafkaSettings(KAFKA_BOOTSTRAP_SERVERS=bootstrap), TopicNames(prefix=prefix),
                           kubeconfig)
        stop = asyncio.Event()
        running = asyncio.create_task(replica.run_forever(stop))
        await publish(bootstrap, TopicNames(prefix=prefix).name("incidents"), [make_incident(node, "i-1")])

        async def tainted() -> bool:
            return bool(((await replica.kube.get_node(node)).get("spec") or {}).get("taints"))

        await wait_until(tainted, 120, what="the first incident's taint")
        loaded = sorted(m for m in sys.modules if m.startswith("kubernetes.client.api."))
        stop.set()
        await running
        print(json.dumps(loaded))

    asyncio.run(main())
    """
)


async def test_the_first_taint_needs_no_generated_kubernetes_api(
    kafka_bootstrap: str, kubeconfig: str, unique: Callable[[str], str], tmp_path: Path
) -> None:
    topics = TopicNames(prefix=unique("t") + ".")
    await ensure_topics(kafka_bootstrap, actuator_topics(topics), partitions=1)
    tag = unique("fleet")
    node = unique("gpu")
    kube = Kube.from_config(kubeconfig, 4)
    await create_nodes(kube, [node], {"xidflow.test/fleet": tag}, gpu=True)
    policy = tmp_path / "p.yaml"
    policy.write_text(  # the quarantine only: a drain's pod calls would rightly load CoreV1Api afterwards
        "kind: RescuePolicy\nmetadata: {name: start}\nspec:\n  rules:\n"
        "  - {priority: 10, codes: [79], actions: [{name: quarantine}]}\n"
    )
    try:
        args = [kafka_bootstrap, kubeconfig, topics.prefix, f"xidflow.test/fleet={tag}", unique("ns"), unique("g"),
                node, str(policy)]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", SCRIPT, *args, env={**os.environ, "KUBECONFIG": kubeconfig},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 240)
        assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
        loaded = json.loads(out.decode().strip().splitlines()[-1])
        assert loaded == [], f"generated Kubernetes API modules on the start path: {loaded}"
    finally:
        await delete_nodes(kube, [node])
        await kube.aclose()
