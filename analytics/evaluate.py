"""Replay a real GPU trace through the idle classifier and the idle predictor; score the promises.

``gpupool analytics evaluate`` runs this. The trace is the Alibaba GenAI 2026 serving trace
(``alibaba/clusterdata`` ``cluster-trace-v2026-GenAI/``; ``../shared/data/traces/alibaba_genai_2026/
PROVENANCE.md``): two CSV files, each alone in a ``.tar.gz``, with the columns
``value,timestamp_anon,container_ip`` (any order):

* ``pod_gpu_duty_cycle_anon.tar.gz`` — GPU duty cycle, % (0..100), of one GPU-serving pod;
* ``pod_gpu_memory_used_bytes_anon.tar.gz`` — the pod's GPU memory in use, bytes (scaled by the
  anonymisation: not a real GPU's absolute value).

``container_ip`` (MD5 of the pod IP) is the identity: one pod is one GPU. ``timestamp_anon`` is
epoch seconds *shifted* by the anonymisation, on a 57 s grid: its hour of day is not the real one.

**Replay.** Every sample becomes one observation of the real :class:`~analytics.classify.IdleClassifier`
(duty cycle as ``DCGM_FI_DEV_GPU_UTIL`` %, memory as ``DCGM_FI_DEV_FB_USED`` MiB), all pods merged
in time order; after each instant's samples the classifier is ticked (a pod that stops reporting
goes ``stale``) and every idle run it ended is given to the real
:class:`~analytics.predict.IdlePredictor`. Only then are that instant's idle GPUs predicted, so a
prediction at time ``t`` uses runs that ended at or before ``t`` and nothing later (no peeking).

**Ground truth.** A sample describes the 57 s before it (a duty cycle is a share of the sampling
period). It is *idle* when its duty cycle is at most the idle threshold (5 %), else *not idle*
(a value outside 0..100 is not idle either). Missing samples are not evidence either way.

**Promises.** When the classifier says idle at sample time ``t`` and the predictor gives
``predicted_idle_until = u > t`` with a confidence at least the target (95 %; the predictor's
no-history default, reported at a lower confidence, is never offered), the GPU is *promised* for
``[t, u]``. A promise is *broken* when a not-idle sample lies in ``(t, u]`` (the GPU turned busy
before ``u``), *held* when every sample there is idle, and *unverifiable* when it is not broken
but ``u`` is past the pod's last sample (the trace ends or the pod goes away first).

**Offer policies.** An offer is what a site can claim; it carries the latest promise.

* ``renew_each_sample`` (the default, what gpupool runs): every capacity update of an idle GPU
  carries a fresh prediction and the broker re-offers with it, so a new promise is made at every
  idle sample and the GPU stays offered as long as it is idle and confidently predicted. A site
  that claims at any moment receives the promise current at that moment.
* ``renew_at_expiry``: a promise stands until ``u`` (or until the GPU turns busy) and a new one is
  made only at the first sample at or after ``u``: fewer, non-overlapping promises.

**Metrics** (per variant, over all pods):

* idle GPU-time = (idle samples) × 57 s;
* an idle sample at ``t_j`` is *offerable* when, just before it, an offer stood whose promise was
  made at or before ``t_j − 57`` and runs to at least ``t_j``: a claim at the start of that
  interval would have covered it. Offerable share = offerable idle samples / idle samples;
* broken share = broken promises / (held + broken) promises; unverifiable promises are left out
  and counted;
* mean promised window = mean of ``u − t`` over all promises (s).

**History variants** (which runs a prediction learns from; all use the same predictor code):
``gpu+pool`` (the GPU's own runs, else the pool's), ``pool`` (every GPU's runs in one history,
optionally only the most recent N; the service's default, :data:`RECOMMENDED`, is built from
:class:`~analytics.predict.PredictorConfig`'s defaults by :func:`service_variant`), ``gpu``
(the GPU's own runs only), ``hour+pool`` (runs that began in the same hour of day of the
*shifted* clock, else the pool's; the trace spans 22.8 h, so an hour's history holds only runs of that hour earlier the same day). A *hindsight*
variant is given every run before the replay starts: a ceiling, not a forecast.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import pyarrow as pa

from analytics.classify import FB_USED, GPU_UTIL, IdleClassifier, IdleConfig, IdleRun
from analytics.predict import IdlePredictor, PredictorConfig
from contracts import GpuState, gpu_key
from contracts.gpu_trace import COLUMNS, DUTY_CYCLE_FILE, MEMORY_FILE, STEP_S, read_trace_csv
from contracts.gpu_trace import TraceReadError as TraceReadError  # raised by load_trace, re-exported

ProgressFn = Callable[[str, int, int], None]
"""Progress callback of :func:`read_trace` and :func:`evaluate`: ``(step, done, total)``, called
when a step starts (``done`` 0), as it advances, and when it ends (``done == total``); steps come
one after the other, each with its own ``total`` (files, time instants, variants)."""

TRACE_STEP_S = STEP_S
"""Sampling period of the trace, seconds (:data:`contracts.gpu_trace.STEP_S`)."""
TRACE_HOST = "alibaba-genai"
"""Host name given to every replayed pod (the trace has no hosts); a pod's GPU key is
``alibaba-genai/<container_ip>``."""

Policy = Literal["renew_each_sample", "renew_at_expiry"]
History = Literal["gpu+pool", "pool", "gpu", "hour+pool"]

log = logging.getLogger(__name__)

_MIB = float(1 << 20)
_POOL = "pool"


# --- reading the trace ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PodSeries:
    """One pod (= one GPU) of the trace, samples in time order.

    Attributes:
        pod: the ``container_ip`` hash.
        ts: sample times, shifted epoch seconds, strictly increasing.
        util_pct: duty cycle at each time, % (0..100 in a sound trace; other values are replayed
            as they are and the classifier calls them unknown).
        fb_used_mib: memory in use at each time, MiB (bytes / 2**20, trace scale), ``None`` where
            the memory file has no sample at that time.
    """

    pod: str
    ts: tuple[float, ...]
    util_pct: tuple[float, ...]
    fb_used_mib: tuple[float | None, ...]

    def __post_init__(self) -> None:
        if not len(self.ts) == len(self.util_pct) == len(self.fb_used_mib):
            raise ValueError(f"pod {self.pod}: ts, util_pct and fb_used_mib differ in length")
        if any(b <= a for a, b in zip(self.ts, self.ts[1:], strict=False)):
            raise ValueError(f"pod {self.pod}: timestamps are not strictly increasing")


@dataclass(frozen=True, slots=True)
class ReplayTrace:
    """What :func:`read_trace` returns.

    Attributes:
        pods: the pods replayed, sorted by id.
        pods_in_trace: pods in the duty-cycle file before ``slice_pods``.
        dropped_rows: rows not replayed, by reason: ``empty_value`` (a blank cell),
            ``duplicate`` (a second duty-cycle row of one pod at one time; the first is kept).
    """

    pods: tuple[PodSeries, ...]
    pods_in_trace: int
    dropped_rows: dict[str, int] = field(default_factory=dict)


def read_trace(
    trace_dir: Path | str, *, slice_pods: int | None = None, on_progress: ProgressFn | None = None
) -> ReplayTrace:
    """Read the duty-cycle and memory tarballs of ``trace_dir`` into per-pod series.

    Args:
        trace_dir: folder holding :data:`DUTY_CYCLE_FILE` and :data:`MEMORY_FILE`.
        slice_pods: keep only the first N pods in id order (ids are hashes: an unbiased slice);
            ``None`` keeps all.
        on_progress: told of the step ``"read trace"``, one unit per tarball read and one for
            building the series (:data:`ProgressFn`).

    Raises:
        FileNotFoundError: a tarball is missing.
        TraceReadError: a tarball is unreadable or its CSV lacks a column.
        ValueError: ``slice_pods`` < 1.
    """
    if slice_pods is not None and slice_pods < 1:
        raise ValueError("slice_pods must be >= 1")
    report = on_progress or _no_progress
    d = Path(trace_dir)
    dropped: Counter[str] = Counter()
    report("read trace", 0, 3)
    util = _rows_by_pod(read_trace_csv(d / DUTY_CYCLE_FILE), dropped, count_duplicates=True)
    report("read trace", 1, 3)
    mem = _rows_by_pod(read_trace_csv(d / MEMORY_FILE), Counter(), count_duplicates=False)
    report("read trace", 2, 3)
    names = sorted(util)
    chosen = names if slice_pods is None else names[:slice_pods]
    pods = []
    for name in chosen:
        samples = sorted(util[name].items())
        mem_of = mem.get(name, {})
        pods.append(
            PodSeries(
                pod=name,
                ts=tuple(t for t, _ in samples),
                util_pct=tuple(v for _, v in samples),
                fb_used_mib=tuple(
                    None if (m := mem_of.get(t)) is None else m / _MIB for t, _ in samples
                ),
            )
        )
    report("read trace", 3, 3)
    return ReplayTrace(pods=tuple(pods), pods_in_trace=len(names), dropped_rows=dict(dropped))


def _no_progress(step: str, done: int, total: int) -> None:
    """The :data:`ProgressFn` used when none is given."""


def _rows_by_pod(
    table: pa.Table, dropped: Counter[str], *, count_duplicates: bool
) -> dict[str, dict[float, float]]:
    """``pod → {time: value}``; blank rows and repeated (pod, time) rows are dropped and counted."""
    out: dict[str, dict[float, float]] = defaultdict(dict)
    cols = (table.column(c).to_pylist() for c in COLUMNS)
    for value, ts, pod in zip(*cols, strict=True):
        if value is None or ts is None or pod is None:
            dropped["empty_value"] += 1
            continue
        series = out[pod]
        if ts in series:
            if count_duplicates:
                dropped["duplicate"] += 1
            continue
        series[ts] = value
    return out


# --- configuration and results -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Variant:
    """One way of running the predictor over the trace.

    Attributes:
        name: label in the table.
        history: which runs a prediction learns from (module docstring, "History variants").
        policy: when promises are made (module docstring, "Offer policies").
        pool_runs: keep only the pool's most recent N runs; ``None``: the configuration's
            ``max_runs_per_pool``.
        hindsight: the predictor is given every run of the replay before it starts (and no
            run limit): it peeks, so its row is a ceiling for a model of that history, not a
            forecast.

    Raises:
        ValueError: on construction, for an unknown history or policy or ``pool_runs`` < 1.
    """

    name: str
    history: History
    policy: Policy = "renew_each_sample"
    pool_runs: int | None = None
    hindsight: bool = False

    def __post_init__(self) -> None:
        if self.history not in ("gpu+pool", "pool", "gpu", "hour+pool"):
            raise ValueError(f"unknown history {self.history!r}")
        if self.policy not in ("renew_each_sample", "renew_at_expiry"):
            raise ValueError(f"unknown policy {self.policy!r}")
        if self.pool_runs is not None and self.pool_runs < 1:
            raise ValueError("pool_runs must be >= 1")


def service_variant(config: PredictorConfig | None = None) -> Variant:
    """The variant the service runs with predictor settings ``config`` (default: the service's
    default :class:`~analytics.predict.PredictorConfig`): its history levels and pool history
    size, promises renewed at every sample (each capacity update carries a fresh prediction)."""
    cfg = config if config is not None else PredictorConfig()
    label = "pool" if cfg.history == "pool" else "gpu+pool"
    return Variant(
        f"{label}, last {cfg.max_runs_per_pool} runs (service default)",
        cfg.history,
        "renew_each_sample",
        pool_runs=cfg.max_runs_per_pool,
    )


RECOMMENDED = service_variant()
"""The variant the targets are checked on: what the service runs by default (the pool's recent
history, renewed every sample); follows :class:`~analytics.predict.PredictorConfig`."""

DEFAULT_VARIANTS: tuple[Variant, ...] = (
    RECOMMENDED,
    Variant("gpu+pool (former default)", "gpu+pool"),
    Variant("pool, last 4096 runs", "pool", pool_runs=4096),
    Variant("gpu only", "gpu"),
    Variant("hour-of-day+pool", "hour+pool"),
    Variant("pool, last 512, renew at expiry", "pool", "renew_at_expiry", pool_runs=512),
    Variant("hindsight: pool, all runs known", "pool", hindsight=True),
)
"""The rows of ``gpupool analytics evaluate``: :data:`RECOMMENDED` (the service default) first, then
the service's former configuration, other histories, the other offer policy and a hindsight ceiling."""


@dataclass(frozen=True, slots=True)
class EvaluationConfig:
    """Settings of a replay.

    Attributes:
        min_idle_s: classifier ``min_idle_s``: seconds from the first to the latest idle sample
            before a GPU is idle (57 = two samples of the trace).
        confidence: target probability (0..1) a promise must hold with.
        idle_threshold / busy_threshold: classifier thresholds, ratios of activity (0.05 = 5 %);
            ``idle_threshold`` is also the ground truth's.
        stale_after_s: classifier ``stale_after_s``; the default tolerates two missing samples.
        step_s: sampling period of the trace (s).
        min_at_risk / max_runs_per_gpu / max_runs_per_pool: predictor settings
            (:class:`~analytics.predict.PredictorConfig`).

    Raises:
        ValueError: on construction, for a value the classifier or predictor config rejects or a
            non-positive ``step_s``.
    """

    min_idle_s: float = TRACE_STEP_S
    confidence: float = 0.95
    idle_threshold: float = 0.05
    busy_threshold: float = 0.10
    stale_after_s: float = 3.5 * TRACE_STEP_S
    step_s: float = TRACE_STEP_S
    min_at_risk: int = 5
    max_runs_per_gpu: int = 256
    max_runs_per_pool: int = 4096

    def __post_init__(self) -> None:
        if not self.step_s > 0:
            raise ValueError("step_s must be > 0")
        self.idle_config()
        self.predictor_config()

    def idle_config(self) -> IdleConfig:
        """The classifier's configuration (raises ``ValueError`` like :class:`IdleConfig`)."""
        return IdleConfig(
            idle_threshold=self.idle_threshold,
            busy_threshold=self.busy_threshold,
            min_idle_s=self.min_idle_s,
            stale_after_s=self.stale_after_s,
        )

    def predictor_config(self) -> PredictorConfig:
        """The predictor's configuration, the service's defaults otherwise (no-history default:
        ``min_idle_s`` at 50 %, never offered at a higher target). Its ``history`` is the
        service's; each variant sets its own (:func:`_score`)."""
        return PredictorConfig(
            confidence=self.confidence,
            min_at_risk=self.min_at_risk,
            max_runs_per_gpu=self.max_runs_per_gpu,
            max_runs_per_pool=self.max_runs_per_pool,
            default_remaining_s=self.min_idle_s,
        )


@dataclass(frozen=True, slots=True)
class VariantResult:
    """Scores of one variant over all replayed pods (module docstring, "Metrics").

    Attributes:
        variant: what was run.
        idle_samples: samples whose duty cycle is at most the idle threshold.
        offerable_samples: idle samples covered by a standing offer.
        promises: promises made (held + broken + unverifiable).
        broken: promises broken before their end.
        unverifiable: promises not broken whose end lies past the pod's last sample.
        promised_s: sum of promised windows ``u − t``, seconds.
        step_s: sampling period (s), to turn samples into time.
    """

    variant: Variant
    idle_samples: int
    offerable_samples: int
    promises: int
    broken: int
    unverifiable: int
    promised_s: float
    step_s: float

    @property
    def offerable_share(self) -> float:
        """Offerable idle samples / idle samples (0..1; 0 with no idle sample)."""
        return self.offerable_samples / self.idle_samples if self.idle_samples else 0.0

    @property
    def broken_share(self) -> float:
        """Broken / verifiable (held + broken) promises (0..1; 0 with none)."""
        verifiable = self.promises - self.unverifiable
        return self.broken / verifiable if verifiable else 0.0

    @property
    def mean_promised_s(self) -> float:
        """Mean promised window, seconds (0 with no promise)."""
        return self.promised_s / self.promises if self.promises else 0.0

    @property
    def idle_gpu_hours(self) -> float:
        """Real idle GPU-time, hours."""
        return self.idle_samples * self.step_s / 3600.0

    @property
    def offerable_gpu_hours(self) -> float:
        """Idle GPU-time covered by offers, hours."""
        return self.offerable_samples * self.step_s / 3600.0

    def as_dict(self) -> dict[str, float | int | str]:
        """Plain JSON-able form: counts, shares (0..1), seconds and hours."""
        return {
            "variant": self.variant.name,
            "history": self.variant.history,
            "policy": self.variant.policy,
            "offerable_share": self.offerable_share,
            "broken_share": self.broken_share,
            "promises": self.promises,
            "broken": self.broken,
            "unverifiable": self.unverifiable,
            "mean_promised_s": self.mean_promised_s,
            "idle_samples": self.idle_samples,
            "offerable_samples": self.offerable_samples,
            "idle_gpu_hours": self.idle_gpu_hours,
            "offerable_gpu_hours": self.offerable_gpu_hours,
        }


@dataclass(frozen=True, slots=True)
class Evaluation:
    """All variants' results of one replay.

    Attributes:
        config: the settings used.
        pods: pods replayed.
        samples: samples replayed.
        idle_runs: idle runs the classifier ended (what the predictors learned from).
        results: one per variant, in the order asked.
    """

    config: EvaluationConfig
    pods: int
    samples: int
    idle_runs: int
    results: tuple[VariantResult, ...]


# --- replay --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Sample:
    """A trace sample as the classifier reads it (:class:`analytics.classify.SampleLike`)."""

    ts: float
    host: str
    gpu_uuid: str
    fields: dict[str, float | int]
    invalid: dict[str, str] = field(default_factory=dict)
    gpu_instance_id: int | None = None
    model_name: str | None = None

    @property
    def key(self) -> str:
        return gpu_key(self.host, self.gpu_uuid, self.gpu_instance_id)


@dataclass(slots=True)
class _Classified:
    """The classifier's pass: every instant, the runs it ended and each pod's decision."""

    times: list[float] = field(default_factory=list)
    runs_at: list[list[IdleRun]] = field(default_factory=list)
    samples_at: list[list[tuple[int, int]]] = field(default_factory=list)
    idle_since: list[list[float | None]] = field(default_factory=list)
    factor: list[list[float]] = field(default_factory=list)
    runs: int = 0


@dataclass(slots=True)
class _Offer:
    made_at: float
    until: float


def evaluate(
    pods: Sequence[PodSeries],
    config: EvaluationConfig | None = None,
    variants: Sequence[Variant] = DEFAULT_VARIANTS,
    *,
    on_progress: ProgressFn | None = None,
) -> Evaluation:
    """Replay ``pods`` once through the classifier and, per variant, through a fresh predictor;
    score the promises (module docstring).

    ``on_progress`` (:data:`ProgressFn`) is told of the step ``"classify"`` (one unit per time
    instant of the merged trace, reported every 1 %) and then ``"score"`` (one unit per variant).

    Raises:
        ValueError: two pods share an id.
    """
    report = on_progress or _no_progress
    cfg = config if config is not None else EvaluationConfig()
    if len({p.pod for p in pods}) != len(pods):
        raise ValueError("pod ids must be unique")
    classified = _classify(pods, cfg, report)
    keys = [gpu_key(TRACE_HOST, p.pod) for p in pods]
    truth = [_truth(p, cfg.idle_threshold) for p in pods]
    report("score", 0, len(variants))
    scored: list[VariantResult] = []
    for v in variants:
        scored.append(_score(v, pods, keys, truth, classified, cfg))
        report("score", len(scored), len(variants))
    results = tuple(scored)
    log.info(
        "trace_evaluated",
        extra={
            "pods": len(pods),
            "idle_runs": classified.runs,
            "offerable_share": {r.variant.name: round(r.offerable_share, 4) for r in results},
            "broken_share": {r.variant.name: round(r.broken_share, 4) for r in results},
        },
    )
    return Evaluation(
        config=cfg,
        pods=len(pods),
        samples=sum(len(p.ts) for p in pods),
        idle_runs=classified.runs,
        results=results,
    )


def _classify(
    pods: Sequence[PodSeries], cfg: EvaluationConfig, report: ProgressFn = _no_progress
) -> _Classified:
    """Run the classifier over all pods merged in time order (ties: pod order); ``report`` gets
    the step ``"classify"`` every 1 % of the time instants."""
    classifier = IdleClassifier(cfg.idle_config())
    out = _Classified(
        idle_since=[[None] * len(p.ts) for p in pods], factor=[[1.0] * len(p.ts) for p in pods]
    )
    by_time: dict[float, list[tuple[int, int]]] = defaultdict(list)
    for i, pod in enumerate(pods):
        for j, t in enumerate(pod.ts):
            by_time[t].append((i, j))
    instants = sorted(by_time)
    every = max(1, len(instants) // 100)
    report("classify", 0, len(instants))
    for n, t in enumerate(instants, 1):
        at = by_time[t]
        for i, j in at:
            pod = pods[i]
            fields: dict[str, float | int] = {GPU_UTIL: pod.util_pct[j]}
            mem = pod.fb_used_mib[j]
            if mem is not None:
                fields[FB_USED] = mem
            status = classifier.observe(_Sample(ts=t, host=TRACE_HOST, gpu_uuid=pod.pod, fields=fields))
            if status is not None and status.state is GpuState.IDLE:
                out.idle_since[i][j] = status.since
                out.factor[i][j] = status.confidence_factor
        classifier.tick(t)
        runs = classifier.drain_runs()
        out.runs += len(runs)
        out.times.append(t)
        out.runs_at.append(runs)
        out.samples_at.append(at)
        if n % every == 0 or n == len(instants):
            report("classify", n, len(instants))
    return out


def _truth(pod: PodSeries, idle_threshold: float) -> tuple[list[bool], list[float]]:
    """Per sample: idle by the ground truth; and the time of the next not-idle sample after it
    (``inf`` if none)."""
    idle = [0.0 <= v <= idle_threshold * 100.0 for v in pod.util_pct]  # NaN compares False
    next_bad = [math.inf] * len(idle)
    nxt = math.inf
    for j in range(len(idle) - 1, -1, -1):
        next_bad[j] = nxt
        if not idle[j]:
            nxt = pod.ts[j]
    return idle, next_bad


_FileRun = Callable[[IdleRun], tuple[str, str]]
_Lookup = Callable[[str, float], tuple[str, str]]


def _history(variant: Variant) -> tuple[_FileRun, _Lookup]:
    """``(file_run, lookup)``: the (history key, pool) a run is filed under, and the (key, pool)
    read by a prediction for GPU ``key`` idle since ``since``."""
    h = variant.history
    if h == "gpu+pool":
        return (lambda r: (r.key, _POOL)), (lambda k, s: (k, _POOL))
    if h == "pool":  # the predictor skips the GPU level (PredictorConfig.history == "pool")
        return (lambda r: (r.key, _POOL)), (lambda k, s: (k, _POOL))
    if h == "gpu":
        return (lambda r: (r.key, r.key)), (lambda k, s: (k, k))
    if h == "hour+pool":
        return (lambda r: (_hour_key(r.start), _POOL)), (lambda k, s: (_hour_key(s), _POOL))
    raise AssertionError(h)  # Variant validated it


def _hour_key(ts: float) -> str:
    """History key of the hour of day (0..23) of shifted epoch seconds ``ts``."""
    return f"hour-{int(ts % 86400.0 // 3600.0):02d}"


def _score(
    variant: Variant,
    pods: Sequence[PodSeries],
    keys: list[str],
    truth: list[tuple[list[bool], list[float]]],
    classified: _Classified,
    cfg: EvaluationConfig,
) -> VariantResult:
    file_run, lookup = _history(variant)
    # gpu / hour+pool file their own keys at the GPU level and read it first.
    pcfg = replace(cfg.predictor_config(), history="pool" if variant.history == "pool" else "gpu+pool")
    if variant.hindsight:
        everything = max(1, classified.runs)
        pcfg = replace(pcfg, max_runs_per_pool=everything, max_runs_per_gpu=everything)
    elif variant.pool_runs is not None:
        pcfg = replace(pcfg, max_runs_per_pool=variant.pool_runs)
    predictor = IdlePredictor(pcfg)
    if variant.hindsight:
        for run in (r for runs in classified.runs_at for r in runs):
            key, pool = file_run(run)
            predictor.observe(key, run.duration_s, censored=run.censored, pool=pool)
    standing: list[_Offer | None] = [None] * len(pods)
    idle_samples = offerable = promises = broken = unverifiable = 0
    promised_s = 0.0
    for t, runs, at in zip(classified.times, classified.runs_at, classified.samples_at, strict=True):
        for run in () if variant.hindsight else runs:
            key, pool = file_run(run)
            predictor.observe(key, run.duration_s, censored=run.censored, pool=pool)
        for i, j in at:
            idle, next_bad = truth[i]
            offer = standing[i]
            if idle[j]:
                idle_samples += 1
                if offer is not None and offer.made_at <= t - cfg.step_s + 1e-9 and offer.until >= t:
                    offerable += 1
            since = classified.idle_since[i][j]
            if since is None:  # busy or unknown: the offer is withdrawn
                standing[i] = None
                continue
            if variant.policy == "renew_at_expiry" and offer is not None and offer.until > t:
                continue
            key, pool = lookup(keys[i], since)
            pred = predictor.predict(key, since, t, pool=pool)
            confident = pred.confidence * classified.factor[i][j] >= cfg.confidence - 1e-12
            if not confident or pred.idle_until <= t:
                standing[i] = None
                continue
            until = pred.idle_until
            standing[i] = _Offer(made_at=t, until=until)
            promises += 1
            promised_s += until - t
            if next_bad[j] <= until:
                broken += 1
            elif until > pods[i].ts[-1]:
                unverifiable += 1
    return VariantResult(
        variant=variant,
        idle_samples=idle_samples,
        offerable_samples=offerable,
        promises=promises,
        broken=broken,
        unverifiable=unverifiable,
        promised_s=promised_s,
        step_s=cfg.step_s,
    )
