"""broker.lending.SlurmLending: a claim that carved a placeholder Slurm had just chosen for
preemption. Slurm refuses the lease's new time limit for such a job (``scontrol update`` says
"Job has already finished"); that is Slurm taking the GPU back, so the lease is reclaimed with
Slurm's deadline (``scheduler_preempted``) and no retag failure is counted; a job gone is
``hold_lost``; a refusal for a job that runs unchosen is a failure (counted, logged)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from broker.lending import LendingHooks, SlurmLending
from broker.metrics import BrokerMetrics
from broker.scheduler_slurm import SLURM_BACKFILL_DEFAULTS, BackfillTiming
from broker.scheduler import Hold, HoldState, SchedulerError
from contracts import LeaseLogRecord, LeaseState
from contracts.leases import LeaseReason

_REFUSED = "slurm_update error: Job has already finished for job 11"


class _Slurm:
    """One node; ``scontrol update`` refused as Slurm refuses it for a job in its grace time;
    ``jobs`` lists ``listed``."""

    partition, gres_type, cpus_per_gpu = "lent", "h100", 1

    def __init__(self, listed: list[Hold]) -> None:
        self.listed = listed
        self.updates: list[tuple[str, ...]] = []

    async def command(self, *argv: str, stdin: str | None = None) -> str:
        if argv == ("scontrol", "show", "node", "-o"):
            return "NodeName=n1 Arch=x86_64 NodeAddr=127.0.0.1 NodeHostName=localhost\n"
        if argv[:2] == ("scontrol", "update"):
            self.updates.append(argv)
            raise SchedulerError(_REFUSED, returncode=1)
        if argv[0] in ("scancel", "scontrol"):
            return ""
        raise AssertionError(f"unexpected command {argv}")

    async def jobs(self, job_id: str | None = None) -> list[Hold]:
        return [h for h in self.listed if job_id is None or h.job_id == job_id]

    async def backfill_timing(self) -> BackfillTiming:
        return SLURM_BACKFILL_DEFAULTS

    async def jobs_and_training(self) -> tuple[list[Hold], frozenset[tuple[str, int]], dict[str, float]]:
        return await self.jobs(), frozenset(), {}


def _record() -> LeaseLogRecord:
    return LeaseLogRecord(
        lease_id="L1", site="edge-a", claim_id="c1", offer_id="o", gpus=["n1/gpu0", "n1/gpu1"],
        state=LeaseState.GRANTED, ts=0.0, granted_at=0.0, expires_at=4000.0, ends_at=4000.0, notice_seconds=2.0,
    )  # fmt: skip


async def _carve(
    tmp_path: Path, listed: list[Hold]
) -> tuple[SlurmLending, list[tuple[str, float, str]], BrokerMetrics]:
    slurm = _Slurm(listed)
    lending = SlurmLending(slurm, control_dir=tmp_path, clock=lambda: 1000.0)  # type: ignore[arg-type]
    reclaims: list[tuple[str, float, str]] = []

    async def reclaim(lease_id: str, deadline: float, reason: str) -> None:
        reclaims.append((lease_id, deadline, reason))

    async def lendable(_: frozenset[str]) -> None:
        return None

    metrics = BrokerMetrics()
    lending.bind(LendingHooks(reclaim=reclaim, to_hold=lambda: (), lendable=lendable, republish=lambda _: None),
                 metrics)  # fmt: skip
    for i, job in enumerate(("11", "12")):
        lending._idle.setdefault("n1", {})[i] = Hold("", job, "n1", (i,), HoldState.RUNNING, started_at=900.0)
        (tmp_path / f"{job}.idle").write_text("")
    assert await lending.hold(_record()) == ""
    async with asyncio.timeout(5):
        while [t for t in lending._tasks if t.get_name().startswith("hold-retag")]:
            await asyncio.sleep(0.02)
    return lending, reclaims, metrics


def _retag_errors(metrics: BrokerMetrics) -> float:
    value = metrics.registry.get_sample_value("gpupool_broker_scheduler_errors_total", {"operation": "retag"})
    return value or 0.0


async def test_time_limit_refused_for_a_job_slurm_chose_is_a_preemption(tmp_path: Path) -> None:
    chosen = Hold("", "12", "n1", (1,), HoldState.PREEMPTED, deadline=1002.0, preempted_at=1000.0)
    lending, reclaims, metrics = await _carve(
        tmp_path, [Hold("", "11", "n1", (0,), HoldState.RUNNING), chosen]
    )
    try:
        assert reclaims == [("L1", 1002.0, f"{LeaseReason.SCHEDULER_PREEMPTED}:12")]
        assert _retag_errors(metrics) == 0
        assert "L1" in lending._noticed
    finally:
        await lending.stop()


async def test_time_limit_refused_for_a_job_gone_is_hold_lost(tmp_path: Path) -> None:
    lending, reclaims, metrics = await _carve(tmp_path, [Hold("", "11", "n1", (0,), HoldState.RUNNING)])
    try:
        assert reclaims == [("L1", 1000.0, f"{LeaseReason.HOLD_LOST}:12")]
        assert _retag_errors(metrics) == 0
    finally:
        await lending.stop()


async def test_time_limit_refused_for_jobs_that_run_unchosen_is_a_failure(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    running = [Hold("", "11", "n1", (0,), HoldState.RUNNING), Hold("", "12", "n1", (1,), HoldState.RUNNING)]
    lending, reclaims, metrics = await _carve(tmp_path, running)
    try:
        assert reclaims == []
        assert _retag_errors(metrics) == 1
        assert any(r.message == "hold_retag_failed" and _REFUSED in str(getattr(r, "error", ""))
                   for r in caplog.records)  # fmt: skip
    finally:
        await lending.stop()
