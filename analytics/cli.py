"""``gpupool analytics ...``: run the stage, query its DuckDB store, evaluate idle prediction on a trace.

``app`` is a Typer sub-application; the ``gpupool`` CLI mounts it as ``analytics``.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import logging
import math
import re
import time
from enum import StrEnum
from pathlib import Path
from types import TracebackType
from typing import Annotated, Any

import duckdb
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from analytics.allocator import MMAP_THRESHOLD_BYTES, TRIM_THRESHOLD_BYTES, keep_freed_heap
from analytics.classify import idle_config_from
from analytics.evaluate import (
    TRACE_STEP_S,
    Evaluation,
    EvaluationConfig,
    TraceReadError,
    evaluate,
    read_trace,
)
from analytics.retention import RetentionConfig, read_watermark
from analytics.service import AnalyticsService
from analytics.store import AnalyticsStore, StoreSchemaError
from contracts import KafkaTopics
from runtime.bus import make_bus
from contracts.bus import Bus
from runtime.run_options import settings_command
from runtime.settings import DeploymentSettings, RunFlags
from runtime.stage import run_stage

log = logging.getLogger(__name__)

app = typer.Typer(
    name="analytics", help="Telemetry → DuckDB → idle GPUs → capacity updates.", no_args_is_help=True
)


RUN_FLAGS = RunFlags(
    "gpupool analytics run", "kafka", "analytics_db", "topic_prefix", "metrics.analytics", "metrics.addr",
    "analytics.*", "idle.*", "broker.lent_share_percent",
)  # fmt: skip
"""The settings fields that are options of ``gpupool analytics run`` (each field's :class:`runtime.settings.Flag`
names its option; :func:`runtime.run_options.settings_command` derives the options)."""

run_settings = RUN_FLAGS.load
"""The settings ``gpupool analytics run`` runs with (:meth:`runtime.settings.RunFlags.load`)."""


@settings_command(
    app,
    "run",
    RUN_FLAGS,
    help="Run the analytics stage until Ctrl-C or SIGTERM: read GPU and InfiniBand telemetry from "
    "Kafka into a DuckDB file, decide which GPUs are idle, and publish capacity updates.\n\n"
    "Each option not given as a flag comes from its GPUPOOL_* variable, then the --config file, "
    "then the default (the setting is named after each option). While it runs, no other process "
    "can open the DuckDB file (gpupool analytics sql, maintain, report): stop it first, or work "
    "on a copy made while it was stopped.\n\n"
    "Exit code 2 on invalid settings, no Kafka configured or thresholds that do not fit together "
    "(idle must be below busy); 1 when Kafka cannot be reached, a topic is missing, the metrics "
    "port cannot be bound or the DuckDB file cannot be opened.",
)
def run(settings: DeploymentSettings) -> None:
    """Run the analytics stage against Kafka until SIGINT/SIGTERM (:func:`runtime.stage.run_stage`).

    Every option can also come from the deployment's settings (runtime/settings.py): a flag
    wins over its GPUPOOL_* variable (e.g. GPUPOOL_KAFKA, GPUPOOL_ANALYTICS_DB,
    GPUPOOL_IDLE__MIN_IDLE_S), which wins over the --config TOML file (kafka, analytics_db,
    the idle, analytics and metrics tables), which wins over the defaults.

    Exit code 2 on invalid settings, no Kafka configured, or a bad threshold (``IdleConfig``
    raises ``ValueError``); 1 when a start fails (Kafka unreachable, a topic missing, the DuckDB
    file locked or incompatible) or the /metrics port cannot be bound.
    """
    assert settings.kafka is not None  # settings_command guarantees it
    kafka, s_idle = settings.kafka, settings.idle
    try:
        idle = idle_config_from(s_idle)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    held = keep_freed_heap()
    log.info(
        "allocator_settings",
        extra={"set": held, "mmap_threshold_bytes": MMAP_THRESHOLD_BYTES, "trim_threshold_bytes": TRIM_THRESHOLD_BYTES},
    )

    def build() -> tuple[AnalyticsService, Bus]:
        bus = make_bus(kafka, client_id="gpupool-analytics")
        service = AnalyticsService(
            bus=bus,
            topics=KafkaTopics(settings.topic_prefix),
            db_path=str(settings.analytics_db),
            idle=idle,
            group_id=settings.analytics.group_id,
            pool=s_idle.pool,
            refresh_s=s_idle.refresh_s,
            memory_limit=settings.analytics.memory_limit,
            lent_share=settings.broker.lent_share_percent / 100.0,
            max_uplink_xmit_wait=settings.analytics.max_uplink_xmit_wait,
            forget_after_s=s_idle.forget_after_s,
            scheduler=settings.analytics.scheduler,
            plan_lead_s=settings.analytics.plan_lead_s,
        )
        return service, bus

    metrics = settings.metrics
    run_stage("gpupool analytics run", build, metrics_port=metrics.analytics, metrics_addr=metrics.addr)


class OutputFormat(StrEnum):
    """``--format`` of ``gpupool analytics sql``: ``table`` for people (rich; long cells may be
    wrapped), ``csv`` (RFC 4180, a header row) and ``json`` (a list of objects) for scripts."""

    TABLE = "table"
    CSV = "csv"
    JSON = "json"


_TABLE_LIMIT = 1000


@app.command(
    "sql",
    help="Run one read-only SQL query on the analytics DuckDB file and print the result.\n\n"
    "Tables: gpu_samples, ib_port_samples, gpu_states, idle_runs, gpu_rollup_1m, "
    "ib_port_rollup_1m, scheduler_gpu_samples, committed_offsets, kafka_sources; views: "
    "consumer_offsets, gpu_state_now, idle_windows, ib_port_intervals, "
    "fabric_headroom (README, section SQL views).\n\n"
    "DuckDB lets no other process open a file while `gpupool analytics run` writes it: stop the "
    "stage first, or copy the file while the stage is stopped and query the copy with --db. "
    "Exit code 1 when the file cannot be opened (locked, missing) or the query fails.",
)
def sql(
    query: Annotated[str, typer.Argument(help='SQL to run, e.g. "SELECT * FROM gpu_state_now".')],
    db: Annotated[str, typer.Option(envvar="GPUPOOL_ANALYTICS_DB", help="DuckDB file.")] = (
        "gpupool-analytics.duckdb"
    ),
    output_format: Annotated[
        OutputFormat,
        typer.Option(
            "--format",
            help="table: for reading (default); csv: a header row, NULL as an empty field; json: a "
            "list of objects, NULL as null. csv and json print every value in full.",
        ),
    ] = OutputFormat.TABLE,
    limit: Annotated[
        int | None,
        typer.Option(
            min=0,
            help=f"Print at most this many rows (default: {_TABLE_LIMIT} for table, every row for "
            "csv and json).",
        ),
    ] = None,
) -> None:
    """Run one SQL query on the analytics database (read-only) and print it as ``output_format``.

    ``csv``: :mod:`csv` (excel dialect, RFC 4180) with a header row of the column names; NULL is
    an empty field, LIST/STRUCT/MAP values are their JSON text, others ``str()``.
    ``json``: one array of objects (column name -> value), see :func:`_json_value` for the
    types. A query that returns no result set prints nothing (csv/json) or an empty table.

    Exit code 1 when the file cannot be opened — a file locked by a running stage gets the message
    of :func:`lock_holder_message` — or when the query fails (DuckDB's message).
    """
    err = Console(stderr=True)
    try:
        store = AnalyticsStore(db, read_only=True)
    except (duckdb.Error, StoreSchemaError) as exc:
        err.print(f"cannot open {db}: {lock_holder_message(exc) or exc}", markup=False, highlight=False)
        raise typer.Exit(1) from exc
    try:
        names, rows = store.sql(query)
    except duckdb.Error as exc:
        err.print(f"query failed: {exc}", markup=False, highlight=False)
        raise typer.Exit(1) from exc
    finally:
        store.close()
    cap = limit if limit is not None else (_TABLE_LIMIT if output_format is OutputFormat.TABLE else None)
    shown = rows if cap is None else rows[:cap]
    if output_format is OutputFormat.CSV:
        _print_csv(names, shown)
    elif output_format is OutputFormat.JSON:
        typer.echo(json.dumps([dict(zip(names, map(_json_value, row), strict=True)) for row in shown],
                              indent=1, ensure_ascii=False, allow_nan=False))
    else:
        title = f"{len(rows)} rows" + (f" (first {cap})" if cap is not None and len(rows) > cap else "")
        table = Table(*names, title=title)
        for row in shown:
            table.add_row(*(_cell(v) for v in row))
        Console().print(table)
    if len(shown) < len(rows) and output_format is not OutputFormat.TABLE:
        err.print(f"printed {len(shown)} of {len(rows)} rows (--limit)", markup=False, highlight=False)


_LOCK_PID = re.compile(r"Conflicting lock is held in (?P<exe>.*?) \(PID (?P<pid>\d+)\)")


def lock_holder_message(exc: BaseException) -> str | None:
    """The operator's explanation of DuckDB's "Could not set lock on file" error, or ``None`` when
    ``exc`` is another error.

    DuckDB (``duckdb.IOException``, message ``... Conflicting lock is held in <exe> (PID <n>) ...``)
    lets one process open a file read-write and no other process open it at all meanwhile; the
    returned text names the PID and what to do: ``the store is locked by a running analytics
    stage (PID n): ...``.
    """
    text = str(exc)
    if "Could not set lock" not in text:
        return None
    m = _LOCK_PID.search(text)
    pid = f" (PID {m.group('pid')})" if m else ""
    return (
        f"the store is locked by a running analytics stage{pid}: DuckDB lets no other process open a "
        "file while `gpupool analytics run` writes it. Stop the stage and query the file, or copy it "
        "while the stage is stopped (cp FILE COPY), start the stage again, and query the copy with "
        f"--db COPY. DuckDB said: {text}"
    )


def _print_csv(names: list[str], rows: list[tuple[Any, ...]]) -> None:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(names)
    for row in rows:
        writer.writerow(_csv_value(v) for v in row)
    typer.echo(out.getvalue(), nl=False)


def _csv_value(value: Any) -> Any:
    """One CSV field: ``""`` for NULL, JSON text for LIST/STRUCT/MAP values, else the value."""
    if value is None:
        return ""
    if isinstance(value, list | dict | tuple):
        return json.dumps(_json_value(value), ensure_ascii=False, allow_nan=False)
    return value


def _json_value(value: Any) -> Any:
    """A DuckDB value as JSON: numbers and strings as they are (HUGEINT in full), NULL as null,
    non-finite floats as the strings ``"NaN"``/``"Infinity"``/``"-Infinity"``, DECIMAL as its exact
    text, TIMESTAMP/DATE/TIME as ISO 8601, INTERVAL as seconds, UUID as text, BLOB as hex;
    LIST/STRUCT/MAP recursively."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else ("NaN" if math.isnan(value) else
                                                  ("Infinity" if value > 0 else "-Infinity"))
    if isinstance(value, dt.datetime | dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    return str(value)  # Decimal, UUID, ...


def _cell(value: Any) -> str:
    return "NULL" if value is None else str(value)


_RETENTION = RetentionConfig()


@app.command(
    "maintain",
    help="Catch up rollups and retention of a big analytics store by hand: roll every complete "
    "minute up into gpu_rollup_1m / ib_port_rollup_1m and delete expired rows, one transaction per "
    "--step-s of data, until nothing is left to roll up. The running stage does the same every "
    "minute; use this after a first start on a full file, a replay or a long stop.\n\n"
    "Stop `gpupool analytics run` on the file first (DuckDB lets only one process open it). "
    "Prints the rows rolled up and expired per table. Exit code 2 on a bad option, 1 when the file "
    "cannot be opened or a transaction fails (that step is rolled back; the steps before it stay).",
)
def maintain_store(
    db: Annotated[str, typer.Option(envvar="GPUPOOL_ANALYTICS_DB", help="DuckDB file.")] = (
        "gpupool-analytics.duckdb"
    ),
    raw_retention_s: Annotated[
        float, typer.Option(help="Keep raw samples this long, seconds (0: forever).")
    ] = _RETENTION.raw_retention_s or 0.0,
    rollup_retention_s: Annotated[
        float,
        typer.Option(help="Keep 1-minute rollups, transitions and idle runs this long, s (0: forever)."),
    ] = _RETENTION.rollup_retention_s or 0.0,
    delay_s: Annotated[
        float, typer.Option(help="Roll up a minute once it ended this long ago (allowed lateness), s.")
    ] = _RETENTION.delay_s,
    step_s: Annotated[
        float, typer.Option(help="Data time rolled up per transaction, seconds (>= 60).")
    ] = _RETENTION.max_rollup_s,
    now: Annotated[
        float | None, typer.Option(help="The current time, Unix s (default: the clock); for replays.")
    ] = None,
    progress: _Progress = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Catch up the retention of an analytics store by hand: roll up every complete minute into
    gpu_rollup_1m / ib_port_rollup_1m and delete expired rows (analytics/retention.py), one
    transaction per --step-s of data, until nothing is left to roll up.

    The service does the same every minute, a step at a time; this command is for a big store
    (a first start on a full file, a replay, a long stop), with progress in minutes rolled up.
    DuckDB lets one process write a file: stop `analytics run` on it first, or this fails with
    DuckDB's lock error. Prints rows rolled up and expired per table. Exit code 2 on a bad option
    (RetentionConfig refuses it), 1 when the file cannot be opened or a transaction fails
    (that step is rolled back; the ones before it stay).
    """
    try:
        config = RetentionConfig(
            raw_retention_s=raw_retention_s or None,
            rollup_retention_s=rollup_retention_s or None,
            delay_s=delay_s,
            max_rollup_s=step_s,
        )
        if now is not None and not math.isfinite(now):
            raise ValueError("--now must be a finite Unix time")
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    at = time.time() if now is None else now
    err = Console(stderr=True)
    try:
        store = AnalyticsStore(db)
    except (duckdb.Error, StoreSchemaError) as exc:
        err.print(f"cannot open {db}: {lock_holder_message(exc) or exc}", markup=False, highlight=False)
        raise typer.Exit(1) from exc
    rolled: dict[str, int] = {}
    expired: dict[str, int] = {}
    steps = 0
    try:
        start, end = _rollup_span(store, at - delay_s)
        total = max(0, round((end - start) / 60)) if start is not None else 0
        with _ProgressReport("maintain", progress) as report:
            report("roll up minutes", 0, total)
            while True:
                result = store.maintain(config, at)
                steps += 1
                for table, n in result.rollup_rows.items():
                    rolled[table] = rolled.get(table, 0) + n
                for table, n in result.expired_rows.items():
                    expired[table] = expired.get(table, 0) + n
                if result.rolled_to is None or start is None:
                    break
                report("roll up minutes", min(total, round((result.rolled_to - start) / 60)), total)
            report("roll up minutes", total, total)
    except duckdb.Error as exc:
        err.print(f"[red]maintenance failed (step {steps + 1} rolled back):[/red] {exc}")
        raise typer.Exit(1) from exc
    finally:
        store.close()
    summary = {"transactions": steps, "minutes": total, "rollup_rows": rolled, "expired_rows": expired}
    log.info("store_maintained", extra=summary)
    if json_output:
        typer.echo(json.dumps(summary, indent=2))
        return
    summary_table = Table("table", "rows rolled up", "rows expired", title=f"{total} minutes in {steps} transactions")
    for name in sorted(set(rolled) | set(expired)):
        summary_table.add_row(name, str(rolled.get(name, 0)), str(expired.get(name, 0)))
    Console().print(summary_table)


def _rollup_span(store: AnalyticsStore, until: float) -> tuple[float | None, float]:
    """``(first, last)`` Unix s of what is left to roll up: the first minute holding a raw row at
    or after the rollup watermark (``None``: nothing), and the last complete minute before
    ``until``. Raises ``duckdb.Error``."""
    watermark = read_watermark(store.cursor())
    _, rows = store.sql(
        "SELECT epoch(least((SELECT min(ts) FROM gpu_samples WHERE ts >= make_timestamp($1)), "
        "(SELECT min(ts) FROM ib_port_samples WHERE ts >= make_timestamp($1))))",
        [round((watermark or 0.0) * 1e6)],
    )
    first = rows[0][0] if rows and rows[0][0] is not None else None
    end = math.floor(until / 60) * 60.0
    if first is None or first >= end:
        return None, end
    return math.floor(float(first) / 60) * 60.0, end


_Progress = Annotated[
    bool | None,
    typer.Option(
        "--progress/--no-progress",
        help="Show a progress bar on stderr (default: when stderr is a terminal); otherwise "
        "progress goes to the JSON log, event 'progress' at INFO (gpupool --log-level INFO).",
    ),
]


class _ProgressReport:
    """Progress of long work, shown as a rich progress bar on stderr when ``show`` (``None``:
    when stderr is a terminal), else logged as JSON lines (event ``progress``, fields ``work``,
    ``step``, ``done``, ``total``) at each step's start, every 10 % and its end.

    Use as a context manager; call it as a ``(step, done, total)`` progress callback
    (:data:`analytics.evaluate.ProgressFn`): a new ``step`` starts a new bar."""

    def __init__(self, work: str, show: bool | None) -> None:
        self.work = work
        self.console = Console(stderr=True)
        self.show = self.console.is_terminal if show is None else show
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._step: str | None = None
        self._logged_tenth = -1

    def __enter__(self) -> _ProgressReport:
        if self.show:
            self._bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._bar.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._bar is not None:
            self._bar.__exit__(exc_type, exc, tb)

    def __call__(self, step: str, done: int, total: int) -> None:
        """Record that ``done`` of ``total`` units of ``step`` are done."""
        if step != self._step:
            self._step, self._logged_tenth = step, -1
            if self._bar is not None:
                if self._task is not None:
                    self._bar.update(self._task, visible=False)
                self._task = self._bar.add_task(step, total=total)
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=done, total=total)
            return
        tenth = 10 if total <= 0 else (10 * done) // total
        if tenth > self._logged_tenth or done == 0:
            self._logged_tenth = tenth
            log.info("progress", extra={"work": self.work, "step": step, "done": done, "total": total})


_OFFERABLE_TARGET = 0.60
_BROKEN_TARGET = 0.05


@app.command(
    "evaluate",
    help="Score idle-time prediction on a real GPU trace: replay the Alibaba GenAI 2026 trace "
    "through gpupool's idle detection and prediction and print, per prediction variant, the share "
    "of the real idle GPU-time that could have been offered and the share of promised idle windows "
    "that ended early (targets: at least 60 % offerable, at most 5 % broken; definitions in the "
    "README, section Predicted idle windows).\n\n"
    "The full trace (143 pods) takes about 15-20 s on two cores; progress shows on stderr "
    "(--progress) or goes to the JSON log.\n\n"
    "Exit code 2 on a bad option, 1 when the trace is missing or unreadable.",
)
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
    progress: _Progress = None,
) -> None:
    """Replay a GPU trace through the idle classifier and predictor and print, per variant, the
    share of real idle GPU-time that was offerable and the share of promised windows broken early
    (definitions: :mod:`analytics.evaluate`; targets >= 60 % offerable, <= 5 % broken).

    Reading the trace, classifying and scoring take about a minute on the full trace: progress
    shows on stderr (--progress), or goes to the JSON log.

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
    with _ProgressReport("evaluate", progress) as report:
        try:
            replay = read_trace(trace, slice_pods=slice_pods, on_progress=report)
        except (FileNotFoundError, TraceReadError) as exc:
            report.console.print(f"[red]cannot read the trace:[/red] {exc}")
            raise typer.Exit(1) from exc
        result = evaluate(replay.pods, config, on_progress=report)
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
