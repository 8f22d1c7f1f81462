"""broker.lending.SlurmLending: a GPU Slurm took back gets no new placeholder for
``retake_cooldown_s`` (default: the notice + 5 s), nor after that until a training job is seen
holding it, at most ``retake_hold_max_s`` from the take-back. The training job Slurm preempted
for starts only once every GPU it needs is free (on other nodes too, perhaps after more
preemptions); a placeholder held again on one of them meanwhile is one more it must preempt, with
one more notice to wait (and one more GPU taken back for nothing)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from broker.lending import LendingHooks, SlurmLending
from broker.metrics import BrokerMetrics
from broker.scheduler_slurm import SLURM_BACKFILL_DEFAULTS, BackfillTiming
from broker.scheduler import Hold, HoldState
from contracts import LeaseLogRecord, LeaseState
from contracts.leases import LeaseReason


class _Slurm:
    partition, gres_type, cpus_per_gpu = "lent", "h100", 1

    def __init__(self) -> None:
        self.listed: list[Hold] = []
        self.training: set[tuple[str, int]] = set()
        """(node, GRES index) that jobs other than gpupool's hold."""

    async def command(self, *argv: str, stdin: str | None = None) -> str:
        if argv[0] in ("scancel", "scontrol"):
            return ""
        raise AssertionError(f"unexpected command {argv}")

    async def jobs(self, job_id: str | None = None) -> list[Hold]:
        return [h for h in self.listed if job_id is None or h.job_id == job_id]

    async def backfill_timing(self) -> BackfillTiming:
        return SLURM_BACKFILL_DEFAULTS

    async def jobs_and_training(self) -> tuple[list[Hold], frozenset[tuple[str, int]], dict[str, float]]:
        return await self.jobs(), frozenset(self.training), {}


WANTED = ("n1/gpu0", "n1/gpu1", "n1/gpu2")


def _lending(tmp_path: Path, now: list[float], **kw: float) -> tuple[SlurmLending, _Slurm, list[str]]:
    slurm = _Slurm()
    lending = SlurmLending(slurm, control_dir=tmp_path, notice_s=2.0, clock=lambda: now[0], **kw)  # type: ignore[arg-type]
    reclaims: list[str] = []

    async def reclaim(lease_id: str, deadline: float, reason: str) -> None:
        reclaims.append(reason)

    async def lendable(_: frozenset[str]) -> None:
        return None

    hooks = LendingHooks(reclaim=reclaim, to_hold=lambda: WANTED, lendable=lendable, republish=lambda _: None)
    lending.bind(hooks, BrokerMetrics())
    return lending, slurm, reclaims


def _idle(lending: SlurmLending, tmp_path: Path, index: int, job: str) -> Hold:
    h = Hold("", job, "n1", (index,), HoldState.RUNNING, started_at=0.0)
    lending._idle.setdefault("n1", {})[index] = h
    (tmp_path / f"{job}.idle").write_text("")
    return h


async def test_an_idle_placeholder_slurm_preempted_is_not_held_again_until_the_cooldown_ends(
    tmp_path: Path,
) -> None:
    now = [1000.0]
    lending, _, _ = _lending(tmp_path, now, retake_hold_max_s=0.0)  # the cool-down alone
    assert lending.retake_cooldown_s == 7.0  # notice 2 s + 5 s
    _idle(lending, tmp_path, 0, "10")
    _idle(lending, tmp_path, 1, "11")
    (tmp_path / "10.idle").unlink()  # its script left on Slurm's SIGTERM
    await lending._terms()
    assert lending._idle["n1"].keys() == {1}
    assert lending._wanted() == {"n1": {1, 2}}
    now[0] = 1006.999
    assert lending._wanted() == {"n1": {1, 2}}
    now[0] = 1007.0  # the cooldown's end: wanted again
    assert lending._wanted() == {"n1": {0, 1, 2}}
    assert lending._cooling == {}


async def test_a_lease_slurm_took_back_cools_its_gpus(tmp_path: Path) -> None:
    now = [1000.0]
    lending, slurm, reclaims = _lending(tmp_path, now, retake_cooldown_s=30.0, retake_hold_max_s=0.0)
    h1, h2 = _idle(lending, tmp_path, 1, "11"), _idle(lending, tmp_path, 2, "12")
    record = LeaseLogRecord(
        lease_id="L1", site="edge-a", claim_id="c1", offer_id="o", gpus=["n1/gpu1", "n1/gpu2"],
        state=LeaseState.GRANTED, ts=now[0], granted_at=now[0], expires_at=now[0] + 600, notice_seconds=2.0,
    )  # fmt: skip
    assert await lending.hold(record) == ""
    slurm.listed = [
        Hold("", "11", "n1", (1,), HoldState.PREEMPTED, deadline=now[0] + 2, preempted_at=now[0]),
        Hold("", "12", "n1", (2,), HoldState.RUNNING),
    ]
    (tmp_path / "11.term").write_text(f"{now[0]}\n")
    try:
        await lending._terms()
        assert reclaims == [f"{LeaseReason.SCHEDULER_PREEMPTED}:11"]
        lending.ended(record)
        assert lending._wanted() == {"n1": {0}}  # both of the lease's GPUs, not only the one chosen
        now[0] += 29.9
        assert lending._wanted() == {"n1": {0}}
        now[0] += 0.1
        assert lending._wanted() == {"n1": {0, 1, 2}}
    finally:
        await lending.stop()
    assert (h1.job_id, h2.job_id) == ("11", "12")


async def test_no_placeholder_goes_to_a_node_while_one_of_its_gpus_cools(tmp_path: Path) -> None:
    """A placeholder asks Slurm for one GPU of a node and Slurm picks which: submitted while GPU 0
    of n1 cools, it could be handed GPU 0, which the training job Slurm took it for waits on."""
    now = [1000.0]
    lending, slurm, _ = _lending(tmp_path, now, retake_hold_max_s=0.0)
    submitted = _sbatch_counter(slurm)
    _idle(lending, tmp_path, 1, "11")
    slurm.listed = [Hold("", "11", "n1", (1,), HoldState.RUNNING)]
    lending._cool([("n1", 0)])
    try:
        await lending._poll()
        await asyncio.sleep(0.05)
        assert lending._wanted() == {"n1": {1, 2}}  # GPU 2 is to hold, GPU 0 cools
        assert submitted == []
        status = lending.hold_status()  # what the harvest replay's cause sampler reads
        assert status.cooling == {("n1", 0)} and status.idle == {("n1", 1)} and status.pending_by_node == {}
        now[0] = 1006.999
        await lending._poll()
        await asyncio.sleep(0.05)
        assert submitted == []
        now[0] = 1007.0  # the cool-down's end: GPUs 0 and 2 get a placeholder each
        await lending._poll()
        await asyncio.sleep(0.05)
        assert len(submitted) == 2 and all("--nodelist=n1" in argv for argv in submitted)
        assert lending.hold_status().pending_by_node == {"n1": 2} and lending.hold_status().cooling == set()
    finally:
        await lending.stop()


def _sbatch_counter(slurm: _Slurm) -> list[tuple[str, ...]]:
    submitted: list[tuple[str, ...]] = []

    async def command(*argv: str, stdin: str | None = None) -> str:
        if argv[0] == "sbatch":
            submitted.append(argv)
            return f"{90 + len(submitted)}"
        return ""

    slurm.command = command  # type: ignore[method-assign]
    return submitted


async def _preempt_idle_gpu0(lending: SlurmLending, slurm: _Slurm, tmp_path: Path) -> None:
    """Placeholders idle on GPUs 0 and 1 of n1; Slurm preempts the one on GPU 0 (at the clock's now)."""
    _idle(lending, tmp_path, 0, "10")
    _idle(lending, tmp_path, 1, "11")
    slurm.listed = [Hold("", "11", "n1", (1,), HoldState.RUNNING)]
    (tmp_path / "10.idle").unlink()  # its script left on Slurm's SIGTERM
    await lending._terms()


async def test_a_gpu_taken_back_stays_unlent_past_the_cooldown_until_a_training_job_holds_it(
    tmp_path: Path,
) -> None:
    """The job Slurm preempted GPU 0 for waits for GPUs elsewhere: past the cool-down GPU 0 gets no
    placeholder (nor does n1: Slurm would pick which GPU); once a read shows a job holding it, the
    node is lendable again."""
    now = [1000.0]
    lending, slurm, _ = _lending(tmp_path, now, retake_hold_max_s=60.0)
    submitted = _sbatch_counter(slurm)
    try:
        await _preempt_idle_gpu0(lending, slurm, tmp_path)
        now[0] = 1007.0  # the cool-down's end; the preempting job has not started
        await lending._poll()
        await asyncio.sleep(0.05)
        assert lending._wanted() == {"n1": {1, 2}}
        assert submitted == []
        status = lending.hold_status()  # the cause sampler: past the cool-down, awaiting training
        assert status.cooling == set() and status.awaiting_training == {("n1", 0)}
        now[0] = 1020.0
        slurm.training = {("n1", 0), ("n2", 3)}  # the job runs on GPU 0 now
        await lending._poll()
        await asyncio.sleep(0.05)
        assert lending.hold_status().awaiting_training == set()
        assert lending._wanted() == {"n1": {0, 1, 2}}
        assert len(submitted) == 2 and all("--nodelist=n1" in argv for argv in submitted)
    finally:
        await lending.stop()


async def test_a_training_job_seen_within_the_cooldown_ends_the_hold_at_the_cooldowns_end(
    tmp_path: Path,
) -> None:
    now = [1000.0]
    lending, slurm, _ = _lending(tmp_path, now, retake_hold_max_s=60.0)
    _sbatch_counter(slurm)
    try:
        await _preempt_idle_gpu0(lending, slurm, tmp_path)
        now[0] = 1003.0
        slurm.training = {("n1", 0)}
        await lending._poll()
        assert lending.hold_status().cooling == {("n1", 0)}  # the cool-down is the minimum
        assert lending.hold_status().awaiting_training == set()
        now[0] = 1006.999
        assert lending._wanted() == {"n1": {1, 2}}
        now[0] = 1007.0
        assert lending._wanted() == {"n1": {0, 1, 2}}
    finally:
        await lending.stop()


async def test_the_hold_ends_at_its_cap_when_no_training_job_is_seen(tmp_path: Path) -> None:
    """A job that never starts on the GPU (cancelled, placed elsewhere) keeps it unlent only up to
    ``retake_hold_max_s`` after the take-back; a job on another GPU of the node does not end it."""
    now = [1000.0]
    lending, slurm, _ = _lending(tmp_path, now, retake_hold_max_s=60.0)
    assert SlurmLending(slurm, control_dir=tmp_path).retake_hold_max_s == 120.0  # type: ignore[arg-type]
    _sbatch_counter(slurm)
    try:
        await _preempt_idle_gpu0(lending, slurm, tmp_path)
        slurm.training = {("n1", 3), ("n2", 0)}
        now[0] = 1059.999
        await lending._poll()
        assert lending._wanted() == {"n1": {1, 2}}
        assert lending.hold_status().awaiting_training == {("n1", 0)}
        now[0] = 1060.0  # taken back at 1000 + 60 s: lendable again
        assert lending.hold_status().awaiting_training == set()
        assert lending._wanted() == {"n1": {0, 1, 2}}
        assert lending._awaiting == {}
    finally:
        await lending.stop()


async def test_a_cap_below_the_cooldown_holds_nothing_past_the_cooldown(tmp_path: Path) -> None:
    now = [1000.0]
    lending, slurm, _ = _lending(tmp_path, now, retake_hold_max_s=3.0)
    await _preempt_idle_gpu0(lending, slurm, tmp_path)
    now[0] = 1006.999
    assert lending._wanted() == {"n1": {1, 2}}
    assert lending.hold_status().cooling == {("n1", 0)} and lending.hold_status().awaiting_training == set()
    now[0] = 1007.0
    assert lending._wanted() == {"n1": {0, 1, 2}}


async def test_only_a_read_started_after_the_take_back_ends_the_hold(tmp_path: Path) -> None:
    """A read begun before Slurm took the GPU back shows who held it then, not the job it was
    taken for."""
    now = [1000.0]
    lending, slurm, _ = _lending(tmp_path, now, retake_hold_max_s=60.0)
    await _preempt_idle_gpu0(lending, slurm, tmp_path)
    lending._seen_training({("n1", 0)}, read_at=999.999)
    assert ("n1", 0) in lending._awaiting
    lending._seen_training({("n1", 0)}, read_at=1000.0)
    assert lending._awaiting == {}


async def test_a_placeholder_slurm_starts_on_a_gpu_held_back_is_not_lendable_and_is_cancelled(
    tmp_path: Path,
) -> None:
    """A placeholder submitted on n1 before Slurm took GPU 0 back may be started by Slurm on GPU 0
    while the job it was taken for still waits: it is not reported lendable, and it is cancelled
    at the next read (not after ``unwanted_grace_s``)."""
    now = [1000.0]
    lending, slurm, _ = _lending(tmp_path, now, retake_hold_max_s=60.0)
    cancelled: list[tuple[str, ...]] = []
    told: list[frozenset[str]] = []

    async def command(*argv: str, stdin: str | None = None) -> str:
        if argv[0] == "scancel":
            cancelled.append(argv[1:])
        return ""

    async def lendable(gpus: frozenset[str]) -> None:
        told.append(gpus)

    async def idle_on_gpu0_at(t: float, job_id: str) -> None:
        """At ``t``, Slurm runs placeholder ``job_id`` (idle) on GPU 0 beside the one on GPU 1."""
        now[0] = t
        slurm.listed = [
            Hold("", "11", "n1", (1,), HoldState.RUNNING),
            Hold("", job_id, "n1", (0,), HoldState.RUNNING),
        ]
        (tmp_path / f"{job_id}.idle").write_text("")
        await lending._poll()

    slurm.command = command  # type: ignore[method-assign]
    lending._lendable = lendable
    try:
        await _preempt_idle_gpu0(lending, slurm, tmp_path)
        assert told[-1] == {"n1/gpu1"}
        await idle_on_gpu0_at(1010.0, "20")  # past the cool-down, the preempting job not yet running
        assert cancelled == [("20",)]
        assert told[-1] == {"n1/gpu1"}
        assert lending._idle["n1"].keys() == {1}
        await idle_on_gpu0_at(1060.0, "21")  # the cap: a placeholder on GPU 0 is lendable again
        assert cancelled == [("20",)]
        assert told[-1] == {"n1/gpu0", "n1/gpu1"}
    finally:
        await lending.stop()


async def test_a_claim_on_a_placeholder_that_just_left_reports_it_unlendable_and_cools_it(tmp_path: Path) -> None:
    """Slurm preempted an idle placeholder and its script left (idle file gone) before the
    lending's look for it: a claim that finds it gone is refused, and the GPU is at once no longer
    lendable (else the lease book offers it again after the refusal, while training runs on it)
    and cools down, as when the look finds it gone."""
    now = [1000.0]
    lending, _, _ = _lending(tmp_path, now, retake_hold_max_s=0.0)
    told: list[frozenset[str]] = []

    async def lendable(gpus: frozenset[str]) -> None:
        told.append(gpus)

    lending.bind(LendingHooks(reclaim=lambda *_: asyncio.sleep(0), to_hold=lambda: WANTED, lendable=lendable,
                              republish=lambda _: None), BrokerMetrics())  # fmt: skip
    _idle(lending, tmp_path, 0, "10")
    _idle(lending, tmp_path, 1, "11")
    await lending._tell()
    assert told == [frozenset({"n1/gpu0", "n1/gpu1"})]
    (tmp_path / "10.idle").unlink()  # its script left on Slurm's SIGTERM
    record = LeaseLogRecord(
        lease_id="L1", site="edge-a", claim_id="c1", offer_id="o", gpus=["n1/gpu1", "n1/gpu0"],
        state=LeaseState.GRANTED, ts=now[0], granted_at=now[0], expires_at=now[0] + 600, notice_seconds=2.0,
    )  # fmt: skip
    try:
        assert "taking a GPU back" in await lending.hold(record)
        await asyncio.sleep(0.01)
        assert told[-1] == frozenset({"n1/gpu1"})
        assert ("n1", 0) in lending._cooling and ("n1", 1) not in lending._cooling
        assert (tmp_path / "11.idle").exists()  # the other one is idle again
    finally:
        await lending.stop()
