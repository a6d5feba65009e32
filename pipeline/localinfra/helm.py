"""A ``helm`` binary for rendering and checking the chart in ``deploy/helm/xidflow``.

Built by Go from ``helmbuild/go.mod`` (published modules only, ``tool helm.sh/helm/v3/cmd/helm``)
into ``<cache>/helm/<helm-version>-<modhash>/helm``, like the control-plane binaries in
:mod:`pipeline.localinfra.install`. A ``helm`` already on PATH is not used: the tests render with
the version pinned here so that results do not depend on the machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from pipeline.localinfra import cache
from pipeline.localinfra.install import InstallError, Log, _digest, _need, cache_root, go_build

HERE = Path(__file__).parent
HELM_GOMOD = HERE / "helmbuild" / "go.mod"
HELM_GOSUM = HERE / "helmbuild" / "go.sum"
HELM_PACKAGE = "helm.sh/helm/v3/cmd/helm"


def helm_version() -> str:
    """The helm version pinned in ``helmbuild/go.mod`` (``vX.Y.Z``)."""
    m = re.search(r"^\s*(?:require\s+)?helm\.sh/helm/v3 (v\S+)", HELM_GOMOD.read_text(), re.M)
    if not m:
        raise InstallError(f"{HELM_GOMOD}: no 'helm.sh/helm/v3 vX.Y.Z' requirement")
    return m.group(1)


def helm_target() -> Path:
    """Where the binary of the pinned version lives (whether or not it is built yet)."""
    return cache_root() / "helm" / f"{helm_version()}-{_digest(HELM_GOMOD, HELM_GOSUM)}" / "helm"


def ensure_helm(log: Log = print) -> Path:
    """Build helm with Go from published modules, once per version; return the binary's path."""
    version = helm_version()
    binary = helm_target()
    target = binary.parent
    if cache.is_complete(target, binary.name):
        return binary
    go = _need("go", "install Go >= 1.26 (https://go.dev/dl or your distribution)")
    tmp = Path(tempfile.mkdtemp(prefix="xidflow-helmbuild-"))
    try:
        shutil.copy(HELM_GOMOD, tmp / "go.mod")
        shutil.copy(HELM_GOSUM, tmp / "go.sum")
        env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=mod")
        ldflags = f"-s -w -X helm.sh/helm/v3/internal/version.version={version}"
        with cache.publishing(target, version, binary.name) as staging:
            go_build(
                go, ["-trimpath", f"-ldflags={ldflags}", "-o", str(staging / "helm"), HELM_PACKAGE],
                tmp, f"building helm {version} with Go (a minute or two on a cold cache)", log, env, target,
            )
        log(f"helm {version} installed in {target}")
        return binary
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def value_args(values_files: tuple[Path | str, ...] = (), set_values: dict[str, object] | None = None) -> list[str]:
    """``--values`` and ``--set``/``--set-string`` arguments: strings stay strings, numbers and booleans are typed."""
    args: list[str] = []
    for f in values_files:
        args += ["--values", str(f)]
    for key, value in (set_values or {}).items():
        if isinstance(value, bool):
            args += ["--set", f"{key}={str(value).lower()}"]
        else:
            escaped = str(value).replace("\\", "\\\\").replace(",", "\\,")  # --set splits on commas
            args += ["--set-string" if isinstance(value, str) else "--set", f"{key}={escaped}"]
    return args


def helm(*args: str, kubeconfig: str | Path | None = None, log: Log = print) -> str:
    """The pinned helm with ``args`` (``template``, ``install``, ``upgrade``, ``uninstall``, ...), against the cluster
    of ``kubeconfig`` when given; its standard output, or :class:`InstallError` with helm's message."""
    cmd = [str(ensure_helm(log)), *args]
    if kubeconfig is not None:
        cmd += ["--kubeconfig", str(kubeconfig)]
    home = str(cache_root() / "helm" / "home")  # keep helm away from the user's repositories/plugins
    env = dict(os.environ, HELM_CACHE_HOME=home, HELM_CONFIG_HOME=home, HELM_DATA_HOME=home)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise InstallError(f"helm {args[0] if args else ''} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def helm_template(
    chart: Path | str,
    *,
    release: str,
    namespace: str,
    values_files: tuple[Path | str, ...] = (),
    set_values: dict[str, object] | None = None,
    include_crds: bool = False,
    log: Log = print,
) -> str:
    """``helm template`` with the pinned helm; returns the rendered YAML or raises with helm's message."""
    extra = ["--include-crds"] if include_crds else []
    return helm("template", release, str(chart), "--namespace", namespace, *value_args(values_files, set_values),
                *extra, log=log)
