"""Prometheus metrics of the simulator (default registry, ``gpupool_simulator_`` prefix)."""

from __future__ import annotations

from prometheus_client import Counter

SCRAPES_SERVED = Counter(
    "gpupool_simulator_scrapes_served_total",
    "Requests to a simulated dcgm-exporter /metrics, by node and by injected fault (mode=ok when none).",
    ["host", "mode"],
)
SYSFS_FILES_WRITTEN = Counter(
    "gpupool_simulator_sysfs_files_written_total",
    "Files (re)written atomically in the simulated InfiniBand sysfs trees.",
)
DEMANDS = Counter(
    "gpupool_simulator_demands_total",
    "Pool demands produced by the simulated training (a GPU's trace went from idle to busy).",
)
DEMAND_ERRORS = Counter(
    "gpupool_simulator_demand_errors_total",
    "Pool demands the simulated training failed to produce, by reason.",
    ["reason"],
)
