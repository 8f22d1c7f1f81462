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

from prometheus_client import CollectorRegistry

from runtime.metrics import MetricSet, Samples, StateGauge

__all__ = ["CollectorMetrics", "FabricCollectorMetrics", "SlurmMetrics"]


class CollectorMetrics(MetricSet):
    """Every metric of one collector service, its delivery spool and its targets.

    On the registry it is given (:class:`runtime.metrics.MetricSet`; a new one when ``None``).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.scrapes = self.counter(
            "gpupool_collector_scrapes",
            "Scrapes of dcgm-exporter targets by result (success or failure).",
            ["target", "result"],
        )
        self.scrape_errors = self.counter(
            "gpupool_collector_scrape_errors",
            "Failed scrapes by target and reason (timeout, connect_error, http_500, truncated, garbage...).",
            ["target", "reason"],
        )
        self.scrape_duration = self.histogram(
            "gpupool_collector_scrape_duration_seconds",
            "Wall time of one scrape (dcgm: HTTP request and parse; sysfs: reading one root).",
            ["source"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        self.records_produced = self.counter(
            "gpupool_collector_records_produced",
            "Records handed to the bus producer, by topic.",
            ["topic"],
        )
        self.rejected_samples = self.counter(
            "gpupool_collector_rejected_samples",
            "Lines or values of scraped bodies the parser refused, by reason (sentinel, out_of_range, "
            "not_a_number, truncated_line, unknown_metric...).",
            ["reason"],
        )
        self.sysfs_errors = self.counter(
            "gpupool_collector_sysfs_errors",
            "sysfs files that could not be used (each loses only its own value), by reason.",
            ["reason"],
        )
        self.xid_events = self.counter(
            "gpupool_collector_xid_events",
            "New XID errors seen on GPUs (events on change of DCGM_FI_DEV_XID_ERRORS, or windowed counts).",
            ["xid"],
        )
        self.loop_errors = self.counter(
            "gpupool_collector_loop_errors",
            "Unexpected exceptions caught by the collection loop (the loop goes on), by exception type.",
            ["reason"],
        )
        self.produce_errors = self.counter(
            "gpupool_collector_produce_errors",
            "Records the bus producer refused, by topic and exception type.",
            ["topic", "reason"],
        )
        self.cycle_duration = self.histogram(
            "gpupool_collector_cycle_duration_seconds",
            "Wall time of one collection cycle over every target and sysfs root.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
        )
        # delivery spool (collectors.spool)
        self.spool_levels: Callable[[], Mapping[str, tuple[int, int]]] | None = None
        """The running spool's ``{tier: (records, bytes)}``, read at scrape time (set by
        :class:`collectors.spool.SpoolingProducer` from its start to its stop); ``None``: no series."""
        self.state_gauge(
            "gpupool_collector_spool_records",
            "Records waiting in the delivery spool (not yet acknowledged by the bus), by tier (memory, disk).",
            ["tier"],
            lambda: self._spool_sample(0),
        )
        self.state_gauge(
            "gpupool_collector_spool_bytes",
            "Bytes the delivery spool holds, by tier: record sizes in memory; segment file sizes on disk.",
            ["tier"],
            lambda: self._spool_sample(1),
        )
        self.spool_spooled = self.counter(
            "gpupool_collector_spool_spooled",
            "Records accepted into the delivery spool, by the tier they were written to.",
            ["tier"],
        )
        self.spool_drained = self.counter(
            "gpupool_collector_spool_drained",
            "Records that left the delivery spool acknowledged by the bus.",
        )
        self.spool_dropped = self.counter(
            "gpupool_collector_spool_dropped",
            "Records the delivery spool had to drop, by reason (full, too_large, disk_error, rejected, "
            "corrupt, shutdown).",
            ["reason"],
        )
        self.spool_redelivered = self.counter(
            "gpupool_collector_spool_redelivered",
            "Records sent again after an attempt whose outcome was unknown (they carry the "
            "gpupool-redelivery header and may be duplicates).",
        )
        self.spool_delivery_errors = self.counter(
            "gpupool_collector_spool_delivery_errors",
            "Errors of the bus producer behind the spool (start, send, flush), by exception type.",
            ["reason"],
        )
        self.spool_bus_up = self.gauge(
            "gpupool_collector_spool_bus_up",
            "1 while the bus acknowledges the spool's deliveries, 0 while it waits on an unreachable bus.",
        )
        # targets (collectors.targets)
        self.targets = self.gauge(
            "gpupool_collector_targets",
            "dcgm-exporter targets currently configured, by source (static, file_sd).",
            ["source"],
        )
        self.file_sd_reads = self.counter(
            "gpupool_collector_file_sd_reads",
            "file_sd files read after a change, by result (ok, error).",
            ["result"],
        )
        self.file_sd_errors = self.counter(
            "gpupool_collector_file_sd_errors",
            "file_sd problems by reason: a whole file refused (read_error, bad_json, bad_shape, "
            "bad_label_name, bad_label_value, unsupported_format; its previous targets are kept) or one "
            "target dropped (bad_address, bad_scheme, bad_duration, timeout_exceeds_interval).",
            ["reason"],
        )

    def _spool_sample(self, i: int) -> dict[tuple[str, ...], float]:
        """Field ``i`` (0: records, 1: bytes) of :attr:`spool_levels` by tier."""
        levels = self.spool_levels
        return {} if levels is None else {(tier,): v[i] for tier, v in levels().items()}


class FabricCollectorMetrics(MetricSet):
    """Metrics of the InfiniBand fabric collector (:class:`collectors.fabric_collector.FabricCollector`).

    On the registry it is given (:class:`runtime.metrics.MetricSet`; a new one when ``None``).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.device_duration = self.histogram(
            "gpupool_collector_fabric_device_duration_seconds",
            "Wall time to read the port counters of one fabric device (every perfquery run for it).",
            ["node_type"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        self.errors = self.counter(
            "gpupool_collector_fabric_errors_total",
            "Fabric collection failures by reason: timeout, exec_error, transport, unreachable, exit_status, "
            "empty_output, no_counters, missing_port, no_lid, publish, or a parser line problem "
            "(unrecognised_line, bad_value, out_of_range, duplicate_counter, too_few_fields, bad_node_type, "
            "bad_number, bad_guid, bad_peer).",
            ["reason"],
        )
        self.timeouts = self.counter(
            "gpupool_collector_fabric_timeouts_total",
            "Diag command runs (perfquery, ibnetdiscover) killed at their timeout.",
        )
        self.sweep_duration = self.histogram(
            "gpupool_collector_fabric_sweep_duration_seconds",
            "Wall time of one counter sweep over the whole fabric.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
        )
        self.discovery_duration = self.histogram(
            "gpupool_collector_fabric_discovery_duration_seconds",
            "Wall time of one ibnetdiscover run.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
        )
        self.samples = self.counter(
            "gpupool_collector_fabric_samples_total",
            "IbPortSample records produced by the fabric collector.",
        )
        self.ports_down = self.gauge(
            "gpupool_collector_fabric_ports_down",
            "Ports seen connected once and found without a peer at the last discovery.",
        )


class SlurmMetrics(MetricSet):
    """Metrics of the Slurm source (:class:`collectors.slurm_collector.SlurmCollector`); its
    pending-GPU gauge is read from the source at scrape time once it calls :meth:`watch_pending`.

    On the registry it is given (:class:`runtime.metrics.MetricSet`; a new one when ``None``).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.errors = self.counter(
            "gpupool_collector_slurm_errors_total",
            "Failures of the Slurm source by command and reason: a command (scontrol show node|job) that "
            "was not_found, exec_error, timeout, exit_status, empty_output or no_records (the read is "
            "skipped); command=parse with a line's parser reason (no_fields, missing_key, bad_gres, "
            "bad_index, bad_hostlist, bad_time, bad_number: the line is skipped); command=produce; "
            "command=loop.",
            ["command", "reason"],
        )
        self.read_duration = self.histogram(
            "gpupool_collector_slurm_read_duration_seconds",
            "Wall time of one read of the Slurm source (both scontrol commands, parsing, producing).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        )
        self.records = self.counter(
            "gpupool_collector_slurm_records_total",
            "SchedulerNode records produced by the Slurm source.",
        )

    def watch_pending(self, read: Samples) -> StateGauge:
        """Register ``gpupool_collector_slurm_pending_gpus{partition}``, read by ``read()`` at each
        scrape (``{(partition,): GPUs}``). Raises ``ValueError`` when already registered."""
        return self.state_gauge(
            "gpupool_collector_slurm_pending_gpus",
            "GPUs asked by pending jobs at the latest read, by partition (jobs that ask for none add 0).",
            ["partition"],
            read,
        )


class KubernetesMetrics(MetricSet):
    """Metrics of the Kubernetes scheduler source (:class:`collectors.kube_collector.KubernetesCollector`);
    its pending-GPU gauge is read from the source at scrape time once it calls :meth:`watch_pending`.

    On the registry it is given (:class:`runtime.metrics.MetricSet`; a new one when ``None``).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.errors = self.counter(
            "gpupool_collector_kubernetes_errors_total",
            "Failures of the Kubernetes source by resource (nodes, pods, workloads, localqueues, "
            "clusterqueues; produce, loop) and reason: a list or watch that failed (unreachable, "
            "http_<status>, stream_error, bad_list: the cache is not used until listed again), an "
            "expired watch (expired: listed again), an object that did not parse (no_metadata, "
            "bad_quantity, bad_time, bad_field: skipped), a pod that did not fit its node (over_allocated).",
            ["resource", "reason"],
        )
        self.reads = self.counter(
            "gpupool_collector_kubernetes_reads_total",
            "Reads of the Kubernetes source by outcome: ok (records produced) or failed (a cache was "
            "not synced with the API server: nothing produced).",
            ["outcome"],
        )
        self.read_duration = self.histogram(
            "gpupool_collector_kubernetes_read_duration_seconds",
            "Wall time of one read of the Kubernetes source (records built from the caches and produced).",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.records = self.counter(
            "gpupool_collector_kubernetes_records_total",
            "SchedulerNode records produced by the Kubernetes source.",
        )

    def watch_pending(self, read: Samples) -> StateGauge:
        """Register ``gpupool_collector_kubernetes_pending_gpus{queue}``, read by ``read()`` at each
        scrape (``{(queue,): GPUs}``). Raises ``ValueError`` when already registered."""
        return self.state_gauge(
            "gpupool_collector_kubernetes_pending_gpus",
            "GPUs asked by pending Kueue workloads and pending pods at the latest read, by ClusterQueue "
            '("" for pods of no queue).',
            ["queue"],
            read,
        )
