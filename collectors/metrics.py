"""Prometheus metrics of the collectors stage (default registry, names ``gpupool_collector_*``).

Label values are bounded: ``target`` is a configured scrape target, ``reason`` one of the
snake_case reasons of :mod:`collectors.scrape`, :mod:`collectors.dcgm` and
:mod:`collectors.sysfs_ib`, ``topic`` a Kafka topic name, ``xid`` an XID code.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SCRAPES = Counter(
    "gpupool_collector_scrapes",
    "Scrapes of dcgm-exporter targets by result (success or failure).",
    ["target", "result"],
)
SCRAPE_ERRORS = Counter(
    "gpupool_collector_scrape_errors",
    "Failed scrapes by target and reason (timeout, connect_error, http_500, truncated, garbage...).",
    ["target", "reason"],
)
SCRAPE_DURATION = Histogram(
    "gpupool_collector_scrape_duration_seconds",
    "Wall time of one scrape (dcgm: HTTP request and parse; sysfs: reading one root).",
    ["source"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
RECORDS_PRODUCED = Counter(
    "gpupool_collector_records_produced",
    "Records handed to the bus producer, by topic.",
    ["topic"],
)
REJECTED_SAMPLES = Counter(
    "gpupool_collector_rejected_samples",
    "Lines or values of scraped bodies the parser refused, by reason (sentinel, out_of_range, "
    "not_a_number, truncated_line, unknown_metric...).",
    ["reason"],
)
SYSFS_ERRORS = Counter(
    "gpupool_collector_sysfs_errors",
    "sysfs files that could not be used (each loses only its own value), by reason.",
    ["reason"],
)
XID_EVENTS = Counter(
    "gpupool_collector_xid_events",
    "New XID errors seen on GPUs (events on change of DCGM_FI_DEV_XID_ERRORS, or windowed counts).",
    ["xid"],
)
LOOP_ERRORS = Counter(
    "gpupool_collector_loop_errors",
    "Unexpected exceptions caught by the collection loop (the loop goes on), by exception type.",
    ["reason"],
)
PRODUCE_ERRORS = Counter(
    "gpupool_collector_produce_errors",
    "Records the bus producer refused, by topic and exception type.",
    ["topic", "reason"],
)
CYCLE_DURATION = Histogram(
    "gpupool_collector_cycle_duration_seconds",
    "Wall time of one collection cycle over every target and sysfs root.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)

# --- delivery spool (collectors.spool) -------------------------------------------------------------
SPOOL_RECORDS = Gauge(
    "gpupool_collector_spool_records",
    "Records waiting in the delivery spool (not yet acknowledged by the bus), by tier (memory, disk).",
    ["tier"],
)
SPOOL_BYTES = Gauge(
    "gpupool_collector_spool_bytes",
    "Bytes the delivery spool holds, by tier: record sizes in memory; segment file sizes on disk.",
    ["tier"],
)
SPOOL_SPOOLED = Counter(
    "gpupool_collector_spool_spooled",
    "Records accepted into the delivery spool, by the tier they were written to.",
    ["tier"],
)
SPOOL_DRAINED = Counter(
    "gpupool_collector_spool_drained",
    "Records that left the delivery spool acknowledged by the bus.",
)
SPOOL_DROPPED = Counter(
    "gpupool_collector_spool_dropped",
    "Records the delivery spool had to drop, by reason (full, too_large, disk_error, rejected, "
    "corrupt, shutdown).",
    ["reason"],
)
SPOOL_REDELIVERED = Counter(
    "gpupool_collector_spool_redelivered",
    "Records sent again after an attempt whose outcome was unknown (they carry the "
    "gpupool-redelivery header and may be duplicates).",
)
SPOOL_DELIVERY_ERRORS = Counter(
    "gpupool_collector_spool_delivery_errors",
    "Errors of the bus producer behind the spool (start, send, flush), by exception type.",
    ["reason"],
)
SPOOL_BUS_UP = Gauge(
    "gpupool_collector_spool_bus_up",
    "1 while the bus acknowledges the spool's deliveries, 0 while it waits on an unreachable bus.",
)

# --- targets (collectors.targets) ----------------------------------------------------------------
TARGETS = Gauge(
    "gpupool_collector_targets",
    "dcgm-exporter targets currently configured, by source (static, file_sd).",
    ["source"],
)
FILE_SD_READS = Counter(
    "gpupool_collector_file_sd_reads",
    "file_sd files read after a change, by result (ok, error).",
    ["result"],
)
FILE_SD_ERRORS = Counter(
    "gpupool_collector_file_sd_errors",
    "file_sd problems by reason: a whole file refused (read_error, bad_json, bad_shape, "
    "bad_label_name, bad_label_value, unsupported_format; its previous targets are kept) or one "
    "target dropped (bad_address, bad_scheme, bad_duration, timeout_exceeds_interval).",
    ["reason"],
)
