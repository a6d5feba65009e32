"""Container logs through the real Fluent Bit and the shipped configuration.

The ``tail`` input reads CRI-format files named as the kubelet names them (a partial ``P`` line and its
``F`` end exercise the ``cri`` multiline parser), the shipped prefilter (Onigmo, as Fluent Bit runs it)
drops the noise, the shipped ``kubernetes`` filter looks each pod up on the real local API server with
the credential the chart gives Fluent Bit (its ServiceAccount, ClusterRole and binding, rendered by the
real helm; a token from the TokenRequest API), and the Kafka output delivers to a real worker.

The shipped file is changed only where a test machine differs from a GPU node
(``pipeline.localinfra.fluentbit_run.render_shipped_config``; drift is a unit test).
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from pipeline.actuator.kube import Kube
from pipeline.actuator.machines import create_nodes
from pipeline.ingest.parsing.pod import match_pod_signal
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from pipeline.localinfra.fluentbit_run import FluentBit, Render, load_shipped
from pipeline.localinfra.helm import helm_template
from pipeline.runtime.settings import TopicNames
from tests.integration.test_pipeline import Pipeline
from tests.integration.workloads import ensure_ns, statefulset
from tests.unit.test_deploy_fluentbit import NOISE

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "xidflow"
POD_CORPUS = REPO / "tests" / "corpus" / "pod_corpus.yaml"

ECC = "RuntimeError: CUDA error: uncorrectable ECC error encountered"
NCCL = [
    "[rank3]:[E ProcessGroupNCCL.cpp:563] [Rank 3] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=1234, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600041 "
    "milliseconds before timing out.",
    "RuntimeError: NCCL error: remote process exited or there was a network error",
]
# An application-grade line after the NCCL lines in the same file: one file is one ordered stream to one
# partition, so once its incident is out the NCCL lines before it have been aggregated.
SENTINEL = "RuntimeError: CUDA error: an illegal memory access was encountered"


def cri(text: str, stream: str = "stderr", tag: str = "F") -> str:
    """One line as containerd/CRI-O write it: ``<RFC3339Nano> <stream> <P|F> <text>``."""
    now = datetime.now(UTC)
    return f"{now:%Y-%m-%dT%H:%M:%S}.{now.microsecond:06d}{secrets.randbelow(1000):03d}Z {stream} {tag} {text}"


def log_name(pod: str, namespace: str, container: str) -> str:
    """The kubelet's file name under /var/log/containers."""
    return f"{pod}_{namespace}_{container}-{secrets.token_hex(32)}.log"


# -- the API server side: namespace, node, pods, and Fluent Bit's credential from the chart -----------------
@dataclass
class KubeAccess:
    namespace: str
    node: str
    kube: dict[str, str]  # kube_url, kube_ca_file, kube_token_file for the kubernetes filter
    pods: dict[str, str]  # pod name -> uid


def chart_fluent_bit_rbac(release: str, namespace: str) -> list[dict[str, Any]]:
    """The ServiceAccount, ClusterRole and ClusterRoleBinding the chart gives Fluent Bit."""
    text = helm_template(CHART, release=release, namespace=namespace, log=lambda m: print(f"[helm] {m}"))
    docs = [d for d in yaml.safe_load_all(text) if d]
    mine = [d for d in docs if d["kind"] in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding")
            and d["metadata"]["name"] == f"{release}-xidflow-fluent-bit"]
    assert sorted(d["kind"] for d in mine) == ["ClusterRole", "ClusterRoleBinding", "ServiceAccount"], mine
    return mine


@pytest.fixture(scope="module")
def kube_access(k8s: Any, kubeconfig: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeAccess]:
    from kubernetes import client

    core, rbac = client.CoreV1Api(k8s), client.RbacAuthorizationV1Api(k8s)
    tag = uuid.uuid4().hex[:6]
    namespace, node, release = f"fb-pods-{tag}", f"gpu-fb-{tag}", f"fb{tag}"
    # A KWOK node; the pods are StatefulSets' (trainer-0, trainer-1, corpus-0), placed there by the scheduler.
    pods = asyncio.run(_kwok_node_with_pods(kubeconfig, namespace, node))
    docs = chart_fluent_bit_rbac(release, namespace)
    made_cluster: list[tuple[Callable[..., Any], str]] = []
    try:
        for doc in docs:
            if doc["kind"] == "ServiceAccount":
                core.create_namespaced_service_account(namespace, doc)
            elif doc["kind"] == "ClusterRole":
                rbac.create_cluster_role(doc)
                made_cluster.append((rbac.delete_cluster_role, doc["metadata"]["name"]))
            else:
                rbac.create_cluster_role_binding(doc)
                made_cluster.append((rbac.delete_cluster_role_binding, doc["metadata"]["name"]))
        sa = next(d for d in docs if d["kind"] == "ServiceAccount")["metadata"]["name"]
        token = core.create_namespaced_service_account_token(
            sa, namespace,
            client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)),
        ).status.token
        secrets_dir = tmp_path_factory.mktemp("fb-kube")
        token_file = secrets_dir / "token"
        token_file.write_text(token)
        kcfg = yaml.safe_load(Path(kubeconfig).read_text())["clusters"][0]["cluster"]
        _wait_rbac(k8s, token, namespace)
        yield KubeAccess(namespace, node, {"kube_url": kcfg["server"], "kube_ca_file": kcfg["certificate-authority"],
                                           "kube_token_file": str(token_file)}, pods)
    finally:
        for delete, name in made_cluster:
            delete(name)
        core.delete_namespace(namespace)
        core.delete_node(node)


async def _kwok_node_with_pods(kubeconfig: str, namespace: str, node: str) -> dict[str, str]:
    """The namespace, a KWOK GPU node and the StatefulSets' running pods on it: {pod name: uid}."""
    kube = Kube.from_config(kubeconfig, 4)
    try:
        await ensure_ns(kube, namespace)
        await create_nodes(kube, [node], {}, gpu=True)
        names = [*await statefulset(kube, namespace, "trainer", node, 2, {"app": "train", "set": "trainer"},
                                    container_name="main"),
                 *await statefulset(kube, namespace, "corpus", node, 1, {"app": "train", "set": "corpus"},
                                    container_name="main")]
        return {name: (await kube.get_pod(namespace, name))["metadata"]["uid"] for name in names}
    finally:
        await kube.aclose()


def _wait_rbac(k8s: Any, token: str, namespace: str) -> None:
    """The binding is in force (RBAC caches catch up within moments): the token reads pods, and nothing more."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    cfg = client.Configuration()
    cfg.host, cfg.ssl_ca_cert = k8s.configuration.host, k8s.configuration.ssl_ca_cert
    cfg.api_key = {"authorization": f"Bearer {token}"}
    narrow = client.CoreV1Api(client.ApiClient(cfg))
    deadline = time.monotonic() + 15
    while True:
        try:
            narrow.list_namespaced_pod(namespace)
            break
        except ApiException as exc:
            if exc.status != 403 or time.monotonic() > deadline:
                raise
            time.sleep(0.3)
    with pytest.raises(ApiException) as denied:
        narrow.list_namespaced_secret(namespace)
    assert denied.value.status == 403


# -- Kafka side ------------------------------------------------------------------------------------------
async def read_topic(bootstrap: str, topic: str, settings: Any = None) -> list[dict[str, Any]]:
    """Every record on ``topic`` (JSON values, and the key as ``_key``), read to its end with no group."""
    consumer = kafka_clients.consumer(topic, bootstrap=None if settings else bootstrap, settings=settings,
                                      group_id=None, auto_offset_reset="earliest", enable_auto_commit=False)
    await consumer.start()
    try:
        deadline = time.monotonic() + 30
        while not consumer.assignment():
            assert time.monotonic() < deadline, f"no partitions of {topic} assigned"
            await consumer.getmany(timeout_ms=200)  # the subscription is assigned while fetching
        parts = sorted(consumer.assignment())
        await consumer.seek_to_beginning(*parts)
        end = await consumer.end_offsets(parts)
        out: list[dict[str, Any]] = []
        while [p for p in parts if await consumer.position(p) < end[p]]:
            assert time.monotonic() < deadline, f"could not read {topic} to its end"
            for batch in (await consumer.getmany(*parts, timeout_ms=500)).values():
                out += [{**orjson.loads(r.value), "_key": r.key} for r in batch]
        return out
    finally:
        await consumer.stop()


def fluent_bit(root: Path, node: str, bootstrap: str, pods_topic: str, kube: KubeAccess,
               kernel_topic: str) -> FluentBit:
    return FluentBit(root, node, bootstrap, Render(root=root, kernel_topic=kernel_topic, pods_topic=pods_topic,
                                                   kube=kube.kube))


# -- the tests ---------------------------------------------------------------------------------------------
async def test_pod_lines_reach_the_worker_with_their_pod_and_only_what_the_catalog_says(
    kafka_bootstrap: str, worker_prefix: str, kube_access: KubeAccess, tmp_path: Path
) -> None:
    topics = TopicNames(prefix=worker_prefix)
    ns, node = kube_access.namespace, kube_access.node
    # Under a dot-leading folder with a space, as the demo's default state directory (~/.cache/...) has: the
    # kubernetes filter matches only if its kube_tag_prefix is the tag the real tail input gives these files.
    fb = fluent_bit(tmp_path / ".state dir" / "fb", node, kafka_bootstrap, topics.name("logs_pods"), kube_access,
                    topics.name("logs_kernel")).start()
    noise = NOISE[:6]
    try:
        # trainer-0: noise around the ECC line, which the runtime wrote in two pieces (P, then its F end).
        head, tail = ECC[:27], ECC[27:]
        fb.write(log_name("trainer-0", ns, "main"), *(cri(n, "stdout") for n in noise[:3]),
                 cri(head, tag="P"), cri(tail), *(cri(n, "stdout") for n in noise[3:]), folder="containers")
        # trainer-1: sympathetic NCCL lines only, then the sentinel.
        fb.write(log_name("trainer-1", ns, "main"), *(cri(n) for n in NCCL), cri(noise[0], "stdout"),
                 cri(SENTINEL), folder="containers")
        expected = {ECC, *NCCL, SENTINEL}
        async with Pipeline(kafka_bootstrap, worker_prefix) as pipe:
            def events() -> list[dict[str, Any]]:
                return [e for e in pipe.seen["fault_events"] if e.get("node") == node]

            def done() -> bool:
                assert fb.alive(), f"Fluent Bit exited:\n{fb.log_tail()}"
                lines = {e.get("line") for e in events()}
                sentinel_out = any(i.get("type") == "incident" and i.get("signature", "").startswith(
                    "pod_error:application") for i in pipe.incidents(node))
                return expected <= lines and sentinel_out

            try:
                await pipe.wait_for(done, 120, "the pod lines' fault events and the sentinel's incident")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\nevents: {events()}\ndead letters: {pipe.seen['deadletter'][-3:]}\n"
                                     f"Fluent Bit:\n{fb.log_tail()}") from None
            await pipe.poll()

            # Every event names the pod, namespace and container its line came from (the file name, resolved
            # by the kubernetes filter); the partial ECC line arrived whole, once.
            by_line = {e["line"]: e for e in events()}
            assert len(events()) == len(expected), events()
            for line, pod in ((ECC, "trainer-0"), (NCCL[0], "trainer-1"), (NCCL[1], "trainer-1"),
                              (SENTINEL, "trainer-1")):
                e = by_line[line]
                assert (e["namespace"], e["pod"], e["container"]) == (ns, pod, "main"), e
                assert e["kind"] == "pod_error" and e["source"] == "pod"
            assert by_line[ECC]["grade"] == "hardware"
            assert {by_line[n]["grade"] for n in NCCL} == {"sympathetic"}

            # The hardware-grade line opens what the catalog says (pod_hardware: RESTART_APP, error, no
            # quarantine); the sympathetic NCCL lines alone open nothing.
            incidents = [i for i in pipe.incidents(node) if i.get("type") == "incident"]
            hw = [i for i in incidents if i["signature"].startswith("pod_error:hardware")]
            assert len(hw) == 1, incidents
            assert (hw[0]["action"], hw[0]["severity"]) == ("RESTART_APP", "error"), hw[0]
            assert by_line[ECC]["id"] in hw[0]["evidence_ids"]
            nccl_ids = {by_line[n]["id"] for n in NCCL}
            assert not [i for i in incidents if i["signature"].startswith("pod_error:sympathetic")], incidents
            assert not [i for i in incidents if nccl_ids & set(i.get("evidence_ids", []))], incidents
            assert {i["action"] for i in incidents} == {"RESTART_APP"}, incidents  # nothing quarantines
            assert not [d for d in pipe.seen["deadletter"] if node in str(d)]
    finally:
        fb.stop()

    # What Fluent Bit put on the raw topic: the four fault lines with the API server's pod metadata (uid and
    # node come only from the lookup), keyed by node, and none of the noise.
    raw = [r for r in await read_topic(kafka_bootstrap, topics.name("logs_pods")) if r.get("node") == node]
    assert sorted(r["log"] for r in raw) == sorted(expected), [r["log"] for r in raw]
    for r in raw:
        assert r["_key"] == node.encode()
        k = r["kubernetes"]
        assert k["namespace_name"] == ns and k["container_name"] == "main"
        assert k["pod_id"] == kube_access.pods[k["pod_name"]], k
        assert k["host"] == node, k
    assert not {n for n in noise if any(n in r["log"] for r in raw)}


def pod_corpus_lines() -> tuple[list[str], list[str]]:
    """(every pod-signal fault line of the corpus, its lines that are no signal)."""
    faults, quiet = [], []
    for case in yaml.safe_load(POD_CORPUS.read_text())["cases"]:
        flagged = {e["line"] for e in case["expect"] if e.get("kind") == "pod_error"}
        for n, line in enumerate(case["lines"], 1):
            (faults if n in flagged else quiet).append(line)
    return faults, quiet


async def test_the_prefilter_as_onigmo_runs_it_keeps_every_pod_fault_and_drops_the_noise(
    kafka_bootstrap: str, kube_access: KubeAccess, tmp_path: Path
) -> None:
    faults, corpus_quiet = pod_corpus_lines()
    assert len(faults) >= 20 and all(match_pod_signal(f) for f in faults if "NCCL INFO" not in f)
    tag = uuid.uuid4().hex[:6]
    topics = TopicNames(prefix=f"t-fbonig-{tag}-")
    await ensure_topics(kafka_bootstrap, [topics.name("logs_pods"), topics.name("logs_kernel")], 1)
    fb = fluent_bit(tmp_path / "fb", kube_access.node, kafka_bootstrap, topics.name("logs_pods"), kube_access,
                    topics.name("logs_kernel"))
    sent = faults + NOISE + corpus_quiet
    shipped = next(f for f in load_shipped()["pipeline"]["filters"] if f["name"] == "grep" and f["match"] == "kube.*")
    field, regex = shipped["regex"].split(" ", 1)
    assert field == "log"
    python_kept = [line for line in sent if re.search(regex, line)]
    fb.write(log_name("corpus-0", kube_access.namespace, "main"), *(cri(line) for line in sent), folder="containers")
    fb.start()  # read from the head: the whole file is there before Fluent Bit starts
    try:
        fb.wait_delivered(len(faults), timeout=90)
        await asyncio.sleep(3)  # anything more would have been flushed by now (flush: 1 s)
        delivered = fb.output_records()
    finally:
        fb.stop()
    got = [r["log"] for r in await read_topic(kafka_bootstrap, topics.name("logs_pods"))]
    assert sorted(set(faults) - set(got)) == [], "pod faults the real prefilter dropped"
    assert sorted(set(NOISE) & set(got)) == [], "noise the real prefilter let through"
    assert len(got) == len(set(got)) == delivered
    # Onigmo and Python's re agree on every line sent (the unit tests check the regex with Python's re).
    assert sorted(got) == sorted(python_kept)
