"""Per-GPU idle detection: busy / idle / unknown from a stream of GPU samples.

Pure logic, no I/O and no wall clock: every time comes from the samples (or from the ``now`` given
to :meth:`IdleClassifier.tick`), so unit tests and trace replays are deterministic.

Rules (DESIGN.md "Idle capacity"; cases GPU-03, GPU-05, GPU-06, GPU-14 in
``../shared/data/cases/cases.json``):

* **Identity.** One track per :attr:`GpuSample.key` (``host/uuid[/gpu_instance_id]``): a MIG GPU
  instance is a GPU of its own.
* **Activity signal.** The profiling ratios ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` /
  ``DCGM_FI_PROF_SM_ACTIVE`` (0..1; the larger of those present) first. ``DCGM_FI_DEV_GPU_UTIL``
  (%, divided by 100) only for a whole GPU that has shown no profiling field for
  :attr:`IdleConfig.prof_forget_s`; never for a MIG instance, where it is not supported (GPU-05:
  a missing GPU_UTIL is not 0 %).
* **Unknown** when the activity field is missing (``missing_field``), was rejected by the collector
  (its ``invalid`` reason: ``sentinel``, ``out_of_range``, ``not_a_number``), is out of range or not
  finite here, profiling looks stalled (activity <= idle threshold while GPU_UTIL >=
  :attr:`IdleConfig.prof_stalled_util_pct`: ``prof_stalled``, GPU-14), or the GPU has not been seen
  for :attr:`IdleConfig.stale_after_s` (``stale``). An unknown sample ends any idle run.
* **Hysteresis.** One sample with activity >= ``busy_threshold`` makes the GPU busy at once. A GPU
  becomes idle only after ``min_idle_s`` of consecutive samples with activity <=
  ``idle_threshold``; samples in between the thresholds keep an idle GPU idle and a non-idle GPU
  not idle (they break a pending idle run).
* **Grade.** An idle GPU is ``free`` when ``DCGM_FI_DEV_FB_USED`` (MiB) <= ``free_fb_used_mib``,
  ``memory_held`` otherwise. Without a valid FB_USED (absent for MIG GIs on H100, GPU-06) it gets
  ``fb_unknown_grade`` and its confidence is multiplied by ``fb_unknown_confidence``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Protocol, cast

from contracts import GpuState, IdleGrade
from runtime.settings import IdleSettings

GR_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
"""Ratio (0..1) of time the graphics/compute engine was active (DCGM field 1001)."""
SM_ACTIVE = "DCGM_FI_PROF_SM_ACTIVE"
"""Ratio (0..1) of time at least one warp was resident on an SM, averaged over SMs (field 1002)."""
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
"""Percent (0..100) of time a kernel was running (field 203); not supported per MIG instance."""
FB_USED = "DCGM_FI_DEV_FB_USED"
"""Framebuffer memory used, MiB (field 252)."""
FB_FREE = "DCGM_FI_DEV_FB_FREE"
"""Framebuffer memory free, MiB (field 251)."""
FB_TOTAL = "DCGM_FI_DEV_FB_TOTAL"
"""Framebuffer memory total, MiB (field 250)."""
FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
"""Framebuffer memory reserved by the driver, MiB (field 253)."""

PROFILING_FIELDS: tuple[str, ...] = (GR_ENGINE_ACTIVE, SM_ACTIVE)
"""Activity fields preferred over :data:`GPU_UTIL`, in order of preference."""

READ_FIELDS: tuple[str, ...] = (GR_ENGINE_ACTIVE, SM_ACTIVE, GPU_UTIL, FB_USED, FB_FREE, FB_TOTAL, FB_RESERVED)
"""Every field name the classifier reads of a sample's ``fields`` and ``invalid`` (nothing else of
those maps), in the order of :data:`FieldReadings`: what an observation of a scrape record's GPU
carries (:class:`analytics.scrapes.GpuObservation`)."""

FieldReadings = tuple[float | int | str | None, ...]
"""The entries of :data:`READ_FIELDS` of one sample, as the first ``2 * len(READ_FIELDS)`` items
of a tuple: ``len(READ_FIELDS)`` values of its ``fields`` (``int`` or ``float``) then as many
reasons of its ``invalid`` (``str``), in the order of :data:`READ_FIELDS`; ``None`` where the
sample has no entry. Items after those are not read."""

_GR, _SM, _UTIL, _FB_USED, _FB_FREE, _FB_TOTAL, _FB_RESERVED = range(len(READ_FIELDS))
_PROF = tuple(READ_FIELDS.index(f) for f in PROFILING_FIELDS)
_WHY = len(READ_FIELDS)
"""Offset of the reasons in :data:`FieldReadings`."""


def field_readings(sample: SampleLike) -> FieldReadings:
    """The :data:`FieldReadings` of ``sample``: the sample itself when it is a tuple (an
    :class:`analytics.scrapes.GpuObservation`, whose readings come first), else read from its
    ``fields`` and ``invalid`` maps."""
    if isinstance(sample, tuple):
        return sample
    fields, invalid = sample.fields, sample.invalid
    return (*map(fields.get, READ_FIELDS), *map(invalid.get, READ_FIELDS))

_RATIO_TOLERANCE = 1e-3
"""DCGM profiling ratios may overshoot 1.0 by rounding; more than this is out of range."""


class SampleLike(Protocol):
    """What the classifier reads from a sample; :class:`contracts.GpuSample` satisfies it.

    Each member has the meaning and units of the :class:`contracts.GpuSample` field of the same
    name (``ts`` Unix seconds; ``fields`` valid values by DCGM field name; ``invalid`` rejected
    field → reason; ``key`` the :func:`contracts.topics.gpu_key` identity).
    """

    @property
    def ts(self) -> float: ...
    @property
    def host(self) -> str: ...
    @property
    def gpu_uuid(self) -> str | None: ...
    @property
    def gpu_instance_id(self) -> int | None: ...
    @property
    def model_name(self) -> str | None: ...
    @property
    def fields(self) -> dict[str, float | int]: ...
    @property
    def invalid(self) -> dict[str, str]: ...
    @property
    def key(self) -> str: ...


@dataclass(frozen=True, slots=True)
class IdleConfig:
    """Thresholds of idle detection. Activity is a ratio 0..1 (GPU_UTIL % is divided by 100).

    Attributes:
        idle_threshold: activity at or below this is an idle sample (0.05 = 5 %).
        busy_threshold: activity at or above this makes the GPU busy at once; must be >=
            ``idle_threshold``.
        min_idle_s: seconds of consecutive idle samples (first to latest) before a GPU is idle.
        stale_after_s: a GPU not sampled for longer than this is unknown (``stale``); a gap longer
            than this between two samples also ends an idle run. Must exceed the sampling interval.
        free_fb_used_mib: an idle GPU with FB_USED (MiB) at or below this is ``free``.
        prof_stalled_util_pct: GPU_UTIL (%) at or above which a profiling activity at or below
            ``idle_threshold`` is contradictory: ``prof_stalled`` (GPU-14).
        prof_forget_s: a whole GPU that has shown no profiling field for this long falls back to
            GPU_UTIL; before that a missing profiling field is ``missing_field``.
        fb_unknown_grade: grade of an idle GPU whose FB_USED is unknown.
        fb_unknown_confidence: factor (0..1] applied to the confidence of such a GPU.

    Raises:
        ValueError: on construction, if a threshold is out of its range.
    """

    idle_threshold: float = 0.05
    busy_threshold: float = 0.10
    min_idle_s: float = 60.0
    stale_after_s: float = 30.0
    free_fb_used_mib: float = 512.0
    prof_stalled_util_pct: float = 50.0
    prof_forget_s: float = 600.0
    fb_unknown_grade: IdleGrade = IdleGrade.MEMORY_HELD
    fb_unknown_confidence: float = 0.8

    def __post_init__(self) -> None:
        if not 0.0 <= self.idle_threshold <= self.busy_threshold <= 1.0:
            raise ValueError("need 0 <= idle_threshold <= busy_threshold <= 1 (ratios)")
        if self.min_idle_s < 0 or self.stale_after_s <= 0 or self.prof_forget_s < 0:
            raise ValueError("min_idle_s >= 0, stale_after_s > 0 and prof_forget_s >= 0 are required")
        if not 0.0 < self.fb_unknown_confidence <= 1.0:
            raise ValueError("fb_unknown_confidence must be in (0, 1]")


def idle_config_from(settings: IdleSettings) -> IdleConfig:
    """The :class:`IdleConfig` of the ``[idle]`` settings group (other fields at their defaults) —
    the one mapping used by ``gpupool analytics run`` and ``gpupool config show``.

    Raises:
        ValueError: thresholds :class:`IdleConfig` refuses (``idle_threshold > busy_threshold``).
    """
    return IdleConfig(
        idle_threshold=settings.idle_threshold,
        busy_threshold=settings.busy_threshold,
        min_idle_s=settings.min_idle_s,
        stale_after_s=settings.stale_after_s,
    )


@dataclass(frozen=True, slots=True)
class GpuStatus:
    """The classifier's view of one GPU after its latest sample (or tick).

    Attributes:
        key: GPU identity (:func:`contracts.gpu_key`).
        host / gpu_uuid / gpu_instance_id / model_name: from the latest sample.
        state: busy / idle / unknown.
        since: when ``state`` began (Unix s); for idle, the first sample of the idle run.
        ts: time of the decision (Unix s): the latest sample's time, or the stale deadline.
        reason: for unknown, the code (``missing_field``, ``sentinel``, ``out_of_range``,
            ``not_a_number``, ``prof_stalled``, ``stale``); for busy and idle, the DCGM field that
            decided, with ``idle_pending`` while an idle run is not yet ``min_idle_s`` long and
            ``fb_unknown`` for an idle GPU without FB_USED (comma separated).
        grade: for idle GPUs, the grade; else ``None``.
        fb_used_mib: latest valid FB_USED (MiB) or ``None`` (unknown, never 0 by default).
        fb_total_mib: FB_TOTAL, else FB_USED + FB_FREE (+ FB_RESERVED) when known (MiB).
        confidence_factor: 1.0, or ``fb_unknown_confidence`` for an idle GPU without FB_USED.
        activity: the activity ratio (0..1) of the latest sample, ``None`` when unknown.
    """

    key: str
    host: str
    gpu_uuid: str
    gpu_instance_id: int | None
    model_name: str | None
    state: GpuState
    since: float
    ts: float
    reason: str
    grade: IdleGrade | None = None
    fb_used_mib: float | None = None
    fb_total_mib: int | None = None
    confidence_factor: float = 1.0
    activity: float | None = None


@dataclass(frozen=True, slots=True)
class IdleRun:
    """One idle period of a GPU that reached the idle state, ended by a busy or unknown sample.

    Attributes:
        key: GPU identity.
        model_name: GPU model, for pooled statistics.
        start: first idle sample (Unix s).
        end: last sample known idle (Unix s); a conservative end.
        censored: True when the run ended in unknown (the true end is later than ``end``, unseen).
    """

    key: str
    model_name: str | None
    start: float
    end: float
    censored: bool

    @property
    def duration_s(self) -> float:
        """``end - start`` in seconds (>= 0)."""
        return max(0.0, self.end - self.start)


@dataclass(slots=True)
class _Track:
    status: GpuStatus
    last_ts: float
    prof_seen_ts: float | None = None
    idle_start: float | None = None
    last_idle_ts: float | None = None
    stale: bool = False


@dataclass(frozen=True, slots=True)
class _Reading:
    activity: float | None
    signal: str
    unknown: str | None = None


class IdleClassifier:
    """Classifies every GPU seen; feed samples in time order per GPU with :meth:`observe`.

    Samples of a GPU not newer than its latest one are ignored (re-delivered or out of order).
    """

    def __init__(self, config: IdleConfig | None = None) -> None:
        """Start with no GPU known; ``config`` defaults to :class:`IdleConfig` ()."""
        self.config = config if config is not None else IdleConfig()
        self._tracks: dict[str, _Track] = {}
        self._runs: list[IdleRun] = []

    # public API ------------------------------------------------------------------------------
    def observe(self, sample: SampleLike) -> GpuStatus | None:
        """Update the GPU of ``sample``; return its new status, or ``None`` if the sample was
        ignored because it is not newer than the GPU's latest sample."""
        key = sample.key
        track = self._tracks.get(key)
        if track is not None and sample.ts <= track.last_ts:
            return None
        if track is None:
            track = self._new_track(sample)
            self._tracks[key] = track
        elif sample.ts - track.last_ts > self.config.stale_after_s:
            # A gap longer than the stale limit: the GPU was unknown in between.
            self._go_stale(track, track.last_ts + self.config.stale_after_s)
        self._apply(track, sample)
        return track.status

    def tick(self, now: float) -> list[GpuStatus]:
        """Mark every GPU not sampled for more than ``stale_after_s`` before ``now`` (Unix s)
        unknown (``stale``); return the statuses that changed."""
        changed: list[GpuStatus] = []
        for track in self._tracks.values():
            if not track.stale and now - track.last_ts > self.config.stale_after_s:
                self._go_stale(track, track.last_ts + self.config.stale_after_s)
                changed.append(track.status)
        return changed

    def status(self, key: str) -> GpuStatus | None:
        """The current status of GPU ``key``, or ``None`` if never seen."""
        track = self._tracks.get(key)
        return None if track is None else track.status

    def statuses(self) -> dict[str, GpuStatus]:
        """Current status of every GPU seen, by key (a new dict)."""
        return {k: t.status for k, t in self._tracks.items()}

    def drain_runs(self) -> list[IdleRun]:
        """Idle runs ended since the previous call (each returned once), oldest first."""
        runs, self._runs = self._runs, []
        return runs

    def forget(self, key: str) -> None:
        """Drop GPU ``key`` (e.g. its partition moved to another analytics instance)."""
        self._tracks.pop(key, None)

    def rename(self, old: str, new: str, gpu_uuid: str) -> bool:
        """Move GPU ``old``'s track to key ``new`` with ``gpu_uuid`` (its UUID appeared:
        :mod:`analytics.identity`), unless ``new`` already has one (then ``old`` is dropped).
        Returns True when a track was moved."""
        track = self._tracks.pop(old, None)
        if track is None or new in self._tracks:
            return False
        track.status = replace(track.status, key=new, gpu_uuid=gpu_uuid)
        self._tracks[new] = track
        return True

    def gone(self, now: float, after_s: float) -> list[str]:
        """Keys of the GPUs whose latest sample is ``after_s`` seconds or more before ``now``
        (Unix s): gone that long, to be forgotten."""
        return [k for k, t in self._tracks.items() if now - t.last_ts >= after_s]

    # internals -------------------------------------------------------------------------------
    def _new_track(self, sample: SampleLike) -> _Track:
        status = GpuStatus(
            key=sample.key,
            host=sample.host,
            gpu_uuid=_identity(sample),
            gpu_instance_id=sample.gpu_instance_id,
            model_name=sample.model_name,
            state=GpuState.UNKNOWN,
            since=sample.ts,
            ts=sample.ts,
            reason="missing_field",
        )
        return _Track(status=status, last_ts=sample.ts)

    def _apply(self, track: _Track, sample: SampleLike) -> None:
        cfg = self.config
        ts = sample.ts
        readings = field_readings(sample)
        reading = self._reading(track, sample, readings)
        track.last_ts = ts
        track.stale = False
        fb_used, fb_total = _framebuffer(readings)
        prev = track.status
        base = replace(
            prev,
            host=sample.host,
            model_name=sample.model_name or prev.model_name,
            ts=ts,
            fb_used_mib=fb_used,
            fb_total_mib=fb_total if fb_total is not None else prev.fb_total_mib,
            activity=reading.activity,
            grade=None,
            confidence_factor=1.0,
        )
        if reading.unknown is not None or reading.activity is None:
            self._end_run(track, censored=True)
            track.status = _enter(base, GpuState.UNKNOWN, ts, reading.unknown or "missing_field")
            return
        activity = reading.activity
        if activity >= cfg.busy_threshold and activity > cfg.idle_threshold:
            self._end_run(track, censored=False)
            track.status = _enter(base, GpuState.BUSY, ts, reading.signal)
            return
        if activity <= cfg.idle_threshold:
            if track.idle_start is None:
                track.idle_start = ts
            track.last_idle_ts = ts
            if prev.state is GpuState.IDLE or ts - track.idle_start >= cfg.min_idle_s:
                track.status = self._idle_status(base, track.idle_start, reading.signal, fb_used)
            else:
                track.status = replace(base, reason=f"{reading.signal},idle_pending")
            return
        # Between the thresholds: hysteresis keeps an idle GPU idle; anything else is not idle.
        if prev.state is GpuState.IDLE and track.idle_start is not None:
            track.last_idle_ts = ts
            track.status = self._idle_status(base, track.idle_start, reading.signal, fb_used)
            return
        track.idle_start = None
        track.last_idle_ts = None
        track.status = _enter(base, GpuState.BUSY, ts, reading.signal)

    def _idle_status(self, base: GpuStatus, start: float, signal: str, fb_used: float | None) -> GpuStatus:
        cfg = self.config
        if fb_used is None:
            grade, factor, reason = cfg.fb_unknown_grade, cfg.fb_unknown_confidence, f"{signal},fb_unknown"
        else:
            grade = IdleGrade.FREE if fb_used <= cfg.free_fb_used_mib else IdleGrade.MEMORY_HELD
            factor, reason = 1.0, signal
        since = base.since if base.state is GpuState.IDLE else start
        return replace(
            base, state=GpuState.IDLE, since=since, reason=reason, grade=grade, confidence_factor=factor
        )

    def _end_run(self, track: _Track, *, censored: bool) -> None:
        """Close the pending idle run; record it if the GPU had reached idle."""
        if track.status.state is GpuState.IDLE and track.idle_start is not None:
            end = track.last_idle_ts if track.last_idle_ts is not None else track.idle_start
            self._runs.append(
                IdleRun(track.status.key, track.status.model_name, track.idle_start, end, censored)
            )
        track.idle_start = None
        track.last_idle_ts = None

    def _go_stale(self, track: _Track, at: float) -> None:
        self._end_run(track, censored=True)
        track.stale = True
        base = replace(track.status, ts=at, grade=None, confidence_factor=1.0, activity=None)
        track.status = _enter(base, GpuState.UNKNOWN, at, "stale")

    def _reading(self, track: _Track, sample: SampleLike, r: FieldReadings) -> _Reading:
        """The activity of ``sample`` (its :data:`FieldReadings` ``r``) as a ratio, or the reason
        it is unknown."""
        cfg = self.config
        mig = sample.gpu_instance_id is not None
        if any(r[i] is not None or r[_WHY + i] is not None for i in _PROF):
            track.prof_seen_ts = sample.ts
        util = None if mig else cast("float | int | None", r[_UTIL])
        prof = [(READ_FIELDS[i], cast("float | int", r[i])) for i in _PROF if r[i] is not None]
        if prof:
            for name, value in prof:
                bad = _check(value, 1.0 + _RATIO_TOLERANCE)
                if bad:
                    return _Reading(None, name, bad)
            name, value = max(prof, key=lambda p: p[1])
            activity = min(float(value), 1.0)
            if (
                util is not None
                and _check(util, 100.0) is None
                and activity <= cfg.idle_threshold
                and util >= cfg.prof_stalled_util_pct
            ):
                return _Reading(None, name, "prof_stalled")
            return _Reading(activity, name)
        for i in _PROF:
            if r[_WHY + i] is not None:
                return _Reading(None, READ_FIELDS[i], cast(str, r[_WHY + i]) or "invalid")
        recent_prof = track.prof_seen_ts is not None and sample.ts - track.prof_seen_ts <= cfg.prof_forget_s
        if mig or recent_prof:
            return _Reading(None, GR_ENGINE_ACTIVE, "missing_field")
        if util is not None:
            bad = _check(util, 100.0)
            if bad:
                return _Reading(None, GPU_UTIL, bad)
            return _Reading(float(util) / 100.0, GPU_UTIL)
        if r[_WHY + _UTIL] is not None:
            return _Reading(None, GPU_UTIL, cast(str, r[_WHY + _UTIL]) or "invalid")
        return _Reading(None, GPU_UTIL, "missing_field")


def _enter(base: GpuStatus, state: GpuState, ts: float, reason: str) -> GpuStatus:
    """``base`` in ``state``; ``since`` moves to ``ts`` only when the state changes."""
    since = base.since if base.state is state else ts
    return replace(base, state=state, since=since, reason=reason, grade=None, confidence_factor=1.0)


def _check(value: float | int, upper: float) -> str | None:
    """``None`` if ``0 <= value <= upper`` and finite, else the reason code."""
    v = float(value)
    if not math.isfinite(v):
        return "not_a_number"
    if v < 0.0 or v > upper:
        return "out_of_range"
    return None


def _framebuffer(r: FieldReadings) -> tuple[float | None, int | None]:
    """``(FB_USED MiB or None, total MiB or None)`` from the valid fields of a sample's
    :data:`FieldReadings` ``r``: the total is FB_TOTAL, else used + free + reserved (0 when
    absent)."""
    used = cast("float | int | None", r[_FB_USED])
    if used is not None and (not math.isfinite(float(used)) or used < 0):
        used = None
    total = cast("float | int | None", r[_FB_TOTAL])
    free = cast("float | int | None", r[_FB_FREE])
    if total is None and used is not None and free is not None:
        reserved = cast("float | int | None", r[_FB_RESERVED])
        total = used + free + (0 if reserved is None else reserved)
    total_mib = int(total) if total is not None and math.isfinite(float(total)) and total > 0 else None
    return (None if used is None else float(used)), total_mib


def _identity(sample: SampleLike) -> str:
    """The sample's GPU UUID. Raises ``ValueError`` for a sample without one: a sample known only
    by its index gets a UUID or a stand-in id from :mod:`analytics.identity` before it is
    classified."""
    if sample.gpu_uuid is None:
        raise ValueError(f"GPU sample {sample.key} has no UUID: resolve its identity first")
    return sample.gpu_uuid
