"""Leases in the training scheduler: fencing, training wins, the site's workload.

The broker (:class:`broker.service.BrokerService`) gives a :class:`Lending` its
:class:`LendingHooks` (reclaim a lease, which GPUs to hold for lending, which are held now,
republish a lease) and calls it at four points:
:meth:`~Lending.start` after the lease book is rebuilt (adopt the scheduler's holds, cancel those
of leases that are no longer live), :meth:`~Lending.hold` before a claim is granted (``""``: the
GPUs are held for the lease; else why not, and the claim is refused ``isolation_failed``),
:meth:`~Lending.ended` when a lease ends (release, expiry, revocation: the hold goes), and
:meth:`~Lending.endpoint` when it publishes a lease message (node → ``host:port`` of the lease's
workload healthy there).

:class:`NoLending` (``[broker] scheduler = "none"``) holds nothing;
:class:`broker.lending_kubernetes.KubernetesLending` (``"kubernetes"``) holds with placeholder pods
(that module's docstring). :class:`SlurmLending`
(``"slurm"``) carves leases out of placeholder jobs (:mod:`broker.placeholders`): every GPU the
book would offer (:meth:`broker.leases.LeaseBook.to_hold_for_lending`) is held ahead of time by
a one-GPU job in the lent partition, and only GPUs held so are offered
(:meth:`broker.leases.LeaseBook.set_lendable`, told through :attr:`LendingHooks.lendable`): an
offer never names a GPU Slurm has given to training, and a claim is granted without submitting
anything to Slurm (a claim whose placeholder Slurm has just taken back is refused, and the site
claims again). An idle placeholder Slurm preempts renames its idle file away at once; the watch
sees that within ``term_poll_s`` and the GPU leaves its offer. It reads
Slurm's jobs (``scontrol show job -d -o``) every ``poll_s`` while placeholders are wanted,
starting or unwanted, else every ``read_every_s``; and every ``term_poll_s``
it looks for the term files of the carved placeholders (written by their script when Slurm
signals them, :mod:`broker.placeholders`): a new one is confirmed by reading that job alone, so
a preemption is noticed when Slurm signals it rather than at the next full read:

* a lease hold Slurm chose for preemption (a pending training job needs the GPUs, partition
  preemption) → the lease is reclaimed with Slurm's own deadline (``EndTime``, the end of the
  lent partition's ``GraceTime``), reason ``scheduler_preempted:<job id>``; every job of the lease
  is sent SIGTERM, so the workload drains; at the deadline the lease is revoked. A hold already
  gone when read, whose workload drained and left before the grace time ran out, is that too
  (Slurm still lists it, ended, with its ``PreemptTime``): its deadline is ``PreemptTime`` + the
  notice, as Slurm set ``EndTime`` at the preemption;
* a lease hold that ended while the lease is live without Slurm choosing it (an operator's
  ``scancel``, a node failure) → the lease is reclaimed with the deadline ``now`` (revoked at the
  next tick), ``hold_lost``;
* placeholders are submitted for GPUs to hold not yet held, and idle placeholders on GPUs no
  longer to hold are cancelled after ``unwanted_grace_s``; a GPU Slurm took back (either case
  above, or an idle placeholder it preempted) gets no new placeholder for ``retake_cooldown_s``
  (the job it was taken for may still wait for other GPUs it preempted), nor after that until a
  read of Slurm's jobs shows a job other than gpupool's holding it, at most ``retake_hold_max_s``
  from the take-back; neither does any other GPU of its node meanwhile: a placeholder asks Slurm
  for one GPU of a node, and Slurm picks which, so it could be handed the GPU held back;
* a time limit Slurm refuses for a carved placeholder it has just chosen for preemption ("Job has
  already finished") is that preemption, seen early, not a failure.

A placeholder's time limit is ``placeholder_minutes``, but on a node where Slurm plans a pending
training job to start (``StartTime`` and ``SchedNodeList`` of the job), only the whole minutes
that end before that start at the backfill scheduler's resolution (:func:`placeholder_minutes`,
with the timing read from ``scontrol show config`` at start): Slurm's backfill starts a job on
GPUs its plan needs for a pending job only if it ends by then, as it fills them with any short
job. Once running, a placeholder is taken back by preemption like any other when the job can
start, earlier than planned or not, and Slurm's plan does not move for its time limit: so, once
seen running, a placeholder that started with a shorter limit gets ``placeholder_minutes``
(``scontrol update ... TimeLimit=``, before any carving renames it) and holds its GPU up to the
planned start instead of leaving up to a minute and the backfill's rounding before it. An idle
placeholder that leaves for its time limit is no take-back: its GPU does not cool down, and a new
placeholder holds it while it is still to hold.

Slurm needs nothing from gpupool: holds are ordinary jobs with time limits (a lease's end), and
partition preemption takes them back with the grace time whether or not the broker runs.

The minimum guaranteed duration of a claim maps to Slurm's ``PreemptExemptTime`` (cluster-wide,
counted from a job's start): Slurm does not preempt a hold younger than it. A placeholder older
than that carries no exemption, so with placeholders a lease is guaranteed only what gpupool
enforces (demands), not what Slurm does when gpupool is down; the broker refuses nothing for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from broker.config import BrokerConfig
from broker.metrics import BrokerMetrics
from broker.placeholders import GpuMap, placeholder_script, read_term, start_script
from broker.scheduler import Hold, HoldState, SchedulerError
from broker.scheduler_slurm import (
    COMMENT_PREFIX,
    IDLE_COMMENT,
    JOB_NAME,
    SLURM_BACKFILL_DEFAULTS,
    BackfillTiming,
    SlurmScheduler,
    job_gone,
)
from broker.workloads import (
    WorkloadError,
    WorkloadProfile,
    allowed,
    pick_port,
    placeholder_cpus,
    render,
    wait_healthy,
)
from contracts import LeaseLogRecord, LeaseState
from contracts.leases import LeaseReason
from runtime.settings import BrokerSettings

log = logging.getLogger(__name__)

Reclaim = Callable[[str, float, str], Awaitable[None]]
"""``(lease_id, deadline, reason)``: reclaim a live lease with that deadline (Unix s)."""
ToHold = Callable[[], Iterable[str]]
"""The GPU keys the broker would offer if the scheduler held them for lending."""
Lendable = Callable[[frozenset[str]], Awaitable[None]]
"""Tell the broker the GPU keys the scheduler holds for lending now (only those are offered)."""
Republish = Callable[[str], None]
"""Publish the lease message of ``lease_id`` again (its endpoint changed)."""


@dataclass(frozen=True)
class LendingHooks:
    """The broker's side of a :class:`Lending` (called from :meth:`Lending.start` on).

    Attributes:
        reclaim: reclaim a live lease with the scheduler's deadline (:data:`Reclaim`).
        to_hold: the GPUs to hold for lending (:data:`ToHold`).
        lendable: the GPUs held for lending now (:data:`Lendable`); a lending that is not
            :attr:`Lending.enforced` never calls it.
        republish: publish a lease message again (:data:`Republish`).
    """

    reclaim: Reclaim
    to_hold: ToHold
    lendable: Lendable
    republish: Republish


@dataclass(frozen=True)
class HoldStatus:
    """What :class:`SlurmLending`'s placeholders hold at one moment.

    Attributes:
        idle: (node, GRES index) of the running placeholders not carved into a lease (lendable).
        pending_by_node: placeholders submitted (or being submitted) and not yet running, per node.
        cooling: (node, GRES index) of the GPUs in their retake cool-down (no new placeholder).
        awaiting_training: (node, GRES index) of the GPUs Slurm took back whose cool-down has
            ended and on which no training job has been seen yet (no new placeholder until one
            is, or :attr:`SlurmLending.retake_hold_max_s` has passed); none of them is in
            ``cooling``.
    """

    idle: frozenset[tuple[str, int]]
    pending_by_node: Mapping[str, int]
    cooling: frozenset[tuple[str, int]]
    awaiting_training: frozenset[tuple[str, int]] = frozenset()


async def _nothing_lendable(_: frozenset[str]) -> None:
    return None


_RETAG_DELAY_S = 0.2
"""Seconds between a carving and the Slurm commands that name its jobs."""

_NODE_ADDR = re.compile(r"(?:^|\s)NodeAddr=(\S+)")
_NODE_NAME = re.compile(r"(?:^|\s)NodeName=(\S+)")


class Lending(Protocol):
    """What the broker asks of the training scheduler (module docstring).

    Attributes:
        enforced: True if a lease is granted only with a running hold in the scheduler (then
            only GPUs it reports through :attr:`LendingHooks.lendable` are offered).
    """

    enforced: bool

    def bind(self, hooks: LendingHooks, metrics: BrokerMetrics) -> None:
        """Give the broker's callbacks (called from :meth:`start` on) and the service's metrics
        (:class:`broker.metrics.BrokerMetrics`), where the lending counts what it does."""
        ...

    async def start(self, live: Sequence[LeaseLogRecord]) -> None:
        """Adopt the scheduler's holds of the ``live`` leases, cancel the others, start watching.
        Raises :class:`broker.scheduler.SchedulerError` if the scheduler cannot be read."""
        ...

    async def stop(self) -> None:
        """Stop watching (the holds stay: Slurm keeps fencing while gpupool is down)."""
        ...

    async def hold(self, record: LeaseLogRecord) -> str:
        """Hold ``record.gpus`` for the lease (and start its workload); ``""`` when held, else
        why not (nothing is held then). Never raises."""
        ...

    def reclaiming(self, record: LeaseLogRecord) -> None:
        """The lease is being reclaimed (its notice runs): its workload gets SIGTERM now."""
        ...

    def ended(self, record: LeaseLogRecord) -> None:
        """The lease ended (or its grant was undone): its hold goes, in the background."""
        ...

    def endpoint(self, lease_id: str) -> Mapping[str, str]:
        """The lease's workload where it is healthy: node → ``host:port`` (one instance per node
        of the lease); empty while none is (or the lease has no workload)."""
        ...


class NoLending:
    """``[broker] scheduler = "none"``: leases hold nothing in a training scheduler."""

    enforced = False

    def bind(self, hooks: LendingHooks, metrics: BrokerMetrics) -> None:
        """Nothing to call back, nothing to count."""

    async def start(self, live: Sequence[LeaseLogRecord]) -> None:
        """Nothing to adopt."""

    async def stop(self) -> None:
        """Nothing runs."""

    async def hold(self, record: LeaseLogRecord) -> str:
        """Nothing is held: ``""``."""
        return ""

    def reclaiming(self, record: LeaseLogRecord) -> None:
        """No workload runs."""

    def ended(self, record: LeaseLogRecord) -> None:
        """Nothing to release."""

    def endpoint(self, lease_id: str) -> Mapping[str, str]:
        """No workload runs: empty."""
        return {}


PLAN_SLACK_S = 5.0
"""How long (s) after ``sbatch`` a placeholder may start, besides waiting for a backfill cycle."""

SIGNAL_EARLY_S = 60.0
"""How early (s) Slurm may send a job's ``--signal`` before the time given (sbatch(1): "due to
the resolution of event handling by Slurm, the signal may be sent up to 60 seconds earlier")."""


def placeholder_minutes(
    planned_start: float | None, now: float, most: int, timing: BackfillTiming = SLURM_BACKFILL_DEFAULTS
) -> int:
    """Time limit (whole minutes, Slurm's granularity) of a placeholder submitted at ``now`` on
    a node where Slurm plans a pending job to start at ``planned_start`` (Unix s; ``None``: no
    plan there), with the backfill scheduler's ``timing``.

    The placeholder must end by the planned start rounded down to a multiple of
    ``timing.resolution_s`` (Slurm's backfill keeps times at that resolution: one ending past it
    stays pending), even if it starts ``timing.interval_s`` + :data:`PLAN_SLACK_S` after
    ``now`` (the next backfill cycle). The result is the whole minutes that fit, at most
    ``most``; ``most`` when not one minute fits (Slurm may still start it on a GPU of the node
    the plan does not need) or there is no plan.
    """
    if planned_start is None:
        return most
    end_by = math.floor(planned_start / timing.resolution_s) * timing.resolution_s
    fits = math.floor((end_by - now - timing.interval_s - PLAN_SLACK_S) / 60.0)
    return min(most, fits) if fits >= 1 else most


class SlurmLending:
    """Leases carved from placeholder jobs in Slurm's lent partition (module docstring).

    Args:
        scheduler: runs and reads Slurm's commands (its ``partition``, ``gres_type``,
            ``slurm_conf``).
        gpu_map: GRES index ↔ GPU key.
        workloads: the operator's profiles (``BrokerConfig.workloads``); every placeholder asks
            Slurm for the CPUs of the most demanding one (:func:`broker.workloads.placeholder_cpus`).
        notice_s: the leases' notice (= the lent partition's ``GraceTime``), seconds.
        control_dir: where placeholder jobs write their output and find their held and start
            files (shared with the nodes).
        poll_s: seconds between two reads of Slurm's jobs while placeholders are wanted,
            starting or unwanted (offered GPUs not held, jobs submitted, idle ones not offered).
        read_every_s: seconds between two reads of Slurm's jobs otherwise (what no term file
            tells: a node failure, a placeholder preempted while idle).
        term_poll_s: seconds between two looks for the term files of carved placeholders.
        placeholder_minutes: time limit of an idle placeholder, minutes (less on a node with a
            planned training start: :func:`placeholder_minutes`).
        unwanted_grace_s: an idle placeholder on a GPU no longer offered is cancelled after
            this many seconds; a placeholder pending this long is cancelled too.
        retake_cooldown_s: a GPU Slurm took back (a placeholder it preempted, idle or carved, or
            a lease's hold that went) gets no new placeholder for this many seconds (``None``:
            the notice + 5 s), nor does its node (Slurm picks a placeholder's GPU): the training
            job it was taken for starts on it only once every GPU it preempts is free, and a
            placeholder held again meanwhile is one more it must preempt, with one more notice
            to wait.
        retake_hold_max_s: after its cool-down, a GPU Slurm took back still gets no new
            placeholder (nor does its node) until a read of Slurm's jobs shows a job other than
            gpupool's holding it (the job it was taken for may wait longer than the cool-down
            for GPUs on other nodes, or for more preemptions), but at most this many seconds
            from the take-back (Unix time, the ``clock``'s): a job that never starts there
            (cancelled, placed elsewhere) must not keep the GPU unlent for ever. The cool-down
            is the minimum: a value below ``retake_cooldown_s`` holds nothing past it.
        clock: Unix time source.
    """

    enforced = True

    def __init__(
        self,
        scheduler: SlurmScheduler,
        *,
        gpu_map: GpuMap | None = None,
        workloads: Collection[WorkloadProfile] = (),
        notice_s: float = 30.0,
        control_dir: Path,
        poll_s: float = 0.25,
        read_every_s: float = 1.0,
        term_poll_s: float = 0.05,
        placeholder_minutes: int = 60,
        unwanted_grace_s: float = 5.0,
        retake_cooldown_s: float | None = None,
        retake_hold_max_s: float = 120.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.scheduler = scheduler
        self.gpu_map = gpu_map or GpuMap()
        self.workloads = tuple(workloads)
        self.placeholder_cpus = placeholder_cpus(self.workloads, scheduler.cpus_per_gpu)
        """CPUs each placeholder asks Slurm for (``--cpus-per-task``)."""
        self.notice_s = notice_s
        self.control_dir = control_dir
        self.poll_s = poll_s
        self.read_every_s = max(poll_s, read_every_s)
        self.term_poll_s = term_poll_s
        self.placeholder_minutes = placeholder_minutes
        self.unwanted_grace_s = unwanted_grace_s
        self.retake_cooldown_s = notice_s + 5.0 if retake_cooldown_s is None else retake_cooldown_s
        self._clock = clock
        self.retake_hold_max_s = retake_hold_max_s
        self._cooling: dict[tuple[str, int], float] = {}
        """GPUs Slurm took back: (node, GRES index) → until when (clock) no placeholder holds them."""
        self._awaiting: dict[tuple[str, int], tuple[float, float]] = {}
        """GPUs Slurm took back on which no training job has been seen since: (node, GRES index) →
        (taken back at, held back until at most), clock times (:attr:`retake_hold_max_s`)."""
        self._reclaim: Reclaim | None = None
        self._metrics = BrokerMetrics()  # replaced by the service's in bind()
        self._to_hold: ToHold = lambda: ()
        self._lendable: Lendable = _nothing_lendable
        self._told: frozenset[str] | None = None
        """The GPUs last reported through ``lendable`` (``None``: not yet)."""
        self._republish: Republish = lambda _: None
        self._idle: dict[str, dict[int, Hold]] = {}
        """Running placeholders not carved into a lease: node → GRES index → hold."""
        self._leases: dict[str, list[Hold]] = {}
        """Holds of each live lease (job ids fixed at carving; states as carved)."""
        self._noticed: set[str] = set()
        """Leases already reclaimed for the scheduler (preempted or hold lost)."""
        self._termed: set[str] = set()
        """Carved placeholders whose term file was seen (each is confirmed once)."""
        self._submitted: dict[str, tuple[str, float]] = {}
        """Placeholders submitted and not yet seen running: job id → (node, submit time)."""
        self._submitting: dict[str, int] = {}
        """``sbatch`` of a placeholder in progress, per node."""
        self._plans: dict[str, float] = {}
        """Node → when Slurm plans a pending training job to start there (the latest read)."""
        self._backfill = SLURM_BACKFILL_DEFAULTS
        """The backfill scheduler's timing (read at :meth:`start`; Slurm's defaults until then)."""
        self._extended: set[str] = set()
        """Idle placeholders started with a shorter time limit whose limit was raised (or tried)."""
        self._extending: dict[str, asyncio.Task[None]] = {}
        """Raises in progress: job id → the task running ``scontrol update`` (a carving waits)."""
        self._unwanted: dict[str, float] = {}
        """Idle placeholders on GPUs not offered: job id → since when (clock)."""
        self._ports: dict[str, dict[str, int]] = {}
        """Workload of each lease: lease id → node → the port its instance there listens on; kept
        after the lease ends until its hold is gone (the workload may still be draining on it)."""
        self._endpoints: dict[str, dict[str, str]] = {}
        """Healthy workload instances: lease id → node → ``addr:port``."""
        self._addr: dict[str, str] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._watch: asyncio.Task[None] | None = None
        self._watch_terms: asyncio.Task[None] | None = None

    # wiring --------------------------------------------------------------------------------------
    def bind(self, hooks: LendingHooks, metrics: BrokerMetrics) -> None:
        """See :meth:`Lending.bind`."""
        self._reclaim, self._to_hold, self._republish = hooks.reclaim, hooks.to_hold, hooks.republish
        self._lendable = hooks.lendable
        self._metrics = metrics

    async def start(self, live: Sequence[LeaseLogRecord]) -> None:
        """See :meth:`Lending.start`: holds of live leases are adopted (their workload's health
        checked again; a placeholder carved but not yet named after its lease is named now, its
        lease found by its GPU), holds of other leases cancelled, live leases without any hold reclaimed
        at once (``hold_lost``)."""
        self.control_dir.mkdir(parents=True, exist_ok=True)
        await self._read_addrs()
        try:
            self._backfill = await self.scheduler.backfill_timing()
        except SchedulerError as e:  # Slurm's defaults: placeholders on planned nodes end earlier
            self._metrics.scheduler_errors.labels(operation="read").inc()
            log.warning("backfill_timing_unread", extra={"error": str(e), "assumed": str(self._backfill)})
        jobs = [h for h in await self.scheduler.jobs() if h.state is not HoldState.ENDED]
        live_ids = {r.lease_id: r for r in live}
        by_gpu = {g: r for r in live for g in r.gpus}
        stale: list[str] = []
        unnamed: dict[str, list[Hold]] = {}
        for h in jobs:
            if not h.lease_id and self._file(h.job_id, "held").exists():
                # carved by a broker that stopped before naming it: its lease's if one holds the GPU
                owner = self._owner(h, by_gpu)
                if owner is None:
                    stale.append(h.job_id)
                else:
                    self._leases.setdefault(owner.lease_id, []).append(h)
                    unnamed.setdefault(owner.lease_id, []).append(h)
                continue
            if not h.lease_id:
                continue
            if h.lease_id in live_ids:
                self._leases.setdefault(h.lease_id, []).append(h)
            else:
                stale.append(h.job_id)
        if stale:
            await self._cancel(stale, "release")
            log.info("stale_holds_cancelled", extra={"job_ids": stale})
        for rec in live:
            if rec.state is LeaseState.RECLAIMING:
                self._noticed.add(rec.lease_id)
                self._site_told(self._leases.get(rec.lease_id, ()))
            if rec.lease_id not in self._leases:
                self._noticed.add(rec.lease_id)
                if rec.state is not LeaseState.RECLAIMING and self._reclaim is not None:
                    log.warning("hold_missing_at_start", extra={"lease_id": rec.lease_id})
                    await self._reclaim(rec.lease_id, self._clock(), f"{LeaseReason.HOLD_LOST}:none")
            else:
                self._adopt_workload(rec)
        for lease_id, holds in unnamed.items():
            self._background(self._retag(live_ids[lease_id], holds), f"hold-retag-{lease_id}")
        await self._poll()
        self._watch = asyncio.create_task(self._watch_forever(), name="broker-lending-watch")
        self._watch_terms = asyncio.create_task(self._terms_forever(), name="broker-lending-terms")
        log.info(
            "lending_started",
            extra={
                "adopted_leases": sorted(self._leases),
                "placeholders": sum(len(v) for v in self._idle.values()),
                "bf_interval_s": self._backfill.interval_s,
                "bf_resolution_s": self._backfill.resolution_s,
            },
        )

    def _owner(self, hold: Hold, by_gpu: dict[str, LeaseLogRecord]) -> LeaseLogRecord | None:
        """The live lease (of ``by_gpu``: GPU key → lease) holding a one-GPU placeholder's GPU."""
        if len(hold.gpu_indices) != 1:
            return None
        try:
            return by_gpu.get(self.gpu_map.key(hold.host, hold.gpu_indices[0]))
        except KeyError:
            return None

    async def stop(self) -> None:
        """See :meth:`Lending.stop`; releases in progress are awaited."""
        for watch in (self._watch, self._watch_terms):
            if watch is not None:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
        self._watch = self._watch_terms = None
        for t in list(self._tasks):
            if not t.get_name().startswith("hold-release"):
                t.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # leases ----------------------------------------------------------------------------------------
    async def hold(self, record: LeaseLogRecord) -> str:
        """See :meth:`Lending.hold`: carve the placeholders on ``record.gpus`` (their idle files
        renamed to held files, :mod:`broker.placeholders`): no Slurm command on this path; the
        jobs' rename and time limit follow in the background."""
        taken: list[Hold] = []
        for key in record.gpus:
            where = self.gpu_map.locate(key)
            hold = self._idle.get(where[0], {}).pop(where[1], None) if where else None
            if hold is None:
                for h in taken:
                    self._idle.setdefault(h.host, {})[h.gpu_indices[0]] = h
                return (
                    f"{key}: not held in Slurm's {self.scheduler.partition} partition now (taken back for "
                    "training, or not held yet); claim again"
                )
            taken.append(hold)
        carved: list[Hold] = []
        leaving: Hold | None = None
        for h in taken:
            try:  # atomic against the script leaving on SIGTERM (broker.placeholders)
                self._file(h.job_id, "idle").rename(self._file(h.job_id, "held"))
            except FileNotFoundError:
                leaving = h
                break
            carved.append(h)
        if leaving is not None:
            for h in carved:
                with contextlib.suppress(FileNotFoundError):
                    self._file(h.job_id, "held").rename(self._file(h.job_id, "idle"))
            for h in taken:
                if h is not leaving:
                    self._idle.setdefault(h.host, {})[h.gpu_indices[0]] = h
            self._left_idle([leaving])  # its script left on a SIGTERM: not lendable now
            self._background(self._tell(), f"lendable-{record.lease_id}")
            return (
                f"Slurm is taking a GPU back for training ({self.scheduler.partition} partition); claim again"
            )
        for h in taken:
            self._unwanted.pop(h.job_id, None)
        self._leases[record.lease_id] = taken
        self._background(self._tell(), f"lendable-{record.lease_id}")
        self._metrics.placeholder_gpus.set(sum(len(v) for v in self._idle.values()))
        if record.workload is not None:
            problem = self._start_workload(record, taken)
            if problem:
                self.ended(record)
                return problem
        self._background(self._retag(record, taken), f"hold-retag-{record.lease_id}")
        return ""

    def reclaiming(self, record: LeaseLogRecord) -> None:
        """See :meth:`Lending.reclaiming`: a reclaim gpupool started (a training demand) signals
        the lease's jobs as Slurm's preemption does (each leaves by the notice's end); one Slurm
        started was signalled when it was seen; one deferred past the notice (a minimum
        guarantee) is not signalled (its jobs would leave before its deadline). Either way,
        unless deferred, each job's *told* file is written (the site has been sent the reclaim,
        :mod:`broker.placeholders`): a job whose workload already left gives its GPU back now."""
        holds = self._leases.get(record.lease_id)
        deadline = record.reclaim_deadline
        if deadline is not None and deadline - self._clock() > self.notice_s + 1.0:
            return  # deferred to its guarantee's end: the jobs would leave too early; scancel then
        self._site_told(holds or ())
        if holds and record.lease_id not in self._noticed:
            self._noticed.add(record.lease_id)
            self._background(self._confirm(list(holds)), f"hold-confirm-{record.lease_id}")

    def ended(self, record: LeaseLogRecord) -> None:
        """See :meth:`Lending.ended`."""
        holds = self._leases.pop(record.lease_id, None)
        self._noticed.discard(record.lease_id)
        self._endpoints.pop(record.lease_id, None)
        for t in list(self._tasks):
            if t.get_name().startswith(f"workload-health-{record.lease_id}/"):
                t.cancel()
        if not holds:
            self._ports.pop(record.lease_id, None)
            return
        self._background(self._tell(), f"lendable-{record.lease_id}")
        for h in holds:
            self._termed.discard(h.job_id)
            for kind in ("held", "start", "idle", "term", "told"):
                self._file(h.job_id, kind).unlink(missing_ok=True)
        self._file(record.lease_id, "endpoint").unlink(missing_ok=True)
        self._background(self._release(record.lease_id, holds), f"hold-release-{record.lease_id}")

    def endpoint(self, lease_id: str) -> Mapping[str, str]:
        """See :meth:`Lending.endpoint`."""
        return dict(self._endpoints.get(lease_id, {}))

    def _site_told(self, holds: Iterable[Hold]) -> None:
        """Write the *told* file of each of ``holds`` (their lease's site was sent its reclaim);
        a file that cannot be written is logged (the job then keeps its GPU to the notice's end)."""
        for h in holds:
            try:
                self._file(h.job_id, "told").touch()
            except OSError as e:
                log.error("told_file_failed", extra={"job_id": h.job_id, "error": str(e)})

    def held_gpus(self) -> dict[str, tuple[int, ...]]:
        """GRES indices held per live lease (for tests and the demo's summary)."""
        return {lid: tuple(sorted(h.gpu_indices[0] for h in hs)) for lid, hs in self._leases.items()}

    def hold_status(self) -> HoldStatus:
        """The placeholders' state now (:class:`HoldStatus`), for the harvest replay's account of
        GPUs not lent."""
        now = self._clock()
        pending = dict(self._submitting)
        for host, _ in self._submitted.values():
            pending[host] = pending.get(host, 0) + 1
        cooling = frozenset(w for w, until in self._cooling.items() if until > now)
        return HoldStatus(
            idle=frozenset((host, i) for host, by_index in self._idle.items() for i in by_index),
            pending_by_node={h: n for h, n in pending.items() if n > 0},
            cooling=cooling,
            awaiting_training=frozenset(
                w for w, (_, cap) in self._awaiting.items() if cap > now and w not in cooling
            ),
        )

    # workload ------------------------------------------------------------------------------------
    def _start_workload(self, record: LeaseLogRecord, holds: list[Hold]) -> str:
        """Write one start file per node of the lease's holds (on that node's first placeholder,
        with that node's GPU indices, CPU budget and the lease's partition) and the lease's
        endpoint file; check each instance's health in the background. ``""``, or why it cannot
        run (unknown profile, no free port on a node: then nothing is written)."""
        assert record.workload is not None
        by_node: dict[str, list[Hold]] = {}
        for h in holds:
            by_node.setdefault(h.host, []).append(h)
        try:
            profile = allowed(self.workloads, record.site, record.workload)
            ports: dict[str, int] = {}
            for host in sorted(by_node):
                ports[host] = pick_port(profile, self._ports_near(host, ports))
        except WorkloadError as e:
            return str(e)
        for host, port in ports.items():
            on_host = by_node[host]
            argv = render(profile, port=port, lease_id=record.lease_id, site=record.site, gpus=len(on_host))
            script = start_script(
                argv,
                [h.gpu_indices[0] for h in on_host],
                record.lease_id,
                cpus=profile.cpus_per_gpu * len(on_host),
                partition=record.partition,
            )
            self._file(on_host[0].job_id, "start").write_text(script)
        nodes = [{"host": host, "port": port} for host, port in ports.items()]
        self._file(record.lease_id, "endpoint").write_text(json.dumps({"nodes": nodes}))
        self._watch_workload(record.lease_id, profile, ports)
        return ""

    def _ports_near(self, host: str, also: Mapping[str, int]) -> list[int]:
        """Ports taken near ``host``: those of every live workload instance (and of ``also``,
        node → port, picked for the lease being started) on a node that may share its address
        (``NodeAddr``: the same one, or one of the two not read yet)."""
        mine = self._addr.get(host)
        taken: list[int] = []
        for by_node in [*self._ports.values(), also]:
            for other, port in by_node.items():
                theirs = self._addr.get(other)
                if other == host or mine is None or theirs is None or theirs == mine:
                    taken.append(port)
        return taken

    def _watch_workload(self, lease_id: str, profile: WorkloadProfile, ports: Mapping[str, int]) -> None:
        self._ports[lease_id] = dict(ports)
        for host, port in ports.items():
            self._background(
                self._health(lease_id, profile, host, port), f"workload-health-{lease_id}/{host}"
            )

    def _adopt_workload(self, record: LeaseLogRecord) -> None:
        """After a restart: check the health of every instance of a live lease's workload again
        (its nodes and ports from the lease's endpoint file, ``{"nodes": [{"host", "port"}]}``,
        or ``{"host", "port"}`` as brokers that ran one instance per lease wrote it)."""
        if record.workload is None:
            return
        try:
            info = json.loads(self._file(record.lease_id, "endpoint").read_text())
            nodes = info["nodes"] if "nodes" in info else [info]
            ports = {str(n["host"]): int(n["port"]) for n in nodes}
            profile = allowed(self.workloads, record.site, record.workload)
        except (OSError, ValueError, TypeError, KeyError, WorkloadError) as e:
            log.warning("workload_not_adopted", extra={"lease_id": record.lease_id, "error": str(e)})
            return
        self._watch_workload(record.lease_id, profile, ports)

    async def _health(self, lease_id: str, profile: WorkloadProfile, host: str, port: int) -> None:
        """Poll the health path of the workload's instance on ``host`` until it answers 200
        (then publish the lease again with its endpoint) or ``profile.health_timeout_s`` passes
        (logged and counted; the lease keeps no endpoint on that node)."""
        addr = await self._node_addr(host)
        url = f"http://{addr}:{port}{profile.health_path}"
        if await wait_healthy(url, profile.health_timeout_s, lambda: True):  # ended(): cancelled
            if lease_id not in self._leases:
                return  # ended meanwhile
            self._endpoints.setdefault(lease_id, {})[host] = f"{addr}:{port}"
            log.info(
                "workload_healthy", extra={"lease_id": lease_id, "host": host, "endpoint": f"{addr}:{port}"}
            )
            self._republish(lease_id)
            return
        self._metrics.scheduler_errors.labels(operation="start").inc()
        log.warning(
            "workload_unhealthy",
            extra={"lease_id": lease_id, "host": host, "url": url, "timeout_s": profile.health_timeout_s},
        )

    async def _read_addrs(self) -> None:
        """Every node's ``NodeAddr`` (``scontrol show node -o``), before any workload starts: a
        port is chosen among the workloads at the same address. Unread (Slurm down): node names."""
        try:
            text = await self.scheduler.command("scontrol", "show", "node", "-o")
        except SchedulerError as e:
            log.warning("node_addresses_unread", extra={"error": str(e)})
            return
        for line in text.splitlines():
            name, addr = _NODE_NAME.search(line), _NODE_ADDR.search(line)
            if name and addr:
                self._addr[name.group(1)] = addr.group(1)

    async def _node_addr(self, host: str) -> str:
        """The node's ``NodeAddr`` in Slurm (where its workloads listen); the node name if unread."""
        if host not in self._addr:
            try:
                text = await self.scheduler.command("scontrol", "show", "node", host, "-o")
                found = _NODE_ADDR.search(text)
                self._addr[host] = found.group(1) if found else host
            except SchedulerError:
                return host
        return self._addr[host]

    # Slurm ------------------------------------------------------------------------------------------
    def _file(self, name: str, kind: str) -> Path:
        return self.control_dir / f"{name}.{kind}"

    async def _retag(self, record: LeaseLogRecord, holds: list[Hold]) -> None:
        """Name the carved placeholders after the lease and set their time limit to its end
        (after :data:`_RETAG_DELAY_S`: a process start must not hold up the lease message and
        reply of the claim that carved them, which are still being published): one
        ``scontrol update JobId=<id,id,...>`` per time limit (jobs started in the same minute
        share one)."""
        await asyncio.sleep(_RETAG_DELAY_S)
        raising = {t for h in holds if (t := self._extending.get(h.job_id)) is not None}
        if raising:  # a raise of the idle placeholder's limit must not land after the lease's
            await asyncio.wait(raising)
        groups: dict[int | None, list[str]] = {}
        for h in holds:
            minutes = None
            if record.ends_at is not None:
                started = h.started_at if h.started_at is not None else self._clock()
                minutes = max(1, math.ceil((record.ends_at - started) / 60.0))
            groups.setdefault(minutes, []).append(h.job_id)
        for minutes, job_ids in groups.items():
            argv = [
                "scontrol",
                "update",
                f"JobId={','.join(job_ids)}",
                f"Comment={COMMENT_PREFIX}{record.lease_id}",
            ]
            if minutes is not None:
                argv.append(f"TimeLimit={minutes}")
            if record.lease_id not in self._leases:
                return  # ended meanwhile: its jobs are cancelled
            try:
                await self.scheduler.command(*argv)
            except SchedulerError as e:
                if record.lease_id not in self._leases or record.lease_id in self._noticed:
                    return  # ended, or Slurm is taking it back: a leaving job takes no update
                # Slurm refuses a new time limit for a job it has chosen for preemption ("Job has
                # already finished"): a claim carved a placeholder in the instant between
                # Slurm's choice and the script's leaving; that is a reclaim, not a failure
                with contextlib.suppress(SchedulerError):
                    read = await asyncio.gather(*(self.scheduler.jobs(j) for j in job_ids))
                    if await self._judge(record.lease_id, job_ids, [h for listed in read for h in listed]):
                        log.info(
                            "hold_retag_taken_back",
                            extra={"lease_id": record.lease_id, "job_ids": job_ids, "error": str(e)},
                        )
                        return
                if record.lease_id not in self._leases or record.lease_id in self._noticed:
                    return
                self._metrics.scheduler_errors.labels(operation="retag").inc()
                log.error(
                    "hold_retag_failed",
                    extra={"lease_id": record.lease_id, "job_ids": job_ids, "error": str(e)},
                )

    async def _release(self, lease_id: str, holds: list[Hold]) -> None:
        """``scancel`` the lease's jobs and wait until Slurm no longer runs them; observed in
        ``gpupool_broker_hold_release_seconds``."""
        try:
            await self._release_holds(lease_id, holds)
        finally:
            self._ports.pop(lease_id, None)  # its workload is gone with its jobs (or given up on)

    async def _release_holds(self, lease_id: str, holds: list[Hold]) -> None:
        t0 = time.perf_counter()
        ids = [h.job_id for h in holds]
        await self._cancel(ids, "release")
        for _ in range(int(5.0 / 0.05)):
            try:
                running = [
                    h
                    for h in await self.scheduler.jobs()
                    if h.job_id in ids and h.state is not HoldState.ENDED
                ]
            except SchedulerError:
                running = holds
            if not running:
                self._metrics.hold_release.observe(time.perf_counter() - t0)
                log.info(
                    "hold_released",
                    extra={"lease_id": lease_id, "job_ids": ids, "seconds": time.perf_counter() - t0},
                )
                return
            await asyncio.sleep(0.05)
        self._metrics.scheduler_errors.labels(operation="release").inc()
        log.error("hold_release_slow", extra={"lease_id": lease_id, "job_ids": ids})

    async def _cancel(self, job_ids: Sequence[str], operation: str) -> None:
        try:
            await self.scheduler.command("scancel", *job_ids)
        except SchedulerError as e:
            if job_gone(e):  # ended meanwhile (its time limit, a preemption): nothing to cancel
                log.info("scancel_jobs_gone", extra={"job_ids": list(job_ids), "error": str(e)})
                return
            self._metrics.scheduler_errors.labels(operation=operation).inc()
            log.error("scancel_failed", extra={"job_ids": list(job_ids), "error": str(e)})

    async def _submit(self, host: str) -> None:
        """One placeholder on ``host``: one GPU, :attr:`placeholder_cpus` CPUs, the time limit
        :func:`placeholder_minutes` gives for the node's planned training start."""
        s = self.scheduler
        gres = f"gpu:{s.gres_type}:1" if s.gres_type else "gpu:1"
        minutes = placeholder_minutes(
            self._plans.get(host), self._clock(), self.placeholder_minutes, self._backfill
        )
        argv = [
            "sbatch", "--parsable", f"--partition={s.partition}", f"--nodelist={host}", "--nodes=1",
            f"--gres={gres}", f"--cpus-per-task={self.placeholder_cpus}", f"--time={minutes}",
            f"--signal=B:TERM@{max(1, math.ceil(self.notice_s))}", f"--job-name={JOB_NAME}",
            f"--comment={IDLE_COMMENT}", f"--output={self.control_dir / 'placeholder-%j.out'}", "--no-requeue",
        ]  # fmt: skip
        try:
            out = await s.command(*argv, stdin=placeholder_script(self.notice_s, self.control_dir))
        except SchedulerError as e:
            self._metrics.scheduler_errors.labels(operation="submit").inc()
            log.error("placeholder_submit_failed", extra={"host": host, "error": str(e)})
            return
        else:
            self._submitted[out.strip().split(";")[0]] = (host, self._clock())
        finally:
            self._submitting[host] -= 1

    async def _watch_forever(self) -> None:
        due = last = time.monotonic()
        while True:  # at a fixed rate: a slow read does not stretch the period
            due = max(due + self.poll_s, time.monotonic())
            await asyncio.sleep(due - time.monotonic())
            if time.monotonic() - last < self.read_every_s and not self._placeholders_in_flux():
                continue  # nothing to do that needs Slurm's jobs: the controller is not asked
            last = time.monotonic()
            await self._guarded(self._poll, "lending_poll_failed")

    async def _guarded(self, step: Callable[[], Awaitable[None]], failed: str) -> None:
        """Run one step of a watch: a Slurm read that failed is counted and logged, a bug is
        logged as ``failed``; neither stops the watch."""
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except SchedulerError as e:
            self._metrics.scheduler_errors.labels(operation="read").inc()
            log.error("scheduler_read_failed", extra={"error": str(e)})
        except Exception:  # noqa: BLE001 — a bug in one step must not stop watching
            log.exception(failed)

    async def _poll(self) -> None:
        """One read of Slurm: preemptions and lost holds → reclaims; placeholders kept."""
        read_at = self._clock()
        listed, training, self._plans = await self.scheduler.jobs_and_training()
        self._seen_training(training, read_at)
        jobs = {h.job_id: h for h in listed if h.state is not HoldState.ENDED}
        taken = {h.job_id: h for h in listed if self._deadline_if_chosen(h) is not None}
        now = self._clock()
        confirm: list[Hold] = []
        for lease_id, holds in list(self._leases.items()):
            if lease_id in self._noticed:
                continue
            current = [jobs.get(h.job_id) or taken.get(h.job_id) for h in holds]
            chosen = [h for h in current if h is not None and h.job_id in taken]
            gone = [h.job_id for h, c in zip(holds, current, strict=True) if c is None]
            if chosen:
                self._noticed.add(lease_id)
                deadline = min(d for h in chosen if (d := self._deadline_if_chosen(h)) is not None)
                await self._notify(
                    lease_id, deadline, f"{LeaseReason.SCHEDULER_PREEMPTED}:{chosen[0].job_id}"
                )
                self._observe_notice(chosen[0])
                confirm.extend(h for h in current if h is not None and h.state is not HoldState.ENDED)
            elif gone:
                self._noticed.add(lease_id)
                await self._notify(lease_id, now, f"{LeaseReason.HOLD_LOST}:{gone[0]}")
        if confirm:  # every job of the lease gets SIGTERM (the workload drains), off the notices' path
            self._background(self._confirm(confirm), "hold-confirm-notice")
        self._keep_placeholders(jobs, now)
        self._extend_short()
        wanted = self._wanted()
        for job_id, (_, since) in list(self._submitted.items()):
            if job_id not in jobs:
                del self._submitted[job_id]
            elif jobs[job_id].state is HoldState.PENDING and now - since >= self.unwanted_grace_s:
                del self._submitted[job_id]
                await self._cancel([job_id], "release")
        cancel: list[str] = []
        held_back = self._held_back(now)
        for host, by_index in self._idle.items():
            for index, h in by_index.items():
                if index in wanted.get(host, ()):
                    self._unwanted.pop(h.job_id, None)
                elif (host, index) in held_back:  # Slurm started one submitted before the take-back there
                    cancel.append(h.job_id)
                elif now - self._unwanted.setdefault(h.job_id, now) >= self.unwanted_grace_s:
                    cancel.append(h.job_id)
        if cancel:
            for by_index in self._idle.values():
                for index in [i for i, h in by_index.items() if h.job_id in cancel]:
                    del by_index[index]
            await self._cancel(cancel, "release")
        pending = dict(self._submitting)
        for host, _ in self._submitted.values():
            pending[host] = pending.get(host, 0) + 1
        # _wanted() dropped the cool-downs and holds that ended
        cooling = {host for host, _ in self._cooling} | {host for host, _ in self._awaiting}
        for host, indices in sorted(wanted.items()):
            if host in cooling:  # Slurm, not gpupool, picks a placeholder's GPU: it may be one held back
                continue
            missing = len(indices - set(self._idle.get(host, {}))) - pending.get(host, 0)
            for _ in range(max(0, missing)):  # in the background: the next read is not delayed
                self._submitting[host] = self._submitting.get(host, 0) + 1
                self._background(self._submit(host), f"placeholder-submit-{host}")
        self._metrics.placeholder_gpus.set(sum(len(v) for v in self._idle.values()))
        await self._tell()

    async def _terms_forever(self) -> None:
        due = time.monotonic()
        while True:
            due = max(due + self.term_poll_s, time.monotonic())
            await asyncio.sleep(due - time.monotonic())
            await self._guarded(self._terms, "lending_terms_failed")

    async def _terms(self) -> None:
        """One look for new term files of the live leases' jobs (a ``stat`` each): each lease with
        one has that job read alone (those of several leases at once); Slurm chose it for preemption → reclaimed with Slurm's
        deadline at once (as :meth:`_poll` would at its next read); gone → ``hold_lost``; still
        running unchosen (its time limit's signal) → left to :meth:`_poll`."""
        left = [(host, i, h) for host, by_index in self._idle.items() for i, h in by_index.items()
                if not self._file(h.job_id, "idle").exists()]  # fmt: skip
        if left:  # preempted while idle (its script renamed the idle file away): not lendable now
            for host, i, _ in left:
                del self._idle[host][i]
            self._left_idle([h for _, _, h in left])
            await self._tell()
        signalled: dict[str, Hold] = {}
        for lease_id, holds in self._leases.items():
            if lease_id in self._noticed:
                continue
            for h in holds:
                if h.job_id not in self._termed and self._file(h.job_id, "term").exists():
                    self._termed.add(h.job_id)
                    signalled.setdefault(lease_id, h)
        if not signalled:
            return
        read = await asyncio.gather(*(self.scheduler.jobs(h.job_id) for h in signalled.values()))
        for (lease_id, h), listed in zip(signalled.items(), read, strict=True):
            await self._judge(lease_id, [h.job_id], listed)

    def _left_idle(self, left: Iterable[Hold]) -> None:
        """Idle placeholders whose script has left (out of :attr:`_idle` already): the GPU of each
        that Slurm took back, rather than its time limit's signal (:meth:`_timed_out`), cools."""
        now = self._clock()
        self._cool((h.host, h.gpu_indices[0]) for h in left if not self._timed_out(h, now))

    def _timed_out(self, idle: Hold, now: float) -> bool:
        """Whether the idle placeholder ``idle``, seen leaving at ``now``, left for its time
        limit's signal (``--signal=B:TERM@<notice>``, which Slurm may send up to
        :data:`SIGNAL_EARLY_S` early) rather than a preemption: the signal was due, and no
        training job is planned to start on its node by the end of a notice (the latest read)."""
        plan = self._plans.get(idle.host)
        return (
            idle.deadline is not None
            and idle.deadline - self.notice_s - SIGNAL_EARLY_S <= now
            and (plan is None or plan > now + self.notice_s)
        )

    async def _judge(self, lease_id: str, job_ids: Sequence[str], listed: Sequence[Hold]) -> bool:
        """After a read of some of a lease's jobs (``job_ids``; ``listed``: what Slurm showed of
        them): one Slurm chose for preemption → reclaimed with Slurm's deadline (the jobs get
        their notice signal); one gone → ``hold_lost``. True when the lease was noticed so now;
        False when it had been noticed or had ended already, or when its jobs run unchosen."""
        if lease_id in self._noticed or lease_id not in self._leases:
            return False  # noticed by a read of every job meanwhile, or ended
        found = {
            j.job_id: j
            for j in listed
            if j.state is not HoldState.ENDED or self._deadline_if_chosen(j) is not None
        }
        chosen = next(
            (found[j] for j in job_ids if j in found and self._deadline_if_chosen(found[j]) is not None), None
        )
        if chosen is not None:
            self._noticed.add(lease_id)
            deadline = self._deadline_if_chosen(chosen)
            assert deadline is not None  # chosen
            await self._notify(lease_id, deadline, f"{LeaseReason.SCHEDULER_PREEMPTED}:{chosen.job_id}")
            self._observe_notice(chosen)
            self._background(self._confirm(list(self._leases.get(lease_id, ()))), "hold-confirm-notice")
            return True
        gone = next((j for j in job_ids if j not in found), None)
        if gone is not None:
            self._noticed.add(lease_id)
            await self._notify(lease_id, self._clock(), f"{LeaseReason.HOLD_LOST}:{gone}")
            return True
        return False

    def _deadline_if_chosen(self, hold: Hold) -> float | None:
        """The deadline (Unix s) of a hold Slurm chose for preemption, ``None`` if it did not:
        running in its grace time → its ``EndTime`` (else now + the notice); ended already (its
        workload left before the grace time ran out, ``preempted_at`` set) → ``PreemptTime`` +
        the notice, the ``EndTime`` Slurm set at the preemption (``GraceTime`` = the notice)."""
        if hold.state is HoldState.PREEMPTED:
            return hold.deadline if hold.deadline is not None else self._clock() + self.notice_s
        if hold.state is HoldState.ENDED and hold.preempted_at is not None:
            return hold.preempted_at + self.notice_s
        return None

    def _observe_notice(self, chosen: Hold) -> None:
        """``gpupool_broker_preemption_notice_seconds``: from the SIGTERM Slurm sent ``chosen``
        (its term file, microseconds) or else its ``PreemptTime`` (whole seconds) to now."""
        try:
            since = read_term(self._file(chosen.job_id, "term"))
        except (OSError, ValueError):
            since = None
        if since is None:
            since = chosen.preempted_at
        if since is not None:
            self._metrics.preemption_notice.observe(max(0.0, self._clock() - since))

    def _wanted(self) -> dict[str, set[int]]:
        """GRES indices per node of the GPUs to hold for lending (what placeholders should hold):
        those to hold (:attr:`LendingHooks.to_hold`) but the ones Slurm took back that are in
        their cool-down (:attr:`retake_cooldown_s`) or still wait for a training job to be seen
        on them (:attr:`retake_hold_max_s`)."""
        wanted = self.gpu_map.by_node(self._to_hold())
        if self._cooling or self._awaiting:
            now = self._clock()
            for where, until in list(self._cooling.items()):
                if until <= now:
                    del self._cooling[where]
            for where, (taken_at, cap) in list(self._awaiting.items()):
                if cap <= now:
                    del self._awaiting[where]
                    log.info(
                        "retake_hold_expired",
                        extra={"host": where[0], "gpu_index": where[1], "held_s": now - taken_at},
                    )
            for where in self._cooling.keys() | self._awaiting.keys():
                if where[1] in wanted.get(where[0], ()):
                    wanted[where[0]].discard(where[1])
        return wanted

    def _cool(self, gpus: Iterable[tuple[str, int]]) -> None:
        """Slurm took ``gpus`` (node, GRES index) back: no placeholder for them for
        :attr:`retake_cooldown_s`, nor after that until a training job is seen on them (at most
        :attr:`retake_hold_max_s` from now)."""
        now = self._clock()
        until = now + self.retake_cooldown_s
        cap = now + self.retake_hold_max_s
        for where in gpus:
            self._cooling[where] = max(until, self._cooling.get(where, until))
            self._awaiting[where] = (now, cap)
            log.debug("gpu_cooling", extra={"host": where[0], "gpu_index": where[1], "until": until})

    def _seen_training(self, training: Collection[tuple[str, int]], read_at: float) -> None:
        """A read of Slurm's jobs started at ``read_at`` (clock) shows jobs other than gpupool's
        holding ``training`` (node, GRES index): those of them Slurm took back before that read
        are no longer held back once their cool-down ends (:attr:`retake_hold_max_s`)."""
        seen = [w for w, (taken_at, _) in self._awaiting.items() if w in training and taken_at <= read_at]
        for where in seen:
            taken_at, _ = self._awaiting.pop(where)
            log.info(
                "retake_hold_released",
                extra={"host": where[0], "gpu_index": where[1], "training_seen_after_s": read_at - taken_at},
            )

    def _held_back(self, now: float) -> set[tuple[str, int]]:
        """(node, GRES index) of the GPUs Slurm took back that no placeholder may hold at ``now``
        (clock): in their cool-down, or awaiting a training job (:attr:`retake_hold_max_s`)."""
        cooling = {w for w, until in self._cooling.items() if until > now}
        return cooling | {w for w, (_, cap) in self._awaiting.items() if cap > now}

    async def _tell(self) -> None:
        """Report the GPUs idle placeholders hold (:attr:`LendingHooks.lendable`) if they changed
        since the last report; a GPU held back after Slurm took it back (:meth:`_held_back`) is
        not lendable even when a placeholder submitted before holds it (it is cancelled)."""
        held: set[str] = set()
        held_back = self._held_back(self._clock())
        for host, by_index in self._idle.items():
            for index in by_index:
                if (host, index) in held_back:
                    continue
                with contextlib.suppress(KeyError):
                    held.add(self.gpu_map.key(host, index))
        now = frozenset(held)
        if now != self._told:
            self._told = now
            await self._lendable(now)

    def _placeholders_in_flux(self) -> bool:
        """True while a read of Slurm's jobs has work to do: placeholders submitted and not yet
        seen running, idle ones on GPUs not to hold, or GPUs to hold without one (in memory)."""
        if self._submitted or any(self._submitting.values()) or self._unwanted:
            return True
        wanted = self._wanted()
        for host, by_index in self._idle.items():
            if not by_index.keys() <= wanted.get(host, set()):
                return True
        return any(not indices <= self._idle.get(host, {}).keys() for host, indices in wanted.items())

    def _extend_short(self) -> None:
        """Raise to :attr:`placeholder_minutes` the time limit of the idle placeholders that
        started with a shorter one (:func:`placeholder_minutes` fitted it before a planned
        start), in the background, once each. Slurm's backfill starts a job on GPUs its plan
        needs only if it ends by the planned start; once running, a placeholder is preempted at
        that start like any other (the plan does not move for it), so it holds its GPU up to
        then instead of leaving up to a minute and the backfill's rounding before."""
        most = self.placeholder_minutes * 60.0
        short = sorted(
            h.job_id
            for by_index in self._idle.values()
            for h in by_index.values()
            if h.job_id not in self._extended
            and h.deadline is not None
            and h.started_at is not None
            and h.deadline - h.started_at < most
        )
        if not short:
            return
        self._extended.update(short)
        task = self._background(self._extend(short), "placeholder-extend")
        for job_id in short:
            self._extending[job_id] = task

    async def _extend(self, job_ids: list[str]) -> None:
        """One ``scontrol update JobId=<id,...> TimeLimit=<placeholder_minutes>``; a job that
        ended or that Slurm chose for preemption meanwhile ("already finished") keeps its limit,
        any other refusal is counted (``operation="extend"``) and logged; never raises."""
        try:
            await self.scheduler.command(
                "scontrol", "update", f"JobId={','.join(job_ids)}", f"TimeLimit={self.placeholder_minutes}"
            )
        except SchedulerError as e:
            if job_gone(e) or "already finished" in str(e):
                log.info("placeholder_extend_skipped", extra={"job_ids": job_ids, "error": str(e)})
            else:
                self._metrics.scheduler_errors.labels(operation="extend").inc()
                log.error("placeholder_extend_failed", extra={"job_ids": job_ids, "error": str(e)})
        finally:
            for job_id in job_ids:
                self._extending.pop(job_id, None)

    def _keep_placeholders(self, jobs: dict[str, Hold], now: float) -> None:
        """Rebuild the idle placeholders from Slurm's jobs whose script has written its idle file
        (those carved meanwhile stay out)."""
        carved = {h.job_id for hs in self._leases.values() for h in hs}
        idle: dict[str, dict[int, Hold]] = {}
        for h in jobs.values():
            if (
                h.job_id in carved
                or h.lease_id
                or h.state is not HoldState.RUNNING
                or len(h.gpu_indices) != 1
            ):
                continue
            if not self._file(h.job_id, "idle").exists():
                continue  # its script has not started yet (still counted as submitted)
            idle.setdefault(h.host, {})[h.gpu_indices[0]] = h
            self._submitted.pop(h.job_id, None)
        self._idle = idle
        for job_id in [j for j in self._unwanted if j not in jobs]:
            del self._unwanted[job_id]
        self._extended &= jobs.keys()

    async def _confirm(self, holds: list[Hold]) -> None:
        """:meth:`SlurmScheduler.confirm_notice` of each of ``holds``, at once."""
        results = await asyncio.gather(
            *(self.scheduler.confirm_notice(h) for h in holds), return_exceptions=True
        )
        for h, r in zip(holds, results, strict=True):
            if isinstance(r, Exception):
                self._metrics.scheduler_errors.labels(operation="signal").inc()
                log.error("notice_signal_failed", extra={"job_id": h.job_id, "error": str(r)})

    async def _notify(self, lease_id: str, deadline: float, reason: str) -> None:
        self._cool((h.host, i) for h in self._leases.get(lease_id, ()) for i in h.gpu_indices)
        log.info(
            "scheduler_reclaim", extra={"lease_id": lease_id, "reclaim_deadline": deadline, "reason": reason}
        )
        if self._reclaim is not None:
            await self._reclaim(lease_id, deadline, reason)

    def _background(self, coro: Coroutine[object, object, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def lending_from(settings: BrokerSettings, config: BrokerConfig, state_dir: Path) -> Lending:
    """The :class:`Lending` of the ``[broker]`` settings group: :class:`NoLending` for
    ``scheduler = "none"``, a :class:`broker.lending_kubernetes.KubernetesLending` on
    ``kubeconfig`` (or the in-cluster service account) for ``"kubernetes"``, else a
    :class:`SlurmLending` on ``slurm_conf`` (its control folder ``slurm_output_dir``, or
    ``<state_dir>/broker-slurm``). Raises ``ValueError`` or ``OSError`` for an unreadable
    ``slurm_gpu_map`` or kubeconfig."""
    if settings.scheduler == "none":
        return NoLending()
    if settings.scheduler == "kubernetes":
        from broker.lending_kubernetes import KubernetesLending
        from runtime.kube import kubernetes_client

        return KubernetesLending(
            kubernetes_client(settings.kubeconfig),
            namespace=settings.k8s_namespace,
            priority_class=settings.k8s_priority_class,
            image=settings.k8s_image,
            resource=settings.k8s_gpu_resource,
            notice_s=config.notice_s,
            workloads=config.workloads,
            poll_s=settings.k8s_poll_s,
        )
    scheduler = SlurmScheduler(
        settings.slurm_conf, partition=settings.slurm_partition, gres_type=settings.slurm_gres_type or None
    )
    return SlurmLending(
        scheduler,
        gpu_map=GpuMap.load(settings.slurm_gpu_map),
        workloads=config.workloads,
        notice_s=config.notice_s,
        control_dir=settings.slurm_output_dir or state_dir / "broker-slurm",
        poll_s=settings.slurm_poll_s,
        placeholder_minutes=settings.slurm_placeholder_minutes,
    )
