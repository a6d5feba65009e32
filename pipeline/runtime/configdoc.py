"""Renders the configuration reference (every setting, its variable and default) from the settings classes.

``python -m pipeline.runtime.configdoc`` writes ``docs/configuration.md``; a unit test fails while the
committed file is stale, so the reference cannot drift from the code.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import textwrap
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

SETTINGS_CLASSES: tuple[tuple[str, str, str], ...] = (
    ("pipeline.runtime.settings", "KafkaSettings", "Kafka connection (every process)"),
    ("pipeline.runtime.settings", "TopicNames", "Topic names (every process)"),
    ("pipeline.runtime.logconfig", "LogSettings", "Logging (every process; flags --log-level, --log-format)"),
    ("pipeline.runtime.heartbeat", "HealthSettings", "Liveness endpoint served by the event loop (every process)"),
    ("pipeline.runtime.settings", "ConsumerGroupSettings", "Consumer-group membership (worker, actuator)"),
    ("pipeline.kafka.cloudevents", "CloudEventsSettings",
     "CloudEvents headers of incidents and audit records (worker, actuator)"),
    ("pipeline.runtime.gcpolicy", "GcSettings", "Garbage collector thresholds (worker, actuator)"),
    ("pipeline.runtime.supervisor", "SupervisorSettings",
     "Warm supervisor that replaces a crashed child (worker, actuator)"),
    ("pipeline.detection.catalog", "CatalogSettings", "Xid/SXid catalog overrides (worker, `classify`)"),
    ("pipeline.detection.parse_settings", "ParseSettings", "Parse stage (worker)"),
    ("pipeline.app", "WorkerSettings", "Faust worker (worker)"),
    ("pipeline.aggregate.settings", "AggregationSettings", "Per-node aggregation windows and thresholds (worker)"),
    ("pipeline.actuator.settings", "ActuatorSettings", "Actuator: remediation, safety rails (actuator)"),
    ("pipeline.actuator.api.settings", "ApiSettings", "Decision API (actuator, when tokens are configured)"),
    ("pipeline.actuator.notify", "NotifySettings", "Webhook notifications (actuator)"),
    ("pipeline.actuator.signing", "SigningSettings", "Rescue request signing key (decision API and actuator)"),
)

OUT = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _env_name(cls: type[BaseSettings], name: str, field: FieldInfo) -> str:
    alias = field.validation_alias
    if isinstance(alias, str):
        return alias
    prefix = cls.model_config.get("env_prefix", "") or ""
    return (prefix + name).upper()


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        try:
            value: Any = field.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "(computed)"
    else:
        value = field.default
    if value is None or value == "":
        return "(empty)" if value == "" else "(none)"
    text = _plain(value)
    return f"`{text}`" if len(text) < 60 else f"`{text[:57]}...`"


def _plain(value: Any) -> str:
    """A stable, readable rendering: enums by value, sets sorted, containers recursively."""
    if hasattr(value, "value"):  # enums, including str/int enums
        return str(value.value)
    if isinstance(value, set | frozenset):
        return ", ".join(sorted(_plain(v) for v in value))
    if isinstance(value, list | tuple):
        return ", ".join(_plain(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{_plain(k)}={_plain(v)}" for k, v in value.items())
    return str(value)


def _description(field: FieldInfo, docstring: str | None = None) -> str:
    text = (field.description or docstring or "").replace("\n", " ").replace("|", "\\|").strip()
    return text or "-"


def attribute_docstrings(cls: type) -> dict[str, str]:
    """The string under each field of a class (``pipeline.actuator.settings``'s style), by field name.

    Read here from the source, not by pydantic at import (``use_attribute_docstrings``): on Python 3.11
    pydantic finds the class's source by walking the import's frames, and its first ``inspect.getmodule``
    resolves the file of every loaded module, ~50 ms of CPU of each ``xidflow actuator`` start (issue 22,
    a restarted container's critical path). Cleaned as pydantic cleans them (``inspect.cleandoc``).
    """
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source file (a class built at run time): its descriptions only
        return {}
    body = next(node.body for node in ast.parse(source).body if isinstance(node, ast.ClassDef))
    found: dict[str, str] = {}
    for field, doc in zip(body, body[1:], strict=False):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            found[field.target.id] = inspect.cleandoc(doc.value.value)
    return found


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Every setting is read from the environment (or a `.env`-style variable in the pod spec). This file is",
        "generated from the settings classes by `python -m pipeline.runtime.configdoc`; a test fails when it is stale.",
        "",
    ]
    for module_name, class_name, title in SETTINGS_CLASSES:
        cls = getattr(importlib.import_module(module_name), class_name)
        lines += [f"## {title}", "", f"`{module_name}.{class_name}`", "",
                  "| variable | default | meaning |", "| --- | --- | --- |"]
        docs = attribute_docstrings(cls)
        for name, field in cls.model_fields.items():
            meaning = _description(field, docs.get(name))
            lines.append(f"| `{_env_name(cls, name, field)}` | {_default(field)} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(render())
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
