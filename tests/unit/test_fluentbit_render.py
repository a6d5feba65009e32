"""The Fluent Bit configuration the tests and the demo run is the shipped one: only this machine's paths,
ports, topic names, credentials and the documented file form of the kernel input differ."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pipeline.localinfra.fluentbit_run import (
    FABRIC_MANAGER_TAG,
    KERNEL_FILE_PARSERS,
    Render,
    kube_tag_prefix,
    load_shipped,
    render_shipped_config,
    shipped_config_drift,
)


@pytest.mark.parametrize("kernel_source", ["kmsg", "file-lines", "file-kmsg"])
def test_rendering_changes_only_the_allowed_keys(tmp_path: Path, kernel_source: str) -> None:
    render = Render(root=tmp_path, kernel_source=kernel_source, kernel_topic="t-gpu.logs.kernel",  # type: ignore[arg-type]
                    pods_topic="t-gpu.logs.pods", http_port=2021,
                    kube={"kube_url": "https://127.0.0.1:6443", "kube_ca_file": "/ca", "kube_token_file": "/tok"},
                    rdkafka={"compression.codec": "zstd", "sasl.username": "xidflow-shipper"})
    rendered = render_shipped_config(render)
    assert shipped_config_drift(rendered) == []
    assert str(tmp_path) in rendered["service"]["storage.path"]


def test_a_changed_filter_or_output_is_drift(tmp_path: Path) -> None:
    rendered = render_shipped_config(Render(root=tmp_path))
    rendered["pipeline"]["filters"][0]["regex"] = "msg Xid"
    rendered["pipeline"]["outputs"][0]["format"] = "msgpack"
    rendered["pipeline"]["outputs"][0]["rdkafka.request.required.acks"] = 1  # a shipped property changed
    drift = shipped_config_drift(rendered)
    assert len(drift) == 3, drift
    assert any("regex" in d for d in drift) and any("format" in d for d in drift)


def test_fabric_managers_log_moves_under_the_root_and_nothing_else_of_it_may_change(tmp_path: Path) -> None:
    rendered = render_shipped_config(Render(root=tmp_path))
    fabric_manager = next(i for i in rendered["pipeline"]["inputs"] if i["tag"] == FABRIC_MANAGER_TAG)
    assert fabric_manager["path"] == str(tmp_path / "fabricmanager" / "fabricmanager.log")
    assert fabric_manager["db"].startswith(str(tmp_path))
    outputs = {o["match"]: o["topics"] for o in rendered["pipeline"]["outputs"]}
    assert outputs == {"kernel*": "gpu.logs.kernel", "kube.*": "gpu.logs.pods"}  # its lines go with the kernel's
    fabric_manager["parser"] = "json"
    assert shipped_config_drift(rendered) == [
        f"input[{FABRIC_MANAGER_TAG}].parser: shipped 'xidflow-kernel-line', rendered 'json'"]


def test_the_kernel_file_parsers_are_shipped_and_yield_msg() -> None:
    parsers = {p["name"]: p for p in load_shipped()["parsers"]}
    for name in KERNEL_FILE_PARSERS.values():
        assert "(?<msg>" in parsers[name]["regex"]
    # The kmsg record parser yields what Fluent Bit's kmsg input does: sec/usec since boot and the sequence.
    regex = parsers["xidflow-kmsg-record"]["regex"].replace("(?<", "(?P<")
    m = re.match(regex, "4,1187,538441007373,-;NVRM: Xid (PCI:0000:4e:00): 79, GPU has fallen off the bus.")
    assert m and m.group("sec") == "538441" and m.group("usec") == "007373" and m.group("sequence") == "1187"
    assert m.group("msg").startswith("NVRM: Xid")


def test_the_kubernetes_tag_prefix_follows_the_container_log_path(tmp_path: Path) -> None:
    """The shipped prefix is what the shipped glob's tag expansion gives; a moved glob moves it along, or the
    kubernetes filter would find no pod name in the tag and add no metadata."""
    shipped = load_shipped()
    tail = next(i for i in shipped["pipeline"]["inputs"] if i["tag"] == "kube.*")
    kube = next(f for f in shipped["pipeline"]["filters"] if f["name"] == "kubernetes")
    assert kube_tag_prefix(str(Path(tail["path"]).parent)) == kube["kube_tag_prefix"]
    rendered = render_shipped_config(Render(root=tmp_path))
    kube = next(f for f in rendered["pipeline"]["filters"] if f["name"] == "kubernetes")
    assert kube["kube_tag_prefix"] == kube_tag_prefix(str(tmp_path / "containers"))


# (folder, the prefix the real Fluent Bit's tail input gives its files); tests/integration/test_fluent_bit_tags.py
# asks the real binary for each of them (rooted in a temporary folder).
KNOWN_PREFIXES = [
    ("/var/log/containers", "kube.var.log.containers."),
    # A dot-leading folder loses its dot (the demo's default state directory is under ~/.cache).
    ("/root/.cache/xidflow/local/demo/fluent-bit/gpu-0/containers",
     "kube.root.cache.xidflow.local.demo.fluent-bit.gpu-0.containers."),
    ("/tmp/x/.hid/containers", "kube.tmp.x.hid.containers."),
    ("/tmp/a b/c:d/e..f", "kube.tmp.a b.c.d.e.f."),
]


@pytest.mark.parametrize(("folder", "prefix"), KNOWN_PREFIXES)
def test_the_kubernetes_tag_prefix_is_fluent_bits_tag_expansion(folder: str, prefix: str) -> None:
    """Known answers of the real Fluent Bit (tests/integration/test_fluent_bit_tags.py asks it for each)."""
    assert kube_tag_prefix(folder) == prefix

