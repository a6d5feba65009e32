"""Record shapes of shippers other than Fluent Bit and Loki, as ``ShippedLine``s: pure, no I/O.

``pipeline.ingest.adapters`` dispatches here and turns each ``ShippedLine`` into a ``LogRecord`` (it owns
timestamps, node fallbacks and dead letters). Shapes, from each shipper's documentation:

- **OpenTelemetry Collector, Kafka exporter, ``encoding: otlp_json``** (the logs data model as an
  ``ExportLogsServiceRequest`` in protobuf JSON): ``{"resourceLogs": [{"resource": {"attributes":
  [{"key": "k8s.node.name", "value": {"stringValue": "n1"}}]}, "scopeLogs": [{"scope": {...},
  "logRecords": [{"timeUnixNano": "<ns>", "observedTimeUnixNano": "<ns>", "severityNumber": 9,
  "body": {"stringValue": "<line>"}, "attributes": [...]}]}]}]}``. The node is the resource (else
  record) attribute ``k8s.node.name``, else ``host.name``; ``k8s.pod.name``/``k8s.namespace.name``/
  ``k8s.container.name`` make it a pod line. A ``kvlistValue`` body (the journald receiver's) gives its
  ``MESSAGE`` (or ``message``/``log``).
- **Filebeat, Kafka output with its default ``codec.json``**: the event as ECS JSON: ``@timestamp``,
  ``@metadata`` (``beat``, ``type``, ``version``), ``message``, ``host`` *object* (``host.name``),
  ``agent``, ``ecs``, ``log`` *object* (``log.file.path``, ``log.offset``), ``input.type``; with
  ``add_kubernetes_metadata`` also ``kubernetes.node.name``/``pod.name``/``namespace``/
  ``container.name``.
- **rsyslog (omkafka) and other syslog text**: one line per record, with a syslog header in front of
  the message: ``RSYSLOG_FileFormat``/``ForwardFormat`` (RFC 3339 time, host, tag), the traditional
  formats (``Mmm dd hh:mm:ss host tag:``) and RFC 5424 (``<PRI>1 time host app procid msgid sd msg``).
  omkafka sends no key by default, so the host in the header is the node.
- **CRI container log lines sent raw** (rsyslog imfile or Vector's file source on ``/var/log/containers``):
  ``<RFC 3339 nano> <stdout|stderr> <F|P> <text>``, the kubelet's runtime's own format; ``P`` (partial)
  lines are joined up to the next ``F``. The line names no node: the Kafka key or header does; it is a pod
  line whatever topic it came on (a workload's output, never the kernel's).

Replays: ``kmsg_replay_key`` names a kernel ring-buffer line by what a replay repeats exactly (boot
id, sequence number, time since boot), not by its wall-clock time, which Fluent Bit's kmsg input
recomputes coarsely on every start.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

NODE_ATTRIBUTES: tuple[str, ...] = ("k8s.node.name", "host.name")
"""OTLP resource/record attributes naming the node, in order of preference."""


@dataclass(frozen=True, slots=True)
class ShippedLine:
    """One log line found in a shipper's record, before it becomes a ``LogRecord``."""

    line: Any  # the adapter rejects anything but a string, with a reason
    shipper: str
    node: str | None = None
    ts: Any = None  # raw: epoch numbers/strings or ISO 8601 (record_fields.parse_timestamp), or a datetime
    kernel: bool = False  # the record itself says it is a kernel line
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    boot_id: str | None = None


class ShapeError(ValueError):
    """The record has the shape's marker but not its structure; the message says where."""


# -- OpenTelemetry (OTLP JSON) -----------------------------------------------------------------------


def is_otlp_logs(obj: Mapping[str, Any]) -> bool:
    return "resourceLogs" in obj


def _any_value(value: Any) -> Any:
    """The Python value of an OTLP ``AnyValue`` (``{"stringValue": ...}`` etc.)."""
    if not isinstance(value, Mapping):
        return None
    for name in ("stringValue", "boolValue", "intValue", "doubleValue", "bytesValue"):
        if name in value:
            return value[name]
    if "kvlistValue" in value:
        kv = value["kvlistValue"]
        return _attributes(kv.get("values") if isinstance(kv, Mapping) else None)
    if "arrayValue" in value:
        arr = value["arrayValue"]
        values = arr.get("values") if isinstance(arr, Mapping) else None
        return [_any_value(v) for v in values] if isinstance(values, list) else []
    return None


def _attributes(raw: Any) -> dict[str, Any]:
    """``[{"key": k, "value": AnyValue}]`` -> ``{k: value}``; malformed items are skipped."""
    out: dict[str, Any] = {}
    if isinstance(raw, list):
        for item in raw:
            if isinstance(item, Mapping) and isinstance(item.get("key"), str):
                out[item["key"]] = _any_value(item.get("value"))
    return out


def _str(raw: Any) -> str | None:
    return raw if isinstance(raw, str) and raw.strip() else None


def _otlp_body(body: Any) -> Any:
    value = _any_value(body)
    if isinstance(value, dict):  # journald receiver: the body is the journal entry's fields
        for key in ("MESSAGE", "message", "log"):
            if key in value:
                return value[key]
    return value


def otlp_lines(obj: Mapping[str, Any]) -> list[ShippedLine | ShapeError]:
    """Every log record of an OTLP JSON logs request; structural problems as ``ShapeError``s in place."""
    resource_logs = obj.get("resourceLogs")
    if not isinstance(resource_logs, list):
        return [ShapeError("OTLP 'resourceLogs' is not a list")]
    out: list[ShippedLine | ShapeError] = []
    for i, rl in enumerate(resource_logs):
        if not isinstance(rl, Mapping) or not isinstance(rl.get("scopeLogs", []), list):
            out.append(ShapeError(f"OTLP resourceLogs[{i}] is not an object with a 'scopeLogs' list"))
            continue
        resource = rl.get("resource")
        res_attrs = _attributes(resource.get("attributes") if isinstance(resource, Mapping) else None)
        for j, sl in enumerate(rl.get("scopeLogs") or []):
            records = sl.get("logRecords") if isinstance(sl, Mapping) else None
            if not isinstance(records, list):
                out.append(ShapeError(f"OTLP resourceLogs[{i}].scopeLogs[{j}] has no 'logRecords' list"))
                continue
            for k, rec in enumerate(records):
                if not isinstance(rec, Mapping):
                    out.append(ShapeError(f"OTLP logRecords[{k}] of resourceLogs[{i}] is not an object"))
                    continue
                attrs = {**_attributes(rec.get("attributes")), **res_attrs}  # the resource wins
                node = next((_str(attrs.get(a)) for a in NODE_ATTRIBUTES if _str(attrs.get(a))), None)
                ts = rec.get("timeUnixNano")
                if ts in (None, "0", 0):
                    ts = rec.get("observedTimeUnixNano")
                out.append(
                    ShippedLine(
                        line=_otlp_body(rec.get("body")),
                        shipper="otel-collector",
                        node=node,
                        ts=ts if ts not in ("0", 0) else None,
                        kernel=attrs.get("syslog.identifier") == "kernel" or attrs.get("_TRANSPORT") == "kernel",
                        namespace=_str(attrs.get("k8s.namespace.name")),
                        pod=_str(attrs.get("k8s.pod.name")),
                        container=_str(attrs.get("k8s.container.name")),
                        boot_id=_str(attrs.get("host.boot.id")) or _str(attrs.get("_BOOT_ID")),
                    )
                )
    return out


# -- Filebeat (ECS JSON) --------------------------------------------------------------------------


def is_filebeat(obj: Mapping[str, Any]) -> bool:
    """Filebeat's JSON codec: ``@metadata.beat``, or an ECS event (``host`` object + ``message``)."""
    meta = obj.get("@metadata")
    if isinstance(meta, Mapping) and "beat" in meta:
        return True
    agent = obj.get("agent")
    if isinstance(agent, Mapping) and agent.get("type") == "filebeat":
        return True
    return isinstance(obj.get("host"), Mapping) and "message" in obj


def _path(obj: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)  # type: ignore[assignment]
    return obj


def filebeat_line(obj: Mapping[str, Any]) -> ShippedLine:
    kube = obj.get("kubernetes") if isinstance(obj.get("kubernetes"), Mapping) else {}
    node = (
        _str(_path(kube, "node", "name"))
        or _str(_path(obj, "host", "name"))
        or _str(_path(obj, "host", "hostname"))
    )
    namespace = kube.get("namespace")
    if isinstance(namespace, Mapping):  # newer add_kubernetes_metadata: kubernetes.namespace.name
        namespace = namespace.get("name")
    file_path = _path(obj, "log", "file", "path")
    identifier = _path(obj, "syslog", "identifier") or _path(obj, "process", "name")
    kernel = identifier == "kernel" or (isinstance(file_path, str) and ("kern" in file_path or "dmesg" in file_path))
    return ShippedLine(
        line=obj.get("message"),
        shipper="filebeat",
        node=node,
        ts=obj.get("@timestamp"),
        kernel=kernel,
        namespace=_str(namespace),
        pod=_str(_path(kube, "pod", "name")),
        container=_str(_path(kube, "container", "name")) or _str(_path(obj, "container", "name")),
        boot_id=_str(_path(obj, "host", "boot", "id")),
    )


# -- syslog text (rsyslog omkafka, syslog-ng, ...) ---------------------------------------------------

_MONTHS = {m: i for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct",
                                      "Nov", "Dec"), 1)}
# journalctl -o short-iso / short-iso-precise print the offset without a colon on older systemd ("%z"),
# -o short-precise adds microseconds to the traditional form, -o short-full (with --utc) writes
# "Thu 2024-07-04 11:09:40 UTC" (systemd logs-show.c). A named zone other than UTC is ambiguous: such a
# line is not taken as a syslog header (its record stays plain text, timed by Kafka).
_RFC3339 = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,9})?(?:Z|[+-]\d{2}:?\d{2})"
_BSD = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) [ \d]\d \d{2}:\d{2}:\d{2}(?:\.\d{1,6})?"
_FULL = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) \d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:\.\d{1,6})? UTC"
_HOST = r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}"
_SYSLOG = re.compile(
    rf"^(?:<(?P<pri>\d{{1,3}})>(?P<ver>1 )?)?(?P<ts>{_RFC3339}|{_BSD}|{_FULL}) (?P<host>{_HOST}) (?P<rest>.*)$"
)
# Talos Linux's kernel log (machined's Dmesg API and "kernel" service log: "%s: %7s: [%s]: %s", facility,
# priority, RFC 3339 time, text), with the "<node>: " talosctl puts in front. That node is the API endpoint as
# it was addressed (often an IP address), not the Kubernetes node name: the Kafka key or header names the node.
_TALOS = re.compile(
    rf"^(?:[\w.:\[\]-]+: )?(?P<facility>[a-z][a-z0-9]*): +[a-z]+: \[(?P<ts>{_RFC3339})\]: (?P<msg>.*)$"
)
_TAG = re.compile(r"^(?P<tag>[^\s:\[]{1,64})(?:\[\d+\])?: ?(?P<msg>.*)$")
_RFC5424_REST = re.compile(r"^(?P<app>\S+) \S+ \S+ (?:-|(?:\[(?:[^\]\\]|\\.)*\])+) ?(?P<msg>.*)$")
_FRACTION = re.compile(r"\.(\d+)")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_WEEKDAYS = frozenset(("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"))


@dataclass(frozen=True, slots=True)
class SyslogLine:
    ts: datetime
    host: str
    tag: str | None
    message: str


def _syslog_time(text: str, reference: datetime) -> datetime | None:
    if text[:3] in _WEEKDAYS:  # journalctl -o short-full --utc: "Thu 2024-07-04 11:09:40 UTC"
        text = text[4:-4].replace(" ", "T") + "+00:00"
    if text[:1].isdigit():
        # Python's fromisoformat takes at most 6 fractional digits; rsyslog writes up to 6, others 9.
        text = _FRACTION.sub(lambda m: "." + m.group(1)[:6].ljust(6, "0"), text, count=1)
        try:
            return datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            return None
    # Traditional timestamps have no year and no zone: the reference's year (the one before, when the
    # date would lie more than a day ahead, as on 1 January for a line of 31 December), UTC.
    month, day, clock = text.split()
    clock, _, fraction = clock.partition(".")  # journalctl -o short-precise: microseconds
    hh, mm, ss = (int(p) for p in clock.split(":"))
    try:
        ts = datetime(reference.year, _MONTHS[month], int(day), hh, mm, ss, int(fraction.ljust(6, "0")),
                      tzinfo=UTC)
        if (ts - reference).days >= 1:
            ts = ts.replace(year=reference.year - 1)
    except ValueError:
        return None
    return ts


def parse_syslog(line: str, reference: datetime) -> SyslogLine | None:
    """The header and message of one syslog-formatted line, or None when it has no syslog header."""
    m = _SYSLOG.match(line)
    if m is None:
        return None
    ts = _syslog_time(m.group("ts"), reference)
    if ts is None:
        return None
    rest = m.group("rest")
    tag: str | None = None
    if m.group("ver"):
        r = _RFC5424_REST.match(rest)
        if r is None:
            return None
        tag, rest = (None if r.group("app") == "-" else r.group("app")), r.group("msg")
    else:
        t = _TAG.match(rest)
        if t is not None:
            tag, rest = t.group("tag"), t.group("msg")
    return SyslogLine(ts=ts, host=m.group("host"), tag=tag, message=rest)


def parse_talos(line: str) -> tuple[datetime, bool, str] | None:
    """Time, kernel facility or not, and text of one Talos kernel-log line; None when it is not one."""
    m = _TALOS.match(line)
    if m is None:
        return None
    ts = _syslog_time(m.group("ts"), _EPOCH)
    if ts is None:
        return None
    kernel = m.group("facility") == "kern"
    # Another facility keeps its name in front, so its text is never taken for the kernel's own.
    return ts, kernel, m.group("msg") if kernel else f"{m.group('facility')}: {m.group('msg')}"


def syslog_lines(text: str, reference: datetime) -> list[ShippedLine] | None:
    """A text record whose every non-empty line has a syslog (or Talos) header, as lines; else None (plain text).

    Another program's tag stays in front of its text ("gpu-alerter: NVRM: ..."), as journalctl shows it, so a
    kernel line it quotes is not taken for the kernel's own (pipeline.ingest.parsing.common.prefix_is_kernel).
    """
    out: list[ShippedLine] = []
    for raw in text.splitlines():
        if not raw.strip():
            continue
        parsed = parse_syslog(raw, reference)
        if parsed is None:
            talos = parse_talos(raw)
            if talos is None:
                return None
            ts, kernel, message = talos
            out.append(ShippedLine(line=message, shipper="talos", ts=ts, kernel=kernel))
            continue
        kernel = parsed.tag == "kernel"
        line = parsed.message if kernel or parsed.tag is None else f"{parsed.tag}: {parsed.message}"
        out.append(ShippedLine(line=line, shipper="syslog", node=parsed.host, ts=parsed.ts, kernel=kernel))
    return out or None


# -- CRI container log lines (the runtime's file format, shipped raw) -------------------------------------

# "<RFC 3339 nano> <stream> <F|P>[:more tags] <text>" (kubelet/cri-api, pkg/kubelet/kuberuntime/logs). Its
# header looks like a syslog header ("<time> <host> <rest>"), so it is recognised first: otherwise the
# stream name would be taken for the node and the flag for the text.
_CRI = re.compile(rf"^(?P<ts>{_RFC3339}) (?:stdout|stderr) (?P<tag>[FP])(?::\S*)? ?(?P<msg>.*)$")


def cri_lines(text: str) -> list[ShippedLine] | None:
    """A text record whose every non-empty line is a CRI log line, as its full lines; else None."""
    out: list[ShippedLine] = []
    parts: list[str] = []
    ts: datetime | None = None
    for raw in text.splitlines():
        if not raw.strip():
            continue
        m = _CRI.match(raw)
        if m is None:
            return None
        ts = ts or _syslog_time(m.group("ts"), _EPOCH)
        parts.append(m.group("msg"))
        if m.group("tag") == "F":
            if line := "".join(parts):
                out.append(ShippedLine(line=line, shipper="cri", ts=ts))
            parts, ts = [], None
    if line := "".join(parts):  # a partial line whose end is in the next record: what there is of it
        out.append(ShippedLine(line=line, shipper="cri", ts=ts))
    return out if text.strip() else None  # lines that are all empty carry nothing to read


# -- kernel ring buffer replays ------------------------------------------------------------------------


def kmsg_replay_key(obj: Mapping[str, Any]) -> str | None:
    """What a replay of one kmsg record repeats exactly: boot id, sequence and time since boot.

    Fluent Bit's kmsg input keeps no cursor (it re-reads the whole ring buffer on start) and derives
    the wall-clock time from a boot time it computes to the second, so a replayed line can carry a
    timestamp one second off. The sequence number and the since-boot ``sec``/``usec`` come from the
    kernel and do not move; the boot id (added by the DaemonSet's Lua filter) separates boots, and
    the since-boot time does so too where the boot id is missing.
    """
    seq, sec, usec = obj.get("sequence"), obj.get("sec"), obj.get("usec")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (seq, sec, usec)):
        return None
    boot = obj.get("boot_id")
    return f"kmsg:{boot if isinstance(boot, str) else '-'}:{seq}:{sec}.{usec:06d}"
