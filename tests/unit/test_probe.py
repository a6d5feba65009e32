"""Probe checks against an injected NVML stand-in (it replaces GPU hardware, which this machine lacks)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest
from click.testing import CliRunner

from pipeline.ingest.probe import (
    DriverCall,
    check_gpu_count,
    normalise_bus_id,
    read_boot_id,
    run_checks,
)
from schemas.records import HealthCheckResult, Severity

NODE = "gpu-node-1"
BOOT = "3f1c2a4e-0000-4000-8000-000000000001"


def nvml_error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


@dataclass
class FakeGpu:
    uuid: str
    bus_id: str
    links: dict[int, int] = field(default_factory=lambda: {i: 1 for i in range(18)})
    ecc_volatile: int | Exception = 0
    ecc_aggregate: int = 0
    remapped: tuple[int, int, int, int] | Exception = (0, 0, 0, 0)
    handle_error: Exception | None = None


class FakeNvml:
    """Answers like NVML for a configured set of GPUs; raises pynvml's own error classes."""

    NVMLError = pynvml.NVMLError

    def __init__(self, gpus: list[FakeGpu], hang: threading.Event | None = None, driver_error: int | None = None):
        self.gpus = gpus
        self.hang = hang
        self.driver_error = driver_error
        self.shutdowns = 0

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        if self.hang is not None:
            self.hang.wait(30)
        if self.driver_error is not None:
            raise nvml_error(self.driver_error)
        return "570.86.15"

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:  # noqa: N802
        gpu = self.gpus[index]
        if gpu.handle_error is not None:
            raise gpu.handle_error
        return gpu

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str:  # noqa: N802
        return handle.uuid

    def nvmlDeviceGetPciInfo(self, handle: FakeGpu) -> Any:  # noqa: N802
        return SimpleNamespace(busId=handle.bus_id.encode())

    def nvmlDeviceGetNvLinkState(self, handle: FakeGpu, link: int) -> int:  # noqa: N802
        if link not in handle.links:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return handle.links[link]

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeGpu, error_type: int, counter_type: int) -> int:  # noqa: N802
        assert error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        if counter_type == pynvml.NVML_VOLATILE_ECC:
            if isinstance(handle.ecc_volatile, Exception):
                raise handle.ecc_volatile
            return handle.ecc_volatile
        assert counter_type == pynvml.NVML_AGGREGATE_ECC
        return handle.ecc_aggregate

    def nvmlDeviceGetRemappedRows(self, handle: FakeGpu) -> tuple[int, int, int, int]:  # noqa: N802
        if isinstance(handle.remapped, Exception):
            raise handle.remapped
        return handle.remapped


def hgx(n: int = 8) -> list[FakeGpu]:
    return [
        FakeGpu(uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000", bus_id=f"00000000:{0x18 + i:02X}:00.0")
        for i in range(n)
    ]


def by_check(results: list[HealthCheckResult], check: str) -> list[HealthCheckResult]:
    return [r for r in results if r.check == check]


def failed(results: list[HealthCheckResult]) -> list[tuple[str, int | None]]:
    return [(r.check, r.gpu_index) for r in results if not r.passed]


def test_healthy_hgx_node_passes_every_check() -> None:
    results = run_checks(FakeNvml(hgx()), NODE, expected_gpus=8, boot_id=BOOT)
    assert failed(results) == []
    assert [r.check for r in results[:2]] == ["driver", "gpu_count"]
    assert (
        len(by_check(results, "nvlink"))
        == len(by_check(results, "ecc"))
        == len(by_check(results, "remapped_rows"))
        == 8
    )
    assert {r.node for r in results} == {NODE} and {r.boot_id for r in results} == {BOOT}
    first_ecc = by_check(results, "ecc")[0]
    assert (first_ecc.gpu_index, first_ecc.pci, first_ecc.gpu_uuid) == (0, "0000:18:00.0", hgx()[0].uuid)
    assert by_check(results, "nvlink")[0].values["active"] == 18
    assert by_check(results, "driver")[0].values["driver_version"] == "570.86.15"
    for r in results:  # every record is a valid wire record
        assert HealthCheckResult.from_bytes(r.to_bytes()) == r


def test_missing_gpu_fails_count() -> None:
    results = run_checks(FakeNvml(hgx(7)), NODE, expected_gpus=8)
    (count,) = by_check(results, "gpu_count")
    assert not count.passed and count.severity is Severity.CRITICAL
    assert count.values == {"visible": 7, "usable": 7, "expected": 8}


def test_gpu_count_rules() -> None:
    assert check_gpu_count(NODE, None, 8, 0, None).passed
    assert not check_gpu_count(NODE, None, 0, 0, None).passed
    assert not check_gpu_count(NODE, None, 8, 1, 8).passed
    more = check_gpu_count(NODE, None, 9, 0, 8)
    assert more.passed and more.severity is Severity.WARNING


def test_lost_gpu_handle_is_reported_and_others_still_checked() -> None:
    gpus = hgx()
    gpus[3].handle_error = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
    results = run_checks(FakeNvml(gpus), NODE, expected_gpus=8)
    assert ("gpu_count", None) in failed(results) and ("gpu_count", 3) in failed(results)
    assert len(by_check(results, "ecc")) == 7


def test_one_nvlink_down_fails_that_gpu_only() -> None:
    gpus = hgx()
    gpus[2].links[5] = 0
    results = run_checks(FakeNvml(gpus), NODE)
    assert failed(results) == [("nvlink", 2)]
    bad = by_check(results, "nvlink")[2]
    assert bad.values["down_links"] == [5] and bad.values["expected"] == 18
    assert bad.severity is Severity.ERROR


def test_pcie_node_without_nvlink_passes() -> None:
    gpus = hgx(2)
    for g in gpus:
        g.links = {}
    results = run_checks(FakeNvml(gpus), NODE, expected_gpus=2)
    assert failed(results) == []
    assert by_check(results, "nvlink")[0].message == "no NVLink on this GPU"


def test_explicit_expected_nvlinks() -> None:
    gpus = hgx(1)
    gpus[0].links = {0: 1, 1: 1, 2: 1, 3: 1}
    assert failed(run_checks(FakeNvml(gpus), NODE, expected_nvlinks=4)) == []
    assert failed(run_checks(FakeNvml(gpus), NODE, expected_nvlinks=18)) == [("nvlink", 0)]


def test_all_links_down_everywhere_fails_with_explicit_expectation() -> None:
    gpus = hgx(2)
    for g in gpus:
        g.links = {i: 0 for i in range(18)}
    assert failed(run_checks(FakeNvml(gpus), NODE, expected_nvlinks=18)) == [("nvlink", 0), ("nvlink", 1)]


def test_volatile_uncorrectable_ecc_fails_aggregate_only_warns() -> None:
    gpus = hgx(2)
    gpus[0].ecc_volatile = 2
    gpus[1].ecc_aggregate = 5
    results = run_checks(FakeNvml(gpus), NODE)
    assert failed(results) == [("ecc", 0)]
    ecc0, ecc1 = by_check(results, "ecc")
    assert ecc0.severity is Severity.ERROR and ecc0.values["uncorrected_volatile"] == 2
    assert ecc1.passed and ecc1.severity is Severity.WARNING


def test_ecc_not_supported_passes_other_error_fails() -> None:
    gpus = hgx(2)
    gpus[0].ecc_volatile = nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    gpus[1].ecc_volatile = nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
    ecc0, ecc1 = by_check(run_checks(FakeNvml(gpus), NODE), "ecc")
    assert ecc0.passed and ecc0.values == {"supported": False}
    assert not ecc1.passed and ecc1.severity is Severity.CRITICAL and ecc1.values["nvml_error"] == 15


@pytest.mark.parametrize(
    ("remapped", "passed", "severity"),
    [
        ((3, 1, 0, 0), True, Severity.INFO),
        ((0, 1, 1, 0), False, Severity.ERROR),
        ((0, 512, 0, 1), False, Severity.CRITICAL),
        ((0, 512, 1, 1), False, Severity.CRITICAL),
    ],
)
def test_remapped_rows(remapped: tuple[int, int, int, int], passed: bool, severity: Severity) -> None:
    gpus = hgx(1)
    gpus[0].remapped = remapped
    (result,) = by_check(run_checks(FakeNvml(gpus), NODE), "remapped_rows")
    assert (result.passed, result.severity) == (passed, severity)
    assert result.values["pending"] == bool(remapped[2]) and result.values["failure"] == bool(remapped[3])


def test_remapped_rows_unsupported_before_ampere() -> None:
    gpus = hgx(1)
    gpus[0].remapped = nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
    (result,) = by_check(run_checks(FakeNvml(gpus), NODE), "remapped_rows")
    assert result.passed and "not supported" in result.message


def test_hung_driver_fails_and_stops_the_round() -> None:
    hang = threading.Event()
    call = DriverCall()
    try:
        results = run_checks(FakeNvml(hgx(), hang=hang), NODE, call=call, driver_timeout_s=0.05)
        assert [(r.check, r.passed, r.severity) for r in results] == [("driver", False, Severity.CRITICAL)]
        # While the first call is still stuck the next round fails at once, without a second thread.
        again = run_checks(FakeNvml(hgx(), hang=hang), NODE, call=call, driver_timeout_s=0.05)
        assert [(r.check, r.passed) for r in again] == [("driver", False)]
    finally:
        hang.set()


def test_driver_error_fails() -> None:
    results = run_checks(FakeNvml(hgx(), driver_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED), NODE)
    assert [(r.check, r.passed) for r in results] == [("driver", False)]
    assert results[0].values["nvml_error"] == pynvml.NVML_ERROR_DRIVER_NOT_LOADED


def test_normalise_bus_id() -> None:
    assert normalise_bus_id("00000000:4E:00.0") == "0000:4e:00.0"
    assert normalise_bus_id(b"00000000:4E:00.0") == "0000:4e:00.0"
    assert normalise_bus_id("0000:03:00") == "0000:03:00.0"
    assert normalise_bus_id("03:00.0") == "0000:03:00.0"
    assert normalise_bus_id("garbage") is None


def test_read_boot_id(tmp_path: Path) -> None:
    path = tmp_path / "boot_id"
    path.write_text(BOOT + "\n")
    assert read_boot_id(path) == BOOT
    assert read_boot_id(tmp_path / "absent") is None


def machine_has_gpu() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_cli_once_stdout_on_this_machine() -> None:
    """Without a driver: a clear message and a non-zero exit. With one (the GPU runner): JSON records."""
    from pipeline.commands.probe import EXIT_NO_GPU, probe

    result = CliRunner().invoke(probe, ["--node", NODE, "--once", "--stdout"])
    if not machine_has_gpu():
        assert result.exit_code == EXIT_NO_GPU
        assert "no usable NVIDIA GPU/driver" in result.output
        return
    assert result.exit_code in (0, 1), result.output
    records = [HealthCheckResult.from_bytes(line) for line in result.stdout.splitlines() if line.strip()]
    assert records[0].check == "driver" and records[0].passed
    assert {r.check for r in records} >= {"driver", "gpu_count", "ecc", "remapped_rows", "nvlink"}
    assert result.exit_code == (1 if any(not r.passed for r in records) else 0)
