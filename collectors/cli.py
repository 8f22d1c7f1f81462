"""``gpupool collect ...``: run the collector stage, or parse one input to see what it yields."""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from contracts import KafkaTopics
from runtime.bus import make_bus
from runtime.run_options import (
    ConfigOption,
    KafkaOption,
    MetricsAddrOption,
    TopicPrefixOption,
    exit_on_missing_topics,
    load_run_settings,
    metrics_port_option,
)
from runtime.settings import CollectorsSettings, RunFlags

if TYPE_CHECKING:
    from collectors.fabric_collector import FabricCollector
    from prometheus_client import CollectorRegistry
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


RUN_SETTINGS: dict[str, str] = {
    "kafka": "kafka",
    "topic_prefix": "topic_prefix",
    "dcgm_target": "collectors.dcgm_targets",
    "sysfs_root": "collectors.sysfs_roots",
    "nvidia_smi": "collectors.nvidia_smi",
    "ufm_telemetry": "collectors.ufm_telemetry",
    "nvml_host": "collectors.nvml_host",
    "file_sd": "collectors.file_sd",
    "file_sd_refresh": "collectors.file_sd_refresh_s",
    "spool_dir": "collectors.spool_dir",
    "spool_memory_records": "collectors.spool_memory_records",
    "spool_disk_bytes": "collectors.spool_disk_bytes",
    "interval": "collectors.interval_s",
    "timeout": "collectors.timeout_s",
    "concurrency": "collectors.concurrency",
    "fabric": "collectors.fabric",
    "fabric_interval": "collectors.fabric_interval_s",
    "fabric_discover_every": "collectors.fabric_discover_every",
    "fabric_concurrency": "collectors.fabric_concurrency",
    "fabric_timeout": "collectors.fabric_timeout_s",
    "slurm_conf": "collectors.slurm_conf",
    "slurm_interval": "collectors.slurm_interval_s",
    "metrics_port": "metrics.collectors",
    "metrics_addr": "metrics.addr",
}
"""Parameter of ``run`` → the :class:`runtime.settings.DeploymentSettings` field it sets."""


_RUN = RunFlags("gpupool collect run", RUN_SETTINGS)
run_settings = _RUN.load
"""The settings ``gpupool collect run`` runs with (:meth:`runtime.settings.RunFlags.load`)."""
_setting = _RUN.help


@app.command("run")
def run(
    config: ConfigOption = None,
    kafka: KafkaOption = None,
    dcgm_target: Annotated[
        list[str] | None,
        typer.Option(
            "--dcgm-target", help="dcgm-exporter /metrics URL (repeatable)." + _setting("dcgm_target")
        ),
    ] = None,
    sysfs_root: Annotated[
        list[str] | None,
        typer.Option(
            "--sysfs-root",
            help="HOST=PATH of a folder holding class/infiniband, e.g. node-1=/sys (repeatable)."
            + _setting("sysfs_root"),
        ),
    ] = None,
    nvidia_smi: Annotated[
        list[str] | None,
        typer.Option(
            "--nvidia-smi",
            help='HOST=COMMAND printing nvidia-smi -q -x XML, e.g. node-1="nvidia-smi -q -x", or a CSV '
            'query, e.g. node-1="nvidia-smi --query-gpu=index,uuid,utilization.gpu,memory.used,memory.total '
            '--format=csv,noheader,nounits" (repeatable).' + _setting("nvidia_smi"),
        ),
    ] = None,
    ufm_telemetry: Annotated[
        list[str] | None,
        typer.Option(
            "--ufm-telemetry",
            help="UFM Telemetry Prometheus endpoint URL: InfiniBand port counters of the fabric "
            "(repeatable)." + _setting("ufm_telemetry"),
        ),
    ] = None,
    nvml_host: Annotated[
        str | None,
        typer.Option(
            help="Read this machine's GPUs through NVML under this host name." + _setting("nvml_host")
        ),
    ] = None,
    file_sd: Annotated[
        list[Path] | None,
        typer.Option(
            "--file-sd",
            help="Prometheus file_sd JSON file of dcgm-exporter targets, re-read when it changes; "
            "the last component may be a glob, e.g. targets/*.json (repeatable)." + _setting("file_sd"),
        ),
    ] = None,
    file_sd_refresh: Annotated[
        float | None,
        typer.Option(
            help="Seconds between two checks of the --file-sd files for changes (default 5)."
            + _setting("file_sd_refresh")
        ),
    ] = None,
    spool_dir: Annotated[
        Path | None,
        typer.Option(
            help="Spool records here (after --spool-memory-records in memory) while Kafka is "
            "unreachable, and resume them after a restart; without it records wait for Kafka only "
            "inside aiokafka's buffer." + _setting("spool_dir")
        ),
    ] = None,
    spool_memory_records: Annotated[
        int | None,
        typer.Option(
            help="Records the spool holds in memory before it writes to --spool-dir (default 100000)."
            + _setting("spool_memory_records")
        ),
    ] = None,
    spool_disk_bytes: Annotated[
        int | None,
        typer.Option(
            help="Bytes the spool may take in --spool-dir (default 1 GiB)." + _setting("spool_disk_bytes")
        ),
    ] = None,
    interval: Annotated[
        float | None,
        typer.Option(help="Seconds between the starts of two cycles (default 5)." + _setting("interval")),
    ] = None,
    timeout: Annotated[
        float | None, typer.Option(help="Deadline of one scrape, seconds (default 2)." + _setting("timeout"))
    ] = None,
    concurrency: Annotated[
        int | None, typer.Option(help="Scrapes in flight at most (default 64)." + _setting("concurrency"))
    ] = None,
    fabric: Annotated[
        bool | None,
        typer.Option(
            "--fabric/--no-fabric",
            help="Also run the switch-side fabric collector: ibnetdiscover -p (topology to "
            "fabric.topology) and perfquery -x on every switch and HCA port (to telemetry.ib_port). "
            "On one host per fabric whose HCA reaches the subnet (a /dev/infiniband/umad* device, "
            "infiniband-diags installed); default off." + _setting("fabric"),
        ),
    ] = None,
    fabric_interval: Annotated[
        float | None,
        typer.Option(
            help="Seconds between the starts of two fabric sweeps (default 30)." + _setting("fabric_interval")
        ),
    ] = None,
    fabric_discover_every: Annotated[
        int | None,
        typer.Option(
            help="Re-discover the fabric's topology every Nth sweep (default 10)."
            + _setting("fabric_discover_every")
        ),
    ] = None,
    fabric_concurrency: Annotated[
        int | None,
        typer.Option(help="perfquery processes at once (default 8)." + _setting("fabric_concurrency")),
    ] = None,
    fabric_timeout: Annotated[
        float | None,
        typer.Option(
            help="Deadline of one perfquery run, seconds (default 5)." + _setting("fabric_timeout")
        ),
    ] = None,
    slurm_conf: Annotated[
        Path | None,
        typer.Option(
            help="Read this Slurm cluster (its slurm.conf) every --slurm-interval: nodes, GPUs by "
            "GRES index and job, pending jobs with their planned start -> telemetry.scheduler."
            + _setting("slurm_conf")
        ),
    ] = None,
    slurm_interval: Annotated[
        float | None,
        typer.Option(help="Seconds between two reads of Slurm (default 10)." + _setting("slurm_interval")),
    ] = None,
    topic_prefix: TopicPrefixOption = None,
    metrics_port: Annotated[int | None, metrics_port_option("collectors", 9410)] = None,
    metrics_addr: MetricsAddrOption = None,
) -> None:
    """Scrape every dcgm-exporter and UFM Telemetry target, read every sysfs root, run every
    nvidia-smi command (-q -x XML or a --query-gpu CSV query) and read NVML each interval and
    produce GpuSample / NvSwitchSample / IbPortSample records to Kafka until SIGINT or SIGTERM.
    With --slurm-conf, also read that Slurm cluster every --slurm-interval and produce one
    SchedulerNode record per node to telemetry.scheduler (a failing scontrol fails that read only).

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

    settings = load_run_settings(
        _RUN,
        config,
        kafka=kafka,
        topic_prefix=topic_prefix,
        dcgm_target=dcgm_target,
        sysfs_root=sysfs_root,
        nvidia_smi=nvidia_smi,
        ufm_telemetry=ufm_telemetry,
        nvml_host=nvml_host,
        file_sd=file_sd,
        file_sd_refresh=file_sd_refresh,
        spool_dir=spool_dir,
        spool_memory_records=spool_memory_records,
        spool_disk_bytes=spool_disk_bytes,
        interval=interval,
        timeout=timeout,
        concurrency=concurrency,
        fabric=fabric,
        fabric_interval=fabric_interval,
        fabric_discover_every=fabric_discover_every,
        fabric_concurrency=fabric_concurrency,
        fabric_timeout=fabric_timeout,
        slurm_conf=slurm_conf,
        slurm_interval=slurm_interval,
        metrics_port=metrics_port,
        metrics_addr=metrics_addr,
    )
    bootstrap = settings.kafka
    cs = settings.collectors
    targets = list(cs.dcgm_targets)
    roots = [_sysfs_root(s) for s in cs.sysfs_roots]
    commands = [_nvsmi_command(s) for s in cs.nvidia_smi]
    sd_files = list(cs.file_sd)
    ufm = list(cs.ufm_telemetry)
    has_gpu_source = targets or roots or commands or cs.nvml_host or sd_files or ufm or cs.fabric
    if not has_gpu_source and cs.slurm_conf is None:
        raise typer.BadParameter(
            "give at least one --dcgm-target, --file-sd, --sysfs-root, --nvidia-smi, --ufm-telemetry, "
            "--nvml-host, --fabric or --slurm-conf (or [collectors] dcgm_targets, file_sd, sysfs_roots, "
            "nvidia_smi, ufm_telemetry, nvml_host, fabric, slurm_conf in the settings)"
        )
    from collectors.metrics import CollectorMetrics

    metrics = CollectorMetrics()
    _serve_metrics(settings.metrics.collectors, settings.metrics.addr, metrics.registry)

    async def _main() -> None:
        bus = make_bus(bootstrap, client_id="gpupool-collector")
        topics = KafkaTopics(prefix=settings.topic_prefix)
        service = CollectorService(
            bus=bus,
            topics=topics,
            dcgm_targets=targets,
            sysfs_roots=roots,
            interval_s=cs.interval_s,
            timeout_s=cs.timeout_s,
            concurrency=cs.concurrency,
            nvsmi_commands=commands,
            ufm_targets=ufm,
            nvml_host=cs.nvml_host,
            file_sd=sd_files,
            file_sd_refresh_s=cs.file_sd_refresh_s,
            spool_dir=cs.spool_dir,
            spool_memory_records=cs.spool_memory_records,
            spool_disk_bytes=cs.spool_disk_bytes,
            fabric=_fabric_collector(bus, topics, cs, metrics.registry),
            fabric_interval_s=cs.fabric_interval_s,
            fabric_discover_every=cs.fabric_discover_every,
            forget_after_s=cs.forget_after_s,
            metrics=metrics,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        slurm = _slurm_collector(bus, service.topics, cs.slurm_conf, service.registry)
        try:
            async with exit_on_missing_topics("gpupool collect run", bus):
                await service.start()
                if slurm is not None:
                    await slurm.start()
        except typer.Exit:
            raise
        except Exception as e:
            log.error("bus_unreachable", extra={"bootstrap": bootstrap, "error": repr(e)})
            await bus.close()
            raise typer.Exit(1) from e
        log.info(
            "collector_started",
            extra={
                "targets": len(service.targets.targets),
                "sysfs_roots": len(roots),
                "fabric": cs.fabric,
                "spool_dir": str(cs.spool_dir) if cs.spool_dir else None,
                "config": str(settings.config) if settings.config else None,
            },
        )
        try:
            await asyncio.gather(
                service.run(stop) if has_gpu_source else stop.wait(),
                *([slurm.run(cs.slurm_interval_s, stop)] if slurm is not None else []),
            )
        finally:
            if slurm is not None:
                await slurm.stop()
            await service.stop()
            await bus.close()

    asyncio.run(_main())


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


def _slurm_collector(
    bus: Any, topics: KafkaTopics, slurm_conf: Path | None, registry: CollectorRegistry | None = None
) -> Any:
    """The Slurm source (:class:`collectors.slurm_collector.SlurmCollector`) for ``slurm_conf``
    (its metrics on ``registry``; ``None``: one of its own), ``None`` without one."""
    if slurm_conf is None:
        return None
    from collectors.metrics import SlurmMetrics
    from collectors.slurm_collector import SlurmCollector

    return SlurmCollector(bus, topics, slurm_conf=slurm_conf, metrics=SlurmMetrics(registry))


def _serve_metrics(port: int, addr: str, registry: CollectorRegistry) -> None:
    """Start the Prometheus /metrics server of ``registry`` (port 0: none). Exit 1 with a message
    when the port cannot be bound (in use, or an address this host does not have)."""
    if not port:
        return
    from prometheus_client import start_http_server

    try:
        start_http_server(port, addr=addr, registry=registry)
    except OSError as e:
        typer.echo(f"gpupool collect run: cannot serve /metrics on {addr}:{port}: {e}", err=True)
        raise typer.Exit(1) from None


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
