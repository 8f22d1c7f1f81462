"""XID errors as events on change (case GPU-10).

``DCGM_FI_DEV_XID_ERRORS`` is "the value of the last XID error encountered" (``dcgm_fields.h``):
a gauge that holds an error code and stays at e.g. 31 for ever after the GPU recovered. Treating
it as a count, or alerting on its value, repeats one fault at every scrape. dcgm-exporter's own
``DCGM_EXP_XID_ERRORS_COUNT{xid="31"}`` counts XIDs inside a sliding window and is preferred
when a scrape carries it.

The parser (:mod:`collectors.dcgm`) is stateless and reports one :class:`XidObservation` per GPU
per scrape; :class:`XidTracker` keeps the previous observation per GPU and turns changes into
:class:`XidEvent` s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, slots=True)
class XidObservation:
    """What one scrape said about one GPU's XID errors.

    Attributes:
        key: GPU key (:func:`contracts.topics.gpu_key`).
        ts: sample time, Unix seconds.
        last_xid: value of ``DCGM_FI_DEV_XID_ERRORS`` (0 = none since driver load), or ``None``.
        message: the ``err_msg`` label of that series, if any.
        window_counts: ``xid → count`` from ``DCGM_EXP_XID_ERRORS_COUNT`` (empty if absent).
        codes: every code of ``DCGM_FI_DEV_XID_ERRORS`` when the field came as several series
            (split by an ``xid`` label), in series order; empty for one series.
    """

    key: str
    ts: float
    last_xid: int | None = None
    message: str | None = None
    window_counts: dict[int, int] = field(default_factory=dict)
    codes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class XidEvent:
    """One XID error reported once.

    Attributes:
        key: GPU key.
        ts: time of the observation that revealed it, Unix seconds.
        xid: the XID code.
        previous: the code seen before on this GPU (``None`` if this is the first observation,
            for ``source="window_count"`` the previous windowed count of this code).
        count: how many new occurrences (1 for ``last_value``; the count increase for
            ``window_count``).
        message: dcgm-exporter's ``err_msg`` when known.
        source: ``last_value`` (a change of ``DCGM_FI_DEV_XID_ERRORS``) or ``window_count``
            (an increase of ``DCGM_EXP_XID_ERRORS_COUNT``).
    """

    key: str
    ts: float
    xid: int
    previous: int | None
    count: int
    message: str | None
    source: Literal["last_value", "window_count"]


@dataclass(slots=True)
class _State:
    last_xid: int | None
    window_counts: dict[int, int]
    codes: frozenset[int] = frozenset()


class XidTracker:
    """Turns successive :class:`XidObservation` s of each GPU into :class:`XidEvent` s.

    Rules: when an observation carries windowed counts, an event is emitted for each code whose
    count went up (a code seen for the first time counts from 0) and the last-value gauge is
    ignored for it; otherwise an event is emitted when the last XID value changes to a non-zero
    code, or is non-zero at the first observation of that GPU (a restarted collector cannot tell
    an old code from a new one and reports it once). A value that stays the same never
    re-alerts; a change back to 0 (driver reload) is not an event. When the last-XID field came
    as several series (``codes``), each non-zero code absent from the previous observation's
    codes (or last value) is an event of its own.
    """

    def __init__(self) -> None:
        self._state: dict[str, _State] = {}

    def __len__(self) -> int:
        """Number of GPUs tracked."""
        return len(self._state)

    def observe(self, observations: Iterable[XidObservation]) -> list[XidEvent]:
        """Fold ``observations`` (in scrape order) into the state; return the new events."""
        events: list[XidEvent] = []
        for obs in observations:
            state = self._state.get(obs.key)
            if obs.window_counts:
                before = state.window_counts if state is not None else {}
                for xid, count in sorted(obs.window_counts.items()):
                    prev = before.get(xid, 0)
                    if count > prev:
                        events.append(
                            XidEvent(obs.key, obs.ts, xid, prev, count - prev, obs.message, "window_count")
                        )
            elif obs.codes:
                before_codes = state.codes if state is not None else frozenset()
                if state is not None and not before_codes and state.last_xid is not None:
                    before_codes = frozenset({state.last_xid})
                for code in obs.codes:
                    if code != 0 and code not in before_codes:
                        prev_xid = state.last_xid if state is not None else None
                        events.append(XidEvent(obs.key, obs.ts, code, prev_xid, 1, obs.message, "last_value"))
            elif obs.last_xid is not None:
                prev_xid = state.last_xid if state is not None else None
                if obs.last_xid != 0 and obs.last_xid != prev_xid:
                    events.append(
                        XidEvent(obs.key, obs.ts, obs.last_xid, prev_xid, 1, obs.message, "last_value")
                    )
            self._state[obs.key] = _State(
                obs.last_xid if obs.last_xid is not None else (state.last_xid if state else None),
                dict(obs.window_counts),
                frozenset(obs.codes),
            )
        return events
