"""Idle detection: signal choice, unknown reasons, hysteresis, grades, staleness, idle runs."""

from __future__ import annotations

import pytest

from analytics.classify import (
    FB_USED,
    GPU_UTIL,
    GR_ENGINE_ACTIVE,
    SM_ACTIVE,
    IdleClassifier,
    IdleConfig,
)
from contracts import GpuSample, GpuState, IdleGrade
from tests.test_analytics_cases import case, mig_samples

CFG = IdleConfig(idle_threshold=0.05, busy_threshold=0.10, min_idle_s=60.0, stale_after_s=30.0)


def gpu(
    ts: float,
    fields: dict[str, float],
    invalid: dict[str, str] | None = None,
    gi: int | None = None,
    uuid: str = "GPU-a",
) -> GpuSample:
    return GpuSample(
        ts=ts,
        host="n1",
        gpu_uuid=uuid,
        gpu_instance_id=gi,
        model_name="NVIDIA H100 80GB HBM3",
        fields=fields,
        invalid=invalid or {},
    )


def feed(c: IdleClassifier, samples: list[GpuSample]) -> GpuState:
    st = None
    for s in samples:
        st = c.observe(s)
    assert st is not None
    return st.state


def idle_series(t0: float, n: int, step: float = 10.0, **extra: float) -> list[GpuSample]:
    return [gpu(t0 + i * step, {GR_ENGINE_ACTIVE: 0.0, FB_USED: 100, **extra}) for i in range(n)]


# --- signal choice -------------------------------------------------------------------------
def test_gr_engine_active_is_preferred_over_gpu_util() -> None:
    c = IdleClassifier(CFG)
    st = c.observe(gpu(0, {GR_ENGINE_ACTIVE: 0.8, GPU_UTIL: 0.0}))
    assert st is not None and st.state is GpuState.BUSY and st.reason == GR_ENGINE_ACTIVE
    # GPU_UTIL says 30 % but the engine is idle: profiling decides (30 < 50, not a stall).
    c2 = IdleClassifier(CFG)
    assert (
        feed(c2, [gpu(t, {GR_ENGINE_ACTIVE: 0.0, GPU_UTIL: 30.0, FB_USED: 0}) for t in range(0, 70, 10)])
        is GpuState.IDLE
    )


def test_sm_active_counts_when_gr_engine_active_is_absent() -> None:
    c = IdleClassifier(CFG)
    st = c.observe(gpu(0, {SM_ACTIVE: 0.5, GPU_UTIL: 0.0}))
    assert st is not None and st.state is GpuState.BUSY and st.reason == SM_ACTIVE


def test_gpu_util_used_only_where_profiling_does_not_exist() -> None:
    c = IdleClassifier(CFG)
    assert feed(c, [gpu(t, {GPU_UTIL: 0.0, FB_USED: 0}) for t in range(0, 70, 10)]) is GpuState.IDLE
    st = c.observe(gpu(70, {GPU_UTIL: 12.0}))
    assert st is not None and st.state is GpuState.BUSY and st.reason == GPU_UTIL
    # A GPU that has shown profiling fields and then lacks them is unknown, not judged by GPU_UTIL...
    c2 = IdleClassifier(CFG)
    c2.observe(gpu(0, {GR_ENGINE_ACTIVE: 0.5, GPU_UTIL: 50.0}))
    st = c2.observe(gpu(10, {GPU_UTIL: 0.0}))
    assert st is not None and st.state is GpuState.UNKNOWN and st.reason == "missing_field"
    # ...until it has shown none for prof_forget_s.
    c3 = IdleClassifier(IdleConfig(min_idle_s=0.0, prof_forget_s=20.0, stale_after_s=30.0))
    c3.observe(gpu(0, {GR_ENGINE_ACTIVE: 0.5}))
    assert c3.observe(gpu(10, {GPU_UTIL: 0.0})).state is GpuState.UNKNOWN  # type: ignore[union-attr]
    assert c3.observe(gpu(25, {GPU_UTIL: 0.0})).state is GpuState.IDLE  # type: ignore[union-attr]


def test_gpu05_mig_instances_use_gr_engine_active_and_missing_gpu_util_is_not_zero() -> None:
    assert "GR_ENGINE_ACTIVE" in str(case("GPU-05")["expected"])
    c = IdleClassifier(CFG)
    states = {}
    for t in (0.0, 30.0, 60.0):
        for gi, s in mig_samples("GPU-05", ts=t).items():
            st = c.observe(s)
            assert st is not None
            states[gi] = st
    assert states[13].state is GpuState.BUSY and states[5].state is GpuState.BUSY
    assert states[14].state is GpuState.IDLE and states[1].state is GpuState.IDLE
    assert states[13].activity == pytest.approx(0.784913)
    # A MIG instance without profiling fields is unknown — even with a GPU_UTIL of 0 repeated on it.
    gi13 = mig_samples("GPU-05", ts=70.0)[13]
    st = c.observe(gi13.model_copy(update={"fields": {GPU_UTIL: 0.0}}))
    assert st is not None and st.state is GpuState.UNKNOWN and st.reason == "missing_field"


def test_gpu06_mig_without_fb_used_is_idle_with_unknown_memory_and_reduced_confidence() -> None:
    c = IdleClassifier(CFG)
    for t in (0.0, 30.0, 60.0):
        for s in mig_samples("GPU-06", ts=t).values():
            c.observe(s)
    for gi in (7, 8, 9):
        st = c.status(f"gpu-node-074/GPU-0a1b2c3d-0000-1111-2222-333344445555/{gi}")
        assert st is not None and st.state is GpuState.IDLE
        assert st.fb_used_mib is None  # unknown, not 0
        assert st.grade is CFG.fb_unknown_grade and "fb_unknown" in st.reason
        assert st.confidence_factor == CFG.fb_unknown_confidence < 1.0


# --- unknown ------------------------------------------------------------------------------
def test_gpu14_prof_stalled_is_never_idle() -> None:
    c = IdleClassifier(CFG)
    for t in range(0, 600, 10):
        st = c.observe(gpu(t, {GR_ENGINE_ACTIVE: 0.0, GPU_UTIL: 99.0, FB_USED: 0}))
        assert st is not None and st.state is GpuState.UNKNOWN and st.reason == "prof_stalled"
    assert c.drain_runs() == []


@pytest.mark.parametrize("reason", ["sentinel", "out_of_range", "not_a_number"])
def test_rejected_activity_field_is_unknown_with_its_reason(reason: str) -> None:
    c = IdleClassifier(CFG)
    feed(c, idle_series(0, 7))
    assert c.status("n1/GPU-a").state is GpuState.IDLE  # type: ignore[union-attr]
    st = c.observe(gpu(70, {FB_USED: 100}, invalid={GR_ENGINE_ACTIVE: reason}))
    assert st is not None and st.state is GpuState.UNKNOWN and st.reason == reason
    [run] = c.drain_runs()
    assert run.censored and run.start == 0 and run.end == 60


def test_gpu03_out_of_range_gpu_util_is_not_used_for_idleness() -> None:
    assert "4294967295" in str(case("GPU-03")["input"])
    c = IdleClassifier(CFG)
    # Rejected by the collector...
    st = c.observe(gpu(0, {}, invalid={GPU_UTIL: "out_of_range"}))
    assert st is not None and st.state is GpuState.UNKNOWN and st.reason == "out_of_range"
    # ...or passed through by mistake: the classifier checks the range itself.
    st = c.observe(gpu(10, {GPU_UTIL: 4294967295}))
    assert st is not None and st.state is GpuState.UNKNOWN and st.reason == "out_of_range"
    st = c.observe(gpu(20, {GR_ENGINE_ACTIVE: 1.7}))
    assert st is not None and st.state is GpuState.UNKNOWN and st.reason == "out_of_range"
    st = c.observe(gpu(30, {GR_ENGINE_ACTIVE: float("nan")}))
    assert st is not None and st.state is GpuState.UNKNOWN and st.reason == "not_a_number"


def test_missing_activity_is_unknown() -> None:
    c = IdleClassifier(CFG)
    st = c.observe(gpu(0, {FB_USED: 0}))
    assert st is not None and st.state is GpuState.UNKNOWN and st.reason == "missing_field"


def test_stale_gpu_becomes_unknown_on_tick_and_ends_its_run() -> None:
    c = IdleClassifier(CFG)
    feed(c, idle_series(0, 8))  # idle from 0, last sample at 70
    assert c.tick(now=100.0) == []  # 30 s: not yet stale
    [st] = c.tick(now=100.5)
    assert st.state is GpuState.UNKNOWN and st.reason == "stale" and st.since == 100.0
    assert c.tick(now=200.0) == []  # reported once
    [run] = c.drain_runs()
    assert run.censored and run.duration_s == 70.0
    # A fresh idle sample does not make it idle at once: the idle window starts again.
    st2 = c.observe(gpu(210, {GR_ENGINE_ACTIVE: 0.0, FB_USED: 0}))
    assert st2 is not None and st2.state is GpuState.UNKNOWN and "idle_pending" in st2.reason


def test_gap_longer_than_stale_limit_restarts_the_idle_window() -> None:
    c = IdleClassifier(CFG)
    c.observe(gpu(0, {GR_ENGINE_ACTIVE: 0.0}))
    c.observe(gpu(20, {GR_ENGINE_ACTIVE: 0.0}))
    st = c.observe(gpu(61, {GR_ENGINE_ACTIVE: 0.0}))  # 41 s gap > 30 s: not idle since 0
    assert st is not None and st.state is GpuState.UNKNOWN
    assert c.observe(gpu(121, {GR_ENGINE_ACTIVE: 0.0})) is not None
    assert c.status("n1/GPU-a").state is not GpuState.IDLE  # type: ignore[union-attr]


# --- hysteresis ---------------------------------------------------------------------------
def test_single_idle_sample_never_makes_idle_and_one_busy_sample_makes_busy() -> None:
    c = IdleClassifier(CFG)
    st = c.observe(gpu(0, {GR_ENGINE_ACTIVE: 0.9}))
    assert st is not None and st.state is GpuState.BUSY
    st = c.observe(gpu(10, {GR_ENGINE_ACTIVE: 0.0, FB_USED: 0}))
    assert st is not None and st.state is GpuState.BUSY and "idle_pending" in st.reason
    for t in (20, 30, 40, 50, 60):
        assert feed(c, [gpu(t, {GR_ENGINE_ACTIVE: 0.0, FB_USED: 0})]) is GpuState.BUSY
    st = c.observe(gpu(70, {GR_ENGINE_ACTIVE: 0.0, FB_USED: 0}))  # 60 s of idle samples (10..70)
    assert st is not None and st.state is GpuState.IDLE and st.since == 10.0
    st = c.observe(gpu(80, {GR_ENGINE_ACTIVE: 0.10}))  # one sample at the busy threshold
    assert st is not None and st.state is GpuState.BUSY and st.since == 80.0
    [run] = c.drain_runs()
    assert not run.censored and (run.start, run.end) == (10.0, 70.0)


def test_between_thresholds_keeps_idle_idle_and_breaks_a_pending_window() -> None:
    c = IdleClassifier(CFG)
    feed(c, idle_series(0, 7))
    st = c.observe(gpu(70, {GR_ENGINE_ACTIVE: 0.07, FB_USED: 100}))
    assert st is not None and st.state is GpuState.IDLE and st.since == 0.0
    c2 = IdleClassifier(CFG)
    feed(c2, idle_series(0, 5))  # pending, 40 s
    assert feed(c2, [gpu(50, {GR_ENGINE_ACTIVE: 0.07})]) is GpuState.BUSY  # valid, above the idle threshold
    feed(c2, idle_series(60, 6))  # 60..110: only 50 s since the break
    assert c2.status("n1/GPU-a").state is not GpuState.IDLE  # type: ignore[union-attr]
    assert feed(c2, idle_series(120, 1)) is GpuState.IDLE


def test_out_of_order_and_repeated_samples_are_ignored() -> None:
    c = IdleClassifier(CFG)
    c.observe(gpu(10, {GR_ENGINE_ACTIVE: 0.9}))
    assert c.observe(gpu(10, {GR_ENGINE_ACTIVE: 0.0})) is None
    assert c.observe(gpu(5, {GR_ENGINE_ACTIVE: 0.0})) is None
    assert c.status("n1/GPU-a").state is GpuState.BUSY  # type: ignore[union-attr]


# --- grade --------------------------------------------------------------------------------
def test_grade_free_vs_memory_held_and_grade_changes_while_idle() -> None:
    c = IdleClassifier(CFG)
    st = None
    for t in range(0, 70, 10):
        st = c.observe(gpu(t, {GR_ENGINE_ACTIVE: 0.0, FB_USED: 30_000}))
    assert st is not None and st.state is GpuState.IDLE and st.grade is IdleGrade.MEMORY_HELD
    assert st.confidence_factor == 1.0
    st = c.observe(gpu(70, {GR_ENGINE_ACTIVE: 0.0, FB_USED: 300, "DCGM_FI_DEV_FB_FREE": 81_000}))
    assert st is not None and st.grade is IdleGrade.FREE and st.fb_total_mib == 81_300
    st = c.observe(gpu(80, {GR_ENGINE_ACTIVE: 0.9, FB_USED: 300}))
    assert st is not None and st.grade is None


def test_two_mig_instances_of_one_gpu_are_separate_gpus() -> None:
    c = IdleClassifier(CFG)
    for t in range(0, 70, 10):
        c.observe(gpu(t, {GR_ENGINE_ACTIVE: 0.0}, gi=1))
        c.observe(gpu(t, {GR_ENGINE_ACTIVE: 0.6}, gi=2))
    assert c.status("n1/GPU-a/1").state is GpuState.IDLE  # type: ignore[union-attr]
    assert c.status("n1/GPU-a/2").state is GpuState.BUSY  # type: ignore[union-attr]
    assert c.status("n1/GPU-a") is None


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        IdleConfig(idle_threshold=0.2, busy_threshold=0.1)
    with pytest.raises(ValueError):
        IdleConfig(stale_after_s=0)
    with pytest.raises(ValueError):
        IdleConfig(fb_unknown_confidence=0.0)
