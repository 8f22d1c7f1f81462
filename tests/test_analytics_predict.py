"""Predicted availability: Kaplan–Meier curve, conditional promise, fallbacks, honesty."""

from __future__ import annotations

import random

import pytest

from analytics.predict import IdlePredictor, PredictorConfig, SurvivalCurve


def test_survival_without_censoring_is_the_empirical_tail() -> None:
    curve = SurvivalCurve([10.0 * i for i in range(1, 11)], [True] * 10)
    assert curve.survival(5) == 1.0
    assert curve.survival(10) == pytest.approx(0.9)
    assert curve.survival(55) == pytest.approx(0.5)
    assert curve.survival(100) == pytest.approx(0.0)
    # P(T >= 20) = 0.9; P(T > 20) = 0.8 < 0.9.
    assert curve.remaining(0, 0.9) == pytest.approx(20.0)
    # Given at least 50 s (6 of 10 runs lasted that long): the 50 s run may end now, 5/6 < 0.9 →
    # nothing to promise; at 0.5: 70 s keeps 3/6 = 0.5, 80 s keeps 2/6 → 30 s more.
    assert curve.remaining(50, 0.9) == pytest.approx(0.0)
    assert curve.remaining(50, 0.5) == pytest.approx(30.0)
    assert curve.mean_remaining(0) == pytest.approx(55.0)
    assert curve.mean_remaining(50) == pytest.approx(25.0)  # (0+10+...+50)/6
    assert curve.at_risk(50) == 6
    assert curve.survival_from(50) == pytest.approx(0.6)
    assert curve.remaining(100, 0.9) == pytest.approx(0.0)
    assert curve.remaining(101, 0.9) is None


def test_censored_runs_follow_kaplan_meier() -> None:
    # 10 ends; 20 censored; 30 ends; 40 ends.
    curve = SurvivalCurve([30.0, 10.0, 40.0, 20.0], [True, True, True, False])
    assert curve.survival(10) == pytest.approx(0.75)
    assert curve.survival(25) == pytest.approx(0.75)  # the censored run is not an end
    assert curve.survival(30) == pytest.approx(0.375)
    assert curve.survival(40) == pytest.approx(0.0)
    assert curve.remaining(0, 0.8) == pytest.approx(10.0)
    assert curve.remaining(15, 0.6) == pytest.approx(15.0)


def test_promise_never_extrapolates_past_the_longest_run() -> None:
    curve = SurvivalCurve([100.0] * 5, [False] * 5)  # all censored: no end ever seen
    assert curve.remaining(0, 0.9) == pytest.approx(100.0)
    assert curve.remaining(40, 0.9) == pytest.approx(60.0)
    assert curve.mean_remaining(40) == pytest.approx(60.0)


def test_curve_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        SurvivalCurve([1.0], [True, False])
    with pytest.raises(ValueError):
        SurvivalCurve([-1.0], [True])


def test_predictor_falls_back_from_gpu_to_pool_to_default() -> None:
    p = IdlePredictor(
        PredictorConfig(
            confidence=0.9,
            min_at_risk=5,
            default_remaining_s=60.0,
            default_confidence=0.5,
            history="gpu+pool",
        )
    )
    pred = p.predict("g1", since=1000.0, now=1100.0)
    assert (pred.basis, pred.idle_until, pred.confidence, pred.runs) == ("default", 1160.0, 0.5, 0)
    for i in range(10):  # other GPUs of the pool: runs of 200..290 s
        p.observe(f"other{i}", 200.0 + 10 * i)
    pred = p.predict("g1", since=1000.0, now=1100.0)  # age 100: all 10 pool runs outlast it
    assert pred.basis == "pool" and pred.confidence == 0.9
    assert pred.idle_until == pytest.approx(1100.0 + 110.0)  # S(210)/S(100)=0.9, S(220)=0.8
    for _ in range(6):
        p.observe("g1", 1000.0)
    pred = p.predict("g1", since=1000.0, now=1100.0)
    assert pred.basis == "gpu" and pred.idle_until == pytest.approx(2000.0)
    assert pred.expected_remaining_s == pytest.approx(900.0)
    # Older than every run the GPU and the pool ever had: no history applies.
    assert p.predict("g1", since=0.0, now=5000.0).basis == "default"


def test_predictor_keeps_pools_apart_and_validates() -> None:
    p = IdlePredictor(PredictorConfig(min_at_risk=1))
    p.observe("a", 500.0, pool="p1")
    assert p.predict("b", since=0, now=10, pool="p2").basis == "default"
    assert p.predict("b", since=0, now=10, pool="p1").basis == "pool"
    with pytest.raises(ValueError):
        p.observe("a", float("nan"))
    with pytest.raises(ValueError):
        PredictorConfig(confidence=1.0)


def test_history_is_bounded_per_gpu() -> None:
    p = IdlePredictor(PredictorConfig(max_runs_per_gpu=3))
    for d in (10.0, 20.0, 30.0, 40.0):
        p.observe("g", d)
    assert p.history_size("g") == 3


@pytest.mark.parametrize("age", [0.0, 120.0, 600.0])
def test_promises_hold_at_the_stated_confidence_on_fresh_runs(age: float) -> None:
    """Learn from 3,000 heavy-tailed runs (lognormal, median ~5 min); on 40,000 new runs that
    outlasted ``age``, the share still idle at the promised time is at least the confidence
    (less a sampling margin)."""
    rng = random.Random(7)
    p = IdlePredictor(PredictorConfig(confidence=0.9, max_runs_per_gpu=5000, history="gpu+pool"))
    for _ in range(3000):
        p.observe("g", rng.lognormvariate(5.7, 1.2))
    pred = p.predict("g", since=0.0, now=age)
    assert pred.basis == "gpu"
    promise = pred.idle_until  # absolute: the run must last at least this long
    fresh = [d for d in (rng.lognormvariate(5.7, 1.2) for _ in range(40_000)) if d > age]
    kept = sum(d >= promise for d in fresh) / len(fresh)
    assert kept >= 0.9 - 0.02
    assert promise > age  # and it promises something


def test_a_run_that_reached_an_age_is_a_peer_of_runs_that_ended_at_it() -> None:
    """Durations on a 60 s sampling grid; at an idle sample of age 120 s the runs that ended at
    exactly 120 s are peers (the current run may end at this sample too)."""
    # 100 runs: 10 end at 120 s, 90 last 600 s.
    curve = SurvivalCurve([120.0] * 10 + [600.0] * 90, [True] * 100)
    assert curve.at_risk(120.0) == 100
    # P(run >= 180 | run >= 120) = 0.9: a 95 % promise is impossible, a 90 % one reaches 600 s.
    assert curve.remaining(120.0, 0.95) == pytest.approx(0.0)
    assert curve.remaining(120.0, 0.9) == pytest.approx(480.0)
    # One sample later only the long runs remain: promised to their end.
    assert curve.remaining(180.0, 0.95) == pytest.approx(420.0)
    p = IdlePredictor(PredictorConfig(confidence=0.95, min_at_risk=5, history="gpu+pool"))
    for d in [120.0] * 10 + [600.0] * 90:
        p.observe("g", d)
    pred = p.predict("g", since=1000.0, now=1120.0)
    assert pred.basis == "gpu" and pred.idle_until == pytest.approx(1120.0)  # nothing promised


def test_default_reads_only_the_pools_recent_runs() -> None:
    """The default (``history="pool"``, 512 runs): a GPU's own long history is ignored, and only
    the pool's latest 512 runs count."""
    cfg = PredictorConfig(min_at_risk=5)
    assert (cfg.history, cfg.max_runs_per_pool) == ("pool", 512)
    p = IdlePredictor(cfg)
    for _ in range(10):
        p.observe("g1", 1000.0)  # g1's own runs: long
    pred = p.predict("g1", since=0.0, now=100.0)
    assert pred.basis == "pool" and pred.runs == 10
    for i in range(512):
        p.observe(f"other{i}", 50.0)  # the pool's newest 512 runs: all shorter than age 100
    assert p.history_size("g1") == 10  # per-GPU runs are still kept
    # The ten 1000 s runs left the pool's window: no history outlasts age 100.
    assert p.predict("g1", since=0.0, now=100.0).basis == "default"
    gp = IdlePredictor(PredictorConfig(min_at_risk=5, history="gpu+pool"))
    for _ in range(10):
        gp.observe("g1", 1000.0)
    assert gp.predict("g1", since=0.0, now=100.0).basis == "gpu"
    with pytest.raises(ValueError):
        PredictorConfig(history="gpu")  # type: ignore[arg-type]
