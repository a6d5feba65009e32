"""Kernel records as shippers hand them over: escapes decoded, one record split into its lines.

``/dev/kmsg`` escapes every non-printable byte and the backslash itself as ``\\xNN``
(``Documentation/ABI/testing/dev-kmsg``). A printk with embedded newlines -- NVIDIA's three-line
"fallen off the bus" message is one -- therefore reaches a kmsg reader (Fluent Bit's ``kmsg`` input,
``cat /dev/kmsg``) as ONE record with literal ``\\x0a`` in it. rsyslog writes the same newline as
``#012`` (its control-character escape), journald and ``dmesg`` as a real newline. Every form is
turned back into separate lines here, so the parsers see what the driver printed.

Pure functions, no state.
"""

from __future__ import annotations

import re

_KMSG_ESCAPE_RE = re.compile(r"\\x([0-9a-fA-F]{2})")
# rsyslog's $EscapeControlCharactersOnReceive writes a newline as "#012" (octal).
_RSYSLOG_NEWLINE = "#012"


def _unescape(match: re.Match[str]) -> str:
    return chr(int(match.group(1), 16))


def decode_kmsg_escapes(text: str) -> str:
    """``\\xNN`` escapes of a ``/dev/kmsg`` record decoded (``\\x0a`` -> newline, ``\\x5c`` -> ``\\``).

    Text without a backslash is returned as is (the common case costs one substring scan).
    """
    if "\\x" not in text:
        return text
    return _KMSG_ESCAPE_RE.sub(_unescape, text)


def record_lines(text: str) -> list[str]:
    """The lines one kernel record holds, whatever form its embedded newlines took.

    Decodes kmsg ``\\xNN`` escapes and rsyslog's ``#012``, then splits on newlines. A record without
    any of them is one line.
    """
    if "\\x" in text:
        text = decode_kmsg_escapes(text)
    if _RSYSLOG_NEWLINE in text:
        text = text.replace(_RSYSLOG_NEWLINE, "\n")
    if "\n" in text or "\r" in text:
        return text.splitlines()
    return [text]
