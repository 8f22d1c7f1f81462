"""broker.lending.SlurmLending on a node where Slurm plans a pending training job: placeholders
get a time limit that ends before the planned start (Slurm's backfill starts nothing longer on
GPUs its plan needs), and an idle placeholder that leaves for its time limit is no take-back."""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path

import pytest

from broker.lending import PLAN_SLACK_S, SIGNAL_EARLY_S, SlurmLending, placeholder_minutes
from broker.scheduler import Hold, HoldState
from contracts import LeaseLogRecord, LeaseState
from broker.scheduler_slurm import SLURM_BACKFILL_DEFAULTS, BackfillTiming, backfill_timing, planned_starts
from tests.test_broker_lending_cooldown import _idle, _lending, _sbatch_counter

NOW = 1_000_000.0


LOCAL = BackfillTiming(interval_s=2.0, resolution_s=60.0)
"""The local cluster's backfill timing (deploy/local/slurm.sh)."""


def test_placeholder_minutes_end_by_the_planned_start_rounded_down_to_the_backfill_resolution() -> None:
    assert placeholder_minutes(None, NOW, 60, LOCAL) == 60
    plan = 1_000_320.0 + 54.0  # the backfill keeps it as 1_000_320 (a multiple of 60 s)
    start = LOCAL.interval_s + PLAN_SLACK_S  # latest start after submit
    one = 1_000_320.0 - start - 60.0  # submitted then, one minute ends exactly at 1_000_320
    assert placeholder_minutes(plan, one, 60, LOCAL) == 1
    assert placeholder_minutes(plan, one + 0.001, 60, LOCAL) == 60  # none fits: a GPU not planned
    assert placeholder_minutes(plan, one - 59.999, 60, LOCAL) == 1
    assert placeholder_minutes(plan, one - 60.0, 60, LOCAL) == 2
    assert placeholder_minutes(1_000_320.0, one, 60, LOCAL) == 1  # a plan on a multiple is kept as it is
    assert placeholder_minutes(1_000_320.0 - 0.001, one, 60, LOCAL) == 60
    assert placeholder_minutes(plan + 7200.0, one, 60, LOCAL) == 60  # at most the placeholder's own
    assert placeholder_minutes(plan, plan + 5.0, 60, LOCAL) == 60  # a plan already due


def test_placeholder_minutes_follow_the_backfill_interval_and_resolution() -> None:
    plan = 3_600_000.0 + 600.0  # a multiple of 60 s and of 300 s
    slow = BackfillTiming(interval_s=30.0, resolution_s=60.0)  # Slurm's defaults
    at = plan - 120.0 - 30.0 - PLAN_SLACK_S  # two minutes fit exactly with a 30 s cycle
    assert placeholder_minutes(plan, at, 60, slow) == 2
    assert placeholder_minutes(plan, at + 0.001, 60, slow) == 1
    assert placeholder_minutes(plan, at, 60) == 2  # the defaults are Slurm's
    coarse = BackfillTiming(interval_s=30.0, resolution_s=300.0)
    assert placeholder_minutes(plan + 299.0, at, 60, coarse) == 2  # kept as plan at 300 s
    assert placeholder_minutes(plan - 1.0, at, 60, coarse) == 60  # kept as plan - 300 s: none fits


def test_backfill_timing_is_read_from_scheduler_parameters() -> None:
    conf = (
        "Configuration data as of 2026-12-03T06:40:00\n"
        "SchedulerParameters     = batch_sched_delay=0,bf_interval=2,sched_min_interval=100000\n"
        "SchedulerType           = sched/backfill\n"
    )
    assert backfill_timing(conf) == BackfillTiming(interval_s=2.0, resolution_s=60.0)
    conf2 = "SchedulerParameters = bf_resolution=300,bf_interval=45\n"
    assert backfill_timing(conf2) == BackfillTiming(interval_s=45.0, resolution_s=300.0)
    assert backfill_timing("SchedulerParameters     = (null)\n") == SLURM_BACKFILL_DEFAULTS
    assert backfill_timing("") == SLURM_BACKFILL_DEFAULTS
    # a longer name that ends the same is not the parameter
    assert backfill_timing("SchedulerParameters = max_bf_interval=9\n") == SLURM_BACKFILL_DEFAULTS
    with pytest.raises(ValueError):
        backfill_timing("SchedulerParameters = bf_resolution=0\n")


def _line(job: str, name: str, state: str, start: str, sched: str) -> str:
    return (
        f"JobId={job} JobName={name} UserId=root(0) Priority=1 JobState={state} Reason=Resources "
        f"TimeLimit=00:10:00 SubmitTime=2026-12-01T14:01:29 StartTime={start} EndTime=Unknown "
        f"Partition=training ReqNodeList=(null) NodeList=(null) SchedNodeList={sched} "
        "NumNodes=2 NumCPUs=2 TresPerNode=gres:gpu:h100:8 Command=(null) WorkDir=/tmp/sj"
    )


def test_planned_starts_are_the_earliest_start_of_other_pending_jobs_per_node() -> None:
    t = datetime(2026, 12, 1, 14, 20, 0).timestamp()
    text = "\n".join([
        _line("41", "train-1", "PENDING", "2026-12-01T14:20:00", "gpu-node-[001-002]"),
        _line("42", "train-2", "PENDING", "2026-12-01T14:10:00", "gpu-node-002"),
        _line("43", "gpupool-lease", "PENDING", "2026-12-01T14:01:00", "gpu-node-003"),  # our own
        _line("44", "train-3", "RUNNING", "2026-12-01T14:00:00", "gpu-node-004"),
        _line("45", "train-4", "PENDING", "Unknown", "gpu-node-005"),
        _line("46", "train-5", "PENDING", "2026-12-01T14:05:00", "(null)"),
        "",
    ])  # fmt: skip
    assert planned_starts(text) == {"gpu-node-001": t, "gpu-node-002": t - 600}
    with pytest.raises(ValueError):
        planned_starts(_line("47", "train-6", "PENDING", "2026-12-01T14:05:00", "gpu-node-[001"))
    with pytest.raises(ValueError):
        planned_starts(_line("48", "train-7", "PENDING", "14:05", "gpu-node-001"))


async def test_a_placeholder_on_a_planned_node_ends_before_the_planned_start(tmp_path: Path) -> None:
    now = [NOW]
    lending, slurm, _ = _lending(tmp_path, now)
    submitted = _sbatch_counter(slurm)
    # kept as 1_000_200 by the backfill; 165 s fit after Slurm's default 30 s cycle and the slack
    plans = {"n1": 1_000_200.0 + 30.0}

    async def read() -> tuple[list[Hold], frozenset[tuple[str, int]], dict[str, float]]:
        return [], frozenset(), plans

    slurm.jobs_and_training = read  # type: ignore[method-assign]
    try:
        await lending._poll()
        await asyncio.sleep(0.05)
        assert len(submitted) == 3 and all("--time=2" in argv for argv in submitted)
        plans.clear()  # the plan is gone: the next ones ask for the whole placeholder time
        lending._submitted.clear()
        await lending._poll()
        await asyncio.sleep(0.05)
        assert len(submitted) == 6 and all(
            f"--time={lending.placeholder_minutes}" in a for a in submitted[3:]
        )
    finally:
        await lending.stop()


def _leaves(lending: SlurmLending, tmp_path: Path, deadline: float | None) -> None:
    h = _idle(lending, tmp_path, 0, "10")
    lending._idle["n1"][0] = Hold("", h.job_id, "n1", (0,), HoldState.RUNNING, deadline=deadline)
    (tmp_path / "10.idle").unlink()  # its script left on a SIGTERM


@pytest.mark.parametrize(
    ("deadline_from_now", "plan_from_now", "cools"),
    [
        (2.0 + SIGNAL_EARLY_S, None, False),  # its time limit's signal was due: no take-back
        (2.0 + SIGNAL_EARLY_S + 0.001, None, True),  # not yet due: Slurm preempted it
        (None, None, True),  # no time limit known
        (2.0 + SIGNAL_EARLY_S, 2.0, True),  # due, but a training job is planned there now
        (2.0 + SIGNAL_EARLY_S, 2.001, False),
    ],
)
async def test_an_idle_placeholder_that_leaves_for_its_time_limit_is_no_take_back(
    tmp_path: Path, deadline_from_now: float | None, plan_from_now: float | None, cools: bool
) -> None:
    now = [NOW]
    lending, _, _ = _lending(tmp_path, now, retake_hold_max_s=0.0)  # notice 2 s
    if plan_from_now is not None:
        lending._plans = {"n1": NOW + plan_from_now}
    _leaves(lending, tmp_path, None if deadline_from_now is None else NOW + deadline_from_now)
    await lending._terms()
    assert lending._idle["n1"] == {}
    assert (("n1", 0) in lending._cooling) is cools


def _running(tmp_path: Path, job: str, index: int, limit_s: float) -> Hold:
    (tmp_path / f"{job}.idle").write_text("")
    return Hold("", job, "n1", (index,), HoldState.RUNNING, deadline=NOW + limit_s, started_at=NOW)


async def test_an_idle_placeholder_started_short_gets_the_whole_placeholder_time_once(tmp_path: Path) -> None:
    """Slurm's plan does not move for a running placeholder's time limit: one that started with
    a fitted (shorter) limit gets ``placeholder_minutes`` once it is seen running, once."""
    lending, slurm, _ = _lending(tmp_path, [NOW])
    commands: list[tuple[str, ...]] = []

    async def command(*argv: str, stdin: str | None = None) -> str:
        commands.append(argv)
        return ""

    slurm.command = command  # type: ignore[method-assign]
    most = lending.placeholder_minutes * 60.0
    slurm.listed = [
        _running(tmp_path, "10", 0, most - 0.001),
        _running(tmp_path, "11", 1, most),  # the whole placeholder time already
        Hold("", "12", "n1", (2,), HoldState.PENDING),
    ]
    try:
        await lending._poll()
        await asyncio.sleep(0.05)
        assert [a for a in commands if a[0] == "scontrol"] == [("scontrol", "update", "JobId=10", "TimeLimit=60")]
        await lending._poll()  # read again with the old limit (the update not yet seen): not again
        await asyncio.sleep(0.05)
        assert len([a for a in commands if a[0] == "scontrol"]) == 1
        slurm.listed[2] = _running(tmp_path, "12", 2, 120.0)
        slurm.listed.append(_running(tmp_path, "13", 3, 60.0))
        await lending._poll()
        await asyncio.sleep(0.05)
        assert commands[-1] == ("scontrol", "update", "JobId=12,13", "TimeLimit=60")  # one update for all
        assert lending._extending == {}
    finally:
        await lending.stop()


async def test_a_lease_carved_while_its_placeholder_limit_is_raised_gets_its_own_limit_last(
    tmp_path: Path,
) -> None:
    """The raise of an idle placeholder's limit and the carving's time limit (the lease's end) go
    to Slurm in that order, however slow the first command is."""
    lending, slurm, _ = _lending(tmp_path, [NOW])
    order: list[str] = []
    slow = asyncio.Event()

    async def command(*argv: str, stdin: str | None = None) -> str:
        if argv[:2] == ("scontrol", "update") and argv[-1] == "TimeLimit=60":
            await slow.wait()
        if argv[0] == "scontrol":
            order.append(argv[-1])
        return ""

    slurm.command = command  # type: ignore[method-assign]
    slurm.listed = [_running(tmp_path, "10", 0, 120.0)]
    try:
        await lending._poll()
        held = lending._idle["n1"][0]
        rec = LeaseLogRecord(
            lease_id="L1", site="edge-a", claim_id="c1", offer_id="o1", gpus=["n1/gpu0"], state=LeaseState.GRANTED,
            ts=NOW, granted_at=NOW, expires_at=NOW + 600.0, ends_at=NOW + 600.0, notice_seconds=2.0,
        )  # fmt: skip
        lending._leases["L1"] = [held]
        retag = asyncio.create_task(lending._retag(rec, [held]))
        await asyncio.sleep(0.5)  # past the retag's own delay
        assert order == []  # the carving waits for the raise
        slow.set()
        await retag
        assert order == ["TimeLimit=60", "TimeLimit=10"]
    finally:
        slow.set()
        await lending.stop()
