"""What the API server itself did in a bench window: its own ``/metrics`` read before and after.

A burst's time is bounded by the API server's CPU on this machine, so the profile that explains the gap
between the pipeline and a bare client is a count of the requests each made the API server serve
(``apiserver_request_total`` by verb, resource and subresource), the watch events it sent
(``apiserver_watch_events_total`` by kind) and its own time per request kind
(``apiserver_request_duration_seconds_sum``). New TCP connections to its port (each a TLS handshake)
are counted from ``/proc/net/tcp``: the API server exposes no counter for them.

The parsers and the differences are pure; ``scrape`` and ``connections`` do the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_REQUESTS = "apiserver_request_total"
_DURATION = "apiserver_request_duration_seconds_sum"
_WATCH = "apiserver_watch_events_total"
_WATCH_BYTES = "apiserver_watch_events_sizes_sum"
_PREFIXES = ("apiserver_request_total", "apiserver_request_duration_seconds_sum", "apiserver_watch_events_")


@dataclass(frozen=True)
class Snapshot:
    requests: dict[str, float] = field(default_factory=dict)
    """``VERB resource[/subresource]`` -> requests served so far (every response code)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """the same keys -> the API server's summed request duration so far"""
    watch_events: dict[str, float] = field(default_factory=dict)
    """kind -> watch events sent so far"""
    watch_bytes: dict[str, float] = field(default_factory=dict)
    """kind -> their summed size in bytes. A mean over every watcher, whatever its encoding (the bench's and the
    actuators' watches read JSON; a watcher of the whole fleet that also saw the bare client's nodes is likely
    a protobuf one): compare windows with the same watchers only; ``burst.node_bytes`` gives a Node's JSON size."""
    sockets: frozenset[int] = frozenset()
    """inodes of the TCP connections to the API server's port open at the reading (``connections``)"""
    conflicts: dict[str, float] = field(default_factory=dict)
    """``VERB resource[/subresource]`` -> requests answered 409 Conflict so far (a precondition that failed)"""


def _key(labels: dict[str, str]) -> str:
    sub = labels.get("subresource", "")
    return f"{labels.get('verb', '?')} {labels.get('resource', '?')}{'/' + sub if sub else ''}"


def parse(text: str, sockets: frozenset[int] = frozenset()) -> Snapshot:
    """A ``Snapshot`` of the families this module reads from a Prometheus text exposition. Pure.

    Only those families' lines go to prometheus-client's parser: the API server's whole exposition (every
    histogram bucket of every request kind) is tens of thousands of lines the profile does not read.
    """
    from prometheus_client.parser import text_string_to_metric_families

    wanted = "\n".join(line for line in text.splitlines() if line.startswith(_PREFIXES))
    requests: dict[str, float] = {}
    seconds: dict[str, float] = {}
    watch: dict[str, float] = {}
    watch_bytes: dict[str, float] = {}
    conflicts: dict[str, float] = {}
    targets = {_REQUESTS: requests, _DURATION: seconds, _WATCH: watch, _WATCH_BYTES: watch_bytes}
    for family in text_string_to_metric_families(wanted):
        for sample in family.samples:
            target = targets.get(sample.name)
            if target is None:
                continue
            if target is watch or target is watch_bytes:
                k = sample.labels.get("kind") or sample.labels.get("resource", "?")
            else:
                k = _key(sample.labels)
            target[k] = target.get(k, 0) + sample.value
            if target is requests and sample.labels.get("code") == "409":
                conflicts[k] = conflicts.get(k, 0) + sample.value
    return Snapshot(requests, seconds, watch, watch_bytes, sockets, conflicts)


def delta(before: Snapshot, after: Snapshot, nodes: int) -> dict[str, Any]:
    """What the API server did between two snapshots, for a window that wrote ``nodes`` nodes. Pure.

    ``requests``: ``VERB resource`` -> count (zeros left out); ``per_node``: the same / ``nodes``;
    ``request_s``: its summed request time per kind (watches' long-running time left out);
    ``watch_events``: kind -> events sent, ``watch_event_bytes``: kind -> their mean size;
    ``new_connections``: TCP connections to it opened meanwhile
    (still open at the second reading; a connection opened and closed between the readings is missed);
    ``conflicts``: the requests of each kind answered 409 (a write whose precondition failed, and was resent).
    """

    def diff(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
        return {k: round(v - a.get(k, 0), 3) for k, v in sorted(b.items()) if v - a.get(k, 0) > 0}

    requests = {k: int(v) for k, v in diff(before.requests, after.requests).items()}
    seconds = {k: v for k, v in diff(before.seconds, after.seconds).items() if not k.startswith("WATCH")}
    events = {k: int(v) for k, v in diff(before.watch_events, after.watch_events).items()}
    return {
        "requests": requests,
        "per_node": {k: round(v / nodes, 2) for k, v in requests.items()} if nodes else {},
        "requests_total": sum(requests.values()),
        "request_s": {k: round(v, 2) for k, v in seconds.items()},
        "watch_events": events,
        "watch_event_bytes": {k: round(v / events[k]) for k, v in diff(before.watch_bytes, after.watch_bytes).items()
                              if events.get(k)},
        "new_connections": len(after.sockets - before.sockets),
        "conflicts": {k: int(v) for k, v in diff(before.conflicts, after.conflicts).items()},
    }


def parse_tcp(text: str, port: int) -> frozenset[int]:
    """Inodes of the established TCP connections to ``port`` in a ``/proc/net/tcp[6]`` table. Pure."""
    out: set[int] = set()
    for line in text.splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10 or cols[3] != "01":  # 01: ESTABLISHED
            continue
        remote_port = int(cols[2].rsplit(":", 1)[1], 16)
        if remote_port == port:
            out.add(int(cols[9]))
    return frozenset(out)


def connections(port: int) -> frozenset[int]:
    """The client ends of the established TCP connections to ``port`` on this host, as socket inodes."""
    found: frozenset[int] = frozenset()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                found |= parse_tcp(f.read(), port)
        except OSError:
            continue
    return found


async def scrape(kube: Any) -> Snapshot:
    """The API server's ``/metrics`` through ``kube`` (a ``Kube``: its credentials), and its open connections."""
    from urllib.parse import urlparse

    text = await kube.raw_get("/metrics")
    port = urlparse(kube.api_client.configuration.host).port or 443
    return parse(text.decode(), connections(port))
