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
from pipeline.actuator.requests import RescueActionRequest
from pipeline.settings import TopicNames

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
        core = k8s_client.CoreV1Api(self.api)
        core.create_node(k8s_client.V1Node(metadata=k8s_client.V1ObjectMeta(name=name, labels=labels or {})))
        self.nodes.append(name)
        if gpus:
            # No kubelet here: report capacity through the status subresource, as a device plugin would.
            core.patch_node_status(name, {"status": {"capacity": {"nvidia.com/gpu": str(gpus)}}})
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
    kafka_bootstrap: str, k8s: k8s_client.ApiClient, settings: ApiSettings, topics: TopicNames
) -> tuple[Callable[[], Any], str, ConfigMapPlanLedger]:
    producer = make_producer(kafka_bootstrap)
    await producer.start()
    lookup = KubernetesNodeLookup(
        k8s, gpu_node_selector=settings.gpu_node_selector, gpu_resource_name=settings.gpu_resource_name
    )
    ledger = ConfigMapPlanLedger.from_settings(k8s, settings)
    app = create_app(settings, producer, lookup, plan_ledger=ledger, topics=topics)
    runner, addresses = await serve(app, "127.0.0.1", 0)
    host, port = addresses[0]

    async def stop() -> None:
        await runner.cleanup()
        await producer.stop()

    return stop, f"http://{host}:{port}", ledger


@pytest.fixture
async def served(
    kafka_bootstrap: str, k8s: k8s_client.ApiClient, cluster: Cluster, unique: Callable[[str], str]
) -> AsyncIterator[ServedApi]:
    topics = TopicNames(prefix=unique("api") + ".")
    topic = topics.name("remediation_requests")
    await create_topic(kafka_bootstrap, topic)
    settings = ApiSettings(
        host="127.0.0.1",
        port=0,
        tokens={"ops-portal": TOKEN},
        namespace=cluster.namespace(unique("api-ns")),
        max_pending_plans=3,
    )
    stop, base_url, ledger = await start_api(kafka_bootstrap, k8s, settings, topics)
    async with aiohttp.ClientSession() as session:
        yield ServedApi(base_url, topic, settings, ledger, session)
    await stop()
    await delete_topic(kafka_bootstrap, topic)


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
    k8s: k8s_client.ApiClient,
    unique: Callable[[str], str],
) -> None:
    topics = TopicNames(prefix=served.topic.removesuffix(TopicNames().remediation_requests))
    stop_second, second_url, _ = await start_api(kafka_bootstrap, k8s, served.settings, topics)
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
