"""Installs what the local infrastructure runs, once, cached by version.

- Kafka: the broker's runtime closure resolved by Maven from ``kafka/pom.xml`` into
  ``<cache>/kafka/<version>-<pomhash>/libs``.
- kube-apiserver, kube-controller-manager, kube-scheduler, etcd and kubectl: one Go build of ``gobuild/go.mod``
  (published modules only; ``gobuild/regen.sh`` writes it) into ``<cache>/controlplane/<k8s-version>-<modhash>/``.
- KWOK (the node and pod simulator): built by Go from ``kwokbuild/go.mod`` into
  ``<cache>/kwok/<version>-<modhash>/``, with the module's own ``kustomize/stage`` and ``kustomize/rbac``
  files copied beside it (:mod:`pipeline.localinfra.kwok` configures it from them).

A second start finds the cache and takes seconds. Failures say which tool failed and why. A long
build or resolve says where its result is cached and logs its elapsed time and progress (packages
built, files downloaded, CMake's percentage) every ``PROGRESS_EVERY_S`` seconds: ``run_logged``.
"""

from __future__ import annotations

import hashlib
import os
import queue
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pipeline.localinfra import cache

HERE = Path(__file__).parent
POM = HERE / "kafka" / "pom.xml"
GOMOD = HERE / "gobuild" / "go.mod"
GOSUM = HERE / "gobuild" / "go.sum"
KWOK_GOMOD = HERE / "kwokbuild" / "go.mod"
KWOK_GOSUM = HERE / "kwokbuild" / "go.sum"
KWOK_MODULE = "sigs.k8s.io/kwok"

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


# -- running a long build or resolve, with progress ------------------------------------------------------
PROGRESS_EVERY_S = 10.0
"""How often a running install step logs its elapsed time and progress."""

Meter = Callable[[str], str | None]
"""Reads one line of a child's output; returns what its progress is now ("312 packages"), None: unchanged."""


def run_logged(cmd: Sequence[str], cwd: Path, what: str, log: Log, env: dict[str, str] | None = None, *,
               meter: Meter | None = None, cached_in: Path | None = None, every: float | None = None) -> None:
    """Run ``cmd`` streaming its output; log the elapsed time and the meter's progress every ``every`` seconds.

    The one runner of every install step (Maven, the Go builds, Fluent Bit's CMake and make). A line
    says what runs, where, and where the result is cached; a progress line follows every ``every``
    seconds (``PROGRESS_EVERY_S``) even when the child prints nothing; a last line says how long it
    took. A failure raises ``InstallError`` with the end of the child's output.
    """
    every = PROGRESS_EVERY_S if every is None else every
    where = f"in {cwd}" + (f"; cached in {cached_in}" if cached_in else "")
    log(f"{what}: {' '.join(str(c) for c in cmd[:3])} ... ({where})")
    t0 = time.monotonic()
    tail: deque[str] = deque(maxlen=60)
    progress: str | None = None
    lines: queue.Queue[str | None] = queue.Queue()
    with subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        assert proc.stdout is not None
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        next_report = t0 + every
        while True:
            try:
                line = lines.get(timeout=max(0.0, next_report - time.monotonic()))
            except queue.Empty:
                line = ""
            if line is None:  # the child closed its output
                break
            if line:
                tail.append(line)
                if meter is not None:
                    progress = meter(line) or progress
            now = time.monotonic()
            if now >= next_report:
                log(f"  ... {now - t0:.0f}s" + (f", {progress}" if progress else ""))
                next_report = now + every
        rc = proc.wait()
    if rc != 0:
        text = "\n".join(tail)[-3000:]
        raise InstallError(f"{what} failed (exit {rc}):\n{text}")
    log(f"  {what}: done in {time.monotonic() - t0:.0f}s" + (f" ({progress})" if progress else ""))


def _pump(stream: IO[bytes], lines: queue.Queue[str | None]) -> None:
    try:
        for raw in stream:
            lines.put(raw.decode(errors="replace").rstrip("\r\n"))
    finally:
        lines.put(None)


def go_build_meter() -> Meter:
    """``go build -v`` prints each package as it builds it, ``go: downloading M V`` for each module fetched."""
    counts = {"modules": 0, "packages": 0}

    def meter(line: str) -> str | None:
        text = line.strip()
        if text.startswith("go: downloading "):
            counts["modules"] += 1
        elif text and " " not in text and not text.startswith(("#", "go:")):
            counts["packages"] += 1
        else:
            return None
        parts = [f"{counts['modules']} modules downloaded"] if counts["modules"] else []
        return ", ".join([*parts, f"{counts['packages']} packages built"])

    return meter


def go_env() -> dict[str, str]:
    """The environment of a pinned Go build: static binaries, and ``-mod=readonly`` (the user's other GOFLAGS kept).

    A module missing from the committed ``go.sum`` fails the build instead of being resolved anew: what is
    compiled is exactly what the repository pins.
    """
    flags = " ".join(f for f in os.environ.get("GOFLAGS", "").split() if not f.startswith("-mod="))
    return dict(os.environ, CGO_ENABLED="0", GOFLAGS=f"{flags} -mod=readonly".strip())


def go_build(go: str, args: Sequence[str], cwd: Path, what: str, log: Log, env: dict[str, str],
             cached_in: Path) -> None:
    """``go build -v ARGS``, its progress counted in packages built."""
    run_logged([go, "build", "-v", *args], cwd, what, log, env, meter=go_build_meter(), cached_in=cached_in)


def maven_meter() -> Meter:
    """Maven in batch mode logs ``Downloaded from <repository>: ...`` for each file it fetches."""
    count = 0

    def meter(line: str) -> str | None:
        nonlocal count
        if "Downloaded from " not in line:
            return None
        count += 1
        return f"{count} files downloaded"

    return meter


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
    if cache.is_complete(target, libs.name):
        return KafkaDist(version, libs)
    mvn = _need("mvn", "install Java 17 and Maven (Debian: apt-get install openjdk-17-jdk-headless maven)")
    _need("java", "install Java 17 (Debian: apt-get install openjdk-17-jdk-headless)")
    tmp = Path(tempfile.mkdtemp(prefix="xidflow-kafka-"))
    try:
        shutil.copy(POM, tmp / "pom.xml")
        with cache.publishing(target, version, libs.name) as staging:
            run_logged(
                [mvn, "-B", "dependency:copy-dependencies", f"-DoutputDirectory={staging / libs.name}",
                 "-DincludeScope=runtime"],
                tmp, f"resolving Kafka {version} jars with Maven", log, meter=maven_meter(), cached_in=target,
            )
        log(f"Kafka {version} installed in {target}")
        return KafkaDist(version, libs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class ControlPlaneDist:
    version: str
    kube_apiserver: Path
    etcd: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path  # not run by `local up`: the tests hold xidflow's kubectl-style output against the real one

    @property
    def binaries(self) -> tuple[Path, ...]:
        return (self.kube_apiserver, self.etcd, self.kube_controller_manager, self.kube_scheduler, self.kubectl)


CONTROLPLANE_PACKAGES = (
    "k8s.io/kubernetes/cmd/kube-apiserver",
    "k8s.io/kubernetes/cmd/kube-controller-manager",
    "k8s.io/kubernetes/cmd/kube-scheduler",
    "k8s.io/kubernetes/cmd/kubectl",
    "go.etcd.io/etcd/server/v3",
)
"""What the one Go build of ``gobuild/go.mod`` compiles (its ``tool`` lines; ``gobuild/regen.sh`` writes both)."""


def controlplane_target() -> Path:
    return cache_root() / "controlplane" / f"{kubernetes_version()}-{_digest(GOMOD, GOSUM)}"


def build_pinned_go(target: Path, stamp: str, files: Sequence[str], gomod: Path, gosum: Path,
                    build: Callable[[str, Path, Path], None]) -> None:
    """Publish ``target`` with ``files`` unless it is complete: ``build(go, module_dir, staging)`` runs in a
    folder holding copies of the pinned ``gomod``/``gosum``, one builder of ``target`` at a time (a second
    caller waits, then finds it complete), into a staging folder published whole."""
    if cache.is_complete(target, *files):
        return
    go = _need("go", "install Go >= 1.26 (https://go.dev/dl or your distribution)")
    with cache.one_builder(target):
        if cache.is_complete(target, *files):
            return
        tmp = Path(tempfile.mkdtemp(prefix=f"xidflow-{target.parent.name}-build-"))
        try:
            shutil.copy(gomod, tmp / "go.mod")
            shutil.copy(gosum, tmp / "go.sum")
            with cache.publishing(target, stamp, *files) as staging:
                build(go, tmp, staging)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def ensure_controlplane(log: Log = print) -> ControlPlaneDist:
    """Build kube-apiserver, kube-controller-manager, kube-scheduler, etcd and kubectl with Go, in one build
    from published modules (cached by version)."""
    version = kubernetes_version()
    target = controlplane_target()
    dist = ControlPlaneDist(version, target / "kube-apiserver", target / "etcd", target / "kube-controller-manager",
                            target / "kube-scheduler", target / "kubectl")

    def build(go: str, module: Path, staging: Path) -> None:
        go_build(go, ["-trimpath", "-ldflags=-s -w", "-o", str(staging) + "/", *CONTROLPLANE_PACKAGES], module,
                 f"building the control plane {version} (kube-apiserver, kube-controller-manager, kube-scheduler), "
                 "etcd and kubectl with Go (minutes on a cold cache)", log, go_env(), target)
        (staging / "server").rename(staging / dist.etcd.name)
        log(f"kube-apiserver, kube-controller-manager, kube-scheduler, kubectl {version} and etcd built for {target}")

    build_pinned_go(target, version, [b.name for b in dist.binaries], GOMOD, GOSUM, build)
    return dist


@dataclass(frozen=True)
class KwokDist:
    """The KWOK binary and, beside it, the module's own ``kustomize/stage`` and ``kustomize/rbac`` files."""

    version: str
    binary: Path

    @property
    def module_files(self) -> Path:
        return self.binary.parent / "module"


KWOK_MODULE_DIRS = ("kustomize/stage", "kustomize/rbac")
"""The folders of the KWOK module copied beside the binary: its Stage YAML and its controller's ClusterRole."""


def kwok_version() -> str:
    """The KWOK version pinned in ``kwokbuild/go.mod`` (``vX.Y.Z``)."""
    m = re.search(rf"^\s*(?:require\s+)?{re.escape(KWOK_MODULE)} (v\S+)", KWOK_GOMOD.read_text(), re.M)
    if not m:
        raise InstallError(f"{KWOK_GOMOD}: no '{KWOK_MODULE} vX.Y.Z' requirement")
    return m.group(1)


def ensure_kwok(log: Log = print) -> KwokDist:
    """Build KWOK with Go from its published module (cached by version); copy the module's stages and role.

    KWOK has a module graph of its own (its ``k8s.io`` and OpenTelemetry versions are not the API
    server's), so it is built from ``kwokbuild/go.mod`` rather than ``gobuild/go.mod``: sharing would
    change what the control plane compiles.
    """
    version = kwok_version()
    target = cache_root() / "kwok" / f"{version}-{_digest(KWOK_GOMOD, KWOK_GOSUM)}"
    dist = KwokDist(version, target / "kwok")

    def build(go: str, module: Path, staging: Path) -> None:
        env = go_env()
        go_build(go, ["-trimpath", "-ldflags=-s -w", "-o", str(staging / dist.binary.name), f"{KWOK_MODULE}/cmd/kwok"],
                 module, f"building KWOK {version} with Go (minutes on a cold cache)", log, env, target)
        source = _module_dir(go, module, env, KWOK_MODULE)
        for folder in KWOK_MODULE_DIRS:
            # The module cache is read-only: copies that are not would stay removable.
            shutil.copytree(source / folder, staging / dist.module_files.name / folder, copy_function=shutil.copyfile)
        log(f"KWOK {version} built for {target}")

    files = [dist.binary.name, *(f"{dist.module_files.name}/{d}" for d in KWOK_MODULE_DIRS)]
    build_pinned_go(target, version, files, KWOK_GOMOD, KWOK_GOSUM, build)
    return dist


def _module_dir(go: str, build_dir: Path, env: dict[str, str], module: str) -> Path:
    """Where Go unpacked ``module`` for the build in ``build_dir`` (``go list -m``)."""
    proc = subprocess.run([go, "list", "-m", "-f", "{{.Dir}}", module], cwd=build_dir, env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise InstallError(f"`go list -m {module}` failed (exit {proc.returncode}): {proc.stderr.strip()[-1000:]}")
    return Path(proc.stdout.strip())


@dataclass(frozen=True)
class InstallStep:
    """One thing `xidflow local install` installs: a title and the function that installs it."""

    title: str
    run: Callable[[Log], object]


def install_steps() -> list[InstallStep]:
    """What `xidflow local install` installs, in order. A step added here is shown with the others."""
    return [
        InstallStep("Kafka broker jars (Maven)", ensure_kafka),
        InstallStep("Kubernetes control plane and etcd (Go build)", ensure_controlplane),
        InstallStep("KWOK, the node and pod simulator (Go build)", ensure_kwok),
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


# -- a binary the user names instead of the project's build ---------------------------------------------------
def user_binary(env_var: str, probe: Sequence[str], timeout: float = 60.0) -> tuple[Path, str] | None:
    """The binary ``$env_var`` names (None when unset) and what it printed when run with ``probe``.

    An unset variable means "build it"; a set one must be an executable file that answers ``probe``
    (exit 0), else an ``InstallError`` that names the variable. The caller checks the answer's text.
    """
    value = os.environ.get(env_var)
    if not value:
        return None
    path = Path(value)
    if not path.is_file() or not os.access(path, os.X_OK):
        raise InstallError(f"{env_var}={path} is not an executable file")
    try:
        proc = subprocess.run([str(path), *probe], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise InstallError(f"{env_var}={path} did not answer `{path.name} {' '.join(probe)}` within "
                           f"{timeout:.0f}s: is it the program named?") from None
    answer = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        raise InstallError(f"{env_var}={path} failed `{path.name} {' '.join(probe)}` (exit {proc.returncode}): "
                           f"{answer[:300]}")
    return path, proc.stdout


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
