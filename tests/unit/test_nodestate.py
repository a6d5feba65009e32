"""Which view of a Node a write starts from (pure: no API server involved)."""

from __future__ import annotations

from typing import Any

from pipeline.actuator.nodestate import NodeWriter, newest
from pipeline.actuator.nodeview import NodeView


def view(name: str, rv: str) -> NodeView:
    return NodeView.from_object({"metadata": {"name": name, "resourceVersion": rv}})


def test_newest_compares_resource_versions_as_numbers() -> None:
    assert newest(view("n", "99"), view("n", "100")).resource_version == "100"
    assert newest(view("n", "100"), None).resource_version == "100"
    assert newest(None, None) is None


def test_known_prefers_the_later_of_the_watch_and_our_own_write() -> None:
    writer = NodeWriter(kube=Any, worker="w", max_flows=10)  # type: ignore[arg-type]
    cache = {"n": view("n", "5")}
    writer.peek = cache.get
    assert writer.known("n").resource_version == "5"
    writer._remember(view("n", "7"))  # our write, not yet seen by the watch
    assert writer.known("n").resource_version == "7"
    cache["n"] = view("n", "9")  # the watch moved past it (another writer)
    assert writer.known("n").resource_version == "9"
    assert writer.known("other") is None


def test_after_a_conflict_the_watchs_newer_view_is_taken_else_a_read() -> None:
    """A 409 says another writer came between; the watch usually has delivered that write by then."""
    writer = NodeWriter(kube=Any, worker="w", max_flows=10)  # type: ignore[arg-type]
    cache = {"n": view("n", "7")}
    writer.peek = cache.get
    refused = view("n", "7")
    assert writer._seen_after(refused) is None  # the watch has nothing newer: read
    cache["n"] = view("n", "8")  # the lifecycle controller's taint, delivered
    assert writer._seen_after(refused).resource_version == "8"
    cache["n"] = view("n", "6")
    assert writer._seen_after(refused) is None  # older than what was refused
    cache["n"] = view("n", "x")
    assert writer._seen_after(view("n", "y")) is None  # versions that cannot be ordered: read
    writer.peek = None
    assert writer._seen_after(refused) is None
