"""A real Apache Kafka cluster in KRaft mode on loopback: one broker, or N for failure tests.

Every node is a combined broker+controller (``process.roles=broker,controller``) with a static
controller quorum, so a 3-node cluster survives the loss of one node like a production one.

One module (about 450 lines) on purpose: a cluster's configuration, start, readiness and stop are one
lifecycle that the tests start and tear down as a whole; each part reads the state the others write.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
import secrets
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pipeline.kafka.acls import principals
from pipeline.localinfra import procs
from pipeline.localinfra.controlplane import _cert, _write_key
from pipeline.localinfra.install import KafkaDist, Log, ensure_kafka
from pipeline.runtime.settings import KafkaSettings

LOG4J2 = """\
status = warn
appender.file.type = Console
appender.file.name = STDOUT
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.stdout.ref = STDOUT
logger.kafka.name = kafka
logger.kafka.level = WARN
logger.apache.name = org.apache.kafka
logger.apache.level = WARN
logger.started.name = kafka.server.KafkaRaftServer
logger.started.level = INFO
"""

STARTED_MARK = "Kafka Server started"

# "oauth_unsecured_test": SASL_PLAINTEXT + OAUTHBEARER with Kafka's *unsecured* JWT validator (any
# well-formed unsigned token with sub and exp passes) -- for testing OAUTHBEARER clients, never a real setup.
SECURITY_MODES = ("plaintext", "sasl_ssl", "oauth_unsecured_test")
ADMIN_USER = "admin"
BROKER_CN = "xidflow-kafka-broker"

# Applies the ACL table through the Admin API in one JVM (java's single-file source launcher).
ACL_TOOL = """\
import java.nio.file.*;
import java.util.*;
import org.apache.kafka.clients.admin.*;
import org.apache.kafka.common.acl.*;
import org.apache.kafka.common.resource.*;

public class AclTool {
  public static void main(String[] a) throws Exception {
    Properties p = new Properties();
    try (var r = Files.newBufferedReader(Path.of(a[0]))) { p.load(r); }
    List<AclBinding> bindings = new ArrayList<>();
    for (String line : Files.readAllLines(Path.of(a[1]))) {
      if (line.isBlank()) continue;
      String[] f = line.split("\\t");
      ResourcePattern rp = new ResourcePattern(ResourceType.valueOf(f[1]), f[3], PatternType.valueOf(f[2]));
      bindings.add(new AclBinding(rp, new AccessControlEntry(f[0], "*", AclOperation.valueOf(f[4]),
          AclPermissionType.ALLOW)));
    }
    try (Admin admin = Admin.create(p)) { admin.createAcls(bindings).all().get(); }
    System.out.println("created " + bindings.size() + " ACL bindings");
  }
}
"""


def _upper_snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


def acl_spec_lines() -> list[str]:
    """The ACL table as AclTool input: principal, resource type, pattern type, name, operation."""
    pattern = {"literal": "LITERAL", "prefix": "PREFIXED"}
    return [
        "\t".join((f"User:{p.user}", a.resource_type.upper(), pattern[a.pattern], a.name, _upper_snake(a.operation)))
        for p in principals() for a in p.acls
    ]


@dataclass
class KafkaNode:
    node_id: int
    port: int
    controller_port: int
    pid: int | None = None


def new_cluster_id() -> str:
    """A KRaft cluster id: a random UUID in URL-safe base64, never starting with '-'.

    The storage tool would read a leading '-' as an option (Kafka's own ``Uuid.randomUuid`` avoids it too);
    one id in 64 would make the format fail.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


@dataclass
class KafkaCluster:
    """A local Kafka cluster rooted at ``root`` (configs, data, logs).

    ``KafkaCluster(root, brokers=3).start()`` then ``.bootstrap``; ``stop_broker(i)`` and
    ``start_broker(i)`` for failure tests; ``stop()`` leaves no process or port behind.
    """

    root: Path
    brokers: int = 1
    cluster_id: str = ""
    nodes: list[KafkaNode] = field(default_factory=list)
    heap: str = "512m"
    security: str = "plaintext"  # or "sasl_ssl": SCRAM-SHA-512 over TLS, StandardAuthorizer, per-component users
    log: Log = field(default=print, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.brokers < 1:
            raise ValueError(f"brokers must be >= 1, got {self.brokers}")
        if self.security not in SECURITY_MODES:
            raise ValueError(f"security must be one of {SECURITY_MODES}, got {self.security!r}")
        if not self.nodes:
            self.nodes = [
                KafkaNode(node_id=i + 1, port=procs.free_port(), controller_port=procs.free_port())
                for i in range(self.brokers)
            ]
        if not self.cluster_id:
            self.cluster_id = new_cluster_id()

    # -- state -----------------------------------------------------------------------------
    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def to_dict(self) -> dict:
        return procs.state_dict(self)

    @classmethod
    def from_dict(cls, d: dict, log: Log = print) -> KafkaCluster:
        nodes = [KafkaNode(**n) for n in d["nodes"]]
        return cls(root=Path(d["root"]), brokers=d["brokers"], cluster_id=d["cluster_id"],
                   nodes=nodes, heap=d.get("heap", "512m"), security=d.get("security", "plaintext"), log=log)

    # -- security (sasl_ssl) ---------------------------------------------------------------
    @property
    def secured(self) -> bool:
        return self.security == "sasl_ssl"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def ca_file(self) -> Path:
        return self.pki / "ca.crt"

    @property
    def users(self) -> list[str]:
        """The admin (super user) and one SCRAM user per component of the ACL table."""
        return [ADMIN_USER, *(p.user for p in principals())]

    def password_file(self, user: str) -> Path:
        return self.root / "users" / f"{user}.password"

    def client_env(self, user: str = ADMIN_USER) -> dict[str, str]:
        """Environment variables (the ``KafkaSettings`` ones) for ``user``; only bootstrap when plaintext."""
        env = {"KAFKA_BOOTSTRAP_SERVERS": self.bootstrap}
        if self.secured:
            env.update(KAFKA_SECURITY_PROTOCOL="SASL_SSL", KAFKA_SASL_MECHANISM="SCRAM-SHA-512",
                       KAFKA_SASL_USERNAME=user, KAFKA_SASL_PASSWORD_FILE=str(self.password_file(user)),
                       KAFKA_SSL_CAFILE=str(self.ca_file))
        return env

    @property
    def signing_key_file(self) -> Path:
        return self.root / "users" / "signing.key"

    def local_env(self) -> dict[str, str]:
        """What `xidflow local env` prints: the admin's Kafka settings and the rescue-request signing key."""
        env = self.client_env(ADMIN_USER)
        if self.secured:
            env["XIDFLOW_SIGNING_KEY_FILE"] = str(self.signing_key_file)
        return env

    def client_settings(self, user: str = ADMIN_USER) -> KafkaSettings:
        return KafkaSettings(**self.client_env(user))

    def _write_secrets(self) -> None:
        """CA, the brokers' certificate (server and client use: the controller listener is mTLS) and passwords."""
        if (self.pki / ".complete").exists():
            return
        self.pki.mkdir(parents=True, exist_ok=True)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "xidflow-local-kafka-ca")])
        ca = _cert(ca_name, ca_name, ca_key.public_key(), ca_key, ca=True)
        _write_key(self.pki / "ca.key", ca_key)
        ca_pem = ca.public_bytes(serialization.Encoding.PEM)
        self.ca_file.write_bytes(ca_pem)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, BROKER_CN)]), ca_name, key.public_key(), ca_key,
            ca=False, usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
            sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        )
        keystore = self.pki / "broker.pem"
        keystore.write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption())
            + cert.public_bytes(serialization.Encoding.PEM) + ca_pem
        )
        keystore.chmod(0o600)
        users = self.root / "users"
        users.mkdir(parents=True, exist_ok=True)
        for user in self.users:
            path = self.password_file(user)
            path.write_text(secrets.token_urlsafe(24))
            path.chmod(0o600)
        self.signing_key_file.write_text(secrets.token_urlsafe(32) + "\n")
        self.signing_key_file.chmod(0o600)
        (self.pki / ".complete").write_text("ok")

    def _jaas(self, user: str) -> str:
        pw = self.password_file(user).read_text()
        return f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{user}" password="{pw}";'

    def _security_properties(self) -> dict[str, object]:
        return {
            "listener.security.protocol.map": "SASL_SSL:SASL_SSL,CONTROLLER:SSL",
            "inter.broker.listener.name": "SASL_SSL",
            "sasl.enabled.mechanisms": "SCRAM-SHA-512",
            "sasl.mechanism.inter.broker.protocol": "SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": self._jaas(ADMIN_USER),
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": self.pki / "broker.pem",
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": self.ca_file,
            # Only a holder of a certificate from this CA (the brokers) reaches the controllers.
            "listener.name.controller.ssl.client.auth": "required",
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{ADMIN_USER};User:CN={BROKER_CN}",
            "allow.everyone.if.no.acl.found": "false",
        }

    def _admin_properties(self) -> Path:
        path = self.root / "admin-client.properties"
        lines = {
            "bootstrap.servers": self.bootstrap,
            "security.protocol": "SASL_SSL",
            "sasl.mechanism": "SCRAM-SHA-512",
            "sasl.jaas.config": self._jaas(ADMIN_USER),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": self.ca_file,
        }
        path.write_text("".join(f"{k}={v}\n" for k, v in lines.items()))
        path.chmod(0o600)
        return path

    def _apply_acls(self, dist: KafkaDist) -> None:
        marker = self.root / "acls.applied"
        if marker.exists():
            return
        tool, spec = self.root / "AclTool.java", self.root / "acls.tsv"
        tool.write_text(ACL_TOOL)
        spec.write_text("\n".join(acl_spec_lines()) + "\n")
        java = shutil.which("java") or "java"
        proc = subprocess.run(
            [java, "-Xmx256m", f"-Dlog4j2.configurationFile={self._dir(self.nodes[0]) / 'log4j2.properties'}",
             "-cp", dist.classpath, str(tool), str(self._admin_properties()), str(spec)],
            capture_output=True, text=True, cwd=self.root, timeout=180,
        )
        if proc.returncode != 0:
            raise procs.StartError(f"applying Kafka ACLs failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
        marker.write_text(proc.stdout)
        self.log(f"Kafka: {proc.stdout.strip()} for {len(self.users) - 1} component users")

    def _node(self, node_id: int) -> KafkaNode:
        for n in self.nodes:
            if n.node_id == node_id:
                return n
        raise KeyError(f"no Kafka node {node_id}; nodes are {[n.node_id for n in self.nodes]}")

    def _dir(self, node: KafkaNode) -> Path:
        return self.root / f"kafka-{node.node_id}"

    def log_file(self, node_id: int) -> Path:
        return self._dir(self._node(node_id)) / "server.log"

    # -- configuration ---------------------------------------------------------------------
    def _properties(self, node: KafkaNode) -> str:
        rf = min(3, len(self.nodes))
        min_isr = 2 if rf >= 3 else 1
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes)
        listener = {"sasl_ssl": "SASL_SSL", "oauth_unsecured_test": "SASL_PLAINTEXT"}.get(self.security, "PLAINTEXT")
        lines: dict[str, object] = {
            "process.roles": "broker,controller",
            "node.id": node.node_id,
            "controller.quorum.voters": voters,
            "listeners": f"{listener}://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}",
            "advertised.listeners": f"{listener}://127.0.0.1:{node.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": self._dir(node) / "data",
            "num.partitions": 1,
            "default.replication.factor": rf,
            "min.insync.replicas": min_isr,
            "offsets.topic.replication.factor": rf,
            "offsets.topic.num.partitions": 8,
            "transaction.state.log.replication.factor": rf,
            "transaction.state.log.min.isr": min_isr,
            "transaction.state.log.num.partitions": 4,
            "share.coordinator.state.topic.replication.factor": rf,
            "share.coordinator.state.topic.min.isr": min_isr,
            "group.initial.rebalance.delay.ms": 0,
            "auto.create.topics.enable": "true",
            "delete.topic.enable": "true",
            "log.retention.hours": 24,
            "log.segment.bytes": 64 * 1024 * 1024,
            "unclean.leader.election.enable": "false",
        }
        if self.secured:
            lines.update(self._security_properties())
        elif self.security == "oauth_unsecured_test":
            lines.update({
                "listener.security.protocol.map": "SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT",
                "inter.broker.listener.name": "SASL_PLAINTEXT",
                "sasl.enabled.mechanisms": "OAUTHBEARER",
                "sasl.mechanism.inter.broker.protocol": "OAUTHBEARER",
                "listener.name.sasl_plaintext.oauthbearer.sasl.jaas.config":
                    "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule required "
                    'unsecuredLoginStringClaim_sub="broker";',
            })
        return "".join(f"{k}={v}\n" for k, v in lines.items())

    def _java(self, dist: KafkaDist, node: KafkaNode, main: str, *args: str) -> list[str]:
        java = shutil.which("java")
        if not java:
            raise procs.StartError("'java' is not on PATH; install Java 17")
        d = self._dir(node)
        return [
            java, f"-Xmx{self.heap}", "-Xms128m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true", f"-Dlog4j2.configurationFile={d / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={d / 'logs'}", "-cp", dist.classpath, main, *args,
        ]

    def _prepare(self, dist: KafkaDist, node: KafkaNode) -> None:
        d = self._dir(node)
        d.mkdir(parents=True, exist_ok=True)
        if self.secured:
            self._write_secrets()
        (d / "server.properties").write_text(self._properties(node))
        (d / "log4j2.properties").write_text(LOG4J2)
        if (d / "data" / "meta.properties").exists():
            return
        scram = []
        for user in self.users if self.secured else []:  # SCRAM credentials go into the metadata at format time
            scram += ["--add-scram", f"SCRAM-SHA-512=[name={user},password={self.password_file(user).read_text()}]"]
        cmd = self._java(dist, node, "kafka.tools.StorageTool", "format", "-t", self.cluster_id,
                         "-c", str(d / "server.properties"), "--ignore-formatted", *scram)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=d)
        if proc.returncode != 0:
            raise procs.StartError(
                f"formatting Kafka storage for node {node.node_id} failed:\n{proc.stdout}{proc.stderr}"
            )

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 90.0) -> KafkaCluster:
        dist = ensure_kafka(self.log)
        for node in self.nodes:
            self._prepare(dist, node)
        for node in self.nodes:
            self._launch(dist, node)
        for node in self.nodes:
            self._await(node, timeout)
        if self.secured:
            self._apply_acls(dist)
        return self

    def _launch(self, dist: KafkaDist, node: KafkaNode) -> None:
        if procs.alive(node.pid, str(self.root)):
            return
        for port in (node.port, node.controller_port):
            if procs.port_open(port):
                raise procs.StartError(f"Kafka node {node.node_id}: port {port} is already in use")
        d = self._dir(node)
        log_file = d / "server.log"
        # Mark where this start begins so readiness is judged on this run's lines only.
        with open(log_file, "a") as f:
            f.write(f"\n=== xidflow start node {node.node_id} ===\n")
        node.pid = procs.spawn(
            self._java(dist, node, "kafka.Kafka", str(d / "server.properties")), log_file, cwd=d,
            env=dict(os.environ, KAFKA_HEAP_OPTS=""),
        )

    def _await(self, node: KafkaNode, timeout: float) -> None:
        log_file = self._dir(node) / "server.log"

        def ready() -> bool:
            text = log_file.read_text(errors="replace")
            last = text.rsplit("=== xidflow start", 1)[-1]
            return STARTED_MARK in last and procs.port_open(node.port)

        procs.wait_until(ready, timeout, f"Kafka node {node.node_id}", node.pid, log_file, self.log)

    def stop_broker(self, node_id: int, hard: bool = False) -> None:
        """Stop one node (SIGTERM, or SIGKILL with ``hard``) to simulate a broker failure."""
        import signal

        node = self._node(node_id)
        procs.stop(node.pid, sig=signal.SIGKILL if hard else signal.SIGTERM, expect=str(self.root))
        node.pid = None

    def start_broker(self, node_id: int, timeout: float = 90.0) -> None:
        dist = ensure_kafka(self.log)
        node = self._node(node_id)
        self._launch(dist, node)
        self._await(node, timeout)

    def restart(self, timeout: float = 90.0) -> None:
        """Stop every node, then start them again on the same ports and data."""
        for node in self.nodes:
            self.stop_broker(node.node_id)
        dist = ensure_kafka(self.log)
        for node in self.nodes:
            self._launch(dist, node)
        for node in self.nodes:
            self._await(node, timeout)

    def stop(self) -> None:
        for node in self.nodes:
            procs.stop(node.pid, expect=str(self.root))
            node.pid = None

    def running(self) -> dict[int, bool]:
        return {n.node_id: procs.alive(n.pid, str(self.root)) and procs.port_open(n.port) for n in self.nodes}
