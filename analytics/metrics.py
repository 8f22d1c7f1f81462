"""Prometheus metrics of the analytics stage (default registry, ``gpupool_analytics_`` prefix).

The capacity gauges (:data:`GPUS`, :data:`IDLE_GPUS`, :data:`IDLE_GPU_MEMORY`) are set by
:data:`CAPACITY` from the snapshot each running :class:`analytics.service.AnalyticsService`
publishes after every step: instances in one process add up, a stopped instance's GPUs disappear
with it, and a series is updated in place (new values set first, then vanished label sets
removed), so a scrape never finds a known series missing.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections import Counter as _Tally
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from prometheus_client import Counter, Gauge, Histogram

RECORDS_CONSUMED = Counter(
    "gpupool_analytics_records_consumed_total",
    "Records read from the bus, by topic (including those then rejected).",
    ["topic"],
)
REJECTED_RECORDS = Counter(
    "gpupool_analytics_rejected_records_total",
    "Records or values skipped, by reason (tombstone, malformed_json, invalid_record, "
    "unsupported_version, unknown_topic, duplicate, counter_out_of_range, invalid_topology).",
    ["reason"],
)
DECODE_FALLBACKS = Counter(
    "gpupool_analytics_decode_fallback_records_total",
    "Records the fast decoder (msgspec twin of the record model) refused and the pydantic model then "
    "decided, accepted or rejected: lax spellings, unknown fields, bad records. Slower per record.",
)
INGEST_ROWS = Counter(
    "gpupool_analytics_ingest_rows_total",
    "Rows committed to DuckDB, by table.",
    ["table"],
)
INGEST_BATCH_SECONDS = Histogram(
    "gpupool_analytics_ingest_batch_seconds",
    "Time to write one batch (rows, offsets, states) to DuckDB in one transaction.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
INGEST_FAILURES = Counter(
    "gpupool_analytics_ingest_failures_total",
    "Batches whose DuckDB transaction failed and was rolled back (then re-read from the stored offsets).",
)
GPUS = Gauge(
    "gpupool_analytics_gpus",
    "GPUs (and MIG instances) known to this process, by state.",
    ["state"],
)
IDLE_GPUS = Gauge(
    "gpupool_analytics_idle_gpus",
    "Idle GPUs (and MIG instances), by pool, GPU model and idle grade; 0 for a known model with none.",
    ["pool", "model", "grade"],
)
IDLE_GPU_MEMORY = Gauge(
    "gpupool_analytics_idle_gpu_memory_bytes",
    "Framebuffer total of idle GPUs (and MIG instances), bytes, by pool, GPU model and idle grade.",
    ["pool", "model", "grade"],
)
LEAF_UPLINK_HEADROOM = Gauge(
    "gpupool_analytics_leaf_uplink_headroom_ratio",
    "Headroom training leaves on the busiest uplink of each leaf switch (1 - p95 utilisation in the "
    "busier direction over the headroom window), by leaf; absent when unknown.",
    ["leaf"],
)
LEAF_UPLINK_XMIT_WAIT = Gauge(
    "gpupool_analytics_leaf_uplink_xmit_wait_ratio",
    "Worst XmitWait fraction among the uplink ports of each leaf switch, "
    "ΔPortXmitWait / (ΔPortXmitWait + ΔPortXmitData) over the headroom window, by leaf.",
    ["leaf"],
)
LENT_SHARE = Gauge(
    "gpupool_analytics_lent_share_ratio",
    "Share of a link lent traffic may take: a leaf whose uplink headroom is below it is not offered.",
)
CAPACITY_UPDATES = Counter(
    "gpupool_analytics_capacity_updates_total",
    "Capacity updates published, by state.",
    ["state"],
)
PUBLISH_FAILURES = Counter(
    "gpupool_analytics_publish_failures_total",
    "Rounds of capacity updates that could not be published (retried on the next step).",
)
CONSUMER_LAG = Gauge(
    "gpupool_analytics_consumer_lag_records",
    "Records of an owned partition not yet committed to DuckDB: the partition's end offset minus "
    "the next offset stored with the rows (refreshed every publish interval).",
    ["topic", "partition"],
)
MAINTENANCE_SECONDS = Histogram(
    "gpupool_analytics_maintenance_seconds",
    "Time of one maintenance transaction (1-minute rollups, then expiry of old rows).",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
MAINTENANCE_FAILURES = Counter(
    "gpupool_analytics_maintenance_failures_total",
    "Maintenance transactions that failed and were rolled back (retried next interval).",
)
ROLLUP_ROWS = Counter(
    "gpupool_analytics_rollup_rows_total",
    "Rows written to a 1-minute rollup table, by table.",
    ["table"],
)
EXPIRED_ROWS = Counter(
    "gpupool_analytics_expired_rows_total",
    "Rows deleted by retention, by table.",
    ["table"],
)
ROLLUP_LATE_ROWS = Counter(
    "gpupool_analytics_rollup_late_rows_total",
    "Raw rows written for a minute already rolled up (later than the allowed lateness): kept raw, "
    "missing from the rollups. By table.",
    ["table"],
)

ALLOCATED_IDLE_GPUS = Gauge(
    "gpupool_analytics_allocated_idle_gpus",
    "GPUs the training scheduler has allocated to a job while their telemetry says idle, by the "
    "job's partition, user and job id (set from analytics.scheduler.SchedulerJoin).",
    ["partition", "user", "job"],
)

_S = TypeVar("_S")


@dataclass(frozen=True, slots=True)
class CapacitySnapshot:
    """One analytics instance's GPUs at the end of a step.

    Attributes:
        pool: the pool the instance reports.
        states: GPUs (and MIG instances) by state (``busy``, ``idle``, ``unknown``).
        models: every GPU model known to the instance (``unknown`` for none), so a model with no
            idle GPU reports 0 rather than no series.
        idle: idle GPUs by ``(model, grade)``.
        idle_memory_bytes: framebuffer total (bytes) of idle GPUs by ``(model, grade)``; GPUs whose
            total is unknown add nothing.
    """

    pool: str
    states: Mapping[str, int] = field(default_factory=dict)
    models: frozenset[str] = frozenset()
    idle: Mapping[tuple[str, str], int] = field(default_factory=dict)
    idle_memory_bytes: Mapping[tuple[str, str], int] = field(default_factory=dict)


IDLE_GRADES: tuple[str, ...] = ("free", "memory_held")
"""Grades reported for every known model (values of :class:`contracts.IdleGrade`)."""
GPU_STATES: tuple[str, ...] = ("busy", "idle", "unknown")
"""States reported (values of :class:`contracts.GpuState`)."""


class PerInstanceGauges(ABC, Generic[_S]):
    """Gauges summed over the running service instances of the process: each instance publishes
    a snapshot (held weakly, so an instance that is gone drops out) and :meth:`_apply`, which a
    subclass defines, sets the gauges from all of them (thread-safe)."""

    def __init__(self) -> None:
        """Start with no instance."""
        self._lock = threading.Lock()
        self._snapshots: weakref.WeakKeyDictionary[object, _S] = weakref.WeakKeyDictionary()

    def publish(self, instance: object, snapshot: _S) -> None:
        """Replace ``instance``'s snapshot (``instance``: the service object, held weakly) and
        update the gauges."""
        with self._lock:
            self._snapshots[instance] = snapshot
            self._apply()

    def withdraw(self, instance: object) -> None:
        """Forget ``instance`` (it stopped) and update the gauges; unknown instances are ignored."""
        with self._lock:
            self._snapshots.pop(instance, None)
            self._apply()

    @abstractmethod
    def _apply(self) -> None:
        """Set the gauges from ``self._snapshots`` (called with the lock held)."""


class CapacityGauges(PerInstanceGauges[CapacitySnapshot]):
    """Sums the snapshots of the running instances into :data:`GPUS`, :data:`IDLE_GPUS` and
    :data:`IDLE_GPU_MEMORY` (thread-safe)."""

    def __init__(self) -> None:
        """Start with no instance."""
        super().__init__()
        self._idle_labels: set[tuple[str, str, str]] = set()

    def _apply(self) -> None:
        states: _Tally[str] = _Tally()
        idle: dict[tuple[str, str, str], int] = {}
        memory: dict[tuple[str, str, str], int] = {}
        for s in list(self._snapshots.values()):
            states.update(s.states)
            for model in s.models:  # zeros for known models: "none idle" is a 0, not a gap
                for grade in IDLE_GRADES:
                    idle.setdefault((s.pool, model, grade), 0)
                    memory.setdefault((s.pool, model, grade), 0)
            for (model, grade), n in s.idle.items():
                key = (s.pool, model, grade)
                idle[key] = idle.get(key, 0) + n
                memory[key] = memory.get(key, 0) + s.idle_memory_bytes.get((model, grade), 0)
        for state in GPU_STATES:
            GPUS.labels(state=state).set(states.get(state, 0))
        for key, n in idle.items():
            IDLE_GPUS.labels(*key).set(n)
            IDLE_GPU_MEMORY.labels(*key).set(memory[key])
        for key in self._idle_labels - idle.keys():
            IDLE_GPUS.remove(*key)
            IDLE_GPU_MEMORY.remove(*key)
        self._idle_labels = set(idle)


CAPACITY = CapacityGauges()
"""The one :class:`CapacityGauges` of the process."""
