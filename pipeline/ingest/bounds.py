"""What one input record, and one node in a batch, may cost and become: bounded lines, bytes and dead letters.

Pure, no I/O. "No input stops the pipeline" needs every output of a record to fit the broker's limits
whatever the input was: a kernel line of half a megabyte is carried twice by its fault event (``line`` and
the message in ``detail``), which is past the producer's 1 MiB request limit. So a line that reaches the
detector is cut to ``max_line_chars`` with a marker saying how much was cut (the whole input goes to
the dead-letter topic once, itself cut to 64 KiB), and one record yields at most a bounded number
of dead letters: the rest are summarised in one.

"One node cannot stall detection for every node" needs what one record and one node cost the parse stage
bounded too: a 600 KB record of 100,000 short marker lines cost ~1 s of CPU, so a few such records a
second from one shipper took the whole stage. So a record is parsed up to ``max_lines_per_record`` lines
(``cut_raw_lines`` before it is decoded, ``cap_lines`` after, for lines a JSON string carried), and in one
batch the records of one Kafka key (the node, as every shipper xidflow ships sends it) that must be decoded
are parsed up to ``max_key_bytes_per_batch`` bytes (``budget_by_key``): the node's first record is always
parsed, its records past the budget are not. What is not parsed becomes a dead letter with the reason:
one per over-long record, one per node and batch for the records past its budget.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from schemas.records import DeadLetter, DeadLetterCode, LogRecord

DEFAULT_MAX_LINE_CHARS = 4096
"""Characters kept of one physical line (printk's limit is 1024; pod lines of a few KB still fit)."""

DEFAULT_MAX_DEAD_LETTERS = 10
"""Dead letters one input record yields at most (the last one summarises the rest)."""

DEFAULT_MAX_LINES_PER_RECORD = 1000
"""Lines of one record that are parsed (each costs the parse stage ~20-40 us to decode). Fluent Bit, rsyslog and the
Loki bridge send one line a record; the OpenTelemetry Collector a batch, at most 1000 with the shipped configuration
(``deploy/otel-collector/otel-collector.yaml``, the batch processor's ``send_batch_max_size``)."""

DEFAULT_MAX_KEY_BYTES_PER_BATCH = 64 << 10
"""Bytes of one key's records (a node's) that are decoded and parsed in one batch: ~400 Xid lines."""


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


def cut_raw_lines(value: bytes, limit: int) -> tuple[bytes, int]:
    """``value`` cut after its ``limit``-th line (a newline ends a line) and how many lines it had.

    Counting and cutting are C-speed scans, so a record of 100,000 lines costs no Python-level work per
    line before it is cut. Lines inside a JSON string (escaped newlines) are bounded by ``cap_lines``.
    """
    lines = value.count(b"\n") + (0 if value.endswith(b"\n") else 1)
    if lines <= limit:
        return value, lines
    end = -1
    for _ in range(limit):
        end = value.find(b"\n", end + 1)
    return value[:end], lines


def cap_lines(records: list[LogRecord], limit: int) -> int:
    """Keep the first ``limit`` physical lines of the records' text (in place); how many there were."""
    total = sum(r.line.count("\n") + 1 for r in records)
    if total <= limit:
        return total
    room = limit
    for index, record in enumerate(records):
        count = record.line.count("\n") + 1
        if count > room:
            if room == 0:
                del records[index:]
                break
            end = -1
            for _ in range(room):
                end = record.line.find("\n", end + 1)
            record.line = record.line[:end]
            del records[index + 1:]
            break
        room -= count
    return total


def budget_by_key(
    wanted: Sequence[tuple[int, bytes | None, int]], limit: int
) -> tuple[list[int], dict[bytes, list[int]]]:
    """Which ``wanted`` records, ``(index, key, size)`` in order, fit their key's ``limit`` bytes, and which do not.

    A key's first record always fits; once one of its records does not, none of its later ones does (what
    is parsed of a node stays in order). Records without a key (a shipper that names the node only inside
    the record) are not budgeted: which node they are is known only after decoding them.
    """
    used: dict[bytes, int] = {}
    over: dict[bytes, list[int]] = {}
    kept: list[int] = []
    for index, key, size in wanted:
        if key is None:
            kept.append(index)
            continue
        if key in over:
            over[key].append(index)
            continue
        spent = used.get(key, 0)
        if spent and spent + size > limit:
            over[key] = [index]
            continue
        used[key] = spent + size
        kept.append(index)
    return kept, over
