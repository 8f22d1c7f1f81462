"""The training-job generator against AcmeTrace's published Seren statistics (cluster_summary.csv,
acme_cdfs.csv): the fit, the samples, the replay-cluster truncation, the warm start, the seeds."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from simulator.training_jobs import (
    TrainingJob,
    TrainingWorkload,
    UtilisationCdf,
    WorkloadError,
    compression_for,
    fit_sizes,
    fit_workload,
    load_cluster_summary,
    load_utilisation_cdf,
    node_sizes,
)

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="module")
def seren():  # type: ignore[no-untyped-def]
    return fit_workload(load_cluster_summary("Seren", DATA))


@pytest.fixture(scope="module")
def cdf() -> UtilisationCdf:
    return load_utilisation_cdf("seren:GPU_UTIL", DATA)


@pytest.fixture(scope="module")
def full_scale(seren, cdf) -> list[TrainingJob]:  # type: ignore[no-untyped-def]
    """20,000 jobs on Seren's own size (2288 GPUs: sizes up to 1024, as published)."""
    w = TrainingWorkload(seren, cdf, cluster_gpus=2288, load=0.8, seed=3)
    jobs = w.jobs(20_000 / w.arrival_rate_per_s)
    assert 19_000 < len(jobs) < 21_000
    return jobs


def test_summary_row_is_read_as_published() -> None:
    s = load_cluster_summary("Seren", DATA)
    assert (s.gpu_job_num, s.avg_gpu_num, s.med_run_time_s, s.max_gpu) == (663813, 5.68, 122.0, 1024)
    assert s.gpu_seconds_per_job == pytest.approx((4560592618 + 14274584510 + 2675447459) / 663813)
    assert sum(s.state_shares().values()) == pytest.approx(1.0)
    with pytest.raises(WorkloadError, match="no cluster"):
        load_cluster_summary("Nope", DATA)
    with pytest.raises(WorkloadError, match="complete_rate_gpu"):
        load_cluster_summary("PAI", DATA)  # PAI has no final-state columns


def test_node_sizes_fit_eight_gpu_nodes() -> None:
    assert node_sizes(1) == (1,)
    assert node_sizes(8) == (1, 2, 4, 8)
    assert node_sizes(16)[-1] == 16 and node_sizes(15)[-1] == 8
    assert node_sizes(1024)[-1] == 1024 and node_sizes(1023)[-1] == 512
    assert all(s % 8 == 0 for s in node_sizes(1024) if s > 8)
    with pytest.raises(ValueError):
        node_sizes(0)


def test_fit_reproduces_the_published_moments(seren) -> None:  # type: ignore[no-untyped-def]
    s = seren.summary
    assert seren.sizes.mean == pytest.approx(s.avg_gpu_num, rel=1e-3)
    assert seren.sizes.median == 1 and seren.sizes.probs[0] == 0.6
    assert seren.sizes.sizes[-1] == s.max_gpu and sum(seren.sizes.probs) == pytest.approx(1.0)
    d = seren.durations
    means = [d.mean(g) for g in seren.sizes.sizes]
    mean = sum(p * m for p, m in zip(seren.sizes.probs, means, strict=True))
    gpu_s = sum(p * g * m for g, p, m in zip(seren.sizes.sizes, seren.sizes.probs, means, strict=True))
    below = sum(p * d.cdf(g, s.med_run_time_s) for g, p in zip(seren.sizes.sizes, seren.sizes.probs, strict=True))
    assert mean == pytest.approx(s.avg_run_time_s, rel=0.01)
    assert gpu_s == pytest.approx(s.gpu_seconds_per_job, rel=0.01)
    assert below == pytest.approx(0.5, abs=0.005)
    assert d.beta > 0  # bigger jobs run longer: the published GPU-time needs it
    assert d.max_s == s.max_run_time_s and d.cdf(1, s.max_run_time_s) == 1.0 and d.cdf(1, 0.5) == 0.0


def test_p_single_must_keep_the_median_at_one_gpu() -> None:
    s = load_cluster_summary("Seren", DATA)
    assert fit_sizes(s, 0.5).median == 1
    for bad in (0.49, 1.0):
        with pytest.raises(WorkloadError):
            fit_sizes(s, bad)


def test_samples_match_the_published_statistics(full_scale) -> None:  # type: ignore[no-untyped-def]
    s = load_cluster_summary("Seren", DATA)
    gpus = [j.gpus for j in full_scale]
    runs = [j.duration_s for j in full_scale]
    assert statistics.median(gpus) == 1
    assert statistics.fmean(gpus) == pytest.approx(s.avg_gpu_num, rel=0.15)
    assert max(gpus) <= s.max_gpu and all(g in node_sizes(1024) for g in gpus)
    assert statistics.median(runs) == pytest.approx(s.med_run_time_s, rel=0.08)
    # heavy tail (mean 11.6x the median): the sample mean of 20k jobs is within 30 %
    assert statistics.fmean(runs) == pytest.approx(s.avg_run_time_s, rel=0.3)
    assert 1.0 <= min(runs) and max(runs) <= s.max_run_time_s
    shares = s.state_shares()
    for state, share in shares.items():
        assert sum(j.final_state == state for j in full_scale) / len(full_scale) == pytest.approx(share, abs=0.015)


def test_same_seed_same_jobs_other_seed_other_jobs(seren, cdf) -> None:  # type: ignore[no-untyped-def]
    def make(seed: int) -> list[TrainingJob]:
        return TrainingWorkload(seren, cdf, cluster_gpus=128, load=0.8, seed=seed).jobs(4 * 3600, 86400)

    assert make(7) == make(7)
    assert make(7) != make(8)
    w = TrainingWorkload(seren, cdf, cluster_gpus=128, load=0.8, seed=7)
    job = next(j for j in make(7) if not j.idle_holding and j.gpus >= 2)
    assert w.gpu_utilisation(job, 1, 50) == w.gpu_utilisation(job, 1, 50)
    assert w.gpu_utilisation(job, 0, 50) != w.gpu_utilisation(job, 1, 50)


def test_replay_cluster_truncates_sizes_and_sets_the_rate_from_the_load(seren, cdf) -> None:  # type: ignore[no-untyped-def]
    w = TrainingWorkload(seren, cdf, cluster_gpus=128, load=0.8, seed=1)
    assert w.sizes.sizes == (1, 2, 4, 8, 16, 32)  # 1024/2288 of 128 GPUs = 57
    assert sum(w.sizes.probs) == pytest.approx(1.0)
    assert TrainingWorkload(seren, cdf, cluster_gpus=128, load=0.8, seed=1, max_gpu_share=0.5).sizes.sizes[-1] == 64
    assert TrainingWorkload(seren, cdf, cluster_gpus=128, load=0.8, seed=1,
                            max_gpu_share=63.9 / 128).sizes.sizes[-1] == 32
    assert w.arrival_rate_per_s == pytest.approx(0.8 * 128 / w.gpu_seconds_per_job)
    horizon = 2000 / w.arrival_rate_per_s
    n = len(w.jobs(horizon))
    assert abs(n - 2000) < 4 * math.sqrt(2000)  # Poisson count
    for bad in ({"cluster_gpus": 12}, {"cluster_gpus": 0}, {"load": 0.0}, {"max_gpu_share": 0.0},
                {"idle_job_share": 1.5}, {"diurnal_amplitude": 1.0}):
        kwargs = {"cluster_gpus": 128, "load": 0.8, "seed": 1, **bad}
        with pytest.raises(ValueError):
            TrainingWorkload(seren, cdf, **kwargs)  # type: ignore[arg-type]


def test_jobs_above_eight_gpus_take_whole_nodes(full_scale) -> None:  # type: ignore[no-untyped-def]
    for j in full_scale:
        assert j.nodes * j.gpus_per_node == j.gpus
        assert (j.nodes == 1 and j.gpus <= 8) or (j.gpus_per_node == 8 and j.nodes == j.gpus // 8)


def test_utilisation_follows_the_measured_cdf_with_idle_jobs(seren, cdf) -> None:  # type: ignore[no-untyped-def]
    assert cdf.zero_share == pytest.approx(0.3143, abs=1e-3)  # PROVENANCE.md: ~31 % at 0
    assert cdf.quantile(0.0) == 0.0 and cdf.quantile(1.0) == 100.0
    with pytest.raises(ValueError):
        cdf.quantile(1.01)
    w = TrainingWorkload(seren, cdf, cluster_gpus=128, load=0.8, seed=5)
    jobs = w.jobs(3 * 86400)
    idle = [j for j in jobs if j.idle_holding]
    assert len(idle) / len(jobs) == pytest.approx(w.idle_job_probability, abs=0.03)
    assert w.gpu_utilisation(idle[0], 0, 20) == [0.0] * 20 and w.idle_fraction(idle[0]) == 1.0
    # one sample per job-GPU, weighted equally: the zero share and the median of the CDF come back
    samples = [u for j in jobs for g in range(min(j.gpus, 2)) for u in w.gpu_utilisation(j, g, 4)]
    assert sum(u == 0.0 for u in samples) / len(samples) == pytest.approx(cdf.zero_share, abs=0.03)
    assert statistics.median(samples) == pytest.approx(cdf.quantile(0.5), abs=3)
    assert all(0.0 <= u <= 100.0 for u in samples)
    with pytest.raises(ValueError):
        w.gpu_utilisation(jobs[0], jobs[0].gpus, 1)


def test_warm_start_carries_running_jobs_to_time_zero(seren, cdf) -> None:  # type: ignore[no-untyped-def]
    w = TrainingWorkload(seren, cdf, cluster_gpus=128, load=0.8, seed=2)
    cold = w.jobs(3600)
    warm = w.jobs(3600, 86400)
    assert not any(j.carried_over for j in cold)
    carried = [j for j in warm if j.carried_over]
    assert carried and all(j.submit_s == 0.0 and j.duration_s > 0 for j in carried)
    assert all(0 <= j.submit_s < 3600 for j in warm)
    assert [j.submit_s for j in warm] == sorted(j.submit_s for j in warm)
    # what is carried is about the load's share of the cluster (an M/G/inf occupancy, no queue)
    assert 0.3 * 0.8 * 128 < sum(j.gpus for j in carried) < 2.5 * 0.8 * 128


def test_diurnal_amplitude_moves_arrivals_to_the_peak(seren, cdf) -> None:  # type: ignore[no-untyped-def]
    w = TrainingWorkload(seren, cdf, cluster_gpus=128, load=0.8, seed=4, diurnal_amplitude=0.8, diurnal_peak_h=14)
    jobs = w.jobs(4 * 86400)
    peak = sum(1 for j in jobs if 12 <= (j.submit_s / 3600) % 24 < 16)
    trough = sum(1 for j in jobs if 0 <= (j.submit_s / 3600) % 24 < 4)
    assert peak > 3 * trough


def test_compression_fits_a_day_into_twenty_minutes() -> None:
    assert compression_for(86400, 1200) == 72.0
    with pytest.raises(ValueError):
        compression_for(86400, 0)
