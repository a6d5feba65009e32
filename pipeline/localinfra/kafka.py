"""A real Apache Kafka cluster in KRaft mode on loopback: one broker, or N for failure tests.

Every node is a combined broker+controller (``process.roles=broker,controller``) with a static
controller quorum, so a 3-node cluster survives the loss of one node like a production one.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.localinfra import procs
from pipeline.localinfra.install import KafkaDist, Log, ensure_kafka

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


@dataclass
class KafkaNode:
    node_id: int
    port: int
    controller_port: int
    pid: int | None = None


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
    log: Log = field(default=print, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.brokers < 1:
            raise ValueError(f"brokers must be >= 1, got {self.brokers}")
        if not self.nodes:
            self.nodes = [
                KafkaNode(node_id=i + 1, port=procs.free_port(), controller_port=procs.free_port())
                for i in range(self.brokers)
            ]
        if not self.cluster_id:
            self.cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")

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
                   nodes=nodes, heap=d.get("heap", "512m"), log=log)

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
        lines = {
            "process.roles": "broker,controller",
            "node.id": node.node_id,
            "controller.quorum.voters": voters,
            "listeners": f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{node.port}",
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
        (d / "server.properties").write_text(self._properties(node))
        (d / "log4j2.properties").write_text(LOG4J2)
        if (d / "data" / "meta.properties").exists():
            return
        cmd = self._java(dist, node, "kafka.tools.StorageTool", "format", "-t", self.cluster_id,
                         "-c", str(d / "server.properties"), "--ignore-formatted")
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

        procs.wait_until(ready, timeout, f"Kafka node {node.node_id}", node.pid, log_file)

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
