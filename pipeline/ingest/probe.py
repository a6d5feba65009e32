"""Node-side GPU health checks through NVML, as ``HealthCheckResult`` records.

The checks are those public GPU fleets run before trusting a node (Azure's aznhc, AWS's EKS node
monitoring agent, leptonai/gpud, NVIDIA NVSentinel):

- ``driver``: a timed NVML call; a driver that does not answer within the timeout is a hung GPU/driver,
  and no other check is attempted (they would hang too).
- ``gpu_count``: GPUs NVML sees against the expected count; a missing GPU has fallen off the bus.
- ``nvlink``: per GPU, NVLink links that are supported but not active. Without an explicit expected
  count the node's best GPU sets it, so a PCIe node without NVLink passes and an HGX node with one
  dead link fails.
- ``ecc``: uncorrectable ECC errors, volatile (since the last driver load: any is a failure, threshold
  0 as in aznhc and Meta's GCM ``ecc_uncorrected_volatile_total``) and aggregate (lifetime: reported,
  a warning, not a failure on its own).
- ``remapped_rows``: ``nvmlDeviceGetRemappedRows``. A pending remap needs a GPU reset to take effect
  (NVIDIA's memory error management guide); a remap failure means the GPU is out of spare rows and
  must be replaced.

The checks are pure functions over an NVML-like object (the ``pynvml`` module in production), so
they are tested with a stand-in for the hardware. Unsupported queries (``NVMLError_NotSupported``,
e.g. ECC on a GeForce card, row remapping before Ampere) pass with a message saying so.

One module (about 530 lines): the checks are small pure functions over one NVML-like object, next to
the loop that runs them; split per check, each file would repeat the same NVML handling.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from schemas.records import HealthCheckResult, Severity

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
DEFAULT_DRIVER_TIMEOUT_S = 10.0

# NVML return codes (nvml.h); copied so that the pure checks do not need the NVML library loaded.
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_GPU_IS_LOST = 15
NVML_FEATURE_ENABLED = 1
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_NVLINK_MAX_LINKS = (
    36  # nvml.h of recent drivers (18 on Hopper, more on Blackwell); extra ones are skipped
)

T = TypeVar("T")


class NvmlLike(Protocol):
    """The part of ``pynvml`` the checks use (the module itself satisfies it)."""

    NVMLError: type[Exception]

    def nvmlSystemGetDriverVersion(self) -> str: ...  # noqa: N802 - NVML's names
    def nvmlDeviceGetCount(self) -> int: ...  # noqa: N802
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...  # noqa: N802
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...  # noqa: N802
    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any: ...  # noqa: N802
    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int: ...  # noqa: N802
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter_type: int) -> int: ...  # noqa: N802
    def nvmlDeviceGetRemappedRows(self, handle: Any) -> tuple[int, int, int, int]: ...  # noqa: N802


class GpuInfo:
    """One GPU as the checks see it: index, NVML handle, UUID and PCI address (None if unreadable)."""

    __slots__ = ("index", "handle", "uuid", "pci")

    def __init__(self, index: int, handle: Any, uuid: str | None, pci: str | None) -> None:
        self.index = index
        self.handle = handle
        self.uuid = uuid
        self.pci = pci


def read_boot_id(path: Path = BOOT_ID_PATH) -> str | None:
    """This boot's id (changes on every reboot), or None where the file is absent."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def normalise_bus_id(bus_id: str | bytes | None) -> str | None:
    """NVML's ``00000000:4E:00.0`` -> ``0000:4e:00.0`` (the form FaultEvent.pci uses)."""
    if bus_id is None:
        return None
    text = bus_id.decode("ascii", "replace") if isinstance(bus_id, bytes) else str(bus_id)
    text = text.strip().lower()
    if ":" not in text:
        return None
    domain, _, rest = text.partition(":")
    if rest.count(":") != 1:  # no domain in the string
        domain, rest = "0000", text
    if "." not in rest:
        rest += ".0"
    return f"{domain[-4:].rjust(4, '0')}:{rest}"


def error_code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def describe_error(exc: BaseException) -> str:
    code = error_code(exc)
    name = type(exc).__name__
    return f"{name} (NVML code {code})" if code is not None else f"{name}: {exc}"


class DriverCall:
    """Runs NVML calls with a timeout in a daemon thread (a hung driver call can never be interrupted).

    While an earlier call is still stuck, further calls fail at once instead of piling up threads.
    """

    def __init__(self) -> None:
        self._stuck: threading.Thread | None = None

    def __call__(self, fn: Callable[[], T], timeout_s: float) -> tuple[bool, T | BaseException | None, float]:
        """(finished, result or exception, seconds); finished is False on timeout."""
        if self._stuck is not None and self._stuck.is_alive():
            return False, None, 0.0
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["result"] = fn()
            except BaseException as exc:  # handed back to the caller, not swallowed
                box["error"] = exc

        started = time.monotonic()
        thread = threading.Thread(target=target, name="nvml-call", daemon=True)
        thread.start()
        thread.join(timeout_s)
        elapsed = time.monotonic() - started
        if thread.is_alive():
            self._stuck = thread
            return False, None, elapsed
        self._stuck = None
        return True, box.get("error", box.get("result")), elapsed


def _result(
    node: str,
    check: str,
    boot_id: str | None,
    *,
    passed: bool,
    severity: Severity,
    message: str,
    gpu: GpuInfo | None = None,
    **values: Any,
) -> HealthCheckResult:
    return HealthCheckResult(
        node=node,
        check=check,
        passed=passed,
        severity=severity,
        message=message,
        gpu_index=gpu.index if gpu else None,
        gpu_uuid=gpu.uuid if gpu else None,
        pci=gpu.pci if gpu else None,
        values=values,
        boot_id=boot_id,
    )


def check_driver(
    nvml: NvmlLike,
    node: str,
    boot_id: str | None,
    call: DriverCall,
    timeout_s: float = DEFAULT_DRIVER_TIMEOUT_S,
) -> HealthCheckResult:
    """Is the driver answering? Times a driver-version and device-count query."""

    def query() -> tuple[str, int]:
        version = nvml.nvmlSystemGetDriverVersion()
        if isinstance(version, bytes):
            version = version.decode("ascii", "replace")
        return version, nvml.nvmlDeviceGetCount()

    finished, outcome, elapsed = call(query, timeout_s)
    latency_ms = round(elapsed * 1000, 1)
    if not finished:
        return _result(
            node,
            "driver",
            boot_id,
            passed=False,
            severity=Severity.CRITICAL,
            message=f"NVML did not answer within {timeout_s:g}s: driver or GPU hung",
            latency_ms=latency_ms,
            timeout_s=timeout_s,
        )
    if isinstance(outcome, BaseException):
        return _result(
            node,
            "driver",
            boot_id,
            passed=False,
            severity=Severity.CRITICAL,
            message=f"NVML query failed: {describe_error(outcome)}",
            latency_ms=latency_ms,
            nvml_error=error_code(outcome),
        )
    version, count = outcome  # type: ignore[misc]
    return _result(
        node,
        "driver",
        boot_id,
        passed=True,
        severity=Severity.INFO,
        message=f"driver {version} answered in {latency_ms} ms",
        latency_ms=latency_ms,
        driver_version=version,
        device_count=count,
    )


def list_gpus(nvml: NvmlLike) -> tuple[list[GpuInfo], list[tuple[int, BaseException]]]:
    """Every GPU NVML counts, and the indices whose handle could not be read (GPU lost)."""
    gpus: list[GpuInfo] = []
    failures: list[tuple[int, BaseException]] = []
    for index in range(nvml.nvmlDeviceGetCount()):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as exc:
            failures.append((index, exc))
            continue
        uuid = pci = None
        try:
            raw_uuid = nvml.nvmlDeviceGetUUID(handle)
            uuid = raw_uuid.decode("ascii", "replace") if isinstance(raw_uuid, bytes) else str(raw_uuid)
        except nvml.NVMLError:
            pass
        try:
            pci = normalise_bus_id(getattr(nvml.nvmlDeviceGetPciInfo(handle), "busId", None))
        except nvml.NVMLError:
            pass
        gpus.append(GpuInfo(index, handle, uuid, pci))
    return gpus, failures


def check_gpu_count(
    node: str, boot_id: str | None, visible: int, unreadable: int, expected: int | None
) -> HealthCheckResult:
    """GPUs NVML can use against the expected count."""
    usable = visible - unreadable
    values = {"visible": visible, "usable": usable, "expected": expected}
    if expected is not None and usable < expected:
        return _result(
            node,
            "gpu_count",
            boot_id,
            passed=False,
            severity=Severity.CRITICAL,
            message=f"{usable} usable GPUs, expected {expected}: GPU missing or fallen off the bus",
            **values,
        )
    if expected is None and usable == 0:
        return _result(
            node,
            "gpu_count",
            boot_id,
            passed=False,
            severity=Severity.CRITICAL,
            message="NVML sees no usable GPU",
            **values,
        )
    if expected is not None and usable > expected:
        return _result(
            node,
            "gpu_count",
            boot_id,
            passed=True,
            severity=Severity.WARNING,
            message=f"{usable} GPUs, more than the expected {expected}",
            **values,
        )
    return _result(
        node, "gpu_count", boot_id, passed=True, severity=Severity.INFO, message=f"{usable} GPUs", **values
    )


def nvlink_states(nvml: NvmlLike, gpu: GpuInfo, max_links: int = NVML_NVLINK_MAX_LINKS) -> dict[int, bool]:
    """link -> active, for every link this GPU supports (unsupported/nonexistent links are left out)."""
    states: dict[int, bool] = {}
    for link in range(max_links):
        try:
            states[link] = nvml.nvmlDeviceGetNvLinkState(gpu.handle, link) == NVML_FEATURE_ENABLED
        except nvml.NVMLError as exc:
            if error_code(exc) in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT):
                continue
            raise
    return states


def check_nvlink(
    node: str, boot_id: str | None, gpu: GpuInfo, states: dict[int, bool], expected_active: int | None
) -> HealthCheckResult:
    """A GPU's active NVLinks against the expected count (explicit, or the node's best GPU)."""
    active = sorted(link for link, up in states.items() if up)
    down = sorted(link for link, up in states.items() if not up)
    values = {
        "active": len(active),
        "supported": len(states),
        "down_links": down,
        "expected": expected_active,
    }
    if not states:
        passed = not expected_active
        return _result(
            node,
            "nvlink",
            boot_id,
            gpu=gpu,
            passed=passed,
            severity=Severity.INFO if passed else Severity.ERROR,
            message="no NVLink on this GPU"
            if passed
            else f"no NVLink reported, expected {expected_active} active links",
            **values,
        )
    if expected_active is not None and len(active) < expected_active:
        return _result(
            node,
            "nvlink",
            boot_id,
            gpu=gpu,
            passed=False,
            severity=Severity.ERROR,
            message=f"{len(active)}/{expected_active} NVLinks active; down: {down}",
            **values,
        )
    return _result(
        node,
        "nvlink",
        boot_id,
        gpu=gpu,
        passed=True,
        severity=Severity.INFO,
        message=f"{len(active)} NVLinks active",
        **values,
    )


def check_ecc(
    nvml: NvmlLike, node: str, boot_id: str | None, gpu: GpuInfo, volatile_threshold: int = 0
) -> HealthCheckResult:
    """Uncorrectable ECC errors: volatile above the threshold fails; aggregate alone warns."""
    try:
        volatile = nvml.nvmlDeviceGetTotalEccErrors(
            gpu.handle, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC
        )
        aggregate = nvml.nvmlDeviceGetTotalEccErrors(
            gpu.handle, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_AGGREGATE_ECC
        )
    except nvml.NVMLError as exc:
        return _unsupported_or_failed(node, "ecc", boot_id, gpu, exc)
    values = {
        "uncorrected_volatile": volatile,
        "uncorrected_aggregate": aggregate,
        "volatile_threshold": volatile_threshold,
    }
    if volatile > volatile_threshold:
        return _result(
            node,
            "ecc",
            boot_id,
            gpu=gpu,
            passed=False,
            severity=Severity.ERROR,
            message=f"{volatile} uncorrectable ECC errors since driver load: reset the GPU",
            **values,
        )
    if aggregate > 0:
        return _result(
            node,
            "ecc",
            boot_id,
            gpu=gpu,
            passed=True,
            severity=Severity.WARNING,
            message=f"{aggregate} uncorrectable ECC errors over the GPU's lifetime",
            **values,
        )
    return _result(
        node,
        "ecc",
        boot_id,
        gpu=gpu,
        passed=True,
        severity=Severity.INFO,
        message="no uncorrectable ECC errors",
        **values,
    )


def check_remapped_rows(nvml: NvmlLike, node: str, boot_id: str | None, gpu: GpuInfo) -> HealthCheckResult:
    """Row remapping: failure -> replace the GPU; pending -> reset the GPU to apply it."""
    try:
        corrected, uncorrected, pending, failed = nvml.nvmlDeviceGetRemappedRows(gpu.handle)
    except nvml.NVMLError as exc:
        return _unsupported_or_failed(node, "remapped_rows", boot_id, gpu, exc)
    values = {
        "correctable_rows": corrected,
        "uncorrectable_rows": uncorrected,
        "pending": bool(pending),
        "failure": bool(failed),
    }
    if failed:
        return _result(
            node,
            "remapped_rows",
            boot_id,
            gpu=gpu,
            passed=False,
            severity=Severity.CRITICAL,
            message="row remapping failed: no spare rows left, replace the GPU",
            **values,
        )
    if pending:
        return _result(
            node,
            "remapped_rows",
            boot_id,
            gpu=gpu,
            passed=False,
            severity=Severity.ERROR,
            message="row remap pending: reset the GPU to apply it",
            **values,
        )
    return _result(
        node,
        "remapped_rows",
        boot_id,
        gpu=gpu,
        passed=True,
        severity=Severity.INFO,
        message=f"{corrected + uncorrected} rows remapped, none pending",
        **values,
    )


def _unsupported_or_failed(
    node: str, check: str, boot_id: str | None, gpu: GpuInfo, exc: BaseException
) -> HealthCheckResult:
    if error_code(exc) == NVML_ERROR_NOT_SUPPORTED:
        return _result(
            node,
            check,
            boot_id,
            gpu=gpu,
            passed=True,
            severity=Severity.INFO,
            message="not supported on this GPU",
            supported=False,
        )
    severity = Severity.CRITICAL if error_code(exc) == NVML_ERROR_GPU_IS_LOST else Severity.ERROR
    return _result(
        node,
        check,
        boot_id,
        gpu=gpu,
        passed=False,
        severity=severity,
        message=f"NVML query failed: {describe_error(exc)}",
        nvml_error=error_code(exc),
    )


def run_checks(
    nvml: NvmlLike,
    node: str,
    *,
    expected_gpus: int | None = None,
    expected_nvlinks: int | None = None,
    boot_id: str | None = None,
    call: DriverCall | None = None,
    driver_timeout_s: float = DEFAULT_DRIVER_TIMEOUT_S,
) -> list[HealthCheckResult]:
    """One round of every check on an initialised NVML; the driver check gates the rest."""
    call = call or DriverCall()
    driver = check_driver(nvml, node, boot_id, call, driver_timeout_s)
    if not driver.passed:
        return [driver]
    results = [driver]
    gpus, unreadable = list_gpus(nvml)
    results.append(
        check_gpu_count(node, boot_id, len(gpus) + len(unreadable), len(unreadable), expected_gpus)
    )
    for index, exc in unreadable:
        lost = GpuInfo(index, None, None, None)
        results.append(
            _result(
                node,
                "gpu_count",
                boot_id,
                gpu=lost,
                passed=False,
                severity=Severity.CRITICAL,
                message=f"GPU {index} unreadable: {describe_error(exc)}",
                nvml_error=error_code(exc),
            )
        )
    link_states: dict[int, dict[int, bool] | BaseException] = {}
    for gpu in gpus:
        try:
            link_states[gpu.index] = nvlink_states(nvml, gpu)
        except nvml.NVMLError as exc:
            link_states[gpu.index] = exc
    if expected_nvlinks is None:
        # The node's best GPU sets the bar: HGX boards have every GPU fully linked.
        counts = [sum(s.values()) for s in link_states.values() if isinstance(s, dict)]
        inferred = max(counts, default=0)
        expected_links: int | None = inferred or None
    else:
        expected_links = expected_nvlinks
    for gpu in gpus:
        states = link_states[gpu.index]
        if isinstance(states, BaseException):
            results.append(_unsupported_or_failed(node, "nvlink", boot_id, gpu, states))
        else:
            results.append(check_nvlink(node, boot_id, gpu, states, expected_links))
        results.append(check_ecc(nvml, node, boot_id, gpu))
        results.append(check_remapped_rows(nvml, node, boot_id, gpu))
    return results
