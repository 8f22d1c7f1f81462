"""Prometheus metrics of the collectors stage (names ``gpupool_collector_*``), built on the registry
each object is given: :class:`CollectorMetrics` for a :class:`collectors.service.CollectorService`
(scrapes, delivery spool, targets), :class:`FabricCollectorMetrics` for the InfiniBand fabric
collector (``gpupool_collector_fabric_*``) and :class:`SlurmMetrics` for the Slurm source
(``gpupool_collector_slurm_*``). Give a stage's objects one registry and serve it on ``/metrics``:
two collectors in one process never share a series, and a process without the fabric collector
or the Slurm source has none of their series.

Label values are bounded: ``target`` is a configured scrape target, ``reason`` one of the
snake_case reasons of :mod:`collectors.scrape`, :mod:`collectors.dcgm` and
:mod:`collectors.sysfs_ib`, ``topic`` a Kafka topic name, ``xid`` an XID code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from runtime.metrics import StateGauge

__all__ = ["CollectorMetrics", "FabricCollectorMetrics", "SlurmMetrics"]


class CollectorMetrics:
    """Every metric of one collector service, its delivery spool and its targets.

    Args:
        registry: where they are registered (a new :class:`prometheus_client.CollectorRegistry`
            when ``None``); :attr:`registry` is what the service's ``/metrics`` serves. Raises
            ``ValueError`` if one of their names is already there (one object per registry).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        registry = self.registry
        self.scrapes = Counter(
            "gpupool_collector_scrapes",
            "Scrapes of dcgm-exporter targets by result (success or failure).",
            ["target", "result"],
            registry=registry,
        )
        self.scrape_errors = Counter(
            "gpupool_collector_scrape_errors",
            "Failed scrapes by target and reason (timeout, connect_error, http_500, truncated, garbage...).",
            ["target", "reason"],
            registry=registry,
        )
        self.scrape_duration = Histogram(
            "gpupool_collector_scrape_duration_seconds",
            "Wall time of one scrape (dcgm: HTTP request and parse; sysfs: reading one root).",
            ["source"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=registry,
        )
        self.records_produced = Counter(
            "gpupool_collector_records_produced",
            "Records handed to the bus producer, by topic.",
            ["topic"],
            registry=registry,
        )
        self.rejected_samples = Counter(
            "gpupool_collector_rejected_samples",
            "Lines or values of scraped bodies the parser refused, by reason (sentinel, out_of_range, "
            "not_a_number, truncated_line, unknown_metric...).",
            ["reason"],
            registry=registry,
        )
        self.sysfs_errors = Counter(
            "gpupool_collector_sysfs_errors",
            "sysfs files that could not be used (each loses only its own value), by reason.",
            ["reason"],
            registry=registry,
        )
        self.xid_events = Counter(
            "gpupool_collector_xid_events",
            "New XID errors seen on GPUs (events on change of DCGM_FI_DEV_XID_ERRORS, or windowed counts).",
            ["xid"],
            registry=registry,
        )
        self.loop_errors = Counter(
            "gpupool_collector_loop_errors",
            "Unexpected exceptions caught by the collection loop (the loop goes on), by exception type.",
            ["reason"],
            registry=registry,
        )
        self.produce_errors = Counter(
            "gpupool_collector_produce_errors",
            "Records the bus producer refused, by topic and exception type.",
            ["topic", "reason"],
            registry=registry,
        )
        self.cycle_duration = Histogram(
            "gpupool_collector_cycle_duration_seconds",
            "Wall time of one collection cycle over every target and sysfs root.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=registry,
        )
        # delivery spool (collectors.spool)
        self.spool_levels: Callable[[], Mapping[str, tuple[int, int]]] | None = None
        """The running spool's ``{tier: (records, bytes)}``, read at scrape time (set by
        :class:`collectors.spool.SpoolingProducer` from its start to its stop); ``None``: no series."""
        StateGauge(
            "gpupool_collector_spool_records",
            "Records waiting in the delivery spool (not yet acknowledged by the bus), by tier (memory, disk).",
            ["tier"],
            lambda: self._spool_sample(0),
            registry,
        )
        StateGauge(
            "gpupool_collector_spool_bytes",
            "Bytes the delivery spool holds, by tier: record sizes in memory; segment file sizes on disk.",
            ["tier"],
            lambda: self._spool_sample(1),
            registry,
        )
        self.spool_spooled = Counter(
            "gpupool_collector_spool_spooled",
            "Records accepted into the delivery spool, by the tier they were written to.",
            ["tier"],
            registry=registry,
        )
        self.spool_drained = Counter(
            "gpupool_collector_spool_drained",
            "Records that left the delivery spool acknowledged by the bus.",
            registry=registry,
        )
        self.spool_dropped = Counter(
            "gpupool_collector_spool_dropped",
            "Records the delivery spool had to drop, by reason (full, too_large, disk_error, rejected, "
            "corrupt, shutdown).",
            ["reason"],
            registry=registry,
        )
        self.spool_redelivered = Counter(
            "gpupool_collector_spool_redelivered",
            "Records sent again after an attempt whose outcome was unknown (they carry the "
            "gpupool-redelivery header and may be duplicates).",
            registry=registry,
        )
        self.spool_delivery_errors = Counter(
            "gpupool_collector_spool_delivery_errors",
            "Errors of the bus producer behind the spool (start, send, flush), by exception type.",
            ["reason"],
            registry=registry,
        )
        self.spool_bus_up = Gauge(
            "gpupool_collector_spool_bus_up",
            "1 while the bus acknowledges the spool's deliveries, 0 while it waits on an unreachable bus.",
            registry=registry,
        )
        # targets (collectors.targets)
        self.targets = Gauge(
            "gpupool_collector_targets",
            "dcgm-exporter targets currently configured, by source (static, file_sd).",
            ["source"],
            registry=registry,
        )
        self.file_sd_reads = Counter(
            "gpupool_collector_file_sd_reads",
            "file_sd files read after a change, by result (ok, error).",
            ["result"],
            registry=registry,
        )
        self.file_sd_errors = Counter(
            "gpupool_collector_file_sd_errors",
            "file_sd problems by reason: a whole file refused (read_error, bad_json, bad_shape, "
            "bad_label_name, bad_label_value, unsupported_format; its previous targets are kept) or one "
            "target dropped (bad_address, bad_scheme, bad_duration, timeout_exceeds_interval).",
            ["reason"],
            registry=registry,
        )

    def _spool_sample(self, i: int) -> dict[tuple[str, ...], float]:
        """Field ``i`` (0: records, 1: bytes) of :attr:`spool_levels` by tier."""
        levels = self.spool_levels
        return {} if levels is None else {(tier,): v[i] for tier, v in levels().items()}


class FabricCollectorMetrics:
    """Metrics of the InfiniBand fabric collector (:class:`collectors.fabric_collector.FabricCollector`).

    Args:
        registry: where they are registered (the collector service's, so its ``/metrics`` shows
            them; a new :class:`prometheus_client.CollectorRegistry` when ``None``). Raises
            ``ValueError`` if one of their names is already there.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        registry = self.registry
        self.device_duration = Histogram(
            "gpupool_collector_fabric_device_duration_seconds",
            "Wall time to read the port counters of one fabric device (every perfquery run for it).",
            ["node_type"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=registry,
        )
        self.errors = Counter(
            "gpupool_collector_fabric_errors_total",
            "Fabric collection failures by reason: timeout, exec_error, transport, unreachable, exit_status, "
            "empty_output, no_counters, missing_port, no_lid, publish, or a parser line problem "
            "(unrecognised_line, bad_value, out_of_range, duplicate_counter, too_few_fields, bad_node_type, "
            "bad_number, bad_guid, bad_peer).",
            ["reason"],
            registry=registry,
        )
        self.timeouts = Counter(
            "gpupool_collector_fabric_timeouts_total",
            "Diag command runs (perfquery, ibnetdiscover) killed at their timeout.",
            registry=registry,
        )
        self.sweep_duration = Histogram(
            "gpupool_collector_fabric_sweep_duration_seconds",
            "Wall time of one counter sweep over the whole fabric.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=registry,
        )
        self.discovery_duration = Histogram(
            "gpupool_collector_fabric_discovery_duration_seconds",
            "Wall time of one ibnetdiscover run.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
            registry=registry,
        )
        self.samples = Counter(
            "gpupool_collector_fabric_samples_total",
            "IbPortSample records produced by the fabric collector.",
            registry=registry,
        )
        self.ports_down = Gauge(
            "gpupool_collector_fabric_ports_down",
            "Ports seen connected once and found without a peer at the last discovery.",
            registry=registry,
        )


class SlurmMetrics:
    """Metrics of the Slurm source (:class:`collectors.slurm_collector.SlurmCollector`); its
    pending-GPU gauge is read from the source at scrape time once it calls :meth:`watch_pending`.

    Args:
        registry: where they are registered (the collector service's, so its ``/metrics`` shows
            them; a new :class:`prometheus_client.CollectorRegistry` when ``None``). Raises
            ``ValueError`` if one of their names is already there.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        registry = self.registry
        self.errors = Counter(
            "gpupool_collector_slurm_errors_total",
            "Failures of the Slurm source by command and reason: a command (scontrol show node|job) that "
            "was not_found, exec_error, timeout, exit_status, empty_output or no_records (the read is "
            "skipped); command=parse with a line's parser reason (no_fields, missing_key, bad_gres, "
            "bad_index, bad_hostlist, bad_time, bad_number: the line is skipped); command=produce; "
            "command=loop.",
            ["command", "reason"],
            registry=registry,
        )
        self.read_duration = Histogram(
            "gpupool_collector_slurm_read_duration_seconds",
            "Wall time of one read of the Slurm source (both scontrol commands, parsing, producing).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
            registry=registry,
        )
        self.records = Counter(
            "gpupool_collector_slurm_records_total",
            "SchedulerNode records produced by the Slurm source.",
            registry=registry,
        )

    def watch_pending(self, read: Callable[[], Mapping[tuple[str, ...], float]]) -> StateGauge:
        """Register ``gpupool_collector_slurm_pending_gpus{partition}``, read by ``read()`` at each
        scrape (``{(partition,): GPUs}``). Raises ``ValueError`` when already registered."""
        return StateGauge(
            "gpupool_collector_slurm_pending_gpus",
            "GPUs asked by pending jobs at the latest read, by partition (jobs that ask for none add 0).",
            ["partition"],
            read,
            self.registry,
        )
