"""Tests create the actuator's topics through ``pipeline.actuator.app.actuator_topics``, never a list of their own.

Copies drift: several fixtures listed four of the five topics (no ``fabric_signals``) long after the actuator
began to read it, so those actuators ran against a topic nobody had created for them. A collection literal in
the tests naming two or more of ``ACTUATOR_TOPICS`` is such a copy.
"""

from __future__ import annotations

import ast
from pathlib import Path

from pipeline.actuator.app import ACTUATOR_TOPICS

TESTS = Path(__file__).resolve().parents[1]


def _copies(source: str) -> list[tuple[int, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.List | ast.Tuple | ast.Set):
            names = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in ACTUATOR_TOPICS]
            if len(names) >= 2:
                found.append((node.lineno, names))
    return found


def test_the_detector_sees_a_copied_list() -> None:
    assert _copies('names = ["incidents", "remediation_requests", "deadletter"]') == [
        (1, ["incidents", "remediation_requests", "deadletter"])]
    assert _copies('for t in ("remediation_audit", "remediation_requests"): pass')
    assert not _copies('names = ["incidents", "gpu.fault.events"]')


def test_no_test_holds_its_own_copy_of_the_actuator_topics() -> None:
    copies = [f"{path.relative_to(TESTS.parent)}:{line} {names}"
              for path in sorted(TESTS.rglob("*.py")) if path != Path(__file__).resolve()
              for line, names in _copies(path.read_text())]
    assert not copies, "use actuator_topics(topics) from pipeline/actuator/app.py instead of:\n" + "\n".join(copies)
