"""Helpers shared by the kernel and pod parsers: PCI addresses and line-prefix sanity (the kernel's, Fabric
Manager's)."""

from __future__ import annotations

import re

# Linux prints the PCI domain with %04x, so a domain is 4 hex digits or more (VMD domains are 5).
PCI_PATTERN = r"(?:[0-9A-Fa-f]{4,8}:)?[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?"

_PCI_RE = re.compile(r"(?:PCI:)?(?:([0-9A-Fa-f]{4,8}):)?([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})(?:\.([0-7]))?")


def normalize_pci(raw: str) -> str | None:
    """``PCI:0000:4E:00`` -> ``0000:4e:00.0``: lowercase ``dddd:bb:dd.f``, domain 0000 and f=0 when absent,
    an 8-digit domain (``00000000:86:00.0``, Fabric Manager's form) folded to Linux's ``%04x``.

    Returns None when ``raw`` is not a PCI address.
    """
    m = _PCI_RE.fullmatch(raw.strip())
    if m is None:
        return None
    domain, bus, device, function = m.groups()
    # Linux prints "%04x" (a VMD domain has 5 digits); Fabric Manager and nvidia-smi print 8 ("00000000").
    domain = f"{int(domain, 16):04x}" if domain else "0000"
    return f"{domain}:{bus.lower()}:{device.lower()}.{function or '0'}"


# Characters that never occur in the prefix a kernel/syslog/journald/dmesg line puts before the
# driver's text, but always occur when the driver's text is quoted: a shell command grepping for
# "NVRM: Xid", an audit EXECVE record (a1="..."), sudo's COMMAND=..., a JSON string.
_QUOTING_CHARS = frozenset("\"'=|$`\\")

# What may stand before the driver's text on a line the kernel wrote, left to right, each part optional:
#   syslog priority "<4>" (RFC 5424 adds a version digit), a /dev/kmsg record header "6,1234,5678,-;",
#   a syslog / journald header ending in the kernel's tag ("Nov 21 23:11:02 host kernel: ",
#   "2024-07-04T11:09:40+00:00 host kernel: ", RFC 5424 "... host kernel - - - ", bare "kernel: "; every
#   journalctl -o short* mode: short-iso "2024-07-04T11:09:40+0000 host kernel: ", short-precise
#   "Jul 04 11:09:40.123456 host kernel: ", short-monotonic "[538441.007373] host kernel: ", short-full
#   "Thu 2024-07-04 11:09:40 UTC host kernel: ", short-unix "1720091380.123456 host kernel: "), Talos's kernel
#   log ("node: kern: warning: [2026-04-22T21:25:20.505406921Z]: ", node optional) or a bare timestamp
#   (dmesg --time-format iso), dmesg -x / --decode "kern  :err   : " (any syslog facility: an agent that
#   re-logs the driver's line into /dev/kmsg writes it as "user  :err   : " or "daemon:warn  : "), and
#   bracketed stamps ("[538441.007373] ", dmesg -T "[Thu Jul  4 11:09:40 2024] ", printk caller "[T1234] ").
# Anything else -- another program's tag ("alertmanager[12]: "), a log level ("WARN "), words ending in a
# colon ("ALERT: node-3: ") -- means a userspace program is quoting the kernel's text: not a fault.
_TOKEN = r"""[^\s:"'=|$`\\]+(?::[^\s:"'=|$`\\]+)*"""  # no quoting chars, never ends with ':'
_ISO_TS = r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?"
# util-linux dmesg -x / --decode prints "%-6s:%-6s: " of the record's facility and level names (its
# facility_names and level_names tables: tests/expected/dmesg/decode in util-linux).
DMESG_FACILITIES = ("kern", "user", "mail", "daemon", "auth", "syslog", "lpr", "news", "uucp", "cron", "authpriv",
                    "ftp", "res0", "res1", "res2", "res3", *(f"local{n}" for n in range(8)))
DMESG_LEVELS = ("emerg", "alert", "crit", "err", "warn", "notice", "info", "debug")
_DMESG_DECODE = r"(?:(?:" + "|".join(DMESG_FACILITIES) + r")\s*:\s*(?:" + "|".join(DMESG_LEVELS) + r")\s*:\s*)"
# Before everything: a /dev/kmsg record header ("6,1234,5678,-;", with CONFIG_PRINTK_CALLER
# "6,1234,5678,-,caller=T12;"), or the file name grep puts before a log line it found
# ("/var/log/kern.log:", "syslog.1:1234:") -- not dmesg -x's "syslog:err   : ", the syslog facility.
_HEAD_RE = re.compile(
    r"\s*(?:\d+,\d+,\d+(?:,[^;\s]*)?;"
    r"|(?:/[^\s:]+|[\w.-]+\.log(?:\.\d+)?|syslog(?:\.\d+)?|messages(?:\.\d+)?)(?::\d+)?:"
    r"(?!\s*(?:" + "|".join(DMESG_LEVELS) + r")\s*:))"
)
# Talos Linux formats every kernel message "%s: %7s: [%s]: %s" (facility, priority right-aligned to 7,
# RFC 3339 time with nanoseconds, text: machined's Dmesg API and its "kernel" service log), and talosctl puts
# "<node>: " in front (the node as it was addressed: host name, IPv4 or IPv6 address). Only the kernel's
# facility: a userspace program writing to /dev/kmsg shows up as "user: ..." or "daemon: ...".
_TALOS_NODE = r"(?:[\w.-]+|\[?[0-9A-Fa-f:.]+\]?)"
_TALOS = r"(?:" + _TALOS_NODE + r":\s+)?kern:\s+[a-z]+:\s+\[" + _ISO_TS + r"\]:\s*"
# An RFC 5424 header whose APP-NAME is the kernel's and that carries structured data
# ('<4>1 2024-07-04T11:09:40.123Z host kernel - - [timeQuality tzKnown="1"] '): its quoted parameter values
# are part of the header, not a quotation of the kernel's text, so the header is taken off before the quoting
# check. A quoted value holding the marker itself never closes its element, so it is never taken off.
_RFC5424_SD_RE = re.compile(
    r"\s*<\d{1,3}>1\s+\S+\s+\S+\s+kernel\s+\S+\s+\S+\s+"
    r"(?:\[[^\s\]\[=\"]+(?:\s+[^\s\]\[=\"]+=\"(?:[^\"\\]|\\.)*\")*\s*\]\s*)+"
)
_KERNEL_PREFIX_RE = re.compile(
    r"\s*(?:<\d{1,3}>\d?\s*)?"
    r"(?:\d+,\d+,\d+(?:,[^;]*)?;)?"
    r"(?:(?:" + _TOKEN + r"\s+){0,8}?(?:kernel|vmunix)(?:\[\d+\])?(?::|(?:\s+-){3})\s*"
    r"|" + _TALOS +
    r"|" + _ISO_TS + r"\s+)?"
    r"(?:" + _DMESG_DECODE + r")?(?:" + _ISO_TS + r"\s+)?"
    r"(?:\[[^\]\[]*\]\s*)*"
)


# What may stand before Fabric Manager's report of an NVSwitch error: its own log file's stamps
# ("[Jul 09 2024 18:14:07] [ERROR] [tid 12727] ": time, level, thread), or a syslog / journald header ending in
# its tag ("Mar 03 18:39:57 host nv-fabricmanager[5183]: ", when it logs to syslog), or nothing.
_FABRIC_MANAGER_PREFIX_RE = re.compile(
    r"\s*(?:<\d{1,3}>\d?\s*)?"
    r"(?:(?:" + _TOKEN + r"\s+){0,8}?nv(?:idia)?-fabricmanager(?:\[\d+\])?:\s*)?"
    r"(?:\[[^\]\[]*\]\s*)*"
)


def prefix_is_kernel(prefix: str) -> bool:
    """True when ``prefix`` (the text before the driver's marker) can be a kernel log prefix.

    Accepts dmesg ``[538441.007373] ``, ``dmesg -T`` ``[Thu Jul  4 11:09:40 2024] ``, syslog
    ``Nov 21 23:11:02 host kernel: `` (RFC 3339 and RFC 5424 headers too), every ``journalctl -o short*``
    mode, Talos ``node: kern: warning: [2026-04-22T21:25:20.505406921Z]: ``, kmsg records
    ``6,1234,5678,-;``, ``dmesg -x`` ``kern  :err   : `` (any facility), indentation and nothing at all.
    Rejects prefixes that quote the text or that are another program's message around it (a tag other than
    the kernel's, a log level, a label, a Talos facility other than ``kern``).
    """
    if not prefix or prefix.isspace():
        return True
    head = _HEAD_RE.match(prefix)
    if head is not None:  # a kmsg record header ("caller=T12" has '=') or grep's "file:" / "file:line:"
        prefix = prefix[head.end():]
    sd = _RFC5424_SD_RE.match(prefix)
    if sd is not None:  # RFC 5424 kernel header with structured data (its values are quoted)
        prefix = prefix[sd.end():]
    return _unquoted_fullmatch(_KERNEL_PREFIX_RE, prefix)


def prefix_is_fabric_manager(prefix: str) -> bool:
    """True when ``prefix`` (the text before ``detected NVSwitch``) can be what Fabric Manager's own log or a
    syslog / journald copy of it puts there: ``[Jul 09 2024 18:14:07] [ERROR] [tid 12727] ``,
    ``Mar 03 18:39:57 host nv-fabricmanager[5183]: ``, grep's ``fabricmanager.log:`` or nothing. Rejects
    quotations and other programs' messages around the text, as :func:`prefix_is_kernel` does.
    """
    if not prefix or prefix.isspace():
        return True
    head = _HEAD_RE.match(prefix)
    if head is not None:  # grep's "file:" / "file:line:"
        prefix = prefix[head.end():]
    return _unquoted_fullmatch(_FABRIC_MANAGER_PREFIX_RE, prefix)


def _unquoted_fullmatch(pattern: re.Pattern[str], prefix: str) -> bool:
    return _QUOTING_CHARS.isdisjoint(prefix) and pattern.fullmatch(prefix) is not None
