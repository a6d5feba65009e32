"""Runs the real-line corpus (kernel_corpus.yaml, pod_corpus.yaml) through classify_lines."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pipeline.commands.classify import event_to_row
from pipeline.detection.detector import classify_lines

HERE = Path(__file__).parent


def _cases(name: str, source: str) -> list:
    document = yaml.safe_load((HERE / name).read_text(encoding="utf-8"))
    return [pytest.param(source, case, id=case["id"]) for case in document["cases"]]


ALL_CASES = _cases("kernel_corpus.yaml", "kernel") + _cases("pod_corpus.yaml", "pod")


def test_corpus_is_broad() -> None:
    kernel = yaml.safe_load((HERE / "kernel_corpus.yaml").read_text())["cases"]
    lines = sum(len(c["lines"]) for c in kernel)
    lookalikes = [c for c in kernel if not c["expect"]]
    assert lines >= 50 and len(lookalikes) >= 6
    assert all(c.get("source") for c in kernel), "every case names its public source"


@pytest.mark.parametrize(("source", "case"), ALL_CASES)
def test_corpus_case(source: str, case: dict) -> None:
    rows = [event_to_row(n, e) for n, e in classify_lines(case["lines"], source=source)]
    expected = case["expect"]
    assert len(rows) == len(expected), f"{case['id']}: got {rows}"
    for row, want in zip(rows, expected, strict=True):
        for key, value in want.items():
            assert row[key] == value, f"{case['id']} line {row['line']}: {key}={row[key]!r}, want {value!r}"
