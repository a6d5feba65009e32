"""Errors a person meets end in one sentence and a non-zero exit, never a traceback.

The cases that need nothing running: no kubeconfig, an API server / Kafka / Loki with nothing
listening. Unknown nodes (a real API server) are in tests/integration/test_cli_sentences.py.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.cli import cli


def free_port() -> int:
    """A loopback port with nothing listening (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def listener() -> Iterator[int]:
    """A TCP port that accepts connections (stands for a Loki that is up when Kafka is the one down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def down_kubeconfig(tmp_path: Path) -> str:
    path = tmp_path / "kubeconfig"
    server = f"https://127.0.0.1:{free_port()}"
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: c, cluster: {{server: '{server}', insecure-skip-tls-verify: true}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: ctx, context: {cluster: c, user: u}}]\ncurrent-context: ctx\n"
    )
    return str(path)


def run(args: list[str], env: dict[str, str | None]) -> tuple[int, str]:
    result = CliRunner().invoke(cli, args, env={"XIDFLOW_METRICS_PORT": "0", **env})
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def no_kube_env(tmp_path: Path) -> dict[str, str | None]:
    return {"KUBECONFIG": None, "HOME": str(tmp_path), "KUBERNETES_SERVICE_HOST": None}


KUBE_COMMANDS = [
    ["status"],
    ["status", "-o", "json"],
    ["reset", "--node", "gpu-1"],
    ["reset", "--all"],
    ["breaker", "status"],
    ["breaker", "reset"],
    ["actuator"],
]


@pytest.mark.parametrize("args", KUBE_COMMANDS, ids=" ".join)
def test_no_kubeconfig(tmp_path: Path, args: list[str]) -> None:
    code, out = run(args, no_kube_env(tmp_path))
    assert code == 1
    assert "no kubeconfig" in out and "--kubeconfig" in out


@pytest.mark.parametrize("args", KUBE_COMMANDS, ids=" ".join)
def test_api_server_down(tmp_path: Path, args: list[str]) -> None:
    code, out = run([*args, "--kubeconfig", down_kubeconfig(tmp_path)], {})
    assert code == 1
    assert "cannot reach the Kubernetes API server" in out


@pytest.mark.parametrize("args", [["status"], ["breaker", "status"], ["reset", "--all"]], ids=" ".join)
def test_unknown_context(tmp_path: Path, args: list[str]) -> None:
    code, out = run([*args, "--kubeconfig", down_kubeconfig(tmp_path), "--context", "prod"], {})
    assert code == 1
    assert "context 'prod' is not in the kubeconfig" in out and "ctx" in out


def test_kubeconfig_that_does_not_exist(tmp_path: Path) -> None:
    code, out = run(["status", "--kubeconfig", str(tmp_path / "nope")], {})
    assert code == 1 and "does not exist" in out


def test_loki_down() -> None:
    code, out = run(["loki-tail", "--loki-url", f"http://127.0.0.1:{free_port()}", "--query", '{job="kmsg"}'], {})
    assert code == 1 and "cannot reach Loki at" in out


def test_loki_tail_with_kafka_down(listener: int) -> None:
    code, out = run(
        ["loki-tail", "--loki-url", f"http://127.0.0.1:{listener}", "--query", '{job="kmsg"}',
         "--bootstrap", f"127.0.0.1:{free_port()}"],
        {},
    )
    assert code == 1 and "cannot reach Kafka at" in out


def test_worker_with_kafka_down() -> None:
    code, out = run(["worker", "--bootstrap", f"127.0.0.1:{free_port()}"], {})
    assert code == 1 and "cannot reach Kafka at" in out


def test_classify_a_directory(tmp_path: Path) -> None:
    code, out = run(["classify", str(tmp_path)], {})
    assert code == 1 and f"cannot read {tmp_path}" in out


def test_local_env_when_nothing_is_up(tmp_path: Path) -> None:
    code, out = run(["local", "env", "--state-dir", str(tmp_path)], {})
    assert code == 1 and "not up" in out


def test_context_selects_the_cluster(tmp_path: Path) -> None:
    current, other = free_port(), free_port()
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters:\n- {{name: a, cluster: {{server: 'https://127.0.0.1:{current}', insecure-skip-tls-verify: 1}}}}\n"
        f"- {{name: b, cluster: {{server: 'https://127.0.0.1:{other}', insecure-skip-tls-verify: 1}}}}\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: ctx-a, context: {cluster: a, user: u}}, {name: ctx-b, context: {cluster: b, user: u}}]\n"
        "current-context: ctx-a\n"
    )
    code, out = run(["status", "--kubeconfig", str(path)], {})
    assert code == 1 and f"127.0.0.1:{current}" in out
    code, out = run(["status", "--kubeconfig", str(path), "--context", "ctx-b"], {})
    assert code == 1 and f"127.0.0.1:{other}" in out and f"127.0.0.1:{current}" not in out


def test_a_kubeconfig_list_is_accepted_as_kubectl_does(tmp_path: Path) -> None:
    listed = f"{tmp_path / 'missing'}:{down_kubeconfig(tmp_path)}"
    code, out = run(["status"], {"KUBECONFIG": listed})
    assert code == 1 and "cannot reach the Kubernetes API server" in out
