"""The API server profile's pure parts: its /metrics text and /proc/net/tcp read into a window's counts."""

from pipeline.benchmarks.apimetrics import delta, parse, parse_tcp


def _line(name: str, verb: str, sub: str, value: float, code: str = "") -> str:
    labels = (f'code="{code}",' if code else "") + (
        f'component="apiserver",dry_run="",group="",resource="nodes",scope="resource",'
        f'subresource="{sub}",verb="{verb}",version="v1"'
    )
    return f"{name}{{{labels}}} {value}\n"


_BEFORE = (
    "# HELP apiserver_request_total [STABLE] Counter of apiserver requests\n"
    "# TYPE apiserver_request_total counter\n"
    + _line("apiserver_request_total", "PATCH", "", 10, "200")
    + _line("apiserver_request_total", "PATCH", "", 1, "409")
    + _line("apiserver_request_total", "PATCH", "status", 4, "200")
    + _line("apiserver_request_duration_seconds_sum", "PATCH", "", 0.5)
    + _line("apiserver_request_duration_seconds_count", "PATCH", "", 11)
    + 'apiserver_watch_events_total{group="",kind="Node",version="v1"} 100\n'
    + 'apiserver_watch_events_sizes_sum{group="",kind="Node",version="v1"} 300000\n'
)

_AFTER = _BEFORE.replace("} 10\n", "} 30\n").replace("} 0.5\n", "} 2.5\n").replace("} 100\n", "} 160\n").replace(
    "} 300000\n", "} 540000\n"
) + (
    'apiserver_request_total{code="201",component="apiserver",dry_run="",group="",resource="events",'
    'scope="resource",subresource="",verb="POST",version="v1"} 20\n'
)


def test_a_window_counts_requests_by_verb_and_resource_every_code_together_and_per_node() -> None:
    d = delta(parse(_BEFORE), parse(_AFTER), nodes=20)
    # The 409s did not change and the status patches neither: left out.
    assert d["requests"] == {"PATCH nodes": 20, "POST events": 20}
    assert d["per_node"] == {"PATCH nodes": 1.0, "POST events": 1.0}
    assert d["requests_total"] == 40
    assert d["request_s"] == {"PATCH nodes": 2.0}
    assert d["watch_events"] == {"Node": 60}
    assert d["watch_event_bytes"] == {"Node": 4000}


def test_subresources_are_their_own_kind_and_codes_add_up() -> None:
    snap = parse(_BEFORE)
    assert snap.requests == {"PATCH nodes": 11, "PATCH nodes/status": 4}


_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:A1B2 0100007F:1A0B 01 00000000:00000000 00:00000000 00000000  1000        0 111 1
   1: 0100007F:A1B3 0100007F:1A0B 06 00000000:00000000 00:00000000 00000000  1000        0 0 1
   2: 0100007F:1A0B 0100007F:A1B2 01 00000000:00000000 00:00000000 00000000  1000        0 222 1
   3: 0100007F:A1B4 0100007F:1A0B 01 00000000:00000000 00:00000000 00000000  1000        0 333 1
"""


def test_connections_are_the_established_client_ends_to_the_port_and_new_ones_are_counted() -> None:
    port = 0x1A0B
    # 1: TIME_WAIT; 2: the server's end (its remote port is the client's).
    assert parse_tcp(_TCP, port) == frozenset({111, 333})
    d = delta(parse("", frozenset({111})), parse("", frozenset({111, 333, 444})), nodes=1)
    assert d["new_connections"] == 2
