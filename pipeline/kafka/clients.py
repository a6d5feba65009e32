"""The one place that builds Kafka clients: every producer, consumer and admin client of every component.

Components never call ``AIOKafkaProducer(...)``/``AIOKafkaConsumer(...)``/``AIOKafkaAdminClient(...)``
themselves: they ask this module, which adds the connection settings (bootstrap servers and, where
the cluster needs them, TLS and SASL credentials) read from the environment by ``KafkaSettings``.
Call-site keyword arguments (acks, group ids, poll sizes) are the component's own business and are
passed through unchanged. The Faust app gets the same credentials through ``faust_options``.

Security: PLAINTEXT, SSL (CA, optional client certificate for mTLS, hostname verification on unless
``KAFKA_SSL_CHECK_HOSTNAME=false``), SASL_PLAINTEXT and SASL_SSL with PLAIN, SCRAM-SHA-256,
SCRAM-SHA-512 or OAUTHBEARER (a token from a file or a command, fetched again before it expires).
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.abc import AbstractTokenProvider
from aiokafka.admin import AIOKafkaAdminClient
from pydantic import ValidationError

from pipeline.kafka import reachability
from pipeline.runtime.settings import KafkaSettings

# Every process that talks to Kafka imports this module first: from here on, a broker outage is a few lines
# (pipeline.kafka.reachability), in its clients and in Faust's.
reachability.install()


class KafkaConfigError(click.ClickException):
    """The Kafka settings cannot work; the message names the variable. The CLI prints it and exits 1."""


def load_settings() -> KafkaSettings:
    """``KafkaSettings()`` from the environment, with a refusal that names the variable at fault."""
    try:
        return KafkaSettings()
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p)
            msg = err.get("msg", "").removeprefix("Value error, ")
            lines.append(f"{where}: {msg}" if where else msg)
        raise KafkaConfigError("invalid Kafka settings (KAFKA_*): " + "; ".join(lines)) from exc


# -- OAUTHBEARER tokens ----------------------------------------------------------------------
@dataclass(frozen=True)
class Token:
    value: str
    expires_at: float | None  # epoch seconds; None when the token does not say


def parse_token(text: str, now: float) -> Token:
    """A token as a file or command gives it: JSON ``{"token"|"access_token", "expires_at"|"expiry_ms"|
    "expires_in"}`` (what AWS's MSK IAM signer and OIDC token endpoints return), or the bare token
    (a JWT's ``exp`` claim is its expiry)."""
    text = text.strip()
    if not text:
        raise ValueError("empty OAUTHBEARER token")
    if text.startswith("{"):
        doc = json.loads(text)
        value = doc.get("token") or doc.get("access_token")
        if not isinstance(value, str) or not value:
            raise ValueError("OAUTHBEARER token JSON has no 'token' or 'access_token'")
        if "expiry_ms" in doc:
            return Token(value, float(doc["expiry_ms"]) / 1000.0)
        if "expires_at" in doc:
            return Token(value, float(doc["expires_at"]))
        if "expires_in" in doc:
            return Token(value, now + float(doc["expires_in"]))
        return Token(value, jwt_expiry(value))
    return Token(text, jwt_expiry(text))


def jwt_expiry(token: str) -> float | None:
    """The ``exp`` claim of a JWT, or None for anything else (no signature check: the broker does that)."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        payload = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (ValueError, TypeError):
        return None
    exp = payload.get("exp") if isinstance(payload, dict) else None
    return float(exp) if isinstance(exp, int | float) else None


class RefreshingTokenProvider(AbstractTokenProvider):
    """aiokafka asks for a token on every new connection; this hands out the cached one until it is
    ``refresh_margin_s`` from expiry (or ``default_lifetime_s`` old when it carries no expiry), then
    fetches a new one. Concurrent connects share one fetch."""

    def __init__(self, fetch: Callable[[], Any], refresh_margin_s: float, default_lifetime_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._fetch = fetch  # async () -> str
        self._margin, self._lifetime, self._clock = refresh_margin_s, default_lifetime_s, clock
        self._token: Token | None = None
        self._lock: asyncio.Lock | None = None
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        self.fetches = 0

    def _fresh(self, now: float) -> bool:
        return self._token is not None and now < (self._token.expires_at or 0.0) - self._margin

    async def token(self) -> str:
        loop = asyncio.get_running_loop()
        if self._lock is None or self._lock_loop is not loop:  # one lock per event loop
            self._lock, self._lock_loop = asyncio.Lock(), loop
        async with self._lock:
            now = self._clock()
            if not self._fresh(now):
                tok = parse_token(await self._fetch(), now)
                self.fetches += 1
                if tok.expires_at is None:
                    tok = Token(tok.value, now + self._lifetime)
                self._token = tok
            assert self._token is not None
            return self._token.value


def _token_fetcher(settings: KafkaSettings) -> Callable[[], Any]:
    if settings.sasl_oauth_token_file is not None:
        path = settings.sasl_oauth_token_file

        async def from_file() -> str:
            return path.read_text()

        return from_file
    command = settings.sasl_oauth_token_command
    assert command is not None

    async def from_command() -> str:
        proc = await asyncio.create_subprocess_shell(
            command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"KAFKA_SASL_OAUTH_TOKEN_COMMAND exited {proc.returncode}: {err.decode()[-500:]}")
        return out.decode()

    return from_command


# -- TLS -------------------------------------------------------------------------------------
def ssl_context(settings: KafkaSettings) -> ssl.SSLContext:
    """Verifies the broker (the CA file, else the system CAs; hostname checked unless turned off);
    presents a client certificate when one is configured (mTLS)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                     cafile=str(settings.ssl_cafile) if settings.ssl_cafile else None)
    ctx.check_hostname = settings.ssl_check_hostname
    if settings.ssl_certfile is not None:
        ctx.load_cert_chain(str(settings.ssl_certfile), str(settings.ssl_keyfile) if settings.ssl_keyfile else None)
    return ctx


def _password(settings: KafkaSettings) -> str | None:
    if settings.sasl_password_file is not None:
        return settings.sasl_password_file.read_text().rstrip("\r\n")
    return settings.sasl_password.get_secret_value() if settings.sasl_password is not None else None


_providers: dict[tuple, RefreshingTokenProvider] = {}


def _provider(settings: KafkaSettings) -> RefreshingTokenProvider:
    """One token provider per token source, so every client of a process shares its token."""
    key = (settings.sasl_oauth_token_file, settings.sasl_oauth_token_command,
           settings.sasl_oauth_refresh_margin_s, settings.sasl_oauth_default_lifetime_s)
    if key not in _providers:
        _providers[key] = RefreshingTokenProvider(
            _token_fetcher(settings), settings.sasl_oauth_refresh_margin_s, settings.sasl_oauth_default_lifetime_s)
    return _providers[key]


def _settings(settings: KafkaSettings | None) -> KafkaSettings:
    return settings if settings is not None else load_settings()


def security_options(settings: KafkaSettings | None = None) -> dict[str, Any]:
    """The aiokafka keyword arguments for TLS and SASL (empty for PLAINTEXT)."""
    s = _settings(settings)
    opts: dict[str, Any] = {}
    if s.security_protocol == "PLAINTEXT":
        return opts
    opts["security_protocol"] = s.security_protocol
    if s.uses_ssl:
        opts["ssl_context"] = ssl_context(s)
    if s.uses_sasl:
        assert s.sasl_mechanism is not None
        opts["sasl_mechanism"] = s.sasl_mechanism
        if s.sasl_mechanism == "OAUTHBEARER":
            opts["sasl_oauth_token_provider"] = _provider(s)
        else:
            opts["sasl_plain_username"] = s.sasl_username
            opts["sasl_plain_password"] = _password(s)
    return opts


def connection_options(bootstrap: str | None = None, settings: KafkaSettings | None = None) -> dict[str, Any]:
    """Keyword arguments every aiokafka client needs to reach and authenticate to the cluster.

    ``bootstrap`` overrides the configured servers (tests and the local launcher pass their own).
    """
    s = _settings(settings)
    return {"bootstrap_servers": bootstrap or s.bootstrap_servers, **security_options(s)}


def producer(bootstrap: str | None = None, settings: KafkaSettings | None = None, **kwargs: Any) -> AIOKafkaProducer:
    return AIOKafkaProducer(**connection_options(bootstrap, settings), **kwargs)


def consumer(*topics: str, bootstrap: str | None = None, settings: KafkaSettings | None = None,
             **kwargs: Any) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(*topics, **connection_options(bootstrap, settings), **kwargs)


def admin(bootstrap: str | None = None, settings: KafkaSettings | None = None, **kwargs: Any) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(**connection_options(bootstrap, settings), **kwargs)


def faust_options(settings: KafkaSettings | None = None) -> dict[str, Any]:
    """``faust.App`` keyword arguments carrying the same credentials (``broker_credentials``/``ssl_context``)."""
    import faust

    s = _settings(settings)
    if s.security_protocol == "PLAINTEXT":
        return {}
    ctx = ssl_context(s) if s.uses_ssl else None
    if not s.uses_sasl:
        return {"broker_credentials": faust.SSLCredentials(ctx)}
    if s.sasl_mechanism == "OAUTHBEARER":
        return {"broker_credentials": faust.OAuthCredentials(oauth_cb=_provider(s), ssl_context=ctx)}
    return {"broker_credentials": faust.SASLCredentials(
        username=s.sasl_username, password=_password(s), ssl_context=ctx, mechanism=s.sasl_mechanism)}
