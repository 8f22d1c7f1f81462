"""``gpupool report``: the command (a plain function; :mod:`gpupool.cli` registers it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated

import duckdb
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from contracts import KafkaTopics, LeaseLogRecord
from gpupool.report.leases import load_jsonl, read_from_bus
from runtime.bus import make_bus


def report(
    db: Annotated[
        Path,
        typer.Option(
            envvar="GPUPOOL_ANALYTICS_DB",
            help="Analytics DuckDB file, opened read-only. DuckDB lets no other process open a file "
            "that `gpupool analytics run` is writing: stop it, or report on a copy.",
        ),
    ] = Path("gpupool-analytics.duckdb"),
    out: Annotated[Path, typer.Option(help="HTML file to write (one self-contained file).")] = Path(
        "gpupool-report.html"
    ),
    leases: Annotated[
        Path | None,
        typer.Option(
            help="Lease log as JSON lines, one lease-log record (as on the leases.log topic) per line; "
            "the demo writes <state-dir>/leases-<run>.jsonl.",
        ),
    ] = None,
    kafka: Annotated[
        str | None,
        typer.Option(
            help="Read the lease log from Kafka instead (bootstrap host:port[,...]): the topic "
            "leases.log, from its first record to its end at the start of the report. Only reads.",
        ),
    ] = None,
    topic_prefix: Annotated[str, typer.Option(help="Kafka topic prefix (with --kafka).")] = "",
    kafka_timeout: Annotated[
        float, typer.Option(help="Seconds to read the lease log to its end (with --kafka).")
    ] = 30.0,
    title: Annotated[str, typer.Option(help="Page title.")] = "gpupool report",
    max_columns: Annotated[int, typer.Option(min=10, help="Most time buckets per heatmap.")] = 400,
    max_idle_windows: Annotated[int, typer.Option(min=1, help="Newest idle windows drawn.")] = 5000,
) -> None:
    """Write one self-contained HTML file (it opens without network) with plots of what gpupool
    saw and did: GPU utilisation per GPU over time; idle windows, predicted against real; leases
    and their reclaims (with --leases or --kafka); InfiniBand link headroom per port.

    The DuckDB file is only read, but no process can open it while `gpupool analytics run` writes
    it: stop the stage, or report on a copy made while it was stopped. --kafka only reads the lease
    log. Exit code 1 when the database or the lease log cannot be read or Kafka does not answer;
    2 on bad options.
    \f
    Developer notes (not shown by ``--help``): plots are plotly figures
    (:mod:`gpupool.report.figures`, plotly.js inlined by :mod:`gpupool.report.page`) built from the
    read-only queries of :mod:`gpupool.report.data`; headroom is ``1 - 4·ΔPortXmitData / (Δt·rate)``.
    The lease log comes from :func:`gpupool.report.leases.load_jsonl` or
    :func:`gpupool.report.leases.read_from_bus` (end offsets; writes nothing). Errors: the database
    (``FileNotFoundError``, ``ReportDataError``, ``duckdb.Error``), the lease log (``OSError``,
    ``UnicodeDecodeError``, ``TimeoutError``, ``ConnectionError``) and the output (``OSError``)
    become exit code 1.
    """
    if leases is not None and kafka is not None:
        raise typer.BadParameter("give --leases or --kafka, not both", param_hint="--leases/--kafka")
    err = Console(stderr=True)
    from gpupool.report.build import STEPS, ReportOptions, build_report  # plotly: loaded only here
    from gpupool.report.data import ReportDataError

    records: list[LeaseLogRecord] | None = None
    rejected = 0
    source: str | None = None
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as progress:
        task = progress.add_task("read lease log", total=len(STEPS) + 1)
        try:
            if leases is not None:
                records, rejected = load_jsonl(leases)
                source = str(leases)
            elif kafka is not None:
                topic = KafkaTopics(topic_prefix).leases_log
                records, rejected = asyncio.run(_read_kafka(kafka, topic, kafka_timeout))
                source = f"{topic} on {kafka}"
        except (OSError, UnicodeDecodeError, TimeoutError) as exc:
            err.print(f"[red]cannot read the lease log:[/red] {exc}")
            raise typer.Exit(1) from exc
        progress.advance(task)

        first = [True]

        def on_step(name: str) -> None:  # advance past the step before, then show this one
            if not first[0]:
                progress.advance(task)
            first[0] = False
            progress.update(task, description=name)

        try:
            summary = build_report(
                db,
                out,
                lease_records=records,
                options=ReportOptions(
                    title=title,
                    max_columns=max_columns,
                    max_idle_windows=max_idle_windows,
                    lease_source=source,
                    leases_rejected=rejected,
                ),
                on_step=on_step,
            )
        except (FileNotFoundError, ReportDataError, duckdb.Error) as exc:
            err.print(f"[red]cannot read {db}:[/red] {exc}")
            raise typer.Exit(1) from exc
        except OSError as exc:
            err.print(f"[red]cannot write {out}:[/red] {exc}")
            raise typer.Exit(1) from exc
        progress.advance(task)
    leases_text = (
        "no lease log"
        if summary.leases is None
        else f"{summary.leases} leases ({summary.reclaims} reclaimed)"
    )
    typer.echo(
        f"wrote {out} ({summary.bytes_written / 1e6:.1f} MB, {summary.seconds:.1f} s): {summary.gpus} GPUs, "
        f"{summary.idle_windows} idle windows, {leases_text}, {summary.ports} IB ports"
        + (f"; {rejected} lease log records rejected" if rejected else "")
    )


async def _read_kafka(bootstrap: str, topic: str, timeout_s: float) -> tuple[list[LeaseLogRecord], int]:
    """Read the lease log from Kafka; a Kafka error becomes a ``ConnectionError``."""
    from aiokafka.errors import KafkaError

    bus = make_bus(bootstrap, client_id="gpupool-report")
    try:
        return await read_from_bus(bus, topic, timeout_s=timeout_s)
    except KafkaError as exc:
        raise ConnectionError(f"Kafka at {bootstrap}: {exc}") from exc
    finally:
        await bus.close()
