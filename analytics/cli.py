"""``gpupool analytics ...``: run the stage, query its DuckDB store.

``app`` is a Typer sub-application; the ``gpupool`` CLI mounts it as ``analytics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Annotated, Any

import duckdb
import typer
from rich.console import Console
from rich.table import Table

from analytics.classify import IdleConfig
from analytics.service import AnalyticsService
from analytics.store import AnalyticsStore
from contracts import KafkaTopics
from contracts.bus import make_bus

log = logging.getLogger(__name__)

app = typer.Typer(
    name="analytics", help="Telemetry → DuckDB → idle GPUs → capacity updates.", no_args_is_help=True
)


@app.command("run")
def run(
    kafka: Annotated[
        str, typer.Option(envvar="GPUPOOL_KAFKA", help="Kafka bootstrap servers host:port[,...].")
    ],
    db: Annotated[str, typer.Option(envvar="GPUPOOL_ANALYTICS_DB", help="DuckDB file (created if new).")] = (
        "gpupool-analytics.duckdb"
    ),
    metrics_port: Annotated[int, typer.Option(help="Serve Prometheus /metrics on this port (0: off).")] = 0,
    metrics_addr: Annotated[str, typer.Option(help="Address of the /metrics server.")] = "127.0.0.1",
    topic_prefix: Annotated[str, typer.Option(help="Prefix of every Kafka topic name.")] = "",
    group_id: Annotated[str, typer.Option(help="Kafka consumer group.")] = "gpupool-analytics",
    pool: Annotated[str, typer.Option(help="Pool name put on capacity updates.")] = "default",
    min_idle_s: Annotated[float, typer.Option(help="Seconds of idle samples before a GPU is idle.")] = 60.0,
    idle_threshold: Annotated[
        float, typer.Option(help="Activity ratio at or below which a sample is idle.")
    ] = 0.05,
    busy_threshold: Annotated[
        float, typer.Option(help="Activity ratio at or above which a GPU is busy.")
    ] = 0.10,
    stale_after_s: Annotated[float, typer.Option(help="A GPU not sampled this long is unknown.")] = 30.0,
    refresh_s: Annotated[
        float, typer.Option(help="Re-publish every GPU's update at least this often.")
    ] = 30.0,
    memory_limit: Annotated[str | None, typer.Option(help="DuckDB memory_limit, e.g. 2GB.")] = None,
) -> None:
    """Run the analytics stage against Kafka until SIGINT/SIGTERM.

    Exit code 2 on a bad threshold (``IdleConfig`` raises ``ValueError``); the error of the bus or
    of DuckDB (locked or incompatible file) otherwise.
    """
    try:
        idle = IdleConfig(
            idle_threshold=idle_threshold,
            busy_threshold=busy_threshold,
            min_idle_s=min_idle_s,
            stale_after_s=stale_after_s,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=metrics_addr)
    asyncio.run(_run(kafka, db, idle, KafkaTopics(topic_prefix), group_id, pool, refresh_s, memory_limit))


async def _run(
    kafka: str,
    db: str,
    idle: IdleConfig,
    topics: KafkaTopics,
    group_id: str,
    pool: str,
    refresh_s: float,
    memory_limit: str | None,
) -> None:
    bus = make_bus(kafka, client_id="gpupool-analytics")
    service = AnalyticsService(
        bus=bus,
        topics=topics,
        db_path=db,
        idle=idle,
        group_id=group_id,
        pool=pool,
        refresh_s=refresh_s,
        memory_limit=memory_limit,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await service.start()
    try:
        await service.run(stop)
    finally:
        await service.stop()
        await bus.close()


@app.command("sql")
def sql(
    query: Annotated[str, typer.Argument(help='SQL to run, e.g. "SELECT * FROM gpu_state_now".')],
    db: Annotated[str, typer.Option(envvar="GPUPOOL_ANALYTICS_DB", help="DuckDB file.")] = (
        "gpupool-analytics.duckdb"
    ),
    limit: Annotated[int, typer.Option(help="Print at most this many rows.")] = 1000,
) -> None:
    """Run one SQL query on the analytics database (read-only) and print a table.

    Tables: gpu_samples, ib_port_samples, gpu_states, idle_runs, consumer_offsets; view:
    gpu_state_now. DuckDB lets one process write a file: while ``analytics run`` holds it, this
    fails with DuckDB's lock error (exit code 1).
    """
    console = Console()
    try:
        store = AnalyticsStore(db, read_only=True)
    except duckdb.Error as exc:
        console.print(f"[red]cannot open {db}:[/red] {exc}")
        raise typer.Exit(1) from exc
    try:
        names, rows = store.sql(query)
    except duckdb.Error as exc:
        console.print(f"[red]query failed:[/red] {exc}")
        raise typer.Exit(1) from exc
    finally:
        store.close()
    table = Table(*names, title=f"{len(rows)} rows" + (f" (first {limit})" if len(rows) > limit else ""))
    for row in rows[:limit]:
        table.add_row(*(_cell(v) for v in row))
    console.print(table)


def _cell(value: Any) -> str:
    return "NULL" if value is None else str(value)
