"""broker.lending.SlurmLending and broker.scheduler_slurm.SlurmScheduler.jobs: a lease hold Slurm
chose for preemption whose workload drained and left before the grace time ran out is gone by
the time the broker reads it (0.3 s after Slurm's SIGTERM in the harvest replay, where the read
came 0.1-1 s after). Slurm still lists it, ended, with its ``PreemptTime``: the lease is reclaimed
``scheduler_preempted`` with Slurm's deadline (``PreemptTime`` + the notice), not ``hold_lost``
with the deadline "now" (which the site heard as a hold lost, with no notice left, and the replay
did not count as a preemption). A hold that ended without Slurm choosing it (an operator's
``scancel``) is still ``hold_lost``."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.lending import LendingHooks, SlurmLending
from broker.metrics import BrokerMetrics
from broker.scheduler import Hold, HoldState
from broker.scheduler_slurm import SlurmScheduler, BackfillTiming, SLURM_BACKFILL_DEFAULTS
from contracts import LeaseLogRecord, LeaseState
from contracts.leases import LeaseReason
from tests.test_broker_scheduler_slurm import LINE

NOW = 1000.0


class _Slurm:
    partition, gres_type, cpus_per_gpu = "lent", "h100", 1

    def __init__(self) -> None:
        self.listed: list[Hold] = []

    async def command(self, *argv: str, stdin: str | None = None) -> str:
        return ""

    async def jobs(self, job_id: str | None = None) -> list[Hold]:
        return [h for h in self.listed if job_id is None or h.job_id == job_id]

    async def backfill_timing(self) -> BackfillTiming:
        return SLURM_BACKFILL_DEFAULTS

    async def jobs_and_training(self) -> tuple[list[Hold], frozenset[tuple[str, int]], dict[str, float]]:
        return await self.jobs(), frozenset(), {}


async def _leased(tmp_path: Path) -> tuple[SlurmLending, _Slurm, list[tuple[str, float, str]]]:
    """A lending (notice 2 s) with lease L1 carved from placeholder 11 (n1, GPU 1)."""
    slurm = _Slurm()
    lending = SlurmLending(slurm, control_dir=tmp_path, notice_s=2.0, clock=lambda: NOW)  # type: ignore[arg-type]
    reclaims: list[tuple[str, float, str]] = []

    async def reclaim(lease_id: str, deadline: float, reason: str) -> None:
        reclaims.append((lease_id, deadline, reason))

    async def lendable(_: frozenset[str]) -> None:
        return None

    lending.bind(LendingHooks(reclaim, lambda: ("n1/gpu1",), lendable, lambda _: None), BrokerMetrics())
    lending._idle["n1"] = {1: Hold("", "11", "n1", (1,), HoldState.RUNNING, started_at=0.0)}
    (tmp_path / "11.idle").write_text("")
    record = LeaseLogRecord(
        lease_id="L1", site="edge-a", claim_id="c1", offer_id="o", gpus=["n1/gpu1"], state=LeaseState.GRANTED,
        ts=NOW, granted_at=NOW, expires_at=NOW + 600, notice_seconds=2.0,
    )  # fmt: skip
    assert await lending.hold(record) == ""
    return lending, slurm, reclaims


def _ended(preempted_at: float | None) -> Hold:
    return Hold("L1", "11", "n1", (1,), HoldState.ENDED, deadline=NOW - 0.5, preempted_at=preempted_at)


@pytest.mark.parametrize("read", ["term_file", "full_read"])
async def test_a_preempted_hold_gone_before_the_read_is_reclaimed_with_slurms_deadline(
    tmp_path: Path, read: str
) -> None:
    lending, slurm, reclaims = await _leased(tmp_path)
    slurm.listed = [_ended(preempted_at=NOW - 1.0)]  # chosen 1 s ago; its workload left at once
    try:
        if read == "term_file":
            (tmp_path / "11.term").write_text(f"{NOW - 0.9}\n")
            await lending._terms()
        else:
            await lending._poll()
        assert reclaims == [("L1", NOW + 1.0, f"{LeaseReason.SCHEDULER_PREEMPTED}:11")]  # PreemptTime + 2 s
    finally:
        await lending.stop()


@pytest.mark.parametrize("read", ["term_file", "full_read"])
async def test_a_hold_gone_without_a_preemption_is_still_lost(tmp_path: Path, read: str) -> None:
    lending, slurm, reclaims = await _leased(tmp_path)
    slurm.listed = [_ended(preempted_at=None)] if read == "term_file" else []
    try:
        if read == "term_file":
            (tmp_path / "11.term").write_text(f"{NOW - 0.9}\n")  # an operator's scancel signals it too
            await lending._terms()
        else:
            await lending._poll()
        assert reclaims == [("L1", NOW, f"{LeaseReason.HOLD_LOST}:11")]
    finally:
        await lending.stop()


def _line(state: str, preempt_time: str) -> str:
    return LINE.replace("JobState=RUNNING", f"JobState={state}").replace(
        "PreemptTime=2026-12-01T14:01:30", f"PreemptTime={preempt_time}"
    )


@pytest.mark.parametrize(
    ("state", "preempt_time", "listed_as"),
    [
        ("RUNNING", "2026-12-01T14:01:30", HoldState.PREEMPTED),
        ("RUNNING", "None", HoldState.RUNNING),
        ("COMPLETED", "2026-12-01T14:01:30", HoldState.ENDED),  # left early after the preemption
        ("CANCELLED", "2026-12-01T14:01:30", HoldState.ENDED),
        ("COMPLETING", "2026-12-01T14:01:30", HoldState.ENDED),
        ("COMPLETED", "None", None),  # ended, not preempted: left out
        ("CANCELLED", "None", None),
    ],
)
async def test_jobs_lists_holds_not_ended_and_those_ended_after_a_preemption(
    monkeypatch: pytest.MonkeyPatch, state: str, preempt_time: str, listed_as: HoldState | None
) -> None:
    scheduler = SlurmScheduler(None)
    other = LINE.replace("JobId=7 JobName=gpupool-lease", "JobId=8 JobName=train").replace(
        "JobState=RUNNING", "JobState=COMPLETED"
    )
    monkeypatch.setattr(scheduler, "_run", lambda argv, stdin: f"{_line(state, preempt_time)}\n{other}\n")
    holds = await scheduler.jobs()
    assert [h.state for h in holds] == ([] if listed_as is None else [listed_as])
    if listed_as is not None:
        assert holds[0].job_id == "7" and (holds[0].preempted_at is None) == (preempt_time == "None")


async def test_the_told_file_is_written_once_the_site_was_sent_the_reclaim_and_goes_with_the_lease(
    tmp_path: Path,
) -> None:
    """The broker calls ``reclaiming`` after the reclaiming record is logged and published; the
    hold's script gives the GPU back early only once this file exists (broker.placeholders)."""
    lending, _, _ = await _leased(tmp_path)
    rec = LeaseLogRecord(
        lease_id="L1", site="edge-a", claim_id="c1", offer_id="o", gpus=["n1/gpu1"], state=LeaseState.RECLAIMING,
        ts=NOW, granted_at=NOW, expires_at=NOW + 600, notice_seconds=2.0, reclaim_deadline=NOW + 3.0,
    )  # fmt: skip
    try:
        lending.reclaiming(rec.model_copy(update={"reclaim_deadline": NOW + 3.0 + 0.001}))
        assert not (tmp_path / "11.told").exists()  # deferred past the notice (+ 1 s): not told yet
        lending.reclaiming(rec)
        assert (tmp_path / "11.told").exists()
        lending.ended(rec.model_copy(update={"state": LeaseState.REVOKED}))
        assert not (tmp_path / "11.told").exists()
    finally:
        await lending.stop()
