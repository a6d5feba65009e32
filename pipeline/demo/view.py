"""The demo's screen: the live fleet view and the final report, in kubectl's manner. Pure.

Plain data in (Node objects as the API server returns them, audit records, the verdicts), text out.
The tables are ``pipeline.commands.output``'s (what ``xidflow status`` prints, and its fault and age
cells): one line per row, upper-case headers, aligned columns, a cell never cut or wrapped, whatever
the width and when piped. Short state words (``Ready``, ``Quarantined``, ``Rebooting``, ``Standby``),
the fault as ``xid 79``, ids cut to 8 characters, ages as ``12s``/``3m``.

What does not fit the console's width is left out, never cut: the live view keeps the node and its
state and adds the other columns while they fit (all but the pod count fit 80 columns with the demo's
names); the details (what xidflow applied and why, incidents, boot ids, the kernel-line path, the last
action, the pods' names, the audit reasons) are the ``-o wide`` columns, printed after the run by
``xidflow demo --details``. Below the fleet, when the repair loop (docs/repair.md) touched any of its
nodes, their repair history as ``xidflow status NODE`` prints it (nothing when it touched none); then the
pods Kubernetes moved, as ``kubectl get pods`` would list them: where each evicted pod was, and where its
controller's new pod runs now.

A column is a ``Column`` in a list (``FLEET_COLUMNS``, ``REPAIR_COLUMNS``, ``MOVE_COLUMNS``,
``AUDIT_COLUMNS``) over rows that are plain mappings: another column is a field in the row and an entry in
the list.
The expectations are one line each, with the reason in a last column when every reason fits the
width, else wrapped at words on the lines below its expectations.
"""

from __future__ import annotations

import re
import textwrap
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rich.console import Console, ConsoleOptions, RenderResult
from rich.text import Text

from pipeline.actuator.nodeview import NodeView
from pipeline.actuator.ownership import REBOOT_REQUEST_ANNOTATION
from pipeline.commands.output import COLUMN_GAP, Column, age, joined, render_table
from pipeline.commands.status import HISTORY_COLUMNS, STATUS_COLUMNS, history_rows, node_rows

ID_CHARS = 8
SYSTEM_TAINT_PREFIX = "node.kubernetes.io/"
STATE_STYLES = {"Ready": "green", "Quarantined": "red", "Rebooting": "magenta", "Standby": "yellow",
                "Cordoned": "yellow", "NotReady": "red"}


def _status_cell(header: str) -> Callable[[Mapping[str, Any]], str]:
    """A cell of ``xidflow status``'s table: the demo shows the fault and the age as it does."""
    return next(c.cell for c in STATUS_COLUMNS if c.header == header)


def short_id(value: str | None) -> str:
    return (value or "")[:ID_CHARS] or "-"


_HEX_ID = re.compile(r"\b[0-9a-f]{16,}\b")
_LAST_ACTION = re.compile(r"^(?P<what>.*?) by (?P<who>\S+) at (?P<at>\S+)$")


def short_last_action(text: str | None, now: float) -> str:
    """``cordon+taint <32 hex> by actuator-0 at 2027-01-15T08:00:00Z`` -> ``cordon+taint 9f0e0c1d 12s ago``."""
    if not text:
        return "-"
    m = _LAST_ACTION.match(text)
    what, when = (m.group("what"), _epoch(m.group("at"))) if m else (text, None)
    what = _HEX_ID.sub(lambda h: h.group(0)[:ID_CHARS], what)
    return f"{what} {age(now - when)} ago" if when is not None else what


def _epoch(rfc3339: str) -> float | None:
    try:
        return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def node_state(view: NodeView, standby_label: str) -> str:
    """One word, as kubectl's STATUS: Rebooting, Quarantined, Standby (a cordoned warm standby), Ready, ..."""
    owned = bool(view.ledger.owned)
    if not view.ready:
        return "NotReady"
    if REBOOT_REQUEST_ANNOTATION in view.annotations:
        return "Rebooting"
    if view.unschedulable:
        if owned:
            return "Quarantined"
        return "Standby" if view.labels.get(standby_label) == "true" else "Cordoned"
    return "Ready"


def fleet_rows(nodes: Sequence[Mapping[str, Any]], *, standby_label: str, order: Sequence[str] = (),
               kernel_paths: Mapping[str, str] | None = None, pods: Mapping[str, Sequence[str]] | None = None,
               now: float | None = None) -> list[dict[str, Any]]:
    """``xidflow status``'s rows with what the demo adds: state word, taints, boot id, kernel-line path, and
    the workloads' pods running on the node (``pods``: node -> pod names)."""
    now = time.time() if now is None else now
    views = {v.name: v for v in map(NodeView.from_object, nodes)}
    rows = node_rows(list(nodes), now=now)
    for row in rows:
        view = views[row["node"]]
        row["state"] = node_state(view, standby_label)
        row["taints"] = [dict(t) for t in view.taints if not str(t.get("key", "")).startswith(SYSTEM_TAINT_PREFIX)]
        row["boot"] = view.boot_id[:ID_CHARS]
        row["kernel_path"] = (kernel_paths or {}).get(view.name, "")
        row["pods"] = list((pods or {}).get(view.name, ()))
        row["last_action_short"] = short_last_action(row["last_action"], now)
    rank = {name: i for i, name in enumerate(order)}
    return sorted(rows, key=lambda r: (rank.get(r["node"], len(rank)), r["node"]))


FLEET_COLUMNS = [
    Column("node", lambda r: r["node"]),
    Column("state", lambda r: r["state"]),
    Column("fault", _status_cell("fault")),
    Column("age", _status_cell("age")),
    Column("taints", lambda r: joined(sorted({t["key"] for t in r["taints"]}))),
    Column("pods", lambda r: str(len(r["pods"]))),
    Column("effects", _status_cell("effects"), wide_only=True),
    Column("why", _status_cell("why"), wide_only=True),
    Column("repair", _status_cell("repair"), wide_only=True),
    Column("incidents", lambda r: joined([short_id(i["id"]) for i in r["incidents"]]), wide_only=True),
    Column("boot", lambda r: r["boot"] or "-", wide_only=True),
    Column("lines-via", lambda r: r["kernel_path"] or "-", wide_only=True),
    Column("last-action", lambda r: r["last_action_short"], wide_only=True),
    Column("pod-names", lambda r: joined(r["pods"]), wide_only=True),
]
FLEET_REQUIRED = ("NODE", "STATE")


def move_rows(moves: Iterable[Any], now: float | None = None) -> list[dict[str, Any]]:
    """Pods that moved (``pipeline.demo.observed.Move``), in the order they left their nodes."""
    now = time.time() if now is None else now
    return [{
        "pod": m.pod or m.evicted,
        "evicted": m.evicted,
        "workload": f"{m.owner.lower() or 'pod'}/{m.workload}",
        "from": m.source,
        "to": m.target,
        "status": m.status,
        "age_seconds": now - m.left_at,
    } for m in moves]


MOVE_COLUMNS = [
    Column("pod", lambda r: r["pod"]),
    Column("from", lambda r: r["from"]),
    Column("to", lambda r: r["to"] or "-"),
    Column("status", lambda r: r["status"]),
    Column("age", lambda r: age(r["age_seconds"])),
    Column("controller", lambda r: r["workload"]),
    Column("replaces", lambda r: r["evicted"], wide_only=True),
]
MOVE_REQUIRED = ("POD", "FROM", "TO")
MOVES_HEADING = "pods moved by Kubernetes"


def audit_rows(records: Iterable[Any], now: float | None = None) -> list[dict[str, Any]]:
    """Audit records (``RemediationRecord``) as rows, oldest first."""
    now = time.time() if now is None else now
    return [{
        "age_seconds": now - rec.finished_at.timestamp(),
        "node": rec.node,
        "action": rec.action,
        "outcome": getattr(rec.outcome, "value", str(rec.outcome)),
        "incident": rec.incident_id,
        "reason": rec.reason,
    } for rec in records]


AUDIT_COLUMNS = [
    Column("age", lambda r: age(r["age_seconds"])),
    Column("node", lambda r: r["node"]),
    Column("action", lambda r: r["action"]),
    Column("outcome", lambda r: r["outcome"]),
    Column("incident", lambda r: short_id(r["incident"])),
    Column("reason", lambda r: r["reason"], wide_only=True),
]
AUDIT_REQUIRED = ("NODE", "ACTION", "OUTCOME")

REPAIR_COLUMNS = [Column("node", lambda r: r["node"]), *HISTORY_COLUMNS]
"""A node's repair history as ``xidflow status NODE`` prints it, with the node's name: the demo shows every node's."""
REPAIR_REQUIRED = ("NODE", "STAGE")
REPAIR_HEADING = "repair history (docs/repair.md)"


def repair_rows(fleet: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every step of every repair case of the fleet's nodes (``fleet_rows``), oldest first; empty when the repair
    loop touched none of them."""
    return sorted((h for row in fleet for h in history_rows(row)), key=lambda r: float(r["at"] or 0))


def fitted_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column], width: int,
                 required: Sequence[str]) -> list[str]:
    """The table's lines with the required columns and, in order, every other non-wide one that fits ``width``.

    A column that does not fit is left out whole; no cell is ever cut.
    """
    chosen = [c for c in columns if c.header.upper() in required]
    for col in columns:
        if col.wide_only or col in chosen:
            continue
        trial = [c for c in columns if c in chosen or c is col]
        if _width(_table(rows, trial)) <= width:
            chosen = trial
    return _table(rows, chosen)


def wide_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> list[str]:
    """Every column (``-o wide``), whatever the width."""
    return _table(rows, columns)


def _table(rows: Sequence[Mapping[str, Any]], columns: Sequence[Column]) -> list[str]:
    return render_table([c.header for c in columns], [[c.cell(r) for c in columns] for r in rows]).splitlines()


def _width(lines: Sequence[str]) -> int:
    return max((len(line) for line in lines), default=0)


# -- rich: lines chosen when drawn, for the width the console gives ------------------------------------
@dataclass
class Lines:
    """A renderable whose lines are made for the width it is drawn at; table lines are never wrapped."""

    make: Callable[[int], list[Text]]

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from self.make(options.max_width)


def _heading(text: str) -> Text:
    return Text(text, style="bold")  # prose: may wrap at words on a narrow console


def _table_text(lines: Sequence[str], style_row: Callable[[int, str, Text], None] | None = None) -> list[Text]:
    out = []
    for i, line in enumerate(lines):
        t = Text(line, no_wrap=True, overflow="ignore", style="bold" if i == 0 else "")
        if i and style_row:
            style_row(i - 1, line, t)
        out.append(t)
    return out


def _style_states(header: str) -> Callable[[int, str, Text], None]:
    start = _column_start(header, "STATE")

    def style(_: int, line: str, text: Text) -> None:
        if start is None:
            return
        word = line[start:].split(" ", 1)[0]
        if word in STATE_STYLES:
            text.stylize(STATE_STYLES[word], start, start + len(word))

    return style


def _column_start(header: str, name: str) -> int | None:
    m = re.search(rf"(^|{COLUMN_GAP}){name}(\s|$)", header)
    return None if m is None else m.start() + len(m.group(1))


@dataclass(frozen=True)
class Snapshot:
    """What the live view shows at one moment: plain data the runner gathers."""

    title: str
    nodes: Sequence[Mapping[str, Any]]  # Node objects in the API's JSON form
    standby_label: str
    order: Sequence[str] = ()
    kernel_paths: Mapping[str, str] = field(default_factory=dict)
    pods: Mapping[str, Sequence[str]] = field(default_factory=dict)  # node -> the workloads' pods running there
    moves: Sequence[Any] = ()  # pipeline.demo.observed.Move, in the order the pods left
    audit: Sequence[Any] = ()  # RemediationRecord, oldest first
    audit_count: int = 0
    audit_topic: str = ""
    audit_shown: int = 10
    now: float = field(default_factory=time.time)

    def fleet(self) -> list[dict[str, Any]]:
        return fleet_rows(self.nodes, standby_label=self.standby_label, order=self.order,
                          kernel_paths=self.kernel_paths, pods=self.pods, now=self.now)

    def moved(self) -> list[dict[str, Any]]:
        return move_rows(self.moves, self.now)

    def moves_heading(self) -> str:
        return (f"{MOVES_HEADING}: {len(self.moves)} (evicted by xidflow's drains, re-created by their "
                "controllers, placed by the scheduler, run by KWOK)")

    def audit_tail(self) -> list[dict[str, Any]]:
        return audit_rows(list(self.audit)[-self.audit_shown:], self.now)

    def audit_heading(self) -> str:
        return f"audit trail: {self.audit_count} records on {self.audit_topic}"


def live_view(snap: Snapshot) -> Lines:
    """The fleet, one line per node, the nodes' repair history when the repair loop touched any, the pods that
    moved and the latest audit records, fitted to the width."""
    fleet, moved, audit = snap.fleet(), snap.moved(), snap.audit_tail()
    repairs = repair_rows(fleet)

    def make(width: int) -> list[Text]:
        out = [_heading(snap.title)]
        if fleet:
            lines = fitted_table(fleet, FLEET_COLUMNS, width, FLEET_REQUIRED)
            out += _table_text(lines, _style_states(lines[0]))
        if repairs:
            out += [Text(""), _heading(REPAIR_HEADING), *_table_text(fitted_table(repairs, REPAIR_COLUMNS, width,
                                                                                  REPAIR_REQUIRED))]
        out += [Text(""), _heading(snap.moves_heading())]
        if moved:
            out += _table_text(fitted_table(moved, MOVE_COLUMNS, width, MOVE_REQUIRED))
        out += [Text(""), _heading(snap.audit_heading())]
        if audit:
            out += _table_text(fitted_table(audit, AUDIT_COLUMNS, width, AUDIT_REQUIRED))
        return out

    return Lines(make)


def details(snap: Snapshot) -> Lines:
    """The ``-o wide`` section: every column of the fleet and of the audit trail (reasons included).

    Lines may be longer than the console; print it with ``soft_wrap=True`` so that none is cut.
    """
    fleet, moved, audit = snap.fleet(), snap.moved(), snap.audit_tail()
    repairs = repair_rows(fleet)

    def make(_: int) -> list[Text]:
        lines = wide_table(fleet, FLEET_COLUMNS)
        out = [Text(""), _heading(f"{snap.title} (details)"), *_table_text(lines, _style_states(lines[0]))]
        if repairs:
            out += [Text(""), _heading(f"{REPAIR_HEADING} (details)"), *_table_text(wide_table(repairs,
                                                                                               REPAIR_COLUMNS))]
        out += [Text(""), _heading(f"{snap.moves_heading()} (details)")]
        if moved:
            out += _table_text(wide_table(moved, MOVE_COLUMNS))
        out += [Text(""), _heading(f"{snap.audit_heading()} (details)")]
        return out + _table_text(wide_table(audit, AUDIT_COLUMNS))

    return Lines(make)


# -- the final report ----------------------------------------------------------------------------------
REPORT_TITLE = "What happened and why"
_REPORT_COLUMNS = ["step", "node", "expected", "observed", "result"]


def report(verdicts: Sequence[Any]) -> Lines:
    """One line per expectation (``Verdict``: step, node, expected, observed, ok, why) and its reason.

    The reason of a run of expectations that share it is shown once: in a WHY column when every reason
    fits the width, else below the run, indented and wrapped at words (prose, never a cut name).
    """
    steps: dict[str, int] = {}
    rows = []
    for v in verdicts:
        n = steps.setdefault(v.step, len(steps) + 1)
        rows.append([str(n), v.node, v.expected, v.observed, "ok" if v.ok else "WRONG"])
    reasons = _reasons(verdicts)

    def make(width: int) -> list[Text]:
        table = render_table(_REPORT_COLUMNS, rows).splitlines()
        with_why = render_table([*_REPORT_COLUMNS, "why"], [[*r, reasons[i] or ""] for i, r in enumerate(rows)])
        if _width(with_why.splitlines()) <= width:
            lines = with_why.splitlines()
            return [Text(""), _heading(REPORT_TITLE), *_table_text(lines, _style_result(verdicts))]
        out = [Text(""), _heading(REPORT_TITLE), *_table_text(table[:1])]
        indent = " " * (_column_start(table[0], "NODE") or 4)
        for i, line in enumerate(table[1:]):
            out.append(Text(line, no_wrap=True, overflow="ignore", style="" if verdicts[i].ok else "red"))
            if _ends_run(reasons, i):
                out += [Text(w, style="dim") for w in textwrap.wrap(
                    _run_reason(reasons, i), max(20, width - len(indent)), initial_indent=indent,
                    subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)]
        return out

    return Lines(make)


def _reasons(verdicts: Sequence[Any]) -> list[str]:
    """Each expectation's reason, the step's title before the first reason of a step."""
    out, titled = [], set()
    for v in verdicts:
        why = v.why or ""
        if v.step not in titled:
            titled.add(v.step)
            why = f"{v.step}: {why}" if why else v.step
        out.append(why)
    # A run of expectations with the same reason shows it once: later ones refer to the first.
    for i in range(len(verdicts) - 1, 0, -1):
        if verdicts[i].step == verdicts[i - 1].step and (verdicts[i].why or "") == (verdicts[i - 1].why or ""):
            out[i] = ""
    return out


def _ends_run(reasons: Sequence[str], i: int) -> bool:
    """Row ``i`` is the last of a run of rows that share a reason (the next row has its own, or none follows)."""
    return bool(_run_reason(reasons, i)) and (i + 1 == len(reasons) or reasons[i + 1] != "")


def _run_reason(reasons: Sequence[str], i: int) -> str:
    while i > 0 and not reasons[i]:
        i -= 1
    return reasons[i]


def _style_result(verdicts: Sequence[Any]) -> Callable[[int, str, Text], None]:
    def style(i: int, _: str, text: Text) -> None:
        if i < len(verdicts) and not verdicts[i].ok:
            text.stylize("red")

    return style


def result_line(verdicts: Sequence[Any], audit_count: int, audit_topic: str) -> Text:
    ok = all(v.ok for v in verdicts)
    met = sum(1 for v in verdicts if v.ok)
    text = Text("demo passed" if ok else "demo failed", style="bold green" if ok else "bold red")
    text.append(f": {met}/{len(verdicts)} expectations met; {audit_count} audit records on {audit_topic}")
    return text
