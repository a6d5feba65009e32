"""Debian's rsyslogd with its Kafka output (omkafka, package ``rsyslog-kafka``), for the shipper tests.

``ensure_rsyslog_kafka`` finds ``rsyslogd`` and ``omkafka.so``; when either is missing on a Debian-like
machine where we are root it installs them with ``apt-get update`` + ``apt-get install`` (what CI's
install step runs through ``xidflow local install``), else it says what to install.
"""

from __future__ import annotations

import glob
import shutil
from dataclasses import dataclass
from pathlib import Path

from pipeline.localinfra.install import InstallError, Log, apt_install

PACKAGES = ("rsyslog", "rsyslog-kafka")
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
