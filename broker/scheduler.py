"""The seam between leases and the training scheduler (DESIGN.md "The training scheduler").

A lease is real only when the scheduler knows it: the leased GPUs are held by a job of the
scheduler's own (Slurm: a job in the lent partition), so no training job is placed on them, and
the scheduler's own preemption takes them back with the lease's notice, whether or not gpupool
runs. The broker asks a :class:`TrainingScheduler` to :meth:`~TrainingScheduler.hold` GPUs for a
lease, :meth:`~TrainingScheduler.release` them when the lease ends, and reads
:meth:`~TrainingScheduler.holds` to learn which holds the scheduler has chosen to preempt (each
with its absolute deadline).

:class:`NoScheduler` is the explicit "scheduler integration disabled" mode: it holds nothing and
says so (``enforced = False``). The Slurm implementation is :class:`broker.scheduler_slurm.SlurmScheduler`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class SchedulerError(Exception):
    """A hold could not be placed, read or released; the message says which and why.

    Attributes:
        returncode: the exit status of the scheduler's command that failed, when one ran and
            exited (``None``: it did not start, timed out, or printed what cannot be read).
    """

    def __init__(self, message: str, returncode: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode


class HoldState(StrEnum):
    """Where a hold is in the scheduler.

    ``pending``: submitted, not yet on its GPUs; ``running``: holding its GPUs; ``preempted``: the
    scheduler chose it for preemption and takes the GPUs back at ``Hold.deadline``; ``ended``:
    gone (released, cancelled, timed out or preempted to the end).
    """

    PENDING = "pending"
    RUNNING = "running"
    PREEMPTED = "preempted"
    ENDED = "ended"


@dataclass(frozen=True)
class HoldRequest:
    """What to hold for one lease.

    Attributes:
        lease_id: the lease (at most 64 characters of ``[A-Za-z0-9._-]``).
        host: the node (the scheduler's node name = the telemetry host name).
        count: GPUs to hold on that node, >= 1.
        end_at: the lease ends here at the latest (Unix s): the hold's time limit, so the GPUs
            return to training at that time even if gpupool is down.
        notice_s: the reclaim notice (s): between the scheduler choosing the hold for preemption
            and the GPUs going back.
        command: the site's workload, an argv list run on the held GPUs (they are in
            ``CUDA_VISIBLE_DEVICES``); empty: hold only. It gets SIGTERM at the notice.
    """

    lease_id: str
    host: str
    count: int
    end_at: float
    notice_s: float
    command: tuple[str, ...] = ()


@dataclass(frozen=True)
class Hold:
    """One hold as the scheduler reports it.

    Attributes:
        lease_id: the lease it belongs to.
        job_id: the scheduler's id of the holding job.
        host: the node, ``""`` while pending.
        gpu_indices: the node-local GPU indices held (Slurm GRES indices = NVML indices), sorted;
            empty while pending.
        state: see :class:`HoldState`.
        deadline: when the GPUs go back (Unix s): for a preempted hold the end of its notice,
            else the time limit; ``None`` if unknown.
        preempted_at: when the scheduler chose it for preemption (Unix s), else ``None``.
        started_at: when it started running (Unix s), ``None`` while pending or unknown.
    """

    lease_id: str
    job_id: str
    host: str
    gpu_indices: tuple[int, ...] = field(default=())
    state: HoldState = HoldState.PENDING
    deadline: float | None = None
    preempted_at: float | None = None
    started_at: float | None = None


class TrainingScheduler(Protocol):
    """Places, reads and releases the scheduler-side holds of leases.

    Attributes:
        enforced: True if a lease must not be granted without a running hold. An implementation
            that cannot hold must say False here, never pretend.
    """

    enforced: bool

    async def hold(self, request: HoldRequest, timeout_s: float = 10.0) -> Hold:
        """Hold ``request.count`` GPUs on ``request.host`` for the lease and wait until the hold
        runs on them. Returns the running :class:`Hold` (its ``gpu_indices`` are what the
        scheduler allocated). Raises :class:`SchedulerError` if it cannot be placed or does not
        run within ``timeout_s`` seconds (a hold that did not start is cancelled)."""
        ...

    async def release(self, lease_id: str) -> None:
        """End the lease's hold (its workload gets SIGTERM, then the GPUs go back); returns when
        the scheduler no longer lists it as running. No-op without a hold. Raises
        :class:`SchedulerError` if it cannot be released."""
        ...

    async def holds(self) -> dict[str, Hold]:
        """Every live hold this integration placed, by lease id, as the scheduler sees it now.
        Raises :class:`SchedulerError` if the scheduler cannot be read."""
        ...

    async def remove_stale(self, keep: Collection[str]) -> list[str]:
        """Release every hold whose lease id is not in ``keep`` (after a broker restart: holds of
        leases that ended while it was down). Returns the lease ids released."""
        ...


class NoScheduler:
    """Scheduler integration disabled by configuration: leases hold nothing in the scheduler.

    Use only where the GPUs are not scheduled by a training scheduler, or for the demo; the
    scheduler may then start training on lent GPUs.
    """

    enforced = False

    async def hold(self, request: HoldRequest, timeout_s: float = 10.0) -> Hold:
        """Nothing is held: a hold in state ``ended`` with no job."""
        return Hold(lease_id=request.lease_id, job_id="", host=request.host, state=HoldState.ENDED)

    async def release(self, lease_id: str) -> None:
        """Nothing to release."""

    async def holds(self) -> dict[str, Hold]:
        """No holds: ``{}``."""
        return {}

    async def remove_stale(self, keep: Collection[str]) -> list[str]:
        """No holds: ``[]``."""
        return []
