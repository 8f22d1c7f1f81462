"""Why idle GPUs were not lent and why GPUs taken back were not used (gpupool/harvest_causes.py):
each GPU's cause, the GPU-hours per cause over a window, the table that sums to the unlent total,
and the disruption's causes, on hand-made inputs with their right values."""

from __future__ import annotations

import pytest

from contracts import CapacityUpdate, GpuState, LeaseLogRecord, LeaseState
from gpupool.harvest_causes import cause_gpu_hours, disruption_causes, gpu_cause, unlent_rows


def cap(state: GpuState, reason: str = "") -> CapacityUpdate:
    return CapacityUpdate(ts=1.0, host="n1", gpu_uuid="g0", state=state, since=0.0, reason=reason)


def cause(**kw: object) -> str:
    args: dict[str, object] = {"leased": False, "why": "", "cap": cap(GpuState.IDLE), "cooling": False,
                               "node_pending": False, "demand_met": False} | kw  # fmt: skip
    return gpu_cause(**args)  # type: ignore[arg-type]


def test_each_gpu_gets_the_first_cause_that_holds() -> None:
    assert cause(leased=True, why="leased", cooling=True) == "lent"
    planned = cap(GpuState.UNKNOWN, "scheduler_planned")
    assert cause(why="not idle", cap=planned, cooling=True) == "withheld:scheduler_planned"
    assert cause(why="not idle", cap=cap(GpuState.BUSY)) == "telemetry_busy"
    pending = "DCGM_FI_PROF_GR_ENGINE_ACTIVE,idle_pending"
    assert cause(why="not idle", cap=cap(GpuState.BUSY, pending)) == "idle_pending"
    assert cause(why="not idle", cap=cap(GpuState.UNKNOWN, pending)) == "idle_pending"
    assert cause(why="not idle", cap=None) == "no_capacity_update"
    assert cause(why="no recent capacity update") == "capacity_update_old"
    assert cause(why="planned for a pending training job", cooling=True) == "planned_start"
    assert cause(why="held for training") == "held_for_training"
    assert cause(why="claimed by another site a moment ago") == "claim_in_flight"
    fence = "not held for lending by the training scheduler yet"
    assert cause(why=fence, cooling=True, node_pending=True, awaiting_training=True) == "retake_cooldown"
    assert cause(why=fence, awaiting_training=True, node_pending=True) == "retake_awaiting_training"
    assert cause(why="", awaiting_training=True) == "offered_unclaimed"
    assert cause(why="planned for a pending training job", awaiting_training=True) == "planned_start"
    assert cause(why=fence, node_pending=True) == "placeholder_pending"
    assert cause(why=fence) == "placeholder_not_submitted"
    assert cause(why="", demand_met=True) == "offered_demand_met"
    assert cause(why="") == "offered_unclaimed"


def test_gpu_hours_per_cause_hold_each_sample_until_the_next_within_the_window() -> None:
    timeline = [(900.0, {"lent": 9}), (1000.0, {"lent": 2, "retake_cooldown": 1}), (1500.0, {"lent": 1}),
                (2500.0, {"lent": 7})]  # fmt: skip
    hours = cause_gpu_hours(timeline, (1000.0, 2000.0), compression=3.6)
    # lent: 2 GPUs × 500 s + 1 × 500 s = 1500 GPU-s × 3.6 / 3600; cool-down 500 GPU-s
    assert hours == {"lent": pytest.approx(1.5), "retake_cooldown": pytest.approx(0.5)}
    # the first sample counts from the window's start only; nothing before the first sample
    assert cause_gpu_hours([(1900.0, {"x": 1})], (1000.0, 2000.0), 36.0) == {"x": pytest.approx(1.0)}
    with pytest.raises(ValueError):
        cause_gpu_hours(timeline, (2.0, 2.0), 1.0)
    with pytest.raises(ValueError):
        cause_gpu_hours(timeline, (1.0, 2.0), 0.0)


def test_the_unlent_table_sums_to_idle_less_lent_with_the_read_timing_apart() -> None:
    hours = {"lent": 10.0, "offered_unclaimed": 3.0, "withheld:scheduler_planned": 5.0, "withheld:zz": 1.0}
    rows = unlent_rows(hours, idle_unallocated=20.0, lent=10.5)
    assert [c for c, _ in rows] == [
        "withheld:scheduler_planned",
        "offered_unclaimed",
        "withheld:zz",
        "read_timing",
    ]
    assert sum(h for _, h in rows) == pytest.approx(20.0 - 10.5)
    assert dict(rows)["read_timing"] == pytest.approx(0.5)


LOCATE = {f"n1/g{i}": ("n1", i) for i in range(8)} | {"n2/g0": ("n2", 0)}


def preempted(lease: str, gpus: list[str], deadline: float = 1200.0) -> list[LeaseLogRecord]:
    base = {"site": "edge-b", "claim_id": f"c-{lease}", "offer_id": "o", "gpus": gpus, "granted_at": 1100.0,
            "expires_at": 1300.0, "notice_seconds": 2.0}  # fmt: skip
    return [
        LeaseLogRecord(lease_id=lease, state=LeaseState.GRANTED, ts=1100.0, seq=1, **base),  # type: ignore[arg-type]
        LeaseLogRecord(lease_id=lease, state=LeaseState.RECLAIMING, ts=deadline - 1.9, seq=2,
                       reclaim_deadline=deadline, reason="scheduler_preempted:7", **base),  # type: ignore[arg-type]
        LeaseLogRecord(lease_id=lease, state=LeaseState.REVOKED, ts=deadline, seq=3, reclaim_deadline=deadline,
                       reason="reclaim_deadline", **base),  # type: ignore[arg-type]
    ]  # fmt: skip


def test_gpus_taken_back_and_not_used_are_put_under_their_cause() -> None:
    records = preempted("A", ["n1/g0", "n1/g1", "n1/g2"]) + preempted("B", ["n2/g0"])
    starts = {
        "9": (1203.0, {"n1": (0, 5)}, True),  # uses g0 in the span; g1 and g2 idle on a node that got a start
        "10": (1205.0 + 60.0, {"n1": (1,)}, False),  # g1: a start just inside the late span
        "11": (1205.0 + 60.01, {"n2": (0,)}, False),  # n2/g0: past the late span, nothing on n2 in the span
    }
    W = (1000.0, 2000.0)
    got = disruption_causes(records, starts, LOCATE, W)
    assert got == {"started_late": 1, "node_other_gpus": 1, "not_on_node": 1}
    # taken back - used = the causes' sum (4 taken, 1 used)
    from gpupool.harvest import lending_figures

    fig = lending_figures(records, starts, LOCATE, W, 1.0)
    assert fig.gpus_taken_back - fig.gpus_needed == sum(got.values())
    # a start at the deadline + slack is still "used" (not a cause); a start before the preemption is none
    at_edge = {"9": (1205.0, {"n2": (0,)}, True)}
    assert disruption_causes(preempted("B", ["n2/g0"]), at_edge, LOCATE, W) == {
        "started_late": 0,
        "node_other_gpus": 0,
        "not_on_node": 0,
    }
    early = {"9": (1197.9, {"n2": (0,)}, True)}
    assert disruption_causes(preempted("B", ["n2/g0"]), early, LOCATE, W)["not_on_node"] == 1
