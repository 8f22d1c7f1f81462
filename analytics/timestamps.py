"""The sample times the analytics stage takes: those it can store and read back.

A record's time (Unix seconds, a JSON number) is valid for the contracts whenever it is a finite
float, but the stage stores it as a DuckDB ``TIMESTAMP`` (microseconds in an int64) and reads it
back as Python ``datetime`` (years 1-9999): a time outside those years would fail every batch it
is in (the state rows the classifier derives from it included), so the decode rejects it
(``bad_timestamp``; ``invalid_sample`` for one GPU of a scrape record) like a non-finite one.
"""

from __future__ import annotations

TS_MIN_S = -62_135_596_800.0
"""0001-01-01T00:00:00Z in Unix seconds: the earliest sample time the stage takes."""
TS_MAX_S = 253_402_300_800.0
"""10000-01-01T00:00:00Z in Unix seconds: sample times from here on are refused."""


def storable_ts(ts: float) -> bool:
    """Whether ``ts`` (Unix seconds) is a time the stage stores and reads back: finite and within
    the years 1-9999 (:data:`TS_MIN_S` <= ``ts`` < :data:`TS_MAX_S`; DuckDB's ``TIMESTAMP`` and
    Python's ``datetime`` both hold those). False for NaN and the infinities."""
    return TS_MIN_S <= ts < TS_MAX_S
