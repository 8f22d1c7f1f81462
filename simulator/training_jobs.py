"""Training jobs calibrated to a real cluster's published job statistics (AcmeTrace, NSDI'24).

Inputs, read from the shared data folder (never copied into the project):

* ``traces/acmetrace_jobs/cluster_summary.csv`` (InternLM/AcmeTrace ``data/cluster_summary.csv``,
  CC BY 4.0): one row per cluster with the GPU jobs' mean/median/max run time (s), GPUs per job
  (mean/median/max), final-state shares and GPU-seconds by final state;
* ``traces/acmetrace_cdf/acme_cdfs.csv`` (same repository, the ``util_gpu_*.pkl`` CDFs): 1000-point
  CDFs ``(x, cdf_percent)`` of per-GPU DCGM ``GPU_UTIL`` samples (15 s sampling), columns
  ``source_pkl,series,x,cdf_percent``.

The model (fitted by :func:`fit_workload` to one cluster's row; nothing is hard-coded per cluster):

* **GPUs per job** on the sizes an 8-GPU node can hold: 1, 2, 4, 8 on one node, then whole nodes
  16, 32, ... up to the published maximum. ``P(1) = p_single`` (≥ 0.5, the published median is one
  GPU) and ``P(2^k) ∝ 2^(-alpha·k)`` for k ≥ 1, ``alpha`` solved so that the mean equals the
  published mean.
* **Run time** given the job's size ``g``: lognormal, ``ln d ~ N(mu + beta·log2 g, sigma)``,
  truncated to [1 s, published max]. ``mu``, ``sigma``, ``beta`` are solved so that the mixture's
  median and mean equal the published median and mean run time and the mean GPU-seconds per job
  equal the published total GPU-time ÷ GPU job count (big jobs run longer: on every AcmeTrace
  cluster the GPU-time per job is several times mean GPUs × mean run time).
* **Final state** COMPLETED / CANCELLED / FAILED drawn with the published job shares (normalised),
  independently of size and run time: the published GPU-time shares by state are *not* fitted
  (:meth:`TrainingWorkload.state_gpu_time_shares` gives the model's, to compare).
* **Arrivals**: a Poisson process whose rate gives the requested offered load (GPU-seconds
  asked per second ÷ cluster GPUs) on the replay cluster. The summary has no time-of-day data, so
  the rate is flat unless ``diurnal_amplitude`` > 0 asks for a sinusoidal day (peak at
  ``diurnal_peak_h``), drawn by thinning.
* **Replay cluster**: job sizes above ``max_gpu_share`` of the replay cluster's GPUs are removed
  and the size law renormalised (the published cluster held jobs up to 1024 of its GPUs).
* **Per-GPU utilisation** (DCGM ``DCGM_FI_DEV_GPU_UTIL``, %): the CDF's mass at 0 % (``z``) is
  split between jobs that hold all their GPUs at 0 % for their whole life (a share
  ``idle_job_share`` of that mass, drawn per job) and zero samples inside working jobs; a working
  GPU's non-zero samples follow the CDF's positive part (inverse CDF, linear between points). Over
  GPU-time the samples follow the measured CDF.

Everything is deterministic given the seed. Times are simulated seconds from the workload's start;
:func:`compression_for` gives the factor that fits a simulated span into a wall-clock budget.
"""

from __future__ import annotations

import csv
import math
import random
import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from statistics import NormalDist
from typing import Literal

FinalState = Literal["COMPLETED", "CANCELLED", "FAILED"]
FINAL_STATES: tuple[FinalState, ...] = ("COMPLETED", "CANCELLED", "FAILED")
GPUS_PER_NODE = 8
"""GPUs per node of the replay cluster (deploy/local/slurm.sh's default)."""
DCGM_SAMPLE_S = 15.0
"""AcmeTrace's DCGM sampling period, seconds: one utilisation sample per GPU per period."""
SUMMARY_FILE = Path("traces/acmetrace_jobs/cluster_summary.csv")
CDF_FILE = Path("traces/acmetrace_cdf/acme_cdfs.csv")
_N = NormalDist()


class WorkloadError(ValueError):
    """A summary row or CDF that cannot calibrate the generator (missing, malformed, infeasible)."""


def default_data_dir() -> Path:
    """``../shared/data`` relative to the repository root (where the tests and benchmarks read it)."""
    return Path(__file__).resolve().parents[1].parent / "shared" / "data"


@dataclass(frozen=True)
class ClusterSummary:
    """One row of AcmeTrace's ``cluster_summary.csv`` (GPU jobs only). Times in seconds.

    ``*_rate`` are shares of GPU jobs by final state; ``*_gpu_time`` GPU-seconds by final state.
    """

    name: str
    gpu_job_num: int
    avg_run_time_s: float
    med_run_time_s: float
    max_run_time_s: float
    avg_que_time_s: float
    med_que_time_s: float
    avg_gpu_num: float
    med_gpu_num: float
    max_gpu: int
    complete_rate: float
    cancel_rate: float
    fail_rate: float
    complete_gpu_time: float
    cancel_gpu_time: float
    fail_gpu_time: float

    @property
    def gpu_seconds_per_job(self) -> float:
        """Total GPU-seconds of all final states ÷ GPU job count."""
        return (self.complete_gpu_time + self.cancel_gpu_time + self.fail_gpu_time) / self.gpu_job_num

    def state_shares(self) -> dict[FinalState, float]:
        """Job shares by final state, normalised to sum to 1 (the published ones sum to 1 ± 0.002)."""
        raw = {"COMPLETED": self.complete_rate, "CANCELLED": self.cancel_rate, "FAILED": self.fail_rate}
        total = sum(raw.values())
        return {s: raw[s] / total for s in FINAL_STATES}

    def state_gpu_time_shares(self) -> dict[FinalState, float]:
        """GPU-time shares by final state (published GPU-seconds by state ÷ their sum)."""
        raw = {"COMPLETED": self.complete_gpu_time, "CANCELLED": self.cancel_gpu_time,
               "FAILED": self.fail_gpu_time}
        total = sum(raw.values())
        return {s: raw[s] / total for s in FINAL_STATES}


def load_cluster_summary(cluster: str, data_dir: Path | None = None) -> ClusterSummary:
    """The row of ``cluster`` (``id`` column, e.g. ``"Seren"``) of AcmeTrace's cluster summary.

    Raises:
        WorkloadError: no such row, or a field needed here is empty or not a number (PAI has no
            final-state columns).
        OSError: the file cannot be read.
    """
    path = (data_dir or default_data_dir()) / SUMMARY_FILE
    with path.open(newline="") as f:
        rows = {r["id"]: r for r in csv.DictReader(f)}
    if cluster not in rows:
        raise WorkloadError(f"{path}: no cluster {cluster!r} (have {sorted(rows)})")
    r = rows[cluster]

    def num(key: str) -> float:
        try:
            v = float(r[key])
        except (KeyError, TypeError, ValueError):
            raise WorkloadError(f"{path}: {cluster}: {key} is missing or not a number ({r.get(key)!r})") from None
        if not math.isfinite(v) or v < 0:
            raise WorkloadError(f"{path}: {cluster}: {key} = {v} is not a finite non-negative number")
        return v

    return ClusterSummary(
        name=cluster, gpu_job_num=int(num("gpu_job_num")), avg_run_time_s=num("avg_run_time_gpu"),
        med_run_time_s=num("med_run_time_gpu"), max_run_time_s=num("max_run_time_gpu"),
        avg_que_time_s=num("avg_que_time_gpu"), med_que_time_s=num("med_que_time_gpu"),
        avg_gpu_num=num("avg_gpu_num"), med_gpu_num=num("med_gpu_num"), max_gpu=int(num("max_gpu")),
        complete_rate=num("complete_rate_gpu"), cancel_rate=num("cancel_rate_gpu"),
        fail_rate=num("fail_rate_gpu"), complete_gpu_time=num("complete_gpu_time"),
        cancel_gpu_time=num("cancel_gpu_time"), fail_gpu_time=num("fail_gpu_time"),
    )


@dataclass(frozen=True)
class UtilisationCdf:
    """A measured CDF of per-GPU utilisation samples: ``x`` in % (non-decreasing), ``cdf`` in
    0..1 (non-decreasing, last point 1)."""

    series: str
    x: tuple[float, ...]
    cdf: tuple[float, ...]

    @property
    def zero_share(self) -> float:
        """Share of samples at exactly 0 % (the CDF's value at the last ``x == 0`` point)."""
        return max((c for v, c in zip(self.x, self.cdf, strict=True) if v == 0.0), default=0.0)

    def quantile(self, u: float) -> float:
        """The utilisation (%) at cumulative share ``u`` in [0, 1]: the first point with
        ``cdf >= u``, linearly interpolated from the point before it."""
        if not 0.0 <= u <= 1.0:
            raise ValueError(f"u must be in [0, 1], got {u}")
        lo, hi = 0, len(self.cdf) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.cdf[mid] >= u:
                hi = mid
            else:
                lo = mid + 1
        if lo == 0 or self.cdf[lo] == self.cdf[lo - 1]:
            return self.x[lo]
        w = (u - self.cdf[lo - 1]) / (self.cdf[lo] - self.cdf[lo - 1])
        return self.x[lo - 1] + w * (self.x[lo] - self.x[lo - 1])


def load_utilisation_cdf(series: str, data_dir: Path | None = None) -> UtilisationCdf:
    """The CDF named ``series`` (e.g. ``"seren:GPU_UTIL"``) from AcmeTrace's ``acme_cdfs.csv``.

    Raises:
        WorkloadError: no such series, a non-number, x or cdf decreasing, cdf outside 0..100 % or
            not ending at 100 %.
        OSError: the file cannot be read.
    """
    path = (data_dir or default_data_dir()) / CDF_FILE
    xs: list[float] = []
    cs: list[float] = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            if row.get("series") != series:
                continue
            try:
                xs.append(float(row["x"]))
                cs.append(float(row["cdf_percent"]) / 100.0)
            except (TypeError, ValueError):
                raise WorkloadError(f"{path}: {series}: not a number in {row}") from None
    if not xs:
        raise WorkloadError(f"{path}: no series {series!r}")
    if any(b < a for a, b in zip(xs, xs[1:], strict=False)) or any(b < a for a, b in zip(cs, cs[1:], strict=False)):
        raise WorkloadError(f"{path}: {series}: x and cdf must be non-decreasing")
    if cs[0] < 0.0 or abs(cs[-1] - 1.0) > 1e-3:
        raise WorkloadError(f"{path}: {series}: cdf must lie in 0..100 % and end at 100 % (ends {cs[-1]:.4f})")
    cs[-1] = 1.0
    return UtilisationCdf(series=series, x=tuple(xs), cdf=tuple(cs))


# ---------------------------------------------------------------- fitting


def node_sizes(max_gpu: int) -> tuple[int, ...]:
    """Job sizes that fit 8-GPU nodes, up to ``max_gpu``: 1, 2, 4, 8, then 16, 32, ... (whole nodes).

    Raises:
        ValueError: ``max_gpu`` < 1.
    """
    if max_gpu < 1:
        raise ValueError(f"max_gpu must be >= 1, got {max_gpu}")
    out = [1]
    while out[-1] * 2 <= max_gpu:
        out.append(out[-1] * 2)
    return tuple(out)


def _bisect(f: Callable[[float], float], lo: float, hi: float, target: float, *, iters: int = 60) -> float:
    """x in [lo, hi] with increasing ``f(x) == target`` (bisection); the bound if out of range."""
    flo, fhi = f(lo), f(hi)
    if target <= flo:
        return lo
    if target >= fhi:
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        if f(mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _size_probs(sizes: tuple[int, ...], p_single: float, alpha: float) -> tuple[float, ...]:
    if len(sizes) == 1:
        return (1.0,)
    tail = [2.0 ** (-alpha * k) for k in range(1, len(sizes))]
    t = sum(tail)
    return (p_single, *((1 - p_single) * w / t for w in tail))


@dataclass(frozen=True)
class SizeLaw:
    """GPUs per job: ``sizes`` with probabilities ``probs`` (sum 1)."""

    sizes: tuple[int, ...]
    probs: tuple[float, ...]
    p_single: float
    alpha: float

    @property
    def mean(self) -> float:
        """Mean GPUs per job."""
        return sum(s * p for s, p in zip(self.sizes, self.probs, strict=True))

    @property
    def median(self) -> int:
        """Median GPUs per job (the smallest size whose cumulative share reaches 0.5)."""
        acc = 0.0
        for s, p in zip(self.sizes, self.probs, strict=True):
            acc += p
            if acc >= 0.5:
                return s
        return self.sizes[-1]

    def truncated(self, max_gpu: int) -> SizeLaw:
        """The same law without sizes above ``max_gpu``, renormalised.

        Raises:
            ValueError: ``max_gpu`` < 1.
        """
        if max_gpu < 1:
            raise ValueError(f"max_gpu must be >= 1, got {max_gpu}")
        keep = [(s, p) for s, p in zip(self.sizes, self.probs, strict=True) if s <= max_gpu]
        total = sum(p for _, p in keep)
        return SizeLaw(tuple(s for s, _ in keep), tuple(p / total for _, p in keep), self.p_single, self.alpha)


def fit_sizes(summary: ClusterSummary, p_single: float) -> SizeLaw:
    """The size law with ``P(1) = p_single`` whose mean is the published ``avg_gpu_num``.

    Raises:
        WorkloadError: ``p_single`` outside [0.5, 1) (the published median is one GPU on the
            clusters this fits), or no ``alpha`` in [-2, 4] reaches the published mean.
    """
    if not 0.5 <= p_single < 1.0:
        raise WorkloadError(f"p_single must be in [0.5, 1), got {p_single}")
    sizes = node_sizes(summary.max_gpu)

    def mean(alpha: float) -> float:
        # decreasing in alpha: bisect on -alpha
        return sum(s * p for s, p in zip(sizes, _size_probs(sizes, p_single, -alpha), strict=True))

    alpha = -_bisect(mean, -4.0, 2.0, summary.avg_gpu_num)
    law = SizeLaw(sizes, _size_probs(sizes, p_single, alpha), p_single, alpha)
    if abs(law.mean - summary.avg_gpu_num) > 1e-3 * summary.avg_gpu_num:
        raise WorkloadError(f"{summary.name}: no size law with P(1)={p_single} has mean {summary.avg_gpu_num}")
    return law


@dataclass(frozen=True)
class DurationLaw:
    """Run time given size g: ``ln d ~ N(mu + beta·log2 g, sigma)`` truncated to [``min_s``, ``max_s``]."""

    mu: float
    sigma: float
    beta: float
    min_s: float
    max_s: float

    def _bounds(self, g: int) -> tuple[float, float, float]:
        m = self.mu + self.beta * math.log2(g)
        return m, _N.cdf((math.log(self.min_s) - m) / self.sigma), _N.cdf((math.log(self.max_s) - m) / self.sigma)

    def mean(self, g: int) -> float:
        """Mean run time (s) of a job of g GPUs."""
        m, pa, pb = self._bounds(g)
        if pb - pa < 1e-12:  # all the mass is beyond a bound: the job takes that bound
            return self.min_s if m < math.log(self.min_s) else self.max_s
        a = (math.log(self.min_s) - m) / self.sigma
        b = (math.log(self.max_s) - m) / self.sigma
        return math.exp(m + self.sigma**2 / 2) * (_N.cdf(b - self.sigma) - _N.cdf(a - self.sigma)) / (pb - pa)

    def cdf(self, g: int, d: float) -> float:
        """P(run time <= d) for a job of g GPUs."""
        if d < self.min_s:
            return 0.0
        if d >= self.max_s:
            return 1.0
        m, pa, pb = self._bounds(g)
        if pb - pa < 1e-12:
            return 1.0 if m < math.log(self.min_s) else 0.0
        return (_N.cdf((math.log(d) - m) / self.sigma) - pa) / (pb - pa)

    def sample(self, g: int, u: float) -> float:
        """Run time (s) at uniform ``u`` in (0, 1) for a job of g GPUs (inverse CDF)."""
        m, pa, pb = self._bounds(g)
        if pb - pa < 1e-12:
            return self.min_s if m < math.log(self.min_s) else self.max_s
        p = min(max(pa + u * (pb - pa), 1e-300), 1 - 1e-16)
        return min(self.max_s, max(self.min_s, math.exp(m + self.sigma * _N.inv_cdf(p))))


def _mixture_median(law: DurationLaw, sizes: SizeLaw) -> float:
    def f(log_d: float) -> float:
        d = math.exp(log_d)
        return sum(p * law.cdf(g, d) for g, p in zip(sizes.sizes, sizes.probs, strict=True))

    return math.exp(_bisect(f, math.log(law.min_s), math.log(law.max_s), 0.5, iters=50))


def _mixture_means(law: DurationLaw, sizes: SizeLaw) -> tuple[float, float]:
    """(mean run time, mean GPU-seconds per job)."""
    means = [law.mean(g) for g in sizes.sizes]
    return (sum(p * m for p, m in zip(sizes.probs, means, strict=True)),
            sum(p * g * m for g, p, m in zip(sizes.sizes, sizes.probs, means, strict=True)))


def fit_durations(summary: ClusterSummary, sizes: SizeLaw, min_s: float = 1.0) -> DurationLaw:
    """The duration law whose mixture over ``sizes`` has the published median and mean run time
    and mean GPU-seconds per job (nested bisections: mu for the median, sigma for the mean, beta
    for the GPU-seconds).

    Raises:
        WorkloadError: the fitted law misses a target by more than 1 %.
    """
    max_s = summary.max_run_time_s

    def with_median(sigma: float, beta: float) -> DurationLaw:
        def below_median(neg_mu: float) -> float:  # P(d <= published median), decreasing in mu
            law = DurationLaw(-neg_mu, sigma, beta, min_s, max_s)
            return sum(p * law.cdf(g, summary.med_run_time_s) for g, p in zip(sizes.sizes, sizes.probs, strict=True))

        mu = -_bisect(below_median, -25.0, 10.0, 0.5, iters=40)
        return DurationLaw(mu, sigma, beta, min_s, max_s)

    def with_mean(beta: float) -> DurationLaw:
        sigma = _bisect(lambda s: _mixture_means(with_median(s, beta), sizes)[0], 0.05, 6.0,
                        summary.avg_run_time_s, iters=40)
        return with_median(sigma, beta)

    beta = _bisect(lambda b: _mixture_means(with_mean(b), sizes)[1], 0.0, 3.0,
                   summary.gpu_seconds_per_job, iters=30)
    law = with_mean(beta)
    mean, gpu_s = _mixture_means(law, sizes)
    median = _mixture_median(law, sizes)
    for name, got, want in (("median run time", median, summary.med_run_time_s),
                            ("mean run time", mean, summary.avg_run_time_s),
                            ("GPU-seconds per job", gpu_s, summary.gpu_seconds_per_job)):
        if abs(got - want) > 0.01 * want:
            raise WorkloadError(f"{summary.name}: fitted {name} {got:.1f} misses the published {want:.1f}")
    return law


@dataclass(frozen=True)
class WorkloadFit:
    """The fit of one cluster's row: its size law and duration law at the published scale."""

    summary: ClusterSummary
    sizes: SizeLaw
    durations: DurationLaw

    def describe(self) -> str:
        """One line naming the row and the fitted parameters (for a replay's output)."""
        d = self.durations
        return (f"AcmeTrace {self.summary.name}: GPUs/job P(1)={self.sizes.p_single:.2f}, "
                f"P(2^k)~2^(-{self.sizes.alpha:.3f}k) up to {self.sizes.sizes[-1]}; run time lognormal "
                f"ln d~N({d.mu:.3f}+{d.beta:.3f}*log2 g, {d.sigma:.3f}) in [{d.min_s:g}, {d.max_s:g}] s")


@lru_cache(maxsize=8)
def fit_workload(summary: ClusterSummary, p_single: float = 0.6) -> WorkloadFit:
    """Fit sizes then durations to ``summary`` (cached: the fit takes about a second).

    Raises:
        WorkloadError: see :func:`fit_sizes` and :func:`fit_durations`.
    """
    sizes = fit_sizes(summary, p_single)
    return WorkloadFit(summary, sizes, fit_durations(summary, sizes))


# ---------------------------------------------------------------- generation


@dataclass(frozen=True)
class TrainingJob:
    """One generated training job.

    Attributes:
        job_id: 0, 1, ... in submit order.
        submit_s: simulated seconds from the workload's start.
        gpus: GPUs asked (1, 2, 4, 8 on one node, or a multiple of 8 on whole nodes).
        duration_s: run time once started, simulated seconds (the job ends, or is cancelled, then).
        final_state: how it ends: COMPLETED (exit 0), FAILED (non-zero exit), CANCELLED (scancel).
        idle_holding: holds all its GPUs at 0 % utilisation for its whole life.
        carried_over: submitted before the workload's start and still running then (warm start):
            it starts at 0 with what is left of its run time; it did not queue in the replay.
    """

    job_id: int
    submit_s: float
    gpus: int
    duration_s: float
    final_state: FinalState
    idle_holding: bool
    carried_over: bool = False

    @property
    def nodes(self) -> int:
        """Nodes the job spans (1 up to 8 GPUs)."""
        return max(1, self.gpus // GPUS_PER_NODE)

    @property
    def gpus_per_node(self) -> int:
        """GPUs asked on each of its nodes."""
        return self.gpus // self.nodes


@dataclass
class TrainingWorkload:
    """A seeded generator of training jobs for a replay cluster of ``cluster_gpus`` GPUs.

    Args:
        fit: the fitted cluster row (:func:`fit_workload`).
        utilisation: the measured per-GPU ``GPU_UTIL`` CDF of the same cluster.
        cluster_gpus: GPUs of the replay cluster (> 0, a multiple of 8).
        load: offered load, GPU-seconds asked per second ÷ ``cluster_gpus`` (> 0).
        seed: any int; equal seeds give equal jobs and samples.
        max_gpu_share: the largest job is at most this share of ``cluster_gpus`` (0 < share <= 1;
            default 1024 of AcmeTrace Seren's 2288 GPUs, the paper's Table 1).
        idle_job_share: share (0..1) of the CDF's 0 % mass that comes from jobs idle for their
            whole life; the rest are zero samples inside working jobs.
        diurnal_amplitude: 0 (flat, default) .. < 1: arrival rate ``λ·(1 + A·cos(2π(t/86400 -
            peak_h/24)))``.
        diurnal_peak_h: hour of the simulated day with the most arrivals.

    Raises:
        ValueError: an argument outside its range.
    """

    fit: WorkloadFit
    utilisation: UtilisationCdf
    cluster_gpus: int
    load: float
    seed: int
    max_gpu_share: float = 1024 / 2288
    idle_job_share: float = 0.5
    diurnal_amplitude: float = 0.0
    diurnal_peak_h: float = 14.0
    sizes: SizeLaw = field(init=False)
    shares: dict[FinalState, float] = field(init=False)

    def __post_init__(self) -> None:
        if self.cluster_gpus <= 0 or self.cluster_gpus % GPUS_PER_NODE:
            raise ValueError(f"cluster_gpus must be a positive multiple of {GPUS_PER_NODE}, got {self.cluster_gpus}")
        if not self.load > 0:
            raise ValueError(f"load must be > 0, got {self.load}")
        if not 0 < self.max_gpu_share <= 1:
            raise ValueError(f"max_gpu_share must be in (0, 1], got {self.max_gpu_share}")
        if not 0 <= self.idle_job_share <= 1:
            raise ValueError(f"idle_job_share must be in [0, 1], got {self.idle_job_share}")
        if not 0 <= self.diurnal_amplitude < 1:
            raise ValueError(f"diurnal_amplitude must be in [0, 1), got {self.diurnal_amplitude}")
        cap = max(1, math.floor(self.max_gpu_share * self.cluster_gpus))
        self.sizes = self.fit.sizes.truncated(cap)
        self.shares = self.fit.summary.state_shares()

    @property
    def gpu_seconds_per_job(self) -> float:
        """Mean GPU-seconds per job on the replay cluster (sizes truncated)."""
        return _mixture_means(self.fit.durations, self.sizes)[1]

    @property
    def arrival_rate_per_s(self) -> float:
        """Mean arrivals per simulated second: ``load · cluster_gpus / gpu_seconds_per_job``."""
        return self.load * self.cluster_gpus / self.gpu_seconds_per_job

    @property
    def idle_job_probability(self) -> float:
        """P(a job holds its GPUs at 0 % all its life) = zero share × ``idle_job_share``."""
        return self.utilisation.zero_share * self.idle_job_share

    @property
    def working_zero_probability(self) -> float:
        """P(a sample of a working job's GPU is 0 %), so that all samples have the CDF's zero share."""
        z, q = self.utilisation.zero_share, self.idle_job_probability
        return 0.0 if q >= 1 else (z - q) / (1 - q)

    def idle_fraction(self, job: TrainingJob) -> float:
        """Expected share of ``job``'s allocated GPU-time at 0 % utilisation."""
        return 1.0 if job.idle_holding else self.working_zero_probability

    def _rate(self, t: float) -> float:
        a = self.diurnal_amplitude
        return self.arrival_rate_per_s * (1 + a * math.cos(2 * math.pi * (t / 86400 - self.diurnal_peak_h / 24)))

    def jobs(self, horizon_s: float, warm_start_s: float = 0.0) -> list[TrainingJob]:
        """Jobs submitted in [0, ``horizon_s``) simulated seconds, in submit order.

        With ``warm_start_s`` > 0 the arrivals start ``warm_start_s`` earlier: a job of that span
        still running at 0 (as if it had started at once) comes first, at ``submit_s`` 0 with the
        rest of its run time and ``carried_over`` set; the others of that span are dropped. So the
        replay starts from a cluster already busy instead of empty. Job ids stay in arrival order.

        Raises:
            ValueError: ``horizon_s`` or ``warm_start_s`` < 0.
        """
        if horizon_s < 0 or warm_start_s < 0:
            raise ValueError(f"horizon_s and warm_start_s must be >= 0, got {horizon_s}, {warm_start_s}")
        out = []
        for j in self._iter(horizon_s + warm_start_s):
            t = j.submit_s - warm_start_s
            if t >= 0:
                out.append(replace(j, submit_s=t))
            elif t + j.duration_s > 0:
                out.append(replace(j, submit_s=0.0, duration_s=t + j.duration_s, carried_over=True))
        out.sort(key=lambda j: (j.submit_s, j.job_id))
        return out

    def _iter(self, horizon_s: float) -> Iterator[TrainingJob]:
        rng = random.Random(f"gpupool-training-jobs:{self.seed}")
        peak = self.arrival_rate_per_s * (1 + self.diurnal_amplitude)
        cum: list[float] = []
        acc = 0.0
        for p in self.sizes.probs:
            acc += p
            cum.append(acc)
        states = list(self.shares)
        weights = [self.shares[s] for s in states]
        t, n = 0.0, 0
        while True:
            t += rng.expovariate(peak)
            if t >= horizon_s:
                return
            if rng.random() * peak > self._rate(t):
                continue  # thinned out (diurnal trough)
            g = self.sizes.sizes[min(len(cum) - 1, bisect.bisect_left(cum, rng.random()))]
            d = self.fit.durations.sample(g, rng.random())
            state = rng.choices(states, weights)[0]
            idle = rng.random() < self.idle_job_probability
            yield TrainingJob(n, t, g, d, state, idle)
            n += 1

    def gpu_utilisation(self, job: TrainingJob, gpu: int, samples: int) -> list[float]:
        """``samples`` DCGM ``GPU_UTIL`` values (%) of the job's ``gpu``-th GPU, one per
        :data:`DCGM_SAMPLE_S` of its run, deterministic in (seed, job, gpu).

        Raises:
            ValueError: ``gpu`` not in [0, job.gpus) or ``samples`` < 0.
        """
        if not 0 <= gpu < job.gpus:
            raise ValueError(f"gpu must be in [0, {job.gpus}), got {gpu}")
        if samples < 0:
            raise ValueError(f"samples must be >= 0, got {samples}")
        if job.idle_holding:
            return [0.0] * samples
        rng = random.Random(f"gpupool-gpu-util:{self.seed}:{job.job_id}:{gpu}")
        z, p0 = self.utilisation.zero_share, self.working_zero_probability
        out = []
        for _ in range(samples):
            if rng.random() < p0:
                out.append(0.0)
            else:
                out.append(self.utilisation.quantile(z + rng.random() * (1 - z)))
        return out

    def state_gpu_time_shares(self, jobs: list[TrainingJob]) -> dict[FinalState, float]:
        """GPU-time shares by final state among ``jobs`` (to set against the published ones)."""
        by: dict[FinalState, float] = dict.fromkeys(FINAL_STATES, 0.0)
        for j in jobs:
            by[j.final_state] += j.gpus * j.duration_s
        total = sum(by.values()) or 1.0
        return {s: v / total for s, v in by.items()}


def compression_for(simulated_s: float, wall_s: float) -> float:
    """The time-compression factor (simulated seconds per wall second) that fits ``simulated_s``
    into ``wall_s`` (e.g. one day into 20 minutes: 72).

    Raises:
        ValueError: either argument <= 0.
    """
    if simulated_s <= 0 or wall_s <= 0:
        raise ValueError(f"simulated_s and wall_s must be > 0, got {simulated_s}, {wall_s}")
    return simulated_s / wall_s
