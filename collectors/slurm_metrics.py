"""Prometheus metrics of the Slurm source: default registry, ``gpupool_collector_slurm_*``."""

from __future__ import annotations

import threading
from collections import Counter as _Tally
from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from collectors.slurm_parse import JobInfo

__all__ = ["ERRORS", "PENDING_GPUS", "READ_DURATION", "RECORDS", "set_pending"]

ERRORS = Counter(
    "gpupool_collector_slurm_errors_total",
    "Failures of the Slurm source by command and reason: a command (scontrol show node|job) that "
    "was not_found, exec_error, timeout, exit_status, empty_output or no_records (the read is "
    "skipped); command=parse with a line's parser reason (no_fields, missing_key, bad_gres, "
    "bad_index, bad_hostlist, bad_time, bad_number: the line is skipped); command=produce; "
    "command=loop.",
    ["command", "reason"],
)
READ_DURATION = Histogram(
    "gpupool_collector_slurm_read_duration_seconds",
    "Wall time of one read of the Slurm source (both scontrol commands, parsing, producing).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
RECORDS = Counter(
    "gpupool_collector_slurm_records_total",
    "SchedulerNode records produced by the Slurm source.",
)
PENDING_GPUS = Gauge(
    "gpupool_collector_slurm_pending_gpus",
    "GPUs asked by pending jobs at the latest read, by partition (jobs that ask for none add 0).",
    ["partition"],
)

_lock = threading.Lock()
_pending_labels: set[str] = set()


def set_pending(jobs: Iterable[JobInfo]) -> None:
    """Set :data:`PENDING_GPUS` from a read's jobs; partitions with no pending GPU job left are
    removed."""
    global _pending_labels
    tally: _Tally[str] = _Tally()
    for job in jobs:
        if job.state == "PENDING" and job.gpus_requested:
            tally[job.partition or ""] += job.gpus_requested
    with _lock:
        for part, n in tally.items():
            PENDING_GPUS.labels(partition=part).set(n)
        for part in _pending_labels - tally.keys():
            PENDING_GPUS.remove(part)
        _pending_labels = set(tally)
