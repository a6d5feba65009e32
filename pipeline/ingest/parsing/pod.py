"""Pure matchers for GPU fault signals in pod / container logs.

Pod logs are weaker evidence than kernel lines: they are tenant-controlled text, and when one node
fails every rank of a distributed job reports errors. Each signal is therefore tagged with a grade
(:class:`schemas.records.SignalGrade`):

- ``hardware``: the CUDA runtime says the hardware failed (uncorrectable ECC / NVLink error);
- ``application``: the job's own bug or a crash it caused (illegal address, device-side assert, ...);
- ``sympathetic``: collective-communication failures every rank reports when a peer dies (NCCL
  watchdog timeouts, remote process exited, NET/IB completion errors with a status, failed ibv_* verbs
  calls, socket transport "Connection reset by peer") and the CUDA errors a job prints when its GPU is gone or
  unusable (``cudaErrorUnknown``, ``cudaErrorDevicesUnavailable``: the event carries the CUDA error's name and
  number, :data:`CUDA_ERRORS`). Never act on these alone: the aggregator attaches them to kernel evidence on the
  same node (corroboration), exactly like the watchdog timeouts.

The patterns cover the CUDA runtime's error strings (``cudaGetErrorString``), the driver API's
enum names (``CUDA_ERROR_*``) and runtime enum names (``cudaError*``), as PyTorch, JAX and NCCL print them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from schemas.records import SignalGrade


@dataclass(frozen=True, slots=True)
class PodSignal:
    """One recognised pod-log signal; ``cuda_error``/``cuda_error_code``: the CUDA runtime's enum name and
    number for the signals that are one CUDA error (the number the line prints where it prints one)."""

    name: str
    grade: SignalGrade
    matched: str
    cuda_error: str | None = None
    cuda_error_code: int | None = None


@dataclass(frozen=True, slots=True)
class CudaError:
    """A CUDA runtime error a signal stands for: its ``cudaError_t`` name and number (``code``), and the numbers
    older runtimes gave it (``legacy``: printed by THC, cutorch and old PyTorch as ``error=30``, ``(30)``)."""

    name: str
    code: int
    legacy: tuple[int, ...] = ()


# (name, grade, regex). Order matters: the first match wins, and hardware beats application
# beats sympathetic, so a line quoting both an NCCL error and its ECC cause counts as hardware.
_SIGNALS: tuple[tuple[str, SignalGrade, str], ...] = (
    ("cuda_ecc_uncorrectable", SignalGrade.HARDWARE,
     r"uncorrectable ECC error encountered|CUDA_ERROR_ECC_UNCORRECTABLE|cudaErrorECCUncorrectable"),
    ("cuda_nvlink_uncorrectable", SignalGrade.HARDWARE,
     r"uncorrectable NVLink error detected|CUDA_ERROR_NVLINK_UNCORRECTABLE|cudaErrorNvlinkUncorrectable"),
    # NVML's NVML_ERROR_GPU_IS_LOST text and nvidia-smi's "GPU is lost" as a container prints them.
    ("nvml_gpu_lost", SignalGrade.HARDWARE,
     r"GPU has fallen off the bus or has otherwise become inaccessible|NVML_ERROR_GPU_IS_LOST"
     r"|NVMLError_GpuIsLost|GPU is lost\.\s+Reboot the system"),
    ("cuda_illegal_address", SignalGrade.APPLICATION,
     r"an illegal memory access was encountered|CUDA_ERROR_ILLEGAL_ADDRESS|cudaErrorIllegalAddress"),
    ("cuda_launch_failure", SignalGrade.APPLICATION,
     r"unspecified launch failure|CUDA_ERROR_LAUNCH_FAILED|cudaErrorLaunchFailure"),
    ("cuda_misaligned_address", SignalGrade.APPLICATION,
     r"CUDA error: misaligned address|CUDA_ERROR_MISALIGNED_ADDRESS|cudaErrorMisalignedAddress"
     r"|\bmisaligned address\b"),
    ("cuda_device_assert", SignalGrade.APPLICATION,
     r"device-side assert triggered|CUDA_ERROR_ASSERT\b|cudaErrorAssert\b"),
    ("cuda_illegal_instruction", SignalGrade.APPLICATION,
     r"an illegal instruction was encountered|CUDA_ERROR_ILLEGAL_INSTRUCTION|cudaErrorIllegalInstruction"),
    ("cuda_launch_timeout", SignalGrade.APPLICATION,
     r"the launch timed out and was terminated|CUDA_ERROR_LAUNCH_TIMEOUT|cudaErrorLaunchTimeout"),
    ("cuda_invalid_device_ordinal", SignalGrade.APPLICATION,
     r"invalid device ordinal|CUDA_ERROR_INVALID_DEVICE\b|cudaErrorInvalidDevice\b"),
    # The GPU is gone or unusable (cudaErrorUnknown 999, 30 before CUDA 10.1; cudaErrorDevicesUnavailable 46, 38
    # before): as PyTorch ("CUDA error: unknown error"), NCCL ("NCCL WARN Cuda failure 999 'unknown error'", and
    # "Last error: Cuda failure 999 'unknown error'" after ncclUnhandledCudaError), THC ("THCudaCheck FAIL ...
    # error=30 : unknown error"), cutorch ("cuda runtime error (30) : unknown error") and the driver API
    # (CUDA_ERROR_UNKNOWN, CUDA_ERROR_DEVICE_UNAVAILABLE: "CUDA-capable device(s) is/are busy or unavailable") print
    # them. Every rank of a job whose GPU fell off prints them, and so does a job on a GPU in exclusive-process
    # mode held by another process, or a broken driver install: never proof alone, corroboration only.
    ("cuda_unknown_error", SignalGrade.SYMPATHETIC,
     r"CUDA error: unknown error|Cuda failure (?:\d+ )?'unknown error"
     r"|THCudaCheck FAIL\b[^\n]*?error=(?:30|999) : unknown error|cuda runtime error \((?:30|999)\) : unknown error"
     r"|CUDA_ERROR_UNKNOWN\b|cudaErrorUnknown\b"),
    ("cuda_devices_unavailable", SignalGrade.SYMPATHETIC,
     r"(?i:all CUDA-capable devices are busy or unavailable|CUDA-capable device\(s\) is/are busy or unavailable)"
     r"|CUDA_ERROR_DEVICE_UNAVAILABLE\b|cudaErrorDevicesUnavailable\b"),
    ("nccl_watchdog_timeout", SignalGrade.SYMPATHETIC,
     r"Watchdog caught collective operation timeout"),
    # PyTorch's NCCL process group when a collective hangs or a peer died: the communicator is aborted,
    # the heartbeat monitor fires, "Some NCCL operations have failed or timed out".
    ("nccl_communicator_aborted", SignalGrade.SYMPATHETIC,
     r"NCCL communicator was aborted|Some NCCL operations have failed or timed out|Heartbeat monitor timed out"),
    ("nccl_remote_error", SignalGrade.SYMPATHETIC,
     r"remote process exited or there was a network error"),
    ("nccl_unhandled_system_error", SignalGrade.SYMPATHETIC,
     r"NCCL error[^\n]*unhandled system error|ncclSystemError"),
    ("nccl_unhandled_cuda_error", SignalGrade.SYMPATHETIC,
     r"unhandled cuda error|ncclUnhandledCudaError"),
    # NCCL's network transports when a peer's node dies: IB/RoCE work completions with an error status
    # ("NET/IB : Got completion from peer 10.0.0.2<41234> with status=12 opcode=0 ..." in NCCL >= 2.19,
    # "NET/IB : Got completion with error 12, opcode 0, len 0, vendor err 129" before), async port events,
    # AWS OFI completion errors, and the socket transport's recv failing on a reset or closed connection.
    ("nccl_net_ib_error", SignalGrade.SYMPATHETIC,
     r"NET/IB\s*:\s*Got (?:completion\b[^\n]*?with (?:error|status)|async (?:error )?event)"),
    # NCCL's verbs wrapper (misc/ibvwrap.cc) when an ibv_* call fails: "NCCL WARN Call to ibv_create_cq failed",
    # "... Call to ibv_modify_qp failed with error Connection timed out", "... failed with 110 Connection timed
    # out, on dev mlx5_0:1, curr state INIT, next state RTR, ..." (NCCL >= 2.2x), "Call to ibv_poll_cq()
    # returned -1". A peer that died, a fabric problem or the job's own limits (memlock for ibv_reg_mr): the
    # node's GPUs are not implicated on their own. Only NCCL's WARN line counts; UCX, libfabric and others
    # word their ibv_* failures differently and are not NCCL's transport.
    ("nccl_ibv_call_failed", SignalGrade.SYMPATHETIC,
     r"NCCL WARN Call to ibv_\w+(?:\(\))? (?:failed|returned)"),
    ("nccl_net_ofi_error", SignalGrade.SYMPATHETIC,
     r"NET/OFI\b[^\n]*?(?:error|failed)"),
    ("nccl_net_socket_error", SignalGrade.SYMPATHETIC,
     r"(?:NET/|[Nn][Cc][Cc][Ll]|socketProgress)[^\n]*?"
     r"(?:Connection reset by peer|Connection closed by (?:remote )?peer|Broken pipe)"),
    ("nccl_error", SignalGrade.SYMPATHETIC,
     r"NCCL error\b|ncclInternalError|ncclRemoteError"),
)

_COMBINED_RE = re.compile("|".join(f"(?P<s{i}>{pattern})" for i, (_, _, pattern) in enumerate(_SIGNALS)))

CUDA_ERRORS: dict[str, CudaError] = {
    "cuda_unknown_error": CudaError("cudaErrorUnknown", 999, legacy=(30,)),
    "cuda_devices_unavailable": CudaError("cudaErrorDevicesUnavailable", 46, legacy=(38,)),
}
"""The CUDA error each CUDA-error signal is (names and numbers from the CUDA runtime's ``cudaError_t``)."""

# The number a line prints next to the error's text: "Cuda failure 999 '...'", "error=30 : ...", "(46) : ...".
_CUDA_NUMBER_RE = re.compile(r"(?:Cuda failure |error=|error \()(\d{1,4})\b")

# Every pattern above contains one of these substrings; lines without any of them are skipped
# with plain substring scans before the regular expression runs.
POD_ANCHORS: tuple[str, ...] = (
    "rror",  # error / Error / cudaError* / CUDA_ERROR_* (upper case checked below)
    "RROR",
    "ailure",
    "ssert",
    "misaligned",
    "ordinal",
    "Watchdog",
    "NCCL",
    "Heartbeat monitor",
    "timed out",
    "remote process",
    "NET/",
    "fallen off the bus",
    "GPU is lost",
    "GpuIsLost",
    "reset by peer",
    "closed by",
    "Broken pipe",
    "-capable device",  # "CUDA-capable device(s) is/are busy or unavailable" (any case)
)


def pod_anchor(line: str) -> bool:
    """Cheap test: can ``line`` contain a pod signal at all?"""
    for anchor in POD_ANCHORS:
        if anchor in line:
            return True
    return False


def match_pod_signal(line: str) -> PodSignal | None:
    """The strongest signal in one pod-log line, or None."""
    if not pod_anchor(line):
        return None
    best: tuple[int, re.Match[str]] | None = None
    for m in _COMBINED_RE.finditer(line):
        index = int(m.lastgroup[1:]) if m.lastgroup else len(_SIGNALS)
        if best is None or index < best[0]:
            best = (index, m)
        if index == 0:
            break
    if best is None:
        return None
    name, grade, _ = _SIGNALS[best[0]]
    cuda = CUDA_ERRORS.get(name)
    if cuda is None:
        return PodSignal(name=name, grade=grade, matched=best[1].group(0))
    number = _CUDA_NUMBER_RE.search(best[1].group(0))
    printed = int(number.group(1)) if number else None
    code = printed if printed in (cuda.code, *cuda.legacy) else cuda.code
    return PodSignal(name=name, grade=grade, matched=best[1].group(0), cuda_error=cuda.name, cuda_error_code=code)
