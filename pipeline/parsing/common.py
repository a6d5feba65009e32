"""Helpers shared by the kernel and pod parsers: PCI addresses and line-prefix sanity."""

from __future__ import annotations

import re

# Linux prints the PCI domain with %04x, so a domain is 4 hex digits or more (VMD domains are 5).
PCI_PATTERN = r"(?:[0-9A-Fa-f]{4,8}:)?[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?"

_PCI_RE = re.compile(r"(?:PCI:)?(?:([0-9A-Fa-f]{4,8}):)?([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})(?:\.([0-7]))?")


def normalize_pci(raw: str) -> str | None:
    """``PCI:0000:4E:00`` -> ``0000:4e:00.0``: lowercase ``dddd:bb:dd.f``, domain 0000 and f=0 when absent.

    Returns None when ``raw`` is not a PCI address.
    """
    m = _PCI_RE.fullmatch(raw.strip())
    if m is None:
        return None
    domain, bus, device, function = m.groups()
    domain = (domain or "0000").lower()
    if len(domain) < 4:
        domain = domain.rjust(4, "0")
    return f"{domain}:{bus.lower()}:{device.lower()}.{function or '0'}"


# Characters that never occur in the prefix a kernel/syslog/journald/dmesg line puts before the
# driver's text, but always occur when the driver's text is quoted: a shell command grepping for
# "NVRM: Xid", an audit EXECVE record (a1="..."), sudo's COMMAND=..., a JSON string.
_QUOTING_CHARS = frozenset("\"'=|$`\\")

# A syslog / journald-short header names the program that wrote the line. Only the kernel writes
# these messages; another program's line that quotes them (a monitoring agent, a script) is not one.
_SYSLOG_TAG_RE = re.compile(
    r"^\s*(?:<\d{1,3}>\d?\s*)?"
    r"(?:[A-Z][a-z]{2} [ \d]?\d \d\d:\d\d:\d\d(?:\.\d+)?|\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d\S*)"
    r"\s+\S+\s+(?P<tag>[^\s:\[]+)(?:\[\d+\])?:\s"
)
_KERNEL_TAGS = frozenset({"kernel", "vmunix"})


def prefix_is_kernel(prefix: str) -> bool:
    """True when ``prefix`` (the text before the driver's marker) can be a kernel log prefix.

    Accepts dmesg ``[538441.007373] ``, ``dmesg -T`` ``[Thu Jul  4 11:09:40 2024] ``, syslog
    ``Nov 21 23:11:02 host kernel: ``, journald short, kmsg records ``6,1234,5678,-;``, ``dmesg -x``
    ``kern  :err   : `` and nothing at all. Rejects prefixes that quote the text or that name a
    program other than the kernel.
    """
    if not prefix:
        return True
    if not _QUOTING_CHARS.isdisjoint(prefix):
        return False
    m = _SYSLOG_TAG_RE.match(prefix)
    if m is not None and m.group("tag") not in _KERNEL_TAGS:
        return False
    return True
