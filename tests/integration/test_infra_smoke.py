"""Smoke tests proving both services are real: Kafka (aiokafka, Faust) and the Kubernetes control plane (+RBAC).

What each component of the control plane does is proven in test_control_plane.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from kubernetes import client
from kubernetes.client.rest import ApiException

from pipeline.actuator.kube import Kube, TooManyRequests
from pipeline.actuator.machines import create_nodes, delete_nodes, node_object, node_usable
from tests.integration.workloads import deployment, ensure_ns, pdb

pytestmark = pytest.mark.integration


async def _create_topic(bootstrap: str, name: str, partitions: int = 1) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    finally:
        await admin.close()


async def test_kafka_round_trip(kafka_bootstrap: str, unique) -> None:
    topic = unique("smoke")
    await _create_topic(kafka_bootstrap, topic, partitions=3)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for i in range(30):
            await producer.send_and_wait(topic, f"line {i}".encode(), key=f"node-{i % 3}".encode())
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka_bootstrap,
        group_id=unique("g"),
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    got: dict[str, list[int]] = {}
    try:
        deadline = time.monotonic() + 30
        while sum(len(v) for v in got.values()) < 30 and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=1000)
            for records in batch.values():
                for r in records:
                    got.setdefault(r.key.decode(), []).append(int(r.value.split()[1]))
        await consumer.commit()
    finally:
        await consumer.stop()
    # Keyed by node: every node's records arrive, in the order produced.
    assert {k: v for k, v in got.items()} == {f"node-{n}": list(range(n, 30, 3)) for n in range(3)}


FAUST_APP = """
import faust

app = faust.App({app_id!r}, broker={broker!r}, store="memory://", web_enabled=False,
                topic_partitions=1, topic_replication_factor=1)
source = app.topic({src!r}, value_type=bytes, value_serializer="raw")
sink = app.topic({dst!r}, value_type=bytes, value_serializer="raw")


@app.agent(source)
async def upper(stream):
    async for value in stream:
        await sink.send(value=value.upper())
"""


async def test_faust_app_processes_records(kafka_bootstrap: str, unique, tmp_path: Path) -> None:
    src, dst = unique("faust-in"), unique("faust-out")
    await _create_topic(kafka_bootstrap, src)
    await _create_topic(kafka_bootstrap, dst)
    mod = tmp_path / "smoke_faust_app.py"
    mod.write_text(
        textwrap.dedent(
            FAUST_APP.format(app_id=unique("app"), broker=f"kafka://{kafka_bootstrap.split(',')[0]}", src=src, dst=dst)
        )
    )
    worker = subprocess.Popen(  # noqa: ASYNC220 - starts a daemon, returns at once
        [sys.executable, "-m", "faust", "-A", "smoke_faust_app", "worker", "-l", "warn", "--without-web"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(tmp_path)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
        await producer.start()
        try:
            for word in (b"xid", b"sxid", b"nvlink"):
                await producer.send_and_wait(src, word)
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(dst, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest")
        await consumer.start()
        seen: list[bytes] = []
        try:
            deadline = time.monotonic() + 90
            while len(seen) < 3 and time.monotonic() < deadline:
                if worker.poll() is not None:
                    break
                for records in (await consumer.getmany(timeout_ms=1000)).values():
                    seen.extend(r.value for r in records)
        finally:
            await consumer.stop()
    finally:
        worker.terminate()
        try:
            out = worker.communicate(timeout=30)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            worker.kill()
            out = worker.communicate()[0].decode(errors="replace")
    assert seen == [b"XID", b"SXID", b"NVLINK"], f"Faust worker output:\n{out[-3000:]}"


def _node(core: client.CoreV1Api, name: str) -> None:
    """Register a node as KWOK's and wait until it is usable (KWOK made it Ready, the node lifecycle controller
    lifted the not-ready taint every new node gets)."""
    core.create_node(node_object(name, {"nvidia.com/gpu.present": "true", "xidflow.dev/test": "smoke"}))
    deadline = time.monotonic() + 60
    while not node_usable(core.api_client.sanitize_for_serialization(core.read_node(name))):
        assert time.monotonic() < deadline, f"node {name} not Ready and untainted within 60s"
        time.sleep(0.2)


def test_nodes_taints_conditions_events(k8s: client.ApiClient, unique) -> None:
    core = client.CoreV1Api(k8s)
    name = unique("node")
    _node(core, name)
    try:
        assert name in {n.metadata.name for n in core.list_node(label_selector="xidflow.dev/test=smoke").items}
        core.patch_node(
            name,
            {
                "spec": {
                    "unschedulable": True,
                    "taints": [{"key": "xidflow.dev/gpu-fault", "value": "xid-79", "effect": "NoSchedule"}],
                }
            },
        )
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        core.patch_node_status(
            name,
            {
                "status": {
                    "conditions": [
                        {
                            "type": "GpuXid",
                            "status": "True",
                            "reason": "Xid79",
                            "message": "GPU has fallen off the bus",
                            "lastHeartbeatTime": now,
                            "lastTransitionTime": now,
                        }
                    ]
                }
            },
        )
        node = core.read_node(name)
        assert node.spec.unschedulable is True
        # Ours, and the node lifecycle controller's answer to the cordon (node.kubernetes.io/unschedulable).
        assert [t.key for t in node.spec.taints if not t.key.startswith("node.kubernetes.io/")] == [
            "xidflow.dev/gpu-fault"]
        assert {c.type: c.status for c in node.status.conditions}["GpuXid"] == "True"
        event = core.create_namespaced_event(
            "default",
            client.CoreV1Event(
                metadata=client.V1ObjectMeta(generate_name="xid-"),
                involved_object=client.V1ObjectReference(kind="Node", name=name, uid=node.metadata.uid),
                reason="XidError",
                message="Xid 79 on 0000:4e:00.0",
                type="Warning",
                first_timestamp=now,
                last_timestamp=now,
                count=1,
                source=client.V1EventSource(component="xidflow"),
            ),
        )
        assert core.read_namespaced_event(event.metadata.name, "default").reason == "XidError"
    finally:
        core.delete_node(name)


async def test_eviction_refused_by_pdb(kubeconfig: str, unique) -> None:
    """A Deployment's one pod behind minAvailable 1: the disruption controller allows no disruption, and the API
    server's eviction handler refuses with 429."""
    kube = Kube.from_config(kubeconfig, 4)
    ns, node = unique("ns"), unique("node")
    await ensure_ns(kube, ns)
    await create_nodes(kube, [node], {"xidflow.dev/test": "smoke"})
    try:
        (pod,) = await deployment(kube, ns, "train", node, 1, {"app": "train"})
        status = await pdb(kube, ns, "train", {"app": "train"}, min_available=1)
        assert (status["disruptionsAllowed"], status["currentHealthy"], status["expectedPods"]) == (0, 1, 1)
        with pytest.raises(TooManyRequests):
            await kube.evict_pod(ns, pod, None)
    finally:
        await kube._call(kube.core.delete_namespace, ns)
        await delete_nodes(kube, [node])
        kube.close()


def test_rbac_narrow_service_account_cannot_delete_nodes(k8s: client.ApiClient, unique, kubeconfig: str) -> None:
    core, rbac = client.CoreV1Api(k8s), client.RbacAuthorizationV1Api(k8s)
    ns, sa, role, node = unique("ns"), "reader", unique("role"), unique("node")
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=ns)))
    core.create_namespaced_service_account(ns, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=sa)))
    rbac.create_cluster_role(
        client.V1ClusterRole(
            metadata=client.V1ObjectMeta(name=role),
            rules=[client.V1PolicyRule(api_groups=[""], resources=["nodes"], verbs=["get", "list", "watch", "patch"])],
        )
    )
    rbac.create_cluster_role_binding(
        client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name=role),
            role_ref=client.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=role),
            subjects=[client.RbacV1Subject(kind="ServiceAccount", name=sa, namespace=ns)],
        )
    )
    core.create_node(node_object(node, {"xidflow.dev/test": "smoke"}))
    try:
        token = core.create_namespaced_service_account_token(
            sa,
            ns,
            client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600)),
        ).status.token
        cfg = client.Configuration()
        cfg.host = k8s.configuration.host
        cfg.ssl_ca_cert = k8s.configuration.ssl_ca_cert
        cfg.api_key = {"authorization": f"Bearer {token}"}
        narrow = client.CoreV1Api(client.ApiClient(cfg))
        deadline = time.monotonic() + 15
        while True:  # RBAC caches catch up with the new binding within a moment
            try:
                narrow.read_node(node)
                break
            except ApiException as exc:
                if exc.status != 403 or time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        narrow.patch_node(node, {"metadata": {"labels": {"patched-by": "sa"}}})
        with pytest.raises(ApiException) as denied:
            narrow.delete_node(node)
        assert denied.value.status == 403
        with pytest.raises(ApiException) as secrets:
            narrow.list_namespaced_secret(ns)
        assert secrets.value.status == 403
        assert core.read_node(node).metadata.labels["patched-by"] == "sa"
    finally:
        core.delete_node(node)
        rbac.delete_cluster_role_binding(role)
        rbac.delete_cluster_role(role)
        core.delete_namespace(ns)


def test_local_cli_up_env_status_down(tmp_path: Path) -> None:
    """The CLI lifecycle on a state directory of its own; `down` leaves nothing listening."""
    env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_BOOTSTRAP_SERVERS", "KUBECONFIG")}
    env["XIDFLOW_NO_DOCKER"] = "1"
    xidflow = [sys.executable, "-m", "pipeline.cli", "local"]
    state = ["--state-dir", str(tmp_path / "state")]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*xidflow, *args, *state], capture_output=True, text=True, env=env, timeout=400)

    up = run("up")
    assert up.returncode == 0, up.stderr
    exports = dict(line.removeprefix("export ").split("=", 1) for line in run("env").stdout.splitlines())
    assert set(exports) == {"KAFKA_BOOTSTRAP_SERVERS", "KUBECONFIG"}
    plane = json.loads((tmp_path / "state" / "state.json").read_text())["control_plane"]
    try:
        status = run("status")
        assert status.returncode == 0, status.stdout + status.stderr
        for component in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"):
            assert component in status.stdout, status.stdout
        again = run("up")  # a second `up` finds it all running and changes nothing
        assert again.returncode == 0 and "already running" in again.stderr, again.stderr
        assert json.loads((tmp_path / "state" / "state.json").read_text())["control_plane"] == plane
        check = subprocess.run(
            [
                sys.executable,
                "-c",
                textwrap.dedent("""
            import asyncio, os
            from kubernetes import client, config
            from aiokafka import AIOKafkaProducer, AIOKafkaConsumer
            config.load_kube_config()
            client.CoreV1Api().list_node()
            async def rt():
                p = AIOKafkaProducer(bootstrap_servers=os.environ["KAFKA_BOOTSTRAP_SERVERS"])
                await p.start(); await p.send_and_wait("cli-smoke", b"ok"); await p.stop()
                c = AIOKafkaConsumer("cli-smoke", bootstrap_servers=os.environ["KAFKA_BOOTSTRAP_SERVERS"],
                                     auto_offset_reset="earliest")
                await c.start(); r = await asyncio.wait_for(c.getone(), 60); await c.stop()
                assert r.value == b"ok"
            asyncio.run(rt())
            print("round-trip ok")
        """),
            ],
            capture_output=True,
            text=True,
            env={**env, **exports},
            timeout=120,
        )
        assert check.returncode == 0 and "round-trip ok" in check.stdout, check.stderr
    finally:
        down = run("down")
    assert down.returncode == 0, down.stderr
    ports = [int(exports["KAFKA_BOOTSTRAP_SERVERS"].rsplit(":", 1)[1])]
    kubeconfig = Path(exports["KUBECONFIG"]).read_text()
    ports.append(int(kubeconfig.split("server: https://127.0.0.1:", 1)[1].split()[0]))
    ports += [v for k, v in plane.items() if k.endswith("_port")]
    from pipeline.localinfra.procs import alive, port_open

    assert not any(port_open(p) for p in ports), "something is still listening after `local down`"
    pids = [v for k, v in plane.items() if k.endswith("_pid")]
    assert len(pids) == 5 and not any(alive(pid, str(tmp_path)) for pid in pids), "a process outlived `local down`"
    assert run("status").returncode == 1


@pytest.mark.parametrize("n", [1])
def test_private_kafka_restart_keeps_data(private_kafka, n: int) -> None:
    cluster = private_kafka(brokers=n)

    async def produce_then_read(after_restart: bool) -> list[bytes]:
        if not after_restart:
            p = AIOKafkaProducer(bootstrap_servers=cluster.bootstrap, acks="all")
            await p.start()
            await p.send_and_wait("durable", b"before-restart")
            await p.stop()
        c = AIOKafkaConsumer("durable", bootstrap_servers=cluster.bootstrap, auto_offset_reset="earliest")
        await c.start()
        try:
            r = await asyncio.wait_for(c.getone(), 60)
        finally:
            await c.stop()
        return [r.value]

    assert asyncio.run(produce_then_read(False)) == [b"before-restart"]
    cluster.restart()
    assert asyncio.run(produce_then_read(True)) == [b"before-restart"]
