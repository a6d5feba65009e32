"""What one input record may become: bounded lines, bounded dead letters. Pure, no I/O.

"No input stops the pipeline" needs every output of a record to fit the broker's limits whatever the
input was: a kernel line of half a megabyte is carried twice by its fault event (``line`` and the
message in ``detail``), which is past the producer's 1 MiB request limit. So a line that reaches the
detector is cut to ``max_line_chars`` with a marker saying how much was cut (the whole input goes to
the dead-letter topic once, itself cut to 64 KiB), and one record yields at most a bounded number
of dead letters: the rest are summarised in one.
"""

from __future__ import annotations

from collections import Counter

from schemas.records import DeadLetter, DeadLetterCode, LogRecord

DEFAULT_MAX_LINE_CHARS = 4096
"""Characters kept of one physical line (printk's limit is 1024; pod lines of a few KB still fit)."""

DEFAULT_MAX_DEAD_LETTERS = 10
"""Dead letters one input record yields at most (the last one summarises the rest)."""


def truncation_marker(cut: int) -> str:
    """The marker put at the end of a cut line; it says how many characters are missing."""
    return f" ...[xidflow: {cut} characters truncated]"


def clip_text(text: str, limit: int) -> tuple[str, int]:
    """``text`` with every physical line cut to ``limit`` characters (plus a marker); and how much was cut."""
    if len(text) <= limit:
        return text, 0
    if "\n" not in text:
        cut = len(text) - limit
        return text[:limit] + truncation_marker(cut), cut
    total = 0
    parts = []
    for part in text.split("\n"):
        clipped, cut = clip_text(part, limit) if len(part) > limit else (part, 0)
        parts.append(clipped)
        total += cut
    return "\n".join(parts), total


def clip_record(record: LogRecord, limit: int) -> int:
    """Cut ``record.line`` in place (see ``clip_text``); returns the characters cut (0: untouched)."""
    if len(record.line) <= limit:
        return 0
    record.line, cut = clip_text(record.line, limit)
    return cut


def cap_dead_letters(dead: list[DeadLetter], limit: int) -> list[DeadLetter]:
    """At most ``limit`` dead letters for one input record: the first ``limit - 1``, then one summary.

    The summary keeps the next letter's coordinates and payload, and counts the rest by code.
    """
    if len(dead) <= limit:
        return dead
    kept = dead[: max(0, limit - 1)]
    rest = dead[len(kept):]
    counts = Counter(d.code.value for d in rest)
    by_code = ", ".join(f"{n} {code}" for code, n in sorted(counts.items()))
    first = rest[0]
    summary = first.model_copy(
        update={
            "code": DeadLetterCode.MORE_PROBLEMS,
            "reason": f"{len(rest)} more problems in this record ({by_code}); first: {first.reason}"[:2048],
        }
    )
    return [*kept, summary]
