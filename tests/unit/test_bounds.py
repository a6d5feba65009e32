"""What one input record and one node may cost and become: cut lines, capped dead letters, records within a
record's lines and a node's bytes per batch (pipeline.ingest.bounds)."""

from __future__ import annotations

from datetime import UTC, datetime

from pipeline.ingest.bounds import budget_by_key, cap_dead_letters, cap_lines, clip_record, clip_text, cut_raw_lines
from schemas.records import DeadLetter, DeadLetterCode, LogRecord, Source


def test_only_over_long_physical_lines_are_cut_and_the_marker_counts_what_is_missing() -> None:
    assert clip_text("short", 10) == ("short", 0)
    text, cut = clip_text("a" * 25, 10)
    assert text == "a" * 10 + " ...[xidflow: 15 characters truncated]" and cut == 15
    text, cut = clip_text("ok\n" + "b" * 30 + "\nfine", 10)
    lines = text.split("\n")
    assert lines[0] == "ok" and lines[2] == "fine" and lines[1].startswith("b" * 10) and cut == 20


def test_clip_record_cuts_in_place() -> None:
    rec = LogRecord(node="n", source=Source.KERNEL, ts=datetime.now(UTC), line="x" * 100)
    assert clip_record(rec, 50) == 50 and rec.line.startswith("x" * 50) and "50 characters" in rec.line
    assert clip_record(rec, 1000) == 0


def test_dead_letters_are_capped_and_the_rest_summarised_by_code() -> None:
    letters = [DeadLetter.of("adapter", f"bad {i}", b"p", DeadLetterCode.INVALID_JSON, offset=i) for i in range(50)]
    letters.append(DeadLetter.of("adapter", "no node", b"p", DeadLetterCode.NO_NODE))
    capped = cap_dead_letters(letters, 10)
    assert len(capped) == 10 and capped[:9] == letters[:9]
    assert capped[-1].code == DeadLetterCode.MORE_PROBLEMS and capped[-1].offset == 9
    assert capped[-1].reason.startswith("42 more problems in this record (41 invalid_json, 1 no_node); first: bad 9")
    assert cap_dead_letters(letters[:3], 10) == letters[:3]


def test_a_dead_letter_is_bounded_whatever_its_input() -> None:
    letter = DeadLetter.of("adapter", "r" * 100_000, b"\x01" * 1_000_000, key="k" * 100_000)
    assert len(letter.reason) < 2100 and len(letter.key or "") < 2100
    assert letter.payload_truncated and len(letter.to_bytes()) < 500_000


def test_a_record_is_cut_after_its_limit_of_lines_before_it_is_decoded() -> None:
    assert cut_raw_lines(b"a\nb\nc", 3) == (b"a\nb\nc", 3)
    assert cut_raw_lines(b"a\nb\nc\n", 3) == (b"a\nb\nc\n", 3)  # a final newline ends a line, it opens none
    assert cut_raw_lines(b"a\nb\nc\nd", 2) == (b"a\nb", 4)
    value, lines = cut_raw_lines(b"NVRM: x\n" * 100_000, 1000)
    assert lines == 100_000 and value.count(b"\n") == 999 and value.endswith(b"NVRM: x")


def test_lines_a_json_string_carried_are_capped_across_the_records_it_made() -> None:
    def rec(text: str) -> LogRecord:
        return LogRecord(node="n", source=Source.KERNEL, ts=datetime.now(UTC), line=text)

    records = [rec("a\nb"), rec("c\nd\ne"), rec("f")]
    assert cap_lines(records, 10) == 6 and [r.line for r in records] == ["a\nb", "c\nd\ne", "f"]
    assert cap_lines(records, 3) == 6 and [r.line for r in records] == ["a\nb", "c"]
    records = [rec("a\nb"), rec("c")]
    assert cap_lines(records, 2) == 3 and [r.line for r in records] == ["a\nb"]
    records = [rec("x\n" * 99_999 + "x")]
    assert cap_lines(records, 1000) == 100_000 and records[0].line.count("\n") == 999


def test_a_nodes_records_past_its_bytes_are_not_parsed_and_its_first_always_is() -> None:
    wanted = [(0, b"a", 10), (1, b"b", 500), (2, b"a", 10), (3, b"a", 100), (4, None, 10_000), (5, b"a", 1),
              (6, b"b", 1)]
    kept, over = budget_by_key(wanted, 100)
    # a: 10 + 10 fit, 100 more does not, and none of a's later records is parsed (order kept); b's first is
    # over the limit alone and still parsed; a record without a key is not budgeted.
    assert kept == [0, 1, 2, 4] and over == {b"a": [3, 5], b"b": [6]}
    assert budget_by_key([], 100) == ([], {})
