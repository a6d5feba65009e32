"""Start-up of ``xidflow actuator`` with a bad API or hook-Job configuration: one clear sentence, a
non-zero exit, before anything connects, and never a token in the output."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.actuator.api import ApiSettings, TokenFileError, TokenStore, read_token_file
from pipeline.actuator.effects import REBOOT_IMAGE
from pipeline.cli import cli

SECRET = "s3cr3t-token-value-4711"


def run(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    result = CliRunner().invoke(cli, args, env=env)
    return result.exit_code, result.output + (str(result.exception) if result.exception else "")


@pytest.mark.parametrize(
    "tokens",
    [
        f'["{SECRET}"]',  # valid JSON, wrong shape
        f'{{"ops": ["{SECRET}"]}}',
        f'{{"ops": "{SECRET}"',  # not JSON
        f"ops:{SECRET}",
    ],
)
def test_malformed_api_tokens_are_refused_without_echoing_them(tokens: str) -> None:
    code, out = run(["actuator", "--kubeconfig", "/nonexistent"], {"XIDFLOW_API_TOKENS": tokens})
    assert code != 0
    assert "tokens" in out.lower() and "invalid setting" in out
    assert SECRET not in out
    assert "Traceback" not in out


def test_api_settings_errors_hide_the_input() -> None:
    with pytest.raises(ValueError) as err:
        ApiSettings(tokens=[SECRET])  # type: ignore[arg-type]
    assert SECRET not in str(err.value)


def test_a_token_file_that_is_not_utf8_is_refused_at_start(tmp_path: Path) -> None:
    token_file = tmp_path / "tokens"
    token_file.write_bytes(f"ops:{SECRET}\nother:\xff\xfe{SECRET}\n".encode("latin-1"))
    with pytest.raises(TokenFileError, match="line 2"):
        read_token_file(token_file)
    code, out = run(["actuator"], {"XIDFLOW_API_TOKEN_FILE": str(token_file)})
    assert code != 0
    assert f"API token file {token_file} is not valid UTF-8 text (line 2)" in out
    assert SECRET not in out


def test_a_token_file_that_cannot_be_read_is_refused_at_start(tmp_path: Path) -> None:
    code, out = run(["actuator"], {"XIDFLOW_API_TOKEN_FILE": str(tmp_path)})  # a directory
    assert code != 0
    assert "XIDFLOW_API_TOKEN_FILE" in out and f"{tmp_path}: not a file" in out
    unreadable = tmp_path / "tokens"
    unreadable.write_text("ops:t0ken\n")
    unreadable.chmod(0)
    code, out = run(["actuator"], {"XIDFLOW_API_TOKEN_FILE": str(unreadable)})
    if os.geteuid() != 0:  # root reads a file whatever its mode
        assert code != 0 and f"API token file {unreadable} cannot be read" in out
    code, out = run(["actuator"], {"XIDFLOW_API_TOKEN_FILE": str(tmp_path / "no-such-dir" / "tokens")})
    assert code != 0 and "XIDFLOW_API_TOKEN_FILE" in out


def test_api_forced_on_without_tokens_is_refused() -> None:
    code, out = run(["actuator", "--api"], {})
    assert code != 0
    assert "the decision API has no tokens" in out


def test_a_missing_token_file_serves_401_to_everyone(tmp_path: Path) -> None:
    store = TokenStore({}, tmp_path / "not-yet")
    assert store.has_sources() and store.load() == 0
    assert store.identify(f"Bearer {SECRET}") is None
    (tmp_path / "not-yet").write_text(f"ops:{SECRET}\n")
    assert store.identify(f"Bearer {SECRET}") == "ops"  # a Secret mounted later is picked up


def test_deleting_the_token_file_revokes_its_tokens(tmp_path: Path) -> None:
    """Issue 37: the setting promises 401 while the file is missing; a deleted file used to keep its tokens."""
    token_file = tmp_path / "tokens"
    token_file.write_text("ops:s3cret\n")
    store = TokenStore({"static": "always"}, token_file)
    assert store.load() == 2 and store.identify("Bearer s3cret") == "ops"
    token_file.unlink()
    assert store.identify("Bearer s3cret") is None  # 401
    assert store.identify("Bearer always") == "static"  # XIDFLOW_API_TOKENS is not the file's
    token_file.write_text("ops:n3w\n")  # the Secret created again
    assert store.identify("Bearer n3w") == "ops" and store.identify("Bearer s3cret") is None


def test_a_token_header_that_is_not_utf8_is_refused_not_an_error() -> None:
    store = TokenStore({"ops": SECRET})
    assert store.identify("Bearer \udcff\udcfe") is None


def test_an_unsafe_operator_job_template_is_refused_at_start(tmp_path: Path) -> None:
    template = tmp_path / "reboot.yaml"
    template.write_text(
        "apiVersion: batch/v1\nkind: Job\nspec:\n  backoffLimit: 0\n  template:\n    spec:\n      containers:\n"
        f"      - {{name: r, image: '{REBOOT_IMAGE}', command: [reboot]}}\n"
        "      volumes: [{name: t, secret: {secretName: xidflow-api-tokens}}]\n"
    )
    code, out = run(["actuator"], {"XIDFLOW_ACTUATOR_REBOOT_JOB_TEMPLATE": str(template)})
    assert code != 0
    assert f"reboot Job template {template}: spec.template.spec.volumes: not allowed" in out
    code, out = run(["actuator"], {"XIDFLOW_ACTUATOR_RESET_JOB_TEMPLATE": str(tmp_path / "missing.yaml")})
    assert code != 0 and "XIDFLOW_ACTUATOR_RESET_JOB_TEMPLATE" in out and "no such file" in out
