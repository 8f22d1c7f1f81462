"""Counters to rates, in one place: used by the collectors and by analytics.

A counter read (an InfiniBand PMA counter such as ``PortXmitData``, a DCGM total such as
``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``) becomes a delta and a rate only when two consecutive
reads of the same counter can honestly be compared. :class:`CounterTracker` keeps, per
``(key, counter)``, the previous raw value (a Python ``int``) and its time, and classifies every
new read as one :data:`CounterEvent`:

* ``first``      — no previous read: the read becomes the baseline, no rate;
* ``ok``         — ``delta = value - previous`` (an exact ``int``) and ``rate = delta / dt``;
* ``reset``      — the value went *down*. IBTA PMA counters never wrap (IBTA spec vol. 1,
  16.1.3: "counters ... stop at all ones"); a drop means the counter was cleared (``perfquery
  -R``, a driver reload, a port or device reset). The read becomes the new baseline and the
  interval has **no rate**. Prometheus's ``rate()`` instead counts the new value as the increase
  since the reset; that is a lower bound of an interval whose real length (from the clear to this
  read) is unknown, and the traffic between the previous read and the clear is lost. An
  underestimated rate would make a congested link look idle, so the honest answer is "unknown";
* ``saturated``  — the value is at the counter's all-ones maximum ``2**bits - 1`` (or the caller
  says so): the counter stopped counting at some unknown time, so no delta is known. The read is
  kept as the baseline, so the clear that must follow is seen as a ``reset``;
* ``clock_step`` — the read's time does not come after the previous one, or comes more than
  ``max_gap_s`` later (missed reads hide resets and saturations). The read becomes the new
  baseline, no rate;
* ``missing``    — the counter could not be read (``None``). The previous baseline is kept, so
  the next good read gets a delta over the longer interval (exact for a counter that neither
  reset nor saturated meanwhile; the gap check bounds that interval).

Integers end to end: raw values and deltas are Python ``int`` (switch byte counters pass 2**53,
where float64 stops being exact); only the rate, a ratio of a count to seconds, is a ``float``.

:func:`link_utilisation` turns a ``PortXmitData`` delta into the fraction of a link's capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DEFAULT_MAX_GAP_S",
    "CounterEvent",
    "CounterTracker",
    "RateResult",
    "link_utilisation",
]

CounterEvent = Literal["first", "ok", "reset", "saturated", "clock_step", "missing"]
"""What a read meant; see the module docstring. Only ``ok`` carries a delta and a rate."""

DEFAULT_MAX_GAP_S = 300.0
"""Largest time between two reads that still gives a rate, seconds (60 collection intervals of
5 s). Longer gaps may hide a reset followed by growth past the old value."""


@dataclass(frozen=True, slots=True)
class RateResult:
    """The outcome of one :meth:`CounterTracker.update`.

    Attributes:
        delta: exact increase since the previous read (``int`` >= 0), only for ``event == "ok"``.
        rate_per_s: ``delta / dt_s`` in counter units per second, only for ``event == "ok"``.
        event: what the read meant (:data:`CounterEvent`).
        dt_s: seconds since the previous read, when there was one and the clock moved forward.
    """

    delta: int | None
    rate_per_s: float | None
    event: CounterEvent
    dt_s: float | None = None


class CounterTracker:
    """Per ``(key, counter)`` state: the previous raw ``int`` value and its time.

    ``key`` is the thing the counter belongs to (an :attr:`contracts.IbPortSample.key`
    ``node_guid/port``, a :attr:`contracts.GpuSample.key`), ``counter`` its name
    (``PortXmitData``). Not thread-safe: one tracker per consumer task.

    Args:
        max_gap_s: a read more than this many seconds after the previous one is a
            ``clock_step`` (no rate).

    Raises:
        ValueError: ``max_gap_s`` is not a positive finite number.
    """

    __slots__ = ("_max_gap_s", "_state")

    def __init__(self, *, max_gap_s: float = DEFAULT_MAX_GAP_S) -> None:
        if not (math.isfinite(max_gap_s) and max_gap_s > 0):
            raise ValueError(f"max_gap_s must be a positive finite number, got {max_gap_s!r}")
        self._max_gap_s = float(max_gap_s)
        self._state: dict[str, dict[str, tuple[int, float]]] = {}

    @property
    def max_gap_s(self) -> float:
        """The largest gap between two reads that still gives a rate, seconds."""
        return self._max_gap_s

    def __len__(self) -> int:
        """Number of ``(key, counter)`` baselines held."""
        return sum(len(c) for c in self._state.values())

    def previous(self, key: str, counter: str) -> tuple[int, float] | None:
        """The baseline ``(raw value, ts)`` of ``(key, counter)``, or ``None``."""
        return self._state.get(key, {}).get(counter)

    def forget(self, key: str) -> None:
        """Drop every baseline of ``key`` (a port or GPU that went away); unknown keys are ignored."""
        self._state.pop(key, None)

    def update(
        self,
        key: str,
        counter: str,
        value: int | None,
        ts: float,
        bits: int = 64,
        saturated: bool = False,
    ) -> RateResult:
        """Take one read of ``counter`` of ``key`` and say what it means (module docstring).

        Args:
            key / counter: identity of the counter.
            value: the raw read, a non-negative ``int`` < ``2**bits``; ``None`` if unreadable.
            ts: time of the read, Unix seconds.
            bits: the counter's width (64 for PortCountersExtended, 32 for legacy data
                counters, 16/8/4 for PMA error counters: :mod:`collectors.ib_counters`).
            saturated: the source already flagged the value as saturated
                (:attr:`contracts.IbPortSample.saturated`); a value of ``2**bits - 1`` is
                saturated in any case.

        Returns:
            A :class:`RateResult`; ``delta`` and ``rate_per_s`` are set only for ``ok``.

        Raises:
            TypeError: ``value`` is not an ``int`` (a ``float`` or ``bool`` would betray the
                integer contract: floats are inexact past 2**53).
            ValueError: ``value`` is negative or does not fit in ``bits``; ``bits`` < 1; ``ts``
                is not finite. The tracker's state is unchanged.
        """
        if value is None:
            return RateResult(None, None, "missing")
        if type(value) is not int:
            raise TypeError(f"{counter}: counter values must be int, got {type(value).__name__}")
        if bits < 1:
            raise ValueError(f"{counter}: bits must be >= 1, got {bits}")
        top = (1 << bits) - 1
        if value < 0 or value > top:
            raise ValueError(f"{counter}: value {value} outside 0..2**{bits}-1")
        if not math.isfinite(ts):
            raise ValueError(f"{counter}: ts must be finite, got {ts!r}")

        counters = self._state.setdefault(key, {})
        prev = counters.get(counter)
        counters[counter] = (value, ts)
        dt = None if prev is None else ts - prev[1]
        forward = dt is not None and 0.0 < dt <= self._max_gap_s
        if saturated or value == top:
            return RateResult(None, None, "saturated", dt if forward else None)
        if prev is None:
            return RateResult(None, None, "first")
        if not forward:
            return RateResult(None, None, "clock_step")
        assert dt is not None
        delta = value - prev[0]
        if delta < 0:
            return RateResult(None, None, "reset", dt)
        return RateResult(delta, delta / dt, "ok", dt)


def link_utilisation(delta_xmit_words: int, dt_s: float, rate_bytes_per_second: int) -> float:
    """Fraction of a link's capacity used over an interval, from a ``PortXmitData`` delta.

    ``PortXmitData`` counts 4-octet words (IBTA vol. 1, 16.1.3.5; bytes = 4 × words, never ×
    link width), so::

        utilisation = 4 · Δwords / (Δt · rate_bytes_per_second)

    DESIGN.md writes the same quantity as ``32 · ΔPortXmitData / (Δt · link rate in bits/s)``:
    with ``rate_bits = 8 · rate_bytes``, ``32 / 8 = 4``.

    ``rate_bytes_per_second`` is :attr:`contracts.IbPortSample.rate_bytes_per_second`, the sysfs
    ``rate`` in Gb/s × 125,000,000. For 8b/10b links (SDR/DDR/QDR) that file gives the signalling
    rate, so a saturated link reads 0.8 there; FDR/EDR/HDR/NDR rates are data rates. The result is
    not clamped: timing jitter between the counter read and ``ts`` can put it slightly above 1.

    Args:
        delta_xmit_words: increase of ``PortXmitData`` (an ``ok`` :class:`RateResult` delta), >= 0.
        dt_s: the interval, seconds, > 0.
        rate_bytes_per_second: link rate, bytes per second, > 0.

    Raises:
        TypeError: ``delta_xmit_words`` or ``rate_bytes_per_second`` is not an ``int``.
        ValueError: a negative delta, or a non-positive (or non-finite) interval or rate.
    """
    if type(delta_xmit_words) is not int or type(rate_bytes_per_second) is not int:
        raise TypeError("delta_xmit_words and rate_bytes_per_second must be int")
    if delta_xmit_words < 0:
        raise ValueError(f"delta_xmit_words must be >= 0, got {delta_xmit_words}")
    if not (math.isfinite(dt_s) and dt_s > 0):
        raise ValueError(f"dt_s must be a positive finite number, got {dt_s!r}")
    if rate_bytes_per_second <= 0:
        raise ValueError(f"rate_bytes_per_second must be > 0, got {rate_bytes_per_second}")
    return (4 * delta_xmit_words) / (dt_s * rate_bytes_per_second)
