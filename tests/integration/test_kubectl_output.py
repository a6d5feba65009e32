"""xidflow's kubectl-style output against the real kubectl (built with the local control plane).

``pipeline.commands.output`` lays tables out and writes ages as kubectl does, by imitation (Go's tabwriter
with kubectl's settings; ``duration.HumanDuration``). Imitations drift, so the real kubectl is asked: the same
cells laid out by ``kubectl get`` and by ``render_table`` must be the same text, and the age kubectl prints for
an Event's ``lastTimestamp`` must be the one ``age`` gives for that many seconds.
"""

from __future__ import annotations

import datetime as dt
import subprocess
import uuid
from typing import Any

import pytest

from pipeline.commands.output import age, render_table
from pipeline.localinfra.install import ensure_controlplane

pytestmark = pytest.mark.integration

# Seconds in every band of kubectl's HumanDuration (one unit, two units, each unit), away from a band's edge
# by more than the few seconds between writing the Event and kubectl reading the clock.
AGES = [5, 47, 95, 150, 330, 545, 605, 1500, 7300, 10_900, 14_400, 15_300, 27_000, 30_000, 90_000, 172_900,
        190_800, 266_400, 700_000, 2_000_000, 40_000_000, 63_200_000, 70_000_000, 100_000_000, 300_000_000]


def kubectl(kubeconfig: str, *args: str) -> str:
    binary = ensure_controlplane(lambda m: print(f"[kubectl] {m}", flush=True)).kubectl
    proc = subprocess.run([str(binary), f"--kubeconfig={kubeconfig}", *args], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def namespace(k8s: Any) -> Any:
    from kubernetes import client

    core = client.CoreV1Api(k8s)
    name = f"kubectl-out-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    core.delete_namespace(name)


def test_tables_are_laid_out_as_kubectl_lays_them_out(k8s: Any, kubeconfig: str, namespace: str) -> None:
    from kubernetes import client

    core = client.CoreV1Api(k8s)
    # Names from one character to long, so that both the widest-cell rule and the six-column minimum show.
    for n, name in enumerate(["a", "bb", "a-much-longer-config-map-name-than-the-others", "ccc"]):
        core.create_namespaced_config_map(namespace, client.V1ConfigMap(
            metadata=client.V1ObjectMeta(name=name), data={"k": "v" * n} if n else {}))
    narrow = "custom-columns=N:.metadata.name,K:.data.k,NAMESPACE:.metadata.namespace"
    for args in (["get", "configmaps"], ["get", "configmaps", "-o", narrow]):
        real = kubectl(kubeconfig, "-n", namespace, *args)
        header, *rows = [line.split() for line in real.splitlines()]
        assert all(len(r) == len(header) for r in rows), real  # no cell holds a space
        assert render_table(header, rows) == real, f"kubectl:\n{real}\nxidflow:\n{render_table(header, rows)}"


def test_ages_are_the_ones_kubectl_prints(k8s: Any, kubeconfig: str, namespace: str) -> None:
    from kubernetes import client

    core = client.CoreV1Api(k8s)
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    for seconds in AGES:
        when = now - dt.timedelta(seconds=seconds)
        core.create_namespaced_event(namespace, client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=f"age-{seconds}"), reason=f"Age{seconds}", type="Normal",
            message="x", count=1, first_timestamp=when, last_timestamp=when,
            involved_object=client.V1ObjectReference(kind="ConfigMap", name="kube-root-ca.crt", namespace=namespace),
        ))
    real = kubectl(kubeconfig, "-n", namespace, "get", "events")
    header = real.splitlines()[0]
    assert header.startswith("LAST SEEN"), real
    printed = {}
    for line in real.splitlines()[1:]:
        last_seen, _type, reason, *_ = line.split()
        printed[int(reason.removeprefix("Age"))] = last_seen
    elapsed = int((dt.datetime.now(dt.UTC) - now).total_seconds()) + 1
    for seconds in AGES:
        # kubectl read the clock between writing and now: any whole second in that span is its answer.
        candidates = {age(seconds + d) for d in range(elapsed + 1)}
        assert printed[seconds] in candidates, (seconds, printed[seconds], candidates)
