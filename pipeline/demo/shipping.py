"""The demo's Fluent Bit: the shipped configuration, one real process per simulated node.

What a GPU node's DaemonSet pod does, on this machine: each node gets a Fluent Bit process running
``deploy/fluent-bit/fluent-bit.yaml`` (rendered by :mod:`pipeline.localinfra.fluentbit_run`, which
changes only paths, ports, topics and credentials) with ``NODE_NAME`` set to the node. The demo plays
the node's kernel and container runtime: it appends the scenario's kernel lines to the node's kernel
log file in /dev/kmsg's own record format (the shipped ``xidflow-kmsg-record`` parser, so each record
carries the kernel's sequence number and time since boot like the ``kmsg`` input's records), and pod
lines in CRI format to ``<pod>_<namespace>_<container>-<64 hex>.log`` files, which the shipped
``kubernetes`` filter resolves against the API server with a ServiceAccount token.

Boot ids: the shipped Lua filter stamps every kernel record with this machine's boot id
(``/proc/sys/kernel/random/boot_id``), because that is the node's boot id on a real node. The
simulated nodes all run on this machine, so they start on its boot id (the fleet reports it as each
Node's ``bootID``, and the probe's first checks carry it): kernel records, Node status and probe agree.
A simulated reboot gives the Node a new boot id that this machine's /proc does not have, so a node's
Fluent Bit cannot ship kernel lines of the new boot; the demo refuses to write any (the scenario has
none: after the reboot only the probe speaks for the node).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from pipeline.localinfra.fluentbit import VERSION as FLUENT_BIT_VERSION
from pipeline.localinfra.fluentbit_run import FluentBit, Render
from pipeline.localinfra.helm import helm_template
from pipeline.localinfra.install import Log
from pipeline.runtime.settings import KafkaSettings

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "xidflow"
COMPONENT_LABEL = "app.kubernetes.io/component"
KERNEL_FILE = "kmsg.log"
CONTAINER = "trainer"
KMSG_PRIORITY = 3  # KERN_ERR, what the driver logs Xids at

__all__ = ["FLUENT_BIT_VERSION", "FluentBitAccess", "NodeShipper", "boot_usec", "chart_fluent_bit_rbac",
           "rdkafka_credentials"]


def boot_usec() -> int:
    """Microseconds since this machine booted (what /dev/kmsg records carry)."""
    clock = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)
    return time.clock_gettime_ns(clock) // 1000


def kmsg_record(priority: int, sequence: int, usec: int, line: str) -> str:
    """One line in /dev/kmsg's record format: ``<priority>,<sequence>,<usec since boot>,<flags>;<message>``."""
    return f"{priority},{sequence},{usec},-;{line}"


def cri_line(line: str, stream: str = "stderr") -> str:
    """One line as the CRI container runtimes write it (full line, ``F``)."""
    now = time.time_ns()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now // 10**9)) + f".{now % 10**9:09d}Z"
    return f"{stamp} {stream} F {line}"


def container_log_name(pod: str, namespace: str, container: str, salt: str) -> str:
    """The kubelet's file name for a container's log: ``<pod>_<namespace>_<container>-<64 hex id>.log``."""
    container_id = hashlib.sha256(f"{salt}/{namespace}/{pod}/{container}".encode()).hexdigest()
    return f"{pod}_{namespace}_{container}-{container_id}.log"


def rdkafka_credentials(settings: KafkaSettings | None = None) -> dict[str, str]:
    """The librdkafka properties (``rdkafka.*`` in the shipped outputs) for the brokers the demo's own
    clients use (``KAFKA_SECURITY_PROTOCOL`` and friends); none on a plaintext broker."""
    from pipeline.kafka.clients import _password

    s = settings or KafkaSettings()
    if s.security_protocol == "PLAINTEXT":
        return {}
    props = {"security.protocol": s.security_protocol.lower()}
    if s.uses_sasl:
        if s.sasl_mechanism == "OAUTHBEARER":
            raise RuntimeError("the demo's Fluent Bit cannot use OAUTHBEARER; run it on a PLAIN or SCRAM listener")
        props.update({"sasl.mechanisms": str(s.sasl_mechanism), "sasl.username": s.sasl_username or "",
                      "sasl.password": _password(s) or ""})
    if s.uses_ssl:
        for key, path in (("ssl.ca.location", s.ssl_cafile), ("ssl.certificate.location", s.ssl_certfile),
                          ("ssl.key.location", s.ssl_keyfile)):
            if path:
                props[key] = str(path)
        if not s.ssl_check_hostname:
            props["ssl.endpoint.identification.algorithm"] = "none"
    return props


def chart_fluent_bit_rbac(release: str, namespace: str, log: Log = print) -> list[dict[str, Any]]:
    """The ServiceAccount, ClusterRole and ClusterRoleBinding the Helm chart gives Fluent Bit."""
    rendered = helm_template(CHART, release=release, namespace=namespace, log=log)
    wanted = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    docs = [d for d in yaml.safe_load_all(rendered) if d and d.get("kind") in wanted
            and (d["metadata"].get("labels") or {}).get(COMPONENT_LABEL) == "fluent-bit"]
    kinds = sorted(d["kind"] for d in docs)
    if kinds != sorted(wanted):
        raise RuntimeError(f"the chart's Fluent Bit RBAC is not one {', '.join(sorted(wanted))}: got {kinds}")
    return docs


class FluentBitAccess:
    """Fluent Bit's identity on the API server: the chart's RBAC and a TokenRequest token, as files."""

    def __init__(self, api: client.ApiClient, namespace: str, release: str, folder: Path, log: Log = print) -> None:
        self.api, self.namespace, self.release, self.folder, self.log = api, namespace, release, folder, log
        self.cluster_objects: list[tuple[str, str]] = []  # (kind, name) to delete afterwards

    def create(self, token_seconds: int = 3600) -> dict[str, str]:
        """Create the objects, request a token; returns the kubernetes filter's ``kube_*`` settings."""
        core, rbac = client.CoreV1Api(self.api), client.RbacAuthorizationV1Api(self.api)
        account = ""
        for doc in chart_fluent_bit_rbac(self.release, self.namespace, self.log):
            kind, name = doc["kind"], doc["metadata"]["name"]
            if kind == "ServiceAccount":
                core.create_namespaced_service_account(self.namespace, doc)
                account = name
            elif kind == "ClusterRole":
                rbac.create_cluster_role(doc)
                self.cluster_objects.append((kind, name))
            else:
                rbac.create_cluster_role_binding(doc)
                self.cluster_objects.append((kind, name))
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=token_seconds))
        token = core.create_namespaced_service_account_token(account, self.namespace, request).status.token
        self.folder.mkdir(parents=True, exist_ok=True)
        token_file = self.folder / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        cfg = self.api.configuration
        if not cfg.ssl_ca_cert:
            raise RuntimeError("the kubeconfig names no CA for the API server; the kubernetes filter needs one")
        ca_file = self.folder / "ca.crt"
        shutil.copyfile(cfg.ssl_ca_cert, ca_file)
        return {"kube_url": cfg.host, "kube_ca_file": str(ca_file), "kube_token_file": str(token_file)}

    def delete(self) -> None:
        rbac = client.RbacAuthorizationV1Api(self.api)
        for kind, name in self.cluster_objects:
            try:
                if kind == "ClusterRole":
                    rbac.delete_cluster_role(name)
                else:
                    rbac.delete_cluster_role_binding(name)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        self.cluster_objects.clear()


class NodeShipper:
    """One node's Fluent Bit process and the log files it tails (kernel and container logs)."""

    def __init__(self, root: Path, node: str, brokers: str, render: Render, log: Log = print) -> None:
        self.node = node
        self.fluent_bit = FluentBit(root, node, brokers, render, log=log)
        self.sequence = 0  # the node's kmsg sequence number (never repeats within a boot)
        self.written = 0  # lines written that the prefilter keeps (every scenario line)
        self.container_files: dict[tuple[str, str], str] = {}
        (self.fluent_bit.root / "kernel" / KERNEL_FILE).touch()  # there from boot: appends are seen at once

    def add_container_logs(self, namespace: str, pods: Iterable[str], salt: str) -> None:
        """The container runtime's log files of the node's pods (empty until their containers log)."""
        for pod in pods:
            name = container_log_name(pod, namespace, CONTAINER, salt)
            self.container_files[(namespace, pod)] = name
            (self.fluent_bit.root / "containers" / name).touch()

    def write_kernel(self, lines: Iterable[str]) -> int:
        records = []
        for line in lines:
            self.sequence += 1
            records.append(kmsg_record(KMSG_PRIORITY, self.sequence, boot_usec(), line))
        self.fluent_bit.write(KERNEL_FILE, *records, folder="kernel")
        self.written += len(records)
        return len(records)

    def write_pod(self, namespace: str, pod: str, lines: Iterable[str]) -> int:
        name = self.container_files.get((namespace, pod))
        if name is None:
            raise RuntimeError(f"pod {namespace}/{pod} has no container log on {self.node}")
        records = [cri_line(line) for line in lines]
        self.fluent_bit.write(name, *records, folder="containers")
        self.written += len(records)
        return len(records)

    def wait_delivered(self, timeout: float) -> int:
        """Block until Kafka acknowledged every line written so far (Fluent Bit's output counters)."""
        return self.fluent_bit.wait_delivered(self.written, timeout)

    @property
    def pid(self) -> int | None:
        return self.fluent_bit.proc.pid if self.fluent_bit.proc else None


def start_all(shippers: Iterable[NodeShipper], timeout: float = 60.0,
              started: Callable[[NodeShipper], None] | None = None) -> None:
    """Start the processes side by side (each waits for its health endpoint); ``started(shipper)`` once one answers."""
    shippers = list(shippers)

    def start(shipper: NodeShipper) -> None:
        shipper.fluent_bit.start(timeout, True)
        if started is not None:
            started(shipper)

    with ThreadPoolExecutor(max_workers=max(1, min(8, len(shippers)))) as pool:
        for future in [pool.submit(start, s) for s in shippers]:
            future.result()


def stop_all(shippers: Iterable[NodeShipper]) -> None:
    shippers = list(shippers)
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(shippers)))) as pool:
        list(pool.map(lambda s: s.fluent_bit.stop(), shippers))


def fresh_folder(path: Path) -> Path:
    """An empty folder (the previous run's Fluent Bit files and tail positions removed)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    os.chmod(path, 0o700)  # it holds the ServiceAccount token
    return path
