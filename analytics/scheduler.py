"""The training scheduler joined with GPU telemetry: who may be offered, for how long, and what idles.

:class:`SchedulerJoin` keeps the latest :class:`contracts.scheduler.SchedulerNode` of every host
the analytics instance owns and answers, for a GPU the classifier decided on (host + GPU index,
the index DCGM reports: the scheduler's GRES index on the same host, :mod:`contracts.scheduler`):

* :meth:`SchedulerJoin.block_reason`: why the GPU must not be offered even if its telemetry says
  idle and free. Reasons (the ``reason`` of the capacity update, whose state is then
  ``unknown``): ``scheduler_allocated`` (the scheduler has the GPU allocated to a job, or held
  without a known job; not for gpupool's own holds, jobs named
  :data:`contracts.scheduler.LENT_JOB_NAME`, which hold it to lend it), ``scheduler_node_<state>`` (the node is down, drained... :data:`contracts.
  scheduler.UNSCHEDULABLE_NODE_STATES`, lowercase), ``scheduler_planned_start`` (a pending job is
  planned onto the node at or before now), ``scheduler_planned`` (the GPU is one the scheduler's
  plan needs for a pending job, :func:`planned_gpus`, and the job's planned start is at most
  ``plan_lead_s`` away: a lease there would still hold it when the job starts, and the job would
  wait for the lease's notice), ``scheduler_unknown`` (no scheduler state for the host
  yet, or the scheduler does not list a GPU of that index there, or the GPU's index is unknown),
  ``scheduler_stale`` (the host's latest state is older than ``stale_after_s``);
* :meth:`SchedulerJoin.window_end`: the earliest planned start of a pending job planned onto the
  node: a promise (``predicted_idle_until``) is cut there;
* :meth:`SchedulerJoin.planned_start`: the planned start of the pending job the plan needs this
  GPU for (:func:`planned_gpus`), in any state, once it is at most ``plan_lead_s`` away: a lease
  holding it is at risk (``CapacityUpdate.planned_start``).

A GPU the plan needs for a job planned to start later than ``plan_lead_s`` from now is lent until
then, as the scheduler's own backfill fills it with jobs that end before the planned start: its
promise ends at the planned start (:meth:`SchedulerJoin.window_end`), its lease is told it is at
risk ``plan_lead_s`` before, and if the job can start earlier than planned (the jobs it waits for
end before their time limit), the scheduler takes the GPUs back with the lease's notice.

It also counts, per job, user and partition, the GPUs allocated to a job that the telemetry says
are idle (:meth:`SchedulerJoin.allocated_idle`, gauge ``gpupool_analytics_allocated_idle_gpus``)
and turns each scheduler read into rows of ``scheduler_gpu_samples`` (:func:`scheduler_gpus_table`)
with the GPU's state as analytics knew it then; the view ``allocated_idle_gpu_hours``
(:mod:`analytics.views`) sums them into GPU-hours per job (Slurm's accounting counts a GPU as used
whenever it is allocated).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

import pyarrow as pa

from analytics.classify import GpuStatus
from analytics.rows import Column, arrow_schema, create_table_sql
from contracts import GpuState
from contracts.scheduler import LENT_JOB_NAME, UNSCHEDULABLE_NODE_STATES, SchedulerNode

__all__ = [
    "SCHEDULER_GPU_COLUMNS",
    "SCHEDULER_GPU_TABLE_SQL",
    "SchedulerJoin",
    "planned_gpus",
    "scheduler_gpus_table",
]

DEFAULT_STALE_AFTER_S = 60.0
"""A host whose latest scheduler state is older than this (s) is not offered."""

DEFAULT_PLAN_LEAD_S = 600.0
"""A GPU the scheduler's plan needs for a pending job is not offered, and its lease is at risk,
from this long (s) before the job's planned start."""

SCHEDULER_GPU_COLUMNS: tuple[Column, ...] = (
    Column("ts", "TIMESTAMP", pa.timestamp("us")),
    Column("host", "VARCHAR", pa.string()),
    Column("gpu_index", "INTEGER", pa.int32()),
    Column("gres_type", "VARCHAR", pa.string()),
    Column("node_state", "VARCHAR", pa.string()),
    Column("allocated", "BOOLEAN", pa.bool_()),
    Column("job_id", "VARCHAR", pa.string()),
    Column("job_name", "VARCHAR", pa.string()),
    Column("job_user", "VARCHAR", pa.string()),
    Column("job_partition", "VARCHAR", pa.string()),
    Column("next_planned_start", "TIMESTAMP", pa.timestamp("us")),
    Column("gpu_key", "VARCHAR", pa.string()),
    Column("gpu_state", "VARCHAR", pa.string()),
    Column("kafka_partition", "INTEGER", pa.int32()),
    Column("kafka_offset", "BIGINT", pa.int64()),
)
"""``scheduler_gpu_samples``: one row per GPU per scheduler read: the node's state
(``MIXED+DRAIN``), the GPU's allocation, the node's earliest planned start of a pending job, and
the GPU key and state (busy / idle / unknown) analytics had decided for that host and index when
it read the record (NULL when it had no GPU of that index)."""

SCHEDULER_GPU_TABLE_SQL = create_table_sql("scheduler_gpu_samples", SCHEDULER_GPU_COLUMNS)
"""DDL of ``scheduler_gpu_samples``."""

def _micros(ts: float) -> int:
    if not math.isfinite(ts):
        raise ValueError(f"timestamp not finite: {ts!r}")
    return round(ts * 1_000_000)


def scheduler_gpus_table(
    rows: Sequence[tuple[SchedulerNode, int, int, Mapping[int, tuple[str, GpuState]]]],
) -> pa.Table:
    """Rows of ``scheduler_gpu_samples``: for each ``(record, kafka_partition, kafka_offset,
    states)``, one row per GPU of the record, with ``states[index] = (gpu_key, state)`` where
    analytics knows the GPU. Raises ``ValueError`` for a non-finite ``ts``."""
    cols: dict[str, list[object]] = {c.name: [] for c in SCHEDULER_GPU_COLUMNS}
    for rec, partition, offset, states in rows:
        node_state = "+".join([rec.state, *rec.state_flags])
        start = rec.next_planned_start()
        for gpu in rec.gpus:
            key, state = states.get(gpu.index, (None, None))
            for name, value in (
                ("ts", _micros(rec.ts)),
                ("host", rec.host),
                ("gpu_index", gpu.index),
                ("gres_type", gpu.gres_type),
                ("node_state", node_state),
                ("allocated", gpu.allocated),
                ("job_id", gpu.job_id),
                ("job_name", gpu.job_name),
                ("job_user", gpu.user),
                ("job_partition", gpu.partition),
                ("next_planned_start", None if start is None else _micros(start)),
                ("gpu_key", key),
                ("gpu_state", None if state is None else state.value),
                ("kafka_partition", partition),
                ("kafka_offset", offset),
            ):
                cols[name].append(value)
    return pa.Table.from_arrays(
        [pa.array(cols[c.name], type=c.arrow_type) for c in SCHEDULER_GPU_COLUMNS],
        schema=arrow_schema(SCHEDULER_GPU_COLUMNS),
    )


def planned_gpus(node: SchedulerNode) -> dict[int, float]:
    """GRES index → planned start (Unix s) of the GPUs of ``node`` the scheduler's plan needs
    for its pending jobs.

    The scheduler says which nodes a pending job is planned onto (``planned_nodes``) and when
    (``planned_start``), not which GPUs: a job needs ``gpus_per_node`` GPUs of each of its nodes
    (or ``ceil(gpus / len(planned_nodes))`` when it asks per job; none when it asks for no GPU),
    and takes them from the GPUs no training job holds (free ones first, then those gpupool's
    own jobs, :data:`contracts.scheduler.LENT_JOB_NAME`, hold: the scheduler preempts those),
    lowest index first; the rest it needs come from training jobs that end by then. Jobs are
    served earliest planned start first (then by job id); jobs without a planned start, not
    planned onto this node, or gpupool's own placeholders waiting to start
    (:meth:`contracts.scheduler.SchedulerNode.planned_training`) need none of its GPUs."""
    jobs = sorted(
        ((p.planned_start, p) for p in node.planned_training() if p.planned_start is not None),
        key=lambda sp: (sp[0], sp[1].job_id),
    )
    if not jobs:
        return {}
    free = sorted(g.index for g in node.gpus if not g.allocated)
    lent = sorted(g.index for g in node.gpus if g.allocated and g.job_name == LENT_JOB_NAME)
    candidates = free + lent
    out: dict[int, float] = {}
    for start, p in jobs:
        if p.gpus_per_node is not None:
            need = p.gpus_per_node
        elif p.gpus:
            need = math.ceil(p.gpus / len(p.planned_nodes))
        else:
            need = 0
        for index in candidates[len(out) : len(out) + need]:
            out[index] = start
    return out


class SchedulerJoin:
    """The latest scheduler state per host, joined with the classifier's GPUs (module docstring).

    Args:
        stale_after_s: a host's state older than this (s, by the caller's clock) blocks its GPUs.
        plan_lead_s: a GPU the plan needs for a pending job is blocked (``scheduler_planned``) and
            its planned start published from this long (s) before that start; ``math.inf``: from
            the moment it is planned (nothing planned is ever lent).

    Raises:
        ValueError: ``stale_after_s`` not positive, or ``plan_lead_s`` negative.
    """

    def __init__(self, stale_after_s: float = DEFAULT_STALE_AFTER_S, plan_lead_s: float = DEFAULT_PLAN_LEAD_S) -> None:
        if not stale_after_s > 0:
            raise ValueError("stale_after_s must be > 0")
        if not plan_lead_s >= 0:
            raise ValueError("plan_lead_s must be >= 0")
        self.stale_after_s = stale_after_s
        self.plan_lead_s = plan_lead_s
        self._nodes: dict[str, SchedulerNode] = {}
        self._planned: dict[str, dict[int, float]] = {}
        self._index: dict[str, int] = {}

    def observe(self, record: SchedulerNode) -> None:
        """Keep ``record`` as its host's state unless a newer one (by ``ts``) is held."""
        held = self._nodes.get(record.host)
        if held is None or record.ts >= held.ts:
            self._nodes[record.host] = record
            self._planned[record.host] = planned_gpus(record)

    def note_gpu(self, key: str, gpu_index: int | None) -> None:
        """Remember the GPU index DCGM reported for GPU ``key`` (``None`` forgets it)."""
        if gpu_index is None:
            self._index.pop(key, None)
        else:
            self._index[key] = gpu_index

    def forget_gpu(self, key: str) -> None:
        """Forget GPU ``key`` (its partition moved away)."""
        self._index.pop(key, None)

    def forget_hosts(self, hosts: Iterable[str]) -> None:
        """Forget the scheduler state of ``hosts`` (their partition moved away)."""
        for host in hosts:
            self._nodes.pop(host, None)
            self._planned.pop(host, None)

    def node(self, host: str) -> SchedulerNode | None:
        """The latest state held for ``host``."""
        return self._nodes.get(host)

    def states_by_index(self, host: str, statuses: Iterable[GpuStatus]) -> dict[int, tuple[str, GpuState]]:
        """GPU index → ``(gpu_key, state)`` of the whole GPUs (no MIG instance) of ``host`` in
        ``statuses``."""
        out = {}
        for st in statuses:
            if st.host == host and st.gpu_instance_id is None and (i := self._index.get(st.key)) is not None:
                out[i] = (st.key, st.state)
        return out

    def block_reason(self, st: GpuStatus, now: float) -> str | None:
        """Why GPU ``st`` must not be offered at ``now`` (Unix s), or ``None`` (module docstring
        for the reasons; a MIG instance follows its GPU's index)."""
        node = self._nodes.get(st.host)
        if node is None:
            return "scheduler_unknown"
        if now - node.ts > self.stale_after_s:
            return "scheduler_stale"
        bad = [s for s in (node.state, *node.state_flags) if s in UNSCHEDULABLE_NODE_STATES]
        if bad:
            return f"scheduler_node_{bad[0].lower()}"
        index = self._index.get(st.key)
        gpu = next((g for g in node.gpus if g.index == index), None) if index is not None else None
        if gpu is None:
            return "scheduler_unknown"
        if gpu.allocated and gpu.job_name != LENT_JOB_NAME:  # gpupool's own holds lend it
            return "scheduler_allocated"
        start = node.next_planned_start()
        if start is not None and start <= max(now, st.ts):
            return "scheduler_planned_start"
        if self.planned_start(st, now) is not None:
            return "scheduler_planned"
        return None

    def planned_start(self, st: GpuStatus, now: float) -> float | None:
        """The planned start (Unix s) of the pending job the scheduler's plan needs GPU ``st``
        for (:func:`planned_gpus`; a MIG instance follows its GPU) when it is at most
        ``plan_lead_s`` after ``now`` (or after ``st.ts`` when that is later; Unix s); ``None``
        when no job needs it that soon or the GPU's index is unknown."""
        index = self._index.get(st.key)
        start = None if index is None else self._planned.get(st.host, {}).get(index)
        return start if start is not None and start <= max(now, st.ts) + self.plan_lead_s else None

    def window_end(self, host: str) -> float | None:
        """The earliest planned start (Unix s) of a pending job planned onto ``host``."""
        node = self._nodes.get(host)
        return None if node is None else node.next_planned_start()

    def allocated_idle(self, statuses: Iterable[GpuStatus]) -> Counter[tuple[str, str, str]]:
        """Idle whole GPUs that the scheduler has allocated to a job, counted by
        ``(partition, user, job_id)`` (empty strings where the scheduler gave none)."""
        out: Counter[tuple[str, str, str]] = Counter()
        for st in statuses:
            if st.state is not GpuState.IDLE or st.gpu_instance_id is not None:
                continue
            node, index = self._nodes.get(st.host), self._index.get(st.key)
            if node is None or index is None:
                continue
            gpu = next((g for g in node.gpus if g.index == index), None)
            if gpu is not None and gpu.job_id is not None and gpu.job_name != LENT_JOB_NAME:
                out[(gpu.partition or "", gpu.user or "", gpu.job_id)] += 1
        return out
