"""Run the real Fluent Bit on the project's shipped configuration (tests and the demo).

``render_shipped_config`` takes ``deploy/fluent-bit/fluent-bit.yaml`` as a user would deploy it and
changes only what differs between a GPU node and this machine: file paths (storage, tail databases,
the container log glob, Fabric Manager's log file), the HTTP listener (loopback, a free port), topic names
(the configurable prefix), Kafka and API server credentials, and, because tests never write to ``/dev/kmsg``, the kernel
input: the ``kmsg`` input becomes the ``tail`` input the shipped file documents for kernel lines from a
file, with one of its shipped parsers. ``shipped_config_drift`` lists every other difference, so a
test can prove the two cannot drift apart.

``FluentBit`` is one process of it (one per simulated node, like the DaemonSet): ``NODE_NAME`` and
``KAFKA_BROKERS`` come from the environment exactly as in the DaemonSet.
"""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import orjson
import yaml

from pipeline.localinfra import procs
from pipeline.localinfra.fluentbit import ensure_fluent_bit
from pipeline.localinfra.install import Log

SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "fluent-bit" / "fluent-bit.yaml"

KernelSource = Literal["kmsg", "file-lines", "file-kmsg"]
# The shipped parser for each kind of kernel file (see the comment above `parsers:` in the shipped file).
KERNEL_FILE_PARSERS: dict[str, str] = {"file-lines": "xidflow-kernel-line", "file-kmsg": "xidflow-kmsg-record"}

FABRIC_MANAGER_TAG = "kernel.fabricmanager"
"""The tag of the shipped tail input of Fabric Manager's log; ``KERNEL_MATCH`` routes it with the kernel's lines."""
KERNEL_MATCH = "kernel*"
"""The match of the kernel topic's filters and output: the ``kernel`` input and Fabric Manager's."""

# (section path, key) pairs the rendering may change; anything else is drift.
ALLOWED_CHANGES = frozenset({
    "service.storage.path", "service.http_listen", "service.http_port",
    "input[kernel]", "input[kube.*].path", "input[kube.*].db", "input[kube.*].read_from_head",
    "input[kube.*].refresh_interval",
    # Fabric Manager's log: the file and its tail database move under the test's root, read as soon as written.
    f"input[{FABRIC_MANAGER_TAG}].path", f"input[{FABRIC_MANAGER_TAG}].db",
    f"input[{FABRIC_MANAGER_TAG}].read_from_head", f"input[{FABRIC_MANAGER_TAG}].refresh_interval",
    "filter[kubernetes].kube_url", "filter[kubernetes].kube_ca_file", "filter[kubernetes].kube_token_file",
    "filter[kubernetes].kube_meta_cache_ttl",
    # The tail input's tag is `kube.` + the file's path with '/' as '.': the prefix follows the moved glob.
    "filter[kubernetes].kube_tag_prefix",
    f"output[{KERNEL_MATCH}].topics", "output[kube.*].topics",
    # The codec is what the codec tests vary (every codec Kafka allows must reach the worker).
    f"output[{KERNEL_MATCH}].rdkafka.compression.codec", "output[kube.*].rdkafka.compression.codec",
})
# Output keys that carry Kafka credentials or the codec under test (librdkafka properties).
RDKAFKA_PREFIX = "rdkafka."


@dataclass
class Render:
    """What differs between a GPU node and a test on this machine."""

    root: Path
    kernel_source: KernelSource = "file-lines"
    kernel_glob: str | None = None  # default: <root>/kernel/*.log
    containers_glob: str | None = None  # default: <root>/containers/*.log
    fabric_manager_log: str | None = None  # default: <root>/fabricmanager/fabricmanager.log
    kernel_topic: str = "gpu.logs.kernel"
    pods_topic: str = "gpu.logs.pods"
    http_port: int = 0
    kube: Mapping[str, str] | None = None  # kube_url, kube_ca_file, kube_token_file
    rdkafka: Mapping[str, str] = field(default_factory=dict)  # e.g. security settings, compression.codec


def kube_tag_prefix(containers_dir: str) -> str:
    """The tag prefix the ``kube.*`` tail input gives files in ``containers_dir``.

    Fluent Bit's tail input (``tag_compose`` in ``plugins/in_tail/tail_file.c``) appends the file's path to
    the tag's prefix, turns ``/``, ``\\`` and ``:`` into ``.``, drops ``*`` and collapses a run of dots into
    one, so a dot-leading folder such as ``~/.cache`` loses its dot: ``/root/.cache/c`` ->
    ``kube.root.cache.c.``, ``/var/log/containers`` -> ``kube.var.log.containers.``. The kubernetes filter
    finds no pod in a tag that does not start with its ``kube_tag_prefix`` and adds no metadata, silently.
    This imitates a real program, so ``tests/integration/test_fluent_bit_tags.py`` holds it against the real
    Fluent Bit's tags for paths with dot components, spaces, colons and long names.
    """
    tag = "kube." + containers_dir.replace("*", "") + "/"
    tag = re.sub(r"[/\\:]", ".", tag)
    return re.sub(r"\.{2,}", ".", tag)


def load_shipped(path: Path = SHIPPED_CONFIG) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def render_shipped_config(render: Render, shipped: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The shipped configuration with only this machine's paths, ports, topics and credentials changed."""
    config = copy.deepcopy(dict(shipped or load_shipped()))
    root = render.root
    service = config["service"]
    service["storage.path"] = f"{root / 'flb-storage'}/"
    service["http_listen"] = "127.0.0.1"
    service["http_port"] = render.http_port
    pipeline = config["pipeline"]
    for i, inp in enumerate(pipeline["inputs"]):
        if inp["tag"] == "kernel" and render.kernel_source != "kmsg":
            # The documented file form of the kernel input (tests never write to /dev/kmsg).
            pipeline["inputs"][i] = {
                "name": "tail", "tag": "kernel",
                "path": render.kernel_glob or str(root / "kernel" / "*.log"),
                "parser": KERNEL_FILE_PARSERS[render.kernel_source],
                "db": str(root / "tail-kernel.db"),
                "read_from_head": "true",
                "refresh_interval": 1,
                "storage.type": inp.get("storage.type", "filesystem"),
            }
        elif inp["tag"] == FABRIC_MANAGER_TAG:
            inp["path"] = render.fabric_manager_log or str(root / "fabricmanager" / "fabricmanager.log")
            inp["db"] = str(root / "tail-fabricmanager.db")
            inp["read_from_head"] = "true"
            inp["refresh_interval"] = 1
        elif inp["name"] == "tail":
            inp["path"] = render.containers_glob or str(root / "containers" / "*.log")
            inp["db"] = str(root / "tail-containers.db")
            inp["read_from_head"] = "true"  # files the test creates before Fluent Bit starts are read too
            inp["refresh_interval"] = 1
    containers_dir = os.path.dirname(render.containers_glob or str(root / "containers" / "*.log"))
    for flt in pipeline["filters"]:
        if flt["name"] == "kubernetes":
            flt["kube_tag_prefix"] = kube_tag_prefix(containers_dir)
            if render.kube:
                flt.update(render.kube)
                flt["kube_meta_cache_ttl"] = "5s"
    for out in pipeline["outputs"]:
        out["topics"] = render.kernel_topic if out["match"] == KERNEL_MATCH else render.pods_topic
        out.update({f"{RDKAFKA_PREFIX}{k}": v for k, v in render.rdkafka.items()})
    return config


def _entries(config: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten a config to ``section[id].key -> value`` (inputs/outputs by match/tag, filters by name)."""
    flat: dict[str, Any] = {f"service.{k}": v for k, v in config.get("service", {}).items()}
    pipeline = config.get("pipeline", {})
    for kind, key in (("input", "tag"), ("output", "match")):
        for item in pipeline.get(f"{kind}s", []):
            if kind == "input" and item.get("tag") == "kernel":
                flat["input[kernel]"] = item  # the one input a test may replace as a whole
                continue
            for k, v in item.items():
                flat[f"{kind}[{item[key]}].{k}"] = v
    for n, item in enumerate(pipeline.get("filters", [])):
        ident = item["name"] if item["name"] in ("kubernetes", "record_modifier") else f"{item['name']}#{n}"
        for k, v in item.items():
            flat[f"filter[{ident}].{k}"] = v
    for item in config.get("parsers", []):
        for k, v in item.items():
            flat[f"parser[{item['name']}].{k}"] = v
    return flat


def shipped_config_drift(rendered: Mapping[str, Any], shipped: Mapping[str, Any] | None = None) -> list[str]:
    """Every difference between ``rendered`` and the shipped file outside the allowed substitutions."""
    a, b = _entries(shipped or load_shipped()), _entries(rendered)
    drift = []
    for key in sorted(set(a) | set(b)):
        if a.get(key) == b.get(key) or key in ALLOWED_CHANGES:
            continue
        if key.startswith("output[") and key.split("].", 1)[1].startswith(RDKAFKA_PREFIX) and key not in a:
            continue  # an added librdkafka property: credentials, or the codec under test
        drift.append(f"{key}: shipped {a.get(key)!r}, rendered {b.get(key)!r}")
    return drift


class FluentBit:
    """One Fluent Bit process (one simulated node) on a rendered configuration under ``root``."""

    def __init__(self, root: Path, node: str, brokers: str, render: Render | None = None,
                 extra_env: Mapping[str, str] | None = None, log: Log = print) -> None:
        self.root, self.node, self.brokers = Path(root), node, brokers
        self.root.mkdir(parents=True, exist_ok=True)
        self.render = render or Render(root=self.root)
        self.render.http_port = self.render.http_port or procs.free_port()
        (self.root / "kernel").mkdir(exist_ok=True)
        (self.root / "containers").mkdir(exist_ok=True)
        (self.root / "fabricmanager").mkdir(exist_ok=True)
        self.config_path = self.root / "fluent-bit.yaml"
        self.config_path.write_bytes(yaml.safe_dump(render_shipped_config(self.render), sort_keys=False).encode())
        self.extra_env = dict(extra_env or {})
        self.binary = ensure_fluent_bit(log)
        self.log_file = self.root / "fluent-bit.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.render.http_port}"

    def env(self) -> dict[str, str]:
        return {**os.environ, "NODE_NAME": self.node, "KAFKA_BROKERS": self.brokers, **self.extra_env}

    def dry_run(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.binary), "-c", str(self.config_path), "--dry-run"],
                              capture_output=True, text=True, env=self.env(), timeout=60)

    def start(self, timeout: float = 30.0, new_session: bool = False) -> FluentBit:
        """Start and wait for the health endpoint; ``new_session``: out of the terminal's process group
        (a Ctrl-C then reaches only the caller, which stops the process itself)."""
        out = self.log_file.open("ab")
        self.proc = subprocess.Popen([str(self.binary), "-c", str(self.config_path)], stdout=out,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env(),
                                     cwd=self.root, start_new_session=new_session)
        out.close()
        procs.wait_until(self._healthy, timeout, "Fluent Bit", self.proc.pid, self.log_file)
        return self

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.HTTPError):
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metrics(self) -> dict[str, Any]:
        """Fluent Bit's own counters (``/api/v1/metrics``): records in and out per plugin."""
        with urllib.request.urlopen(f"{self.url}/api/v1/metrics", timeout=5) as r:
            return orjson.loads(r.read())

    def output_records(self) -> int:
        """Records the Kafka outputs have taken so far (``proc_records``).

        Fluent Bit's kafka output counts a record once librdkafka has queued it, before the broker answers: a
        delivery that fails after that is only a ``message delivery failed`` warning in the log (a refusal
        librdkafka already knows of at produce time is an error and a dropped record). Prove delivery by
        reading the topic."""
        return sum(int(v.get("proc_records", 0)) for v in self.metrics().get("output", {}).values())

    def write(self, name: str, *lines: str, folder: str = "kernel") -> Path:
        """Append lines to ``<root>/<folder>/<name>`` (created on first use), as a logging program would."""
        path = self.root / folder / name
        procs.append_lines(path, lines)
        return path

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        procs.terminate(self.proc, timeout, sig)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log_tail(self, lines: int = 40) -> str:
        return procs.tail(self.log_file, lines) if self.log_file.exists() else "(no log)"

    def wait_delivered(self, count: int, timeout: float = 60.0) -> int:
        """Wait until the outputs report at least ``count`` records taken (see ``output_records``); returns
        the count seen."""
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            try:
                seen = self.output_records()
            except (OSError, urllib.error.HTTPError, ValueError):
                seen = seen
            if seen >= count:
                return seen
            time.sleep(0.5)
        raise TimeoutError(f"Fluent Bit delivered {seen} of {count} records in {timeout:.0f}s:\n{self.log_tail()}")
