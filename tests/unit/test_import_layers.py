"""docs/architecture.md's import rules, read from the code: no import circle, and the layers import one way.

The graph is every ``import`` in ``pipeline/``, ``schemas/`` and ``agents/`` that runs when its module is
imported (module level; imports under ``if TYPE_CHECKING:`` and inside functions are left out: they do not
run at import time). Run ``python -m pytest tests/unit/test_import_layers.py -q`` to check it; a failure names
the circle or the import that crosses a layer.
"""

from __future__ import annotations

import ast
import functools
import graphlib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "schemas", "agents")
STAGES = ("pipeline.ingest", "pipeline.detection", "pipeline.aggregate", "pipeline.actuator")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported: not in a function, not under ``if TYPE_CHECKING:``."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if not _type_checking(node.test):
                yield from _import_time(node.body)
            yield from _import_time(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _import_time(block)
        elif isinstance(node, ast.ClassDef | ast.With):
            yield from _import_time(node.body)


def _targets(module: str, node: ast.Import | ast.ImportFrom, known: set[str]) -> Iterator[str]:
    """The project modules an import statement loads (a name imported from a package may be a module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if _is_package(module) else module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join([*package, base]) if base else ".".join(package)
        names = [f"{base}.{a.name}" for a in node.names] + [base]
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            yield name


def _is_package(module: str) -> bool:
    return (ROOT / Path(*module.split(".")) / "__init__.py").exists()


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports at import time."""
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    known = {_module(p) for p in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        module = _module(path)
        tree = ast.parse(path.read_text(), str(path))
        graph[module] = {t for stmt in _import_time(tree.body) for t in _targets(module, stmt, known)}
    return graph


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle (its modules in order, the first again at the end), or [] when there is none."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return []


def _crossing(graph: dict[str, set[str]], source: str, forbidden: tuple[str, ...],
              allowed: tuple[str, ...] = ()) -> list[str]:
    def under(name: str, roots: tuple[str, ...]) -> bool:
        return any(name == r or name.startswith(r + ".") for r in roots)

    return sorted(f"{m} -> {t}" for m, targets in graph.items() if under(m, (source,))
                  for t in targets if under(t, forbidden) and not under(t, allowed))


def test_no_import_circle() -> None:
    assert circle(import_graph()) == []


def test_the_circle_finder_finds_one() -> None:
    # The check above can fail: a three-module loop is reported, a graph without one is not.
    found = circle({"c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"c"}})
    assert set(found) == {"c", "d", "e"} and found[0] == found[-1]
    assert circle({"a": {"b"}, "b": set(), "f": {"a"}}) == []


def test_the_graph_sees_what_the_actuator_imports() -> None:
    # The layer checks below read this graph: it must hold the imports the page allows, or they prove nothing.
    graph = import_graph()
    assert "pipeline.detection.catalog" in graph["pipeline.actuator.plan"]
    assert "pipeline.aggregate.sharedparts" in graph["pipeline.actuator.plan"]
    assert "schemas.records" in graph["pipeline.actuator.plan"]


def test_runtime_and_kafka_import_no_stage() -> None:
    graph = import_graph()
    assert _crossing(graph, "pipeline.runtime", STAGES) == []
    assert _crossing(graph, "pipeline.kafka", STAGES) == []


def test_ingest_imports_neither_detection_nor_aggregation() -> None:
    assert _crossing(import_graph(), "pipeline.ingest", ("pipeline.detection", "pipeline.aggregate")) == []


def test_the_actuator_imports_no_worker_stage_but_the_catalog_and_shared_part_rules() -> None:
    allowed = ("pipeline.detection.catalog", "pipeline.aggregate.sharedparts")
    worker = ("pipeline.ingest", "pipeline.detection", "pipeline.aggregate")
    assert _crossing(import_graph(), "pipeline.actuator", worker, allowed) == []
