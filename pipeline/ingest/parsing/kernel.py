"""Pure parsers for NVIDIA kernel log lines (one line in, one typed match or None out).

Each parser finds the driver's marker anywhere in the line, so every prefix a shipper adds works
(dmesg, ``dmesg -T``, ``dmesg -x``, syslog, journald short, kmsg records, bare ``msg``), and then checks that
what precedes the marker can be a kernel prefix (:func:`prefix_is_kernel`) so that quoted copies of the
text (shell commands, audit records, other programs' logs) produce nothing.

Fabric Manager (``nv-fabricmanager``, NVSwitch systems) reports every SXid again in its own log
(``/var/log/fabricmanager.log``): ``[Jul 09 2024 18:14:07] [ERROR] [tid 12727] detected NVSwitch non-fatal error
12028 on fid 0 on NVSwitch pci bus id 00000000:86:00.0 physical id 3 port 61``. Those lines reach the kernel
topic too (deploy/README.md) and become the same :class:`SXidLine` as the driver's, with ``reporter``
``fabric_manager`` and the switch's port as the link; their prefix is checked by
:func:`prefix_is_fabric_manager`.

Multi-line folding (SXid continuation lines, the three-line "fallen off the bus" message) needs
state and lives in :mod:`pipeline.detection.detector`; here each line is classified on its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pipeline.ingest.parsing.common import PCI_PATTERN, normalize_pci, prefix_is_fabric_manager, prefix_is_kernel
from schemas.records import Reporter

NVRM_MARKER = "NVRM: "
SXID_MARKER = "SXid ("
NCCL_MARKER = "libnccl"
FABRIC_MANAGER_MARKER = "detected NVSwitch "
KERNEL_MARKERS = (NVRM_MARKER, SXID_MARKER, FABRIC_MANAGER_MARKER, NCCL_MARKER)
"""Every kernel line that can hold a fault (or a UUID mapping) contains one of these: the one list the
detector's prefilter and the parse stage's marker gate use."""


@dataclass(slots=True)
class XidLine:
    """``NVRM: Xid (PCI:0000:4e:00): 79, pid=..., name=..., <message>``.

    On a MIG-enabled GPU the driver names the instance the error is attributed to inside the parentheses
    (the three forms of the Xid printer in the driver's ``kernel_rc.c``): ``(PCI:0000:01:00 GPU-I:05)`` the GPU
    instance, ``(PCI:0000:3b:00 GPU-I:01 GPU-CI:02)`` the GPU and compute instance: ``gpu_instance`` and
    ``compute_instance``, None when not printed.
    """

    code: int
    pci: str | None
    gpu_instance: int | None = None
    compute_instance: int | None = None
    pid: int | None = None
    process: str | None = None
    message: str = ""
    subcode: int | None = None
    link: int | None = None
    fatal: bool | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class SXidLine:
    """``nvidia-nvswitch3: SXid (PCI:0000:c1:00.0): 28006, Non-fatal, Link 46 <message>``.

    ``continuation`` is True for the ``Severity ... Engine instance`` and ``Data {...}`` lines the
    driver prints after the first line of one error; they are never counted on their own.
    ``header`` is True when the line prints Fatal/Non-fatal (the first line of an error).
    ``reporter``: ``driver`` (the NVSwitch driver's kernel line) or ``fabric_manager`` (Fabric Manager's own log:
    no device name, the switch's ``physical_id`` and ``port`` as the link, ``detail`` the other places it names).
    """

    code: int
    pci: str | None
    nvswitch: str | None
    fatal: bool | None
    link: int | None
    message: str
    continuation: bool
    header: bool
    reporter: Reporter = Reporter.DRIVER
    physical_id: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class FallenOffBusLine:
    """One line of a "GPU has fallen off the bus" message printed without an Xid.

    ``part``: 0 = a one-line form, in every wording drivers printed: ``NVRM: GPU 0000:29:00.0: GPU has
    fallen off the bus.`` (``NV_DEV_PRINTF`` in osHandleGpuLost), ``NVRM: GPU at PCI:0000:01:00: GPU has
    fallen off the bus.`` (older drivers' device prefix), ``NVRM: GPU at 0000:01:00.0 has fallen off the
    bus.`` (older drivers), the three-line message joined into one line, and any other NVRM line saying a
    GPU has fallen off the bus (address None when it names none),
    1 = ``NVRM: The NVIDIA GPU 0000:b3:00.0`` (the only line with the address),
    2 = ``NVRM: (PCI ID: 10de:26b5) installed in this system has`` (``confirms`` False when the
    line says "is not supported" instead: then it is the unsupported-GPU message, not a fault),
    3 = ``NVRM: fallen off the bus and is not responding to commands.``
    """

    part: int
    pci: str | None = None
    pci_id: str | None = None
    confirms: bool = True


@dataclass(slots=True)
class GpuUuidLine:
    """``NVRM: GPU at PCI:0000:01:00: GPU-bc0fa0b9-...``: which GPU sits at which address."""

    pci: str
    uuid: str


@dataclass(slots=True)
class NcclSegfaultLine:
    """``pt_main_thread[2536443]: segfault at 7f79... ip ... sp ... error 4 in libnccl.so.2[...]``."""

    process: str | None
    pid: int | None
    address: str | None
    library: str
    message: str


KernelLine = XidLine | SXidLine | FallenOffBusLine | GpuUuidLine | NcclSegfaultLine

# -- regular expressions (applied only after a marker was found) -------------------------------

_XID_HEAD_RE = re.compile(
    r"Xid \((?:PCI:)?(?P<pci>" + PCI_PATTERN + r")(?:\s+GPU-I:(?P<gi>\d{1,3}))?(?:\s+GPU-CI:(?P<ci>\d{1,3}))?\):"
    r"\s*(?P<code>\d{1,6})\b,?\s*(?P<tail>.*)"
)
_PID_RE = re.compile(r"pid=(?P<pid>[^,\s]*),?\s*")
_NAME_RE = re.compile(r"name=(?P<name>[^,]*),?\s*")
_GPC_RE = re.compile(r"\(GPC (?P<gpc>\d+), TPC (?P<tpc>\d+), SM (?P<sm>\d+)\)")
_XID74_RE = re.compile(r"[Ll]ink (?P<link>\d+)\s*(?:\((?P<regs>0x[0-9A-Fa-f]+(?:\s*,\s*0x[0-9A-Fa-f]+)*)\))?")
_NVLINK5_RE = re.compile(
    r"(?P<unit>[A-Za-z0-9_/]+)\s+(?P<sev>Fatal|Nonfatal|Non-fatal)\s+(?P<xc>XC\d+)\s+(?P<inst>i\d+)\s+"
    r"Link\s+(?P<link>-?\d+)\s*(?:\((?P<regs>[^)]*)\)?)?"  # lines cut short lose the closing parenthesis
)
_XID154_RE = re.compile(
    r"from\s+(?:0x)?(?P<old>[0-9A-Fa-f]+)\b(?:\s*\((?P<old_text>[^)]*)\))?"
    r"\s+to\s+(?:0x)?(?P<new>[0-9A-Fa-f]+)\b(?:\s*\((?P<new_text>[^)]*)\))?"
)
_UUID_RE = re.compile(
    r"GPU at (?:PCI:)?(?P<pci>" + PCI_PATTERN + r"):\s*"
    r"(?P<uuid>GPU-[0-9A-Fa-f]{8}(?:-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12})\s*$"
)
_FOB_PART1_RE = re.compile(
    r"The NVIDIA GPU (?:at )?(?:PCI:)?(?P<pci>" + PCI_PATTERN + r")\s*"
    r"(?:\(PCI ID: (?P<pci_id>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4})\))?\s*$"
)
_FOB_PART2_RE = re.compile(
    r"(?:\(PCI ID: (?P<pci_id>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4})\)\s*)?installed in this system (?P<rest>.*)$"
)
# The GPU's address in any one-line wording: "GPU 0000:29:00.0: GPU has...", "GPU at PCI:0000:01:00: GPU
# has...", "GPU at 0000:01:00.0 has...", "The NVIDIA GPU 0000:01:00.0 (PCI ID: ...) ... has fallen off".
_FOB_PCI_RE = re.compile(r"\bGPU\s+(?:at\s+)?(?:PCI:)?(?P<pci>" + PCI_PATTERN + r")(?![0-9A-Fa-f])")
FALLEN_OFF = "fallen off the bus"
_SXID_RE = re.compile(
    r"(?:(?P<dev>[A-Za-z0-9_.-]*nvswitch[A-Za-z0-9_-]*|lwpu-\w+):\s*)?"
    r"SXid \((?:PCI:)?(?P<pci>" + PCI_PATTERN + r")\):\s*"
    r"(?P<code>\d{1,6}),\s*(?P<rest>.*)"
)
# Fabric Manager: "detected NVSwitch <fatal|non-fatal> error <code> on fid 0 on NVSwitch pci bus id <pci> physical
# id <n> port <n>" ("on NodeId 0" in its syslog form); every part after the code optional (older releases).
_FABRIC_MANAGER_RE = re.compile(
    r"detected NVSwitch (?P<sev>fatal|non-fatal) error (?P<code>\d{1,6})\b"
    r"(?P<places>(?:\s+on\s+(?!NVSwitch\b)[A-Za-z]+\s+\d+)*)"
    r"(?:\s+on\s+NVSwitch\s+pci\s+bus\s+id\s+(?P<pci>" + PCI_PATTERN + r"))?"
    r"(?:\s+physical\s+id\s+(?P<phys>\d+))?"
    r"(?:\s+port\s+(?P<port>\d+))?"
)
_PLACE_RE = re.compile(r"on\s+([A-Za-z]+)\s+(\d+)")
_SXID_HEADER_RE = re.compile(r"(?P<sev>Fatal|Non-fatal|Nonfatal)\b,?\s*(?:Link\s+(?P<link>\d+)\b)?\s*(?P<msg>.*)")
_SEGFAULT_RE = re.compile(
    r"(?:(?P<proc>[^\s\[\]]+)\[(?P<pid>\d+)\]:\s+)?segfault at (?P<addr>[0-9A-Fa-f]+)\b.*?\bin (?P<lib>libnccl[^\s\[]*)"
)


_PCI_ID_RE = re.compile(r"\(PCI ID: ([0-9A-Fa-f]{4}:[0-9A-Fa-f]{4})\)")


def _int_or_none(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip("'\"<> ")
    return int(text) if text.isdigit() else None


def _name_or_none(text: str | None) -> str | None:
    if text is None:
        return None
    text = text.strip()
    return None if not text or text in ("<unknown>", "'<unknown>'", "<n/a>") else text


def parse_xid(rest: str) -> XidLine | None:
    """Parse the text after ``NVRM: `` when it starts with ``Xid (``."""
    m = _XID_HEAD_RE.match(rest)
    if m is None:
        return None
    code = int(m.group("code"))
    tail = m.group("tail")
    pid: int | None = None
    process: str | None = None
    pm = _PID_RE.match(tail)
    if pm is not None:
        pid = _int_or_none(pm.group("pid"))
        tail = tail[pm.end():]
    nm = _NAME_RE.match(tail)
    if nm is not None:
        process = _name_or_none(nm.group("name"))
        tail = tail[nm.end():]
    event = XidLine(code=code, pci=normalize_pci(m.group("pci")), gpu_instance=_int_or_none(m.group("gi")),
                    compute_instance=_int_or_none(m.group("ci")), pid=pid, process=process, message=tail.strip())
    _decode_code_specific(event)
    return event


def _decode_code_specific(event: XidLine) -> None:
    message = event.message
    code = event.code
    if code == 13:
        g = _GPC_RE.search(message)
        if g is not None:
            event.detail.update(gpc=int(g.group("gpc")), tpc=int(g.group("tpc")), sm=int(g.group("sm")))
    elif code == 74:
        lm = _XID74_RE.search(message)
        if lm is not None:
            event.link = int(lm.group("link"))
            if lm.group("regs"):
                event.detail["registers"] = [r.strip().lower() for r in lm.group("regs").split(",")]
    elif 144 <= code <= 150:
        nm = _NVLINK5_RE.search(message)
        if nm is not None:
            event.fatal = nm.group("sev") == "Fatal"
            link = int(nm.group("link"))
            event.link = link if link >= 0 else None
            registers = nm.group("regs").replace(",", " ").split() if nm.group("regs") else []
            event.detail.update(unit=nm.group("unit"), xc=nm.group("xc"), instance=nm.group("inst"))
            if registers:
                event.detail["registers"] = [r.lower() for r in registers]
                try:
                    intr_info = int(registers[0], 16)
                except ValueError:
                    intr_info = None
                if intr_info is not None:
                    # NVIDIA's "XID 144-150 Decode" sheet: bits 20-25 of intrInfo select the row.
                    event.subcode = (intr_info >> 20) & 0x3F
                    event.detail["intr_info"] = registers[0].lower()
                if len(registers) > 1:
                    event.detail["error_status"] = registers[1].lower()
            if link < 0:
                event.detail["link_raw"] = link
    elif code == 154:
        rm = _XID154_RE.search(message)
        if rm is not None:
            event.subcode = int(rm.group("new"), 16)
            event.detail.update(previous_action=int(rm.group("old"), 16))
            if rm.group("new_text"):
                event.detail["action_text"] = rm.group("new_text")


def parse_nvrm(rest: str) -> KernelLine | None:
    """Parse the text after ``NVRM: ``: Xid, UUID mapping or a fallen-off-the-bus line.

    "Fallen off the bus" in any wording the driver has printed (see :class:`FallenOffBusLine`); the
    three-line message's last line on its own is part 3, every other line saying it is one fault.
    """
    if rest.startswith("Xid"):
        return parse_xid(rest)
    if FALLEN_OFF in rest:
        if rest.startswith(FALLEN_OFF):
            return FallenOffBusLine(part=3)
        m = _FOB_PCI_RE.search(rest)
        pci = normalize_pci(m.group("pci")) if m else None
        id_match = _PCI_ID_RE.search(rest)
        return FallenOffBusLine(part=0, pci=pci, pci_id=_lower(id_match.group(1)) if id_match else None)
    if rest.startswith("GPU at "):  # "GPU at PCI:0000:01:00: GPU-<uuid>" (older drivers omit "PCI:")
        um = _UUID_RE.match(rest)
        if um is not None:
            pci = normalize_pci(um.group("pci"))
            return GpuUuidLine(pci=pci, uuid=um.group("uuid").lower().replace("gpu-", "GPU-")) if pci else None
        return None
    if rest.startswith("The NVIDIA GPU "):
        m = _FOB_PART1_RE.match(rest)
        if m is None:
            return None
        return FallenOffBusLine(part=1, pci=normalize_pci(m.group("pci")), pci_id=_lower(m.group("pci_id")))
    if rest.startswith("(PCI ID:") or rest.startswith("installed in this system"):
        m = _FOB_PART2_RE.match(rest)
        if m is None:
            return None
        confirms = m.group("rest").strip() == "has"
        return FallenOffBusLine(part=2, pci_id=_lower(m.group("pci_id")), confirms=confirms)
    return None


def _lower(text: str | None) -> str | None:
    return text.lower() if text else None


def parse_sxid(line: str, at: int) -> SXidLine | None:
    """Parse an SXid line whose ``SXid (`` marker is at index ``at``."""
    m = _SXID_RE.search(line, max(0, at - 64))
    if m is None:
        return None
    if not prefix_is_kernel(line[: m.start()]):
        return None
    rest = m.group("rest").strip()
    code = int(m.group("code"))
    nvswitch = m.group("dev")
    pci = normalize_pci(m.group("pci"))
    if rest.startswith("Severity ") or rest.startswith("Data {") or rest.startswith("Data{"):
        return SXidLine(code, pci, nvswitch, None, None, rest, continuation=True, header=False)
    hm = _SXID_HEADER_RE.match(rest)
    if hm is not None:
        link = int(hm.group("link")) if hm.group("link") else None
        return SXidLine(code, pci, nvswitch, hm.group("sev") == "Fatal", link, hm.group("msg").strip(), False, True)
    return SXidLine(code, pci, nvswitch, None, None, rest, continuation=False, header=False)


def parse_fabric_manager(line: str, at: int) -> SXidLine | None:
    """Fabric Manager's report of an SXid, whose ``detected NVSwitch`` marker is at index ``at``."""
    m = _FABRIC_MANAGER_RE.match(line, at)
    if m is None or not prefix_is_fabric_manager(line[:at]):
        return None
    detail: dict[str, Any] = {name.lower(): int(number) for name, number in _PLACE_RE.findall(m.group("places"))}
    return SXidLine(
        code=int(m.group("code")),
        pci=normalize_pci(m.group("pci")) if m.group("pci") else None,
        nvswitch=None,
        fatal=m.group("sev") == "fatal",
        link=_int_or_none(m.group("port")),
        message=line[at:].strip(),
        continuation=False,
        header=True,
        reporter=Reporter.FABRIC_MANAGER,
        physical_id=_int_or_none(m.group("phys")),
        detail=detail,
    )


def parse_nccl_segfault(line: str) -> NcclSegfaultLine | None:
    m = _SEGFAULT_RE.search(line)
    if m is None or not prefix_is_kernel(line[: m.start()]):
        return None
    return NcclSegfaultLine(
        process=m.group("proc"),
        pid=_int_or_none(m.group("pid")),
        address=m.group("addr").lower(),
        library=m.group("lib"),
        message=line[m.start():].strip(),
    )


def parse_kernel_line(line: str) -> KernelLine | None:
    """Classify one kernel line; None for noise and for look-alikes.

    Cheap for noise: four substring scans before any regular expression runs.
    """
    at = line.find(NVRM_MARKER)
    if at >= 0:
        if not prefix_is_kernel(line[:at]):
            return None
        return parse_nvrm(line[at + len(NVRM_MARKER):].rstrip())
    at = line.find(SXID_MARKER)
    if at >= 0:
        return parse_sxid(line.rstrip(), at)
    at = line.find(FABRIC_MANAGER_MARKER)
    if at >= 0:
        return parse_fabric_manager(line.rstrip(), at)
    if NCCL_MARKER in line and "segfault at " in line:
        return parse_nccl_segfault(line.rstrip())
    return None
