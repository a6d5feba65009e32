"""``xidflow classify``: classify kernel or pod log lines from a file (or stdin) with the catalog.

Pure and offline: no Kafka, no Kubernetes. One JSON object per recognised fault with
``--format json``; a table otherwise. Unrecognised lines print nothing.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from typing import IO

import click
import orjson

from pipeline.catalog import Catalog, CatalogError
from pipeline.detect import classify_lines
from schemas.records import FaultEvent


def event_to_row(line_no: int, event: FaultEvent) -> dict[str, object]:
    """The JSON object printed for one event (stable keys: other tools parse this output)."""
    return {
        "line": line_no,
        "kind": event.kind.value,
        "code": event.code,
        "subcode": event.subcode,
        "pci": event.pci,
        "gpu_uuid": event.gpu_uuid,
        "nvswitch": event.nvswitch,
        "link": event.link,
        "fatal": event.fatal,
        "grade": event.grade.value if event.grade else None,
        "name": event.name,
        "action": event.action.value,
        "quarantine": event.quarantine,
        "severity": event.severity.value,
        "sticky": event.sticky,
        "id": event.id,
        "text": event.line,
    }


def _decoded_lines(stream: IO[bytes]) -> Iterator[str]:
    # Undecodable bytes become U+FFFD instead of aborting the run: logs are often mixed encodings.
    text = io.TextIOWrapper(stream, encoding="utf-8", errors="replace", newline=None)
    yield from text


@click.command("classify")
@click.option("--source", type=click.Choice(["kernel", "pod"]), default="kernel", show_default=True,
              help="What kind of lines the input holds.")
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="A table, or one JSON object per recognised fault.")
@click.option("--catalog-overrides", type=click.Path(dir_okay=False, path_type=str), default=None,
              help="YAML file overriding catalog entries (same layout as the catalog). "
                   "Default: XIDFLOW_CATALOG_OVERRIDES, as the worker uses it.")
@click.argument("file", required=False, default="-", type=str)
def classify(source: str, output_format: str, catalog_overrides: str | None, file: str) -> None:
    """Classify kernel or pod log lines from FILE (default: stdin, or '-')."""
    try:
        catalog = Catalog.load(overrides=catalog_overrides) if catalog_overrides else Catalog.configured()
    except CatalogError as exc:
        raise click.ClickException(str(exc)) from None
    if file == "-":
        stream: IO[bytes] = sys.stdin.buffer
        close = False
    else:
        try:
            stream = open(file, "rb")  # noqa: SIM115 - closed below, after streaming
        except OSError as exc:
            raise click.ClickException(f"cannot read {file}: {exc.strerror or exc}") from None
        close = True
    try:
        results = classify_lines(_decoded_lines(stream), source=source, node="local", catalog=catalog)
        if output_format == "json":
            out = sys.stdout.buffer
            for line_no, event in results:
                out.write(orjson.dumps(event_to_row(line_no, event)) + b"\n")
            out.flush()
        else:
            _print_table(results)
    finally:
        if close:
            stream.close()


def _print_table(results: Iterator[tuple[int, FaultEvent]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="GPU faults", show_lines=False)
    # Short, fixed columns never wrap; the free-text column takes what width is left.
    for column in ("line", "kind", "code", "pci", "action", "quarantine", "severity"):
        table.add_column(column, no_wrap=True)
    table.add_column("name / gpu", overflow="fold")
    count = 0
    for line_no, event in results:
        count += 1
        code = "" if event.code is None else str(event.code)
        if event.subcode is not None:
            code += f".{event.subcode}"
        what = event.name or (event.grade.value if event.grade else "")
        where = event.gpu_uuid or event.nvswitch
        table.add_row(
            str(line_no), event.kind.value, code, event.pci or "", event.action.value,
            "yes" if event.quarantine else "no", event.severity.value, f"{what} {where}" if where else what,
        )
    # Piped output (files, CI logs) has no terminal width: use a wide page rather than cropping.
    console = Console() if sys.stdout.isatty() else Console(width=200)
    if count:
        console.print(table)
    console.print(f"{count} fault(s) recognised")
