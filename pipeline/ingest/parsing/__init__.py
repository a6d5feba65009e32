"""Pure parsers: kernel lines (Xid, SXid, fallen off the bus, UUID map, NCCL segfault), kmsg record
decoding (escapes, embedded newlines) and pod signals.

Stateless, no I/O. Stateful folding and classification live in :mod:`pipeline.detection.detector`.
"""

from pipeline.ingest.parsing.common import normalize_pci, prefix_is_kernel
from pipeline.ingest.parsing.kernel import (
    FallenOffBusLine,
    GpuUuidLine,
    KernelLine,
    NcclSegfaultLine,
    SXidLine,
    XidLine,
    parse_kernel_line,
)
from pipeline.ingest.parsing.kmsg import decode_kmsg_escapes, record_lines
from pipeline.ingest.parsing.pod import PodSignal, match_pod_signal, pod_anchor

__all__ = [
    "FallenOffBusLine",
    "GpuUuidLine",
    "KernelLine",
    "NcclSegfaultLine",
    "PodSignal",
    "SXidLine",
    "XidLine",
    "decode_kmsg_escapes",
    "match_pod_signal",
    "normalize_pci",
    "parse_kernel_line",
    "pod_anchor",
    "prefix_is_kernel",
    "record_lines",
]
