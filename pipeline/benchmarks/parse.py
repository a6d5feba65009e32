"""Pure parse throughput: ``prefilter`` + :class:`~pipeline.detection.detector.Detector` on a mixed kernel stream.

Run ``python -m pipeline.benchmarks.parse [--lines N] [--fault-ratio R]``. Single thread, one core.

The stream imitates a busy GPU node's kernel log (dmesg/syslog/journald prefixes, network, storage,
cgroup, audit and NVIDIA informational lines, some naming NVRM/nvidia without being faults) with
``fault_ratio`` of real fault lines (Xid, SXid with continuation lines, fallen off the bus). Two
baselines run on the same list in the same process: a bare ``for line in lines: pass`` loop and a
single ``str.find`` scan per line, so the figure is reported relative to the machine's speed.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from datetime import UTC, datetime

from pipeline.detection.detector import Detector, prefilter
from schemas.records import LogRecord, Source

_NOISE_TEMPLATES = (
    "[{t}] IPv6: ADDRCONF(NETDEV_CHANGE): eth{n}: link becomes ready",
    "[{t}] mlx5_core 0000:{b:02x}:00.0: mlx5_fw_tracer_handle_traces:741:(pid {p}): FW tracer event",
    "[{t}] EXT4-fs (nvme0n1p{n}): mounted filesystem with ordered data mode. Quota mode: none.",
    "[{t}] audit: type=1400 audit({t}:{p}): apparmor=\"STATUS\" operation=\"profile_replace\" name=\"nvidia_modprobe\"",
    "Nov 21 23:11:02 gpu-node-{n} kernel: [{t}] cni0: port {n}(veth{p:x}) entered forwarding state",
    "Jul 04 11:09:40 gpu-node-{n} kernel: nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context",
    "[{t}] Memory cgroup out of memory: Killed process {p} (python3) total-vm:412192kB, anon-rss:62936kB",
    "[{t}] nvidia-uvm: Loaded the UVM driver, major device number {n}.",
    "[{t}] nvidia 0000:{b:02x}:00.0: enabling device (0000 -> 0003)",
    "[{t}] TCP: request_sock_TCP: Possible SYN flooding on port {p}. Sending cookies.",
    "[{t}] device veth{p:x} entered promiscuous mode",
    "[{t}] xfs filesystem being remounted at /var/lib/kubelet/pods/{p:x}/volumes supports timestamps until 2038",
)
_FAULT_TEMPLATES = (
    "[{t}] NVRM: Xid (PCI:0000:{b:02x}:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "[{t}] NVRM: Xid (PCI:0000:{b:02x}:00): 13, pid={p}, name=python3, Graphics SM Warp Exception on "
    "(GPC 1, TPC 2, SM 0): Out Of Range Address",
    "[{t}] NVRM: Xid (PCI:0000:{b:02x}:00): 31, pid={p}, name=python3, Ch 00000008, intr 00000000. MMU Fault",
    "[{t}] nvidia-nvswitch{n}: SXid (PCI:0000:{b:02x}:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error",
    "[{t}] nvidia-nvswitch{n}: SXid (PCI:0000:{b:02x}:00.0): 12028, Data {{0x000001c0, 0x00bd5c8a, 0x00000500}}",
    "[{t}] NVRM: Xid (PCI:0009:01:00): 149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 01 (0x021425c6 0x00000000 "
    "0x00000000 0x00000000 0x00000000 0x00000000)",
)


def generate_kernel_stream(lines: int, fault_ratio: float, seed: int = 7) -> list[str]:
    """A reproducible list of kernel lines with ``fault_ratio`` of them fault lines."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(lines):
        fault = rng.random() < fault_ratio
        template = rng.choice(_FAULT_TEMPLATES if fault else _NOISE_TEMPLATES)
        fields = {"t": f"{i / 1000:12.6f}", "n": rng.randrange(8), "b": rng.randrange(256), "p": rng.randrange(99999)}
        out.append(template.format(**fields))
    return out


def _best_of(repeats: int, fn) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run_parse_benchmark(lines: int = 2_000_000, fault_ratio: float = 0.001, repeats: int = 3) -> dict:
    """Measure lines/s of prefilter + Detector against two baselines on the same stream.

    Returns ``parse_lines_per_s``, ``baseline_lines_per_s`` (bare loop), ``find_lines_per_s`` (one
    ``str.find`` per line), the ratios, the number of events and how many lines passed the prefilter.
    """
    stream = generate_kernel_stream(lines, fault_ratio)
    ts = datetime(2025, 1, 1, tzinfo=UTC)
    counts = {"events": 0, "passed": 0}

    def bare_loop() -> None:
        for _line in stream:
            pass

    def find_scan() -> None:
        hits = 0
        for line in stream:
            if line.find("NVRM: ") >= 0:
                hits += 1

    def parse() -> None:
        detector = Detector()
        events = passed = 0
        kernel = Source.KERNEL
        for line in stream:
            if prefilter(line, kernel):
                passed += 1
                events += len(detector.process(LogRecord(node="bench-node", source=kernel, ts=ts, line=line)))
        events += len(detector.flush())
        counts["events"], counts["passed"] = events, passed

    bare_s = _best_of(repeats, bare_loop)
    find_s = _best_of(repeats, find_scan)
    parse_s = _best_of(repeats, parse)
    result = {
        "lines": lines,
        "fault_ratio": fault_ratio,
        "parse_lines_per_s": lines / parse_s,
        "baseline_lines_per_s": lines / bare_s,
        "find_lines_per_s": lines / find_s,
        "parse_vs_bare_loop": parse_s / bare_s,
        "parse_vs_find": parse_s / find_s,
        "prefilter_passed": counts["passed"],
        "events": counts["events"],
        "target_lines_per_s": 1_000_000,
        "meets_target": lines / parse_s >= 1_000_000,
    }
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2_000_000)
    parser.add_argument("--fault-ratio", type=float, default=0.001)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    result = run_parse_benchmark(args.lines, args.fault_ratio, args.repeats)

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"parse throughput, {args.lines:,} lines, {args.fault_ratio:.3%} faults, one core")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("bare loop (baseline)", f"{result['baseline_lines_per_s']:,.0f} lines/s")
    table.add_row("one str.find per line", f"{result['find_lines_per_s']:,.0f} lines/s")
    table.add_row("prefilter + Detector", f"{result['parse_lines_per_s']:,.0f} lines/s")
    table.add_row("parse time / find time", f"{result['parse_vs_find']:.2f}x")
    table.add_row("parse time / bare-loop time", f"{result['parse_vs_bare_loop']:.2f}x")
    table.add_row("lines past prefilter", f"{result['prefilter_passed']:,}")
    table.add_row("events", f"{result['events']:,}")
    table.add_row("target >= 1,000,000 lines/s", "met" if result["meets_target"] else "NOT met")
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
