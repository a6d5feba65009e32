"""Bearer-token authentication of the decision API.

Tokens come from ``XIDFLOW_API_TOKENS`` and/or a token file (a mounted Secret, re-read when it
changes). Only SHA-256 digests are kept in memory, compared in constant time. No token, and no line
of the token file, ever reaches a log line or an error message: problems name the file and the line
number only.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Mapping
from pathlib import Path

from pipeline.actuator.api.settings import ApiSettings

log = logging.getLogger("pipeline.actuator.api")


class TokenFileError(ValueError):
    """The token file exists but cannot be used; the message names the file, never its content."""


def parse_token_file(text: str) -> dict[str, str]:
    """Tokens by client name from ``name:token`` lines; a bare token is named after its line number."""
    tokens: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, token = line.partition(":")
        if not sep:
            name, token = f"token-file-line-{number}", line
        if token.strip():
            tokens[name.strip()] = token.strip()
    return tokens


def read_token_file(path: Path) -> dict[str, str] | None:
    """The file's tokens; None when it does not exist. :class:`TokenFileError` when it is unusable."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TokenFileError(f"API token file {path} cannot be read: {exc.strerror or type(exc).__name__}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TokenFileError(f"API token file {path} is not valid UTF-8 text (line {line})") from None
    return parse_token_file(text)


def _digest(token: str) -> bytes:
    # surrogatepass: a header that is not valid UTF-8 still gets a digest (that matches nothing), not a 500.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class TokenStore:
    """Bearer tokens from settings and a file; answers which client a presented token belongs to."""

    def __init__(self, tokens: Mapping[str, str], token_file: Path | None = None) -> None:
        self._static = {name: _digest(token) for name, token in tokens.items() if token}
        self._file = token_file
        self._file_stamp: tuple[float, int, int] | None = None
        self._from_file: dict[str, bytes] = {}

    @classmethod
    def from_settings(cls, settings: ApiSettings) -> TokenStore:
        return cls({name: secret.get_secret_value() for name, secret in settings.tokens.items()}, settings.token_file)

    @property
    def token_file(self) -> Path | None:
        return self._file

    def has_sources(self) -> bool:
        """Whether any token source is configured (static tokens or a token file, present or not)."""
        return bool(self._static) or self._file is not None

    def load(self) -> int:
        """Read the token file now (at start-up); the number of tokens. Raises :class:`TokenFileError`."""
        if self._file is not None:
            tokens = read_token_file(self._file)
            self._from_file = {name: _digest(token) for name, token in (tokens or {}).items()}
            self._file_stamp = self._stamp()
        return len(self._all_cached())

    def configured(self) -> bool:
        return bool(self._all())

    def identify(self, authorization: str | None) -> str | None:
        """The client name for an ``Authorization: Bearer <token>`` header, or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        presented = _digest(token.strip())
        client_name = None
        # Compare against every token, without stopping early and on equal-length digests, so that
        # timing reveals neither which token matched nor how much of one did.
        for name, digest in self._all().items():
            if hmac.compare_digest(presented, digest):
                client_name = name
        return client_name

    def _all_cached(self) -> dict[str, bytes]:
        return {**self._from_file, **self._static}

    def _all(self) -> dict[str, bytes]:
        if self._file is not None:
            self._reload_file()
        return self._all_cached()

    def _stamp(self) -> tuple[float, int, int] | None:
        assert self._file is not None
        try:
            stat = self._file.stat()
        except OSError:
            return None
        return (stat.st_mtime, stat.st_size, stat.st_ino)

    def _reload_file(self) -> None:
        assert self._file is not None
        stamp = self._stamp()
        if stamp == self._file_stamp:
            return
        try:
            tokens = read_token_file(self._file)
        except TokenFileError as exc:
            # A broken rotation must not lock every client out nor answer 500: keep what worked.
            log.warning("%s; keeping the %d tokens read before", exc, len(self._from_file))
            self._file_stamp = stamp
            return
        if tokens is None:
            # A deleted file revokes its tokens (the setting's promise: while it is missing every request is
            # answered 401). A mounted Secret is rotated by swapping a symlink, so it never goes missing
            # in between: only a removed Secret (or file) gets here.
            if self._from_file:
                log.warning("API token file %s was removed; its %d tokens are no longer accepted", self._file,
                            len(self._from_file))
            self._from_file = {}
        else:
            self._from_file = {name: _digest(token) for name, token in tokens.items()}
        self._file_stamp = stamp
