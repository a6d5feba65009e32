"""The CUDA errors a job prints when its GPU is gone or unusable (issue 36, deliverable 4): pod errors with their
CUDA error name and number, graded sympathetic, never a quarantine alone, and corroboration of the node's kernel
evidence, through the real detector and aggregator. Lines are the pod corpus's (public issues named there) but
for the driver API's enum name, constructed in JAX's spelling.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from pipeline.aggregate.aggregator import Aggregator
from pipeline.detection.detector import Detector
from pipeline.ingest.parsing.pod import CUDA_ERRORS, match_pod_signal
from schemas.records import Action, FaultEvent, LogRecord, NodeIncident, SignalGrade, Source

T0 = datetime(2026, 3, 3, 18, 39, tzinfo=UTC)
LINES = {
    "DESKTOP-1CE5APL:1689:2800 [0] include/alloc.h:112 NCCL WARN Cuda failure 999 'unknown error'":
        ("cuda_unknown_error", "cudaErrorUnknown", 999),
    "[rank0]: Cuda failure 999 'unknown error'": ("cuda_unknown_error", "cudaErrorUnknown", 999),
    "RuntimeError: CUDA error: unknown error": ("cuda_unknown_error", "cudaErrorUnknown", 999),
    "THCudaCheck FAIL file=..\\aten\\src\\THC\\THCGeneral.cpp line=87 error=30 : unknown error":
        ("cuda_unknown_error", "cudaErrorUnknown", 30),
    "luajit: cuda runtime error (30) : unknown error at /tmp/luarocks_cutorch-scm-1-9927/cutorch/lib/THC/"
    "THCStorage.c:113": ("cuda_unknown_error", "cudaErrorUnknown", 30),
    "jax.errors: CUDA_ERROR_UNKNOWN: unknown error": ("cuda_unknown_error", "cudaErrorUnknown", 999),  # constructed
    "RuntimeError: CUDA error: all CUDA-capable devices are busy or unavailable":
        ("cuda_devices_unavailable", "cudaErrorDevicesUnavailable", 46),
    "RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable":
        ("cuda_devices_unavailable", "cudaErrorDevicesUnavailable", 46),
    "RuntimeError: cuda runtime error (46) : all CUDA-capable devices are busy or unavailable at /home/gpu/dev/rt/"
    "pytorch/torch/lib/THC/generic/THCStorage.cu:66": ("cuda_devices_unavailable", "cudaErrorDevicesUnavailable", 46),
}


@pytest.mark.parametrize("line", list(LINES))
def test_each_spelling_is_the_cuda_error_by_name_and_number(line: str) -> None:
    name, cuda_error, number = LINES[line]
    signal = match_pod_signal(line)
    assert signal is not None
    assert (signal.name, signal.grade, signal.cuda_error, signal.cuda_error_code) == (
        name, SignalGrade.SYMPATHETIC, cuda_error, number)
    assert CUDA_ERRORS[name].name == cuda_error
    [event] = Detector().process(LogRecord(node="n1", source=Source.POD, ts=T0, line=line, pod="train-0"))
    assert (event.grade, event.action, event.quarantine) == (SignalGrade.SYMPATHETIC, Action.IGNORE, False)
    assert (event.detail["cuda_error"], event.detail["cuda_error_code"]) == (cuda_error, number)


@pytest.mark.parametrize("line", [
    "ERROR:root:request failed: unknown error",  # no CUDA call named
    "ncclUnhandledCudaError: Call to CUDA function failed.",  # NCCL's own signal, no CUDA error in it
])
def test_other_lines_are_not_these_errors(line: str) -> None:
    signal = match_pod_signal(line)
    assert signal is None or signal.cuda_error is None


def pod(line: str, at: float) -> LogRecord:
    return LogRecord(node="n1", source=Source.POD, ts=T0 + timedelta(seconds=at), line=line, namespace="ml",
                     pod=f"rank-{int(at)}", container="trainer")


def kernel(line: str, at: float) -> LogRecord:
    return LogRecord(node="n1", source=Source.KERNEL, ts=T0 + timedelta(seconds=at), line=line)


def run(records: list[LogRecord]) -> tuple[list[FaultEvent], list[NodeIncident], Aggregator, object]:
    detector, agg = Detector(), Aggregator()
    state, events, out = agg.new_state("n1"), [], []
    for record in records:
        for event in detector.process(record):
            events.append(event)
            state, emitted = agg.step(state, event, now=1_000.0)
            out += [o for o in emitted if isinstance(o, NodeIncident)]
    return events, out, agg, state


def test_alone_they_open_nothing() -> None:
    events, out, _, state = run([pod(line, i) for i, line in enumerate(LINES)])
    assert len(events) == len(LINES) and out == [] and state.incidents == {}


def test_they_corroborate_the_nodes_kernel_evidence() -> None:
    """Every rank prints them around the Xid 79 of the GPU that fell off: they join its incident as evidence,
    before it (held, then claimed) and after it (attached)."""
    xid79 = "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    before, after = list(LINES)[0], list(LINES)[6]
    events, out, agg, state = run([pod(before, 0), kernel(xid79, 5), pod(after, 20)])
    [incident] = out
    assert incident.action is Action.REBOOT_NODE and events[0].id in incident.evidence_ids
    assert "pod_error:sympathetic:cuda_unknown_error" in incident.signatures
    lost = state.incidents["gpu_lost:0000:4e:00.0"]
    assert events[2].id in lost.evidence_ids
    assert "pod_error:sympathetic:cuda_devices_unavailable" in lost.signatures
    # Outside the corroboration window: held, not attached.
    late = agg.settings.corroboration_window_s + 60
    _, more, _, _ = run([kernel(xid79, 0), pod(after, late)])
    assert len(more) == 1 and len(more[0].evidence_ids) == 1
