"""Prometheus metrics of ``gpupool report`` (default registry, names ``gpupool_report_*``)."""

from __future__ import annotations

from prometheus_client import Counter

REJECTED_RECORDS = Counter(
    "gpupool_report_rejected_records_total",
    "Input records the report skipped, by reason (bad_json, bad_record: a lease log line that is "
    "not a LeaseLogRecord).",
    ["reason"],
)
"""Lease-log lines skipped while building a report, by ``reason``."""
