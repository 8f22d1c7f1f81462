"""``gpupool collect ...``: run the collector stage, or parse one input to see what it yields."""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from contracts import KafkaTopics
from runtime.bus import make_bus
from runtime.run_options import settings_command
from runtime.settings import CollectorsSettings, DeploymentSettings, RunFlags
from runtime.stage import run_stage

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from collectors.fabric_collector import FabricCollector
    from collectors.service import CollectorService
    from contracts.bus import Bus

log = logging.getLogger(__name__)

app = typer.Typer(no_args_is_help=True, help="Collectors: GPU and InfiniBand telemetry → Kafka.")


def _nvsmi_command(spec: str) -> tuple[str, list[str]]:
    host, sep, command = spec.partition("=")
    argv = shlex.split(command) if sep else []
    if not host or not argv:
        raise typer.BadParameter(f"expected HOST=COMMAND, got {spec!r}")
    return host, argv


def _sysfs_root(spec: str) -> tuple[str, Path]:
    host, sep, path = spec.partition("=")
    if not sep or not host or not path:
        raise typer.BadParameter(f"expected HOST=PATH, got {spec!r}")
    return host, Path(path)


RUN_FLAGS = RunFlags(
    "gpupool collect run", "kafka", "collectors.*", "topic_prefix", "metrics.collectors", "metrics.addr"
)
"""The settings fields that are options of ``gpupool collect run`` (each field's :class:`runtime.settings.Flag`
names its option; :func:`runtime.run_options.settings_command` derives the options)."""

run_settings = RUN_FLAGS.load
"""The settings ``gpupool collect run`` runs with (:meth:`runtime.settings.RunFlags.load`)."""


@settings_command(app, "run", RUN_FLAGS)
def run(settings: DeploymentSettings) -> None:
    """Scrape every dcgm-exporter and UFM Telemetry target, read every sysfs root, run every
    nvidia-smi command (-q -x XML or a --query-gpu CSV query) and read NVML each interval and
    produce GpuSample / NvSwitchSample / IbPortSample records to Kafka until SIGINT or SIGTERM.
    With --slurm-conf, also read that Slurm cluster every --slurm-interval and produce one
    SchedulerNode record per node to telemetry.scheduler (a failing scontrol fails that read only).
    With --kubernetes, read the Kubernetes cluster of --kubeconfig (list + watch) into the same
    records every --kubernetes-interval (an API server that fails fails that read only).

    Every option can also come from the deployment's settings (runtime/settings.py): a flag
    wins over its GPUPOOL_* variable (e.g. GPUPOOL_KAFKA, GPUPOOL_COLLECTORS__INTERVAL_S), which
    wins over the --config TOML file (the collectors table, kafka, topic_prefix, metrics), which
    wins over the defaults.

    With --fabric the switch-side fabric collector runs too (it needs no other source): every
    --fabric-interval seconds one perfquery per switch and HCA (switches first, --fabric-concurrency
    at once), a new ibnetdiscover every --fabric-discover-every sweeps. Diag commands get
    [collectors] fabric_command_prefix (e.g. ["sudo", "-n"]) and this process's environment
    (IBSIM_SOCKNAME and LD_PRELOAD for a simulated fabric).

    Every --file-sd target is scraped at its own __scrape_interval__ and __scrape_timeout__
    (default --interval / --timeout) and its labels go into GpuSample.attributes as target_<name>.

    Exits with status 2 when the settings are invalid, Kafka is not configured or no source is
    given (--fabric counts as one); 1 when Kafka is unreachable (with --spool-dir records wait for
    Kafka instead), when the --spool-dir folder is unusable, or when the /metrics port cannot be
    bound.
    """
    from collectors.service import CollectorService

    assert settings.kafka is not None  # settings_command guarantees it
    bootstrap = settings.kafka
    cs = settings.collectors
    roots = [_sysfs_root(s) for s in cs.sysfs_roots]
    commands = [_nvsmi_command(s) for s in cs.nvidia_smi]
    has_gpu_source = bool(
        cs.dcgm_targets or roots or commands or cs.nvml_host or cs.file_sd or cs.ufm_telemetry or cs.fabric
    )
    if not has_gpu_source and cs.slurm_conf is None and not cs.kubernetes:
        raise typer.BadParameter(
            "give at least one --dcgm-target, --file-sd, --sysfs-root, --nvidia-smi, --ufm-telemetry, "
            "--nvml-host, --fabric, --slurm-conf or --kubernetes (or [collectors] dcgm_targets, file_sd, "
            "sysfs_roots, nvidia_smi, ufm_telemetry, nvml_host, fabric, slurm_conf, kubernetes in the settings)"
        )

    def build() -> tuple[_CollectorStage, Bus]:
        from collectors.metrics import CollectorMetrics

        bus = make_bus(bootstrap, client_id="gpupool-collector")
        topics = KafkaTopics(prefix=settings.topic_prefix)
        stage_metrics = CollectorMetrics()  # one registry: the service's, fabric's, the scheduler's
        service = CollectorService(
            bus=bus,
            topics=topics,
            dcgm_targets=list(cs.dcgm_targets),
            sysfs_roots=roots,
            interval_s=cs.interval_s,
            sysfs_interval_s=cs.sysfs_interval_s,
            timeout_s=cs.timeout_s,
            concurrency=cs.concurrency,
            nvsmi_commands=commands,
            ufm_targets=list(cs.ufm_telemetry),
            nvml_host=cs.nvml_host,
            file_sd=list(cs.file_sd),
            file_sd_refresh_s=cs.file_sd_refresh_s,
            spool_dir=cs.spool_dir,
            spool_memory_records=cs.spool_memory_records,
            spool_disk_bytes=cs.spool_disk_bytes,
            fabric=_fabric_collector(bus, topics, cs, stage_metrics.registry),
            fabric_interval_s=cs.fabric_interval_s,
            fabric_discover_every=cs.fabric_discover_every,
            forget_after_s=cs.forget_after_s,
            metrics=stage_metrics,
        )
        scheduler = _scheduler_source(bus, topics, cs, stage_metrics.registry)
        return _CollectorStage(service, scheduler, settings, gpu_sources=has_gpu_source), bus

    metrics = settings.metrics
    run_stage("gpupool collect run", build, metrics_port=metrics.collectors, metrics_addr=metrics.addr)


class _CollectorStage:
    """The collector service with the scheduler source (Slurm or Kubernetes) beside it, as one
    stage for :func:`runtime.stage.run_stage`; ``gpu_sources=False`` (only the scheduler): the
    service starts (its metrics, the bus) but does not collect."""

    def __init__(
        self, service: CollectorService, scheduler: Any, settings: DeploymentSettings, *, gpu_sources: bool
    ) -> None:
        """Keep the parts."""
        self.service, self.scheduler, self.settings = service, scheduler, settings
        self.gpu_sources = gpu_sources

    @property
    def registry(self) -> Any:
        """The service's metrics registry (else the default one), served on /metrics."""
        from prometheus_client import REGISTRY

        return getattr(self.service, "registry", REGISTRY)

    async def start(self) -> None:
        """Start the service, then the scheduler source; log ``collector_started``."""
        await self.service.start()
        if self.scheduler is not None:
            await self.scheduler.start()
        cs = self.settings.collectors
        log.info(
            "collector_started",
            extra={
                "targets": len(self.service.targets.targets),
                "sysfs_roots": len(cs.sysfs_roots),
                "fabric": cs.fabric,
                "spool_dir": str(cs.spool_dir) if cs.spool_dir else None,
                "config": str(self.settings.config) if self.settings.config else None,
            },
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Collect (and read the scheduler) until ``stop`` is set."""
        cs = self.settings.collectors
        interval = cs.kubernetes_interval_s if cs.kubernetes else cs.slurm_interval_s
        await asyncio.gather(
            self.service.run(stop) if self.gpu_sources else stop.wait(),
            *([self.scheduler.run(interval, stop)] if self.scheduler is not None else []),
        )

    async def stop(self) -> None:
        """Stop the scheduler source, then the service."""
        if self.scheduler is not None:
            await self.scheduler.stop()
        await self.service.stop()


def _fabric_collector(
    bus: Bus, topics: KafkaTopics, cs: CollectorsSettings, registry: CollectorRegistry | None = None
) -> FabricCollector | None:
    """The :class:`collectors.fabric_collector.FabricCollector` the ``[collectors]`` settings ask
    for (its metrics on ``registry``; ``None``: one of its own), or ``None`` when ``fabric`` is off."""
    if not cs.fabric:
        return None
    from collectors.fabric_collector import FabricCollector
    from collectors.metrics import FabricCollectorMetrics

    return FabricCollector(
        bus,
        topics,
        run_prefix=cs.fabric_command_prefix,
        concurrency=cs.fabric_concurrency,
        timeout_s=cs.fabric_timeout_s,
        metrics=FabricCollectorMetrics(registry),
    )


def _scheduler_source(
    bus: Any, topics: KafkaTopics, cs: CollectorsSettings, registry: CollectorRegistry | None = None
) -> Any:
    """The training scheduler's source the ``[collectors]`` settings ask for (its metrics on
    ``registry``; ``None``: one of its own): :class:`collectors.slurm_collector.SlurmCollector`
    for ``slurm_conf``, :class:`collectors.kube_collector.KubernetesCollector` for
    ``kubernetes``, else ``None``. Raises ``ValueError`` or ``OSError`` for an unreadable
    kubeconfig."""
    if cs.kubernetes:
        from collectors.kube_collector import KubernetesCollector
        from collectors.metrics import KubernetesMetrics
        from runtime.kube import kubernetes_client

        return KubernetesCollector(
            bus,
            topics,
            kubernetes_client(cs.kubeconfig),
            lent_namespace=cs.k8s_lent_namespace,
            resource=cs.k8s_gpu_resource,
            kueue=cs.k8s_kueue,
            metrics=KubernetesMetrics(registry),
        )
    if cs.slurm_conf is None:
        return None
    from collectors.metrics import SlurmMetrics
    from collectors.slurm_collector import SlurmCollector

    return SlurmCollector(bus, topics, slurm_conf=cs.slurm_conf, metrics=SlurmMetrics(registry))


@app.command("parse-dcgm")
def parse_dcgm(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="A saved /metrics body.")],
    host: Annotated[str | None, typer.Option(help="Host for series without a Hostname label.")] = None,
) -> None:
    """Parse a saved dcgm-exporter body and print one GpuSample per line as JSON, then the
    rejections (one ``{"rejected": ...}`` object per line)."""
    from collectors.dcgm import parse_dcgm_exporter

    res = parse_dcgm_exporter(
        file.read_text(encoding="utf-8", errors="replace"),
        ts=time.time(),
        target=str(file),
        default_host=host,
    )
    for s in res.samples:
        typer.echo(s.model_dump_json())
    for r in res.rejected:
        typer.echo(json.dumps({"rejected": r._asdict()}))


@app.command("read-sysfs")
def read_sysfs(
    root: Annotated[Path, typer.Argument(help="Folder holding class/infiniband (e.g. /sys).")] = Path("/sys"),
    host: Annotated[str, typer.Option(help="Host name for the samples.")] = "localhost",
) -> None:
    """Read an InfiniBand sysfs tree and print one IbPortSample per line as JSON, then the file
    errors (one ``{"error": ...}`` object per line)."""
    from collectors.sysfs_ib import read_sysfs_infiniband

    res = read_sysfs_infiniband(root, host, time.time())
    for p in res.ports:
        typer.echo(p.model_dump_json())
    for e in res.errors:
        typer.echo(json.dumps({"error": e._asdict()}))


@app.command("parse-output")
def parse_output(
    kind: Annotated[
        str,
        typer.Argument(help="ibstat, dcgmi-dmon, nvidia-smi-csv or ufm-telemetry."),
    ],
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="A saved output or body.")],
    host: Annotated[str, typer.Option(help="Host name for the records (not for ufm-telemetry).")] = "localhost",
    command: Annotated[
        str | None,
        typer.Option(
            help="The command line that printed it: its --query-gpu list (nvidia-smi noheader output) "
            "or -e field ids (dcgmi dmon) are read from it."
        ),
    ] = None,
) -> None:
    """Parse a saved ibstat / dcgmi dmon / nvidia-smi --query-gpu CSV output or UFM Telemetry body
    and print one record per line as JSON (IbPortSample or GpuSample), then what was rejected
    (one ``{"rejected": ...}`` object per line). Exits 2 for an unknown kind."""
    from collectors.dcgmi_dmon import field_ids, parse_dcgmi_dmon
    from collectors.ibstat import parse_ibstat
    from collectors.nvsmi_csv import parse_nvidia_smi_csv, query_properties
    from collectors.ufm_telemetry import parse_ufm_telemetry

    text = file.read_text(encoding="utf-8", errors="replace")
    argv = shlex.split(command) if command else []
    now = time.time()
    records: list[Any]
    rejected: list[dict[str, Any]]
    if kind == "ibstat":
        ib = parse_ibstat(text, host=host, ts=now)
        records, rejected = ib.ports, [{"lineno": p.lineno, "reason": p.reason, "line": p.line} for p in ib.problems]
    elif kind == "ufm-telemetry":
        ufm = parse_ufm_telemetry(text, ts=now)
        records, rejected = ufm.ports, [r._asdict() for r in ufm.rejected]
    elif kind in ("dcgmi-dmon", "nvidia-smi-csv"):
        gpus = (
            parse_dcgmi_dmon(text, host=host, ts=now, ids=field_ids(argv))
            if kind == "dcgmi-dmon"
            else parse_nvidia_smi_csv(text, host=host, ts=now, properties=query_properties(argv))
        )
        records, rejected = gpus.samples, [r._asdict() for r in gpus.rejected]
        if gpus.error:
            rejected.append({"reason": gpus.error, "detail": gpus.detail})
    else:
        raise typer.BadParameter(f"unknown kind {kind!r}: ibstat, dcgmi-dmon, nvidia-smi-csv or ufm-telemetry")
    for rec in records:
        typer.echo(rec.model_dump_json())
    for r in rejected:
        typer.echo(json.dumps({"rejected": r}))
