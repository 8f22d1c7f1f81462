"""simulator.fleet: GPUs replaying trace pods; the ground truth equals the trace."""

from __future__ import annotations

import re

import pytest

from contracts import gpu_key
from simulator.dcgm_fields import FIELD_BY_NAME
from simulator.fleet import BUSY_THRESHOLD_PCT, FB_RESERVED_MIB, FB_TOTAL_MIB, Fleet
from simulator.trace import Trace
from tests.support import T0, Clock

UUID_RE = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def _fleet(trace: Trace, **kw: object) -> Fleet:
    kw.setdefault("clock", Clock())
    kw.setdefault("t0", T0)
    return Fleet(trace, **kw)  # type: ignore[arg-type]


def test_identity_hosts_uuids_keys(trace: Trace) -> None:
    f = _fleet(trace, nodes=3, gpus_per_node=8, seed=1)
    assert f.hosts() == ["gpu-node-001", "gpu-node-002", "gpu-node-003"]
    gpus = f.gpus()
    assert len(gpus) == 24 and len(f.gpus("gpu-node-002")) == 8
    for g in gpus:
        assert UUID_RE.fullmatch(g.uuid)
        assert re.fullmatch(r"00000000:[0-9A-F]{2}:00\.0", g.pci_bus_id)
        assert g.device == f"nvidia{g.index}"
        assert g.key == gpu_key(g.host, g.uuid)
        assert f.gpu_by_key(g.key) is g and f.gpu(g.host, g.index) is g
    assert len({g.uuid for g in gpus}) == 24
    assert f.gpu_keys() == [g.key for g in gpus]
    # deterministic by seed
    again = _fleet(trace, nodes=3, gpus_per_node=8, seed=1)
    def ident(fl: Fleet) -> list[tuple[str, int, int]]:
        return [(g.uuid, g.pod_idx, g.offset) for g in fl.gpus()]

    assert ident(again) == ident(f)
    other = _fleet(trace, nodes=3, gpus_per_node=8, seed=2)
    assert {g.uuid for g in other.gpus()}.isdisjoint({g.uuid for g in gpus})
    with pytest.raises(KeyError):
        f.gpu("gpu-node-009", 0)


def test_pods_are_varied_and_distinct(trace: Trace) -> None:
    f = _fleet(trace, nodes=8, gpus_per_node=8, seed=0)
    pods = [g.pod_idx for g in f.gpus()]
    assert len(set(pods)) == 64, "fewer GPUs than eligible pods: no pod is reused"
    assert all(g.offset == 0 for g in f.gpus())
    busy = sorted(trace.busy_fraction(p) for p in pods)
    assert busy[0] < 0.05 and busy[-1] > 0.3, busy
    assert all(trace.coverage(p) >= 0.5 for p in pods)
    # each node mixes pods (not all the idle ones on one node)
    per_node = [[trace.busy_fraction(g.pod_idx) for g in f.gpus(h)] for h in f.hosts()]
    assert max(sum(b) / len(b) for b in per_node) - min(sum(b) / len(b) for b in per_node) < 0.25


def test_more_gpus_than_pods_reuse_pods_with_offsets(trace: Trace) -> None:
    f = _fleet(trace, nodes=20, gpus_per_node=8, seed=3)
    pairs = [(g.pod_idx, g.offset) for g in f.gpus()]
    assert len(pairs) == 160
    distinct_pods = len({p for p, _ in pairs})
    assert distinct_pods < 160
    assert len(set(pairs)) == 160, "a reused pod replays from another point of the trace"
    assert sum(1 for _, o in pairs if o) >= 160 - distinct_pods
    assert len(set(f.gpu_keys())) == 160


def test_wall_clock_maps_to_trace_steps(trace: Trace) -> None:
    clock = Clock()
    f = _fleet(trace, nodes=1, gpus_per_node=2, speedup=57.0, start_step=10, clock=clock)
    assert f.step_wall_s == pytest.approx(1.0)
    assert f.step_at(T0) == 10
    assert f.step_at(T0 + 0.999) == 10
    assert f.step_at(T0 + 1.0) == 11
    assert f.step_at(T0 + 125.5) == 135
    clock.t = T0 + 7.2
    assert f.step_at() == 17
    assert f.step_start(17) == pytest.approx(T0 + 7.0)
    slow = _fleet(trace, nodes=1, gpus_per_node=1, speedup=1.0)
    assert slow.step_at(T0 + 56.9) == 0 and slow.step_at(T0 + 57.0) == 1


def test_ground_truth_equals_the_trace(trace: Trace) -> None:
    f = _fleet(trace, nodes=2, gpus_per_node=8, seed=5, start_step=100)
    for g in f.gpus():
        for step in range(100, 100 + trace.steps + 50, 7):  # past the end: the trace wraps
            at = f.step_start(step) + 0.5 * f.step_wall_s
            want = trace.util(g.pod_idx, (step + g.offset) % trace.steps)
            assert f.gpu_util(g.host, g.index, at) == want
            assert f.is_busy_at(g.key, at) is (want > BUSY_THRESHOLD_PCT)
            assert f.is_busy_step(g.key, step) is (want > 0.0)


def test_exported_fields_agree_with_the_ground_truth(trace: Trace) -> None:
    f = _fleet(trace, nodes=2, gpus_per_node=8, seed=5)
    busy_seen = idle_seen = 0
    for step in range(0, 400, 3):
        at = f.step_start(step) + 0.25
        for g in f.gpus():
            u = f.gpu_util(g.host, g.index, at)
            v = f.fields(g.host, g.index, at)
            busy = f.is_busy_at(g.key, at)
            assert (v["DCGM_FI_DEV_GPU_UTIL"] > 0) is busy
            assert (v["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] > 0) is busy
            assert (v["DCGM_FI_PROF_SM_ACTIVE"] > 0) is busy
            assert v["DCGM_FI_DEV_GPU_UTIL"] == (max(1, round(u)) if busy else 0)
            if busy:
                busy_seen += 1
                assert v["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] == pytest.approx(u / 100, rel=0.031, abs=1e-6)
                assert v["DCGM_FI_DEV_SM_CLOCK"] == 1980
            else:
                idle_seen += 1
                assert v["DCGM_FI_DEV_SM_CLOCK"] == 345
            for name in ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_PROF_SM_ACTIVE",
                         "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_PROF_DRAM_ACTIVE"):
                assert 0.0 <= v[name] <= 1.0 and round(v[name], 6) == v[name]
            fb = v["DCGM_FI_DEV_FB_USED"]
            assert fb + v["DCGM_FI_DEV_FB_FREE"] + v["DCGM_FI_DEV_FB_RESERVED"] == FB_TOTAL_MIB
            assert v["DCGM_FI_DEV_FB_USED"] == f.fb_used_mib(g.host, g.index, at)
            ts = f.trace_step(g, step)
            assert (fb == 0) is (not trace.alive(g.pod_idx, ts) or trace.mem_bytes(g.pod_idx, ts) == 0)
            assert v["DCGM_FI_DEV_FB_USED"] <= 0.9 * (FB_TOTAL_MIB - FB_RESERVED_MIB) + 1
            assert set(v) == set(FIELD_BY_NAME)
            for name, val in v.items():
                assert type(val) is (int if FIELD_BY_NAME[name].kind == "int" else float), name
            assert v["DCGM_FI_DEV_XID_ERRORS"] == 0
    assert busy_seen > 500 and idle_seen > 500
    xid = f.field_labels("gpu-node-001", 0, "DCGM_FI_DEV_XID_ERRORS")
    assert xid == {"err_code": "0", "err_msg": "No Error"}
    assert f.field_labels("gpu-node-001", 0, "DCGM_FI_DEV_GPU_UTIL") == {}


def test_fb_used_maps_each_pods_maximum_to_its_fraction(trace: Trace) -> None:
    f = _fleet(trace, nodes=1, gpus_per_node=8, seed=2)
    for g in f.gpus():
        peak = max(f.fb_used_mib(g.host, g.index, f.step_start(s)) for s in range(trace.steps))
        assert peak == round(g.fb_fraction * (FB_TOTAL_MIB - FB_RESERVED_MIB))
        assert 0.55 <= g.fb_fraction <= 0.9


def test_energy_is_monotonic_and_integrates_power(trace: Trace) -> None:
    f = _fleet(trace, nodes=1, gpus_per_node=4, seed=4)
    for g in f.gpus():
        prev = f.energy_mj(g.host, g.index, T0)
        for k in range(1, 300):
            e = f.energy_mj(g.host, g.index, T0 + 0.37 * k)
            assert e >= prev
            prev = e
        # inside one step, ΔE / Δt is POWER_USAGE
        at1, at2 = f.step_start(40) + 0.1, f.step_start(40) + 0.9
        p = f.fields(g.host, g.index, at1)["DCGM_FI_DEV_POWER_USAGE"]
        de_j = (f.energy_mj(g.host, g.index, at2) - f.energy_mj(g.host, g.index, at1)) / 1000
        assert de_j / 0.8 == pytest.approx(p, abs=0.01)
        assert 55.0 < p < 700.0


def test_util_seconds_is_the_exact_integral(trace: Trace) -> None:
    f = _fleet(trace, nodes=1, gpus_per_node=2, seed=4)
    g = f.gpus()[0]
    t1, t2 = f.step_start(3) + 0.25, f.step_start(9) + 0.5
    want = (0.75 * f.gpu_util(g.host, 0, f.step_start(3))
            + sum(f.gpu_util(g.host, 0, f.step_start(s)) for s in range(4, 9))
            + 0.5 * f.gpu_util(g.host, 0, f.step_start(9))) * f.step_wall_s / 100
    assert f.util_seconds(g.host, 0, t1, t2) == pytest.approx(want)
    cycle = trace.steps * f.step_wall_s
    one = f.util_seconds(g.host, 0, T0, T0 + cycle)
    assert f.util_seconds(g.host, 0, T0, T0 + 3 * cycle) == pytest.approx(3 * one)


def test_idle_share_matches_the_trace(trace: Trace) -> None:
    f = _fleet(trace, nodes=4, gpus_per_node=8, seed=7)
    want = sum(1 for g in f.gpus() for s in range(trace.steps) if trace.util(g.pod_idx, s) == 0.0)
    assert f.idle_share() == pytest.approx(want / (32 * trace.steps))
    assert 0.5 < f.idle_share() < 0.85


@pytest.mark.parametrize("kw", [{"nodes": 0}, {"gpus_per_node": 9}, {"speedup": 0.0}, {"min_coverage": 1.01}])
def test_bad_arguments_raise(trace: Trace, kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        _fleet(trace, **kw)
