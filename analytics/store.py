"""The analytics store: telemetry rows, decisions and consumer offsets in one DuckDB database.

Exactly-once groundwork: :meth:`AnalyticsStore.write` commits a batch's rows *and* the offsets
after them in one transaction, so after a crash :meth:`AnalyticsStore.stored_offsets` says where
to resume and no row is lost or stored twice. Raw rows carry their record's Kafka position, so a
batch whose rows already say where the next one starts writes no offsets of its own
(:mod:`analytics.offsets`). Inserts are batched through Arrow
(``INSERT INTO t (<the Arrow table's columns>) SELECT * FROM <registered arrow table>``: columns
matched by name), never row by row; a batch of one statement runs without an explicit
transaction (a statement is atomic by itself).

DuckDB allows one writer process per database file; inside the process this class owns one
connection, used by one thread at a time. Another thread reads through :meth:`cursor`.

Memory: the ``memory_limit`` given to the store is the memory the whole process may use for it.
DuckDB's own ``memory_limit`` covers only DuckDB's buffers, so DuckDB gets
:data:`DUCKDB_MEMORY_SHARE` of it (:func:`duckdb_memory_limit`; past that DuckDB evicts pages to
the database file and spills to its temporary directory) and the rest is left for Python: the
interpreter, libraries and an open store (about 130 MB), the batch being decoded (bounded by the
service's ``max_records``) and its Arrow tables. ``bench/analytics.py`` measures the peak RSS of
an ingest of 8.64 M rows against the limit (973 MiB for ``2GB``).

Tables (columns in :mod:`analytics.rows`): ``gpu_samples``, ``ib_port_samples``, ``gpu_states``,
``idle_runs``, ``gpu_rollup_1m``, ``ib_port_rollup_1m``, ``scheduler_gpu_samples``
(:mod:`analytics.scheduler`),
``committed_offsets`` and ``kafka_sources`` (:mod:`analytics.offsets`), ``analytics_meta``. Views and
table macros: ``consumer_offsets(topic, partition, next_offset)`` (:mod:`analytics.offsets`),
:data:`analytics.views.VIEWS` (``gpu_state_now``, ``idle_windows``, ``ib_port_intervals``,
``fabric_headroom`` ...). Rollups and retention: :meth:`AnalyticsStore.maintain`
(:mod:`analytics.retention`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from analytics import offsets as kafka_offsets
from analytics.metrics import AnalyticsMetrics
from analytics.retention import MaintenanceResult, RetentionConfig, maintain, read_watermark
from analytics.rows import (
    GPU_ROLLUP_COLUMNS,
    GPU_SAMPLE_COLUMNS,
    GPU_STATE_COLUMNS,
    IB_PORT_ROLLUP_COLUMNS,
    IB_PORT_SAMPLE_COLUMNS,
    IDLE_RUN_COLUMNS,
    create_table_sql,
)
from analytics.scheduler import SCHEDULER_GPU_TABLE_SQL
from analytics.views import VIEWS
from contracts.bus import TopicPartition

log = logging.getLogger(__name__)

STORE_SCHEMA_VERSION = 3
"""Layout version of the database. A file of an older version listed in :data:`_MIGRATIONS` is
migrated in place when opened for writing; any other version is refused."""

_TABLES: tuple[str, ...] = (
    "CREATE TABLE IF NOT EXISTS analytics_meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL)",
    create_table_sql("gpu_samples", GPU_SAMPLE_COLUMNS),
    create_table_sql("ib_port_samples", IB_PORT_SAMPLE_COLUMNS),
    create_table_sql("gpu_states", GPU_STATE_COLUMNS),
    create_table_sql("idle_runs", IDLE_RUN_COLUMNS),
    create_table_sql("gpu_rollup_1m", GPU_ROLLUP_COLUMNS),
    create_table_sql("ib_port_rollup_1m", IB_PORT_ROLLUP_COLUMNS),
    SCHEDULER_GPU_TABLE_SQL,
    *kafka_offsets.TABLES,
)

_MIGRATIONS: dict[int, tuple[str, ...]] = {
    # 1 → 2: state rows say whether they are transitions (old rows: yes, the conservative answer);
    # the rollup tables are new (created above).
    1: ("ALTER TABLE gpu_states ADD COLUMN IF NOT EXISTS transition BOOLEAN DEFAULT true",),
    # 2 → 3: positions kept by the rows (analytics.offsets); the old table's become committed ones.
    2: kafka_offsets.MIGRATE_FROM_2,
}
"""Statements that bring a file of version ``k`` to ``k + 1``."""

_GPU_KEYED_TABLES: tuple[tuple[str, bool], ...] = (
    ("gpu_samples", True),
    ("gpu_states", True),
    ("idle_runs", False),
    ("gpu_rollup_1m", True),
)
"""Tables with a ``gpu_key`` column, and whether they have a ``gpu_uuid`` too."""
_BATCH_TABLES: tuple[str, ...] = (
    "gpu_samples", "ib_port_samples", "gpu_states", "idle_runs", "scheduler_gpu_samples"
)

DUCKDB_MEMORY_SHARE = 0.6
"""Share of the store's memory limit given to DuckDB's ``memory_limit`` (module docstring)."""

_UNITS = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
"""DuckDB's size units (``2GB`` is 2·10⁹ bytes, ``2GiB`` 2·2³⁰)."""


def parse_bytes(text: str) -> int:
    """Bytes of a DuckDB-style size such as ``"2GB"``, ``"1.5 GiB"`` or ``"800MB"``.

    Raises:
        ValueError: not a non-negative number followed by an optional unit of :data:`_UNITS`.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m[2].lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (e.g. 2GB, 1.5GiB, 800MB)")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def duckdb_memory_limit(memory_limit: str) -> str:
    """DuckDB's ``memory_limit`` setting (bytes, e.g. ``"1200000000B"``) for a process limit:
    :data:`DUCKDB_MEMORY_SHARE` of it. Raises ``ValueError`` like :func:`parse_bytes`."""
    return f"{int(parse_bytes(memory_limit) * DUCKDB_MEMORY_SHARE)}B"


@dataclass(slots=True)
class StoreBatch:
    """What one transaction writes. Tables come from :mod:`analytics.rows`; ``None`` or empty
    tables are skipped. ``offsets`` maps each partition read to the *next* offset to read."""

    gpu_samples: pa.Table | None = None
    ib_port_samples: pa.Table | None = None
    gpu_states: pa.Table | None = None
    idle_runs: pa.Table | None = None
    offsets: Mapping[TopicPartition, int] = field(default_factory=dict)
    scheduler_gpu_samples: pa.Table | None = None

    def empty(self) -> bool:
        """True when there is nothing to write."""
        tables = (
            self.gpu_samples,
            self.ib_port_samples,
            self.gpu_states,
            self.idle_runs,
            self.scheduler_gpu_samples,
        )
        return not self.offsets and all(t is None or t.num_rows == 0 for t in tables)


class StoreSchemaError(RuntimeError):
    """The database file was written with another :data:`STORE_SCHEMA_VERSION`."""


def _column_list(table: pa.Table) -> str:
    """The column names of ``table`` as a SQL column list (each a quoted identifier)."""
    return ", ".join('"' + name.replace('"', '""') + '"' for name in table.column_names)


class AnalyticsStore:
    """One DuckDB database (a file, or ``:memory:``) holding the stage's data."""

    def __init__(
        self,
        path: str = ":memory:",
        *,
        memory_limit: str | None = None,
        threads: int | None = None,
        read_only: bool = False,
        metrics: AnalyticsMetrics | None = None,
        sources: Mapping[str, str] | None = None,
    ) -> None:
        """Open (creating tables and views unless ``read_only``).

        Args:
            path: database file, or ``:memory:``.
            memory_limit: memory the process may use for the store (e.g. ``"2GB"``, DuckDB's
                units); DuckDB's own limit is :data:`DUCKDB_MEMORY_SHARE` of it (module
                docstring). DuckDB's default (80 % of RAM) if ``None``.
            threads: DuckDB worker threads; DuckDB's default (all cores) if ``None``.
            read_only: open an existing file read-only (operators' queries).
            metrics: where writes and maintenance are counted (the analytics service's);
                ``None``: new ones on a registry of their own.
            sources: raw table → the Kafka topic its rows are read from (tables of
                :data:`analytics.offsets.SOURCED_TABLES`), so that writes leave those topics'
                positions to the rows (:mod:`analytics.offsets`); ``None``: every write stores
                its offsets.

        Raises:
            duckdb.IOException: the file is locked by another process or cannot be opened.
            StoreSchemaError: the file has another layout version.
            ValueError: ``memory_limit`` is not a memory size, or ``sources`` names a table
                without Kafka positions or one topic twice.
        """
        config: dict[str, Any] = {}
        if memory_limit:
            config["memory_limit"] = duckdb_memory_limit(memory_limit)
        if threads:
            config["threads"] = threads
        self.path = path
        self.metrics = metrics if metrics is not None else AnalyticsMetrics()
        self._con = duckdb.connect(path, read_only=read_only, config=config)
        self._watermark: float | None = None  # rollup watermark (Unix s), for counting late rows
        self._derived: dict[str, str] = {}  # topic -> table whose rows keep its positions
        if not read_only:
            try:
                self._create()
                if sources:
                    self._derived = kafka_offsets.set_sources(self._con, sources)
            except BaseException:
                self._con.close()
                raise

    def _create(self) -> None:
        con = self._con
        for stmt in _TABLES:
            con.execute(stmt)
        row = con.execute("SELECT value FROM analytics_meta WHERE key = 'schema_version'").fetchone()
        if row is None:
            con.execute("INSERT INTO analytics_meta VALUES ('schema_version', ?)", [str(STORE_SCHEMA_VERSION)])
        elif row[0] != str(STORE_SCHEMA_VERSION):
            self._migrate(str(row[0]))
        con.execute(kafka_offsets.VIEW_SQL)
        for view in VIEWS:
            con.execute(view.sql)
        self._watermark = read_watermark(con)

    def _migrate(self, found: str) -> None:
        """Bring a file of layout ``found`` to :data:`STORE_SCHEMA_VERSION` in one transaction.
        Raises :class:`StoreSchemaError` if there is no way from ``found``."""
        version = int(found) if found.isdigit() else -1
        path = range(version, STORE_SCHEMA_VERSION)
        if not 1 <= version < STORE_SCHEMA_VERSION or not all(v in _MIGRATIONS for v in path):
            raise StoreSchemaError(f"{self.path}: store layout {found}, this code needs {STORE_SCHEMA_VERSION}")
        con = self._con
        con.begin()
        try:
            for v in path:
                for stmt in _MIGRATIONS[v]:
                    con.execute(stmt)
            con.execute(
                "UPDATE analytics_meta SET value = ? WHERE key = 'schema_version'", [str(STORE_SCHEMA_VERSION)]
            )
            con.commit()
        except BaseException:
            con.rollback()
            raise
        log.info("store_migrated", extra={"path": self.path, "from": found, "to": STORE_SCHEMA_VERSION})

    # writing ---------------------------------------------------------------------------------
    def write(self, batch: StoreBatch) -> dict[str, int]:
        """Write every table of ``batch`` and upsert its offsets in ONE transaction (offsets that
        the rows keep by themselves are not written: :func:`analytics.offsets.uncovered`).

        Returns rows written per table. On any error the transaction is rolled back — neither the
        rows nor the offsets are stored — and the error is raised again (``duckdb.Error``, e.g.
        ``ConstraintException`` for a negative offset, or the Arrow/cast error of a bad table).
        """
        if batch.empty():
            return {}
        started = time.perf_counter()
        con = self._con
        views: dict[str, pa.Table] = {
            name: table
            for name in _BATCH_TABLES
            if (table := getattr(batch, name)) is not None and table.num_rows > 0
        }
        # Registered outside the transaction: unregistering inside an aborted one would fail and
        # hide the original error.
        offsets = kafka_offsets.uncovered(batch.offsets, views, self._derived) if batch.offsets else {}
        for name, table in views.items():
            con.register(f"_batch_{name}", table)
        inserts = [
            f"INSERT INTO {name} ({_column_list(table)}) SELECT * FROM _batch_{name}"
            for name, table in views.items()
        ]
        try:
            if len(inserts) == 1 and not offsets:
                con.execute(inserts[0])  # one statement: atomic without BEGIN / COMMIT
            else:
                con.begin()
                try:
                    for sql in inserts:
                        con.execute(sql)
                    if offsets:
                        kafka_offsets.upsert(con, offsets)
                    con.commit()
                except BaseException:
                    con.rollback()
                    raise
        finally:
            for name in views:
                con.unregister(f"_batch_{name}")
        self.metrics.ingest_batch_seconds.observe(time.perf_counter() - started)
        written = {name: t.num_rows for name, t in views.items()}
        for name, n in written.items():
            self.metrics.ingest_rows.labels(table=name).inc(n)
        self._count_late(views)
        return written

    def stand_in_gpus(self) -> list[tuple[str, str, int | None]]:
        """``(host, gpu_uuid, gpu_instance_id)`` of every GPU whose decided states are stored under a
        stand-in id (``gpu_uuid`` ``gpu<index>``: a GPU known without its UUID,
        :mod:`analytics.identity`)."""
        rows = self._con.execute(
            "SELECT DISTINCT host, gpu_uuid, gpu_instance_id FROM gpu_states"
            " WHERE regexp_full_match(gpu_uuid, 'gpu[0-9]+') ORDER BY ALL"
        ).fetchall()
        return [(h, u, gi) for h, u, gi in rows]

    def rekey_gpu(self, old: str, new: str, gpu_uuid: str) -> int:
        """Move every stored row of GPU ``old`` to key ``new`` and UUID ``gpu_uuid`` (a GPU known by
        its index whose UUID appeared: :mod:`analytics.identity`), in one transaction. Returns the
        rows moved. Raises ``duckdb.Error`` (rolled back)."""
        con = self._con
        moved = 0
        con.begin()
        try:
            for table, has_uuid in _GPU_KEYED_TABLES:
                sets = "gpu_key = ?, gpu_uuid = ?" if has_uuid else "gpu_key = ?"
                params = [new, gpu_uuid, old] if has_uuid else [new, old]
                row = con.execute(f"UPDATE {table} SET {sets} WHERE gpu_key = ?", params).fetchone()
                moved += int(row[0]) if row else 0
            con.commit()
        except BaseException:
            con.rollback()
            raise
        return moved

    def _count_late(self, tables: Mapping[str, pa.Table]) -> None:
        """Count raw rows older than the rollup watermark (they will miss the rollups)."""
        if self._watermark is None:
            return
        cut = pa.scalar(round(self._watermark * 1e6), pa.timestamp("us"))
        for name in ("gpu_samples", "ib_port_samples"):
            table = tables.get(name)
            if table is not None:
                late = pc.sum(pc.less(table.column("ts"), cut)).as_py() or 0
                if late:
                    self.metrics.rollup_late_rows.labels(table=name).inc(late)

    # maintenance -----------------------------------------------------------------------------
    def maintain(self, config: RetentionConfig, now: float) -> MaintenanceResult:
        """Roll up complete minutes and expire old rows in one transaction
        (:func:`analytics.retention.maintain`); counts rows and time in the
        ``gpupool_analytics_rollup_rows_total`` / ``_expired_rows_total`` /
        ``_maintenance_seconds`` metrics.

        Args:
            config: retention settings.
            now: current time, Unix s.

        Raises:
            ValueError: ``now`` is not finite.
            duckdb.Error: the transaction failed and was rolled back (counted in
                ``gpupool_analytics_maintenance_failures_total``).
        """
        started = time.perf_counter()
        try:
            result = maintain(self._con, config, now)
        except duckdb.Error:
            self.metrics.maintenance_failures.inc()
            raise
        self.metrics.maintenance_seconds.observe(time.perf_counter() - started)
        for table, n in result.rollup_rows.items():
            self.metrics.rollup_rows.labels(table=table).inc(n)
        for table, n in result.expired_rows.items():
            self.metrics.expired_rows.labels(table=table).inc(n)
        self._watermark = result.watermark
        return result

    # reading ---------------------------------------------------------------------------------
    def stored_offsets(self, topics: Sequence[str] | None = None) -> dict[TopicPartition, int]:
        """Next offset to read per partition, as last committed with rows (all topics, or
        ``topics``): the ``consumer_offsets`` view (:mod:`analytics.offsets`)."""
        rows = self._con.execute("SELECT topic, partition, next_offset FROM consumer_offsets").fetchall()
        wanted = None if topics is None else set(topics)
        return {TopicPartition(t, int(p)): int(o) for t, p, o in rows if wanted is None or t in wanted}

    def idle_runs(self, per_gpu: int = 256) -> list[tuple[str, str, float, bool]]:
        """The latest ``per_gpu`` idle runs of each GPU, oldest first, as
        ``(gpu_key, pool, duration_s, censored)`` — to reload the predictor's history."""
        return [
            (str(k), str(p), float(d), bool(c))
            for k, p, d, c in self._con.execute(
                "SELECT gpu_key, pool, duration_s, censored FROM ("
                " SELECT *, row_number() OVER (PARTITION BY gpu_key ORDER BY end_ts DESC) AS n"
                " FROM idle_runs) WHERE n <= ? ORDER BY end_ts, gpu_key",
                [per_gpu],
            ).fetchall()
        ]

    def sql(self, query: str, params: Sequence[Any] = ()) -> tuple[list[str], list[tuple[Any, ...]]]:
        """Run ``query`` on this store's connection; return ``(column names, rows)``.

        Raises:
            duckdb.Error: the query is invalid or fails.
        """
        rel = self._con.execute(query, list(params))
        names = [d[0] for d in rel.description or []]
        return names, rel.fetchall()

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A new connection to the same database, for use in another thread."""
        return self._con.cursor()

    def close(self) -> None:
        """Close the connection (idempotent)."""
        try:
            self._con.close()
        except duckdb.Error:  # already closed
            log.debug("store_close_twice", extra={"path": self.path})
