"""Tuning of the parse stage (``XIDFLOW_PARSE_<FIELD>``), shared by its pure core and its Kafka side.

One settings class on purpose: operators see one prefix and one table in docs/configuration.md. The
fields that shape parsing (``shape_check_every``, ``multiline_timeout_s``, ``max_line_chars``,
``max_lines_per_record``, ``max_key_bytes_per_batch``, ``max_dead_letters_per_record``, ``max_nodes``) are
read by ``pipeline.detection.parse_core.ParseCore``; the fetch, produce and commit fields by
``pipeline.detection.parse_stage.ParseStage`` and ``pipeline.detection.parse_outputs``. A module of its own
so the pure core needs nothing of the Kafka side.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.ingest.bounds import (
    DEFAULT_MAX_DEAD_LETTERS,
    DEFAULT_MAX_KEY_BYTES_PER_BATCH,
    DEFAULT_MAX_LINE_CHARS,
    DEFAULT_MAX_LINES_PER_RECORD,
)

PRODUCER_BATCH_BYTES = 512 << 10
"""Producer batch size of the worker's producers (parse stage and Faust): aiokafka's default, 16 KiB,
holds ~24 fault events; the 25th send to a partition then waits until the batch in flight is
acknowledged (one partition, one request in flight), so a burst was sent one round trip at a time."""


class ParseSettings(BaseSettings):
    """Tuning of the parse stage (environment: ``XIDFLOW_PARSE_<FIELD>``)."""

    model_config = SettingsConfigDict(env_prefix="XIDFLOW_PARSE_", extra="ignore")

    max_records: int = Field(
        default=20_000, ge=1, le=1_000_000, description="Default 20000. Records per getmany batch (1 to 1000000)."
    )
    poll_timeout_ms: int = Field(
        default=50,
        ge=1,
        le=60_000,
        description="Default 50. How long getmany waits for records when none are buffered (1 to 60000).",
    )
    shape_check_every: int = Field(
        default=1000,
        ge=0,
        description="Default 1000. Decode one noise record in this many to catch unknown shapes (0: never).",
    )
    multiline_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=3600,
        description="Default 2. A node whose detector holds a partial multi-line message this long is "
        "flushed, so its fault is emitted and its partition's commit moves on (above 0, at most 3600).",
    )
    fetch_max_bytes: int = Field(
        default=16 << 20,
        ge=1 << 20,
        le=1 << 30,
        description="Default 16 MiB. Consumer fetch_max_bytes (1 MiB to 1 GiB): with max_records, what one "
        "batch may hold in memory (20000 log lines are ~4 MB).",
    )
    fetch_max_wait_ms: int = Field(
        default=50,
        ge=1,
        le=10_000,
        description="Default 50. How long one fetch waits on the broker for data (aiokafka: 500). A partition "
        "drained while such a long poll is in flight is fetched again only when it returns (1 to 10000).",
    )
    max_partition_fetch_bytes: int = Field(
        default=4 << 20,
        ge=1 << 20,
        le=1 << 30,
        description="Default 4 MiB. Consumer max_partition_fetch_bytes (1 MiB to 1 GiB).",
    )
    max_unsettled_batches: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Default 4. Batches parsed ahead of their acknowledgements and commits (commits stay "
        "ordered; 1 to 64).",
    )
    max_unsettled_bytes: int = Field(
        default=32 << 20,
        ge=1 << 20,
        le=4 << 30,
        description="Default 32 MiB. Bytes of fault events and dead letters produced but not yet acknowledged "
        "before parsing waits (1 MiB to 4 GiB).",
    )
    linger_ms: int = Field(default=2, ge=0, le=10_000, description="Default 2. Producer linger for fault events.")
    max_batch_bytes: int = Field(
        default=PRODUCER_BATCH_BYTES,
        ge=16 << 10,
        le=1 << 20,
        description="Default 512 KiB. Producer batch size per partition (16 KiB to 1 MiB; keep it below the "
        "topics' max.message.bytes). A full batch makes the next send wait for the one in flight to be "
        "acknowledged: with aiokafka's 16 KiB a 500-line burst waited for several round trips in a row.",
    )
    dead_letter_log_per_s: float = Field(
        default=10.0, ge=0, description="Default 10. Dead letters logged per second at most (the rest are counted)."
    )
    max_line_chars: int = Field(
        default=DEFAULT_MAX_LINE_CHARS,
        ge=256,
        le=262_144,
        description="Default 4096. Characters kept of one log line that reaches the detector; a longer line is "
        "cut with a marker and its record goes to the dead-letter topic once (256 to 262144).",
    )
    max_lines_per_record: int = Field(
        default=DEFAULT_MAX_LINES_PER_RECORD,
        ge=1,
        le=1_000_000,
        description="Default 1000. Lines of one record that are parsed; the rest are not, and the record goes to "
        "the dead-letter topic once (code too_many_lines) (1 to 1000000).",
    )
    max_key_bytes_per_batch: int = Field(
        default=DEFAULT_MAX_KEY_BYTES_PER_BATCH,
        ge=1024,
        le=1 << 30,
        description="Default 64 KiB. Bytes of one Kafka key's (one node's) records with fault markers that are "
        "parsed in one batch; its first record always is. The node's records past it are not parsed and go to "
        "the dead-letter topic as one letter per node and batch (code node_over_budget), so one node's flood "
        "costs that node's lines, not the fleet's detection. Records without a key are not budgeted (1 KiB to "
        "1 GiB).",
    )
    max_dead_letters_per_record: int = Field(
        default=DEFAULT_MAX_DEAD_LETTERS,
        ge=1,
        le=1000,
        description="Default 10. Dead letters one input record yields at most; the last summarises the rest.",
    )
    max_output_bytes: int = Field(
        default=512 << 10,
        ge=16 << 10,
        le=1 << 20,
        description="Default 512 KiB. Largest fault event produced; a bigger one becomes a dead letter "
        "(keep it below the topics' max.message.bytes; 16 KiB to 1 MiB).",
    )
    max_nodes: int = Field(
        default=50_000,
        ge=1,
        le=10_000_000,
        description="Default 50000. Nodes whose detector state (multi-line folds, GPU UUIDs) is kept; past "
        "this the node quiet for longest is forgotten, so made-up node names cannot grow memory.",
    )
    stall_after_s: float = Field(
        default=120.0,
        gt=0,
        le=86_400,
        description="Default 120. /healthz fails when the stage had input waiting and made no progress "
        "(no commit) for this long, or its loop did not run for this long.",
    )
