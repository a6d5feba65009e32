"""docs/log-forms.md is a contract: every kernel prefix form it lists composes with every Xid/SXid message form
it lists, every Fabric Manager prefix with every Fabric Manager message form (the prefix changes nothing in what
is parsed), and every pod example is the signal its row names. Hypothesis varies each prefix form (stamps, hosts,
facilities, levels, caller ids) beyond the documented example.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.ingest.parsing.common import DMESG_FACILITIES, DMESG_LEVELS
from pipeline.ingest.parsing.kernel import SXidLine, parse_kernel_line
from pipeline.ingest.parsing.pod import match_pod_signal

DOC = Path(__file__).resolve().parents[2] / "docs" / "log-forms.md"
NOTHING = "(nothing)"


def doc_tables() -> dict[tuple[str, str], list[tuple[str, str]]]:
    """Each table of the doc as (section, first column's header) -> [(first cell, example)]."""
    tables: dict[tuple[str, str], list[tuple[str, str]]] = {}
    section, header = "", None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section, header = line[3:].strip(), None
            continue
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells[0]
            tables[(section, header)] = []
        elif not set(cells[0]) <= {"-"}:
            example = cells[1]
            example = "" if example == NOTHING else re.fullmatch(r"`(.*)`", example, re.S).group(1)  # type: ignore[union-attr]
            tables[(section, header)].append((cells[0], example))
    return tables


TABLES = doc_tables()
KERNEL_PREFIXES = dict(TABLES[("Kernel line prefixes", "prefix form")])
KERNEL_MESSAGES = dict(TABLES[("Kernel message forms", "message form")])
FM_PREFIXES = dict(TABLES[("Fabric Manager's log", "prefix form")])
FM_MESSAGES = dict(TABLES[("Fabric Manager's log", "message form")])
POD_EXAMPLES = TABLES[("Pod lines: the CUDA errors of a job whose GPU is gone", "signal")]


def test_the_doc_lists_the_forms() -> None:
    assert len(KERNEL_PREFIXES) >= 20 and len(KERNEL_MESSAGES) >= 10
    assert any("GPU-CI:" in m for m in KERNEL_MESSAGES.values()) and any("dmesg -x" in f for f in KERNEL_PREFIXES)
    assert len(FM_PREFIXES) >= 4 and len(FM_MESSAGES) >= 3 and len(POD_EXAMPLES) >= 6


@pytest.mark.parametrize("form", list(KERNEL_PREFIXES))
@pytest.mark.parametrize("message", list(KERNEL_MESSAGES))
def test_every_kernel_prefix_composes_with_every_message_form(form: str, message: str) -> None:
    text = KERNEL_MESSAGES[message]
    alone = parse_kernel_line(text)
    assert alone is not None, f"the doc's {message!r} example is not recognised"
    assert parse_kernel_line(KERNEL_PREFIXES[form] + text) == alone


@pytest.mark.parametrize("form", list(FM_PREFIXES))
@pytest.mark.parametrize("message", list(FM_MESSAGES))
def test_every_fabric_manager_prefix_composes_with_every_report_form(form: str, message: str) -> None:
    text = FM_MESSAGES[message]
    alone = parse_kernel_line(text)
    assert isinstance(alone, SXidLine) and alone.reporter == "fabric_manager"
    assert parse_kernel_line(FM_PREFIXES[form] + text) == alone


@pytest.mark.parametrize(("signal", "line"), POD_EXAMPLES)
def test_every_pod_example_is_its_signal(signal: str, line: str) -> None:
    found = match_pod_signal(line)
    assert found is not None and found.name == signal and found.cuda_error is not None


# -- each form, varied ------------------------------------------------------------------------------------------
_host = st.from_regex(r"[a-z][a-z0-9-]{0,14}(\.[a-z0-9]{1,6}){0,2}", fullmatch=True)
_when = st.datetimes(min_value=datetime(2001, 1, 1), max_value=datetime(2099, 1, 1))
_zone = st.integers(-12 * 60, 14 * 60).map(lambda m: timezone(timedelta(minutes=m)))
_uptime = st.floats(min_value=0, max_value=9_999_999, allow_nan=False).map(lambda f: f"[{f:12.6f}] ")
_caller = st.integers(0, 99_999).map(lambda n: f"[{'T' + str(n):>6}] ")
_seq = st.tuples(st.integers(0, 7), st.integers(0, 10**9), st.integers(0, 10**12))
_decode = st.tuples(st.sampled_from(DMESG_FACILITIES), st.sampled_from(DMESG_LEVELS)).map(
    lambda fl: f"{fl[0]:<6}:{fl[1]:<6}: ")
_talos_level = st.sampled_from(["emerg", "alert", "crit", "err", "warning", "notice", "info", "debug"])


def _ctime(d: datetime) -> str:
    return f"[{d:%a %b} {d.day:>2} {d:%H:%M:%S %Y}] "


def _syslog(d: datetime) -> str:
    return f"{d:%b} {d.day:>2} {d:%H:%M:%S}"


def _iso(d: datetime, sep: str = ".") -> str:
    return d.isoformat(timespec="microseconds").replace(".", sep)


KERNEL_FORMS: dict[str, st.SearchStrategy[str]] = {
    "none (kmsg `msg`, journald `MESSAGE`)": st.just(""),
    "dmesg": _uptime,
    "dmesg -T": _when.map(_ctime),
    "dmesg --time-format iso": st.tuples(_when, _zone).map(lambda t: _iso(t[0].replace(tzinfo=t[1]), ",") + " "),
    "dmesg -x (--decode)": st.tuples(st.sampled_from(DMESG_LEVELS), _uptime).map(lambda t: f"kern  :{t[0]:<6}: {t[1]}"),
    "dmesg -x, the driver's line re-logged by an agent under another facility":
        st.tuples(_decode, _uptime).map("".join),
    "dmesg -x -T with the printk caller": st.tuples(_decode, _when.map(_ctime), _caller).map("".join),
    "/dev/kmsg record": _seq.map(lambda s: f"{s[0]},{s[1]},{s[2]},-;"),
    "/dev/kmsg record with the printk caller": st.tuples(_seq, st.integers(0, 99_999)).map(
        lambda t: f"{t[0][0]},{t[0][1]},{t[0][2]},-,caller=T{t[1]};"),
    "syslog (RFC 3164)": st.tuples(_when, _host).map(lambda t: f"{_syslog(t[0])} {t[1]} kernel: "),
    "syslog with the kernel's stamp": st.tuples(_when, _host, _uptime).map(
        lambda t: f"{_syslog(t[0])} {t[1]} kernel: {t[2]}"),
    "rsyslog RFC 3339": st.tuples(_when, _zone, _host).map(
        lambda t: f"{_iso(t[0].replace(tzinfo=t[1]))} {t[2]} kernel: "),
    "RFC 5424": st.tuples(st.integers(0, 191), _when, _host).map(
        lambda t: f"<{t[0]}>1 {t[1]:%Y-%m-%dT%H:%M:%S}.123Z {t[2]} kernel - - - "),
    "RFC 5424 with structured data": st.tuples(_when, _host, st.sampled_from(["0", "1"])).map(
        lambda t: f'<4>1 {t[0]:%Y-%m-%dT%H:%M:%S}Z {t[1]} kernel - - [timeQuality tzKnown="{t[2]}"] '),
    "journalctl -k (short)": st.tuples(_when, _host).map(lambda t: f"{t[0]:%b %d %H:%M:%S} {t[1]} kernel: "),
    "journalctl -o short-iso": st.tuples(_when, _host).map(lambda t: f"{t[0]:%Y-%m-%dT%H:%M:%S}+0000 {t[1]} kernel: "),
    "journalctl -o short-precise": st.tuples(_when, _host).map(
        lambda t: f"{t[0]:%b %d %H:%M:%S.%f} {t[1]} kernel: "),
    "journalctl -o short-monotonic": st.tuples(_uptime, _host).map(lambda t: f"{t[0]}{t[1]} kernel: "),
    "journalctl -o short-full": st.tuples(_when, _host).map(
        lambda t: f"{t[0]:%a %Y-%m-%d %H:%M:%S} UTC {t[1]} kernel: "),
    "journalctl -o short-unix": st.tuples(st.integers(10**8, 4 * 10**9), _host).map(
        lambda t: f"{t[0]}.123456 {t[1]} kernel: "),
    "kernel tag alone": st.just("kernel: "),
    "Talos (talosctl dmesg)": st.tuples(_host, _talos_level, _when).map(
        lambda t: f"{t[0]}: kern: {t[1]:>7}: [{t[2]:%Y-%m-%dT%H:%M:%S}.505406921Z]: "),
    "Talos kernel log without the node": st.tuples(_talos_level, _when).map(
        lambda t: f"kern: {t[0]:>7}: [{t[1]:%Y-%m-%dT%H:%M:%S}Z]: "),
    "grep over a log file": st.tuples(st.sampled_from(["/var/log/kern.log", "/var/log/syslog.1", "kern.log"]),
                                      _when, _host).map(lambda t: f"{t[0]}:{_syslog(t[1])} {t[2]} kernel: "),
}
FM_FORMS: dict[str, st.SearchStrategy[str]] = {
    "none": st.just(""),
    "its own log file": st.tuples(_when, st.sampled_from(["ERROR", "WARNING", "INFO"]), st.integers(1, 10**7)).map(
        lambda t: f"[{t[0]:%b %d %Y %H:%M:%S}] [{t[1]}] [tid {t[2]}] "),
    "its log line after its time stamp is cut off": st.integers(1, 10**7).map(lambda n: f"[ERROR] [tid {n}] "),
    "syslog / journald": st.tuples(_when, _host, st.integers(1, 10**6)).map(
        lambda t: f"{_syslog(t[0])} {t[1]} nv-fabricmanager[{t[2]}]: "),
    "grep over its log file": st.sampled_from(["/var/log/fabricmanager.log:", "fabricmanager.log.1:42:"]),
}
VARIED = settings(max_examples=40)


def test_every_documented_form_is_varied_and_every_varied_form_documented() -> None:
    assert set(KERNEL_FORMS) == set(KERNEL_PREFIXES)
    assert set(FM_FORMS) == set(FM_PREFIXES)


VARIATIONS = [(form, strategy, KERNEL_MESSAGES) for form, strategy in KERNEL_FORMS.items()] + [
    (form, strategy, FM_MESSAGES) for form, strategy in FM_FORMS.items()]


@pytest.mark.parametrize(("form", "prefixes", "messages"), VARIATIONS, ids=[v[0] for v in VARIATIONS])
def test_each_prefix_form_varied_composes_with_every_message_form(
    form: str, prefixes: st.SearchStrategy[str], messages: dict[str, str]
) -> None:
    @VARIED
    @given(prefix=prefixes, message=st.sampled_from(list(messages.values())))
    def check(prefix: str, message: str) -> None:
        assert parse_kernel_line(prefix + message) == parse_kernel_line(message), prefix

    check()
