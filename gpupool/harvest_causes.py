"""Why the harvest replay's idle GPUs were not lent, and why Slurm took back GPUs training did not use.

**Idle GPU-hours not lent.** :class:`CauseSampler` runs in the pipeline's process and, every
``every_s`` wall seconds, puts each GPU no training job holds (the pipeline's own read of Slurm,
:class:`gpupool.demo_slurm.AllocationHistory`) under one cause (:func:`gpu_cause`, first match
wins), from what the stages already know at that moment:

1. ``lent``: a live lease of the broker's lease book holds it (also while it is reclaimed);
2. the broker's lease book would not lease it (:meth:`broker.leases.LeaseBook.why_not_lendable`):
   ``withheld:<reason>`` (analytics' capacity update is ``unknown`` and says why:
   ``scheduler_planned``, ``scheduler_planned_start``, ``scheduler_allocated``, ``stale``...),
   ``idle_pending`` (idle for less than analytics' ``min_idle_s`` so far), ``telemetry_busy``
   (its update says busy), ``no_capacity_update``, ``capacity_update_old``,
   ``planned_start`` (idle, but a pending training job is planned onto it), ``held_for_training``
   (a pool demand holds it), ``claim_in_flight`` (reserved for a claim being granted);
3. ``retake_cooldown``: Slurm took it back and no placeholder may hold it yet
   (:attr:`broker.lending.SlurmLending.retake_cooldown_s`); ``retake_awaiting_training``: its
   cool-down has ended, and it is still held back because no training job has been seen on it
   since (at most :attr:`broker.lending.SlurmLending.retake_hold_max_s` from the take-back);
4. ``placeholder_pending``: the broker wants it held and a placeholder submitted on its node is
   not running yet; ``placeholder_not_submitted``: wanted, none on the way;
5. ``offered_demand_met`` / ``offered_unclaimed``: it was in an offer and no site claimed it,
   because the sites held what their demand asked for, or although they did not.

A row ``{"t": wall Unix s, "causes": {cause: GPUs}}`` per sample goes to a JSON-lines file;
:func:`cause_gpu_hours` integrates them over the replay's window (each sample held until the
next), so the causes sum to the GPU-hours no training job held by the pipeline's reads.

**Disruption.** :func:`disruption_causes` puts each GPU of a lease Slurm preempted that no training
job started on within the notice + slack (:func:`gpupool.harvest.lending_figures`' match) under one
cause: ``started_late`` (a training job started on it later, within ``late_s``), ``node_other_gpus``
(a training job started on other GPUs of its node in the match's span: Slurm preempted more of the
node than the job used), ``not_on_node`` (no training start on the node in that span: the job
started elsewhere, later, or not at all).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from contracts import GpuState, LeaseLogRecord

if TYPE_CHECKING:
    from broker.lending import HoldStatus
    from broker.leases import LeaseBook
    from contracts import CapacityUpdate
    from gpupool.harvest import Starts

CAUSES: tuple[str, ...] = (
    "withheld:scheduler_planned",
    "withheld:scheduler_planned_start",
    "withheld:scheduler_allocated",
    "withheld:stale",
    "idle_pending",
    "telemetry_busy",
    "no_capacity_update",
    "capacity_update_old",
    "planned_start",
    "held_for_training",
    "claim_in_flight",
    "retake_cooldown",
    "retake_awaiting_training",
    "placeholder_pending",
    "placeholder_not_submitted",
    "offered_demand_met",
    "offered_unclaimed",
)
"""The usual causes, in the table's order (others, ``withheld:<reason>``, follow sorted)."""

_BOOK_CAUSES = {
    "no recent capacity update": "capacity_update_old",
    "planned for a pending training job": "planned_start",
    "held for training": "held_for_training",
    "claimed by another site a moment ago": "claim_in_flight",
}


def gpu_cause(
    *,
    leased: bool,
    why: str,
    cap: CapacityUpdate | None,
    cooling: bool,
    node_pending: bool,
    demand_met: bool,
    awaiting_training: bool = False,
) -> str:
    """The cause one GPU no training job holds is not lent (module docstring, first match wins).

    Args:
        leased: a live lease holds it.
        why: :meth:`broker.leases.LeaseBook.why_not_lendable` (``""``: in an offer).
        cap: the broker's latest capacity update of the GPU, ``None`` if none.
        cooling: in its retake cool-down.
        node_pending: a placeholder submitted on its node is not running yet.
        demand_met: the sites hold at least the GPUs their demand asks for now.
        awaiting_training: past its retake cool-down, held back until a training job is seen
            on it (:attr:`broker.lending.HoldStatus.awaiting_training`).
    """
    if leased or why == "leased":
        return "lent"
    if why == "not idle":
        if cap is None:
            return "no_capacity_update"
        if cap.reason.endswith(",idle_pending"):
            return "idle_pending"
        if cap.state is GpuState.BUSY:
            return "telemetry_busy"
        return f"withheld:{cap.reason or 'unknown'}"
    if why in _BOOK_CAUSES:
        return _BOOK_CAUSES[why]
    if cooling:
        return "retake_cooldown"
    if awaiting_training and why:  # a placeholder started before the take-back may hold it: offered
        return "retake_awaiting_training"
    if why:  # not held by a placeholder yet
        return "placeholder_pending" if node_pending else "placeholder_not_submitted"
    return "offered_demand_met" if demand_met else "offered_unclaimed"


@dataclass
class CauseSampler:
    """Samples :func:`gpu_cause` of every GPU no training job holds (module docstring).

    Args:
        book: the broker's lease book.
        holds: the lending's placeholders now (:meth:`broker.lending.SlurmLending.hold_status`).
        training: the GPU keys training jobs hold now (the pipeline's latest read of Slurm).
        locate: GPU key → (node, GRES index), every GPU of the cluster.
        wanted: GPUs the sites' demand asks for now, ``None`` without demand.
        held: GPUs the sites' live leases hold now.
        every_s: wall seconds between two samples (> 0).
        clock: Unix time source.

    Raises:
        ValueError: ``every_s`` not positive.
    """

    book: LeaseBook
    holds: Callable[[], HoldStatus]
    training: Callable[[], frozenset[str]]
    locate: Mapping[str, tuple[str, int]]
    wanted: Callable[[], int | None]
    every_s: float = 0.5
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        if not self.every_s > 0:
            raise ValueError(f"every_s must be > 0, got {self.every_s}")
        self.rows: list[dict[str, object]] = []

    def sample(self) -> dict[str, object]:
        """One sample now: ``{"t": Unix s, "causes": {cause: GPUs}}``, also kept in :attr:`rows`."""
        now = self.clock()
        hs = self.holds()
        busy = self.training()
        caps = self.book.capacity
        live = self.book.live_leases()
        wanted = self.wanted()
        demand_met = wanted is not None and sum(len(r.gpus) for r in live) >= wanted
        counts: Counter[str] = Counter()
        for key, where in self.locate.items():
            if key in busy:
                continue
            counts[gpu_cause(
                leased=self.book.lease_of(key) is not None, why=self.book.why_not_lendable(key, now),
                cap=caps.get(key), cooling=where in hs.cooling, node_pending=hs.pending_by_node.get(where[0], 0) > 0,
                demand_met=demand_met, awaiting_training=where in hs.awaiting_training,
            )] += 1  # fmt: skip
        row: dict[str, object] = {"t": now, "causes": dict(counts)}
        self.rows.append(row)
        return row

    async def run(self, stop: asyncio.Event) -> None:
        """Sample every :attr:`every_s` until ``stop`` is set."""
        while not stop.is_set():
            self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.every_s)

    def write(self, path: Path) -> None:
        """The samples as JSON lines. Raises ``OSError`` when the file cannot be written."""
        path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))


def read_timeline(path: Path) -> list[tuple[float, dict[str, int]]]:
    """The samples a :class:`CauseSampler` wrote, ``(t, {cause: GPUs})`` in time order. Raises
    ``OSError`` / ``ValueError`` for a missing or malformed file."""
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out.append((float(row["t"]), {str(k): int(v) for k, v in row["causes"].items()}))
    return sorted(out, key=lambda r: r[0])


def cause_gpu_hours(
    timeline: Sequence[tuple[float, Mapping[str, int]]], window: tuple[float, float], compression: float
) -> dict[str, float]:
    """Simulated GPU-hours per cause in ``window`` (wall Unix s): each sample's counts held until the
    next sample (the last until the window's end; before the first nothing is counted).
    ``compression``: simulated seconds per wall second. Raises ``ValueError`` for an empty window
    or ``compression`` <= 0."""
    if not window[1] > window[0] or not compression > 0:
        raise ValueError(f"need window start < end and compression > 0, got {window}, {compression}")
    out: dict[str, float] = {}
    for i, (t, counts) in enumerate(timeline):
        t_next = timeline[i + 1][0] if i + 1 < len(timeline) else window[1]
        span = max(0.0, min(t_next, window[1]) - max(t, window[0]))
        if span <= 0:
            continue
        for cause, n in counts.items():
            out[cause] = out.get(cause, 0.0) + n * span * compression / 3600.0
    return out


def ordered(causes: Iterable[str]) -> list[str]:
    """``causes`` in the table's order: :data:`CAUSES` first, then the rest sorted."""
    causes = set(causes)
    return [c for c in CAUSES if c in causes] + sorted(causes - set(CAUSES))


DISRUPTION_CAUSES = ("started_late", "node_other_gpus", "not_on_node")
"""Why a GPU taken back was not used (module docstring), in the table's order."""


def disruption_causes(
    records: Iterable[LeaseLogRecord],
    starts: Starts,
    locate: Mapping[str, tuple[str, int]],
    window: tuple[float, float],
    *,
    match_slack_s: float = 5.0,
    late_s: float = 60.0,
) -> dict[str, int]:
    """GPUs of the leases Slurm preempted in ``window`` (as :func:`gpupool.harvest.lending_figures`
    counts them) that no training job started on from the preemption to the deadline +
    ``match_slack_s``, by cause (:data:`DISRUPTION_CAUSES`; module docstring); ``late_s``: wall
    seconds after that span in which a start on the GPU counts as ``started_late``."""
    from gpupool.harvest import lease_spans

    on_gpu: dict[tuple[str, int], list[float]] = {}
    on_node: dict[str, list[float]] = {}
    for t, held, _ in starts.values():
        for node, indices in held.items():
            on_node.setdefault(node, []).append(t)
            for i in indices:
                on_gpu.setdefault((node, int(i)), []).append(t)
    out = dict.fromkeys(DISRUPTION_CAUSES, 0)
    for s in lease_spans(records):
        end = s.ended_at if s.ended_at is not None else window[1]
        if not (s.granted_at < window[1] and end > window[0]) or not s.preempted:
            continue
        assert s.reclaim is not None  # preempted
        deadline = s.reclaim.reclaim_deadline
        if deadline is None:
            continue
        t_pre, horizon = deadline - s.record.notice_seconds, deadline + match_slack_s
        for g in s.record.gpus:
            where = locate.get(g)
            if where is None:
                continue
            ts = on_gpu.get(where, [])
            if any(t_pre <= t <= horizon for t in ts):
                continue  # used: not a disruption
            if any(horizon < t <= horizon + late_s for t in ts):
                out["started_late"] += 1
            elif any(t_pre <= t <= horizon for t in on_node.get(where[0], [])):
                out["node_other_gpus"] += 1
            else:
                out["not_on_node"] += 1
    return out


def unlent_rows(hours: Mapping[str, float], idle_unallocated: float, lent: float) -> list[tuple[str, float]]:
    """The table of unallocated idle GPU-hours not lent: ``(cause, GPU-hours)`` of every cause of
    ``hours`` (:func:`cause_gpu_hours`) but ``lent``, in :func:`ordered` order, then
    ``read_timing``: what the pipeline's reads (every half second) and the replay's figures
    (``idle_unallocated`` from the jobs' start and end times, ``lent`` from the lease log) count
    differently. The rows sum to ``idle_unallocated - lent``."""
    rows = [(c, hours[c]) for c in ordered(hours) if c != "lent"]
    rows.append(("read_timing", (idle_unallocated - lent) - sum(h for _, h in rows)))
    return rows
