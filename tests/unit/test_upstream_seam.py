"""Faust's and aiokafka's private names are touched in one module, ``pipeline/kafka/upstream.py``, and nowhere else.

The names are the ones the seam's docstring lists; tests/integration/test_upstream_internals.py checks
each against the pinned upstream versions. A new use elsewhere fails here with its file and line: put
it in the seam (with its test) instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SEAM = ROOT / "pipeline" / "kafka" / "upstream.py"

# Faust's ``Consumer._thread`` is used too, but the name is too common to search for (our own watches have one).
UPSTREAM_PRIVATE = frozenset({
    # Faust's consumer, its thread and its table manager
    "_getmany", "_add_gap", "_new_offset", "_new_consumer_thread", "_create_worker_consumer", "_ensure_consumer",
    "_committed_offset", "_acked", "_read_offset", "_unacked_messages", "_paused_partitions", "_update_channels",
    # aiokafka's consumer, coordinator, admin client and record iterator
    "_fetch_max_wait_ms", "_subscription", "_client", "_coordinator", "_group_instance_id", "_send_request",
    "_unpack_records",
    # aiokafka's fetcher, its buffer and record iterator (the parse stage's bare records)
    "_fetcher", "_records", "_partition_records", "_consumer_record", "_key_deserializer", "_value_deserializer",
    # aiokafka's fetch planning (a long poll only when the fetch holds no partition back)
    "_get_actions_per_node",
    # Faust's producer: the aiokafka producer behind it (the aggregation's record batches)
    "_ensure_producer",
})
PRIVATE_MODULES = ("aiokafka.protocol", "aiokafka.coordinator", "aiokafka.consumer.fetcher", "faust.transport")


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    where = path.relative_to(ROOT)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in UPSTREAM_PRIVATE:
            found.append(f"{where}:{node.lineno}: .{node.attr}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in UPSTREAM_PRIVATE:
            found.append(f"{where}:{node.lineno}: overrides {node.name}")
        elif isinstance(node, ast.Constant) and node.value in UPSTREAM_PRIVATE:
            found.append(f"{where}:{node.lineno}: names {node.value!r}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PRIVATE_MODULES):
            found.append(f"{where}:{node.lineno}: imports {node.module}")
    return found


def test_no_private_upstream_name_outside_the_seam() -> None:
    sources = [p for d in ("pipeline", "agents", "schemas") for p in (ROOT / d).rglob("*.py") if p != SEAM]
    assert sources
    offences = [o for p in sources for o in _offences(p)]
    assert not offences, "private Faust/aiokafka names outside pipeline/kafka/upstream.py:\n" + "\n".join(offences)


def test_the_seam_uses_every_name_it_is_checked_for() -> None:
    # A name no longer used should leave this list (and its integration test) too.
    text = SEAM.read_text()
    assert not [n for n in sorted(UPSTREAM_PRIVATE) if n not in text]
