"""A real single-binary Grafana Loki on loopback: installed once, cached by version, started on demand.

Built by Go from ``lokibuild/go.mod`` (published modules only; Loki's own ``replace`` directives are
repeated there because Go applies them only to a main module) into
``<cache>/loki/<loki-version>-<modhash>/loki``, like kube-apiserver in
:mod:`pipeline.localinfra.install`. A cold build takes minutes; later starts take seconds.

``LokiServer`` runs it as ``-target=all`` with filesystem storage under its own root, the ring in
memory, HTTP and gRPC on 127.0.0.1 only, and ``auth_enabled: true`` so that the ``X-Scope-OrgID``
tenant header is required and honoured (as in a multi-tenant production Loki). Data survives a
restart of the same root, so a test can stop and start it mid-stream.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from pipeline.localinfra import cache, procs
from pipeline.localinfra.install import InstallError, Log, _digest, _need, cache_root, go_build

HERE = Path(__file__).parent
LOKI_GOMOD = HERE / "lokibuild" / "go.mod"
LOKI_GOSUM = HERE / "lokibuild" / "go.sum"
LOKI_PACKAGE = "github.com/grafana/loki/v3/cmd/loki"

DEFAULT_TENANT = "xidflow"


def loki_version() -> str:
    """The Loki version pinned in ``lokibuild/go.mod`` (``vX.Y.Z``)."""
    m = re.search(r"^\s*(?:require\s+)?github\.com/grafana/loki/v3 (v\S+)", LOKI_GOMOD.read_text(), re.M)
    if not m:
        raise InstallError(f"{LOKI_GOMOD}: no 'github.com/grafana/loki/v3 vX.Y.Z' requirement")
    return m.group(1)


def loki_target() -> Path:
    """Where the binary of the pinned version lives (whether or not it is built yet)."""
    return cache_root() / "loki" / f"{loki_version()}-{_digest(LOKI_GOMOD, LOKI_GOSUM)}" / "loki"


def loki_installed() -> bool:
    binary = loki_target()
    return cache.is_complete(binary.parent, binary.name)


def ensure_loki(log: Log = print) -> Path:
    """Build Loki with Go from published modules, once per version; return the binary's path."""
    version = loki_version()
    binary = loki_target()
    target = binary.parent
    if loki_installed():
        return binary
    go = _need("go", "install Go >= 1.26 (https://go.dev/dl or your distribution)")
    with cache.one_builder(target):
        if loki_installed():
            return binary
        return _build(go, version, binary, log)


def _build(go: str, version: str, binary: Path, log: Log) -> Path:
    target = binary.parent
    tmp = Path(tempfile.mkdtemp(prefix="xidflow-lokibuild-"))
    try:
        shutil.copy(LOKI_GOMOD, tmp / "go.mod")
        shutil.copy(LOKI_GOSUM, tmp / "go.sum")
        env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=mod")
        build_info = "github.com/grafana/loki/v3/pkg/util/build"
        ldflags = f"-s -w -X {build_info}.Version={version.lstrip('v')} -X {build_info}.Branch=xidflow"
        with cache.publishing(target, version, binary.name) as staging:
            go_build(
                go, ["-trimpath", "-tags=netgo", f"-ldflags={ldflags}", "-o", str(staging / "loki"), LOKI_PACKAGE],
                tmp, f"building Loki {version} with Go (several minutes on a cold cache)", log, env, target,
            )
        log(f"Loki {version} installed in {target}")
        return binary
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def loki_config(root: Path, http_port: int, grpc_port: int) -> str:
    """Single-binary Loki: filesystem storage under ``root``, in-memory ring, loopback only, multi-tenant."""
    data = root / "data"
    return f"""\
auth_enabled: true
server:
  http_listen_address: 127.0.0.1
  http_listen_port: {http_port}
  grpc_listen_address: 127.0.0.1
  grpc_listen_port: {grpc_port}
  log_level: warn
common:
  instance_addr: 127.0.0.1
  path_prefix: {data}
  storage:
    filesystem:
      chunks_directory: {data}/chunks
      rules_directory: {data}/rules
  replication_factor: 1
  ring:
    kvstore:
      store: inmemory
ingester:
  wal:
    enabled: true
    dir: {data}/wal
  lifecycler:
    min_ready_duration: 0s
    final_sleep: 0s
memberlist:
  bind_addr: [127.0.0.1]
  advertise_addr: 127.0.0.1
schema_config:
  configs:
    - from: 2024-01-01
      store: tsdb
      object_store: filesystem
      schema: v13
      index:
        prefix: index_
        period: 24h
limits_config:
  reject_old_samples: false
  allow_structured_metadata: true
query_range:
  results_cache:
    cache:
      embedded_cache:
        enabled: true
        max_size_mb: 50
pattern_ingester:
  enabled: false
analytics:
  reporting_enabled: false
"""


@dataclass
class LokiServer:
    """One Loki process rooted at ``root``; ``start()`` then ``url``. Restartable on the same data."""

    root: Path
    http_port: int = 0
    grpc_port: int = 0
    pid: int | None = None
    log: Log = field(default=print, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.http_port = self.http_port or procs.free_port()
        self.grpc_port = self.grpc_port or procs.free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def log_file(self) -> Path:
        return self.root / "loki.log"

    def to_dict(self) -> dict:
        return procs.state_dict(self)

    @classmethod
    def from_dict(cls, d: dict, log: Log = print) -> LokiServer:
        return cls(**{**d, "root": Path(d["root"])}, log=log)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/ready", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def start(self, timeout: float = 120.0) -> LokiServer:
        binary = ensure_loki(self.log)
        self.root.mkdir(parents=True, exist_ok=True)
        if procs.alive(self.pid, str(self.root)):
            return self
        for port in (self.http_port, self.grpc_port):
            if procs.port_open(port):
                raise procs.StartError(f"Loki: port {port} is already in use")
        config = self.root / "loki.yaml"
        config.write_text(loki_config(self.root, self.http_port, self.grpc_port))
        self.pid = procs.spawn([str(binary), f"-config.file={config}", "-target=all"], self.log_file, cwd=self.root)
        procs.wait_until(self._ready, timeout, "Loki", self.pid, self.log_file, self.log)
        return self

    def stop(self) -> None:
        procs.stop(self.pid, expect=str(self.root))
        self.pid = None

    def running(self) -> dict[str, bool]:
        return {"loki": procs.alive(self.pid, str(self.root)) and procs.port_open(self.http_port)}


def push_lines(
    url: str,
    labels: dict[str, str],
    values: list[tuple[int, str]],
    *,
    tenant: str | None = DEFAULT_TENANT,
    timeout: float = 10.0,
) -> None:
    """Push entries through Loki's ``POST /loki/api/v1/push`` (JSON); raises on a non-2xx answer."""
    body = orjson.dumps({"streams": [{"stream": labels, "values": [[str(ts), line] for ts, line in values]}]})
    request = urllib.request.Request(f"{url}/loki/api/v1/push", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    if tenant:
        request.add_header("X-Scope-OrgID", tenant)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                r.read()
                return
        except urllib.error.HTTPError as exc:
            # Right after start the ingester may not be in the ring yet: Loki answers 5xx for a moment.
            if exc.code < 500 or time.monotonic() > deadline:
                raise
        time.sleep(0.5)
