"""A local Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK.

What a cluster runs, minus containers: the API server (``--authorization-mode=RBAC``, so tests can
prove least privilege) on a real etcd; the controller-manager with every controller a cluster runs by
default (``--controllers=*``: node lifecycle, ReplicaSet, Deployment, StatefulSet, DaemonSet, Job,
disruption, garbage collector, pod GC, namespace, ServiceAccount and token, taint eviction and, with
the DRA feature gates the API server has, the device-taint eviction controller); the scheduler; and
KWOK (:mod:`pipeline.localinfra.kwok`) in place of the kubelets: it heartbeats the nodes labelled
``kwok.x-k8s.io/node=fake``, runs the pods scheduled to them and finishes Job pods.

Each component authenticates with a client certificate of its own, as on a cluster built by kubeadm:
the admin (``system:masters``), ``system:kube-controller-manager`` and ``system:kube-scheduler``
(bound to their roles by the API server's bootstrap RBAC policy) and ``kwok-controller`` (bound here
to the ClusterRole KWOK's module ships). The controller-manager's controllers run each with their
own ServiceAccount (``--use-service-account-credentials``).

``start()`` returns when every component answers: the API server's ``/readyz``, the
controller-manager's and the scheduler's ``/healthz`` on their secure ports, KWOK's ``/healthz``; a
component that exits or does not answer is named in the error, with the end of its log.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pipeline.localinfra import kwok, procs
from pipeline.localinfra.install import ControlPlaneDist, KwokDist, Log, ensure_controlplane, ensure_kwok

# Dynamic Resource Allocation device taints (KEP-5055), so per-GPU quarantine (``taintDevice``) runs
# against the real API. In 1.36 ResourceSlice is served at resource.k8s.io/v1 by default and
# DRADeviceTaints is beta and on by default, but DeviceTaintRule is served only at
# resource.k8s.io/v1beta2 (and v1alpha3), off by default, behind the beta gate DRADeviceTaintRules.
# The controller-manager (its device-taint eviction controller) and the scheduler get the same gates.
DRA_FEATURE_GATES = "--feature-gates=DRADeviceTaints=true,DRADeviceTaintRules=true"
DRA_FLAGS = (DRA_FEATURE_GATES, "--runtime-config=resource.k8s.io/v1beta2=true")

NODE_MONITOR_GRACE_S = 50
"""The node lifecycle controller's default grace (Kubernetes 1.32+): a node whose Lease is older is Unknown."""
NODE_LEASE_S = 40
"""A kubelet's default node Lease duration; KWOK renews it every quarter of this."""

CLIENT_QPS = 100
"""The controller-manager's and the scheduler's API client rate (``--kube-api-qps`` and ``--kube-api-burst``):
what Kubernetes' own 5,000-node scalability jobs give both components. Their default (20 requests/s, bursts of
30) is a small cluster's, and the node lifecycle controller answers every new node (lifting its not-ready
taint) and every cordon (its ``node.kubernetes.io/unschedulable`` taint) with a read and a patch each: at 20/s
10,000 new nodes took it about 8 minutes, and the cordons of a 5,000-node burst were answered minutes after
the quarantines, sharing the API server with whatever came next."""

KWOK_USER = "kwok-controller"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                          serialization.NoEncryption())
    )
    path.chmod(0o600)


def _cert(
    subject: x509.Name, issuer: x509.Name, public_key, signing_key, *, ca: bool,  # noqa: ANN001
    usages: list | None = None, sans: list | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(issuer).public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        b = b.add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
    if usages:
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return b.sign(signing_key, hashes.SHA256())


CLIENTS = {
    "admin": ("xidflow-admin", "system:masters"),
    "kube-controller-manager": ("system:kube-controller-manager", None),
    "kube-scheduler": ("system:kube-scheduler", None),
    "kwok": (KWOK_USER, None),
}
"""Each client of the API server: its certificate's common name (the user) and organisation (a group)."""


def write_pki(pki: Path) -> None:
    """CA, the API server's serving cert, a client cert per ``CLIENTS`` entry, the service-account key, and the
    front-proxy CA (the request-header authentication the controller-manager and the scheduler delegate to the
    API server expects one, as kubeadm sets it up; no proxy uses it here).

    Each file is written when missing, so a state directory from an older version gains what it lacks
    (signed by its existing CA) and keeps what it has.
    """
    pki.mkdir(parents=True, exist_ok=True)

    def authority(stem: str, common_name: str) -> x509.Name:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        if not ((pki / f"{stem}.key").exists() and (pki / f"{stem}.crt").exists()):
            key = ec.generate_private_key(ec.SECP256R1())
            _write_key(pki / f"{stem}.key", key)
            (pki / f"{stem}.crt").write_bytes(_cert(name, name, key.public_key(), key, ca=True)
                                              .public_bytes(serialization.Encoding.PEM))
        return name

    ca_name = authority("ca", "xidflow-local-ca")
    authority("front-proxy-ca", "xidflow-local-front-proxy-ca")
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)

    def leaf(stem: str, subject: list[x509.NameAttribute], usage: x509.ObjectIdentifier,
             sans: list | None = None) -> None:
        if (pki / f"{stem}.key").exists() and (pki / f"{stem}.crt").exists():
            return
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(x509.Name(subject), ca_name, key.public_key(), ca_key, ca=False, usages=[usage], sans=sans)
        _write_key(pki / f"{stem}.key", key)
        (pki / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    leaf("apiserver", [x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")], ExtendedKeyUsageOID.SERVER_AUTH,
         sans=[x509.DNSName("localhost"), x509.DNSName("kubernetes"), x509.DNSName("kubernetes.default.svc"),
               x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    for stem, (user, group) in CLIENTS.items():
        subject = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, group)] if group else []
        leaf(stem, [*subject, x509.NameAttribute(NameOID.COMMON_NAME, user)], ExtendedKeyUsageOID.CLIENT_AUTH)
    if not (pki / "sa.key").exists():
        _write_key(pki / "sa.key", rsa.generate_private_key(public_exponent=65537, key_size=2048))


def kubeconfig_text(server: str, ca: Path, user: str, cert: Path, key: Path) -> str:
    """A kubeconfig of one user authenticating with a client certificate (pure)."""
    return (
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- name: xidflow-local\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\n"
        f"users:\n- name: {user}\n  user:\n    client-certificate: {cert}\n    client-key: {key}\n"
        f"contexts:\n- name: xidflow-local\n  context:\n    cluster: xidflow-local\n    user: {user}\n"
        "current-context: xidflow-local\n"
    )


# -- command lines (pure) --------------------------------------------------------------------------------------
def controller_manager_command(binary: Path, *, kubeconfig: Path, pki: Path, port: int,
                               node_monitor_grace_s: int) -> list[str]:
    """kube-controller-manager as kubeadm runs it, on loopback, without leader election (one replica)."""
    return [
        str(binary), f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1", f"--secure-port={port}",
        "--controllers=*", "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}", f"--cluster-signing-key-file={pki / 'ca.key'}",
        "--leader-elect=false", f"--node-monitor-grace-period={node_monitor_grace_s}s", "--v=1",
        f"--kube-api-qps={CLIENT_QPS}", f"--kube-api-burst={CLIENT_QPS}", DRA_FEATURE_GATES,
    ]


def scheduler_command(binary: Path, *, kubeconfig: Path, port: int) -> list[str]:
    """kube-scheduler with its default profile, on loopback, without leader election."""
    return [
        str(binary), f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
        "--bind-address=127.0.0.1", f"--secure-port={port}", "--leader-elect=false", "--v=1",
        f"--kube-api-qps={CLIENT_QPS}", f"--kube-api-burst={CLIENT_QPS}", DRA_FEATURE_GATES,
    ]


@dataclass
class ControlPlane:
    """The control plane rooted at ``root``; ``start()`` then ``kubeconfig`` / ``server``.

    ``node_monitor_grace_s`` and ``node_lease_s``: the node lifecycle controller's grace and KWOK's
    Lease duration (a cluster's defaults unless a caller, e.g. the test session, asks for shorter).
    """

    root: Path
    etcd_port: int = 0
    etcd_peer_port: int = 0
    api_port: int = 0
    kcm_port: int = 0
    scheduler_port: int = 0
    kwok_port: int = 0
    etcd_pid: int | None = None
    api_pid: int | None = None
    kcm_pid: int | None = None
    scheduler_pid: int | None = None
    kwok_pid: int | None = None
    node_monitor_grace_s: int = NODE_MONITOR_GRACE_S
    node_lease_s: int = NODE_LEASE_S
    log: Log = field(default=print, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        for name in ("etcd_port", "etcd_peer_port", "api_port", "kcm_port", "scheduler_port", "kwok_port"):
            setattr(self, name, getattr(self, name) or procs.free_port())

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def kubeconfig(self) -> Path:
        """The admin's kubeconfig (``system:masters``): what ``xidflow local env`` exports."""
        return self.root / "kubeconfig"

    def component_kubeconfig(self, component: str) -> Path:
        return self.kubeconfig if component == "admin" else self.root / f"{component}.kubeconfig"

    def log_file(self, component: str) -> Path:
        return self.root / f"{component}.log"

    def to_dict(self) -> dict:
        return procs.state_dict(self)

    @classmethod
    def from_dict(cls, d: dict, log: Log = print) -> ControlPlane:
        return cls(**{**d, "root": Path(d["root"])}, log=log)

    def _write_kubeconfigs(self) -> None:
        for stem, (user, _group) in CLIENTS.items():
            self.component_kubeconfig(stem).write_text(
                kubeconfig_text(self.server, self.pki / "ca.crt", user, self.pki / f"{stem}.crt",
                                self.pki / f"{stem}.key"))

    def _api_ready(self) -> bool:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return _answers(f"{self.server}/readyz", ctx)

    def start(self, timeout: float = 120.0) -> ControlPlane:
        dist = ensure_controlplane(self.log)
        kwok_dist = ensure_kwok(self.log)
        self.root.mkdir(parents=True, exist_ok=True)
        write_pki(self.pki)
        self._write_kubeconfigs()
        for port in (self.etcd_port, self.etcd_peer_port, self.api_port, self.kcm_port, self.scheduler_port,
                     self.kwok_port):
            if procs.port_open(port):
                raise procs.StartError(f"control plane: port {port} is already in use")
        self._start_etcd(dist)
        self._start_apiserver(dist, timeout)
        self._grant_kwok(kwok_dist)
        self._start_nodes_and_controllers(dist, kwok_dist, timeout)
        return self

    def _start_etcd(self, dist: ControlPlaneDist) -> None:
        etcd_log = self.log_file("etcd")
        if not procs.alive(self.etcd_pid, str(self.root)):
            self.etcd_pid = procs.spawn(
                [str(dist.etcd), "--name=xidflow", f"--data-dir={self.root / 'etcd'}",
                 f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                 f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                 f"--listen-peer-urls=http://127.0.0.1:{self.etcd_peer_port}",
                 f"--initial-advertise-peer-urls=http://127.0.0.1:{self.etcd_peer_port}",
                 f"--initial-cluster=xidflow=http://127.0.0.1:{self.etcd_peer_port}",
                 # Throwaway local state: durability of each write is not worth an fsync here.
                 "--unsafe-no-fsync", "--log-level=warn", "--quota-backend-bytes=2147483648"],
                etcd_log, cwd=self.root,
            )
        procs.wait_until(lambda: procs.port_open(self.etcd_port), 30, "etcd", self.etcd_pid, etcd_log, self.log)

    def _start_apiserver(self, dist: ControlPlaneDist, timeout: float) -> None:
        api_log = self.log_file("kube-apiserver")
        pki = self.pki
        self.api_pid = procs.spawn(
            [str(dist.kube_apiserver),
             f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
             f"--cert-dir={pki}", f"--tls-cert-file={pki / 'apiserver.crt'}",
             f"--tls-private-key-file={pki / 'apiserver.key'}", f"--client-ca-file={pki / 'ca.crt'}",
             f"--secure-port={self.api_port}", "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
             "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
             f"--service-account-key-file={pki / 'sa.key'}",
             f"--service-account-signing-key-file={pki / 'sa.key'}",
             "--service-cluster-ip-range=10.0.0.0/24", "--authorization-mode=RBAC",
             f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
             "--requestheader-allowed-names=front-proxy-client", "--requestheader-username-headers=X-Remote-User",
             "--requestheader-group-headers=X-Remote-Group", "--requestheader-extra-headers-prefix=X-Remote-Extra-",
             "--disable-admission-plugins=ServiceAccount", "--allow-privileged=true",
             "--enable-priority-and-fairness=false", "--max-requests-inflight=2000",
             "--max-mutating-requests-inflight=1000", "--endpoint-reconciler-type=none", "--v=1",
             *DRA_FLAGS],
            api_log, cwd=self.root,
        )
        procs.wait_until(self._api_ready, timeout, "kube-apiserver", self.api_pid, api_log, self.log)

    def _grant_kwok(self, kwok_dist: KwokDist) -> None:
        """Bind the ``kwok-controller`` user to the ClusterRole of KWOK's module (created or updated)."""
        from kubernetes import client, config
        from kubernetes.client.rest import ApiException

        role = kwok.role(kwok_dist.module_files)
        name = role["metadata"]["name"]
        binding = {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding", "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": KWOK_USER}],
        }
        api = config.new_client_from_config(config_file=str(self.kubeconfig))
        try:
            rbac = client.RbacAuthorizationV1Api(api)
            for create, replace, body in ((rbac.create_cluster_role, rbac.replace_cluster_role, role),
                                          (rbac.create_cluster_role_binding, rbac.replace_cluster_role_binding,
                                           binding)):
                try:
                    create(body)
                except ApiException as exc:
                    if exc.status != 409:
                        raise procs.StartError(f"KWOK's RBAC could not be created: {exc.status} {exc.reason}: "
                                               f"{exc.body}") from None
                    replace(name, body)
        finally:
            api.close()

    def _start_nodes_and_controllers(self, dist: ControlPlaneDist, kwok_dist: KwokDist, timeout: float) -> None:
        """Start the controller-manager, the scheduler and KWOK together; wait until each answers."""
        config = self.root / "kwok.yaml"
        config.write_text(kwok.config_text(kwok.all_stages(kwok_dist.module_files)))
        commands = {
            "kube-controller-manager": controller_manager_command(
                dist.kube_controller_manager, kubeconfig=self.component_kubeconfig("kube-controller-manager"),
                pki=self.pki, port=self.kcm_port, node_monitor_grace_s=self.node_monitor_grace_s),
            "kube-scheduler": scheduler_command(
                dist.kube_scheduler, kubeconfig=self.component_kubeconfig("kube-scheduler"), port=self.scheduler_port),
            "kwok": kwok.command(kwok_dist.binary, kubeconfig=self.component_kubeconfig("kwok"), config=config,
                                 port=self.kwok_port, lease_seconds=self.node_lease_s),
        }
        for component, cmd in commands.items():
            setattr(self, self._pid_field(component), procs.spawn(cmd, self.log_file(component), cwd=self.root))
        for component in commands:
            procs.wait_until(self._health_check(component), timeout, component,
                             getattr(self, self._pid_field(component)), self.log_file(component), self.log)

    @staticmethod
    def _pid_field(component: str) -> str:
        return {"etcd": "etcd_pid", "kube-apiserver": "api_pid", "kube-controller-manager": "kcm_pid",
                "kube-scheduler": "scheduler_pid", "kwok": "kwok_pid"}[component]

    def _port(self, component: str) -> int:
        return {"etcd": self.etcd_port, "kube-apiserver": self.api_port, "kube-controller-manager": self.kcm_port,
                "kube-scheduler": self.scheduler_port, "kwok": self.kwok_port}[component]

    def _health_check(self, component: str) -> Callable[[], bool]:
        if component == "kwok":
            return lambda: _answers(f"http://127.0.0.1:{self.kwok_port}/healthz")
        # Their serving certificates are self-signed at start: nothing to verify them against.
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        return lambda: _answers(f"https://127.0.0.1:{self._port(component)}/healthz", insecure)

    def stop(self) -> None:
        """Stop every component, the API server's clients first; leaves no process behind."""
        for component in reversed(COMPONENTS):
            pid_field = self._pid_field(component)
            procs.stop(getattr(self, pid_field), expect=str(self.root))
            setattr(self, pid_field, None)

    def running(self) -> dict[str, bool]:
        return {
            component: procs.alive(getattr(self, self._pid_field(component)), str(self.root))
            and procs.port_open(self._port(component))
            for component in COMPONENTS
        }


def _answers(url: str, context: ssl.SSLContext | None = None) -> bool:
    """The URL answers 200 (a health or readiness endpoint)."""
    try:
        with urllib.request.urlopen(url, context=context, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
