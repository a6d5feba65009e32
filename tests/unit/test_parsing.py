"""Stateless kernel-line and pod-line parsers."""

from __future__ import annotations

import pytest

from pipeline.ingest.parsing import (
    FallenOffBusLine,
    GpuUuidLine,
    NcclSegfaultLine,
    SXidLine,
    XidLine,
    match_pod_signal,
    normalize_pci,
    parse_kernel_line,
    prefix_is_kernel,
)
from schemas.records import SignalGrade

XID = "NVRM: Xid (PCI:0000:4E:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("PCI:0000:4E:00", "0000:4e:00.0"),
        ("0000:03:00", "0000:03:00.0"),
        ("0000:c1:00.3", "0000:c1:00.3"),
        ("18:00.0", "0000:18:00.0"),
        ("10000:01:00.0", "10000:01:00.0"),
        ("not-a-pci", None),
        ("0000:zz:00", None),
    ],
)
def test_normalize_pci(raw: str, expected: str | None) -> None:
    assert normalize_pci(raw) == expected


@pytest.mark.parametrize(
    "prefix",
    [
        "",
        "[538441.007373] ",
        "[Thu Jul  4 11:09:40 2024] ",
        "Nov 21 23:11:02 host kernel: ",
        "Nov 21 23:11:02 host kernel: [538441.007373] ",
        "Jul 04 11:09:40 gpu-node-3 kernel: ",
        "2024-07-04T11:09:40.123456+00:00 gpu-node-3 kernel: ",
        "kernel: ",
        "6,1234,5678901,-;",
        "kern  :err   : 2025-01-25T10:34:54,859532+00:00 ",
        "               ",
        # Talos: talosctl dmesg (node first: host name, IPv4, IPv6) and its kernel log without the node.
        "talos-gpu-1: kern: warning: [2026-04-22T21:25:20.505406921Z]: ",
        "172.20.1.2: kern:    info: [2021-11-10T10:09:37.662764956Z]: ",
        "fd00:10::2: kern:     err: [2026-04-22T21:25:20Z]: ",
        "kern:    crit: [2026-04-22T21:25:20.505406921Z]: ",
        # journalctl -k -o short-iso (old systemd: %z), short-iso-precise, short-precise, short-monotonic,
        # short-full, short-unix.
        "2024-07-04T11:09:40+0000 gpu-node-3 kernel: ",
        "2024-07-04T11:09:40.123456-0700 gpu-node-3 kernel: ",
        "Jul 04 11:09:40.123456 gpu-node-3 kernel: ",
        "[538441.007373] gpu-node-3 kernel: ",
        "[   20.544453] gpu-node-3 kernel: ",
        "Thu 2024-07-04 11:09:40 CEST gpu-node-3 kernel: ",
        "1720091380.123456 gpu-node-3 kernel: ",
        # RFC 5424 (rsyslog RSYSLOG_SyslogProtocol23Format), with and without structured data.
        "<4>1 2024-07-04T11:09:40.123456+00:00 gpu-node-3 kernel - - - ",
        '<4>1 2024-07-04T11:09:40.123Z gpu-node-3 kernel - - [timeQuality tzKnown="1" isSynced="1"] ',
        '<4>1 2024-07-04T11:09:40.123Z gpu-node-3 kernel - - [a@1 x="q\\"]"][b@2] [538441.007373] ',
    ],
)
def test_every_kernel_prefix_is_accepted_and_parsed(prefix: str) -> None:
    assert prefix_is_kernel(prefix)
    parsed = parse_kernel_line(prefix + XID)
    assert isinstance(parsed, XidLine)
    assert (parsed.code, parsed.pci, parsed.pid, parsed.process) == (79, "0000:4e:00.0", None, None)


@pytest.mark.parametrize(
    "line",
    [
        'grep "NVRM: Xid (PCI:0000:4e:00): 79," /var/log/syslog',
        "journalctl -k | grep 'NVRM: Xid (PCI:0000:4e:00): 79, x'",
        'type=EXECVE msg=audit(1.2:3): argc=2 a0="grep" a1="NVRM: Xid (PCI:0000:4e:00): 79, x"',
        "Nov 21 23:11:02 host dcgm-exporter[77]: NVRM: Xid (PCI:0000:4e:00): 79, GPU has fallen off the bus.",
        "Nov 21 23:11:02 host sudo[9]: alice : COMMAND=/usr/bin/grep NVRM: Xid (PCI:0000:4e:00): 79, x",
        "NVRM: Xid error: xyz, invalid data",
        "NVRM: Xid (PCI:garbage): 79, x",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15",
        "nvidia-nvswitch0: SXid (PCI:0000:c1:00.0): garbled, Fatal",
        "segfault at 0 ip 0 sp 0 error 4 in libc.so.6[7f00+1000]",
        # Talos: only the kernel's facility, and the bracketed RFC 3339 time is part of the form.
        "talos-gpu-1: user: warning: [2026-04-22T21:25:20.505406921Z]: NVRM: Xid (PCI:0000:4e:00): 79, x",
        "talos-gpu-1: kern: warning: [2026-04-22T21:25:20Z]: gpu-alerter: NVRM: Xid (PCI:0000:4e:00): 79, x",
        "ALERT: talos-gpu-1: kern: warning: [2026-04-22T21:25:20Z]: NVRM: Xid (PCI:0000:4e:00): 79, x",
        # RFC 5424: the text quoted in a structured-data value, or another program's APP-NAME.
        '<11>1 2024-07-04T11:09:40Z n kernel - - [a@1 line="NVRM: Xid (PCI:0000:4e:00): 79, x"]',
        '<11>1 2024-07-04T11:09:40Z n gpu-alerter 12 - [a@1 x="1"] NVRM: Xid (PCI:0000:4e:00): 79, x',
        '<11>1 2024-07-04T11:09:40Z n kernel - - [a@1 x="1"] gpu-alerter[3]: NVRM: Xid (PCI:0000:4e:00): 79, x',
    ],
)
def test_lookalikes_produce_nothing(line: str) -> None:
    assert parse_kernel_line(line) is None


def test_xid_fields_pid_name_and_other_fields() -> None:
    parsed = parse_kernel_line("NVRM: Xid (PCI:0000:01:00): 31, pid=1234, name=python3, Ch 00000008, intr 0")
    assert isinstance(parsed, XidLine)
    assert (parsed.code, parsed.pid, parsed.process) == (31, 1234, "python3")
    assert parsed.message == "Ch 00000008, intr 0"


def test_xid_without_pci_word_and_without_comma_tail() -> None:
    parsed = parse_kernel_line("NVRM: Xid (0000:03:00): 62, Channel 00000001")
    assert isinstance(parsed, XidLine) and (parsed.code, parsed.pci) == (62, "0000:03:00.0")
    bare = parse_kernel_line("NVRM: Xid (PCI:0000:b3:00.0): 79")
    assert isinstance(bare, XidLine) and (bare.code, bare.pci, bare.message) == (79, "0000:b3:00.0", "")


def test_xid13_gpc_tpc_sm() -> None:
    parsed = parse_kernel_line(
        "NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on "
        "(GPC 7, TPC 1, SM 0): Out Of Range Address"
    )
    assert isinstance(parsed, XidLine)
    assert parsed.detail == {"gpc": 7, "tpc": 1, "sm": 0}


def test_xid74_link_and_registers() -> None:
    parsed = parse_kernel_line(
        "NVRM: Xid (PCI:0003:00:00): 74, pid=1, name=x, NVLink: fatal error detected on link 14"
        "(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)"
    )
    assert isinstance(parsed, XidLine)
    assert parsed.link == 14
    assert parsed.detail["registers"] == ["0x0", "0x0", "0x10000", "0x0", "0x0", "0x0", "0x0"]


def test_nvlink5_subcode_fatal_link() -> None:
    parsed = parse_kernel_line(
        "NVRM: Xid (PCI:0000:00:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 07 "
        "(0x026001c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)"
    )
    assert isinstance(parsed, XidLine)
    assert (parsed.fatal, parsed.link, parsed.subcode) == (True, 7, 0x26)
    assert parsed.detail["unit"] == "NETIR_LINK_EVT" and parsed.detail["error_status"] == "0x00000000"
    nonfatal = parse_kernel_line("NVRM: Xid (PCI:0000:04:00): 147, TREX Nonfatal XC0 i0 Link 00 (0x0000000e 0x1)")
    assert isinstance(nonfatal, XidLine) and nonfatal.fatal is False


@pytest.mark.parametrize(("number", "text"), [(1, "GPU Reset Required"), (2, "Node Reboot Required"), (9, "Future")])
def test_xid154_reads_the_number_not_the_text(number: int, text: str) -> None:
    parsed = parse_kernel_line(
        f"NVRM: Xid (PCI:0018:01:00): 154, GPU recovery action changed from 0x0 (None) to 0x{number:x} ({text})"
    )
    assert isinstance(parsed, XidLine) and parsed.subcode == number


def test_sxid_header_continuation_and_unflagged() -> None:
    header = parse_kernel_line(
        "[ 1108.858286] nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 28 sourcetrack timeout error"
    )
    assert isinstance(header, SXidLine)
    assert (header.code, header.fatal, header.link, header.nvswitch, header.header) == (
        24007, True, 28, "nvidia-nvswitch0", True)
    for tail in ("Severity 1 Engine instance 00 Sub-engine instance 00", "Data {0x1, 0x2}"):
        cont = parse_kernel_line(f"nvidia-nvswitch0: SXid (PCI:0000:c3:00.0): 24007, {tail}")
        assert isinstance(cont, SXidLine) and cont.continuation
    soe = parse_kernel_line("nvidia-nvswitch0: SXid (PCI:0004:00:00.0): 26006, SOE HALTED")
    assert isinstance(soe, SXidLine) and not soe.header and not soe.continuation and soe.fatal is None


def test_fallen_off_bus_parts() -> None:
    one = parse_kernel_line("NVRM: GPU 0000:29:00.0: GPU has fallen off the bus.")
    assert one == FallenOffBusLine(part=0, pci="0000:29:00.0")
    first = parse_kernel_line("[ 1843.308145] NVRM: The NVIDIA GPU 0000:B3:00.0")
    assert first == FallenOffBusLine(part=1, pci="0000:b3:00.0")
    second = parse_kernel_line("   NVRM: (PCI ID: 10de:26b5) installed in this system has")
    assert second == FallenOffBusLine(part=2, pci_id="10de:26b5", confirms=True)
    negated = parse_kernel_line("NVRM: installed in this system is not supported by the")
    assert isinstance(negated, FallenOffBusLine) and negated.confirms is False
    assert parse_kernel_line("NVRM: fallen off the bus and is not responding to commands.") == FallenOffBusLine(part=3)


def test_uuid_mapping_line() -> None:
    parsed = parse_kernel_line("kernel: NVRM: GPU at PCI:0000:01:00: GPU-BC0FA0B9-cac2-f507-b715-9bebdb69c71e")
    assert parsed == GpuUuidLine(pci="0000:01:00.0", uuid="GPU-bc0fa0b9-cac2-f507-b715-9bebdb69c71e")


def test_nccl_segfault() -> None:
    parsed = parse_kernel_line(
        "[12.5] pt_main_thread[2536443]: segfault at 7f797fe00000 ip 00007f7c7ac69996 sp 00007f7c12fd7c30 "
        "error 4 cpu 3 in libnccl.so.2.18.3[7f7c7ac00000+d3d3000] likely on CPU 3 (core 3, socket 0)"
    )
    assert isinstance(parsed, NcclSegfaultLine)
    assert (parsed.process, parsed.pid, parsed.library) == ("pt_main_thread", 2536443, "libnccl.so.2.18.3")


@pytest.mark.parametrize(
    ("line", "name", "grade"),
    [
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "cuda_ecc_uncorrectable",
         SignalGrade.HARDWARE),
        ("CUDA_ERROR_NVLINK_UNCORRECTABLE in cuMemcpy", "cuda_nvlink_uncorrectable", SignalGrade.HARDWARE),
        ("CUDA error: unspecified launch failure", "cuda_launch_failure", SignalGrade.APPLICATION),
        ("RuntimeError: CUDA error: misaligned address", "cuda_misaligned_address", SignalGrade.APPLICATION),
        ("RuntimeError: CUDA error: invalid device ordinal", "cuda_invalid_device_ordinal", SignalGrade.APPLICATION),
        ("NCCL error: unhandled cuda error (run with NCCL_DEBUG=INFO)", "nccl_unhandled_cuda_error",
         SignalGrade.SYMPATHETIC),
        # A line naming both a sympathetic and a hardware cause counts as hardware.
        ("NCCL error: unhandled cuda error, caused by: uncorrectable ECC error encountered",
         "cuda_ecc_uncorrectable", SignalGrade.HARDWARE),
        # NCCL's verbs wrapper: every ibv_* call, with or without the error text, and poll_cq's own wording.
        ("n1:1:2 [0] misc/ibvwrap.cc:268 NCCL WARN Call to ibv_create_cq failed", "nccl_ibv_call_failed",
         SignalGrade.SYMPATHETIC),
        ("NCCL WARN Call to ibv_modify_qp failed with error Connection timed out", "nccl_ibv_call_failed",
         SignalGrade.SYMPATHETIC),
        ("NCCL WARN Call to ibv_reg_dmabuf_mr failed with error Invalid argument", "nccl_ibv_call_failed",
         SignalGrade.SYMPATHETIC),
        ("n1:1:2 [0] NCCL WARN Call to ibv_poll_cq() returned -1", "nccl_ibv_call_failed", SignalGrade.SYMPATHETIC),
        # Its cause, when the same line names a hardware one, still wins.
        ("NCCL WARN Call to ibv_modify_qp failed; CUDA error: uncorrectable ECC error encountered",
         "cuda_ecc_uncorrectable", SignalGrade.HARDWARE),
    ],
)
def test_pod_signals(line: str, name: str, grade: SignalGrade) -> None:
    signal = match_pod_signal(line)
    assert signal is not None and (signal.name, signal.grade) == (name, grade)


@pytest.mark.parametrize(
    "line",
    ["loss=0.1 step=3", "Error: file not found", "assertion passed", "",
     # Verbs failures of other libraries, and NCCL saying a verbs call succeeded or is being made.
     "UCX ERROR ibv_reg_mr failed: Bad address", "ibv_create_cq(cqe=4096) failed: Cannot allocate memory",
     "n1:1:2 [0] NCCL INFO Call to ibv_create_cq succeeded", "NCCL INFO NET/IB : Using [0]mlx5_1:1/RoCE"],
)
def test_pod_noise(line: str) -> None:
    assert match_pod_signal(line) is None
