"""A real Kubernetes API server backed by a real etcd, the way envtest runs them (no kubelet).

The API server runs with ``--authorization-mode=RBAC`` so tests can prove least privilege; the
admin kubeconfig authenticates with a client certificate in ``system:masters``. Node objects are
created through the API (as KWOK does) and pods are bound by ``spec.nodeName``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pipeline.localinfra import procs
from pipeline.localinfra.install import Log, ensure_controlplane

# Dynamic Resource Allocation device taints (KEP-5055), so per-GPU quarantine (``taintDevice``) runs
# against the real API. In 1.36 ResourceSlice is served at resource.k8s.io/v1 by default and
# DRADeviceTaints is beta and on by default, but DeviceTaintRule is served only at
# resource.k8s.io/v1beta2 (and v1alpha3), off by default, behind the beta gate DRADeviceTaintRules.
DRA_FLAGS = (
    "--feature-gates=DRADeviceTaints=true,DRADeviceTaintRules=true",
    "--runtime-config=resource.k8s.io/v1beta2=true",
)


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


def write_pki(pki: Path) -> None:
    """CA, API server serving cert, admin client cert (system:masters), service-account key."""
    if (pki / ".complete").exists():
        return
    pki.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "xidflow-local-ca")])
    ca = _cert(ca_name, ca_name, ca_key.public_key(), ca_key, ca=True)
    _write_key(pki / "ca.key", ca_key)
    (pki / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    srv_key = ec.generate_private_key(ec.SECP256R1())
    srv = _cert(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]), ca_name,
        srv_key.public_key(), ca_key, ca=False, usages=[ExtendedKeyUsageOID.SERVER_AUTH],
        sans=[x509.DNSName("localhost"), x509.DNSName("kubernetes"), x509.DNSName("kubernetes.default.svc"),
              x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    _write_key(pki / "apiserver.key", srv_key)
    (pki / "apiserver.crt").write_bytes(srv.public_bytes(serialization.Encoding.PEM))

    adm_key = ec.generate_private_key(ec.SECP256R1())
    adm = _cert(
        x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
                   x509.NameAttribute(NameOID.COMMON_NAME, "xidflow-admin")]),
        ca_name, adm_key.public_key(), ca_key, ca=False, usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
    )
    _write_key(pki / "admin.key", adm_key)
    (pki / "admin.crt").write_bytes(adm.public_bytes(serialization.Encoding.PEM))

    _write_key(pki / "sa.key", rsa.generate_private_key(public_exponent=65537, key_size=2048))
    (pki / ".complete").write_text("ok")


@dataclass
class ControlPlane:
    """etcd + kube-apiserver rooted at ``root``; ``start()`` then ``kubeconfig`` / ``server``."""

    root: Path
    etcd_port: int = 0
    etcd_peer_port: int = 0
    api_port: int = 0
    etcd_pid: int | None = None
    api_pid: int | None = None
    log: Log = field(default=print, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.etcd_port = self.etcd_port or procs.free_port()
        self.etcd_peer_port = self.etcd_peer_port or procs.free_port()
        self.api_port = self.api_port or procs.free_port()

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def kubeconfig(self) -> Path:
        return self.root / "kubeconfig"

    def to_dict(self) -> dict:
        return procs.state_dict(self)

    @classmethod
    def from_dict(cls, d: dict, log: Log = print) -> ControlPlane:
        return cls(**{**d, "root": Path(d["root"])}, log=log)

    def _write_kubeconfig(self) -> None:
        self.kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters:\n- name: xidflow-local\n  cluster:\n    server: {self.server}\n"
            f"    certificate-authority: {self.pki / 'ca.crt'}\n"
            f"users:\n- name: xidflow-admin\n  user:\n    client-certificate: {self.pki / 'admin.crt'}\n"
            f"    client-key: {self.pki / 'admin.key'}\n"
            "contexts:\n- name: xidflow-local\n  context:\n    cluster: xidflow-local\n    user: xidflow-admin\n"
            "current-context: xidflow-local\n"
        )

    def _ready(self) -> bool:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        try:
            with urllib.request.urlopen(f"{self.server}/readyz", context=ctx, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def start(self, timeout: float = 120.0) -> ControlPlane:
        dist = ensure_controlplane(self.log)
        self.root.mkdir(parents=True, exist_ok=True)
        write_pki(self.pki)
        self._write_kubeconfig()
        for port in (self.etcd_port, self.etcd_peer_port, self.api_port):
            if procs.port_open(port):
                raise procs.StartError(f"control plane: port {port} is already in use")
        etcd_log = self.root / "etcd.log"
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
        procs.wait_until(lambda: procs.port_open(self.etcd_port), 30, "etcd", self.etcd_pid, etcd_log)
        api_log = self.root / "kube-apiserver.log"
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
             "--disable-admission-plugins=ServiceAccount", "--allow-privileged=true",
             "--enable-priority-and-fairness=false", "--max-requests-inflight=2000",
             "--max-mutating-requests-inflight=1000", "--endpoint-reconciler-type=none", "--v=1",
             *DRA_FLAGS],
            api_log, cwd=self.root,
        )
        procs.wait_until(self._ready, timeout, "kube-apiserver", self.api_pid, api_log)
        return self

    def stop(self) -> None:
        procs.stop(self.api_pid, expect=str(self.root))
        self.api_pid = None
        procs.stop(self.etcd_pid, expect=str(self.root))
        self.etcd_pid = None

    def running(self) -> dict[str, bool]:
        return {
            "etcd": procs.alive(self.etcd_pid, str(self.root)) and procs.port_open(self.etcd_port),
            "kube-apiserver": procs.alive(self.api_pid, str(self.root)) and procs.port_open(self.api_port),
        }
