"""Logging of every xidflow process: one ``--log-level`` and one ``--log-format`` flag, the same on
every command that runs a process, with the settings ``XIDFLOW_LOG_LEVEL`` and ``XIDFLOW_LOG_FORMAT``.

``json`` writes one object per line (``ts``, ``level``, ``logger``, ``msg``, ``exc``) for log
pipelines; ``text`` is for people.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any, Literal

import click
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_META_KEY = "xidflow.logging"


class LogSettings(BaseSettings):
    """Logging (environment: ``XIDFLOW_LOG_<FIELD>``; the flags ``--log-level``/``--log-format`` win)."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_LOG_", extra="ignore")

    level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        default="info", description="Default info. Log level of every xidflow process (debug, info, warning, ...)."
    )
    format: Literal["text", "json"] = Field(
        default="text", description="Default text. `json`: one JSON object per log line, for log pipelines."
    )


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        import orjson

        doc: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(doc, default=str).decode()


JsonFormatter.converter = time.gmtime  # timestamps in UTC, as the "Z" says


def formatter(fmt: str) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)


def configure(level: str, fmt: str) -> None:
    """Configure the root logger (stderr), replacing whatever was configured before.

    Its handler counts client libraries' failed attempts to reach a dependency instead of writing them
    (``pipeline.runtime.reachability``): an outage is a few lines in every process.
    """
    from pipeline.runtime.reachability import ClientRetries

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    handler.addFilter(ClientRetries())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def dict_config(level: str, fmt: str) -> dict[str, Any]:
    """The same configuration as a ``logging.config.dictConfig`` dict (Faust's worker takes one)."""
    spec: dict[str, Any] = {"()": f"{__name__}.JsonFormatter"} if fmt == "json" else {"format": TEXT_FORMAT}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"xidflow": spec},
        "filters": {"reachability": {"()": "pipeline.runtime.reachability.ClientRetries"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr",
                                "formatter": "xidflow", "filters": ["reachability"]}},
        "root": {"level": level.upper(), "handlers": ["stderr"]},
    }


def current() -> tuple[str, str]:
    """(level, format) chosen by the flags of the running command, else by the settings."""
    ctx = click.get_current_context(silent=True)
    chosen = ctx.meta.get(_META_KEY) if ctx is not None else None
    if chosen:
        return chosen["level"], chosen["format"]
    settings = LogSettings()
    return settings.level, settings.format


def _remember(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    chosen = ctx.meta.setdefault(_META_KEY, {})
    if value is not None:
        chosen[str(param.name).removeprefix("log_")] = value.lower()
    if {"level", "format"} <= chosen.keys():
        configure(chosen["level"], chosen["format"])
    return value


def log_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--log-level`` and ``--log-format`` on a command; logging is configured before it runs.

    The values are not passed to the command; it reads them with ``current()`` when it needs them.
    """
    level = click.option(
        "--log-level", "--loglevel", "log_level", type=click.Choice(LEVELS, case_sensitive=False), default="info",
        envvar="XIDFLOW_LOG_LEVEL", show_default=True, expose_value=False, callback=_remember,
        help="Log level [env XIDFLOW_LOG_LEVEL].",
    )
    fmt = click.option(
        "--log-format", "log_format", type=click.Choice(FORMATS, case_sensitive=False), default="text",
        envvar="XIDFLOW_LOG_FORMAT", show_default=True, expose_value=False, callback=_remember,
        help="text, or json: one object per line [env XIDFLOW_LOG_FORMAT].",
    )
    return level(fmt(command))
