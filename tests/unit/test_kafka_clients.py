"""The Kafka client factory: settings combinations, the options it hands aiokafka and Faust, OAUTHBEARER tokens."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from pathlib import Path

import pytest

from pipeline.kafka import clients as kafka_clients
from pipeline.kafka.clients import KafkaConfigError, RefreshingTokenProvider, parse_token
from pipeline.runtime.settings import KafkaSettings

KAFKA_VARS = ["KAFKA_SECURITY_PROTOCOL", "KAFKA_SASL_MECHANISM", "KAFKA_SASL_USERNAME", "KAFKA_SASL_PASSWORD",
              "KAFKA_SASL_PASSWORD_FILE", "KAFKA_SASL_OAUTH_TOKEN_FILE", "KAFKA_SASL_OAUTH_TOKEN_COMMAND",
              "KAFKA_SSL_CAFILE", "KAFKA_SSL_CERTFILE", "KAFKA_SSL_KEYFILE", "KAFKA_SSL_CHECK_HOSTNAME"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in KAFKA_VARS:
        monkeypatch.delenv(var, raising=False)


def refusal(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> str:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(KafkaConfigError) as info:
        kafka_clients.connection_options()
    return info.value.message


def test_plaintext_by_default_adds_nothing() -> None:
    assert kafka_clients.connection_options("h:1") == {"bootstrap_servers": "h:1"}


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL"}, "KAFKA_SASL_MECHANISM"),
        ({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
          "KAFKA_SASL_PASSWORD": "p"}, "KAFKA_SASL_USERNAME"),
        ({"KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "KAFKA_SASL_MECHANISM": "PLAIN",
          "KAFKA_SASL_USERNAME": "u"}, "KAFKA_SASL_PASSWORD"),
        ({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "OAUTHBEARER"},
         "KAFKA_SASL_OAUTH_TOKEN_FILE"),
        ({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "OAUTHBEARER",
          "KAFKA_SASL_OAUTH_TOKEN_COMMAND": "echo t", "KAFKA_SASL_USERNAME": "u"}, "KAFKA_SASL_USERNAME"),
        ({"KAFKA_SASL_USERNAME": "u"}, "KAFKA_SASL_USERNAME"),  # SASL setting on a PLAINTEXT protocol
        ({"KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "KAFKA_SASL_MECHANISM": "SCRAM-SHA-256",
          "KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": "p", "KAFKA_SSL_CAFILE": "/etc/hosts"},
         "KAFKA_SSL_CAFILE"),
        ({"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CERTFILE": "/etc/hosts"}, "KAFKA_SSL_KEYFILE"),
        ({"KAFKA_SECURITY_PROTOCOL": "SSL", "KAFKA_SSL_CAFILE": "/nonexistent/ca.crt"}, "KAFKA_SSL_CAFILE"),
        ({"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "GSSAPI"}, "KAFKA_SASL_MECHANISM"),
        ({"KAFKA_SECURITY_PROTOCOL": "TLS"}, "KAFKA_SECURITY_PROTOCOL"),
    ],
)
def test_incomplete_or_contradictory_settings_are_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    assert named in refusal(monkeypatch, env)


def test_two_password_sources_are_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("p\n")
    msg = refusal(monkeypatch, {"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "PLAIN",
                                "KAFKA_SASL_USERNAME": "u", "KAFKA_SASL_PASSWORD": "p",
                                "KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "pw")})
    assert "KAFKA_SASL_PASSWORD_FILE" in msg


def test_scram_over_tls_with_a_password_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret\n")
    for k, v in {"KAFKA_SECURITY_PROTOCOL": "sasl_ssl", "KAFKA_SASL_MECHANISM": "scram-sha-512",
                 "KAFKA_SASL_USERNAME": "xidflow-worker", "KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "pw")}.items():
        monkeypatch.setenv(k, v)
    opts = kafka_clients.connection_options("b:9093")
    assert opts["security_protocol"] == "SASL_SSL" and opts["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (opts["sasl_plain_username"], opts["sasl_plain_password"]) == ("xidflow-worker", "s3cret")
    ctx = opts["ssl_context"]
    assert ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED


def test_hostname_verification_can_be_turned_off_explicitly() -> None:
    s = KafkaSettings(security_protocol="SSL", ssl_check_hostname=False)
    assert not kafka_clients.connection_options(settings=s)["ssl_context"].check_hostname


def test_faust_gets_the_same_credentials() -> None:
    import faust

    s = KafkaSettings(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-256", sasl_username="u",
                      sasl_password="p")
    creds = kafka_clients.faust_options(s)["broker_credentials"]
    assert isinstance(creds, faust.SASLCredentials)
    assert (creds.username, creds.password, creds.mechanism.value, creds.protocol.value) == (
        "u", "p", "SCRAM-SHA-256", "SASL_SSL")
    assert kafka_clients.faust_options(KafkaSettings()) == {}
    tls = kafka_clients.faust_options(KafkaSettings(security_protocol="SSL"))["broker_credentials"]
    assert isinstance(tls, faust.SSLCredentials)
    oauth = KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_mechanism="OAUTHBEARER",
                          sasl_oauth_token_command="echo t")
    assert isinstance(kafka_clients.faust_options(oauth)["broker_credentials"], faust.OAuthCredentials)


def _jwt(exp: int) -> str:
    def b64(d: dict) -> str:
        return base64.urlsafe_b64encode(json.dumps(d).encode()).decode().rstrip("=")

    return f"{b64({'alg': 'none'})}.{b64({'exp': exp, 'sub': 'x'})}.sig"


def test_token_formats() -> None:
    assert parse_token(_jwt(1000) + "\n", now=0).expires_at == 1000
    assert parse_token('{"token": "t", "expiry_ms": 5000}', now=0).expires_at == 5.0
    assert parse_token('{"access_token": "t", "expires_in": 60}', now=100).expires_at == 160
    assert parse_token("opaque", now=0) == kafka_clients.Token("opaque", None)
    with pytest.raises(ValueError):
        parse_token("  ", now=0)


def test_token_is_reused_then_fetched_again_before_expiry() -> None:
    now = [1000.0]
    tokens = iter([_jwt(1100), _jwt(1300)])

    async def fetch() -> str:
        return next(tokens)

    provider = RefreshingTokenProvider(fetch, refresh_margin_s=30, default_lifetime_s=300, clock=lambda: now[0])

    async def scenario() -> list[str]:
        got = [await provider.token()]
        now[0] = 1060  # 40 s before expiry: still fresh
        got.append(await provider.token())
        now[0] = 1075  # within the 30 s margin: fetch the next one
        got.append(await provider.token())
        return got

    first, second, third = asyncio.run(scenario())
    assert first == second != third and provider.fetches == 2


def test_token_command_and_file_sources(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text('{"token": "from-file", "expires_in": 600}')
    by_file = kafka_clients.security_options(KafkaSettings(
        security_protocol="SASL_PLAINTEXT", sasl_mechanism="OAUTHBEARER", sasl_oauth_token_file=token_file))
    by_cmd = kafka_clients.security_options(KafkaSettings(
        security_protocol="SASL_PLAINTEXT", sasl_mechanism="OAUTHBEARER", sasl_oauth_token_command="echo from-cmd"))

    async def both() -> tuple[str, str]:
        return (await by_file["sasl_oauth_token_provider"].token(),
                await by_cmd["sasl_oauth_token_provider"].token())

    assert asyncio.run(both()) == ("from-file", "from-cmd")


def test_the_worker_command_refuses_bad_kafka_settings_naming_the_variable() -> None:
    from click.testing import CliRunner

    from pipeline.cli import cli

    result = CliRunner().invoke(cli, ["worker", "--bootstrap", "127.0.0.1:1"],
                                env={"KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KAFKA_SASL_MECHANISM": "PLAIN"})
    assert result.exit_code != 0
    assert "KAFKA_SASL_USERNAME" in result.output and "Traceback" not in result.output


def test_local_env_lines_carry_the_secured_brokers_credentials() -> None:
    from pipeline.localinfra.launcher import Endpoints

    plain = Endpoints("127.0.0.1:1", "/k", "local", "local")
    assert plain.env_lines() == "export KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:1\nexport KUBECONFIG=/k\n"
    secured = Endpoints("127.0.0.1:1", "/k", "local", "local", {"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1",
                                                                "KAFKA_SASL_PASSWORD_FILE": "/s/admin.password"})
    assert "export KAFKA_SASL_PASSWORD_FILE=/s/admin.password\n" in secured.env_lines()
    assert secured.env_lines().count("KAFKA_BOOTSTRAP_SERVERS") == 1
