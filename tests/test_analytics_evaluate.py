"""``analytics.evaluate`` and ``gpupool analytics evaluate``: the metric arithmetic on a hand-made
3-pod trace, the trace reader, and the targets on a slice of the real Alibaba GenAI 2026 trace."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analytics.cli import app
from analytics.evaluate import (
    DUTY_CYCLE_FILE,
    MEMORY_FILE,
    RECOMMENDED,
    EvaluationConfig,
    PodSeries,
    TraceReadError,
    Variant,
    VariantResult,
    evaluate,
    read_trace,
    service_variant,
)
from analytics.predict import PredictorConfig

TRACE_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces" / "alibaba_genai_2026"
STEP = 57.0
T0 = 1_000_000.0 * STEP  # on the grid


def _pod(name: str, first: int, utils: list[float]) -> PodSeries:
    ts = tuple(T0 + STEP * (first + k) for k in range(len(utils)))
    return PodSeries(pod=name, ts=ts, util_pct=tuple(utils), fb_used_mib=(1000.0,) * len(utils))


B, I = 50.0, 0.0  # noqa: E741 — busy, idle duty cycle (%), short to keep the traces readable


def _three_pods() -> list[PodSeries]:
    """Steps k = 0..14 (t_k = T0 + 57 k).

    * a: busy at 0, 5, 10; idle runs 1-4, 6-9, 11-14 (each 171 s, first to last idle sample).
    * b: busy 0-5, idle 6-7, 7 % at 8 (inside the hysteresis band: the classifier keeps it idle,
      the ground truth says not idle), idle at 9, busy at 10.
    * c: first seen busy at 9, idle 10-12, then gone (its last sample is at 12).
    """
    return [
        _pod("a", 0, [B, I, I, I, I, B, I, I, I, I, B, I, I, I, I]),
        _pod("b", 0, [B, B, B, B, B, B, I, I, 7.0, I, B]),
        _pod("c", 9, [B, I, I, I]),
    ]


CFG = EvaluationConfig(min_at_risk=1)  # 57 s to idle, 95 %, one run is enough history


def test_metric_arithmetic_renew_each_sample() -> None:
    """Worked by hand (predictor: a run of age x, history all 171 s, promises up to 171 s):

    * a, run 1 (k 1-4): no run has ended yet → only the 50 % default → no promise.
      run 2: k7 → until t9, k8 → until t9, k9 → 0 s: nothing. Both held. run 3 (k11-14): k12,
      k13 → until t14: held. Offerable idle samples: k8, k9, k13, k14.
    * b: k7 (pool: a's 171 s run) → until t9; broken by the 7 % sample at k8. k8 (classifier
      still idle) → until t9: held (k9 idle). Offerable: k9 (offer made at k8).
    * c: k11 (pool: three 171 s runs) → until t13, k12 → until t13: past c's last sample, not
      broken → unverifiable. Offerable: k12.
    """
    ev = evaluate(_three_pods(), CFG, [Variant("gpu+pool", "gpu+pool")])
    (r,) = ev.results
    assert (ev.pods, ev.samples, ev.idle_runs) == (3, 30, 3)  # a run 1, a run 2, b (a 3, c open)
    assert r.idle_samples == 12 + 3 + 3  # b's 7 % sample is not idle
    assert r.offerable_samples == 4 + 1 + 1
    assert (r.promises, r.broken, r.unverifiable) == (4 + 2 + 2, 1, 2)
    assert r.promised_s == pytest.approx(4 * 114.0 + 4 * 57.0)
    assert r.offerable_share == pytest.approx(6 / 18)
    assert r.broken_share == pytest.approx(1 / 6)  # unverifiable promises are left out
    assert r.mean_promised_s == pytest.approx(684.0 / 8)
    assert r.idle_gpu_hours == pytest.approx(18 * STEP / 3600)
    assert r.offerable_gpu_hours == pytest.approx(6 * STEP / 3600)


def test_metric_arithmetic_renew_at_expiry() -> None:
    """The same trace, a promise renewed only when it ends: a k7 (held, stands through k9), a k12
    (held), b k7 (broken; the offer still stands at k9 since the classifier never saw busy),
    c k11 (unverifiable). Offerable samples are the same six."""
    ev = evaluate(_three_pods(), CFG, [Variant("expiry", "gpu+pool", "renew_at_expiry")])
    (r,) = ev.results
    assert (r.promises, r.broken, r.unverifiable) == (4, 1, 1)
    assert r.offerable_samples == 6 and r.idle_samples == 18
    assert r.broken_share == pytest.approx(1 / 3)
    assert r.promised_s == pytest.approx(4 * 114.0)


def test_only_runs_that_ended_before_a_prediction_are_used() -> None:
    """Online, a's first run gets no promise (nothing has ended yet); the hindsight variant, fed
    every run before the replay, promises at k2 and k3 of it: the replay does not peek."""
    online, hindsight = evaluate(
        _three_pods(),
        CFG,
        [Variant("online", "gpu+pool"), Variant("hindsight", "gpu+pool", hindsight=True)],
    ).results
    assert hindsight.promises == online.promises + 2
    assert hindsight.offerable_samples == online.offerable_samples + 2


def test_history_variants_differ_only_in_what_they_learn_from() -> None:
    """``gpu`` only: b and c never have history of their own, so only a is promised."""
    (r,) = evaluate(_three_pods(), CFG, [Variant("gpu", "gpu")]).results
    assert (r.promises, r.broken, r.offerable_samples) == (4, 0, 4)


def test_the_service_row_follows_the_predictor_default() -> None:
    """:data:`RECOMMENDED` is what the service runs: built from :class:`PredictorConfig`'s
    defaults, and it moves with them."""
    d = PredictorConfig()
    assert (RECOMMENDED.history, RECOMMENDED.pool_runs, RECOMMENDED.policy) == (
        d.history,
        d.max_runs_per_pool,
        "renew_each_sample",
    )
    assert RECOMMENDED == service_variant(d)
    other = service_variant(PredictorConfig(history="gpu+pool", max_runs_per_pool=64))
    assert (other.history, other.pool_runs) == ("gpu+pool", 64) and other.name != RECOMMENDED.name


def test_pool_history_reads_the_pool_level_only() -> None:
    """Every run of the 3-pod trace lasts 171 s, so reading the pool only gives exactly the
    hand-worked promises of ``gpu+pool`` (a's runs are in the pool as well), while ``gpu`` alone
    promises only for a (b and c have no run of their own)."""
    pool, gpu = evaluate(_three_pods(), CFG, [Variant("pool", "pool"), Variant("gpu", "gpu")]).results
    assert (pool.promises, pool.broken, pool.unverifiable, pool.offerable_samples) == (8, 1, 2, 6)
    assert (gpu.promises, gpu.broken, gpu.offerable_samples) == (4, 0, 4)


def test_evaluate_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        evaluate([_pod("a", 0, [I]), _pod("a", 5, [I])], CFG)
    with pytest.raises(ValueError):
        Variant("x", "weekday")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Variant("x", "pool", pool_runs=0)
    with pytest.raises(ValueError):
        EvaluationConfig(confidence=1.0)
    with pytest.raises(ValueError):
        PodSeries("p", (2.0, 1.0), (0.0, 0.0), (None, None))


# --- the reader ---------------------------------------------------------------------------------
def _tarball(path: Path, member: str, text: str) -> None:
    data = text.encode()
    with tarfile.open(path, "w:gz") as tf:
        info = tarfile.TarInfo(member)
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))


def test_reader_joins_memory_and_counts_dropped_rows(tmp_path: Path) -> None:
    _tarball(
        tmp_path / DUTY_CYCLE_FILE,
        "pod_gpu_duty_cycle_anon.csv",
        "value,timestamp_anon,container_ip\n"
        "0,114,pb\n0,57,pa\n30,114,pa\n,171,pa\n12,57,pa\n5,57,pc\n",
    )
    _tarball(  # other column order; a memory-only pod; pa has no memory at 114
        tmp_path / MEMORY_FILE,
        "pod_gpu_memory_used_bytes_anon.csv",
        "container_ip,value,timestamp_anon\npa,2097152,57\npb,1048576,114\npz,1,57\n",
    )
    trace = read_trace(tmp_path)
    assert trace.pods_in_trace == 3
    assert trace.dropped_rows == {"empty_value": 1, "duplicate": 1}
    a, b, c = trace.pods
    assert (a.pod, a.ts, a.util_pct, a.fb_used_mib) == ("pa", (57.0, 114.0), (0.0, 30.0), (2.0, None))
    assert (b.pod, b.fb_used_mib) == ("pb", (1.0,))
    assert c.fb_used_mib == (None,)
    assert [p.pod for p in read_trace(tmp_path, slice_pods=2).pods] == ["pa", "pb"]


def test_reader_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_trace(tmp_path)
    (tmp_path / DUTY_CYCLE_FILE).write_bytes(b"not a tarball")
    _tarball(tmp_path / MEMORY_FILE, "m.csv", "value,timestamp_anon,container_ip\n")
    with pytest.raises(TraceReadError, match="not a readable tar"):
        read_trace(tmp_path)
    _tarball(tmp_path / DUTY_CYCLE_FILE, "readme.txt", "hello")
    with pytest.raises(TraceReadError, match="one .csv member"):
        read_trace(tmp_path)
    _tarball(tmp_path / DUTY_CYCLE_FILE, "d.csv", "value,container_ip\n1,p\n")
    with pytest.raises(TraceReadError, match="columns"):
        read_trace(tmp_path)
    with pytest.raises(ValueError):
        read_trace(tmp_path, slice_pods=0)


# --- the real trace -----------------------------------------------------------------------------
SLICE = 60


@pytest.fixture(scope="module")
def real_slice() -> VariantResult:
    """The recommended variant at the defaults (95 %, 57 s) on the first 60 pods of the trace."""
    if not (TRACE_DIR / DUTY_CYCLE_FILE).is_file():
        pytest.fail(f"the Alibaba trace is missing: {TRACE_DIR}")
    trace = read_trace(TRACE_DIR, slice_pods=SLICE)
    assert trace.pods_in_trace == 143 and len(trace.pods) == SLICE
    (result,) = evaluate(trace.pods, EvaluationConfig(), [RECOMMENDED]).results
    return result


def test_promises_at_95_percent_break_at_most_5_percent(real_slice: VariantResult) -> None:
    """The broken-share target holds for the recommended variant, and the offerable share is at
    least what was reached (17.0 % on this slice, 24.8 % on the whole trace; target 60 %)."""
    r = real_slice
    assert r.promises > 1000 and r.idle_samples > 40_000
    assert r.broken_share <= 0.05
    assert r.offerable_share >= 0.165


@pytest.mark.xfail(strict=True, reason="gap: the 60 % offerable target is not reached at 95 % (see README)")
def test_offerable_target(real_slice: VariantResult) -> None:
    assert real_slice.offerable_share >= 0.60 and real_slice.broken_share <= 0.05


def test_cli_prints_the_table_and_json() -> None:
    runner = CliRunner()
    args = ["evaluate", "--trace", str(TRACE_DIR), "--slice-pods", "8"]
    res = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "8 of 143 pods" in res.output and RECOMMENDED.name in res.output and "offerable %" in res.output
    res = runner.invoke(app, [*args, "--json", "--confidence", "0.9", "--min-idle-s", "114"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["config"]["confidence"] == 0.9 and doc["config"]["min_idle_s"] == 114.0
    assert doc["pods"] == 8 and doc["results"][0]["variant"] == RECOMMENDED.name
    first = doc["results"][0]
    assert 0.0 <= first["offerable_share"] <= 1.0 and first["idle_samples"] > 0


def test_cli_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["evaluate", "--trace", str(tmp_path)])
    assert res.exit_code == 1 and "cannot read the trace" in res.output
    res = runner.invoke(app, ["evaluate", "--trace", str(TRACE_DIR), "--confidence", "1.5"])
    assert res.exit_code == 2
    res = runner.invoke(app, ["evaluate", "--trace", str(TRACE_DIR), "--slice-pods", "0"])
    assert res.exit_code == 2
