"""Property: the lease book and :class:`broker.lending.SlurmLending` over random interleavings of
training submissions, claims, releases, expiries, Slurm preemptions and broker restarts never put
a GPU in two live leases, nor in a live lease (before its reclaim deadline) and a training job at
once.

Slurm is modelled in memory (:class:`_Slurm`: one node of 4 GPUs, partition-priority preemption
with a grace time, placeholders that leave at once on SIGTERM unless their held file exists):
what is tested is the broker's logic against Slurm's rules; the real cluster is exercised by
tests/test_broker_lending_slurm.py."""

from __future__ import annotations

import asyncio
import itertools
import tempfile
from collections.abc import Callable
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from broker.config import BrokerConfig
from broker.leases import Changes, LeaseBook, PendingGrant
from broker.lending import LendingHooks, SlurmLending
from broker.metrics import BrokerMetrics
from broker.scheduler import Hold, HoldState
from broker.scheduler_slurm import COMMENT_PREFIX, IDLE_COMMENT, BackfillTiming, SLURM_BACKFILL_DEFAULTS
from contracts import CapacityUpdate, Claim, GpuState, IdleGrade, LeaseLogRecord, LeaseState, ReasonCode
from contracts.mqtt import Release

HOST, GPUS, GRACE = "n1", 4, 3.0


class _Job:
    def __init__(self, job_id: str, lent: bool, gpus: int, comment: str) -> None:
        self.job_id, self.lent, self.gpus, self.comment = job_id, lent, gpus, comment
        self.indices: tuple[int, ...] = ()
        self.state = "PENDING"
        self.started_at: float | None = None
        self.preempted_at: float | None = None
        self.end: float | None = None


class _Slurm:
    """Slurm's rules for one node, as far as the broker sees them (module docstring), and the
    placeholder script's side of the idle/held files (broker.placeholders)."""

    partition, gres_type, cpus_per_gpu = "lent", "h100", 1

    def __init__(self, control: Path, clock: list[float]) -> None:
        self.jobs_: dict[str, _Job] = {}
        self._ids = itertools.count(1)
        self.control, self.clock = control, clock

    # what SlurmLending calls ----------------------------------------------------------------------
    async def command(self, *argv: str, stdin: str | None = None) -> str:
        if argv[0] == "sbatch":
            opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
            job = _Job(str(next(self._ids)), True, int(opts["gres"].rsplit(":", 1)[1]), opts["comment"])
            self.jobs_[job.job_id] = job
            self.schedule()
            return f"{job.job_id}\n"
        if argv[0] == "scancel":
            for j in argv[1:]:
                self._end(j)
            self.schedule()
            return ""
        if argv[:2] == ("scontrol", "update"):
            fields = dict(a.split("=", 1) for a in argv[2:])
            for job_id in fields["JobId"].split(","):  # scontrol(1): a comma-separated job list
                job = self.jobs_.get(job_id)
                if job is not None and job.state != "ENDED":
                    job.comment = fields["Comment"]
            return ""
        if argv[:3] == ("scontrol", "show", "node"):
            return f"NodeName={HOST} NodeAddr=127.0.0.1\n"
        raise AssertionError(f"unexpected command {argv}")

    async def jobs(self, job_id: str | None = None) -> list[Hold]:
        out = []
        for j in self.jobs_.values():
            if not j.lent or (job_id is not None and j.job_id != job_id):
                continue
            if j.state == "ENDED":
                state = HoldState.ENDED
            elif j.state == "PENDING":
                state = HoldState.PENDING
            else:
                state = HoldState.PREEMPTED if j.preempted_at is not None else HoldState.RUNNING
            lease = j.comment[len(COMMENT_PREFIX) :] if j.comment != IDLE_COMMENT else ""
            out.append(Hold(lease, j.job_id, HOST if j.indices else "", j.indices, state, j.end, j.preempted_at,
                            j.started_at))  # fmt: skip
        return out

    async def backfill_timing(self) -> BackfillTiming:
        return SLURM_BACKFILL_DEFAULTS

    async def jobs_and_training(self) -> tuple[list[Hold], frozenset[tuple[str, int]], dict[str, float]]:
        return await self.jobs(), frozenset((HOST, i) for i in self.training_gpus()), {}

    async def confirm_notice(self, hold: Hold) -> None:
        """The script already leaving ignores it."""

    # the cluster ------------------------------------------------------------------------------------
    def _end(self, job_id: str) -> None:
        job = self.jobs_.get(job_id)
        if job is not None:
            job.state, job.indices = "ENDED", ()

    def submit_training(self, gpus: int) -> None:
        job = _Job(str(next(self._ids)), False, gpus, "")
        self.jobs_[job.job_id] = job
        self.schedule()

    def training_gpus(self) -> set[int]:
        return {i for j in self.jobs_.values() if not j.lent and j.state == "RUNNING" for i in j.indices}

    def schedule(self) -> None:
        """Preempted lent jobs leave (at once when nothing holds them, else at their end); pending
        training jobs run on free GPUs or preempt lent jobs; lent jobs run when nothing waits."""
        now = self.clock[0]
        for j in self.jobs_.values():
            if j.lent and j.state == "RUNNING" and j.preempted_at is not None:
                idle = self.control / f"{j.job_id}.idle"
                try:  # the script's SIGTERM trap: leave at once if still idle
                    idle.rename(self.control / f"{j.job_id}.idle.left")
                    self._end(j.job_id)
                except FileNotFoundError:  # carved: a lease's hold, until its end (or scancel)
                    term = self.control / f"{j.job_id}.term"
                    if not term.exists():  # when the script got Slurm's SIGTERM
                        term.write_text(f"{j.preempted_at}\n")
                    if j.end is not None and now >= j.end:
                        self._end(j.job_id)
        used = {i for j in self.jobs_.values() if j.state == "RUNNING" for i in j.indices}
        free = [i for i in range(GPUS) if i not in used]
        waiting = False
        for j in [j for j in self.jobs_.values() if not j.lent and j.state == "PENDING"]:
            if len(free) >= j.gpus:
                j.indices, free = tuple(free[: j.gpus]), free[j.gpus :]
                j.state, j.started_at = "RUNNING", now
                continue
            waiting = True
            short = j.gpus - len(free)
            for v in [v for v in self.jobs_.values() if v.lent and v.state == "RUNNING" and v.preempted_at is None]:
                if short <= 0:
                    break
                v.preempted_at, v.end = now, now + GRACE
                short -= len(v.indices)
        if waiting:
            return
        for j in [j for j in self.jobs_.values() if j.lent and j.state == "PENDING"]:
            if free and j.gpus <= len(free):
                j.indices, free = tuple(free[: j.gpus]), free[j.gpus :]
                j.state, j.started_at, j.end = "RUNNING", now, now + 3600
                (self.control / f"{j.job_id}.idle").touch()  # the script starts


class LendingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tmp = tempfile.TemporaryDirectory()
        self.control = Path(self.tmp.name)
        self.clock = [1000.0]
        self.slurm = _Slurm(self.control, self.clock)
        self.cfg = BrokerConfig(offer_ttl_s=600, notice_s=GRACE, lease_ttl_s=8, capacity_max_age_s=1e6)
        self.log: list[LeaseLogRecord] = []
        self.claims = itertools.count(1)
        self._restart(first=True)

    def teardown(self) -> None:
        self.loop.run_until_complete(self.lending.stop())
        self.loop.close()
        self.tmp.cleanup()

    # plumbing as in BrokerService ----------------------------------------------------------------
    def _new_lending(self) -> SlurmLending:
        lending = SlurmLending(
            self.slurm,  # type: ignore[arg-type]
            notice_s=GRACE, control_dir=self.control, poll_s=1e6, unwanted_grace_s=2.0,
            clock=lambda: self.clock[0],
        )  # fmt: skip
        lending.bind(LendingHooks(self._reclaim, self._to_hold, self._lendable, lambda _: None), BrokerMetrics())
        return lending

    def _to_hold(self) -> list[str]:
        return self.book.to_hold_for_lending(self.clock[0])

    async def _lendable(self, gpus: frozenset[str]) -> None:
        self._apply(self.book.set_lendable(gpus, self.clock[0]))

    def _apply(self, ch: Changes) -> None:
        for rec in ch.records:
            self.log.append(rec)
            if not rec.state.live:
                self.lending.ended(rec)

    async def _reclaim(self, lease_id: str, deadline: float, reason: str) -> None:
        rec = self.book.leases.get(lease_id)
        if rec is not None and rec.state in (LeaseState.GRANTED, LeaseState.ACTIVE):
            self._apply(self.book.reclaim(self.clock[0], rec.gpus, reason=reason, force=True, deadline=deadline))

    def _in_loop(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the machine's loop (what ends a lease starts a task there)."""

        async def go() -> None:
            fn()

        self._run(go())

    def _run(self, coro: object) -> None:
        self.loop.run_until_complete(coro)  # type: ignore[arg-type]
        for _ in range(5):  # let background retags and releases run
            self.loop.run_until_complete(asyncio.sleep(0))

    def _capacity(self) -> None:
        busy = self.slurm.training_gpus()
        now = self.clock[0]
        for i in range(GPUS):
            idle = i not in busy
            self._apply(self.book.apply_capacity(CapacityUpdate(
                ts=now, host=HOST, gpu_uuid=f"gpu{i}", state=GpuState.IDLE if idle else GpuState.BUSY,
                since=now, grade=IdleGrade.FREE if idle else None, predicted_idle_until=now + 3600 if idle else None,
            ), now))  # fmt: skip

    def _restart(self, first: bool = False) -> None:
        if not first:
            self._run(self.lending.stop())
        counter = itertools.count(len(self.log) + 1)
        self.book = LeaseBook(self.cfg, new_id=lambda p: f"{p}-{self.clock[0]:.0f}-{next(counter)}")
        self.lending = self._new_lending()
        self.book.set_lendable((), self.clock[0])  # as BrokerService does for an enforced lending
        self._in_loop(lambda: self._apply(self.book.rebuild(list(self.log), self.clock[0])))
        self._in_loop(self._capacity)
        self._run(self.lending.start(self.book.live_leases()))

    # rules -----------------------------------------------------------------------------------------------
    @rule(gpus=st.integers(1, GPUS))
    def training(self, gpus: int) -> None:
        self.slurm.submit_training(gpus)

    @rule(count=st.integers(1, 3))
    def claim(self, count: int) -> None:
        offer = next(iter(self.book.offers.values()), None)
        if offer is None:
            return
        claim = Claim(claim_id=f"c{next(self.claims)}", site="s", offer_id=offer.offer_id,
                      count=min(count, len(offer.gpus)), duration_seconds=30, ts=self.clock[0])  # fmt: skip
        step, ch = self.book.begin_claim("s", claim, self.clock[0])
        self._in_loop(lambda: self._apply(ch))
        if not isinstance(step, PendingGrant):
            return
        problem: list[str] = []

        async def hold() -> None:
            problem.append(await self.lending.hold(step.record))

        self._run(hold())
        if problem[0]:
            self._in_loop(lambda: self._apply(self.book.abort(step, ReasonCode.ISOLATION_FAILED, problem[0], self.clock[0])[1]))
        else:
            self._in_loop(lambda: self._apply(self.book.grant(step, self.clock[0])[1]))

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        live = sorted(r.lease_id for r in self.book.live_leases())
        if live:
            lease = data.draw(st.sampled_from(live))
            release = Release(lease_id=lease, site="s", ts=self.clock[0])
            self._in_loop(lambda: self._apply(self.book.release("s", release, self.clock[0])[1]))

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 2.0, 4.0]))
    def time_passes(self, dt: float) -> None:
        """Slurm schedules (preemptions, ends), the broker reads it and ticks (expiries, revocations)."""
        self.clock[0] += dt
        self.slurm.schedule()
        self._run(self.lending._poll())
        self._in_loop(lambda: self._apply(self.book.tick(self.clock[0])))
        self._in_loop(self._capacity)
        self.slurm.schedule()

    @rule()
    def broker_sees_signals(self) -> None:
        """The broker's look for term files (SIGTERMs of carved holds) between two full reads."""
        self.slurm.schedule()
        self._run(self.lending._terms())
        # once the broker has looked, no offer names a GPU Slurm runs training on
        training = self.slurm.training_gpus()
        for offer in self.book.offers.values():
            indices = {int(g.gpu.rsplit("/gpu", 1)[1]) for g in offer.gpus}
            assert not indices & training, f"offer {offer.offer_id} names training's GPUs {indices & training}"

    @rule()
    def broker_restarts(self) -> None:
        self._restart()

    # the property ---------------------------------------------------------------------------------------
    @invariant()
    def no_gpu_lent_twice_nor_lent_and_training(self) -> None:
        now = self.clock[0]
        seen: set[str] = set()
        training = self.slurm.training_gpus()
        for rec in self.book.live_leases():
            assert not seen & set(rec.gpus), f"GPU in two live leases: {seen & set(rec.gpus)}"
            seen |= set(rec.gpus)
            if rec.state is LeaseState.RECLAIMING and rec.reclaim_deadline is not None and now >= rec.reclaim_deadline:
                continue  # past its deadline: Slurm has taken it back, the next tick revokes it
            indices = {int(g.rsplit("/gpu", 1)[1]) for g in rec.gpus}
            assert not indices & training, f"lease {rec.lease_id} ({rec.state}) and training share {indices & training}"


TestLending = LendingMachine.TestCase
TestLending.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
