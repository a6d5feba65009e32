"""Detection: raw log records in, classified :class:`~schemas.records.FaultEvent` records out.

This is the single entry point the streaming parse stage calls. Hot path::

    detector = Detector()                       # one per consumer; holds per-node state
    for record in records:                      # LogRecord, already adapted
        if not prefilter(record.line, record.source):
            continue                            # ~all noise stops here: a few substring scans
        for event in detector.process(record):
            produce(event)
    ...
    for event in detector.flush():              # on partition revocation / shutdown / idle timer
        produce(event)

Contract (stable; other stages depend on it):

- :func:`prefilter` ``(line, source=None) -> bool``: False for lines that cannot hold a fault.
  Pure substring scans. Calling :meth:`Detector.process` without it is correct, only slower.
- :class:`Detector` ``(catalog=None)``: per-node state — the ``NVRM: GPU at PCI:...: GPU-<uuid>``
  map (puts GPU UUIDs on later events), pending multi-line folds (the three-line "fallen off the
  bus" message), the last SXid (its continuation lines are folded into it, never counted).
  State is per node and records of one node must arrive in order (Kafka keys by node).
- :meth:`Detector.process` ``(record) -> list[FaultEvent]``: kernel, pod and probe sources. Never
  raises on content. A record whose ``line`` holds several lines is processed line by line: real
  newlines, and for kernel records also ``/dev/kmsg``'s ``\\x0a`` and rsyslog's ``#012``
  (:func:`pipeline.ingest.parsing.kmsg.record_lines`), so a multi-line printk arriving in one piece is found.
- :meth:`Detector.flush` ``(node=None) -> list[FaultEvent]``: emits what is held for folding.
- :func:`classify_lines` ``(lines, source, node) -> Iterator[(line_no, FaultEvent)]``: for files.

Event ids are deterministic: ``stable_id(node, source, ts, line, offset)`` of the line where the
fault begins (``offset`` = index of that line inside a multi-line record), so a redelivered record
yields the same ids and downstream idempotency holds.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from pydantic import ValidationError

from pipeline.detection.catalog import Catalog, Classification
from pipeline.ingest.parsing.common import normalize_pci
from pipeline.ingest.parsing.kernel import (
    KERNEL_MARKERS,
    FallenOffBusLine,
    GpuUuidLine,
    NcclSegfaultLine,
    SXidLine,
    XidLine,
    parse_kernel_line,
)
from pipeline.ingest.parsing.kmsg import record_lines
from pipeline.ingest.parsing.pod import match_pod_signal, pod_anchor
from schemas.records import (
    FaultEvent,
    FaultKind,
    HealthCheckResult,
    LogRecord,
    Reporter,
    Severity,
    Source,
    stable_id,
)

# A fallen-off-the-bus message for a GPU that an Xid 79 (or another fallen-off message) reported
# within this many interesting lines and this much log time is the same fault: one event, not two.
DEDUP_LINES = 16
DEDUP_WINDOW = timedelta(seconds=120)
# The three lines of the fallen-off message are one printk; other NVRM lines between them are rare.
# A first line not completed within this many interesting lines is dropped (or emitted if confirmed).
FOLD_MAX_LINES = 8

_KERNEL = Source.KERNEL
_POD = Source.POD
_PROBE = Source.PROBE


def kernel_prefilter(line: str) -> bool:
    """Can this kernel line hold a fault (or a UUID mapping)? A substring scan per kernel marker."""
    for marker in KERNEL_MARKERS:
        if marker in line:
            return True
    return False


def prefilter(line: str, source: Source | str | None = None) -> bool:
    """Very cheap test that is False for ~all noise lines.

    With ``source`` (``kernel``/``pod``/``probe``) only that source's markers are scanned; without it
    a line passes when it could be a fault of any source. Probe records always pass (every
    HealthCheckResult is looked at).
    """
    if source is None:
        return kernel_prefilter(line) or pod_anchor(line)
    if source == _KERNEL:
        return kernel_prefilter(line)
    if source == _POD:
        return pod_anchor(line)
    return True


def parse_health_check(line: str | bytes) -> HealthCheckResult | None:
    """The HealthCheckResult in a probe record's line, or None when it is not one.

    The streaming stage uses this to dead-letter malformed probe records; :meth:`Detector.process`
    silently yields nothing for them.
    """
    try:
        return HealthCheckResult.from_bytes(line)
    except (ValidationError, ValueError, TypeError):
        return None


@dataclass(slots=True)
class _PendingFallen:
    """First line(s) of the three-line fallen-off-the-bus message, waiting for the rest."""

    record: LogRecord
    offset: int
    seq: int
    tick: int
    pci: str | None
    pci_id: str | None
    lines: list[str]
    confirmed: bool = False


@dataclass(slots=True)
class _NodeState:
    uuid_by_pci: dict[str, str] = field(default_factory=dict)
    pending: _PendingFallen | None = None
    last_sxid: tuple[str | None, int] | None = None
    lost: dict[str, tuple[int, datetime]] = field(default_factory=dict)
    tick: int = 0


class Detector:
    """Stateful detector: folds multi-line messages and remembers GPU UUIDs, per node.

    Not thread-safe; use one per consumer task. Memory is bounded by the number of nodes times
    their GPUs.
    """

    def __init__(self, catalog: Catalog | None = None) -> None:
        self.catalog = catalog or Catalog.configured()
        self._fallen_code = self.catalog.signal_xid("gpu_fallen_off_bus")
        self._nodes: dict[str, _NodeState] = {}

    # -- public API -------------------------------------------------------------------------------

    def process(self, record: LogRecord) -> list[FaultEvent]:
        """Fault events recognised in one record (kernel, pod or probe source)."""
        return [event for _, event in self._process(record, 0)]

    def flush(self, node: str | None = None) -> list[FaultEvent]:
        """Emit what is held for folding (one node, or all) and forget the pending folds."""
        return [event for _, event in self._flush(node)]

    def gpu_uuid(self, node: str, pci: str) -> str | None:
        """The GPU UUID the node's kernel log mapped to ``pci`` (any spelling), if seen."""
        state = self._nodes.get(node)
        normalized = normalize_pci(pci)
        return state.uuid_by_pci.get(normalized) if state and normalized else None

    def forget(self, node: str) -> None:
        """Drop a node's state (e.g. after it rebooted: its UUID map may be stale)."""
        self._nodes.pop(node, None)

    # -- internals (seq = caller's line number, carried to classify_lines) ------------------------

    def _state(self, node: str) -> _NodeState:
        state = self._nodes.get(node)
        if state is None:
            state = self._nodes[node] = _NodeState()
        return state

    def _process(self, record: LogRecord, seq: int) -> list[tuple[int, FaultEvent]]:
        source = record.source
        if source == _PROBE:
            return self._probe(record, seq)
        text = record.line
        out: list[tuple[int, FaultEvent]] = []
        if source == _POD:
            lines = text.split("\n") if "\n" in text else (text,)
            for offset, line in enumerate(lines):
                if pod_anchor(line):
                    self._pod_line(record, line, offset, seq, out)
            return out
        for offset, line in enumerate(record_lines(text)):
            if kernel_prefilter(line):
                self._kernel_line(record, line, offset, seq, out)
        return out

    def _flush(self, node: str | None) -> list[tuple[int, FaultEvent]]:
        names = list(self._nodes) if node is None else [node]
        out: list[tuple[int, FaultEvent]] = []
        for name in names:
            state = self._nodes.get(name)
            if state is None or state.pending is None:
                continue
            pending, state.pending = state.pending, None
            if pending.confirmed:
                self._emit_fallen(state, pending, None, out)
        return out

    # -- kernel -----------------------------------------------------------------------------------

    def _kernel_line(
        self, record: LogRecord, line: str, offset: int, seq: int, out: list[tuple[int, FaultEvent]]
    ) -> None:
        parsed = parse_kernel_line(line)
        if parsed is None:
            return
        state = self._state(record.node)
        state.tick += 1
        pending = state.pending
        if pending is not None and state.tick - pending.tick > FOLD_MAX_LINES:
            state.pending = None
            if pending.confirmed:
                self._emit_fallen(state, pending, None, out)
            pending = None

        if isinstance(parsed, XidLine):
            self._xid(record, line, offset, seq, parsed, state, out)
        elif isinstance(parsed, SXidLine):
            self._sxid(record, line, offset, seq, parsed, state, out)
        elif isinstance(parsed, GpuUuidLine):
            state.uuid_by_pci[parsed.pci] = parsed.uuid
        elif isinstance(parsed, FallenOffBusLine):
            self._fallen_part(record, line, offset, seq, parsed, state, out)
        elif isinstance(parsed, NcclSegfaultLine):
            cls = self.catalog.signal("nccl_segfault")
            detail = {"library": parsed.library, "address": parsed.address}
            out.append(
                (seq, self._event(record, line, offset, FaultKind.KERNEL_SEGFAULT, cls, pid=parsed.pid,
                                  process=parsed.process, detail=detail))
            )

    def _xid(
        self, record: LogRecord, line: str, offset: int, seq: int, parsed: XidLine, state: _NodeState,
        out: list[tuple[int, FaultEvent]],
    ) -> None:
        code = parsed.code
        workflow = self.catalog.workflow(code)
        if workflow == "nvlink5":
            cls = self.catalog.nvlink5(code, parsed.fatal, parsed.subcode)
        elif workflow == "recovery_action":
            # Act on the recovery-action number; an unreadable number is treated as unknown.
            cls = self.catalog.recovery_action(parsed.subcode if parsed.subcode is not None else -1)
        else:
            cls = self.catalog.xid(code)
        pci = parsed.pci
        if workflow == "gpu_lost" and pci is not None:
            state.lost[pci] = (state.tick, record.ts)
        detail = dict(parsed.detail)
        if parsed.message:
            detail["message"] = parsed.message
        if not cls.known:
            detail["unknown_code"] = True
        out.append(
            (seq, self._event(
                record, line, offset, FaultKind.XID, cls, code=code, subcode=parsed.subcode, pci=pci,
                gpu_uuid=state.uuid_by_pci.get(pci) if pci else None, link=parsed.link,
                fatal=parsed.fatal, gpu_instance=parsed.gpu_instance, compute_instance=parsed.compute_instance,
                pid=parsed.pid, process=parsed.process, detail=detail,
            ))
        )

    def _sxid(
        self, record: LogRecord, line: str, offset: int, seq: int, parsed: SXidLine, state: _NodeState,
        out: list[tuple[int, FaultEvent]],
    ) -> None:
        key = (parsed.pci, parsed.code)
        if parsed.continuation:
            return  # "Severity ..." / "Data {...}" lines belong to the SXid printed just before
        if parsed.reporter is Reporter.DRIVER:
            if not parsed.header and state.last_sxid == key:
                return  # further unflagged lines of the same error (e.g. "SOE HALT data[0] = ...")
            state.last_sxid = key
        cls = self.catalog.sxid(parsed.code, parsed.fatal)
        detail: dict[str, object] = dict(parsed.detail)
        if parsed.physical_id is not None:
            detail["physical_id"] = parsed.physical_id
        if parsed.message:
            detail["message"] = parsed.message
        if not cls.known:
            detail["unknown_code"] = True
        # Both reports of one fault (the driver's line, Fabric Manager's) are emitted, each with the id of its own
        # line: the aggregation folds them into one incident (same signature) and counts the fault once.
        out.append(
            (seq, self._event(
                record, line, offset, FaultKind.SXID, cls, code=parsed.code, pci=parsed.pci,
                nvswitch=parsed.nvswitch, link=parsed.link, fatal=cls.fatal, reporter=parsed.reporter,
                detail=detail,
            ))
        )

    def _fallen_part(
        self, record: LogRecord, line: str, offset: int, seq: int, parsed: FallenOffBusLine,
        state: _NodeState, out: list[tuple[int, FaultEvent]],
    ) -> None:
        part = parsed.part
        if part == 0:
            single = _PendingFallen(record, offset, seq, state.tick, parsed.pci, None, [line], True)
            self._emit_fallen(state, single, None, out)
        elif part == 1:
            previous = state.pending
            if previous is not None and previous.confirmed:
                self._emit_fallen(state, previous, None, out)
            state.pending = _PendingFallen(record, offset, seq, state.tick, parsed.pci, parsed.pci_id, [line])
        elif part == 2:
            pending = state.pending
            if pending is None:
                return
            if not parsed.confirms:
                state.pending = None  # "installed in this system is not supported": not a fault
                return
            pending.confirmed = True
            pending.pci_id = pending.pci_id or parsed.pci_id
            pending.lines.append(line)
        else:
            pending, state.pending = state.pending, None
            if pending is None:
                # Only the last line reached us: still one fault, address unknown.
                pending = _PendingFallen(record, offset, seq, state.tick, None, None, [])
            self._emit_fallen(state, pending, line, out)

    def _emit_fallen(
        self, state: _NodeState, pending: _PendingFallen, last_line: str | None,
        out: list[tuple[int, FaultEvent]],
    ) -> None:
        pci = pending.pci
        record = pending.record
        if pci is not None:
            seen = state.lost.get(pci)
            state.lost[pci] = (state.tick, record.ts)
            if (
                seen is not None
                and state.tick - seen[0] <= DEDUP_LINES
                and abs(record.ts - seen[1]) <= DEDUP_WINDOW
            ):
                return  # the Xid 79 (or the other form of this message) already reported it
        lines = pending.lines + ([last_line] if last_line is not None else [])
        detail: dict[str, object] = {"lines": len(lines)}
        if pending.pci_id:
            detail["pci_id"] = pending.pci_id
        cls = self.catalog.signal("gpu_fallen_off_bus")
        first_line = lines[0]
        event = self._event(
            record, first_line, pending.offset, FaultKind.GPU_FALLEN_OFF_BUS, cls, code=self._fallen_code, pci=pci,
            gpu_uuid=state.uuid_by_pci.get(pci) if pci else None, detail=detail,
        )
        if len(lines) > 1:
            event.line = "\n".join(lines)
        out.append((pending.seq, event))

    # -- pod and probe ----------------------------------------------------------------------------

    def _pod_line(
        self, record: LogRecord, line: str, offset: int, seq: int, out: list[tuple[int, FaultEvent]]
    ) -> None:
        signal = match_pod_signal(line)
        if signal is None:
            return
        cls = self.catalog.signal(f"pod_{signal.grade.value}")
        detail: dict[str, object] = {"matched": signal.matched}
        if signal.cuda_error is not None:
            detail.update(cuda_error=signal.cuda_error, cuda_error_code=signal.cuda_error_code)
        out.append(
            (seq, self._event(
                record, line, offset, FaultKind.POD_ERROR, cls, grade=signal.grade,
                name=signal.name, detail=detail,
            ))
        )

    def _probe(self, record: LogRecord, seq: int) -> list[tuple[int, FaultEvent]]:
        result = parse_health_check(record.line)
        if result is None or result.passed:
            return []
        cls = self.catalog.health_check(result.check, result.values)
        severity = max(cls.severity, result.severity, key=lambda s: s.rank)
        detail = {"check": result.check, "message": result.message, "values": result.values}
        if result.gpu_index is not None:
            detail["gpu_index"] = result.gpu_index
        pci = normalize_pci(result.pci) if result.pci else None
        event = self._event(
            record, record.line, 0, FaultKind.HEALTH_CHECK, cls, pci=pci, gpu_uuid=result.gpu_uuid,
            detail=detail, severity=severity, boot_id=result.boot_id or record.boot_id,
        )
        return [(seq, event)]

    # -- event construction -----------------------------------------------------------------------

    @staticmethod
    def _event(
        record: LogRecord, line: str, offset: int, kind: FaultKind, cls: Classification, *,
        severity: Severity | None = None, name: str | None = None, boot_id: str | None = None,
        **fields: object,
    ) -> FaultEvent:
        return FaultEvent(
            id=stable_id(record.node, record.source.value, record.replay_key or record.ts.isoformat(), line, offset),
            node=record.node,
            kind=kind,
            source=record.source,
            action=cls.action,
            severity=severity or cls.severity,
            sticky=cls.sticky,
            name=name or cls.name,
            ts=record.ts,
            line=line,
            namespace=record.namespace,
            pod=record.pod,
            container=record.container,
            boot_id=boot_id or record.boot_id,
            **fields,
        )


_CLASSIFY_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def classify_lines(
    lines: Iterable[str], source: str = "kernel", node: str = "local", catalog: Catalog | None = None
) -> Iterator[tuple[int, FaultEvent]]:
    """Classify a sequence of lines (a file); yields ``(line_no, event)``, 1-based line where it begins.

    Lines carry no timestamps here: line N is given the time epoch + N ms so ids stay deterministic
    and distinct. Events held for folding are emitted at the end of input.
    """
    src = Source(source)
    detector = Detector(catalog)
    for number, raw in enumerate(lines, start=1):
        line = raw.rstrip("\r\n")
        if not prefilter(line, src):
            continue
        record = LogRecord(node=node, source=src, ts=_CLASSIFY_EPOCH + timedelta(milliseconds=number), line=line)
        yield from detector._process(record, number)
    yield from detector._flush(None)
