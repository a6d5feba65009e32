"""Debian's rsyslogd with its Kafka output (omkafka, package ``rsyslog-kafka``), for the shipper tests.

``ensure_rsyslog_kafka`` finds ``rsyslogd`` and ``omkafka.so``; when either is missing on a Debian-like
machine where we are root it installs them with ``apt-get update`` + ``apt-get install`` (what CI's
install step runs through ``xidflow local install``), else it says what to install.

``render_shipped_recipe`` is the shipped ``deploy/rsyslog/60-xidflow.conf`` with only what differs on this
machine changed: the broker list, the topic and librdkafka properties (credentials, a codec under test).
"""

from __future__ import annotations

import glob
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeline.localinfra.install import InstallError, Log, apt_install

PACKAGES = ("rsyslog", "rsyslog-kafka")
SHIPPED_RECIPE = Path(__file__).resolve().parents[2] / "deploy" / "rsyslog" / "60-xidflow.conf"
MODULE_GLOBS = ("/usr/lib/*/rsyslog/omkafka.so", "/usr/lib/rsyslog/omkafka.so", "/usr/lib64/rsyslog/omkafka.so")


@dataclass(frozen=True)
class RsyslogDist:
    rsyslogd: Path
    module_dir: Path


def find_rsyslog_kafka() -> RsyslogDist | None:
    rsyslogd = shutil.which("rsyslogd") or ("/usr/sbin/rsyslogd" if Path("/usr/sbin/rsyslogd").exists() else None)
    if not rsyslogd:
        return None
    for pattern in MODULE_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return RsyslogDist(Path(rsyslogd), Path(found[0]).parent)
    return None


def ensure_rsyslog_kafka(log: Log = print) -> RsyslogDist:
    """rsyslogd and omkafka, installed with apt-get when missing (root only); raises with a hint otherwise."""
    dist = find_rsyslog_kafka()
    if dist:
        return dist
    apt_install(PACKAGES, "rsyslog with omkafka", log)
    dist = find_rsyslog_kafka()
    if not dist:
        raise InstallError(f"apt-get installed {' and '.join(PACKAGES)} but omkafka.so is not where expected")
    log(f"rsyslogd {dist.rsyslogd} with omkafka in {dist.module_dir}")
    return dist


def render_shipped_recipe(brokers: str, topic: str, conf_params: Sequence[str] = (),
                          recipe: Path = SHIPPED_RECIPE) -> str:
    """The shipped recipe with this machine's broker list and topic, and ``conf_params`` added to its librdkafka
    properties (a later property wins in librdkafka, so a codec under test replaces the shipped one)."""
    text = recipe.read_text()
    changes = (
        (r'broker=\[[^\]]*\]', f'broker=["{brokers}"]'),
        (r'topic="[^"]*"', f'topic="{topic}"'),
        (r'confParam=\[([^\]]*)\]', "confParam=[\\1" + "".join(f', "{p}"' for p in conf_params) + "]"),
    )
    for pattern, replacement in changes:
        text, n = re.subn(r"(?<![A-Za-z.])" + pattern, replacement, text)
        if n != 1:
            raise ValueError(f"{recipe}: expected one {pattern!r}, found {n}")
    return text
