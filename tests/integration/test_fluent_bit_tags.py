"""The tags the real Fluent Bit gives tailed files, against ``kube_tag_prefix``, which imitates them.

The kubernetes filter adds pod metadata only to records whose tag starts with its ``kube_tag_prefix``;
a prefix that differs from the real tag by one character makes it add nothing, silently (issue 34: the
demo's default state directory under ``~/.cache`` lost its dot in the tag, and no pod line had metadata).
So each folder shape the tests, the demo or a user may use is asked of the real binary: the tail input
with the shipped ``kube.*`` tag, and a Lua filter that copies each record's tag into the record.
"""

from __future__ import annotations

import secrets
import subprocess
import time
from pathlib import Path

import orjson
import pytest
import yaml

from pipeline.localinfra.fluentbit import ensure_fluent_bit
from pipeline.localinfra.fluentbit_run import kube_tag_prefix, load_shipped
from tests.unit.test_fluentbit_render import KNOWN_PREFIXES

pytestmark = pytest.mark.integration

TAG_INTO_RECORD = """
function tag_into_record(tag, timestamp, record)
  record["tag"] = tag
  return 2, timestamp, record
end
"""


def real_tags(folders: list[Path], workdir: Path, timeout: float = 60.0) -> dict[Path, str]:
    """Run the real Fluent Bit once over a kubelet-named file in each folder; the tag each file got."""
    shipped = load_shipped()["pipeline"]
    # The container-log input: the tail input whose records the kubernetes filter matches.
    kube_match = next(f["match"] for f in shipped["filters"] if f["name"] == "kubernetes")
    shipped_tag = next(i["tag"] for i in shipped["inputs"] if i["name"] == "tail" and i["tag"] == kube_match)
    names: dict[str, Path] = {}
    inputs = []
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        name = f"p-{len(names)}_ns_main-{secrets.token_hex(32)}.log"
        (folder / name).write_text("2026-11-28T10:00:00.000000000Z stdout F hello\n")
        names[name] = folder
        inputs.append({"name": "tail", "tag": shipped_tag, "path": str(folder / "*.log"),
                       "read_from_head": "true", "db": str(workdir / f"tail-{len(inputs)}.db")})
    config = {
        "service": {"flush": 0.2, "log_level": "warn"},
        "pipeline": {
            "inputs": inputs,
            "filters": [{"name": "lua", "match": "*", "call": "tag_into_record", "code": TAG_INTO_RECORD}],
            "outputs": [{"name": "stdout", "match": "*", "format": "json_lines"}],
        },
    }
    path = workdir / "tags.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    binary = ensure_fluent_bit(lambda m: print(f"[fluent-bit] {m}", flush=True))
    out_file = workdir / "out.log"
    with out_file.open("wb") as out:
        proc = subprocess.Popen([str(binary), "-c", str(path)], stdout=out, stderr=subprocess.STDOUT)
    tags: dict[Path, str] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(tags) < len(folders) and time.monotonic() < deadline:
            assert proc.poll() is None, f"Fluent Bit exited:\n{out_file.read_text()[-3000:]}"
            for line in out_file.read_text(errors="replace").splitlines():
                if line.startswith("{"):
                    tag = orjson.loads(line)["tag"]
                    name = next((n for n in names if tag.endswith(n)), None)
                    assert name is not None, f"a tag that ends in none of the files' names: {tag}"
                    tags[names[name]] = tag
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    missing = [str(f) for f in folders if f not in tags]
    assert not missing, f"no record from {missing}:\n{out_file.read_text()[-3000:]}"
    return tags


def test_kube_tag_prefix_is_the_real_tail_inputs_tag_for_every_folder_shape(tmp_path: Path) -> None:
    long_part = "l" * 200
    folders = [
        tmp_path / "plain" / "containers",
        tmp_path / ".cache" / "xidflow" / "local" / "demo" / "fluent-bit" / "gpu-0" / "containers",  # the demo's
        tmp_path / "x" / ".hid" / "..two" / "containers",
        tmp_path / "with space" / "and  two" / "containers",
        tmp_path / "colon:in" / "e..f" / "star*" / "containers",
        tmp_path / long_part / long_part / long_part / long_part / "containers",
        # The unit test's known answers, rooted here: what they claim of Fluent Bit is asked of it too.
        *(tmp_path / "known" / folder.strip("/") for folder, _ in KNOWN_PREFIXES),
    ]
    tags = real_tags(folders, tmp_path)
    for folder, tag in tags.items():
        prefix = kube_tag_prefix(str(folder))
        assert tag.startswith(prefix), f"{folder}: real tag {tag!r}, kube_tag_prefix {prefix!r}"
        # What follows the prefix is the file name the kubernetes filter parses (pod_namespace_container-id.log).
        assert "/" not in tag[len(prefix):] and tag[len(prefix):].endswith(".log"), tag
    for folder, prefix in KNOWN_PREFIXES:
        rooted = tmp_path / "known" / folder.strip("/")
        expected = kube_tag_prefix(str(tmp_path / "known")) + prefix.removeprefix("kube.")
        assert tags[rooted].startswith(expected), (folder, tags[rooted], expected)
