"""What one input record may become: cut lines and capped dead letters (pipeline.ingest.bounds)."""

from __future__ import annotations

from datetime import UTC, datetime

from pipeline.ingest.bounds import cap_dead_letters, clip_record, clip_text
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
