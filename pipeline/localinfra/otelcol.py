"""A real OpenTelemetry Collector for the shipper tests: built once with the collector builder, cached by version.

What the collector contains is ``otelbuild/manifest.yaml`` (the contrib filelog receiver, the resource and
batch processors, the Kafka exporter, the file_storage extension); ``otelbuild/go.mod`` and ``go.sum`` are
the collector builder's own resolution of that manifest (``go mod tidy`` on its generated sources), kept in
the repository so every build compiles exactly the same module versions, checked against ``go.sum``.

``ensure_otelcol`` returns ``<cache>/otelcol/<version>-<hash of the three files>/otelcol``, building it when
missing (one build at a time, under a lock, like Loki's):

1. the builder (``go run go.opentelemetry.io/collector/cmd/builder@<version>``, the version of the pinned
   core) generates the distribution's sources from the manifest (``--skip-get-modules --skip-compilation``);
2. the pinned ``go.mod``/``go.sum`` replace the generated ``go.mod``;
3. ``go build -mod=readonly -trimpath -ldflags='-s -w'`` with ``CGO_ENABLED=0`` (the builder's own defaults)
   compiles it; a module missing from ``go.sum`` fails the build instead of being resolved anew.

A cold build (modules downloaded, nothing in Go's build cache) takes minutes on 2 cores; progress (elapsed
time and packages compiled) is logged every ``install.PROGRESS_EVERY_S``. ``OTELCOL_BIN`` names a user's own
collector instead (it must have the components the manifest names).

After changing a version in the manifest, ``python -m pipeline.localinfra.otelcol --regenerate`` runs the
builder with its module step and writes the new ``go.mod``/``go.sum`` beside the manifest.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from pipeline.localinfra import cache
from pipeline.localinfra.install import (
    InstallError,
    Log,
    _digest,
    _need,
    cache_root,
    go_build,
    go_build_meter,
    go_env,
    run_logged,
    user_binary,
)

HERE = Path(__file__).parent
OTELBUILD = HERE / "otelbuild"
MANIFEST = OTELBUILD / "manifest.yaml"
OTEL_GOMOD = OTELBUILD / "go.mod"
OTEL_GOSUM = OTELBUILD / "go.sum"
BUILDER = "go.opentelemetry.io/collector/cmd/builder"
CORE = "go.opentelemetry.io/collector/otelcol"

# The components the shipped configuration (deploy/otel-collector/) uses; a user's OTELCOL_BIN must have them.
REQUIRED_COMPONENTS = ("file_log", "resource", "batch", "kafka", "file_storage")



def otelcol_version() -> str:
    """The collector core version pinned in ``otelbuild/go.mod`` (``vX.Y.Z``); the builder runs at it too."""
    m = re.search(rf"^\s*(?:require\s+)?{re.escape(CORE)} (v\S+)", OTEL_GOMOD.read_text(), re.M)
    if not m:
        raise InstallError(f"{OTEL_GOMOD}: no '{CORE} vX.Y.Z' requirement")
    return m.group(1)


def manifest_modules() -> dict[str, str]:
    """``{module path: version}`` of every component and provider the manifest names."""
    doc = yaml.safe_load(MANIFEST.read_text())
    out: dict[str, str] = {}
    for kind in ("receivers", "processors", "exporters", "extensions", "connectors", "providers", "converters"):
        for item in doc.get(kind) or []:
            path, _, version = str(item["gomod"]).strip().partition(" ")
            out[path] = version.strip()
    return out


def check_pins() -> None:
    """Every module the manifest names is required at the same version by the pinned ``go.mod``."""
    gomod = OTEL_GOMOD.read_text()
    wrong = [
        f"{path} {version}"
        for path, version in manifest_modules().items()
        if not re.search(rf"^\s*(?:require\s+)?{re.escape(path)} {re.escape(version)}(?:\s|$)", gomod, re.M)
    ]
    builder = _builder_version_from_manifest()
    if otelcol_version() != builder:
        wrong.append(f"{CORE} {builder} (go.mod has {otelcol_version()})")
    if wrong:
        raise InstallError(
            f"{OTEL_GOMOD} does not pin what {MANIFEST.name} names ({', '.join(wrong)}); run "
            "`python -m pipeline.localinfra.otelcol --regenerate` and commit go.mod/go.sum")


def otelcol_target() -> Path:
    """Where the binary of the pinned build lives (whether or not it is built yet)."""
    digest = _digest(MANIFEST, OTEL_GOMOD, OTEL_GOSUM)
    return cache_root() / "otelcol" / f"{otelcol_version()}-{digest}" / "otelcol"


def otelcol_installed() -> bool:
    binary = otelcol_target()
    return cache.is_complete(binary.parent, binary.name)


def ensure_otelcol(log: Log = print) -> Path:
    """The collector to run: ``$OTELCOL_BIN``, the cached build, or a new build (see the module doc)."""
    explicit = user_binary("OTELCOL_BIN", ["components"])
    if explicit:
        path, answer = explicit
        missing = [c for c in REQUIRED_COMPONENTS if not re.search(rf"\bname: {re.escape(c)}\b", answer)]
        if missing:
            raise InstallError(f"OTELCOL_BIN={path} lacks components {missing} (`{path.name} components`)")
        return path
    binary = otelcol_target()
    if otelcol_installed():
        return binary
    check_pins()
    go = _need("go", "install Go >= 1.25 (https://go.dev/dl or your distribution)")
    target = binary.parent
    with cache.one_builder(target):
        if otelcol_installed():
            return binary
        return _build(go, _builder_version_from_manifest(), binary, log)


def _generate(go: str, version: str, dist: Path, log: Log, *, get_modules: bool) -> None:
    """The builder writes the distribution's sources (and, with ``get_modules``, its tidy go.mod/go.sum)."""
    manifest = dist.parent / "manifest.yaml"
    shutil.copy(MANIFEST, manifest)
    cmd = [go, "run", f"{BUILDER}@{version}", f"--config={manifest}", f"--output-path={dist}",
           "--skip-compilation"]
    if not get_modules:
        cmd.append("--skip-get-modules")
    # The builder makes a default output folder in $TMPDIR even when told another: keep it in ours.
    env = dict(os.environ, CGO_ENABLED="0", TMPDIR=str(dist.parent))
    run_logged(cmd, dist.parent, f"generating the collector's sources with the builder {version}", log, env,
               meter=go_build_meter())


def _build(go: str, version: str, binary: Path, log: Log) -> Path:
    target = binary.parent
    tmp = Path(tempfile.mkdtemp(prefix="xidflow-otelbuild-"))
    try:
        dist = tmp / "dist"
        _generate(go, version, dist, log, get_modules=False)
        shutil.copy(OTEL_GOMOD, dist / "go.mod")
        shutil.copy(OTEL_GOSUM, dist / "go.sum")
        with cache.publishing(target, version, binary.name) as staging:
            go_build(go, ["-trimpath", "-ldflags=-s -w", "-o", str(staging / "otelcol"), "."], dist,
                     f"building the OpenTelemetry Collector {version} with Go (minutes on a cold cache)", log,
                     go_env(), cached_in=target)
        log(f"OpenTelemetry Collector {version} installed in {target}")
        return binary
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def regenerate(log: Log = print) -> None:
    """Run the builder with its module step and write its go.mod/go.sum beside the manifest."""
    go = _need("go", "install Go >= 1.25")
    version = _builder_version_from_manifest()
    tmp = Path(tempfile.mkdtemp(prefix="xidflow-otelgen-"))
    try:
        dist = tmp / "dist"
        _generate(go, version, dist, log, get_modules=True)
        for name in ("go.mod", "go.sum"):
            shutil.copy(dist / name, OTELBUILD / name)
        log(f"wrote {OTEL_GOMOD} and {OTEL_GOSUM} (builder {version})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _builder_version_from_manifest() -> str:
    """The builder runs at the release of the manifest's core components (``go.opentelemetry.io/collector/...``
    modules at v0.x)."""
    core = {v for p, v in manifest_modules().items() if p.startswith("go.opentelemetry.io/collector/") and
            v.startswith("v0.")}
    if len(core) != 1:
        raise InstallError(f"{MANIFEST}: the core components' v0 versions disagree or are missing: {sorted(core)}")
    return core.pop()


if __name__ == "__main__":
    if sys.argv[1:] == ["--regenerate"]:
        regenerate()
    elif not sys.argv[1:]:
        print(ensure_otelcol())
    else:
        sys.exit("usage: python -m pipeline.localinfra.otelcol [--regenerate]")
