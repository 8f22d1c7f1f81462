"""The harvest replay's lending figures (gpupool/harvest.py) from a hand-made lease log and training
starts, and the sites' diurnal demand: every figure has its right value, and the accounting adds up
(GPU-hours lent within the window, every Slurm preemption paired with a notice)."""

from __future__ import annotations

import math

import pytest

from contracts import LeaseKind, LeaseLogRecord, LeaseState
from gpupool.harvest import lease_spans, lending_figures
from simulator.sites import DiurnalDemand

W = (1000.0, 2000.0)
LOCATE = {f"n1/g{i}": ("n1", i) for i in range(8)}


def rec(lease: str, seq: int, state: LeaseState, ts: float, gpus: tuple[int, ...] = (0, 1), **kw: object) -> LeaseLogRecord:
    return LeaseLogRecord(
        lease_id=lease, site="edge-a", claim_id=f"c-{lease}", offer_id="o", gpus=[f"n1/g{i}" for i in gpus],
        state=state, ts=ts, granted_at=kw.pop("granted_at", 1100.0), expires_at=ts + 60, notice_seconds=2.0,
        seq=seq, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def preempted_lease() -> list[LeaseLogRecord]:
    """L1: 2 GPUs from 1100, Slurm preempts it at 1198 (deadline 1200), revoked at 1200.2."""
    return [
        rec("L1", 1, LeaseState.GRANTED, 1100.0),
        rec("L1", 2, LeaseState.RECLAIMING, 1198.3, reclaim_deadline=1200.0, reason="scheduler_preempted:77"),
        rec("L1", 3, LeaseState.REVOKED, 1200.2, reclaim_deadline=1200.0, reason="reclaim_deadline"),
    ]


def test_a_preemption_its_training_job_and_the_gpu_hours_lent() -> None:
    # training job 9 starts on GPU 0 at 1200.5 (GPU 1 is taken back and nobody uses it)
    starts = {"9": (1200.5, {"n1": (0, 5)}, True), "10": (1500.0, {"n1": (6,)}, False)}
    fig = lending_figures(preempted_lease(), starts, LOCATE, W, compression=3600.0)
    assert fig.leases == 1 and fig.preempted == 1
    assert fig.lent_gpu_hours == pytest.approx(2 * 100.2)  # 2 GPUs × 100.2 wall s × 3600 / 3600
    assert fig.preempt_to_running_s == [pytest.approx(2.5)]  # from 1198 (deadline - notice)
    assert (fig.gpus_taken_back, fig.gpus_needed, fig.disruption) == (2, 1, 2.0)
    assert fig.unnoticed_starts == 0 and fig.outlived_notice == 0 and fig.hold_lost == 0
    assert (fig.needed_gpupool, fig.needed_leased) == (1, 1)


def test_a_start_on_a_leased_gpu_before_any_notice_is_counted() -> None:
    starts = {"9": (1150.0, {"n1": (1,)}, True)}  # while L1 held GPU 1 and before its notice at 1198.3
    assert lending_figures(preempted_lease(), starts, LOCATE, W, 1.0).unnoticed_starts == 1
    starts = {"9": (1198.4, {"n1": (1,)}, True)}  # just after the notice: paired
    assert lending_figures(preempted_lease(), starts, LOCATE, W, 1.0).unnoticed_starts == 0


def test_a_training_start_past_the_notice_and_slack_is_not_matched() -> None:
    at = 1200.0 + 5.0  # deadline + match_slack_s: still matched; a hair later: not
    assert lending_figures(preempted_lease(), {"9": (at, {"n1": (0,)}, True)}, LOCATE, W, 1.0).gpus_needed == 1
    fig = lending_figures(preempted_lease(), {"9": (at + 0.01, {"n1": (0,)}, True)}, LOCATE, W, 1.0)
    assert fig.gpus_needed == 0 and fig.disruption == math.inf and fig.preempt_to_running_s == []
    # before the preemption: not the job that took the lease's GPUs
    fig = lending_figures(preempted_lease(), {"9": (1197.9, {"n1": (0,)}, True)}, LOCATE, W, 1.0)
    assert fig.gpus_needed == 0


def test_lent_gpu_hours_are_clipped_to_the_window_and_a_live_lease_counts_to_its_end() -> None:
    records = [rec("L2", 1, LeaseState.ACTIVE, 900.0, gpus=(3,), granted_at=900.0)]  # live past the window
    fig = lending_figures(records, {}, LOCATE, W, compression=2.0)
    assert fig.lent_gpu_hours == pytest.approx(1000.0 * 2.0 / 3600.0)
    assert fig.preempted == 0 and fig.disruption is None
    # a lease that ended before the window is not in it
    gone = [rec("L3", 1, LeaseState.GRANTED, 800.0, granted_at=800.0), rec("L3", 2, LeaseState.RELEASED, 999.0)]
    assert lending_figures(gone, {}, LOCATE, W, 1.0).leases == 0


def test_window_leases_broken_outlived_notices_and_at_risk() -> None:
    window = [  # promised until 1500, reclaimed for 1300: broken; released 2 s after its deadline: outlived
        rec("W1", 1, LeaseState.GRANTED, 1100.0, kind=LeaseKind.WINDOW, window_until=1500.0, min_until=1500.0),
        rec("W1", 2, LeaseState.GRANTED, 1200.0, kind=LeaseKind.WINDOW, window_until=1500.0, min_until=1500.0,
            at_risk_since=1200.0, reclaim_expected_at=1300.0, reason="at_risk"),
        rec("W1", 3, LeaseState.RECLAIMING, 1298.0, kind=LeaseKind.WINDOW, window_until=1500.0, min_until=1500.0,
            reclaim_deadline=1300.0, reason="scheduler_preempted:5;guarantee_broken"),
        rec("W1", 4, LeaseState.RELEASED, 1302.0, kind=LeaseKind.WINDOW, window_until=1500.0, min_until=1500.0,
            reclaim_deadline=1300.0, reason="site_release"),
    ]  # fmt: skip
    kept = [  # promised until 1500, reclaimed exactly at 1500: kept; released 1 s after: within tolerance
        rec("W2", 1, LeaseState.GRANTED, 1100.0, gpus=(4,), kind=LeaseKind.WINDOW, window_until=1500.0,
            min_until=1500.0),
        rec("W2", 2, LeaseState.RECLAIMING, 1498.0, gpus=(4,), kind=LeaseKind.WINDOW, window_until=1500.0,
            min_until=1500.0, reclaim_deadline=1500.0, reason="hold_lost:8"),
        rec("W2", 3, LeaseState.RELEASED, 1501.0, gpus=(4,), kind=LeaseKind.WINDOW, window_until=1500.0,
            min_until=1500.0, reclaim_deadline=1500.0, reason="site_release"),
    ]  # fmt: skip
    fig = lending_figures(window + kept, {}, LOCATE, W, 1.0)
    assert (fig.window_leases, fig.window_broken) == (2, 1)
    assert fig.outlived_notice == 1 and fig.at_risk == 1 and fig.hold_lost == 1 and fig.preempted == 1
    spans = {s.record.lease_id: s for s in lease_spans(window + kept)}
    assert spans["W1"].at_risk_since == 1200.0 and spans["W1"].ended_at == 1302.0 and spans["W1"].preempted
    assert not spans["W2"].preempted
    with pytest.raises(ValueError):
        lending_figures([], {}, LOCATE, (2.0, 2.0), 1.0)


def test_diurnal_demand_peaks_at_its_hour_and_bottoms_out_twelve_hours_away() -> None:
    d = DiurnalDemand(peak_gpus=20, trough_gpus=4, compression=3600.0, start_hour=8.0, peak_hour=14.0)
    assert d.gpus_at(6.0) == 20  # 6 wall s = 6 simulated hours: 14:00
    assert d.gpus_at(18.0) == 4  # 02:00
    assert d.gpus_at(0.0) == 12  # 08:00, half-way
    assert d.hour(20.0) == pytest.approx(4.0)  # wraps past midnight
    with pytest.raises(ValueError):
        DiurnalDemand(peak_gpus=3, trough_gpus=4, compression=1.0)
    with pytest.raises(ValueError):
        DiurnalDemand(peak_gpus=3, trough_gpus=1, compression=0.0)


def test_the_demo_summary_states_the_harvest_share_and_the_delay_added() -> None:
    from gpupool.demo_cli import _scheduler_rows

    rows = dict(_scheduler_rows({"enabled": True, "gpu_hours_idle": 8.0, "gpu_hours_lent": 6.0,
                                 "needed_lent_wait_p50_s": 5.25, "free_wait_p50_s": 0.75}))  # fmt: skip
    assert rows["harvest: share of idle GPU-hours lent"] == "75%"
    assert rows["harvest: training delay added by lending (p50, wall)"].startswith("+4.5 s")
    rows = dict(_scheduler_rows({"enabled": True, "gpu_hours_idle": 0.0, "gpu_hours_lent": 0.0}))
    assert rows["harvest: share of idle GPU-hours lent"] == "—"
    assert rows["harvest: training delay added by lending (p50, wall)"] == "—"


def test_an_outlived_lease_whose_gpu_training_already_ran_on_is_told_apart() -> None:
    """L1's log ends 1.5 s after its deadline (outlived); a training job ran on its GPU 0 from
    1199.5, before that end: the GPU was back, only the record came late. L2 outlived its
    deadline with no training start on its GPU before its end (one at its end, 1301.5)."""
    late = [
        rec("L1", 1, LeaseState.GRANTED, 1100.0, gpus=(0,)),
        rec("L1", 2, LeaseState.RECLAIMING, 1198.3, gpus=(0,), reclaim_deadline=1200.0, reason="scheduler_preempted:7"),
        rec("L1", 3, LeaseState.REVOKED, 1201.5, gpus=(0,), reclaim_deadline=1200.0, reason="reclaim_deadline"),
        rec("L2", 1, LeaseState.GRANTED, 1100.0, gpus=(1,)),
        rec("L2", 2, LeaseState.RECLAIMING, 1298.3, gpus=(1,), reclaim_deadline=1300.0, reason="scheduler_preempted:8"),
        rec("L2", 3, LeaseState.REVOKED, 1301.5, gpus=(1,), reclaim_deadline=1300.0, reason="reclaim_deadline"),
    ]  # fmt: skip
    starts = {"t1": (1199.5, {"n1": (0,)}, True), "t2": (1301.5, {"n1": (1,)}, True)}
    fig = lending_figures(late, starts, LOCATE, W, 1.0)
    assert (fig.outlived_notice, fig.outlived_gpu_back) == (2, 1)
    # a start before the preemption (deadline - notice) is not the GPU coming back
    early = {"t1": (1197.9, {"n1": (0,)}, True)}
    assert lending_figures(late, early, LOCATE, W, 1.0).outlived_gpu_back == 0
    assert lending_figures(late, {"t1": (1198.0, {"n1": (0,)}, True)}, LOCATE, W, 1.0).outlived_gpu_back == 1
