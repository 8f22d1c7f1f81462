"""The time-compressed replay of generated training jobs on the real Slurm cluster, and its accounting.

Unit tests of the accounting on hand-made runs, then a short replay over the session's 4-node
cluster (deploy/local/slurm.sh): every job reaches the final state it was generated with, the
GPU-hours add up, and nothing is written to the working directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from simulator.replay import (
    JobRecord,
    ReplayRun,
    account,
    overlap,
    quantile,
    replay,
    sampled_gpu_seconds,
    start_latency,
)
from simulator.slurm_replay import SlurmClient, script_start
from simulator.training_jobs import TrainingJob, TrainingWorkload, fit_workload, load_cluster_summary, load_utilisation_cdf

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def _job(i: int, gpus: int = 1, carried: bool = False) -> TrainingJob:
    return TrainingJob(i, 0.0, gpus, 10.0, "COMPLETED", False, carried)


def test_quantile_is_nearest_rank() -> None:
    v = list(range(1, 101))
    assert [quantile(v, q) for q in (0.0, 0.5, 0.95, 0.99, 1.0)] == [1, 50, 95, 99, 100]
    assert quantile([3.0], 0.99) == 3.0
    assert quantile(list(range(1, 21)), 0.95) == 19  # ceil(19.0) = 19th
    with pytest.raises(ValueError):
        quantile([], 0.5)
    with pytest.raises(ValueError):
        quantile([1], 1.01)


def test_overlap_and_sampled_gpu_seconds() -> None:
    assert overlap((0, 10), (5, 20)) == 5 and overlap((0, 5), (5, 9)) == 0 and overlap((6, 7), (0, 10)) == 1
    samples = [(10.0, 8), (12.0, 4), (15.0, 0)]
    # 0 before the first sample; 8 for 2 s, 4 for 3 s, 0 to the end
    assert sampled_gpu_seconds(samples, (0.0, 20.0)) == 8 * 2 + 4 * 3
    assert sampled_gpu_seconds(samples, (11.0, 13.0)) == 8 + 4
    assert sampled_gpu_seconds([], (0.0, 5.0)) == 0


def test_script_start_reads_the_first_line(tmp_path: Path) -> None:
    (tmp_path / "1.out").write_text("started=1796142818.250000000\nother\n")
    (tmp_path / "2.out").write_text("nothing\n")
    (tmp_path / "3.out").write_text("started=soon\n")
    assert script_start(tmp_path / "1.out") == 1796142818.25
    assert script_start(tmp_path / "2.out") is None
    assert script_start(tmp_path / "3.out") is None
    assert script_start(tmp_path / "missing.out") is None


def test_account_clips_to_the_window_and_counts_pending_as_lower_bounds(tmp_path: Path) -> None:
    # window 100..200 wall s, compression 10, 8 GPUs
    recs = {
        "1": JobRecord(_job(1, 4), "1", 110.0, "COMPLETED", 110, 112, 150, began_wall=112.5),  # waited 2 s, held 4x38
        "2": JobRecord(_job(2, 2), "2", 90.0, "RUNNING", 90, 95, None),       # before the window: held 2x100
        "3": JobRecord(_job(3, 8), "3", 190.0, "CANCELLED", 190, None, 200, pending_at_end=True),  # waited 10+
        "4": JobRecord(_job(4, 2, carried=True), "4", 100.0, "COMPLETED", 100, 101, 120),  # warm start: held only
    }
    run = ReplayRun(recs, [(100.0, 6), (150.0, 2)], (100.0, 200.0), 8, 10.0, tmp_path)
    r = account(run, lambda j: 0.5 if j.job_id == 1 else 0.0)
    assert (r.jobs_submitted, r.jobs_started, r.jobs_pending_at_end) == (2, 1, 1)
    assert r.queue_delay_s == (20.0, 100.0, 100.0)  # 2 s and >= 10 s, x10
    assert r.began_delay_wall_s[0] == pytest.approx(2.5) and r.began_delay_s[0] == pytest.approx(25.0)
    held = 4 * 38 + 2 * 100 + 2 * 19
    assert r.allocated_gpu_hours == pytest.approx(held * 10 / 3600)
    assert r.window_gpu_hours == pytest.approx(8 * 100 * 10 / 3600)
    assert r.idle_unallocated_gpu_hours == pytest.approx((800 - held) * 10 / 3600)
    assert r.idle_unallocated_sampled_gpu_hours == pytest.approx((800 - (6 * 50 + 2 * 50)) * 10 / 3600)
    assert r.allocated_idle_gpu_hours == pytest.approx(0.5 * 4 * 38 * 10 / 3600)
    assert r.final_states == {"COMPLETED": 1, "CANCELLED": 1}


@pytest.mark.timeout(180)
def test_short_replay_on_slurm_adds_up(slurm_conf: Path, tmp_path: Path) -> None:
    """40 simulated minutes of Seren-calibrated jobs on 4 nodes (32 GPUs), compressed 120x (20 s)."""
    fit = fit_workload(load_cluster_summary("Seren", DATA))
    w = TrainingWorkload(fit, load_utilisation_cdf("seren:GPU_UTIL", DATA), cluster_gpus=32, load=0.8, seed=11)
    jobs = w.jobs(2400, 86400)
    assert {j.final_state for j in jobs} == {"COMPLETED", "CANCELLED", "FAILED"}, "pick a seed with every state"
    cwd_before = set(os.listdir("."))
    polls = []
    run = replay(SlurmClient(slurm_conf), jobs, compression=120.0, horizon_s=2400, cluster_gpus=32,
                 out_dir=tmp_path / "out", poll_s=0.5, observers=[polls.append])
    assert set(os.listdir(".")) == cwd_before  # job output went to out_dir only
    assert len(run.records) == len(jobs) and run.poll_errors == 0 and len(polls) >= 30
    assert all(p.gpus_used and sum(p.gpus_used.values()) <= 32 for p in polls)
    for r in run.records.values():
        assert r.end_time is not None or r.pending_at_end, r
        if r.cancel_sent_wall is None:  # ran its whole compressed run time before the end of the replay
            assert r.state == r.job.final_state, r
        elif r.state != "CANCELLED":  # cancelled at the end of the replay, as it ended by itself
            assert r.state == r.job.final_state and r.end_time <= r.cancel_sent_wall + 1.0, r  # Slurm's whole seconds
    assert sum(r.cancel_sent_wall is None for r in run.records.values()) >= len(jobs) // 3
    report = account(run, w.idle_fraction)
    assert report.jobs_submitted == sum(1 for j in jobs if not j.carried_over)
    assert 0 < report.allocated_gpu_hours <= report.window_gpu_hours
    assert report.idle_unallocated_gpu_hours + report.allocated_gpu_hours == pytest.approx(report.window_gpu_hours)
    assert 0 <= report.allocated_idle_gpu_hours <= report.allocated_gpu_hours
    # the jobs' Slurm times (1 s) and the polled GresUsed (0.5 s) tell the same allocation
    assert report.idle_unallocated_sampled_gpu_hours == pytest.approx(report.idle_unallocated_gpu_hours,
                                                                      abs=0.1 * report.window_gpu_hours)
    p50, p95, p99 = report.queue_delay_s
    assert 0 <= p50 <= p95 <= p99
    assert report.began_delay_wall_s[0] < 3.0  # a free slot starts a job within Slurm's scheduling latency


def test_yardstick_measures_slurm_start_latency(slurm_conf: Path, tmp_path: Path) -> None:
    latencies = start_latency(SlurmClient(slurm_conf), tmp_path, rounds=3)
    assert len(latencies) == 3 and all(0 < t < 5.0 for t in latencies)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({p.name for p in tmp_path.glob("*.out")})
