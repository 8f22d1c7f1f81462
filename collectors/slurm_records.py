"""Slurm nodes and jobs (:mod:`collectors.slurm_parse`) → :class:`contracts.scheduler.SchedulerNode`.

Per node: every GPU of its ``Gres`` by GRES index; a GPU is allocated when a job's ``-d``
allocation group names its index on that node, or when the node's ``GresUsed`` lists the index
(held, owner not known from this read: a job that ended between the two reads, or one not
shown). Pending jobs go on the nodes of their ``SchedNodeList`` (the backfill plan, with its
planned start) and, when they have no plan, on the nodes they asked for (``ReqNodeList``, no
planned start). A GPU a job holds on a node that ``scontrol show node`` did not list is dropped
(there is no node record to put it on).
"""

from __future__ import annotations

from collections.abc import Sequence

from collectors.slurm_parse import JobInfo, NodeInfo
from contracts.scheduler import PendingJob, SchedulerGpu, SchedulerNode

__all__ = ["FINISHED_JOB_STATES", "build_node_records"]

FINISHED_JOB_STATES: frozenset[str] = frozenset(
    {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE",
     "OUT_OF_MEMORY", "REVOKED", "SPECIAL_EXIT"}
)  # fmt: skip
"""Job states (``squeue(1)`` JOB STATE CODES) of jobs that hold nothing any more: ``scontrol show
job`` lists them until ``MinJobAge``; their allocation groups are ignored (``COMPLETING`` jobs
still hold their GPUs and count)."""


def _pending(job: JobInfo) -> PendingJob:
    return PendingJob(
        job_id=job.job_id,
        job_name=job.name,
        user=job.user,
        partition=job.partition,
        gpus_per_node=job.gpus_per_node,
        gpus=job.gpus_requested,
        reason=job.reason or "",
        planned_start=job.start if job.sched_nodes else None,
        planned_nodes=list(job.sched_nodes),
    )


def build_node_records(
    nodes: Sequence[NodeInfo], jobs: Sequence[JobInfo], *, ts: float, seq_start: int = 0
) -> list[SchedulerNode]:
    """One :class:`SchedulerNode` per node of ``nodes`` (in order), read at ``ts`` (Unix s),
    numbered ``seq_start``, ``seq_start + 1``... (module docstring for the rules). Pending jobs
    are those in state ``PENDING``; jobs in :data:`FINISHED_JOB_STATES` hold nothing; any other
    job (``RUNNING``, ``COMPLETING``, ``SUSPENDED``, ``CONFIGURING``...) holds the GPUs of its
    allocation groups."""
    holder: dict[tuple[str, int], JobInfo] = {}
    pending_on: dict[str, list[PendingJob]] = {}
    for job in jobs:
        if job.state in FINISHED_JOB_STATES:
            continue
        for host, indices in job.gpus_by_node.items():
            for i in indices:
                holder[(host, i)] = job
        if job.state == "PENDING":
            targets = job.sched_nodes or job.req_nodes
            if targets:
                rec = _pending(job)
                for host in dict.fromkeys(targets):
                    pending_on.setdefault(host, []).append(rec)
    out = []
    for n, node in enumerate(nodes):
        gpus = []
        for index, gtype in node.gpus:
            held_by = holder.get((node.name, index))
            gpus.append(
                SchedulerGpu(
                    index=index,
                    gres_type=gtype,
                    allocated=held_by is not None or index in node.gpus_used,
                    job_id=held_by.job_id if held_by else None,
                    job_name=held_by.name if held_by else None,
                    user=held_by.user if held_by else None,
                    partition=held_by.partition if held_by else None,
                )
            )
        out.append(
            SchedulerNode(
                ts=ts,
                host=node.name,
                state=node.state,
                state_flags=list(node.flags),
                reason=node.reason,
                partitions=list(node.partitions),
                gpus=gpus,
                pending=pending_on.get(node.name, []),
                seq=seq_start + n,
            )
        )
    return out
