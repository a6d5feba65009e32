"""The real Fluent Bit, for the shipper tests and the demo: built once from vendored source, cached by version.

No package registry this project reaches serves Fluent Bit, so its release source is vendored beside the
checkout (``../shared/vendor/fluent-bit-<version>.tar.xz``, with ``SHA256SUMS``); ``XIDFLOW_VENDOR_DIR``
names another folder. ``ensure_fluent_bit`` returns, in order of preference:

1. ``FLUENT_BIT_BIN`` when set (a user's own build or package): it must run ``--version``;
2. the cached build ``<cache>/fluent-bit/<version>-<options hash>/fluent-bit``;
3. a fresh build: the tarball checked against ``SHA256SUMS``, unpacked, configured with CMake with only the
   plugins the project's configuration uses (tail, kmsg, systemd, grep/lua/kubernetes/record_modifier/
   modify filters, Kafka and stdout outputs) and built with ``make fluent-bit-bin``. Build tools and
   libraries missing on a Debian-like machine where we are root are installed with apt-get (as rsyslog
   is); elsewhere the error names them. A cold build takes minutes on 2 cores; its progress (CMake's
   percentage) is logged every few seconds.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from pipeline.localinfra import cache
from pipeline.localinfra.install import InstallError, Log, _need, apt_install, cache_root, run_logged, user_binary

VERSION = "5.1.1"

# Options that build 5.1.1 with GCC 12 here (simdutf's AVX2 code does not; the vendored tree has no
# sqlite3.c, so the system SQLite is used; SQLDB=Off does not compile in 5.1.1).
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DFLB_ALL=Off", "-DFLB_MINIMAL=On", "-DFLB_USE_SIMDUTF=No", "-DFLB_UNICODE_ENCODER=Off",
    "-DFLB_SQLDB=On", "-DFLB_PREFER_SYSTEM_LIB_SQLITE=On",
    "-DFLB_WASM=Off", "-DFLB_TESTS_RUNTIME=Off", "-DFLB_TESTS_INTERNAL=Off", "-DFLB_EXAMPLES=Off",
    "-DFLB_IN_TAIL=On", "-DFLB_IN_KMSG=On", "-DFLB_IN_SYSTEMD=On", "-DFLB_IN_DUMMY=On",
    # FLB_MINIMAL turns off the internal inputs too: storage_backlog is what reads filesystem-buffered chunks
    # back after a restart ("cannot init storage backlog input plugin" without it), emitter serves multiline.
    "-DFLB_IN_STORAGE_BACKLOG=On", "-DFLB_IN_EMITTER=On",
    "-DFLB_OUT_KAFKA=On", "-DFLB_OUT_STDOUT=On",
    "-DFLB_FILTER_GREP=On", "-DFLB_FILTER_RECORD_MODIFIER=On", "-DFLB_FILTER_MODIFY=On",
    "-DFLB_FILTER_LUA=On", "-DFLB_LUAJIT=On", "-DFLB_FILTER_KUBERNETES=On", "-DFLB_PARSER=On",
)

# What the build needs, as (command or pkg-config module, Debian package).
BUILD_TOOLS = (("cmake", "cmake"), ("make", "make"), ("cc", "build-essential"), ("c++", "build-essential"),
               ("flex", "flex"), ("bison", "bison"), ("pkg-config", "pkg-config"))
BUILD_LIBS = (("yaml-0.1", "libyaml-dev"), ("openssl", "libssl-dev"), ("libsystemd", "libsystemd-dev"),
              ("sqlite3", "libsqlite3-dev"),
              # Cyrus SASL: without it the bundled librdkafka builds SASL PLAIN only (no SCRAM, no OAUTHBEARER)
              # and a kafka output configured for SCRAM-SHA-512 refuses to start.
              ("libsasl2", "libsasl2-dev"))


def vendor_dir() -> Path:
    """Where the vendored source lives: ``$XIDFLOW_VENDOR_DIR``, else ``shared/vendor`` beside the checkout."""
    explicit = os.environ.get("XIDFLOW_VENDOR_DIR")
    if explicit:
        return Path(explicit)
    return Path(__file__).resolve().parents[3] / "shared" / "vendor"


def source_tarball() -> Path:
    return vendor_dir() / f"fluent-bit-{VERSION}.tar.xz"


def fluent_bit_target() -> Path:
    """Where the cached binary of this version and these options lives (built or not)."""
    # The libraries found decide features too (librdkafka's SASL mechanisms), so they are part of the key.
    digest = hashlib.sha256("\n".join((*CMAKE_OPTIONS, *(m for m, _ in BUILD_LIBS))).encode()).hexdigest()[:12]
    return cache_root() / "fluent-bit" / f"{VERSION}-{digest}" / "fluent-bit"


def fluent_bit_installed() -> bool:
    binary = fluent_bit_target()
    return cache.is_complete(binary.parent, binary.name)


def ensure_fluent_bit(log: Log = print) -> Path:
    """The Fluent Bit binary to run: ``$FLUENT_BIT_BIN``, the cached build, or a new build (see module doc)."""
    explicit = user_binary("FLUENT_BIT_BIN", ["--version"], timeout=30)
    if explicit:
        path, answer = explicit
        if "Fluent Bit" not in answer:
            raise InstallError(f"FLUENT_BIT_BIN={path} does not answer `--version` as Fluent Bit does: {answer[:300]}")
        return path
    binary = fluent_bit_target()
    if fluent_bit_installed():
        return binary
    tarball = source_tarball()
    if not tarball.exists():
        raise InstallError(
            f"the Fluent Bit {VERSION} source is not at {tarball}; put the vendored tarball there, point "
            "XIDFLOW_VENDOR_DIR at its folder, or set FLUENT_BIT_BIN to a fluent-bit binary")
    with cache.one_builder(binary.parent):
        if fluent_bit_installed():
            return binary
        _verify_checksum(tarball)
        _ensure_build_prerequisites(log)
        return _build(tarball, binary, log)


def _verify_checksum(tarball: Path) -> None:
    sums = tarball.parent / "SHA256SUMS"
    if not sums.exists():
        raise InstallError(f"{sums} is missing: the vendored Fluent Bit source cannot be checked")
    expected = next((line.split()[0] for line in sums.read_text().splitlines()
                     if line.strip().endswith(tarball.name)), None)
    if not expected:
        raise InstallError(f"{sums} has no line for {tarball.name}")
    actual = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if actual != expected:
        raise InstallError(f"{tarball} has sha256 {actual}, {sums.name} says {expected}: the source was changed")


def missing_build_prerequisites() -> list[str]:
    """The Debian packages whose tool or library the build needs and this machine lacks."""
    missing = [pkg for tool, pkg in BUILD_TOOLS if not shutil.which(tool)]
    pkg_config = shutil.which("pkg-config")
    for module, pkg in BUILD_LIBS:
        if not pkg_config or subprocess.run([pkg_config, "--exists", module]).returncode != 0:
            missing.append(pkg)
    return sorted(set(missing))


def _ensure_build_prerequisites(log: Log) -> None:
    missing = missing_build_prerequisites()
    if not missing:
        return
    apt_install(missing, f"building Fluent Bit {VERSION} (or set FLUENT_BIT_BIN)", log)
    still = missing_build_prerequisites()
    if still:
        raise InstallError(f"apt-get ran but {', '.join(still)} still missing for the Fluent Bit build")


def _build(tarball: Path, binary: Path, log: Log) -> Path:
    target = binary.parent
    tmp = Path(tempfile.mkdtemp(prefix="xidflow-fluentbit-"))
    try:
        log(f"unpacking {tarball.name}")
        with tarfile.open(tarball) as tar:
            tar.extractall(tmp, filter="tar")
        source = next(p for p in tmp.iterdir() if p.is_dir())
        build = source / "build"
        build.mkdir(exist_ok=True)
        cmake = _need("cmake", "install CMake (Debian: apt-get install cmake)")
        run_logged([cmake, *CMAKE_OPTIONS, ".."], build, f"configuring Fluent Bit {VERSION} (CMake)", log,
                   cached_in=target)
        jobs = str(max(1, os.cpu_count() or 1))
        run_logged(["make", f"-j{jobs}", "fluent-bit-bin"], build,
                   f"building Fluent Bit {VERSION} (make, minutes on a cold build)", log, meter=cmake_percent)
        with cache.publishing(target, VERSION, binary.name) as staging:
            shutil.copy2(build / "bin" / "fluent-bit", staging / "fluent-bit")
        log(f"Fluent Bit {VERSION} installed in {target}")
        return binary
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


def cmake_percent(line: str) -> str | None:
    """The progress of a CMake-generated make: its last ``[ NN%]``."""
    m = _PERCENT.match(line)
    return f"{m.group(1)}% done" if m else None
