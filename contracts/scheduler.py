"""Training-scheduler state per node (collectors → ``telemetry.scheduler``, keyed by host).

The scheduler is one more telemetry source: each read of the scheduler (Slurm: ``scontrol show
node -d -o`` and ``scontrol show job -d -o``) gives one :class:`SchedulerNode` per node, with
every GPU of the node by its GRES index (which job holds it, whose, in which partition) and the
pending jobs the scheduler plans onto the node (with the backfill scheduler's planned start).

The GRES index is the GPU's index on its host: Slurm numbers a node's ``gpu`` GRES in the order
of the device files of ``gres.conf`` (``/dev/nvidia0`` ... is index 0 ...), which is the minor
number DCGM and NVML report as the GPU index (:attr:`contracts.telemetry.GpuSample.gpu_index`).
Host + GRES index therefore names the same GPU as host + DCGM index. MIG instances are not
scheduled as GPUs of their own here: a GRES index is a whole GPU.

Kubernetes (``scheduler="kubernetes"``, :mod:`collectors.kube_records`) gives the same records in
Slurm's terms: node states ``IDLE``/``MIXED``/``ALLOCATED``/``DOWN`` (+``DRAIN`` when cordoned),
pods holding GPUs as jobs, pending pods and Kueue Workloads as pending jobs. A pod states a GPU
count, not devices, so there the index is a slot on the node (the collector's deterministic
mapping, the broker's ``<node>/gpu<slot>``), which is the device index only where the PodResources
API's device ids are mapped to it.

The Kafka key is the host (:func:`contracts.topics.telemetry_partition_key`), as on the other
telemetry topics, and ``telemetry.scheduler`` has their partition count: a host's scheduler
state lands on the partition number of its GPU samples, so the analytics instance that owns the
host's GPUs also owns its scheduler state.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from contracts.base import Record
from contracts.topics import telemetry_partition_key

UNSCHEDULABLE_NODE_STATES: frozenset[str] = frozenset(
    {"DOWN", "DRAIN", "DRAINING", "DRAINED", "FAIL", "FAILING", "MAINT", "NOT_RESPONDING", "INVALID",
     "INVALID_REG", "POWERED_DOWN", "POWERING_DOWN", "POWER_DOWN", "REBOOT_REQUESTED", "REBOOT_ISSUED",
     "FUTURE", "UNKNOWN"}
)  # fmt: skip
"""Node states and state flags (Slurm ``scontrol show node`` ``State=BASE+FLAG...``) under which
the scheduler places no new job on the node: its GPUs are not lent either (an operator drains a
node to work on it)."""

LENT_JOB_NAME = "gpupool-lease"
"""Job name of gpupool's own jobs in the lent partition (the broker's placeholder and lease holds,
``broker.placeholders``): a GPU one of them holds is lendable, not allocated to training."""


class SchedulerGpu(Record):
    """One GPU of a node as the scheduler sees it.

    Attributes:
        index: GRES index on the node (``IDX`` of ``GRES=gpu:h100:4(IDX:0-3)``): the GPU's index
            on the host, as DCGM's ``gpu`` label (module docstring).
        gres_type: the GRES type (``h100``), ``None`` for a type-less ``gpu:N``.
        allocated: the scheduler has the GPU allocated (to ``job_id``, or in the node's
            ``GresUsed`` without a job that claims it: held, owner unknown).
        job_id: the job holding it (Slurm ``JobId``: an array task's own id), ``None`` if free or
            unknown.
        job_name / user / partition: of that job (``UserId=name(uid)`` → ``name``).
    """

    index: int = Field(ge=0)
    gres_type: str | None = None
    allocated: bool = False
    job_id: str | None = None
    job_name: str | None = None
    user: str | None = None
    partition: str | None = None


class PendingJob(Record):
    """A pending job the scheduler plans onto (or pinned to) a node.

    Attributes:
        job_id / job_name / user / partition: the job.
        gpus_per_node: GPUs it asks of each node (``TresPerNode=gres:gpu[:type]:N``), ``None`` if
            it asks per job or task only.
        gpus: GPUs it asks in all (per node × nodes, ``TresPerJob``, or per task × tasks), ``None``
            when it asks for none or the count cannot be told.
        reason: why it pends (Slurm ``Reason``: ``Resources``, ``Priority``, ``JobHeldUser``...).
        planned_start: the backfill scheduler's expected start (Unix s; Slurm ``StartTime`` of a
            pending job, the ``START_TIME`` of ``squeue --start``), ``None`` when there is no
            estimate.
        planned_nodes: nodes it is planned onto (``SchedNodeList``); empty without a plan.
    """

    job_id: str
    job_name: str | None = None
    user: str | None = None
    partition: str | None = None
    gpus_per_node: int | None = Field(default=None, ge=0)
    gpus: int | None = Field(default=None, ge=0)
    reason: str = ""
    planned_start: float | None = None
    planned_nodes: list[str] = Field(default_factory=list)


class SchedulerNode(Record):
    """One read of one node's scheduling state; Kafka key :attr:`partition_key` (the host).

    Attributes:
        ts: read time, Unix epoch seconds.
        host: the node name, which is the host name of its GPU telemetry.
        scheduler: which scheduler (``slurm``, ``kubernetes``).
        state: base node state (``IDLE``, ``MIXED``, ``ALLOCATED``, ``DOWN``...).
        state_flags: the ``+FLAG`` parts (``DRAIN``, ``PLANNED``, ``NOT_RESPONDING``...).
        reason: the node's reason (why DOWN or DRAIN), ``None`` if none.
        partitions: partitions the node is in.
        gpus: every GPU of the node, by GRES index.
        pending: pending jobs planned onto, or pinned to, the node.
        source: where the state came from (``scontrol``; ``kube-apiserver``: Nodes, Pods and Kueue
            Workloads read from the API server).
        seq: per-producer sequence number.
    """

    ts: float
    host: str
    scheduler: Literal["slurm", "kubernetes"] = "slurm"
    state: str
    state_flags: list[str] = Field(default_factory=list)
    reason: str | None = None
    partitions: list[str] = Field(default_factory=list)
    gpus: list[SchedulerGpu] = Field(default_factory=list)
    pending: list[PendingJob] = Field(default_factory=list)
    source: Literal["scontrol", "kube-apiserver"] = "scontrol"
    seq: int = 0

    @property
    def key(self) -> str:
        """Identity of the node: its host name."""
        return self.host

    @property
    def partition_key(self) -> str:
        """Kafka key on ``telemetry.scheduler``: the host (:func:`telemetry_partition_key`)."""
        return telemetry_partition_key(self.host)

    @property
    def schedulable(self) -> bool:
        """False when the state or a flag is in :data:`UNSCHEDULABLE_NODE_STATES`."""
        return not ({self.state, *self.state_flags} & UNSCHEDULABLE_NODE_STATES)

    def planned_training(self) -> list[PendingJob]:
        """The pending jobs the scheduler plans onto this node with an expected start, except
        gpupool's own (:data:`LENT_JOB_NAME`: a placeholder waiting to hold a GPU for lending is
        no demand on it; the scheduler plans it like any other job)."""
        return [
            p
            for p in self.pending
            if p.planned_start is not None and self.host in p.planned_nodes and p.job_name != LENT_JOB_NAME
        ]

    def next_planned_start(self) -> float | None:
        """The earliest ``planned_start`` of the pending jobs planned onto this node (Unix s;
        :meth:`planned_training`), ``None`` when none has an estimate."""
        starts = [p.planned_start for p in self.planned_training() if p.planned_start is not None]
        return min(starts) if starts else None
