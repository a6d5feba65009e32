"""``xidflow classify`` through click's runner (the real command object, real files)."""

from __future__ import annotations

from pathlib import Path

import orjson
from click.testing import CliRunner

from pipeline.cli import cli

KERNEL_LOG = (
    b"[  179.43] IPv6: ADDRCONF(NETDEV_CHANGE): eth0: link becomes ready\n"
    b"Nov 21 23:11:02 host kernel: NVRM: Xid (PCI:0000:4E:00): 79, pid='<unknown>', name=<unknown>, "
    b"GPU has fallen off the bus.\n"
    b"[   38.17] nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Non-fatal, Link 44 Minion Link DLREQ\n"
    b"[   38.18] nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 22013, Severity 0 Engine instance 44\n"
    b"dmesg | grep \"NVRM: Xid (PCI:0000:4e:00): 79, x\"\n"
    b"[Thu Jul  4 11:09:40 2024] NVRM: Xid (0000:03:00): 62, Channel 00000001\n"
)


def run(args: list[str], stdin: bytes | None = None):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, ["classify", *args], input=stdin)


def test_json_rows(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_bytes(KERNEL_LOG)
    result = run(["--format", "json", str(log)])
    assert result.exit_code == 0, result.output
    rows = [orjson.loads(line) for line in result.output.splitlines()]
    assert [(r["line"], r["kind"], r["code"]) for r in rows] == [(2, "xid", 79), (3, "sxid", 22013), (6, "xid", 62)]
    first = rows[0]
    assert first["pci"] == "0000:4e:00.0" and first["action"] == "REBOOT_NODE"
    assert first["quarantine"] is True and first["severity"] == "critical"
    assert rows[1]["quarantine"] is False and rows[1]["action"] == "IGNORE"
    assert rows[2]["action"] == "RESET_GPU" and rows[2]["pci"] == "0000:03:00.0"


def test_stdin_and_pod_source() -> None:
    result = run(["--source", "pod", "--format", "json", "-"],
                 stdin=b"ok\nRuntimeError: CUDA error: an illegal memory access was encountered\n")
    assert result.exit_code == 0
    [row] = [orjson.loads(line) for line in result.output.splitlines()]
    assert (row["line"], row["kind"], row["grade"], row["code"], row["pci"]) == (2, "pod_error", "application",
                                                                                None, None)


def test_undecodable_bytes_do_not_crash(tmp_path: Path) -> None:
    log = tmp_path / "mixed.log"
    log.write_bytes(b"\xff\xfe\x00garbage \xc3\x28\n" + b"NVRM: Xid (PCI:0000:01:00): 48, pid=1, name=\xe9t\xe9, DBE\n")
    result = run(["--format", "json", str(log)])
    assert result.exit_code == 0, result.output
    [row] = [orjson.loads(line) for line in result.output.splitlines()]
    assert row["code"] == 48 and row["line"] == 2


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    result = run([str(tmp_path / "nope.log")])
    assert result.exit_code != 0
    assert "cannot read" in result.output and "nope.log" in result.output


def test_unrecognised_input_prints_nothing_in_json() -> None:
    result = run(["--format", "json"], stdin=b"hello\nworld\n")
    assert result.exit_code == 0 and result.output == ""


def test_text_table(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_bytes(KERNEL_LOG)
    result = run([str(log)])
    assert result.exit_code == 0
    assert "3 fault(s) recognised" in result.output and "REBOOT_NODE" in result.output


def test_bad_override_file_is_reported(tmp_path: Path) -> None:
    overrides = tmp_path / "o.yaml"
    overrides.write_text("xid:\n  79: {action: NUKE}\n")
    result = run(["--catalog-overrides", str(overrides), "-"], stdin=b"")
    assert result.exit_code != 0 and "xid 79: action" in result.output
