"""The secured local broker (SASL_SSL, SCRAM-SHA-512, StandardAuthorizer with the ACL table) and proof of origin.

A private SASL_SSL cluster per module; every client authenticates as one component's principal.
The end-to-end test runs a real ``xidflow worker`` and a real ``xidflow actuator`` process, each with
its own credentials, against it and the session's kube-apiserver.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka.errors import KafkaError, TopicAuthorizationFailedError

from pipeline.actuator.kube import Kube
from pipeline.actuator.requests import RescueAction, RescueActionRequest
from pipeline.actuator.signing import Signer, SigningSettings
from pipeline.actuator.testing import create_nodes, delete_nodes
from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.admin import ensure_topics
from pipeline.localinfra import procs
from pipeline.localinfra.kafka import ADMIN_USER, KafkaCluster
from pipeline.localinfra.loki import LokiServer, push_lines
from pipeline.runtime.settings import KafkaSettings, TopicNames
from schemas.records import RemediationRecord

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
T = TopicNames(prefix="")
XID79 = "NVRM: Xid (PCI:0000:4e:00): 79, pid=1234, name=python3, GPU has fallen off the bus."


async def produce(settings: KafkaSettings, topic: str, value: bytes, key: bytes,
                  headers: list[tuple[str, bytes]] | None = None) -> None:
    producer = kafka_clients.producer(settings=settings, acks="all", request_timeout_ms=15000)
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=key, headers=headers)
    finally:
        await producer.stop()


async def read_all(settings: KafkaSettings, topic: str) -> list[bytes]:
    consumer = kafka_clients.consumer(topic, settings=settings, auto_offset_reset="earliest", group_id=None,
                                      enable_auto_commit=False)
    await consumer.start()
    try:
        out: list[bytes] = []
        while True:
            batch = await consumer.getmany(timeout_ms=1500)
            if not batch:
                return out
            out += [m.value for msgs in batch.values() for m in msgs]
    finally:
        await consumer.stop()


@pytest.mark.parametrize("how", ["plaintext", "tls-without-sasl", "wrong-password"])
def test_a_client_without_valid_credentials_is_refused(secured: KafkaCluster, how: str, tmp_path: Path) -> None:
    if how == "plaintext":
        settings = KafkaSettings(bootstrap_servers=secured.bootstrap)
    elif how == "tls-without-sasl":
        settings = KafkaSettings(bootstrap_servers=secured.bootstrap, security_protocol="SSL",
                                 ssl_cafile=secured.ca_file)
    else:
        env = secured.client_env("xidflow-worker")
        (tmp_path / "pw").write_text("not-the-password")
        settings = KafkaSettings(**{**env, "KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "pw")})

    async def attempt() -> None:
        producer = kafka_clients.producer(settings=settings, request_timeout_ms=5000)
        try:
            await producer.start()
            await producer.send_and_wait(T.name("logs_kernel"), b"x", key=b"n")
        finally:
            await producer.stop()

    with pytest.raises((KafkaError, OSError)):
        asyncio.run(asyncio.wait_for(attempt(), 60))


def test_the_worker_cannot_write_rescue_requests(secured: KafkaCluster) -> None:
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(produce(secured.client_settings("xidflow-worker"), T.name("remediation_requests"), b"{}", b"n"))


def test_a_shipper_writes_raw_lines_but_not_incidents(secured: KafkaCluster) -> None:
    shipper = secured.client_settings("xidflow-shipper")
    asyncio.run(produce(shipper, T.name("logs_kernel"), b"allowed", b"n"))
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(produce(shipper, T.name("incidents"), b"{}", b"n"))


def test_a_reader_reads_outputs_and_writes_nothing(secured: KafkaCluster) -> None:
    reader = secured.client_settings("xidflow-reader")
    asyncio.run(read_all(reader, T.name("remediation_audit")))
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(produce(reader, T.name("remediation_audit"), b"{}", b"n"))


# -- end to end: worker + actuator processes, each with its own principal ---------------------
class Proc:
    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        with log.open("wb") as f:
            self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, env=env,
                                         stdout=f, stderr=subprocess.STDOUT)
        self.log = log

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        procs.terminate(self.proc)


class World:
    def __init__(self, cluster: KafkaCluster, kubeconfig: str, unique: Callable[[str], str], logs: Path) -> None:
        self.cluster, self.kubeconfig, self.unique, self.logs = cluster, kubeconfig, unique, logs
        self.tag = unique("fleet")
        self.selector = f"xidflow.test/fleet={self.tag}"
        self.kube = Kube.from_config(kubeconfig, 8)
        self.nodes: list[str] = []
        self.free: list[str] = []
        self.procs: list[Proc] = []

    def env(self, user: str, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "XIDFLOW_"))}
        return {**base, **self.cluster.client_env(user), **extra,
                "XIDFLOW_SIGNING_KEY_FILE": str(self.cluster.signing_key_file)}

    def start(self) -> None:
        self.procs.append(Proc(["worker", "--partitions", "4", "--session-timeout", "6", "--loglevel", "warning"],
                               self.env("xidflow-worker", XIDFLOW_WORKER_TICK_INTERVAL_S="1",
                                        XIDFLOW_PARSE_POLL_TIMEOUT_MS="20"), self.logs / "worker.log"))
        self.procs.append(Proc(["actuator", "--log-level", "WARNING"], self.env(
            "xidflow-actuator", KUBECONFIG=self.kubeconfig, XIDFLOW_ACTUATOR_GPU_NODE_SELECTOR=self.selector,
            XIDFLOW_ACTUATOR_NAMESPACE=self.unique("ns"), XIDFLOW_ACTUATOR_POLICY_SOURCE="file",
            XIDFLOW_ACTUATOR_BREAKER_MAX_SHARE="1.0"), self.logs / "actuator.log"))

    async def make_nodes(self, count: int) -> None:
        """The fleet exists before the actuator starts (its breaker counts the fleet it saw)."""
        names = [self.unique("gpu") for _ in range(count)]
        await create_nodes(self.kube, names, {"xidflow.test/fleet": self.tag})
        self.nodes += names
        self.free = list(names)

    def take(self) -> str:
        return self.free.pop()

    async def cordoned(self, name: str) -> bool:
        return bool((await self.kube.get_node(name))["spec"].get("unschedulable"))

    async def wait(self, what: Callable[[], Any], within_s: float, message: str) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            for p in self.procs:
                assert p.alive(), f"{p.log.name} exited:\n{p.tail()}"
            if await what():
                return
            await asyncio.sleep(0.5)
        raise AssertionError(message + "\n" + "\n".join(f"--- {p.log.name}\n{p.tail()}" for p in self.procs))

    async def audit(self) -> list[RemediationRecord]:
        values = await read_all(self.cluster.client_settings("xidflow-reader"), T.name("remediation_audit"))
        return [RemediationRecord.model_validate(orjson.loads(v)) for v in values]

    async def close(self) -> None:
        for p in self.procs:
            p.stop()
        await delete_nodes(self.kube, self.nodes)


@pytest.fixture(scope="module")
def world(secured: KafkaCluster, kubeconfig: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    counter = iter(range(1000))

    def unique(prefix: str) -> str:
        return f"{prefix}-sec-{uuid.uuid4().hex[:6]}-{next(counter)}"

    w = World(secured, kubeconfig, unique, tmp_path_factory.mktemp("secured-procs"))
    asyncio.run(w.make_nodes(8))
    w.start()
    yield w
    asyncio.run(w.close())


def kmsg(node: str, line: str) -> bytes:
    return orjson.dumps({"priority": 3, "sec": 5, "usec": 0, "msg": line, "hostname": node, "@timestamp": time.time()})


def test_the_pipeline_runs_end_to_end_on_the_secured_broker(world: World) -> None:
    async def scenario() -> None:
        node = world.take()
        shipper = world.cluster.client_settings("xidflow-shipper")

        async def ship_and_check() -> bool:  # the worker may still be joining its group: keep shipping
            await produce(shipper, T.name("logs_kernel"), kmsg(node, XID79), node.encode())
            return await world.cordoned(node)

        await world.wait(ship_and_check, 180, f"{node} was not cordoned through the secured pipeline")

    asyncio.run(scenario())


def request(node: str, request_id: str) -> RescueActionRequest:
    now = datetime.now(UTC)
    return RescueActionRequest(request_id=request_id, node_name=node, xid=79, escalate_time=now, received_at=now,
                               requested_by="ops", actions=[RescueAction(name="cordon")])


def test_a_forged_request_does_nothing_and_is_audited_while_a_signed_one_acts(world: World) -> None:
    async def scenario() -> None:
        forged_node, signed_node = world.take(), world.take()
        admin = world.cluster.client_settings(ADMIN_USER)  # a misconfigured ACL: anyone could write requests
        forged = request(forged_node, f"forged-{uuid.uuid4().hex[:6]}")
        await produce(admin, T.name("remediation_requests"), forged.to_bytes(), forged_node.encode())
        signer = Signer.from_settings(SigningSettings(key_file=world.cluster.signing_key_file))
        genuine = request(signed_node, f"signed-{uuid.uuid4().hex[:6]}")
        value, key = genuine.to_bytes(), signed_node.encode()
        await produce(world.cluster.client_settings("xidflow-api"), T.name("remediation_requests"), value, key,
                      headers=signer.headers(key, value))

        async def refused_audited() -> bool:
            return any(r.node == forged_node and r.reason.startswith("refused: unsigned") for r in await world.audit())

        await world.wait(refused_audited, 90, "the forged request was not audited as refused")
        try:
            await world.wait(lambda: world.cordoned(signed_node), 90, "the signed request was not carried out")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\naudit: {[r for r in await world.audit() if r.node == signed_node]}") from None
        assert not await world.cordoned(forged_node), "a forged request cordoned a node"
        refused = [r for r in await world.audit() if r.node == forged_node]
        assert refused and all(r.action == "rescue-request" and r.details["request_id"] == forged.request_id
                               for r in refused)

    asyncio.run(scenario())


def test_local_up_with_sasl_ssl_prints_working_admin_credentials(kubeconfig: str, tmp_path: Path) -> None:
    """`xidflow local up --kafka-security sasl_ssl` then `local env`: the printed variables authenticate."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "XIDFLOW_"))}
    env = {**base, "KUBECONFIG": kubeconfig, "XIDFLOW_NO_DOCKER": "1"}
    state = tmp_path / "state"

    def cli(*args: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "local", *args, "--state-dir", str(state)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    try:
        cli("up", "--kafka-security", "sasl_ssl")
        printed = dict(line.removeprefix("export ").split("=", 1) for line in cli("env").splitlines())
        assert printed["KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL" and printed["KAFKA_SASL_USERNAME"] == "admin"
        assert Path(printed["KAFKA_SSL_CAFILE"]).is_file() and Path(printed["XIDFLOW_SIGNING_KEY_FILE"]).is_file()
        settings = KafkaSettings(**{k: v for k, v in printed.items() if k.startswith("KAFKA_")})

        async def round_trip() -> None:
            await ensure_topics(settings.bootstrap_servers, ["local-env-check"], 1, settings=settings)
            await produce(settings, "local-env-check", b"ok", b"k")

        asyncio.run(round_trip())
        # Without the printed credentials the same broker refuses.
        with pytest.raises((KafkaError, OSError)):
            asyncio.run(asyncio.wait_for(
                produce(KafkaSettings(bootstrap_servers=settings.bootstrap_servers), "local-env-check", b"x", b"k"),
                60))
    finally:
        subprocess.run([sys.executable, "-m", "pipeline.cli", "local", "down", "--state-dir", str(state)],
                       cwd=REPO, env=env, capture_output=True, timeout=120)


# -- OAUTHBEARER against a real broker (Kafka's unsecured JWT validator: checks form, sub and exp) -----
def unsecured_jwt(sub: str, exp: float) -> str:
    import base64

    def b64(d: dict) -> str:
        return base64.urlsafe_b64encode(orjson.dumps(d)).decode().rstrip("=")

    return f"{b64({'alg': 'none'})}.{b64({'sub': sub, 'iat': int(time.time()) - 5, 'exp': int(exp)})}."


@pytest.fixture(scope="module")
def oauth_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    cluster = KafkaCluster(tmp_path_factory.mktemp("kafka-oauth"), security="oauth_unsecured_test",
                           log=lambda m: print(f"[oauth-kafka] {m}", flush=True))
    try:
        cluster.start()
    except Exception as exc:  # noqa: BLE001
        cluster.stop()
        pytest.fail(f"OAUTHBEARER Kafka could not start: {exc}", pytrace=False)
    yield cluster
    cluster.stop()


def test_oauthbearer_tokens_from_a_file_and_a_command(oauth_cluster: KafkaCluster, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(unsecured_jwt("xidflow-probe", time.time() + 600))
    by_file = KafkaSettings(bootstrap_servers=oauth_cluster.bootstrap, security_protocol="SASL_PLAINTEXT",
                            sasl_mechanism="OAUTHBEARER", sasl_oauth_token_file=token_file)
    command = f"echo '{{\"token\": \"{unsecured_jwt('xidflow-api', time.time() + 600)}\", \"expires_in\": 600}}'"
    by_command = by_file.model_copy(update={"sasl_oauth_token_file": None, "sasl_oauth_token_command": command})

    async def round_trip() -> None:
        await ensure_topics(oauth_cluster.bootstrap, ["oauth-check"], 1, settings=by_file)
        await produce(by_file, "oauth-check", b"from-file", b"k")
        await produce(by_command, "oauth-check", b"from-command", b"k")
        assert set(await read_all(by_command, "oauth-check")) == {b"from-file", b"from-command"}

    asyncio.run(round_trip())


def test_oauthbearer_an_expired_token_is_refused_by_the_broker(oauth_cluster: KafkaCluster, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(unsecured_jwt("xidflow-probe", time.time() - 60))
    expired = KafkaSettings(bootstrap_servers=oauth_cluster.bootstrap, security_protocol="SASL_PLAINTEXT",
                            sasl_mechanism="OAUTHBEARER", sasl_oauth_token_file=token_file)
    with pytest.raises((KafkaError, OSError)):
        asyncio.run(asyncio.wait_for(produce(expired, "oauth-check", b"x", b"k"), 60))


# -- The Loki bridge on the secured broker ---------------------------------------------------
def _loki_tail(secured: KafkaCluster, loki: LokiServer, user: str, run: str, start_ns: int,
               log: Path) -> subprocess.Popen:
    """`xidflow loki-tail` as the chart runs it: credentials of ``user`` from the environment."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "XIDFLOW_", "LOKI_"))}
    env = {**base, **secured.client_env(user), "LOKI_URL": loki.url, "LOKI_ORG_ID": "xidflow"}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "loki-tail", "--query", f'{{job="kmsg", run="{run}"}}',
             "--start-ns", str(start_ns)], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


@pytest.mark.parametrize("user", ["xidflow-loki-tail", "xidflow-shipper"])
def test_loki_tail_restarted_on_the_secured_broker_goes_on_shipping(
    secured: KafkaCluster, loki: LokiServer, tmp_path: Path, user: str
) -> None:
    """A restarted bridge scans its topic for where it was. Its own principal may (nothing re-sent, its
    dead letters written); the Fluent Bit principal may only write, and the bridge must still ship then
    (it starts from ``--start-ns`` and says why), never exit at every start."""

    run, log = uuid.uuid4().hex[:8], tmp_path / "loki-tail.log"
    node = f"n-{run}"
    admin = secured.client_settings(ADMIN_USER)
    start_ns = time.time_ns() - 10**9

    def push(line: str, labels: dict[str, str] | None = None) -> None:
        push_lines(loki.url, labels or {"job": "kmsg", "run": run, "node": node}, [(time.time_ns(), line)])

    async def lines_of_run() -> list[str]:
        out = []
        for value in await read_all(admin, T.name("logs_kernel")):
            if not value.startswith(b"{"):  # this module's other tests write plain lines to the topic
                continue
            for stream in orjson.loads(value).get("streams", []):  # the bridge writes Loki push bodies
                if stream["stream"].get("run") == run:
                    out += [line for _, line in stream["values"]]
        return out

    def wait_for(expected: int, proc: subprocess.Popen, what: str) -> list[str]:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"loki-tail exited ({proc.returncode}) {what}:\n{log.read_text()[-3000:]}"
            got = asyncio.run(lines_of_run())
            if len(got) >= expected:
                return got
            time.sleep(1)
        raise AssertionError(f"{what}: fewer than {expected} lines of run {run} on the topic\n"
                             f"{log.read_text()[-3000:]}")

    first = _loki_tail(secured, loki, user, run, start_ns, log)
    try:
        time.sleep(3)  # connected to Loki's tail
        push(f"first line {run}")
        wait_for(1, first, "before the restart")
    finally:
        first.kill()
        first.wait(30)
    push(f"second line {run}")
    second = _loki_tail(secured, loki, user, run, start_ns, log)
    try:
        got = wait_for(2, second, "after the restart")
        assert any("second line" in g for g in got), got
        time.sleep(3)  # anything re-sent would be on the topic by now
        got = asyncio.run(lines_of_run())
        if user == "xidflow-loki-tail":
            assert sorted(got) == sorted(set(got)) and len(got) == 2, f"re-sent after the resume scan: {got}"
            assert "resuming tail" in log.read_text()
            push("a line of a stream with no node label", {"job": "kmsg", "run": run})
            deadline = time.monotonic() + 60
            while not any(run.encode() in v for v in asyncio.run(read_all(admin, T.name("deadletter")))):
                assert time.monotonic() < deadline, f"no dead letter for the unlabelled line\n{log.read_text()[-3000:]}"
                assert second.poll() is None, log.read_text()[-3000:]
                time.sleep(1)
        else:
            text = log.read_text()
            assert "may not read" in text and T.name("logs_kernel") in text, text[-3000:]
        assert second.poll() is None, log.read_text()[-3000:]
    finally:
        second.terminate()
        second.wait(30)
