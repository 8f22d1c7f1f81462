"""Replay generated training jobs on a real scheduler, time-compressed, and measure it from the
scheduler: the scheduler-neutral half (the submit clock, the polling, the accounting).

:func:`replay` submits each :class:`simulator.training_jobs.TrainingJob` through a
:class:`SchedulerClient` at ``submit_s / compression`` wall seconds after the start; the client
makes the job run its compressed run time and end as generated (COMPLETED, FAILED, or CANCELLED
by its owner on time). Every ``poll_s`` it reads the client's job listing and the GPUs allocated
per node. Observers (``observers``) are called after each poll with the :class:`Poll`: the GPU
sampler is one; the "with lending" run adds the lender there. At the end every job of the replay
still queued or running is cancelled. The clients: :class:`simulator.slurm_replay.SlurmClient`
(``sbatch``/``squeue``/``scontrol``) and :class:`simulator.kubernetes_replay.KubernetesClient`
(batch/v1 Jobs through Kueue, a pod watch).

Job states use Slurm's names (``squeue %T``): PENDING, RUNNING, then COMPLETED, FAILED or
CANCELLED; a Kubernetes job is reported with the same names.

:func:`account` turns the records into simulated-time figures (:class:`ReplayReport`): training
queueing delay p50/p95/p99 (start - submit, × compression; jobs still pending at the end count
with their wait so far, a lower bound, and are counted apart), idle GPU-hours unallocated
(cluster GPU-hours of the window minus the jobs' allocated GPU-hours), the same from the node
samples, and allocated-but-idle GPU-hours (allocated GPU-hours × the job's share of 0 % samples,
:meth:`simulator.training_jobs.TrainingWorkload.idle_fraction`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from simulator.training_jobs import TrainingJob

log = logging.getLogger(__name__)

ACTIVE_STATES = frozenset(
    {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}
)
"""Job states (Slurm's ``squeue %T`` names) of a job that has not ended."""

Listing = dict[str, tuple[str, float | None, float | None, float | None]]
"""A scheduler's jobs: id -> (state, submit time, start time, end time); times Unix s or None."""


class ReplayError(RuntimeError):
    """A scheduler call failed in a way the replay cannot go on from (a submit refused), or a
    read failed (the poll counts it and goes on)."""


class SchedulerClient(Protocol):
    """What :func:`replay` needs of a scheduler.

    ``submit`` returns the job's scheduler id (raises :class:`ReplayError` when refused);
    ``jobs`` lists every job (:data:`Listing`; start time only once the job left PENDING);
    ``gpus_used`` the GPUs allocated per node now; both raise :class:`ReplayError` on a failed
    read. ``cancel`` ends jobs (a job already gone is no error). ``began`` is the wall time
    (Unix s, sub-second) at which the job's work began as the driver saw it, None if unknown.
    """

    def submit(self, job: TrainingJob, compression: float, out_dir: Path) -> str: ...

    def jobs(self) -> Listing: ...

    def gpus_used(self) -> dict[str, int]: ...

    def cancel(self, *job_ids: str) -> None: ...

    def began(self, job_id: str, out_dir: Path) -> float | None: ...


@dataclass
class JobRecord:
    """One replayed job and what the scheduler says of it.

    Attributes:
        job: the generated job.
        scheduler_id: the scheduler's job id (Slurm job id, Kubernetes Job name).
        submitted_wall: Unix time (s) just before the submit.
        state: last listed state (``""`` before the first poll that lists it).
        submit_time, start_time, end_time: the scheduler's submit, start and end times (Unix s;
            Slurm's are whole seconds), once known; the start counts only once the job has left
            PENDING.
        cancel_sent_wall: when the driver cancelled it at the end of the replay (None: the job
            ended by itself).
        pending_at_end: still PENDING when the replay ended (it never ran).
        began_wall: when the job's work began as the driver saw it (:meth:`SchedulerClient.began`),
            filled at the end of the replay.
    """

    job: TrainingJob
    scheduler_id: str
    submitted_wall: float
    state: str = ""
    submit_time: float | None = None
    start_time: float | None = None
    end_time: float | None = None
    cancel_sent_wall: float | None = None
    pending_at_end: bool = False
    began_wall: float | None = None


@dataclass(frozen=True)
class Poll:
    """One poll: ``wall`` (Unix s), GPUs allocated per node, and the replay's records (live objects)."""

    wall: float
    gpus_used: dict[str, int]
    records: dict[str, JobRecord]


@dataclass
class ReplayRun:
    """What :func:`replay` measured: records by scheduler id, node samples, and the run's wall times.

    ``window_wall`` is the measured window (after the warm-up), Unix seconds ``(start, end)``;
    ``out_dir`` holds the jobs' output files where the scheduler writes any.
    """

    records: dict[str, JobRecord]
    samples: list[tuple[float, int]]
    window_wall: tuple[float, float]
    cluster_gpus: int
    compression: float
    out_dir: Path
    polls: int = 0
    poll_errors: int = 0
    late_submits_s: list[float] = field(default_factory=list)


def _update(records: dict[str, JobRecord], listed: Listing) -> None:
    for sid, rec in records.items():
        if sid not in listed:
            continue
        state, submit, start, end = listed[sid]
        rec.state = state
        rec.submit_time = submit or rec.submit_time
        if state != "PENDING" and start is not None and not rec.pending_at_end:
            rec.start_time = start
        if state not in ACTIVE_STATES and end is not None:
            rec.end_time = end


def replay(
    client: SchedulerClient,
    jobs: Sequence[TrainingJob],
    *,
    compression: float,
    horizon_s: float,
    cluster_gpus: int,
    out_dir: Path,
    warmup_s: float = 0.0,
    poll_s: float = 0.5,
    observers: Sequence[Callable[[Poll], None]] = (),
    progress_s: float = 10.0,
    end_wait_s: float = 60.0,
) -> ReplayRun:
    """Submit ``jobs`` time-compressed, poll the scheduler until ``horizon_s`` simulated seconds,
    cancel what is left; the records.

    Args:
        client: the cluster.
        jobs: in submit order; those with ``submit_s >= horizon_s`` are not submitted.
        compression: simulated seconds per wall second (> 0).
        horizon_s: simulated length of the replay (warm-up included).
        cluster_gpus: GPUs of the cluster's training pool.
        out_dir: where the jobs' output files go (never the working directory).
        warmup_s: simulated seconds at the start that are replayed but not measured.
        poll_s: wall seconds between polls.
        observers: called after each poll.
        progress_s: wall seconds between progress log lines.
        end_wait_s: wall seconds the end waits for the cancelled jobs to end.

    Raises:
        ValueError: ``compression`` or ``horizon_s`` <= 0, ``warmup_s`` outside [0, horizon_s).
        ReplayError: the scheduler refused a job.
    """
    if not compression > 0 or not horizon_s > 0:
        raise ValueError(f"compression and horizon_s must be > 0, got {compression}, {horizon_s}")
    if not 0 <= warmup_s < horizon_s:
        raise ValueError(f"warmup_s must be in [0, horizon_s), got {warmup_s}")
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = [j for j in jobs if j.submit_s < horizon_s]
    t0 = time.time()
    run = ReplayRun(
        {},
        [],
        (t0 + warmup_s / compression, t0 + horizon_s / compression),
        cluster_gpus,
        compression,
        out_dir,
    )
    end_wall = run.window_wall[1]
    nxt = 0
    last_poll = last_progress = 0.0
    while True:
        now = time.time()
        while nxt < len(todo) and t0 + todo[nxt].submit_s / compression <= now:
            job = todo[nxt]
            due = t0 + job.submit_s / compression
            run.late_submits_s.append(now - due)
            sid = client.submit(job, compression, out_dir)
            run.records[sid] = JobRecord(job, sid, now)
            nxt += 1
            now = time.time()
        if now - last_poll >= poll_s or now >= end_wall:
            last_poll = now
            _poll(client, run, observers)
        if now >= end_wall:
            break
        if now - last_progress >= progress_s:
            last_progress = now
            running = sum(1 for r in run.records.values() if r.state == "RUNNING")
            pending = sum(1 for r in run.records.values() if r.state == "PENDING")
            log.info(
                "replay progress",
                extra={
                    "simulated_s": round((now - t0) * compression),
                    "horizon_s": horizon_s,
                    "submitted": nxt,
                    "running": running,
                    "pending": pending,
                    "gpus_used": run.samples[-1][1] if run.samples else 0,
                },
            )
        wake = min(last_poll + poll_s, end_wall)
        if nxt < len(todo):
            wake = min(wake, t0 + todo[nxt].submit_s / compression)
        time.sleep(max(0.0, wake - time.time()))
    # The end: cancel what is left, then wait until the scheduler has ended them all.
    left = [sid for sid, r in run.records.items() if r.end_time is None]
    for sid in left:
        rec = run.records[sid]
        rec.pending_at_end = rec.state in ("", "PENDING") and rec.start_time is None
        rec.cancel_sent_wall = rec.cancel_sent_wall or time.time()
    client.cancel(*left)
    deadline = time.time() + end_wait_s
    while time.time() < deadline:
        _poll(client, run, ())
        if all(r.end_time is not None or r.state not in ACTIVE_STATES for r in run.records.values()):
            break
        time.sleep(poll_s)
    for r in run.records.values():
        r.began_wall = client.began(r.scheduler_id, out_dir)
    return run


def _poll(client: SchedulerClient, run: ReplayRun, observers: Sequence[Callable[[Poll], None]]) -> None:
    try:
        listed = client.jobs()
        used = client.gpus_used()
    except ReplayError as e:
        run.poll_errors += 1
        log.warning("poll failed", extra={"error": str(e)})
        return
    wall = time.time()
    run.polls += 1
    _update(run.records, listed)
    run.samples.append((wall, sum(used.values())))
    snapshot = Poll(wall, used, run.records)
    for observe in observers:
        observe(snapshot)


def start_latency(
    client: SchedulerClient, out_dir: Path, rounds: int = 10, timeout_s: float = 30.0
) -> list[float]:
    """The yardstick: wall seconds from the submit to the job's work beginning
    (:meth:`SchedulerClient.began`) for a 1-GPU, 0-second job on an idle cluster, ``rounds``
    times one after the other (the scheduler's own start latency, the floor under every queueing
    delay of a replay).

    Raises:
        ReplayError: the scheduler refused the job, or a job did not end within ``timeout_s``.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(rounds):
        before = time.time()
        sid = client.submit(TrainingJob(-1 - i, 0.0, 1, 0.0, "COMPLETED", False), 1.0, out_dir)
        deadline = before + timeout_s
        while client.jobs().get(sid, ("PENDING",))[0] in ACTIVE_STATES:
            if time.time() > deadline:
                client.cancel(sid)
                raise ReplayError(f"yardstick job {sid} did not end within {timeout_s} s")
            time.sleep(0.05)
        began = client.began(sid, out_dir)
        if began is not None:
            out.append(max(0.0, began - before))
    return out


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) of ``values``, nearest rank (the smallest value with at least
    ``q·n`` values at or below it).

    Raises:
        ValueError: ``values`` empty or ``q`` outside [0, 1].
    """
    if not values:
        raise ValueError("quantile of no values")
    if not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q}")
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Length of the intersection of intervals ``a`` and ``b`` (0 when disjoint)."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def sampled_gpu_seconds(samples: Sequence[tuple[float, int]], window: tuple[float, float]) -> float:
    """Allocated GPU-seconds in ``window`` from ``(wall, gpus used)`` samples, each value held
    until the next sample (the last one until the window's end); before the first sample counts 0."""
    total = 0.0
    for i, (t, used) in enumerate(samples):
        t_next = samples[i + 1][0] if i + 1 < len(samples) else window[1]
        total += used * overlap((t, t_next), window)
    return total


@dataclass(frozen=True)
class ReplayReport:
    """A replay in simulated time.

    Attributes:
        jobs_submitted: jobs submitted in the measured window (carried-over jobs of a warm start
            not counted: they did not queue).
        jobs_started: of those, jobs the scheduler started.
        jobs_pending_at_end: of those, jobs never started (their wait so far is in the delays).
        queue_delay_s: (p50, p95, p99) simulated seconds, the scheduler's start - submit ×
            compression.
        queue_delay_resolution_s: the scheduler's time resolution (Slurm 1 s; Kubernetes the
            watch, 0.001 s) × compression.
        began_delay_s: (p50, p95, p99) simulated seconds from the driver's submit to the job's
            work beginning as the driver saw it (:attr:`JobRecord.began_wall`), jobs that started.
        began_delay_wall_s: the same in wall seconds (the scheduler's own start latency is in it).
        window_gpu_hours: cluster GPUs × window length.
        allocated_gpu_hours: from the jobs' start and end times.
        idle_unallocated_gpu_hours: ``window_gpu_hours - allocated_gpu_hours``.
        idle_unallocated_sampled_gpu_hours: the same from the node samples.
        allocated_idle_gpu_hours: allocated GPU-hours at 0 % utilisation (expected).
        final_states: final states of the window's jobs, counted.
    """

    jobs_submitted: int
    jobs_started: int
    jobs_pending_at_end: int
    queue_delay_s: tuple[float, float, float]
    queue_delay_resolution_s: float
    began_delay_s: tuple[float, float, float]
    began_delay_wall_s: tuple[float, float, float]
    window_gpu_hours: float
    allocated_gpu_hours: float
    idle_unallocated_gpu_hours: float
    idle_unallocated_sampled_gpu_hours: float
    allocated_idle_gpu_hours: float
    final_states: dict[str, int]


def account(
    run: ReplayRun, idle_fraction: Callable[[TrainingJob], float], time_resolution_s: float = 1.0
) -> ReplayReport:
    """Simulated-time figures of ``run`` (see :class:`ReplayReport`); ``idle_fraction(job)`` is the
    share of a job's allocated GPU-time at 0 % utilisation; ``time_resolution_s`` the scheduler's
    (wall seconds).

    Jobs count in the window when the driver submitted them in it (the scheduler's submit time
    may have whole seconds); GPU allocation counts for every job, clipped to the window.
    """
    c = run.compression
    w0, w1 = run.window_wall
    delays: list[float] = []
    began_delays: list[float] = []
    started = pending = 0
    alloc_s = idle_s = 0.0
    states: dict[str, int] = {}
    for r in run.records.values():
        submit = float(r.submit_time if r.submit_time is not None else r.submitted_wall)
        w1_rel = w1 - r.submitted_wall + submit  # the window's end on the scale of the scheduler's times
        if r.start_time is not None:
            end = float(r.end_time) if r.end_time is not None else w1
            held = overlap((float(r.start_time), end), (w0, w1)) * r.job.gpus
            alloc_s += held
            idle_s += held * idle_fraction(r.job)
        if not w0 <= r.submitted_wall < w1 or r.job.carried_over:
            continue
        states[r.state] = states.get(r.state, 0) + 1
        if r.start_time is not None:
            started += 1
            delays.append(max(0.0, r.start_time - submit) * c)
            if r.began_wall is not None:
                began_delays.append(max(0.0, r.began_wall - r.submitted_wall))
        else:
            pending += 1
            delays.append(max(0.0, w1_rel - submit) * c)
    window_gpu_s = run.cluster_gpus * (w1 - w0)

    def pcts(values: list[float], scale: float) -> tuple[float, float, float]:
        if not values:
            return (0.0, 0.0, 0.0)
        return (quantile(values, 0.5) * scale, quantile(values, 0.95) * scale, quantile(values, 0.99) * scale)

    hours = c / 3600
    return ReplayReport(
        jobs_submitted=started + pending,
        jobs_started=started,
        jobs_pending_at_end=pending,
        queue_delay_s=pcts(delays, 1.0),
        queue_delay_resolution_s=time_resolution_s * c,
        began_delay_s=pcts(began_delays, c),
        began_delay_wall_s=pcts(began_delays, 1.0),
        window_gpu_hours=window_gpu_s * hours,
        allocated_gpu_hours=alloc_s * hours,
        idle_unallocated_gpu_hours=(window_gpu_s - alloc_s) * hours,
        idle_unallocated_sampled_gpu_hours=(window_gpu_s - sampled_gpu_seconds(run.samples, (w0, w1)))
        * hours,
        allocated_idle_gpu_hours=idle_s * hours,
        final_states=states,
    )
