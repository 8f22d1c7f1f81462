"""The harvest replay's "with gpupool" run: the whole pipeline lending through a Slurm cluster
someone else drives, and the figures of what it lent and what that cost training.

:func:`run_pipeline` runs :func:`gpupool.demo.run_demo` attached to the caller's cluster
(``DemoConfig.slurm_conf``), following the training jobs the caller submits
(``training_submit=False``), in a process of its own (:func:`start_pipeline`: the replay's submit
clock does not share a GIL with the pipeline). It writes the demo's summary as JSON, with the
lease log (``leases_file``, :class:`contracts.LeaseLogRecord` JSON lines) and the training jobs
it saw start (``training_starts_file``).

:func:`lending_figures` turns those into :class:`LendingFigures` over the replay's measured
window (wall Unix seconds; GPU-hours in simulated time, × ``compression``):

* lent GPU-hours: each lease's GPUs from its grant to its end, clipped to the window;
* Slurm preemptions of a lease (reason ``scheduler_preempted``) and, for each, the preemption
  time (the lease's ``reclaim_deadline`` - ``notice_seconds``: Slurm's deadline is its
  ``PreemptTime`` + ``GraceTime``) to the first training job seen running on one of its GPUs
  (wall seconds; the demo reads Slurm every 0.5 s);
* disruption: GPUs of preempted leases ÷ those of them a training job started on within the
  notice + ``match_slack_s`` (1.0 is ideal: Slurm took back only GPUs training used);
* every preemption paired with a notice: training jobs that started on a GPU while a lease held
  it without a reclaim record before (must be 0);
* window leases that ended before their promised ``window_until`` because of a reclaim, leases
  whose end came later than ``outlive_tolerance_s`` after their reclaim deadline (and of those,
  the ones whose GPU a training job was already running on before that end: the lease log's end
  came late, the GPU did not), leases warned at risk.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contracts import LeaseKind, LeaseLogRecord, LeaseState
from contracts.leases import LeaseReason

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

    from gpupool.demo import DemoConfig

Starts = Mapping[str, tuple[float, Mapping[str, Sequence[int]], bool]]
"""Slurm job id → (first seen running, Unix s; node → GRES indices it holds; a gpupool job held
one of them at the read before: the job waited for gpupool's GPUs to come back)."""


@dataclass(frozen=True)
class LeaseSpan:
    """One lease from the lease log: its newest record and its first reclaim.

    Attributes:
        record: the newest record (highest ``seq``).
        granted_at: grant time (Unix s).
        ended_at: time of the terminal record (Unix s), ``None`` while live.
        reclaim: the first ``reclaiming`` record, ``None`` if never reclaimed.
        at_risk_since: when it was first marked at risk, ``None`` if never.
    """

    record: LeaseLogRecord
    granted_at: float
    ended_at: float | None
    reclaim: LeaseLogRecord | None
    at_risk_since: float | None

    @property
    def preempted(self) -> bool:
        """True when Slurm chose the lease's hold for preemption (``scheduler_preempted``)."""
        return self.reclaim is not None and self.reclaim.reason.startswith(f"{LeaseReason.SCHEDULER_PREEMPTED}:")


def lease_spans(records: Iterable[LeaseLogRecord]) -> list[LeaseSpan]:
    """The leases of a lease log (any order), by lease id; records never granted (reason
    ``log_write_failed``) are left out."""
    by_lease: dict[str, list[LeaseLogRecord]] = {}
    for r in records:
        by_lease.setdefault(r.lease_id, []).append(r)
    out = []
    for lease_id in sorted(by_lease):
        recs = sorted(by_lease[lease_id], key=lambda r: r.seq)
        last = recs[-1]
        if last.reason == LeaseReason.LOG_WRITE_FAILED:
            continue
        reclaim = next((r for r in recs if r.state is LeaseState.RECLAIMING), None)
        risk = next((r.at_risk_since for r in recs if r.at_risk_since is not None), None)
        out.append(LeaseSpan(last, recs[0].granted_at, None if last.state.live else last.ts, reclaim, risk))
    return out


@dataclass(frozen=True)
class LendingFigures:
    """What gpupool lent in the window and what Slurm took back (module docstring).

    Attributes:
        leases: leases granted that overlap the window.
        lent_gpu_hours: simulated GPU-hours held by leases in the window.
        preempted: leases Slurm preempted.
        preempt_to_running_s: per preempted lease with a training job started on its GPUs, wall
            seconds from the preemption to that start.
        gpus_taken_back: GPUs of the preempted leases.
        gpus_needed: of those, GPUs a training job started on within the notice + slack.
        unnoticed_starts: training jobs that started on a GPU a lease held with no reclaim
            record before the start (every preemption must come with a notice: 0).
        window_leases: leases of kind ``window``.
        window_broken: of those, leases a reclaim's deadline ended before ``window_until``.
        outlived_notice: reclaimed leases that ended (or were still live at the window's end)
            later than their deadline + the tolerance.
        outlived_gpu_back: of those, leases on one of whose GPUs a training job started after
            the preemption (deadline - notice) and before the lease's end: the hold had given
            the GPU back and only the lease log's end came late (no training job waited on it).
        at_risk: leases warned at risk before any reclaim.
        hold_lost: leases whose hold ended without a preemption (``hold_lost``).
        needed_gpupool: training jobs started in the window on GPUs a gpupool job (an idle
            placeholder or a lease) held at the read before, or on GPUs of a lease Slurm
            preempted for them.
        needed_leased: of those, jobs started on GPUs of a lease Slurm preempted.
    """

    leases: int
    lent_gpu_hours: float
    preempted: int
    preempt_to_running_s: list[float]
    gpus_taken_back: int
    gpus_needed: int
    unnoticed_starts: int
    window_leases: int
    window_broken: int
    outlived_notice: int
    at_risk: int
    hold_lost: int
    needed_gpupool: int = 0
    needed_leased: int = 0
    outlived_gpu_back: int = 0

    @property
    def disruption(self) -> float | None:
        """``gpus_taken_back / gpus_needed``; ``None`` when nothing was taken back, ``inf`` when
        GPUs were taken back and no training job used them."""
        if not self.gpus_taken_back:
            return None
        return self.gpus_taken_back / self.gpus_needed if self.gpus_needed else float("inf")


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def lending_figures(
    records: Iterable[LeaseLogRecord],
    starts: Starts,
    locate: Mapping[str, tuple[str, int]],
    window: tuple[float, float],
    compression: float,
    *,
    match_slack_s: float = 5.0,
    outlive_tolerance_s: float = 1.0,
) -> LendingFigures:
    """:class:`LendingFigures` of a run (module docstring). ``records``: the lease log;
    ``starts``: training jobs seen running (:data:`Starts`); ``locate``: GPU key → (node, GRES
    index); ``window``: the measured window, wall Unix s; ``compression``: simulated seconds per
    wall second. Raises ``ValueError`` for an empty window or ``compression`` <= 0."""
    if not window[1] > window[0] or not compression > 0:
        raise ValueError(f"need window start < end and compression > 0, got {window}, {compression}")
    spans = [s for s in lease_spans(records)
             if s.granted_at < window[1] and (s.ended_at is None or s.ended_at > window[0])]  # fmt: skip
    started_on: dict[tuple[str, int], list[tuple[float, str]]] = {}
    for job_id, (t, held, _) in starts.items():
        for node, indices in held.items():
            for i in indices:
                started_on.setdefault((node, int(i)), []).append((t, job_id))
    for ts in started_on.values():
        ts.sort()
    leased_jobs: set[str] = set()
    lent_s = 0.0
    to_running: list[float] = []
    taken = needed = unnoticed = windows = broken = outlived = gpu_back = at_risk = lost = preempted = 0
    for s in spans:
        rec = s.record
        end = s.ended_at if s.ended_at is not None else window[1]
        lent_s += _overlap((s.granted_at, end), window) * len(rec.gpus)
        where = [locate[g] for g in rec.gpus if g in locate]
        noticed_at = s.reclaim.ts if s.reclaim is not None else float("inf")
        for w in where:  # a training job on a GPU the lease held: Slurm took it; a notice must be first
            unnoticed += sum(1 for t, _ in started_on.get(w, ()) if s.granted_at < t < end and t < noticed_at)
        if s.at_risk_since is not None and (s.reclaim is None or s.at_risk_since <= s.reclaim.ts):
            at_risk += 1
        if rec.kind is LeaseKind.WINDOW:
            windows += 1
            dl = s.reclaim.reclaim_deadline if s.reclaim is not None else None
            if dl is not None and rec.window_until is not None and dl < rec.window_until:
                broken += 1
        if s.reclaim is not None and s.reclaim.reclaim_deadline is not None:
            deadline = s.reclaim.reclaim_deadline
            if end > deadline + outlive_tolerance_s and (s.ended_at is not None or window[1] > deadline):
                outlived += 1
                t_pre = deadline - rec.notice_seconds
                if any(t_pre <= t < end for w in where for t, _ in started_on.get(w, ())):
                    gpu_back += 1
        if s.reclaim is not None and s.reclaim.reason.startswith(f"{LeaseReason.HOLD_LOST}:"):
            lost += 1
        if not s.preempted or s.reclaim is None or s.reclaim.reclaim_deadline is None:
            continue
        preempted += 1
        t_pre = s.reclaim.reclaim_deadline - rec.notice_seconds
        horizon = s.reclaim.reclaim_deadline + match_slack_s
        taken += len(rec.gpus)
        firsts = []
        for w in where:
            hit = next(((t, j) for t, j in started_on.get(w, ()) if t_pre <= t <= horizon), None)
            if hit is not None:
                needed += 1
                firsts.append(hit[0])
                leased_jobs.add(hit[1])
        if firsts:
            to_running.append(min(firsts) - t_pre)
    return LendingFigures(
        leases=len(spans), lent_gpu_hours=lent_s * compression / 3600.0, preempted=preempted,
        preempt_to_running_s=to_running, gpus_taken_back=taken, gpus_needed=needed,
        unnoticed_starts=unnoticed, window_leases=windows, window_broken=broken,
        outlived_notice=outlived, outlived_gpu_back=gpu_back, at_risk=at_risk, hold_lost=lost,
        needed_gpupool=len({j for j, (t, _, waited) in starts.items() if waited and window[0] <= t < window[1]}
                           | leased_jobs),
        needed_leased=len(leased_jobs),
    )  # fmt: skip


def read_run(summary: Mapping[str, Any]) -> tuple[list[LeaseLogRecord], Starts, dict[str, tuple[str, int]]]:
    """The lease log, training starts and GPU locations a pipeline run wrote (the files named in
    its summary, :func:`run_pipeline`). Raises ``OSError`` / ``ValueError`` for a missing or
    malformed file."""
    from contracts import decode

    leases = summary.get("leases_file")
    starts_file = summary.get("training_starts_file")
    if not leases or not starts_file:
        raise ValueError("the pipeline wrote no lease log or no training starts")
    records = [decode(LeaseLogRecord, line.encode()) for line in Path(leases).read_text().splitlines() if line.strip()]
    data = json.loads(Path(starts_file).read_text())
    starts = {k: (float(t), {n: tuple(ix) for n, ix in held.items()}, bool(waited))
              for k, (t, held, waited) in data["starts"].items()}  # fmt: skip
    locate = {k: (str(n), int(i)) for k, (n, i) in data["locate"].items()}
    return records, starts, locate


def run_pipeline(cfg: DemoConfig, out: Path, ready: Queue[str] | None = None, log_level: str = "WARNING") -> None:
    """Run :func:`gpupool.demo.run_demo` with ``cfg`` and write its summary (JSON) to ``out``;
    put ``"started"`` on ``ready`` once every stage runs (the caller starts submitting then).
    Blocking; meant as a process's target (:func:`start_pipeline`)."""
    from gpupool.demo import run_demo
    from gpupool.logs import setup_logging

    setup_logging(log_level, sys.stderr)
    if ready is not None:
        queue = ready
        cfg.on_started = lambda *_: queue.put("started")
    try:
        summary = asyncio.run(run_demo(cfg))
        out.write_text(json.dumps(summary.as_dict(), default=str))
    except BaseException as e:
        out.write_text(json.dumps({"error": repr(e)}))
        if ready is not None:
            ready.put(f"failed: {e!r}")
        raise


def start_pipeline(cfg: DemoConfig, out: Path) -> tuple[BaseProcess, Queue[str]]:
    """Start :func:`run_pipeline` in a fresh process (``spawn``); the process and the queue on
    which it says ``"started"`` (or ``"failed: ..."``)."""
    ctx = multiprocessing.get_context("spawn")
    ready: Queue[str] = ctx.Queue()
    proc = ctx.Process(target=run_pipeline, args=(cfg, out, ready), name="gpupool-pipeline")
    proc.start()
    return proc, ready


def figures_dict(f: LendingFigures) -> dict[str, object]:
    """``f`` as a JSON-friendly dict, with ``disruption``."""
    return {**asdict(f), "disruption": f.disruption}
