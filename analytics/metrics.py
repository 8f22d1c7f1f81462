"""Prometheus metrics of the analytics stage (``gpupool_analytics_`` prefix), built on the registry
an :class:`AnalyticsMetrics` is given: one object per analytics service, whose ``/metrics`` serves
that registry (two services in one process never share a series).

The gauges that show the service's state (GPUs by state, idle GPUs and their memory, leaf uplink
headroom, consumer lag, allocated-but-idle GPUs) are read from it at scrape time
(:meth:`AnalyticsMetrics.watch`): a label set gone from the state is gone from the scrape.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from runtime.metrics import MetricSet, Samples

__all__ = ["GPU_STATES", "IDLE_GRADES", "AnalyticsMetrics", "CapacitySnapshot"]

IDLE_GRADES: tuple[str, ...] = ("free", "memory_held")
"""Grades reported for every known model (values of :class:`contracts.IdleGrade`)."""
GPU_STATES: tuple[str, ...] = ("busy", "idle", "unknown")
"""States reported (values of :class:`contracts.GpuState`)."""


@dataclass(frozen=True, slots=True)
class CapacitySnapshot:
    """One analytics service's GPUs at the end of a step (immutable: read by the scrape thread).

    Attributes:
        pool: the pool the service reports.
        states: GPUs (and MIG instances) by state (``busy``, ``idle``, ``unknown``).
        models: every GPU model known to the service (``unknown`` for none), so a model with no
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

    def gpus(self) -> dict[tuple[str, ...], float]:
        """``gpupool_analytics_gpus`` samples: ``{(state,): GPUs}`` for every state of :data:`GPU_STATES`."""
        return {(state,): self.states.get(state, 0) for state in GPU_STATES}

    def idle_gpus(self) -> dict[tuple[str, ...], float]:
        """``gpupool_analytics_idle_gpus`` samples: ``{(pool, model, grade): GPUs}``, 0 for every
        grade of :data:`IDLE_GRADES` of a known model with none."""
        out: dict[tuple[str, ...], float] = {(self.pool, m, g): 0 for m in sorted(self.models) for g in IDLE_GRADES}
        for (model, grade), n in self.idle.items():
            out[(self.pool, model, grade)] = n
        return out

    def idle_memory(self) -> dict[tuple[str, ...], float]:
        """``gpupool_analytics_idle_gpu_memory_bytes`` samples, keyed like :meth:`idle_gpus` (bytes)."""
        return {key: self.idle_memory_bytes.get((key[1], key[2]), 0) for key in self.idle_gpus()}


class AnalyticsMetrics(MetricSet):
    """Every metric of one analytics service: counters and histograms here, and the gauges read
    from the service's state once it calls :meth:`watch`.

    On the registry it is given (:class:`runtime.metrics.MetricSet`; a new one when ``None``).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.records_consumed = self.counter(
            "gpupool_analytics_records_consumed_total",
            "Records read from the bus, by topic (including those then rejected).",
            ["topic"],
        )
        self.rejected_records = self.counter(
            "gpupool_analytics_rejected_records_total",
            "Records or values skipped, by reason (tombstone, malformed_json, invalid_record, "
            "unsupported_version, unknown_topic, duplicate, counter_out_of_range, invalid_topology, "
            "invalid_sample: one GPU of a scrape record whose other GPUs were kept).",
            ["reason"],
        )
        self.decode_fallbacks = self.counter(
            "gpupool_analytics_decode_fallback_records_total",
            "Records the fast decoder (the compiled decoder of scrape records, the msgspec twin of the model for "
            "other records) refused and the pydantic model then decided, accepted or rejected: lax spellings, "
            "unknown fields, bad records. Slower per record.",
        )
        self.ingest_rows = self.counter(
            "gpupool_analytics_ingest_rows_total",
            "Rows committed to DuckDB, by table.",
            ["table"],
        )
        self.ingest_batch_seconds = self.histogram(
            "gpupool_analytics_ingest_batch_seconds",
            "Time to write one batch (rows, offsets, states) to DuckDB in one transaction.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )
        self.ingest_failures = self.counter(
            "gpupool_analytics_ingest_failures_total",
            "Batches whose DuckDB transaction failed and was rolled back (then re-read from the stored offsets).",
        )
        self.lent_share = self.gauge(
            "gpupool_analytics_lent_share_ratio",
            "Share of a link lent traffic may take: a leaf whose uplink headroom is below it is not offered.",
        )
        self.capacity_updates = self.counter(
            "gpupool_analytics_capacity_updates_total",
            "Capacity updates published, by state.",
            ["state"],
        )
        self.publish_failures = self.counter(
            "gpupool_analytics_publish_failures_total",
            "Rounds of capacity updates that could not be published (retried on the next step).",
        )
        self.maintenance_seconds = self.histogram(
            "gpupool_analytics_maintenance_seconds",
            "Time of one maintenance transaction (1-minute rollups, then expiry of old rows).",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
        )
        self.maintenance_failures = self.counter(
            "gpupool_analytics_maintenance_failures_total",
            "Maintenance transactions that failed and were rolled back (retried next interval).",
        )
        self.rollup_rows = self.counter(
            "gpupool_analytics_rollup_rows_total",
            "Rows written to a 1-minute rollup table, by table.",
            ["table"],
        )
        self.expired_rows = self.counter(
            "gpupool_analytics_expired_rows_total",
            "Rows deleted by retention, by table.",
            ["table"],
        )
        self.rollup_late_rows = self.counter(
            "gpupool_analytics_rollup_late_rows_total",
            "Raw rows written for a minute already rolled up (later than the allowed lateness): kept raw, "
            "missing from the rollups. By table.",
            ["table"],
        )

    def watch(
        self,
        *,
        gpus: Samples,
        idle_gpus: Samples,
        idle_gpu_memory: Samples,
        leaf_uplink_headroom: Samples,
        leaf_uplink_xmit_wait: Samples,
        consumer_lag: Samples,
        allocated_idle_gpus: Samples,
    ) -> None:
        """Register the gauges read at scrape time, each from its function (label values in the
        order of the gauge's label names → value; see :class:`runtime.metrics.StateGauge` for
        what a function may do). Raises ``ValueError`` when called twice."""
        self.state_gauge(
            "gpupool_analytics_gpus",
            "GPUs (and MIG instances) known to this process, by state.",
            ["state"],
            gpus,
        )
        self.state_gauge(
            "gpupool_analytics_idle_gpus",
            "Idle GPUs (and MIG instances), by pool, GPU model and idle grade; 0 for a known model with none.",
            ["pool", "model", "grade"],
            idle_gpus,
        )
        self.state_gauge(
            "gpupool_analytics_idle_gpu_memory_bytes",
            "Framebuffer total of idle GPUs (and MIG instances), bytes, by pool, GPU model and idle grade.",
            ["pool", "model", "grade"],
            idle_gpu_memory,
        )
        self.state_gauge(
            "gpupool_analytics_leaf_uplink_headroom_ratio",
            "Headroom training leaves on the busiest uplink of each leaf switch (1 - p95 utilisation in the "
            "busier direction over the headroom window), by leaf; absent when unknown.",
            ["leaf"],
            leaf_uplink_headroom,
        )
        self.state_gauge(
            "gpupool_analytics_leaf_uplink_xmit_wait_ratio",
            "Worst XmitWait fraction among the uplink ports of each leaf switch, "
            "ΔPortXmitWait / (ΔPortXmitWait + ΔPortXmitData) over the headroom window, by leaf.",
            ["leaf"],
            leaf_uplink_xmit_wait,
        )
        self.state_gauge(
            "gpupool_analytics_consumer_lag_records",
            "Records of an owned partition not yet committed to DuckDB: the partition's end offset minus "
            "the next offset stored with the rows (refreshed every publish interval).",
            ["topic", "partition"],
            consumer_lag,
        )
        self.state_gauge(
            "gpupool_analytics_allocated_idle_gpus",
            "GPUs the training scheduler has allocated to a job while their telemetry says idle, by the "
            "job's partition, user and job id (set from analytics.scheduler.SchedulerJoin).",
            ["partition", "user", "job"],
            allocated_idle_gpus,
        )
