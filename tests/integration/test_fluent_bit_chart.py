"""The Fluent Bit configuration the Helm chart renders is accepted by the real Fluent Bit (``--dry-run``) and is
the shipped ``deploy/fluent-bit/fluent-bit.yaml`` with only the brokers, topic names and Kafka security
properties filled in, for the default values and every ``ci/*-values.yaml`` (chart-testing's sets).

Rendered by the pinned helm (``pipeline.localinfra.helm``), run by the Fluent Bit the other shipper tests
run (``pipeline.localinfra.fluentbit``).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipeline.localinfra.fluentbit import ensure_fluent_bit
from pipeline.localinfra.fluentbit_run import load_shipped
from pipeline.localinfra.helm import helm_template

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "xidflow"
VALUE_SETS = {"default": None, **{p.name: p for p in sorted((CHART / "ci").glob("*values.yaml"))}}
# What the chart adds to each kafka output for kafka.security (deploy/fluent-bit/fluent-bit.yaml's header).
SECURITY_PREFIXES = ("rdkafka.security.", "rdkafka.sasl.", "rdkafka.ssl.")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Helm's coalescing of a values file onto the defaults: maps merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def chart_values(values_file: Path | None) -> dict[str, Any]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    return _merge(values, yaml.safe_load(values_file.read_text()) or {}) if values_file else values


def chart_fluent_bit_config(values_file: Path | None) -> str:
    text = helm_template(CHART, release="rel", namespace="xf-system",
                         values_files=(values_file,) if values_file else (), log=lambda _m: None)
    maps = [d for d in yaml.safe_load_all(text)
            if d and d["kind"] == "ConfigMap" and d["metadata"]["name"] == "rel-xidflow-fluent-bit"]
    assert len(maps) == 1, "the chart renders one Fluent Bit ConfigMap"
    return maps[0]["data"]["fluent-bit.yaml"]


def dry_run(config_text: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "fluent-bit.yaml"
    config.write_text(config_text)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "NODE_NAME"))}
    return subprocess.run([str(ensure_fluent_bit()), "-c", str(config), "--dry-run"], capture_output=True,
                          text=True, timeout=60, env={**base, "NODE_NAME": "gpu-node-1", **env})


@pytest.mark.parametrize("values_name", list(VALUE_SETS))
def test_the_charts_fluent_bit_config_passes_dry_run(values_name: str, tmp_path: Path) -> None:
    text = chart_fluent_bit_config(VALUE_SETS[values_name])
    # The DaemonSet sets NODE_NAME (downward API) and, with SASL, KAFKA_SASL_PASSWORD (secretKeyRef).
    proc = dry_run(text, tmp_path, KAFKA_SASL_PASSWORD="from-the-secret")
    assert proc.returncode == 0 and "configuration test is successful" in proc.stdout + proc.stderr, proc.stderr


def test_dry_run_refuses_what_fluent_bit_cannot_run(tmp_path: Path) -> None:
    """The check above can fail: a property no plugin knows and a regex Onigmo cannot compile are refused."""
    config = yaml.safe_load(chart_fluent_bit_config(None))
    bad_output = copy.deepcopy(config)
    bad_output["pipeline"]["outputs"][0]["message_key_fild"] = "node"
    proc = dry_run(yaml.safe_dump(bad_output), tmp_path)
    assert proc.returncode != 0 and "message_key_fild" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    bad_parser = copy.deepcopy(config)
    bad_parser["parsers"][0]["regex"] = "^(?<msg>.+$"
    proc = dry_run(yaml.safe_dump(bad_parser), tmp_path)
    assert proc.returncode != 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("values_name", list(VALUE_SETS))
def test_the_charts_fluent_bit_config_is_the_shipped_file(values_name: str) -> None:
    """Inputs, parsers, filters and outputs are the shipped file's; only the brokers, the topic names and, on a
    secured Kafka, the security properties come from the values."""
    values = chart_values(VALUE_SETS[values_name])
    kafka = values["kafka"]
    chart = yaml.safe_load(chart_fluent_bit_config(VALUE_SETS[values_name]))
    topics = {"kernel*": kafka["topics"]["logsKernel"], "kube.*": kafka["topics"]["logsPods"]}
    secured = kafka["security"]["protocol"] != "PLAINTEXT"
    for out in chart["pipeline"]["outputs"]:
        assert out.pop("brokers") == kafka["bootstrapServers"]
        assert out.pop("topics") == kafka["topicPrefix"] + topics[out["match"]]
        added = {k: out.pop(k) for k in list(out) if k.startswith(SECURITY_PREFIXES)}
        if secured:
            assert added["rdkafka.security.protocol"] == kafka["security"]["protocol"].lower()
            assert added["rdkafka.sasl.username"] == kafka["security"]["sasl"]["users"]["fluentBit"]["username"]
            assert added["rdkafka.sasl.password"] == "${KAFKA_SASL_PASSWORD}"
        else:
            assert added == {}
    shipped = load_shipped()
    for out in shipped["pipeline"]["outputs"]:
        del out["brokers"], out["topics"]
    assert json.dumps(chart, sort_keys=True, indent=1) == json.dumps(shipped, sort_keys=True, indent=1)
