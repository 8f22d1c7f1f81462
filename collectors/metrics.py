"""Prometheus metrics of the collectors stage (default registry, names ``gpupool_collector_*``).

Label values are bounded: ``target`` is a configured scrape target, ``reason`` one of the
snake_case reasons of :mod:`collectors.scrape`, :mod:`collectors.dcgm` and
:mod:`collectors.sysfs_ib`, ``topic`` a Kafka topic name, ``xid`` an XID code.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

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
