"""Prometheus metrics of the analytics stage (default registry, ``gpupool_analytics_`` prefix)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECORDS_CONSUMED = Counter(
    "gpupool_analytics_records_consumed_total",
    "Records read from the bus, by topic (including those then rejected).",
    ["topic"],
)
REJECTED_RECORDS = Counter(
    "gpupool_analytics_rejected_records_total",
    "Records or values skipped, by reason (tombstone, malformed_json, invalid_record, "
    "unsupported_version, unknown_topic, duplicate, counter_out_of_range).",
    ["reason"],
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
    "GPUs (and MIG instances) known to this instance, by state.",
    ["state"],
)
IDLE_GPUS = Gauge(
    "gpupool_analytics_idle_gpus",
    "Idle GPUs (and MIG instances), by pool, GPU model and idle grade.",
    ["pool", "model", "grade"],
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
