"""``gpupool collect ...``: run the collector stage, or parse one input to see what it yields."""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
import signal
import time
from pathlib import Path
from typing import Annotated

import typer

from contracts import KafkaTopics
from contracts.bus import make_bus

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


@app.command("run")
def run(
    kafka: Annotated[str, typer.Option(help="Kafka bootstrap servers, host:port[,host:port].")],
    dcgm_target: Annotated[
        list[str] | None, typer.Option("--dcgm-target", help="dcgm-exporter /metrics URL (repeatable).")
    ] = None,
    sysfs_root: Annotated[
        list[str] | None,
        typer.Option(
            "--sysfs-root",
            help="HOST=PATH of a folder holding class/infiniband, e.g. node-1=/sys (repeatable).",
        ),
    ] = None,
    nvidia_smi: Annotated[
        list[str] | None,
        typer.Option(
            "--nvidia-smi",
            help='HOST=COMMAND printing nvidia-smi -q -x XML, e.g. node-1="nvidia-smi -q -x" (repeatable).',
        ),
    ] = None,
    nvml_host: Annotated[
        str | None, typer.Option(help="Read this machine's GPUs through NVML under this host name.")
    ] = None,
    file_sd: Annotated[
        list[Path] | None,
        typer.Option(
            "--file-sd",
            help="Prometheus file_sd JSON file of dcgm-exporter targets, re-read when it changes; "
            "the last component may be a glob, e.g. targets/*.json (repeatable).",
        ),
    ] = None,
    file_sd_refresh: Annotated[
        float, typer.Option(help="Seconds between two checks of the --file-sd files for changes.")
    ] = 5.0,
    spool_dir: Annotated[
        Path | None,
        typer.Option(
            help="Spool records here (after --spool-memory-records in memory) while Kafka is "
            "unreachable, and resume them after a restart; without it records wait for Kafka only "
            "inside aiokafka's buffer."
        ),
    ] = None,
    spool_memory_records: Annotated[
        int, typer.Option(help="Records the spool holds in memory before it writes to --spool-dir.")
    ] = 100_000,
    spool_disk_bytes: Annotated[
        int, typer.Option(help="Bytes the spool may take in --spool-dir.")
    ] = 1 << 30,
    interval: Annotated[float, typer.Option(help="Seconds between the starts of two cycles.")] = 5.0,
    timeout: Annotated[float, typer.Option(help="Deadline of one scrape, seconds.")] = 2.0,
    concurrency: Annotated[int, typer.Option(help="Scrapes in flight at most.")] = 64,
    topic_prefix: Annotated[str, typer.Option(help="Prefix of every Kafka topic name.")] = "",
    metrics_port: Annotated[int, typer.Option(help="Serve Prometheus /metrics on this port (0: off).")] = 0,
    metrics_addr: Annotated[str, typer.Option(help="Address the /metrics server binds to.")] = "127.0.0.1",
) -> None:
    """Scrape every --dcgm-target, read every --sysfs-root, run every --nvidia-smi command and read
    NVML (--nvml-host) each --interval seconds and produce GpuSample / IbPortSample records to
    Kafka until SIGINT or SIGTERM.

    Every --file-sd target is scraped at its own __scrape_interval__ and __scrape_timeout__
    (default --interval / --timeout) and its labels go into GpuSample.attributes as target_<name>.

    Exits with status 2 when no source is given, 1 when Kafka is unreachable (with --spool-dir
    records wait for Kafka instead), 1 when the --spool-dir folder is unusable.
    """
    from collectors.service import CollectorService

    targets = list(dcgm_target or [])
    roots = [_sysfs_root(s) for s in sysfs_root or []]
    commands = [_nvsmi_command(s) for s in nvidia_smi or []]
    sd_files = list(file_sd or [])
    if not targets and not roots and not commands and not nvml_host and not sd_files:
        raise typer.BadParameter(
            "give at least one --dcgm-target, --file-sd, --sysfs-root, --nvidia-smi or --nvml-host"
        )
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=metrics_addr)

    async def _main() -> None:
        bus = make_bus(kafka, client_id="gpupool-collector")
        service = CollectorService(
            bus=bus,
            topics=KafkaTopics(prefix=topic_prefix),
            dcgm_targets=targets,
            sysfs_roots=roots,
            interval_s=interval,
            timeout_s=timeout,
            concurrency=concurrency,
            nvsmi_commands=commands,
            nvml_host=nvml_host,
            file_sd=sd_files,
            file_sd_refresh_s=file_sd_refresh,
            spool_dir=spool_dir,
            spool_memory_records=spool_memory_records,
            spool_disk_bytes=spool_disk_bytes,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await service.start()
        except Exception as e:
            log.error("bus_unreachable", extra={"bootstrap": kafka, "error": repr(e)})
            await bus.close()
            raise typer.Exit(1) from e
        log.info(
            "collector_started",
            extra={
                "targets": len(service.targets.targets),
                "sysfs_roots": len(roots),
                "spool_dir": str(spool_dir) if spool_dir else None,
            },
        )
        try:
            await service.run(stop)
        finally:
            await service.stop()
            await bus.close()

    asyncio.run(_main())


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
