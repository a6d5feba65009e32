"""The decision API served on a real localhost port, against the real Kafka and kube-apiserver."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from kubernetes import client as k8s_client

from pipeline.actuator.api import (
    REQUEST_ID_HEADER,
    RESCUE_ACTIONS_PATH,
    ApiSettings,
    ConfigMapPlanLedger,
    KubernetesNodeLookup,
    TokenStore,
    create_app,
    make_producer,
    openapi_document,
    serve,
)
from pipeline.actuator.app import actuator_topics
from pipeline.actuator.kube import Kube
from pipeline.actuator.machines import node_object
from pipeline.actuator.requests import RescueActionRequest
from pipeline.runtime.settings import TopicNames

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOKEN = "tok-9f2c1b7e0d"
GPU_LABELS = {"nvidia.com/gpu.present": "true"}


def rescue_body(node: str, **overrides: Any) -> dict[str, Any]:
    return {
        "nodeName": node,
        "xid": 79,
        "escalateTime": "2025-03-01T11:59:30Z",
        "actions": [{"name": "cordon", "waittime": 0}, {"name": "drain", "waittime": 30}],
    } | overrides


@dataclass
class Cluster:
    """Objects this module created in the shared API server, deleted at the end."""

    api: k8s_client.ApiClient
    nodes: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    def node(self, name: str, labels: dict[str, str] | None = None, gpus: int = 0) -> str:
        """A KWOK node; ``gpus``: the ``nvidia.com/gpu`` capacity the machine's device plugin reports, no labels."""
        body = node_object(name, labels or {})
        if gpus:
            body["status"]["capacity"] = body["status"]["allocatable"] = {"nvidia.com/gpu": str(gpus)}
        k8s_client.CoreV1Api(self.api).create_node(body)
        self.nodes.append(name)
        return name

    def namespace(self, name: str) -> str:
        k8s_client.CoreV1Api(self.api).create_namespace(
            k8s_client.V1Namespace(metadata=k8s_client.V1ObjectMeta(name=name))
        )
        self.namespaces.append(name)
        return name

    def cleanup(self) -> None:
        core = k8s_client.CoreV1Api(self.api)
        for name in self.nodes:
            core.delete_node(name)
        for name in self.namespaces:
            core.delete_namespace(name)


@dataclass
class ServedApi:
    base_url: str
    topic: str
    settings: ApiSettings
    ledger: ConfigMapPlanLedger
    session: aiohttp.ClientSession

    async def post(
        self, body: Any, *, token: str | None = TOKEN, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any], aiohttp.typedefs.LooseHeaders]:
        all_headers = dict(headers or {})
        if token is not None:
            all_headers["Authorization"] = f"Bearer {token}"
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        async with self.session.post(self.base_url + RESCUE_ACTIONS_PATH, data=data, headers=all_headers) as resp:
            return resp.status, await resp.json(), resp.headers


@pytest.fixture
def cluster(k8s: k8s_client.ApiClient) -> Any:
    created = Cluster(k8s)
    yield created
    created.cleanup()


async def create_topic(bootstrap: str, topic: str, partitions: int = 3) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    finally:
        await admin.close()


async def delete_topic(bootstrap: str, topic: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([topic])
    finally:
        await admin.close()


async def read_topic(bootstrap: str, topic: str, expected: int) -> list[Any]:
    """Every record of ``topic`` once ``expected`` arrived (the pytest timeout bounds the wait)."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    records: list[Any] = []
    try:
        while len(records) < expected:
            batches = await consumer.getmany(timeout_ms=500)
            for batch in batches.values():
                records.extend(batch)
    finally:
        await consumer.stop()
    return records


async def topic_size(bootstrap: str, topic: str) -> int:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        if not partitions:
            await consumer._client.force_metadata_update()  # noqa: SLF001 - metadata of a fresh consumer
            partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        ends = await consumer.end_offsets(partitions)
        return sum(ends.values())
    finally:
        await consumer.stop()


async def start_api(
    kafka_bootstrap: str, kubeconfig: str, settings: ApiSettings, topics: TopicNames
) -> tuple[Callable[[], Any], str, ConfigMapPlanLedger]:
    producer = make_producer(kafka_bootstrap)
    await producer.start()
    kube = Kube.from_config(kubeconfig)  # the same client layer as the actuator's
    lookup = KubernetesNodeLookup(
        kube, gpu_node_selector=settings.gpu_node_selector, gpu_resource_name=settings.gpu_resource_name
    )
    ledger = ConfigMapPlanLedger.from_settings(kube, settings)
    app = create_app(settings, producer, lookup, plan_ledger=ledger, topics=topics)
    runner, addresses = await serve(app, "127.0.0.1", 0)
    host, port = addresses[0]

    async def stop() -> None:
        await runner.cleanup()
        await producer.stop()
        kube.close()

    return stop, f"http://{host}:{port}", ledger


@pytest.fixture
async def served(
    kafka_bootstrap: str, kubeconfig: str, cluster: Cluster, unique: Callable[[str], str]
) -> AsyncIterator[ServedApi]:
    topics = TopicNames(prefix=unique("api") + ".")
    topic = topics.name("remediation_requests")
    await create_topic(kafka_bootstrap, topic)
    await create_topic(kafka_bootstrap, topics.name("remediation_audit"), partitions=1)
    settings = ApiSettings(
        host="127.0.0.1",
        port=0,
        tokens={"ops-portal": TOKEN},
        namespace=cluster.namespace(unique("api-ns")),
        max_pending_plans=3,
    )
    stop, base_url, ledger = await start_api(kafka_bootstrap, kubeconfig, settings, topics)
    async with aiohttp.ClientSession() as session:
        yield ServedApi(base_url, topic, settings, ledger, session)
    await stop()
    await delete_topic(kafka_bootstrap, topic)
    await delete_topic(kafka_bootstrap, topics.name("remediation_audit"))


async def test_success_is_published_keyed_by_node_after_the_ack(
    served: ServedApi, cluster: Cluster, kafka_bootstrap: str, unique: Callable[[str], str]
) -> None:
    node = cluster.node(unique("gpu"), GPU_LABELS)
    status, answer, headers = await served.post(rescue_body(node), headers={"Idempotency-Key": "ticket-1"})
    assert (status, answer) == (200, {"code": "Success", "message": "Success"})

    [record] = await read_topic(kafka_bootstrap, served.topic, 1)
    assert record.key == node.encode()
    request = RescueActionRequest.from_bytes(record.value)
    assert request.request_id == headers[REQUEST_ID_HEADER]
    assert (request.node_name, request.xid, request.requested_by) == (node, 79, "ops-portal")
    assert [(a.name, a.waittime) for a in request.actions] == [("cordon", 0), ("drain", 30)]
    assert dict(record.headers)["request_id"] == request.request_id.encode()
    # The plan counts as pending until the actuator releases it.
    assert set(await served.ledger.pending()) == {request.request_id}


async def test_auth_is_required(served: ServedApi, cluster: Cluster, kafka_bootstrap: str, unique) -> None:
    node = cluster.node(unique("gpu"), GPU_LABELS)
    for token, headers in [(None, {}), ("wrong-token", {}), (None, {"Authorization": f"Basic {TOKEN}"})]:
        status, answer, response_headers = await served.post(rescue_body(node), token=token, headers=headers)
        assert status == 401
        assert answer == {"code": "Error", "message": "Unauthorized"}
        assert response_headers["WWW-Authenticate"].startswith("Bearer")
    assert await topic_size(kafka_bootstrap, served.topic) == 0


async def test_parameter_errors_name_the_field(served: ServedApi, kafka_bootstrap: str) -> None:
    status, answer, _ = await served.post(rescue_body("gpu-x", actions=[{"name": "explode", "waittime": 1}]))
    assert status == 400
    assert answer["code"] == "Error"
    assert answer["message"].startswith("Parameter error: actions[0].name must be one of cordon, drain")

    status, answer, _ = await served.post({"nodeName": "gpu-x", "xid": "79"})
    assert status == 400
    assert answer["message"] == (
        "Parameter error: xid must be an integer; escalateTime is required; actions is required"
    )

    status, answer, _ = await served.post(b"{not json")
    assert (status, answer["message"]) == (400, "Parameter error: body is not valid JSON")

    status, answer, _ = await served.post(b"{" + b" " * 70000 + b"}")
    assert status == 413 and answer["code"] == "Error"
    assert await topic_size(kafka_bootstrap, served.topic) == 0


async def test_preconditions_are_checked_against_the_api_server(
    served: ServedApi, cluster: Cluster, kafka_bootstrap: str, unique: Callable[[str], str]
) -> None:
    missing = unique("ghost")
    status, answer, _ = await served.post(rescue_body(missing))
    assert (status, answer) == (
        404,
        {"code": "Error", "message": f"Failures to meet preconditions: node {missing} does not exist"},
    )

    cpu_node = cluster.node(unique("cpu"), {"kubernetes.io/os": "linux"})
    status, answer, _ = await served.post(rescue_body(cpu_node))
    assert status == 409
    assert answer["message"].startswith(f"Failures to meet preconditions: node {cpu_node} is not a GPU node")
    assert await topic_size(kafka_bootstrap, served.topic) == 0

    # A node whose device plugin reports GPUs is a GPU node even without the label.
    gpu_by_capacity = cluster.node(unique("cap"), gpus=8)
    status, answer, _ = await served.post(rescue_body(gpu_by_capacity))
    assert (status, answer["code"]) == (200, "Success")
    assert await topic_size(kafka_bootstrap, served.topic) == 1


async def test_pending_plans_limit_with_retries_and_release(
    served: ServedApi, cluster: Cluster, kafka_bootstrap: str, unique: Callable[[str], str]
) -> None:
    nodes = [cluster.node(unique("gpu"), GPU_LABELS) for _ in range(4)]
    ids = []
    for i, node in enumerate(nodes[:3]):
        status, answer, headers = await served.post(rescue_body(node), headers={"Idempotency-Key": f"k-{i}"})
        assert (status, answer["code"]) == (200, "Success")
        ids.append(headers[REQUEST_ID_HEADER])

    status, answer, _ = await served.post(rescue_body(nodes[3]))
    assert (status, answer) == (429, {"code": "Error", "message": "Exceed the maximum plans limit 3"})

    # A client retry of an accepted plan is the same plan: accepted again, not counted twice.
    status, answer, headers = await served.post(rescue_body(nodes[0]), headers={"Idempotency-Key": "k-0"})
    assert (status, headers[REQUEST_ID_HEADER]) == (200, ids[0])
    assert len(await served.ledger.pending()) == 3

    await served.ledger.release(ids[1])
    status, answer, _ = await served.post(rescue_body(nodes[3]))
    assert (status, answer["code"]) == (200, "Success")

    records = await read_topic(kafka_bootstrap, served.topic, 5)
    published = [RescueActionRequest.from_bytes(r.value).request_id for r in records]
    assert published.count(ids[0]) == 2  # the retry is re-published; the actuator runs each id once
    assert len(set(published)) == 4


async def test_two_replicas_share_one_limit(
    served: ServedApi,
    cluster: Cluster,
    kafka_bootstrap: str,
    kubeconfig: str,
    unique: Callable[[str], str],
) -> None:
    topics = TopicNames(prefix=served.topic.removesuffix(TopicNames().remediation_requests))
    stop_second, second_url, _ = await start_api(kafka_bootstrap, kubeconfig, served.settings, topics)
    try:
        nodes = [cluster.node(unique("gpu"), GPU_LABELS) for _ in range(8)]

        async def post_to(base_url: str, node: str) -> int:
            url = base_url + RESCUE_ACTIONS_PATH
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with served.session.post(url, data=orjson.dumps(rescue_body(node)), headers=headers) as resp:
                return resp.status

        urls = [served.base_url, second_url]
        statuses = await asyncio.gather(*(post_to(urls[i % 2], node) for i, node in enumerate(nodes)))
    finally:
        await stop_second()
    assert sorted(statuses) == [200] * 3 + [429] * 5
    assert len(await served.ledger.pending()) == 3
    assert await topic_size(kafka_bootstrap, served.topic) == 3


async def test_openapi_document_and_health_are_served(served: ServedApi) -> None:
    async with served.session.get(served.base_url + "/openapi.json") as resp:
        assert resp.status == 200
        document = await resp.json()
    assert document == orjson.loads(orjson.dumps(openapi_document(served.settings)))
    operation = document["paths"][RESCUE_ACTIONS_PATH]["post"]
    assert set(operation["responses"]) == {"200", "400", "401", "404", "409", "413", "429", "503"}
    body_schema = document["components"]["schemas"]["RescueActionBody"]
    assert body_schema["required"] == ["nodeName", "xid", "escalateTime", "actions"]
    assert body_schema["additionalProperties"] is False
    async with served.session.get(served.base_url + "/healthz") as resp:
        assert (resp.status, await resp.json()) == (200, {"status": "ok"})


async def test_the_committed_openapi_document_is_the_one_a_default_actuator_serves(
    kafka_bootstrap: str, kubeconfig: str, cluster: Cluster, unique: Callable[[str], str]
) -> None:
    """docs/openapi/decision-api.json, the document clients are pointed at, is what the API serves with the
    default settings (only where it listens and who may call differ here; neither is in the document)."""
    from pipeline.runtime.contractdocs import OPENAPI

    topics = TopicNames(prefix=unique("api-doc") + ".")
    settings = ApiSettings(host="127.0.0.1", port=0, tokens={"ops-portal": TOKEN},
                           namespace=cluster.namespace(unique("api-ns")))
    stop, base_url, _ = await start_api(kafka_bootstrap, kubeconfig, settings, topics)
    try:
        async with aiohttp.ClientSession() as session, session.get(base_url + "/openapi.json") as resp:
            assert resp.status == 200
            served = await resp.json()
    finally:
        await stop()
    assert served == orjson.loads(OPENAPI.read_bytes())


async def test_schemathesis_against_the_served_document(
    served: ServedApi, cluster: Cluster, unique: Callable[[str], str], tmp_path: Path
) -> None:
    """Property-based calls generated from /openapi.json; every answer must match the document."""
    cluster.node(unique("gpu"), GPU_LABELS)
    schemathesis = Path(sys.executable).with_name("schemathesis")
    assert schemathesis.exists(), "schemathesis is not installed: .venv/bin/pip install schemathesis"
    process = await asyncio.create_subprocess_exec(
        str(schemathesis),
        "run",
        served.base_url + "/openapi.json",
        "--header",
        f"Authorization: Bearer {TOKEN}",
        "--checks",
        "not_a_server_error,status_code_conformance,content_type_conformance,"
        "response_headers_conformance,response_schema_conformance,negative_data_rejection,positive_data_acceptance,"
        "ignored_auth",
        "--max-examples",
        "40",
        "--workers",
        "1",
        "--seed",
        "20250301",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=tmp_path,
        env={**os.environ, "SCHEMATHESIS_HOOKS": ""},
    )
    output, _ = await process.communicate()
    text = output.decode(errors="replace")
    assert process.returncode == 0, text[-6000:]
    assert "Tested: 2" in text, text[-3000:]  # the rescue-actions operation and /healthz


def test_token_file_is_read_and_rotated(tmp_path: Path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text("# rotated by the Secret\nops-portal:first-token\nbare-token\n")
    store = TokenStore({"static": "static-token"}, token_file)
    assert store.identify("Bearer first-token") == "ops-portal"
    assert store.identify("bearer bare-token") == "token-file-line-3"
    assert store.identify("Bearer static-token") == "static"
    assert store.identify("Bearer first-token-and-more") is None
    assert store.identify("Basic first-token") is None
    assert store.identify(None) is None
    token_file.write_text("ops-portal:second-token-longer\n")
    assert store.identify("Bearer first-token") is None
    assert store.identify("Bearer second-token-longer") == "ops-portal"


def test_an_api_without_tokens_refuses_to_start() -> None:
    with pytest.raises(ValueError, match="no API tokens configured"):
        create_app(ApiSettings(tokens={}), None, None, plan_ledger=None)  # type: ignore[arg-type]


async def test_an_idempotency_key_reused_with_another_body_is_refused_and_audited(
    served: ServedApi, cluster: Cluster, kafka_bootstrap: str, unique: Callable[[str], str]
) -> None:
    node = cluster.node(unique("gpu"), GPU_LABELS)
    key = {"Idempotency-Key": "ticket-77"}
    status, _, headers = await served.post(rescue_body(node), headers=key)
    assert status == 200
    request_id = headers[REQUEST_ID_HEADER]
    # The same body spelt differently (another offset notation, keys reordered) is the same request.
    same = {"actions": rescue_body(node)["actions"], "escalateTime": "2025-03-01T11:59:30+00:00",
            "xid": 79, "nodeName": node}
    status, _, headers = await served.post(same, headers=key)
    assert (status, headers[REQUEST_ID_HEADER]) == (200, request_id)

    other = rescue_body(node, actions=[{"name": "reboot", "waittime": 0}])
    status, answer, _ = await served.post(other, headers=key)
    assert status == 409
    assert answer["code"] == "Error" and "Idempotency-Key" in answer["message"]
    # Still refused once the actuator released the plan: the key is remembered, not only counted.
    await served.ledger.release(request_id)
    status, _, _ = await served.post(other, headers=key)
    assert status == 409

    published = [RescueActionRequest.from_bytes(r.value) for r in await read_topic(kafka_bootstrap, served.topic, 2)]
    assert [p.request_id for p in published] == [request_id, request_id]
    assert all([a.name for a in p.actions] == ["cordon", "drain"] for p in published)
    audit_topic = served.topic.removesuffix(TopicNames().remediation_requests) + TopicNames().remediation_audit
    audits = [orjson.loads(r.value) for r in await read_topic(kafka_bootstrap, audit_topic, 1)]
    assert audits[0]["action"] == "api-idempotency-conflict" and audits[0]["node"] == node
    assert audits[0]["details"]["requested_by"] == "ops-portal"
    assert audits[0]["details"]["idempotency_key"] == "ticket-77"


@pytest.mark.parametrize(
    "escalate_time",
    [
        "0001-01-01T00:00:01+02:00",
        "0001-01-01T00:00:00+00:01",
        "9999-12-31T23:59:59-00:01",
        "9999-12-31T23:30:00-23:59",
        "0000-01-01T00:00:00Z",
        "2024-02-30T00:00:00Z",
        "2024-01-01T24:00:00Z",
        "2024-01-01T00:00:00+24:00",
        -1,
        253402300800,
        1.5,
        1e300,
        True,
        None,
        [],
        {},
        "",
    ],
)
async def test_every_bad_escalate_time_is_a_400_naming_the_field(
    served: ServedApi, cluster: Cluster, escalate_time: Any, kafka_bootstrap: str
) -> None:
    status, answer, _ = await served.post(rescue_body("gpu-x", escalateTime=escalate_time))
    assert status == 400, answer
    assert answer["message"].startswith("Parameter error: escalateTime"), answer


async def test_calendar_edge_escalate_times_that_exist_are_accepted(
    served: ServedApi, cluster: Cluster, unique: Callable[[str], str]
) -> None:
    node = cluster.node(unique("gpu"), GPU_LABELS)
    for i, value in enumerate(["0001-01-01T00:00:00Z", "9999-12-31T23:59:59Z", "0001-01-01T01:00:00+01:00", 0]):
        body = rescue_body(node, escalateTime=value)
        status, answer, headers = await served.post(body, headers={"Idempotency-Key": f"e{i}"})
        assert status == 200, (value, answer)
        await served.ledger.release(headers[REQUEST_ID_HEADER])


async def test_a_token_file_rotated_into_invalid_utf8_keeps_the_old_tokens(
    kafka_bootstrap: str, kubeconfig: str, cluster: Cluster, unique: Callable[[str], str], tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_text("ops-portal:first-secret-token\n")
    topics = TopicNames(prefix=unique("apitf") + ".")
    await create_topic(kafka_bootstrap, topics.name("remediation_requests"))
    settings = ApiSettings(host="127.0.0.1", port=0, token_file=token_file, namespace=cluster.namespace(unique("ns")))
    stop, base_url, _ = await start_api(kafka_bootstrap, kubeconfig, settings, topics)
    node = cluster.node(unique("gpu"), GPU_LABELS)
    try:
        async with aiohttp.ClientSession() as session:
            async def post(token: str) -> int:
                headers = {"Authorization": f"Bearer {token}"}
                async with session.post(base_url + RESCUE_ACTIONS_PATH, data=orjson.dumps(rescue_body(node)),
                                        headers=headers) as resp:
                    return resp.status

            assert await post("first-secret-token") == 200
            token_file.write_bytes(b"ops-portal:second-secret-\xff\xfe-token\n")
            assert await post("first-secret-token") == 200  # kept, not a 500 for everyone
    finally:
        await stop()
    logged = caplog.text
    assert f"API token file {token_file} is not valid UTF-8 text" in logged
    assert "first-secret-token" not in logged and "second-secret-" not in logged


def actuator_process_env(kafka_bootstrap: str, kubeconfig: str, prefix: str, namespace: str, group: str,
                         **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "KUBECONFIG": kubeconfig,
        "KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap,
        "XIDFLOW_TOPIC_PREFIX": prefix,
        "XIDFLOW_ACTUATOR_NAMESPACE": namespace,
        "XIDFLOW_API_NAMESPACE": namespace,
        "XIDFLOW_ACTUATOR_GROUP_ID": group,
        "XIDFLOW_ACTUATOR_POLICY_SOURCE": "file",
        "XIDFLOW_METRICS_PORT": "0",
        **extra,
    }


async def test_a_busy_port_stops_the_actuator_with_a_clear_sentence(
    kafka_bootstrap: str, kubeconfig: str, cluster: Cluster, unique: Callable[[str], str]
) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = actuator_process_env(
            kafka_bootstrap, kubeconfig, unique("busy") + ".", cluster.namespace(unique("ns")), unique("g"),
            XIDFLOW_API_HOST="127.0.0.1", XIDFLOW_API_PORT=str(port), XIDFLOW_API_TOKENS=f'{{"ops": "{TOKEN}"}}',
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pipeline.cli", "actuator", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(process.communicate(), 120)
    text = output.decode(errors="replace")
    assert process.returncode != 0, text
    assert f"the decision API cannot listen on 127.0.0.1:{port}: the port is already in use" in text
    assert "Traceback" not in text
    assert TOKEN not in text


async def test_without_a_token_file_the_api_serves_401_to_everyone(
    kafka_bootstrap: str, kubeconfig: str, cluster: Cluster, unique: Callable[[str], str], tmp_path: Path
) -> None:
    """The chart's default: the Secret is optional, the token file path is set but absent."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    token_file = tmp_path / "api" / "tokens"
    token_file.parent.mkdir(exist_ok=True)  # an absent optional Secret is still mounted, as an empty directory
    prefix = unique("notok") + "."
    topics = TopicNames(prefix=prefix)
    for name in actuator_topics(topics):
        await create_topic(kafka_bootstrap, name, partitions=1)
    env = actuator_process_env(
        kafka_bootstrap, kubeconfig, prefix, cluster.namespace(unique("ns")), unique("g"),
        XIDFLOW_API_HOST="127.0.0.1", XIDFLOW_API_PORT=str(port), XIDFLOW_API_TOKEN_FILE=str(token_file),
    )
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pipeline.cli", "actuator", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            while True:
                assert process.returncode is None, "the actuator exited"
                try:
                    async with session.get(url + "/healthz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    await asyncio.sleep(0.2)
            headers = {"Authorization": f"Bearer {TOKEN}"}
            async with session.post(url + RESCUE_ACTIONS_PATH, data=b"{}", headers=headers) as resp:
                assert resp.status == 401
            token_file.parent.mkdir(exist_ok=True)
            token_file.write_text(f"ops:{TOKEN}\n")  # the Secret appears: served without a restart
            async with session.post(url + RESCUE_ACTIONS_PATH, data=b"{}", headers=headers) as resp:
                assert resp.status == 400
    finally:
        process.terminate()
        output, _ = await asyncio.wait_for(process.communicate(), 60)
    text = output.decode(errors="replace")
    assert "every request is answered 401 until a token is configured" in text
    assert TOKEN not in text
