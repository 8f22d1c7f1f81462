"""``gpupool analytics ...``: run the stage, query its DuckDB store, evaluate idle prediction on a trace.

``app`` is a Typer sub-application; the ``gpupool`` CLI mounts it as ``analytics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from pathlib import Path
from typing import Annotated, Any

import duckdb
import typer
from rich.console import Console
from rich.table import Table

from analytics.classify import IdleConfig
from analytics.evaluate import (
    TRACE_STEP_S,
    Evaluation,
    EvaluationConfig,
    TraceReadError,
    evaluate,
    read_trace,
)
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


_OFFERABLE_TARGET = 0.60
_BROKEN_TARGET = 0.05


@app.command("evaluate")
def evaluate_trace(
    trace: Annotated[
        Path,
        typer.Option(
            envvar="GPUPOOL_TRACE_DIR",
            help="Folder with the Alibaba GenAI 2026 tarballs (pod_gpu_duty_cycle_anon.tar.gz, "
            "pod_gpu_memory_used_bytes_anon.tar.gz).",
        ),
    ],
    min_idle_s: Annotated[
        float, typer.Option(help="Seconds of idle samples before a GPU is idle (57 = two samples).")
    ] = TRACE_STEP_S,
    confidence: Annotated[float, typer.Option(help="Probability a promise must hold with.")] = 0.95,
    slice_pods: Annotated[
        int | None, typer.Option(help="Replay only the first N pods (by id); default: all.")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Replay a GPU trace through the idle classifier and predictor and print, per variant, the
    share of real idle GPU-time that was offerable and the share of promised windows broken early
    (definitions: :mod:`analytics.evaluate`; targets >= 60 % offerable, <= 5 % broken).

    Exit code 2 on a bad option (``EvaluationConfig`` raises ``ValueError``), 1 when the trace is
    missing or unreadable (``FileNotFoundError``, ``TraceReadError``).
    """
    try:
        config = EvaluationConfig(min_idle_s=min_idle_s, confidence=confidence)
        if slice_pods is not None and slice_pods < 1:
            raise ValueError("--slice-pods must be >= 1")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    console = Console()
    try:
        replay = read_trace(trace, slice_pods=slice_pods)
    except (FileNotFoundError, TraceReadError) as exc:
        console.print(f"[red]cannot read the trace:[/red] {exc}")
        raise typer.Exit(1) from exc
    result = evaluate(replay.pods, config)
    if json_output:
        typer.echo(json.dumps(_evaluation_json(result, replay.pods_in_trace, replay.dropped_rows), indent=2))
        return
    console.print(_evaluation_table(result, replay.pods_in_trace, replay.dropped_rows))


def _evaluation_json(ev: Evaluation, pods_in_trace: int, dropped: dict[str, int]) -> dict[str, Any]:
    cfg = ev.config
    return {
        "config": {
            "min_idle_s": cfg.min_idle_s,
            "confidence": cfg.confidence,
            "idle_threshold": cfg.idle_threshold,
            "busy_threshold": cfg.busy_threshold,
            "stale_after_s": cfg.stale_after_s,
            "min_at_risk": cfg.min_at_risk,
        },
        "pods": ev.pods,
        "pods_in_trace": pods_in_trace,
        "samples": ev.samples,
        "idle_runs": ev.idle_runs,
        "dropped_rows": dropped,
        "targets": {"offerable_share_min": _OFFERABLE_TARGET, "broken_share_max": _BROKEN_TARGET},
        "results": [r.as_dict() for r in ev.results],
    }


def _evaluation_table(ev: Evaluation, pods_in_trace: int, dropped: dict[str, int]) -> Table:
    cfg = ev.config
    table = Table(
        title=(
            f"{ev.pods} of {pods_in_trace} pods, {ev.samples:,} samples, {ev.idle_runs:,} idle runs; "
            f"confidence {cfg.confidence:.0%}, min idle {cfg.min_idle_s:g} s"
        ),
        caption=(
            f"targets: offerable >= {_OFFERABLE_TARGET:.0%}, broken <= {_BROKEN_TARGET:.0%}"
            + (f"; rows dropped: {dropped}" if dropped else "")
        ),
    )
    for name in ("variant", "offerable %", "broken %", "promises", "mean promised window",
                 "idle GPU-hours", "targets"):
        table.add_column(name, justify="left" if name in ("variant", "targets") else "right")
    for r in ev.results:
        met = r.offerable_share >= _OFFERABLE_TARGET and r.broken_share <= _BROKEN_TARGET
        table.add_row(
            r.variant.name,
            f"{100 * r.offerable_share:.1f}",
            f"{100 * r.broken_share:.1f}",
            f"{r.promises:,}",
            f"{r.mean_promised_s / 60:.1f} min",
            f"{r.idle_gpu_hours:,.1f}",
            "met" if met else "missed",
        )
    return table
