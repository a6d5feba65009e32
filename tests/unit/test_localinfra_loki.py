"""The local Loki: pinned and built from published modules with Loki's own replace directives, configured
loopback-only with filesystem storage, and announced by `xidflow local env`."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from pipeline.localinfra.launcher import Endpoints
from pipeline.localinfra.loki import LOKI_GOMOD, loki_config, loki_target, loki_version

# Loki v3.x's go.mod `replace` directives; Go honours them only in the main module, so ours repeats them.
LOKI_REPLACES = {
    "github.com/Azure/azure-sdk-for-go": "github.com/Azure/azure-sdk-for-go",
    "github.com/Azure/azure-storage-blob-go": "github.com/MasslessParticle/azure-storage-blob-go",
    "github.com/gocql/gocql": "github.com/grafana/gocql",
    "github.com/hashicorp/memberlist": "github.com/grafana/memberlist",
    "github.com/grafana/regexp": "github.com/grafana/regexp",
    "github.com/influxdata/go-syslog/v3": "github.com/leodido/go-syslog/v4",
    "github.com/thanos-io/objstore": "github.com/grafana/objstore",
}


def test_loki_is_pinned_to_a_3x_release_and_cached_by_version() -> None:
    version = loki_version()
    assert re.fullmatch(r"v3\.\d+\.\d+", version)
    assert loki_target().parent.name.startswith(version + "-")


def test_gomod_repeats_lokis_replace_directives() -> None:
    text = LOKI_GOMOD.read_text()
    replaces = dict(re.findall(r"^replace (\S+) => (\S+) \S+$", text, re.M))
    assert replaces == LOKI_REPLACES
    assert "exclude k8s.io/client-go v8.0.0+incompatible" in text
    assert "tool github.com/grafana/loki/v3/cmd/loki" in text
    directives = [line for line in text.splitlines() if not line.lstrip().startswith("//")]
    assert not [line for line in directives if "=> ./" in line]  # no local paths: published modules only


def test_config_is_loopback_only_filesystem_and_multi_tenant(tmp_path: Path) -> None:
    cfg = yaml.safe_load(loki_config(tmp_path, 3100, 9096))
    assert cfg["auth_enabled"] is True
    server = cfg["server"]
    assert server["http_listen_address"] == server["grpc_listen_address"] == "127.0.0.1"
    assert cfg["common"]["instance_addr"] == "127.0.0.1" and cfg["memberlist"]["bind_addr"] == ["127.0.0.1"]
    assert cfg["common"]["storage"]["filesystem"]["chunks_directory"].startswith(str(tmp_path))
    assert cfg["schema_config"]["configs"][0]["object_store"] == "filesystem"
    assert cfg["common"]["ring"]["kvstore"]["store"] == "inmemory"
    assert cfg["analytics"]["reporting_enabled"] is False


def test_env_lines_announce_loki_only_when_started() -> None:
    base = Endpoints("127.0.0.1:9092", "/k", "local", "local")
    assert "LOKI_URL" not in base.env_lines()
    with_loki = Endpoints(
        "127.0.0.1:9092", "/k", "local", "local", loki_url="http://127.0.0.1:3100", loki_org_id="xidflow"
    )
    assert "export LOKI_URL=http://127.0.0.1:3100\n" in with_loki.env_lines()
    assert "export LOKI_ORG_ID=xidflow\n" in with_loki.env_lines()
    # State files written before Loki existed still load.
    assert Endpoints(**{"kafka_bootstrap": "b", "kubeconfig": "k", "kafka_source": "s", "kube_source": "t"})
