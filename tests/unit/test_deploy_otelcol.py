"""deploy/otel-collector/otel-collector.yaml and the collector build in pipeline/localinfra/otelbuild/ agree:
the configuration uses only components the manifest builds, its prefilter is Fluent Bit's keep-list, the
manifest's pins are the ones go.mod resolves, and the build files ship in the package.
(tests/integration/test_otel_collector.py runs the built collector on this configuration.)
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

from pipeline.localinfra import otelcol

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "otel-collector" / "otel-collector.yaml"
FLUENT_BIT = ROOT / "deploy" / "fluent-bit" / "fluent-bit.yaml"

# Component type (as in a configuration) -> the manifest module that provides it.
PROVIDED_BY = {
    "file_log": "github.com/open-telemetry/opentelemetry-collector-contrib/receiver/filelogreceiver",
    "resource": "github.com/open-telemetry/opentelemetry-collector-contrib/processor/resourceprocessor",
    "batch": "go.opentelemetry.io/collector/processor/batchprocessor",
    "kafka": "github.com/open-telemetry/opentelemetry-collector-contrib/exporter/kafkaexporter",
    "file_storage": "github.com/open-telemetry/opentelemetry-collector-contrib/extension/storage/filestorage",
}


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CONFIG.read_text())


def test_every_component_the_configuration_uses_is_built(config: dict) -> None:
    modules = otelcol.manifest_modules()
    used = {name.split("/")[0] for kind in ("receivers", "processors", "exporters", "extensions")
            for name in config[kind]}
    assert used == set(otelcol.REQUIRED_COMPONENTS)
    for component in used:
        assert PROVIDED_BY[component] in modules, f"{component} is not in {otelcol.MANIFEST}"


def test_the_prefilter_is_fluent_bits_keep_list(config: dict) -> None:
    fluent_bit = yaml.safe_load(FLUENT_BIT.read_text())
    grep = next(f for f in fluent_bit["pipeline"]["filters"] if f["name"] == "grep" and f["match"] == "kernel*")
    keep = grep["regex"].partition(" ")[2]
    (operator,) = config["receivers"]["file_log/kernel"]["operators"]
    assert operator["type"] == "filter"
    m = re.fullmatch(r'body not matches "(.*)"', operator["expr"])
    assert m and m.group(1) == keep


def test_the_exporter_sends_what_the_worker_reads(config: dict) -> None:
    kafka = config["exporters"]["kafka/kernel"]
    assert kafka["logs"]["encoding"] == "otlp_json"  # carries the node (resource attribute) and the time
    assert kafka["partition_logs_by_resource_attributes"] is True  # one key per node: per-node order
    attrs = config["processors"]["resource/node"]["attributes"]
    assert {"key": "k8s.node.name", "value": "${env:NODE_NAME}", "action": "upsert"} in attrs
    assert kafka["producer"]["required_acks"] == -1


def test_the_manifest_pins_what_go_mod_resolves() -> None:
    otelcol.check_pins()
    versions = {v for v in otelcol.manifest_modules().values()}
    assert versions <= {"v0.155.0", "v1.61.0"}, versions  # one release: contrib/core v0.155.0, stable v1.61.0
    assert otelcol.otelcol_version() == "v0.155.0"


def test_the_build_files_ship_in_the_package() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["pipeline"]
    for path in (otelcol.MANIFEST, otelcol.OTEL_GOMOD, otelcol.OTEL_GOSUM):
        assert str(path.relative_to(ROOT / "pipeline")) in data


def test_a_batch_holds_no_more_lines_than_the_worker_parses_of_one_record(config: dict) -> None:
    """One Kafka record per batch: past XIDFLOW_PARSE_MAX_LINES_PER_RECORD a record's lines are dead letters."""
    from pipeline.ingest.bounds import DEFAULT_MAX_LINES_PER_RECORD

    batch = config["processors"]["batch"]
    assert batch["send_batch_max_size"] <= DEFAULT_MAX_LINES_PER_RECORD
    assert batch["send_batch_size"] <= batch["send_batch_max_size"]
