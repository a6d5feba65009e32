"""deploy/fluent-bit/fluent-bit.yaml: it parses, has the pipeline xidflow's adapters expect, and its
grep prefilter keeps every line that can matter while dropping noise.

Fluent Bit evaluates the regex with Onigmo; the test evaluates the same text with Python's ``re``.
The regex is kept to the syntax both share (literal alternatives and character classes), which the
test also enforces, so the two engines agree.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pipeline.ingest.parsing.kernel import parse_kernel_line
from pipeline.ingest.parsing.pod import match_pod_signal

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "fluent-bit" / "fluent-bit.yaml"
VALUES = ROOT / "deploy" / "helm" / "xidflow" / "values.yaml"


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def _grep(config: dict, match: str) -> tuple[str, re.Pattern[str]]:
    greps = [f for f in config["pipeline"]["filters"] if f["name"] == "grep" and f["match"] == match]
    assert len(greps) == 1
    key, _, regex = greps[0]["regex"].partition(" ")
    return key, re.compile(regex)


KERNEL_FAULTS = [
    "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
    "NVRM: Xid (0000:03:00): 62, Channel 00000001",
    "[538441.007373] NVRM: Xid (PCI:0000:b7:00): 48, pid=2331, name=python, An uncorrectable double bit error",
    "[Thu Jul  4 11:09:40 2024] NVRM: Xid (PCI:0000:18:00): 13, pid=771, name=pt_main_thread, Graphics "
    "SM Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address",
    "Nov 21 23:11:02 gpu-17 kernel: NVRM: Xid (PCI:0000:3b:00): 74, pid=1, name=x, NVLink: fatal error "
    "detected on link 4(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    "kernel: NVRM: Xid (PCI:0000:9a:00): 154, GPU recovery action changed from 0x0 (None) to 0x2 "
    "(Node Reboot Required)",
    "NVRM: Xid (PCI:0000:1b:00): 145, pid=<unknown>, name=<unknown>, 0x4 Fatal XC0 i0 Link 3 (0x00000000 0x0)",
    "NVRM: GPU at PCI:0000:4e:00: GPU-6bc4a5e1-3c27-e7c6-b7c6-4e5a96b0ec8f",
    "NVRM: The NVIDIA GPU 0000:4e:00.0",
    "NVRM: (PCI ID: 10de:2330) installed in this system has",
    "NVRM: fallen off the bus and is not responding to commands.",
    "NVRM: GPU 0000:4e:00.0: GPU has fallen off the bus.",
    "nvidia-nvswitch3: SXid (PCI:0000:87:00.0): 12028, Non-fatal, Link 46 egress non-posted PRIV error",
    "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Fatal, Link 30 LTSSM Fault Up",
    "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, Severity 1 Engine instance 30 Sub-engine instance 00",
    "[Jul 09 2024 18:14:07] [ERROR] [tid 12727] detected NVSwitch non-fatal error 12028 on fid 0 on NVSwitch pci bus "
    "id 00000000:86:00.0 physical id 3 port 61",
    "NVRM: Xid (PCI:0000:01:00 GPU-I:05): 94, pid=7194, Contained: CE User Channel (0x9). RST: No, D-RST: No",
    "user  :err   : [ 1331.000000] NVRM: Xid (PCI:0000:06:00): 62, pid='<unknown>', name=<unknown>, 0000(0000)",
    "python[12345]: segfault at 7f3a2c000000 ip 00007f3a3b2e1f00 sp 00007ffd9a8c0a10 error 4 in "
    "libnccl.so.2.19.3[7f3a3a000000+1c00000]",
]

POD_FAULTS = [
    "RuntimeError: CUDA error: uncorrectable ECC error encountered",
    "RuntimeError: CUDA error: an illegal memory access was encountered",
    "RuntimeError: CUDA error: unspecified launch failure",
    "RuntimeError: CUDA error: misaligned address",
    "RuntimeError: CUDA error: device-side assert triggered",
    "RuntimeError: CUDA error: invalid device ordinal",
    "cudaErrorNvlinkUncorrectable: uncorrectable NVLink error detected during the execution",
    "jax.errors: CUDA_ERROR_ECC_UNCORRECTABLE: uncorrectable ECC error encountered",
    "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, "
    "NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600046 milliseconds before timing out.",
    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, "
    "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3",
    "ncclUnhandledCudaError: Call to CUDA function failed. unhandled cuda error",
    "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely. "
    "remote process exited or there was a network error",
    "node-7:1234:1240 [0] NCCL INFO NET/IB : Got completion with error 12, opcode 0, len 0",
    # The CUDA errors of a job whose GPU is gone (issue 36), in each spelling that names no "CUDA error".
    "gpu47:4962:5097 [1] transport/nvls.cc:223 NCCL WARN Cuda failure 999 'unknown error'",
    "[rank0]: Cuda failure 999 'unknown error'",
    "THCudaCheck FAIL file=..\\aten\\src\\THC\\THCGeneral.cpp line=87 error=30 : unknown error",
    "luajit: cuda runtime error (30) : unknown error at /tmp/luarocks_cutorch-scm-1-9927/cutorch/lib/THC/"
    "THCStorage.c:113",
    "CUDA-capable device(s) is/are busy or unavailable",
]

NOISE = [
    "eth0: Link is Up - 100Gbps/Full - flow control off",
    "systemd[1]: Started Session 42 of User root.",
    "usb 1-1: new high-speed USB device number 2 using xhci_hcd",
    "audit: type=1400 audit(1700000000.123:42): apparmor=\"STATUS\" operation=\"profile_load\"",
    "EXT4-fs (nvme0n1p1): mounted filesystem with ordered data mode. Opts: (null)",
    "IPv6: ADDRCONF(NETDEV_CHANGE): cali1234abcd: link becomes ready",
    "epoch 3 step 1200 loss 0.4312 lr 3.0e-4 throughput 812 samples/s",
    "INFO:root:Saving checkpoint to /ckpt/step_1200",
    "GET /healthz 200 0.2ms",
    "nvidia-persistenced[812]: Started NVIDIA Persistence Daemon",
    "kubelet: Successfully probed pod readiness",
    "Out of memory: Killed process 4242 (python) total-vm:123456kB",
]


def test_config_parses_with_the_pipeline_the_adapters_expect(config: dict) -> None:
    inputs = {i["tag"]: i for i in config["pipeline"]["inputs"]}
    assert inputs["kernel"]["name"] == "kmsg"
    assert inputs["kube.*"]["name"] == "tail"
    assert inputs["kube.*"]["path"] == "/var/log/containers/*.log"
    assert "cri" in inputs["kube.*"]["multiline.parser"]
    # Fabric Manager's log at its default path, read into `msg` like a kernel file, routed with the kernel's lines.
    fabric_manager = inputs["kernel.fabricmanager"]
    assert (fabric_manager["name"], fabric_manager["path"]) == ("tail", "/var/log/fabricmanager.log")
    assert fabric_manager["parser"] == "xidflow-kernel-line"
    assert fabric_manager["db"].startswith("/var/fluent-bit/state/")
    filters = config["pipeline"]["filters"]
    names = [f["name"] for f in filters]
    # prefilter before the kubernetes lookup, node name on everything
    assert names.index("grep") < names.index("kubernetes") < names.index("record_modifier")
    assert {"match": "*", "name": "record_modifier", "record": "node ${NODE_NAME}"} in filters
    kube = next(f for f in filters if f["name"] == "kubernetes")
    assert kube["match"] == "kube.*" and kube["kube_tag_prefix"] == "kube.var.log.containers."
    outputs = {o["match"]: o for o in config["pipeline"]["outputs"]}
    assert outputs["kernel*"]["topics"] == "gpu.logs.kernel"  # the kmsg input's lines and Fabric Manager's
    assert outputs["kube.*"]["topics"] == "gpu.logs.pods"
    for out in outputs.values():
        assert out["name"] == "kafka"
        assert out["format"] == "json"
        assert out["message_key_field"] == "node"  # the field record_modifier adds
        assert out["timestamp_key"] == "@timestamp"  # the first of the adapters' TIME_FIELDS
        assert out["brokers"] == "${KAFKA_BROKERS}"


def test_grep_keys_are_the_fields_each_input_produces(config: dict) -> None:
    assert _grep(config, "kernel*")[0] == "msg"  # kmsg records: msg, priority, sec, usec
    assert _grep(config, "kube.*")[0] == "log"  # tail + cri/docker parsers: log


def test_both_inputs_share_one_regex_and_the_chart_uses_it(config: dict) -> None:
    kernel = _grep(config, "kernel*")[1].pattern
    assert kernel == _grep(config, "kube.*")[1].pattern
    values = yaml.safe_load(VALUES.read_text())
    assert values["fluentBit"]["prefilterRegex"] == kernel


def test_regex_stays_in_the_onigmo_python_common_subset(config: dict) -> None:
    pattern = _grep(config, "kernel*")[1].pattern
    # Only literal text, '|' alternatives and [..] classes of letters: no flags, groups, escapes,
    # anchors, look-arounds, quantifiers or POSIX classes, where the two engines could differ.
    assert re.fullmatch(r"(?:[A-Za-z0-9_ :\-]|\[[A-Za-z]+\])+(?:\|(?:[A-Za-z0-9_ :\-]|\[[A-Za-z]+\])+)*", pattern)
    assert "'" not in pattern  # the chart renders it into a single-quoted YAML string


@pytest.mark.parametrize("line", KERNEL_FAULTS)
def test_prefilter_keeps_kernel_faults(config: dict, line: str) -> None:
    assert _grep(config, "kernel*")[1].search(line), line


@pytest.mark.parametrize("line", POD_FAULTS + KERNEL_FAULTS[-1:])
def test_prefilter_keeps_pod_faults(config: dict, line: str) -> None:
    assert _grep(config, "kube.*")[1].search(line), line


@pytest.mark.parametrize("line", NOISE)
def test_prefilter_drops_noise(config: dict, line: str) -> None:
    assert not _grep(config, "kernel*")[1].search(line), line
    assert not _grep(config, "kube.*")[1].search(line), line


def test_the_samples_are_what_the_parsers_recognise() -> None:
    """The fault samples are real signals for xidflow's own parsers, and the noise is not."""
    recognised = [line for line in KERNEL_FAULTS if parse_kernel_line(line) is not None]
    # The 3-line fallen-off-the-bus form is recognised by the stage across lines; each part must still pass.
    assert len(recognised) >= len(KERNEL_FAULTS) - 3
    pod_recognised = [line for line in POD_FAULTS if match_pod_signal(line) is not None]
    assert len(pod_recognised) >= len(POD_FAULTS) - 1  # the NCCL INFO line is kept for context only
    assert not [line for line in NOISE if parse_kernel_line(line) is not None or match_pod_signal(line)]


def test_every_line_a_parser_recognises_passes_the_prefilter(config: dict) -> None:
    """Cross-check against the parsers on the samples plus every pod signal's own alternatives."""
    kernel_re = _grep(config, "kernel*")[1]
    pod_re = _grep(config, "kube.*")[1]
    from pipeline.ingest.parsing import pod as pod_module

    alternatives = [
        alt.replace("\\b", "") for _, _, pattern in pod_module._SIGNALS for alt in pattern.split("|")
        if not re.search(r"[\[\](){}*+?]", alt.replace("\\b", ""))
    ]
    assert len(alternatives) > 20
    for line in KERNEL_FAULTS + POD_FAULTS + NOISE + alternatives:
        if parse_kernel_line(line) is not None:
            assert kernel_re.search(line), f"the parser recognises it, the prefilter drops it: {line}"
        if match_pod_signal(line) is not None:
            assert pod_re.search(line), f"the parser recognises it, the prefilter drops it: {line}"


def test_kafka_outage_buffers_on_disk_instead_of_dropping(config: dict) -> None:
    service = config["service"]
    assert service["storage.path"].startswith("/var/fluent-bit/state/")  # the DaemonSet's host mount
    for inp in config["pipeline"]["inputs"]:
        assert inp["storage.type"] == "filesystem", inp["name"]
    for out in config["pipeline"]["outputs"]:
        assert out["retry_limit"] == "no_limits"  # Fluent Bit's default gives up after 1 retry
        assert out["storage.total_limit_size"]


def test_kernel_lines_carry_the_boot_id_for_replay_dedup(config: dict) -> None:
    """Replays are not byte-identical (in_kmsg's boot time is coarse): ids use boot id + kmsg sequence."""
    from pipeline.ingest.adapters import decode_record

    filters = config["pipeline"]["filters"]
    names = [(f["name"], f["match"]) for f in filters]
    lua = next(f for f in filters if f["name"] == "lua")
    assert lua["match"] == "kernel" and names.index(("grep", "kernel*")) < names.index(("lua", "kernel"))
    assert "/proc/sys/kernel/random/boot_id" in lua["code"] and f"function {lua['call']}(" in lua["code"]
    assert 'record["boot_id"]' in lua["code"]
    header = CONFIG.read_text().split("service:", 1)[0]
    assert "same event and incident ids" in header and "NOT byte-identical" in header
    # What the pipeline then emits for one line, first read and replayed a second later.
    first = {"priority": 3, "sequence": 77, "sec": 1200, "usec": 5, "boot_id": "b-1", "node": "n1",
             "msg": "NVRM: Xid (PCI:0000:4e:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.",
             "@timestamp": "2026-11-22T10:00:00.000005000Z"}
    replay = {**first, "@timestamp": "2026-11-22T10:00:01.000005000Z"}
    import orjson

    (a,), _ = decode_record(orjson.dumps(first), b"n1", None, "gpu.logs.kernel")
    (b,), _ = decode_record(orjson.dumps(replay), b"n1", None, "gpu.logs.kernel")
    assert a.replay_key == b.replay_key is not None
