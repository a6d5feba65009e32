"""The demo's scripted scenario: what each node logs, and what xidflow must then do about it.

Pure data. Lines are real driver formats (see tests/corpus for their public sources); the demo writes
them to each node's kernel log (in /dev/kmsg's record format) and container logs (CRI format), and the
node's real Fluent Bit ships them with the shipped configuration, so the demo exercises the same
shipper and adapters as production; one node's kernel lines go the way Konduktor's nodes ship them
instead: pushed to Loki and bridged to Kafka by ``xidflow loki-tail``. After its reboot a node logs no
kernel lines (see pipeline.demo.shipping: its Fluent Bit can only stamp this machine's boot id).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Expect = Literal["schedulable", "quarantined", "recovered"]


@dataclass(frozen=True)
class Emit:
    node_index: int  # 1-based index into the fleet's worker nodes
    source: Literal["kernel", "pod"]
    lines: tuple[str, ...]
    repeat: int = 1
    pod_index: int = 0


@dataclass(frozen=True)
class Step:
    title: str
    why: str
    emits: tuple[Emit, ...]
    expect: dict[int, Expect] = field(default_factory=dict)
    standby_in_service: bool = False  # the warm standby must be schedulable after this step


NCCL_TIMEOUT = (
    "[rank{rank}]:[E1121 23:11:05.123456 ProcessGroupNCCL.cpp:616] [Rank {rank}] Watchdog caught collective "
    "operation timeout: WorkNCCL(SeqNum=2411, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, "
    "Timeout(ms)=600000) ran for 600046 milliseconds before timing out."
)
NCCL_SYSTEM_ERROR = (
    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, "
    "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5"
)

STEPS: tuple[Step, ...] = (
    Step(
        title="Application Xids",
        why="Xid 13/31/43 are application faults (NVIDIA bucket RESTART_APP/IGNORE): no quarantine. "
            "Xid 45 alone is preemptive-cleanup noise.",
        emits=(
            Emit(1, "kernel", (
                "NVRM: Xid (PCI:0000:1b:00): 13, pid=48213, name=python3, Graphics Exception: "
                "ESR 0x504648=0x1000a (GPC 3, TPC 1, SM 0)",
                "NVRM: Xid (PCI:0000:1b:00): 31, pid=48213, name=python3, Ch 00000008, intr 00000000. MMU Fault: "
                "ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f2a_4b000000. Fault is of type FAULT_PDE "
                "ACCESS_TYPE_VIRT_READ",
                "NVRM: Xid (PCI:0000:1b:00): 43, pid=48213, name=python3, Ch 00000008",
            )),
            Emit(8, "kernel", ("NVRM: Xid (PCI:0000:9a:00): 45, pid=48213, name=python3, Ch 00000010",)),
        ),
        expect={1: "schedulable", 8: "schedulable"},
    ),
    Step(
        title="Fatal Xid 79, logged 2,000 times",
        why="GPU fallen off the bus (bucket REBOOT): quarantine at once; the storm of repeats is one "
            "incident with a count, and the fallen-off-bus line for the same GPU joins it.",
        emits=(
            Emit(2, "kernel", (
                "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
            ), repeat=2000),
            Emit(2, "kernel", ("NVRM: GPU 0000:4e:00.0: GPU has fallen off the bus.",)),
        ),
        expect={2: "quarantined"},
    ),
    Step(
        title="Fatal SXid on an NVSwitch",
        why="SXid 24007 is printed Fatal: the fabric is broken. Its continuation lines are folded into it.",
        emits=(
            Emit(3, "kernel", (
                "nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 24007, Fatal, Link 28 sourcetrack TCEN0 crumbstore "
                "ECC DBE Error (First)",
                "nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 24007, Severity 1 Engine instance 28 Sub-engine "
                "instance 00",
                "nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 24007, Data {0x00000000, 0x00000000, 0x00000000, "
                "0x00000000, 0x00000000, 0x00000000, 0x00000000, 0x00000000}",
            )),
        ),
        expect={3: "quarantined"},
        standby_in_service=True,
    ),
    Step(
        title="GPU fallen off the bus, three-line form, no Xid",
        why="Older drivers say it across three lines and print no Xid: one fault, not three.",
        emits=(
            Emit(4, "kernel", (
                "NVRM: The NVIDIA GPU 0000:3b:00.0",
                "NVRM: (PCI ID: 10de:2330) installed in this system has",
                "NVRM: fallen off the bus and is not responding to commands.",
            )),
        ),
        expect={4: "quarantined"},
    ),
    Step(
        title="NCCL storm across a job's nodes",
        why="Every rank of a job reports NCCL timeouts when one node fails; only the node with kernel "
            "evidence (an NVLink Xid 74) is taken out, the others stay in service.",
        emits=(
            Emit(5, "pod", (NCCL_TIMEOUT.format(rank=40), NCCL_SYSTEM_ERROR), repeat=20),
            Emit(7, "pod", (NCCL_TIMEOUT.format(rank=56), NCCL_SYSTEM_ERROR), repeat=20),
            Emit(6, "kernel", (
                "NVRM: Xid (PCI:0000:ca:00): 74, pid=3341, name=python3, NVLink: fatal error detected on "
                "link 14(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
            )),
            Emit(6, "pod", (NCCL_TIMEOUT.format(rank=48), NCCL_SYSTEM_ERROR), repeat=20),
        ),
        expect={5: "schedulable", 6: "quarantined", 7: "schedulable"},
    ),
)

REBOOT_NODE_INDEXES = (2, 4)
"""The nodes whose rule asks their reboot daemon for a reboot (the two fallen-off-bus nodes): each is rebooted
(new boot id, checks pass), passes the diagnostics Job and must come back into service."""

LOKI_NODE_INDEX = 3
"""The node whose kernel lines travel the Konduktor path: Loki -> ``xidflow loki-tail`` -> Kafka."""
