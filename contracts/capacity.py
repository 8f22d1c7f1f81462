"""Capacity updates (analytics → broker) and pool demand (training → broker)."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from contracts.base import Record
from contracts.topics import gpu_key


class GpuState(StrEnum):
    """Classification of one GPU. ``unknown`` is never offered."""

    BUSY = "busy"
    IDLE = "idle"
    UNKNOWN = "unknown"


class IdleGrade(StrEnum):
    """How idle an idle GPU is: ``free`` (no memory held) or ``memory_held`` (compute idle, a
    resident model holds framebuffer memory: offered as a lower grade)."""

    FREE = "free"
    MEMORY_HELD = "memory_held"


class CapacityUpdate(Record):
    """The state of one GPU (or MIG instance) as decided by analytics; keyed by :attr:`key`.

    Attributes:
        ts: time of the decision (Unix s) — the timestamp of the newest sample it used.
        state: busy / idle / unknown.
        since: when the GPU entered ``state`` (Unix s).
        grade: for idle GPUs, the idle grade; ``None`` otherwise.
        predicted_idle_until: for idle GPUs, the time until which it will stay idle at
            ``confidence`` (Unix s); an offer never promises beyond it. ``None`` if no prediction.
        confidence: probability (0..1) that the GPU stays idle until ``predicted_idle_until``.
        reason: why ``unknown`` (``missing_field``, ``sentinel``, ``out_of_range``,
            ``prof_stalled``, ``stale``) or why busy; free text for operators.
        fb_total_mib: framebuffer size in MiB where known.
        headroom: fraction (0..1) of the node's uplink bandwidth unused (p95), ``None`` if unknown.
        pool: name of the pool the GPU belongs to.
        leaf: the leaf switch the node hangs off, for locality (from ``fabric.topology``: the
            switch its HCA ports connect to; ``"a+b"`` when its HCAs connect to several leaves, a
            rail-optimised fabric); ``None`` if unknown.
        leaf_headroom: fraction (0..1, not clamped) of the busiest uplink of that leaf left unused
            by training (1 - p95 utilisation in its busier direction, the switch-to-switch ports
            of the leaf read by the fabric collector); ``None`` if unknown. An idle GPU is offered
            only while it is at least the lent share (``[broker] lent_share_percent`` / 100).
        planned_start: the training scheduler plans a pending job onto this GPU, to start at
            this time (Unix s; Slurm's expected ``StartTime`` of the job, whose GPUs on the node
            are taken from the node's GPUs no training job holds, lowest index first): set in
            any ``state``, once the start is at most analytics' ``plan_lead_s`` away. Such a GPU is
            not offered (``reason`` ``scheduler_planned``), and a lease holding it is told it is
            at risk. ``None``: no plan for it, or one that starts later (the GPU may be lent
            until then: ``predicted_idle_until`` ends at the planned start).
    """

    ts: float
    host: str
    gpu_uuid: str
    gpu_instance_id: int | None = None
    model_name: str | None = None
    state: GpuState
    since: float
    grade: IdleGrade | None = None
    predicted_idle_until: float | None = None
    confidence: float | None = Field(default=None, ge=0.0, le=1.0)
    reason: str = ""
    fb_total_mib: int | None = None
    headroom: float | None = None
    pool: str = "default"
    leaf: str | None = None
    leaf_headroom: float | None = None
    planned_start: float | None = None

    @property
    def key(self) -> str:
        """Kafka key and GPU identity: :func:`contracts.topics.gpu_key`."""
        return gpu_key(self.host, self.gpu_uuid, self.gpu_instance_id)


class PoolDemand(Record):
    """Training wants GPUs back: reclaim the named GPUs (or any ``count`` leased GPUs).

    Attributes:
        demand_id: unique id, for idempotency and tracing.
        ts: when the demand was raised (Unix s).
        gpus: GPU keys (:func:`contracts.topics.gpu_key`) to take back; empty means "any".
        count: how many leased GPUs to take back when ``gpus`` is empty; 0 with empty ``gpus``
            means every leased GPU.
        reason: free text (job name) for the operator's log.
        force: cut a lease's minimum guaranteed duration short (counted and reported).
    """

    demand_id: str
    ts: float
    gpus: list[str] = Field(default_factory=list)
    count: int = Field(default=0, ge=0)
    reason: str = ""
    force: bool = False
