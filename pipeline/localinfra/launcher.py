"""Brings up (or finds) the two services xidflow needs: a Kafka cluster and a Kubernetes cluster.

With ``loki=True`` also a Grafana Loki (``LOKI_URL`` from the environment, else the local build of
:mod:`pipeline.localinfra.loki`), the log store the Konduktor path and ``xidflow loki-tail`` read.

Source order, decided per service:
1. endpoints given in the environment (``KAFKA_BOOTSTRAP_SERVERS``, ``KUBECONFIG``);
2. testcontainers (Kafka, K3s) when a Docker engine answers;
3. local builds (Kafka jars from Maven Central; etcd, kube-apiserver, kube-controller-manager,
   kube-scheduler and KWOK built with Go: :mod:`pipeline.localinfra.controlplane`).

State (pids, ports, container ids) is kept in ``<state_dir>/state.json`` so that ``local down``
in another process stops exactly what ``local up`` started.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.localinfra import procs
from pipeline.localinfra.controlplane import DRA_FLAGS, NODE_LEASE_S, NODE_MONITOR_GRACE_S, ControlPlane
from pipeline.localinfra.install import Log, cache_root
from pipeline.localinfra.kafka import KafkaCluster
from pipeline.localinfra.loki import DEFAULT_TENANT, LokiServer


def default_state_dir() -> Path:
    explicit = os.environ.get("XIDFLOW_STATE_DIR")
    return Path(explicit) if explicit else cache_root() / "local"


def docker_answers() -> bool:
    """True when a Docker engine (not just the client) answers."""
    if os.environ.get("XIDFLOW_NO_DOCKER") or not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@dataclass
class Endpoints:
    kafka_bootstrap: str
    kubeconfig: str
    kafka_source: str
    kube_source: str
    kafka_env: dict[str, str] = field(default_factory=dict)  # credentials of a secured local Kafka (admin user)
    loki_url: str | None = None
    loki_org_id: str | None = None

    def env_lines(self) -> str:
        extra = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in self.kafka_env.items()
                        if k != "KAFKA_BOOTSTRAP_SERVERS")
        lines = f"export KAFKA_BOOTSTRAP_SERVERS={self.kafka_bootstrap}\n{extra}export KUBECONFIG={self.kubeconfig}\n"
        if self.loki_url:
            lines += f"export LOKI_URL={self.loki_url}\n"
        if self.loki_org_id:
            lines += f"export LOKI_ORG_ID={self.loki_org_id}\n"
        return lines


@dataclass
class LocalInfra:
    """The local infrastructure of one state directory."""

    state_dir: Path = field(default_factory=default_state_dir)
    log: Log = print
    kafka: KafkaCluster | None = None
    control_plane: ControlPlane | None = None
    containers: dict[str, str] = field(default_factory=dict)  # role -> Docker container id
    loki: LokiServer | None = None
    endpoints: Endpoints | None = None

    @property
    def state_file(self) -> Path:
        return Path(self.state_dir) / "state.json"

    # -- persistence -----------------------------------------------------------------------
    def save(self) -> None:
        Path(self.state_dir).mkdir(parents=True, exist_ok=True)
        state = {
            "kafka": self.kafka.to_dict() if self.kafka else None,
            "control_plane": self.control_plane.to_dict() if self.control_plane else None,
            "containers": self.containers,
            "loki": self.loki.to_dict() if self.loki else None,
            "endpoints": self.endpoints.__dict__ if self.endpoints else None,
        }
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_file)

    @classmethod
    def load(cls, state_dir: Path | None = None, log: Log = print) -> LocalInfra:
        infra = cls(state_dir=Path(state_dir or default_state_dir()), log=log)
        if infra.state_file.exists():
            state = json.loads(infra.state_file.read_text())
            if state.get("kafka"):
                infra.kafka = KafkaCluster.from_dict(state["kafka"], log=log)
            if state.get("control_plane"):
                infra.control_plane = ControlPlane.from_dict(state["control_plane"], log=log)
            infra.containers = state.get("containers") or {}
            if state.get("loki"):
                infra.loki = LokiServer.from_dict(state["loki"], log=log)
            if state.get("endpoints"):
                infra.endpoints = Endpoints(**state["endpoints"])
        return infra

    # -- lifecycle -------------------------------------------------------------------------
    def up(
        self, kafka_brokers: int = 1, detach: bool = True, kafka_security: str = "plaintext", loki: bool = False,
        node_monitor_grace_s: int = NODE_MONITOR_GRACE_S, node_lease_s: int = NODE_LEASE_S,
    ) -> Endpoints:
        """Start what is not already given; ``detach`` keeps containers alive after this process.

        ``node_monitor_grace_s`` / ``node_lease_s``: the local control plane's node lifecycle grace and
        KWOK's node Lease duration (a cluster's defaults; the test session asks for shorter ones).
        """
        if self.endpoints and self.is_running() and (not loki or self.endpoints.loki_url):
            self.log("local infrastructure already running")
            return self.endpoints
        self.down(quiet=True)
        env_kafka = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        env_kube = os.environ.get("KUBECONFIG")
        docker = None if (env_kafka and env_kube) else docker_answers()
        try:
            if env_kafka:
                kafka_bootstrap, kafka_source = env_kafka, "environment (KAFKA_BOOTSTRAP_SERVERS)"
            elif docker and kafka_security == "plaintext":
                kafka_bootstrap, kafka_source = self._kafka_container(detach), "testcontainers (Docker)"
            else:
                self.kafka = KafkaCluster(Path(self.state_dir) / "kafka", brokers=kafka_brokers, log=self.log,
                                          security=kafka_security)
                self.save()
                self.kafka.start()
                kafka_bootstrap = self.kafka.bootstrap
                kafka_source = f"local build (Apache Kafka, KRaft, {kafka_brokers} broker(s))"
            self.log(f"Kafka: {kafka_source} at {kafka_bootstrap}")
            self.save()
            if env_kube:
                kubeconfig, kube_source = env_kube, "environment (KUBECONFIG)"
            elif docker:
                kubeconfig, kube_source = self._k3s_container(detach), "testcontainers (K3s, Docker)"
            else:
                self.control_plane = ControlPlane(Path(self.state_dir) / "controlplane", log=self.log,
                                                  node_monitor_grace_s=node_monitor_grace_s, node_lease_s=node_lease_s)
                self.save()
                self.control_plane.start()
                kubeconfig = str(self.control_plane.kubeconfig)
                kube_source = ("local build (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, "
                               "KWOK nodes)")
            self.log(f"Kubernetes API: {kube_source}, kubeconfig {kubeconfig}")
            loki_url, loki_org_id = self._loki() if loki else (None, None)
        except BaseException:
            self.save()
            self.down(quiet=True)
            raise
        self.endpoints = Endpoints(kafka_bootstrap, kubeconfig, kafka_source, kube_source,
                                   self.kafka.local_env() if self.kafka and self.kafka.secured else {},
                                   loki_url, loki_org_id)
        self.save()
        return self.endpoints

    def _loki(self) -> tuple[str, str | None]:
        env_loki = os.environ.get("LOKI_URL")
        if env_loki:
            self.log("Loki: environment (LOKI_URL)")
            return env_loki, os.environ.get("LOKI_ORG_ID")
        self.loki = LokiServer(Path(self.state_dir) / "loki", log=self.log)
        self.save()
        self.loki.start()
        self.log(f"Loki: local build (single binary, filesystem storage) at {self.loki.url}, tenant {DEFAULT_TENANT}")
        return self.loki.url, DEFAULT_TENANT

    def _kafka_container(self, detach: bool) -> str:
        if detach:
            os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
        from testcontainers.kafka import KafkaContainer

        container = KafkaContainer().with_kraft()
        container.start()
        self.containers["kafka"] = container.get_wrapped_container().id
        return container.get_bootstrap_server()

    def _k3s_container(self, detach: bool) -> str:
        if detach:
            os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")
        from testcontainers.k3s import K3SContainer

        container = K3SContainer()
        # The same DRA device-taint API as the local build (per-GPU quarantine); K3s passes them on.
        container.with_command(" ".join([container._command, *(f"--kube-apiserver-arg={f[2:]}" for f in DRA_FLAGS)]))
        container.start()
        self.containers["k3s"] = container.get_wrapped_container().id
        path = Path(self.state_dir) / "k3s.kubeconfig"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(container.config_yaml())
        return str(path)

    def down(self, quiet: bool = False) -> None:
        """Stop everything this state directory started; leaves no process or port behind."""
        if self.loki:
            self.loki.stop()
        if self.control_plane:
            self.control_plane.stop()
        if self.kafka:
            self.kafka.stop()
        for cid in self.containers.values():
            if shutil.which("docker"):
                subprocess.run(["docker", "rm", "-f", cid], capture_output=True)
        self.containers = {}
        if self.endpoints and not quiet:
            self.log("local infrastructure stopped")
        self.kafka = None
        self.control_plane = None
        self.loki = None
        self.endpoints = None
        if Path(self.state_dir).exists():
            self.save()

    def is_running(self) -> bool:
        status = self.status()
        return bool(status) and all(status.values())

    def status(self) -> dict[str, bool]:
        out: dict[str, bool] = {}
        if self.kafka:
            for node_id, ok in self.kafka.running().items():
                out[f"kafka-{node_id}"] = ok
        if self.control_plane:
            out.update(self.control_plane.running())
        if self.loki:
            out.update(self.loki.running())
        for key, cid in self.containers.items():
            out[f"container:{key}"] = _container_running(cid)
        return out


def _container_running(cid: str) -> bool:
    try:
        proc = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", cid],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.stdout.strip() == "true"


__all__ = ["Endpoints", "LocalInfra", "default_state_dir", "docker_answers", "procs"]
