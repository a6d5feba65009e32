"""Command output in kubectl's manner, shared by every command that prints rows.

- The default is a table laid out as ``kubectl get`` lays out its tables (Go's tabwriter with kubectl's
  settings: a column is as wide as its widest cell plus three spaces, and at least six), with upper-case
  headers. A cell is never truncated or wrapped, whatever the terminal width and when piped: a
  long node name makes a long line, never two nodes that look alike.
- Ages are kubectl's (``duration.HumanDuration``): 45s, 5m30s, 12m, 2h15m, 10h, 3d4h, 30d, 2y10d.

Both imitate kubectl, so ``tests/integration/test_kubectl_output.py`` holds them against the real kubectl
(built with the local control plane) on the same cells and timestamps.
- ``-o wide`` adds columns; ``-o json`` and ``-o yaml`` print the rows as data (lists stay lists,
  objects stay objects), for scripts.

Pure: rendering returns strings; only ``emit`` writes.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import click

OUTPUT_FORMATS = ("table", "wide", "json", "yaml")
COLUMN_GAP = "   "
# kubectl's tabwriter (k8s.io/cli-runtime printers.GetNewTabWriter): padding 3, minimum cell width 6.
_MIN_CELL_WIDTH = 6


@dataclass(frozen=True)
class Column:
    """One table column: its header and how a row (a mapping) becomes the cell text."""

    header: str
    cell: Callable[[Mapping[str, Any]], str]
    wide_only: bool = False


def output_option(default: str = "table") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``-o/--output table|wide|json|yaml``, the same option on every command that prints rows."""
    return click.option(
        "-o", "--output", "output", type=click.Choice(OUTPUT_FORMATS), default=default, show_default=True,
        help="table (aligned columns), wide (more columns), json or yaml.",
    )


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligned columns, never truncated; the last column is not padded (no trailing spaces)."""
    table = [[str(h).upper() for h in headers], *[[_one_line(c) for c in row] for row in rows]]
    widths = [max(max(len(r[i]) for r in table) + len(COLUMN_GAP), _MIN_CELL_WIDTH) for i in range(len(headers))]
    lines = []
    for r in table:
        cells = [c.ljust(w) for c, w in zip(r[:-1], widths[:-1], strict=True)] + [r[-1]]
        lines.append("".join(cells).rstrip())
    return "\n".join(lines) + "\n"


def _one_line(value: object) -> str:
    text = "" if value is None else str(value)
    text = " ".join(text.split())  # a newline inside a cell would break the alignment of every row below
    return text or "-"


def render_rows(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column], output: str) -> str:
    """The text ``emit`` prints: a table (``table``/``wide``) or the rows as JSON or YAML."""
    if output == "json":
        import orjson

        return orjson.dumps(list(rows), option=orjson.OPT_INDENT_2).decode() + "\n"
    if output == "yaml":
        import yaml

        return yaml.safe_dump([dict(r) for r in rows], sort_keys=False, default_flow_style=False)
    shown = [c for c in columns if output == "wide" or not c.wide_only]
    return render_table([c.header for c in shown], [[c.cell(r) for c in shown] for r in rows])


def emit(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column], output: str, empty: str = "") -> None:
    """Print rows; an empty table prints ``empty`` on stderr instead (as kubectl's "No resources found")."""
    if not rows and output in ("table", "wide"):
        if empty:
            click.echo(empty, err=True)
        return
    text = render_rows(rows, columns, output)
    if output in ("table", "wide") and sys.stdout.isatty():
        _print_coloured(text)
    else:
        click.echo(text, nl=False)


def emit_object(obj: Mapping[str, Any], columns: Sequence[Column], output: str) -> None:
    """One object: itself in JSON or YAML (not a one-element list), one table row otherwise."""
    if output in ("json", "yaml"):
        if output == "json":
            import orjson

            text = orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode() + "\n"
        else:
            import yaml

            text = yaml.safe_dump(dict(obj), sort_keys=False, default_flow_style=False)
        click.echo(text, nl=False)
        return
    emit([obj], columns, output)


def _print_coloured(text: str) -> None:
    # Colour only on a terminal, and only the header: the text (and so the alignment) is unchanged.
    header, _, body = text.partition("\n")
    click.echo(click.style(header, bold=True))
    click.echo(body, nl=False)


def age(seconds: float | None) -> str:
    """kubectl's age of something ``seconds`` old (``HumanDuration`` of k8s.io/apimachinery): two units while
    the larger is small (5m30s, 2h15m, 3d4h, 2y10d), one after; ``<invalid>`` more than a second ahead."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 120:
        return f"{max(s, 0)}s"
    minutes, hours = s // 60, s // 3600
    days = hours // 24
    if minutes < 10:
        return _two(minutes, "m", s % 60, "s")
    if minutes < 3 * 60:
        return f"{minutes}m"
    if hours < 8:
        return _two(hours, "h", minutes % 60, "m")
    if hours < 48:
        return f"{hours}h"
    if hours < 8 * 24:
        return _two(days, "d", hours % 24, "h")
    if days < 2 * 365:
        return f"{days}d"
    if days < 8 * 365:
        return _two(days // 365, "y", days % 365, "d")
    return f"{days // 365}y"


def _two(big: int, big_unit: str, small: int, small_unit: str) -> str:
    return f"{big}{big_unit}{small}{small_unit}" if small else f"{big}{big_unit}"


def joined(values: Sequence[object] | None, sep: str = ",") -> str:
    """A list as one table cell ("-" when empty); JSON and YAML keep the list."""
    return sep.join(str(v) for v in values or ()) or "-"
