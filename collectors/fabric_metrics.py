"""Prometheus metrics of the InfiniBand fabric collector: default registry, ``gpupool_collector_fabric_*``."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "DEVICE_DURATION",
    "DISCOVERY_DURATION",
    "ERRORS",
    "PORTS_DOWN",
    "SAMPLES",
    "SWEEP_DURATION",
    "TIMEOUTS",
]

DEVICE_DURATION = Histogram(
    "gpupool_collector_fabric_device_duration_seconds",
    "Wall time to read the port counters of one fabric device (every perfquery run for it).",
    ["node_type"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
ERRORS = Counter(
    "gpupool_collector_fabric_errors_total",
    "Fabric collection failures by reason: timeout, exec_error, transport, unreachable, exit_status, "
    "empty_output, no_counters, missing_port, no_lid, publish, or a parser line problem "
    "(unrecognised_line, bad_value, out_of_range, duplicate_counter, too_few_fields, bad_node_type, "
    "bad_number, bad_guid, bad_peer).",
    ["reason"],
)
TIMEOUTS = Counter(
    "gpupool_collector_fabric_timeouts_total",
    "Diag command runs (perfquery, ibnetdiscover) killed at their timeout.",
)
SWEEP_DURATION = Histogram(
    "gpupool_collector_fabric_sweep_duration_seconds",
    "Wall time of one counter sweep over the whole fabric.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
DISCOVERY_DURATION = Histogram(
    "gpupool_collector_fabric_discovery_duration_seconds",
    "Wall time of one ibnetdiscover run.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
SAMPLES = Counter(
    "gpupool_collector_fabric_samples_total",
    "IbPortSample records produced by the fabric collector.",
)
PORTS_DOWN = Gauge(
    "gpupool_collector_fabric_ports_down",
    "Ports seen connected once and found without a peer at the last discovery.",
)
