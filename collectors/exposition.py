"""Pieces of the Prometheus text exposition format 0.0.4 that every scrape parser needs.

Source: Prometheus documentation, "Exposition formats" → "Text-based format": a sample line is
``metric_name [ "{" label_name "=" '"' label_value '"' { "," ... } [ "," ] "}" ] value
[ timestamp ]``; label values escape backslash (``\\\\``), double quote (``\\"``) and line feed
(``\\n``); ``value`` is a Go ``ParseFloat`` float (``NaN``, ``+Inf``, ``-Inf`` included);
``timestamp`` is an ``int64`` of milliseconds since the epoch. Blanks may separate tokens,
which is why dcgm-exporter's ``gpu="0", UUID="..."`` (comma then space) is valid.

Everything here raises :class:`ExpositionError` with a short ``reason`` (a Prometheus label
value for the rejection counters) and never anything else.
"""

from __future__ import annotations

import re
from typing import NoReturn

_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
_ESCAPES = {"n": "\n", "\\": "\\", '"': '"'}
METRIC_TYPES = frozenset({"counter", "gauge", "histogram", "summary", "untyped"})
"""Metric types a ``# TYPE`` line may declare."""


class ExpositionError(ValueError):
    """A malformed piece of exposition text.

    Attributes:
        reason: short snake_case cause (``bad_labels``, ``bad_value``, ``bad_timestamp``...).
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


_LABEL_PAIR = re.compile(
    r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"([^"\\]*(?:\\.[^"\\]*)*)"[ \t]*(?:,|\Z)', re.DOTALL
)
"""One ``name="value"`` pair with its separator (a comma, or the end of the label text)."""


def parse_labels(text: str) -> dict[str, str]:
    """Parse the inside of ``{...}`` into ``{name: value}`` with escapes resolved.

    Blanks around names, ``=`` and commas are allowed, as is one trailing comma. An unknown
    escape (``\\t``) is kept literally, as prometheus_client does.

    Raises:
        ExpositionError: ``bad_labels`` for a missing ``=`` or quote, an unterminated value, a
            bad label name or text after a value; ``duplicate_label`` for a repeated name.
    """
    out: dict[str, str] = {}
    pos = 0
    n = len(text)
    match = _LABEL_PAIR.match
    while pos < n:
        m = match(text, pos)
        if m is None:
            if not text[pos:].strip(" \t"):
                break  # blanks after a trailing comma
            _explain_bad_labels(text, pos)
        name, value = m.group(1, 2)
        if "\\" in value:
            value = _unescape(value)
        if name in out:
            raise ExpositionError("duplicate_label", name)
        out[name] = value
        pos = m.end()
    return out


def _unescape(value: str) -> str:
    """Resolve ``\\\\``, ``\\"`` and ``\\n``; keep any other escape as written."""
    parts: list[str] = []
    i = 0
    while True:
        b = value.find("\\", i)
        if b < 0 or b + 1 >= len(value):
            parts.append(value[i:])
            return "".join(parts)
        parts.append(value[i:b])
        esc = value[b + 1]
        parts.append(_ESCAPES.get(esc, "\\" + esc))
        i = b + 2


def _explain_bad_labels(text: str, pos: int) -> NoReturn:
    """Raise the precise :class:`ExpositionError` for label text that stops matching at ``pos``."""
    rest = text[pos:].lstrip(" \t")
    eq = rest.find("=")
    if eq < 0:
        raise ExpositionError("bad_labels", f"no '=' in {rest[:40]!r}")
    name = rest[:eq].strip(" \t")
    if not _LABEL_NAME.match(name):
        raise ExpositionError("bad_labels", f"bad label name {name[:40]!r}")
    value = rest[eq + 1 :].lstrip(" \t")
    if not value.startswith('"'):
        raise ExpositionError("bad_labels", f"label {name} value is not quoted")
    raise ExpositionError("bad_labels", f"label {name}: unterminated value or text after it: {value[:40]!r}")


def parse_value(text: str) -> int | float:
    """Parse a sample value: an ``int`` when the text is an integer (so counters past 2**53
    stay exact), else a ``float`` (``NaN``, ``+Inf``, ``-Inf``, exponents).

    Raises:
        ExpositionError: ``bad_value`` for anything else (including ``_`` digit separators and
            non-ASCII digits, which Python would accept and Go's ``ParseFloat`` would not).
    """
    digits = text[1:] if text[:1] in ("-", "+") else text
    if digits.isdigit() and digits.isascii():
        return int(text)
    if "_" in text or not text.isascii():
        raise ExpositionError("bad_value", text[:40])
    try:
        return float(text)
    except ValueError:
        raise ExpositionError("bad_value", text[:40]) from None


def parse_timestamp_ms(text: str) -> int:
    """Parse an exposition timestamp (``int64`` milliseconds since the epoch, may be negative).

    Raises:
        ExpositionError: ``bad_timestamp`` if it is not an ``int64``.
    """
    digits = text[1:] if text[:1] in ("-", "+") else text
    if not (digits.isdigit() and digits.isascii()):
        raise ExpositionError("bad_timestamp", text[:40])
    ms = int(text)
    if not -(2**63) <= ms < 2**63:
        raise ExpositionError("bad_timestamp", text[:40])
    return ms
