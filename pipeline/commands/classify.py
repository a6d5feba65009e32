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

from pipeline.commands.output import Column, emit
from pipeline.detection.catalog import Catalog, CatalogError
from pipeline.detection.detector import classify_lines
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
        "gpu_instance": event.gpu_instance,
        "compute_instance": event.compute_instance,
        "reporter": event.reporter.value if event.reporter else None,
        "grade": event.grade.value if event.grade else None,
        "cuda_error": event.detail.get("cuda_error"),
        "cuda_error_code": event.detail.get("cuda_error_code"),
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
@click.option("-o", "--output", "--format", "output_format", type=click.Choice(["text", "wide", "json", "yaml"]),
              default="text", show_default=True,
              help="Aligned columns (text, wide), one JSON object per line per fault (json), or YAML.")
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
            _print_table(results, output_format)
    finally:
        if close:
            stream.close()


def _print_table(results: Iterator[tuple[int, FaultEvent]], output_format: str) -> None:
    # kubectl's manner (pipeline.commands.output): columns never truncated or wrapped, at any width.
    rows = [event_to_row(line_no, event) for line_no, event in results]
    emit(rows, CLASSIFY_COLUMNS, "table" if output_format == "text" else output_format)
    click.echo(f"{len(rows)} fault(s) recognised", err=True)


def _code(row: dict[str, object]) -> str:
    code = "" if row["code"] is None else str(row["code"])
    return code + (f".{row['subcode']}" if row["subcode"] is not None else "")


def _detail(row: dict[str, object]) -> str:
    """What the line says beyond the columns: the MIG instance, who reported an SXid, a pod line's CUDA error."""
    parts = []
    if row["gpu_instance"] is not None:
        parts.append(f"GPU-I:{row['gpu_instance']}")
    if row["compute_instance"] is not None:
        parts.append(f"GPU-CI:{row['compute_instance']}")
    if row["reporter"] is not None:
        parts.append(f"reporter={row['reporter']}")
    if row["cuda_error"] is not None:
        parts.append(f"{row['cuda_error']}({row['cuda_error_code']})")
    return " ".join(parts) or "-"


CLASSIFY_COLUMNS = [
    Column("line", lambda r: str(r["line"])),
    Column("kind", lambda r: str(r["kind"])),
    Column("code", _code),
    Column("pci", lambda r: str(r["pci"] or "-")),
    Column("action", lambda r: str(r["action"])),
    Column("quarantine", lambda r: "yes" if r["quarantine"] else "no"),
    Column("severity", lambda r: str(r["severity"])),
    Column("name", lambda r: str(r["name"] or r["grade"] or "-")),
    Column("detail", _detail),
    Column("gpu", lambda r: str(r["gpu_uuid"] or r["nvswitch"] or "-"), wide_only=True),
    Column("link", lambda r: "-" if r["link"] is None else str(r["link"]), wide_only=True),
    Column("id", lambda r: str(r["id"]), wide_only=True),
    Column("text", lambda r: str(r["text"]).strip(), wide_only=True),
]
