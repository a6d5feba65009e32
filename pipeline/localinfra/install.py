"""Installs what the local infrastructure runs, once, cached by version.

- Kafka: the broker's runtime closure resolved by Maven from ``kafka/pom.xml`` into
  ``<cache>/kafka/<version>-<pomhash>/libs``.
- kube-apiserver and etcd: built by Go from ``gobuild/go.mod`` (published modules only) into
  ``<cache>/controlplane/<k8s-version>-<modhash>/``.

A second start finds the cache and takes seconds. Failures say which tool failed and why.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
POM = HERE / "kafka" / "pom.xml"
GOMOD = HERE / "gobuild" / "go.mod"
GOSUM = HERE / "gobuild" / "go.sum"

Log = Callable[[str], None]


class InstallError(RuntimeError):
    """A prerequisite could not be installed; the message says what to do."""


def cache_root() -> Path:
    explicit = os.environ.get("XIDFLOW_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "xidflow"


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def kafka_version() -> str:
    m = re.search(r"<kafka.version>([^<]+)</kafka.version>", POM.read_text())
    if not m:
        raise InstallError(f"{POM}: no <kafka.version> property")
    return m.group(1)


def kubernetes_version() -> str:
    m = re.search(r"^\s*(?:require\s+)?k8s.io/kubernetes (v\S+)", GOMOD.read_text(), re.M)
    if not m:
        raise InstallError(f"{GOMOD}: no 'require k8s.io/kubernetes vX.Y.Z' line")
    return m.group(1)


def _need(tool: str, hint: str) -> str:
    path = shutil.which(tool)
    if not path:
        raise InstallError(f"'{tool}' is not on PATH; {hint}")
    return path


def _run(cmd: list[str], cwd: Path, what: str, log: Log, env: dict[str, str] | None = None) -> None:
    log(f"{what}: {' '.join(cmd[:3])} ... (in {cwd})")
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise InstallError(f"{what} failed (exit {proc.returncode}):\n{tail}")


@dataclass(frozen=True)
class KafkaDist:
    version: str
    libs: Path

    @property
    def classpath(self) -> str:
        return str(self.libs / "*")


def ensure_kafka(log: Log = print) -> KafkaDist:
    """Resolve the Kafka broker's jars with Maven (cached)."""
    version = kafka_version()
    target = cache_root() / "kafka" / f"{version}-{_digest(POM)}"
    libs = target / "libs"
    if (target / ".complete").exists():
        return KafkaDist(version, libs)
    mvn = _need("mvn", "install Java 17 and Maven (Debian: apt-get install openjdk-17-jdk-headless maven)")
    _need("java", "install Java 17 (Debian: apt-get install openjdk-17-jdk-headless)")
    tmp = Path(tempfile.mkdtemp(prefix="xidflow-kafka-"))
    try:
        shutil.copy(POM, tmp / "pom.xml")
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        _run(
            [mvn, "-q", "-B", "dependency:copy-dependencies", f"-DoutputDirectory={staging / 'libs'}",
             "-DincludeScope=runtime"],
            tmp, f"resolving Kafka {version} jars with Maven", log,
        )
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        (target / ".complete").write_text(version)
        log(f"Kafka {version} installed in {target}")
        return KafkaDist(version, libs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class ControlPlaneDist:
    version: str
    kube_apiserver: Path
    etcd: Path


def ensure_controlplane(log: Log = print) -> ControlPlaneDist:
    """Build kube-apiserver and etcd with Go from published modules (cached by version)."""
    version = kubernetes_version()
    target = cache_root() / "controlplane" / f"{version}-{_digest(GOMOD, GOSUM)}"
    dist = ControlPlaneDist(version, target / "kube-apiserver", target / "etcd")
    if (target / ".complete").exists():
        return dist
    go = _need("go", "install Go >= 1.26 (https://go.dev/dl or your distribution)")
    tmp = Path(tempfile.mkdtemp(prefix="xidflow-gobuild-"))
    try:
        shutil.copy(GOMOD, tmp / "go.mod")
        shutil.copy(GOSUM, tmp / "go.sum")
        staging = target.with_name(target.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=mod")
        _run(
            [go, "build", "-trimpath", "-ldflags=-s -w", "-o", str(staging) + "/",
             "k8s.io/kubernetes/cmd/kube-apiserver", "go.etcd.io/etcd/server/v3"],
            tmp, f"building kube-apiserver {version} and etcd with Go (minutes on a cold cache)", log, env,
        )
        (staging / "server").rename(staging / "etcd")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        (target / ".complete").write_text(version)
        log(f"kube-apiserver {version} and etcd installed in {target}")
        return dist
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- `xidflow local install`: the steps, with progress -------------------------------------------------------
@dataclass(frozen=True)
class InstallStep:
    """One thing `xidflow local install` installs: a title and the function that installs it."""

    title: str
    run: Callable[[Log], object]


def install_steps() -> list[InstallStep]:
    """What `xidflow local install` installs, in order. A step added here is shown with the others."""
    return [
        InstallStep("Kafka broker jars (Maven)", ensure_kafka),
        InstallStep("kube-apiserver and etcd (Go build)", ensure_controlplane),
    ]


def run_steps(steps: Sequence[InstallStep], console: Any = None) -> float:
    """Run the steps in order showing "step n/m", a spinner and the elapsed time; returns total seconds.

    On a terminal each step gets a live line (spinner, step n/m, title, elapsed); piped output (CI logs)
    gets one line when a step starts and one when it is done. A failing step stops the rest (its
    ``InstallError`` propagates).
    """
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = console or Console(stderr=True)
    start = time.monotonic()
    total = len(steps)
    if not console.is_terminal:
        for n, step in enumerate(steps, 1):
            t0 = time.monotonic()
            console.print(f"step {n}/{total}: {step.title} ...", highlight=False)
            step.run(lambda msg: console.print(f"  {msg}", highlight=False))
            console.print(f"step {n}/{total}: {step.title} done in {time.monotonic() - t0:.1f}s", highlight=False)
        return time.monotonic() - start
    columns = (
        SpinnerColumn(finished_text="[green]✓[/]"),
        TextColumn("step {task.fields[n]}/{task.fields[m]}"),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        for n, step in enumerate(steps, 1):
            task = progress.add_task(step.title, total=1, n=n, m=total)
            step.run(lambda msg: progress.console.print(f"  [dim]{msg}[/]", highlight=False))
            progress.update(task, completed=1)
    return time.monotonic() - start


# -- Debian packages the project installs itself (rsyslog, promtool, Fluent Bit's build tools) -----------------
def apt_install(packages: Sequence[str], why: str, log: Log) -> None:
    """``apt-get update`` + ``apt-get install`` of ``packages`` where this is a Debian-like machine and we are
    root; otherwise an ``InstallError`` that names the packages to install."""
    hint = f"install Debian's {', '.join(packages)} (apt-get install {' '.join(packages)})"
    apt = shutil.which("apt-get")
    if not apt or os.geteuid() != 0:
        raise InstallError(f"{why} needs {', '.join(packages)}; {hint}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", "--no-install-recommends", *packages]):
        log(f"installing {' '.join(packages)} for {why}: {' '.join(cmd[:3])} ...")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            output = (proc.stdout + proc.stderr)[-2000:]
            raise InstallError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{output}")


def ensure_promtool(log: Log = print) -> Path:
    """Prometheus' promtool (checks and unit-tests the alerting rules), from Debian's ``prometheus`` package."""
    found = shutil.which("promtool")
    if not found:
        apt_install(["prometheus"], "promtool (the alerting rules' checks)", log)
        found = shutil.which("promtool")
        if not found:
            raise InstallError("apt-get installed prometheus but promtool is not on PATH")
        log(f"promtool installed at {found}")
    return Path(found)
