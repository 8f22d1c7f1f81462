"""Read-only DuckDB queries that give each plot of ``gpupool report`` its data.

The database is the analytics store (:mod:`analytics.store`; columns in :mod:`analytics.rows`):
``gpu_samples`` (one row per GPU sample), ``gpu_states`` (every capacity update decided),
``idle_runs`` (ended idle runs) and ``ib_port_samples`` (one row per InfiniBand port read).
Timestamps there are ``TIMESTAMP`` in UTC; every ``datetime`` returned here is naive UTC.

Time is cut into equal buckets starting at the first row: a bucket is at least the typical
sampling interval (so a row of the heatmap has no holes between two samples) and at most
``span / max_columns`` wide, and the grid never exceeds ``max_cells`` cells.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import duckdb

from contracts.counters import DEFAULT_MAX_GAP_S

REQUIRED_TABLES: tuple[str, ...] = ("gpu_samples", "gpu_states", "idle_runs", "ib_port_samples")
"""Tables of the analytics store the report reads."""


class ReportDataError(RuntimeError):
    """The database is not an analytics store (a table the report reads is missing)."""


def open_store(path: Path) -> duckdb.DuckDBPyConnection:
    """Open the analytics DuckDB file ``path`` read-only.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        duckdb.IOException: the file cannot be opened, e.g. ``gpupool analytics run`` holds it
            (DuckDB lets one process open a file for writing, and then no other process at all).
        ReportDataError: a table of :data:`REQUIRED_TABLES` is missing.
    """
    if not path.is_file():
        raise FileNotFoundError(f"no DuckDB file at {path}")
    con = duckdb.connect(str(path), read_only=True)
    present = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    missing = [t for t in REQUIRED_TABLES if t not in present]
    if missing:
        con.close()
        raise ReportDataError(f"{path} is not a gpupool analytics store: no table {', '.join(missing)}")
    return con


@dataclass(frozen=True, slots=True)
class TimeSpan:
    """A closed time interval, naive UTC."""

    start: datetime
    end: datetime

    @property
    def seconds(self) -> float:
        """Length in seconds (>= 0)."""
        return max(0.0, (self.end - self.start).total_seconds())


def data_span(con: duckdb.DuckDBPyConnection) -> TimeSpan | None:
    """First and last timestamp over ``gpu_samples``, ``gpu_states`` and ``ib_port_samples``;
    ``None`` if all three are empty."""
    row = con.execute(
        "SELECT min(t0), max(t1) FROM ("
        " SELECT min(ts) AS t0, max(ts) AS t1 FROM gpu_samples"
        " UNION ALL SELECT min(ts), max(ts) FROM gpu_states"
        " UNION ALL SELECT min(ts), max(ts) FROM ib_port_samples)"
    ).fetchone()
    if row is None or row[0] is None:
        return None
    return TimeSpan(row[0], row[1])


@dataclass(frozen=True, slots=True)
class Grid:
    """Values on a (row × time bucket) grid; ``None`` where a row has no value in a bucket.

    Attributes:
        rows: row keys, in display order.
        times: start of each bucket (naive UTC), ``bucket_s`` apart.
        values: ``values[i][j]`` for ``rows[i]`` and ``times[j]``.
        bucket_s: bucket width, seconds.
        samples: table rows the grid was made from.
    """

    rows: list[str]
    times: list[datetime]
    values: list[list[float | None]]
    bucket_s: float
    samples: int


def bucket_width_us(span_s: float, rows: int, samples: int, max_columns: int, max_cells: int) -> int:
    """Bucket width in microseconds for ``samples`` rows of ``rows`` series over ``span_s`` seconds.

    At least 1.5 × the mean sampling interval ``span_s · rows / samples`` (so that jitter of the
    sampling clock rarely leaves a bucket of a series empty) and 1 ms, and at least ``span_s / columns``
    where ``columns = min(max_columns, max_cells // rows)`` (at least 1).
    Raises ``ValueError`` if ``rows``, ``samples``, ``max_columns`` or ``max_cells`` is < 1.
    """
    if min(rows, samples, max_columns, max_cells) < 1:
        raise ValueError("rows, samples, max_columns and max_cells must be >= 1")
    columns = max(1, min(max_columns, max_cells // rows))
    width_s = max(span_s / columns, 1.5 * span_s * rows / samples, 1e-3)
    return math.ceil(width_s * 1_000_000)


def _grid(
    rows: list[str],
    cells: list[tuple[str, datetime, float | None]],
    start: datetime,
    end: datetime,
    bucket_us: int,
    samples: int,
) -> Grid:
    step = timedelta(microseconds=bucket_us)
    n = int((end - start) // step) + 1
    index = {k: i for i, k in enumerate(rows)}
    values: list[list[float | None]] = [[None] * n for _ in rows]
    for key, bucket, value in cells:
        j = int((bucket - start) // step)
        if key in index and 0 <= j < n:
            values[index[key]][j] = None if value is None else float(value)
    return Grid(rows, [start + j * step for j in range(n)], values, bucket_us / 1e6, samples)


def utilisation_grid(
    con: duckdb.DuckDBPyConnection, *, max_columns: int = 400, max_cells: int = 1_000_000
) -> Grid | None:
    """Mean GPU utilisation (%) per GPU key and time bucket; ``None`` without GPU samples.

    A sample's utilisation is ``gpu_util`` (``DCGM_FI_DEV_GPU_UTIL``, %), or
    ``100 · gr_engine_active`` (``DCGM_FI_PROF_GR_ENGINE_ACTIVE``) where a source lacks it; values
    outside 0..100 (DCGM blank sentinels, NaN) are left out. Rows are GPU keys, sorted.
    """
    t0, t1, samples, gpus = con.execute(
        "SELECT min(ts), max(ts), count(*), count(DISTINCT gpu_key) FROM gpu_samples"
    ).fetchone() or (None, None, 0, 0)
    if not samples:
        return None
    bucket_us = bucket_width_us((t1 - t0).total_seconds(), gpus, samples, max_columns, max_cells)
    cells = con.execute(
        "SELECT gpu_key, time_bucket(to_microseconds(CAST($w AS BIGINT)), ts, $origin) AS bucket,"
        " avg(u) FILTER (WHERE u BETWEEN 0 AND 100)"
        " FROM (SELECT gpu_key, ts, coalesce(gpu_util, 100 * gr_engine_active) AS u FROM gpu_samples)"
        " GROUP BY ALL",
        {"w": bucket_us, "origin": t0},
    ).fetchall()
    keys = sorted({c[0] for c in cells})
    return _grid(keys, cells, t0, t1, bucket_us, samples)


@dataclass(frozen=True, slots=True)
class IdleWindow:
    """One idle window of one GPU: what analytics predicted and what happened.

    Attributes:
        gpu_key / pool / model_name: the GPU.
        since: start of the idle run (first idle sample).
        declared_at: first capacity update that said ``idle``.
        predicted_at: first idle update that carried a prediction; ``None`` if none did.
        predicted_until: that update's ``predicted_idle_until`` — the promise; ``None`` if none.
        confidence: the probability that promise was made with.
        last_seen_idle: newest idle update of the window.
        ended_at: end of the idle run as stored in ``idle_runs`` (the last sample known idle);
            ``None`` while the window is still open at the end of the data.
        censored: the run ended in ``unknown`` (its true end is later than ``ended_at``, unseen).
    """

    gpu_key: str
    pool: str | None
    model_name: str | None
    since: datetime
    declared_at: datetime
    predicted_at: datetime | None
    predicted_until: datetime | None
    confidence: float | None
    last_seen_idle: datetime
    ended_at: datetime | None
    censored: bool

    @property
    def outcome(self) -> str:
        """``kept`` (idle at least until the prediction), ``broken`` (busy before it),
        ``censored`` (went unknown before it), ``open`` (still idle, prediction not reached yet),
        or ``no_prediction``."""
        if self.predicted_until is None:
            return "no_prediction"
        seen_until = self.ended_at if self.ended_at is not None else self.last_seen_idle
        if seen_until >= self.predicted_until:
            return "kept"
        if self.ended_at is None:
            return "open"
        return "censored" if self.censored else "broken"

    @property
    def predicted_s(self) -> float | None:
        """Promised idle time from ``predicted_at`` to ``predicted_until``, seconds."""
        if self.predicted_at is None or self.predicted_until is None:
            return None
        return (self.predicted_until - self.predicted_at).total_seconds()

    @property
    def real_s(self) -> float | None:
        """Idle time seen from ``predicted_at`` to the run's end (or the last idle update while
        open), seconds; ``None`` without a prediction."""
        if self.predicted_at is None:
            return None
        end = self.ended_at if self.ended_at is not None else self.last_seen_idle
        return (end - self.predicted_at).total_seconds()


def idle_windows(con: duckdb.DuckDBPyConnection, *, limit: int = 5000) -> tuple[list[IdleWindow], int]:
    """The newest ``limit`` idle windows (oldest first) and how many there are in all.

    A window is the ``gpu_states`` rows with ``state = 'idle'`` of one ``(gpu_key, since)``; its
    real end is the ``idle_runs`` row of the same GPU whose ``start_ts`` equals ``since`` (the
    classifier writes both from the same first idle sample). Raises ``ValueError`` if ``limit`` < 1.
    """
    if limit < 1:
        raise ValueError("limit must be >= 1")
    rows = con.execute(
        "WITH w AS ("
        " SELECT gpu_key, since, any_value(pool) AS pool, any_value(model_name) AS model_name,"
        "  min(ts) AS declared_at, max(ts) AS last_seen_idle,"
        "  min(ts) FILTER (WHERE predicted_idle_until IS NOT NULL) AS predicted_at,"
        "  arg_min(predicted_idle_until, ts) AS predicted_until,"
        "  arg_min(confidence, ts) FILTER (WHERE predicted_idle_until IS NOT NULL) AS confidence"
        " FROM gpu_states WHERE state = 'idle' GROUP BY gpu_key, since),"
        " r AS (SELECT gpu_key, start_ts, max(end_ts) AS end_ts, bool_or(censored) AS censored"
        "  FROM idle_runs GROUP BY gpu_key, start_ts)"
        " SELECT w.gpu_key, w.pool, w.model_name, w.since, w.declared_at, w.predicted_at,"
        "  w.predicted_until, w.confidence, w.last_seen_idle, r.end_ts, coalesce(r.censored, false),"
        "  count(*) OVER () AS total"
        " FROM w LEFT JOIN r ON r.gpu_key = w.gpu_key AND r.start_ts = w.since"
        " ORDER BY w.since DESC, w.gpu_key LIMIT ?",
        [limit],
    ).fetchall()
    windows = [IdleWindow(*r[:11]) for r in reversed(rows)]
    return windows, int(rows[0][11]) if rows else 0


@dataclass(frozen=True, slots=True)
class PortHeadroom:
    """Link utilisation summary of one InfiniBand port.

    Attributes:
        port_key: ``node_guid/port`` (:func:`contracts.ib_port_key`).
        host / device / port: where it is (an HCA on a host, or a switch port of a leaf when the
            fabric collector reads switches with perfquery).
        rate_bytes_per_second: newest link rate read.
        intervals: intervals that gave a utilisation.
        p95_utilisation / max_utilisation: over those intervals (ratio, 1 = line rate); ``None``
            without any.
    """

    port_key: str
    host: str
    device: str
    port: int
    rate_bytes_per_second: int | None
    intervals: int
    p95_utilisation: float | None
    max_utilisation: float | None

    @property
    def label(self) -> str:
        """``host device/port``."""
        return f"{self.host} {self.device}/{self.port}"

    @property
    def headroom_p95(self) -> float | None:
        """``1 - p95_utilisation``: the share of line rate left 95 % of the time (may dip just
        below 0 from timing jitter, as utilisation may pass 1)."""
        return None if self.p95_utilisation is None else 1.0 - self.p95_utilisation


@dataclass(frozen=True, slots=True)
class FabricData:
    """Port utilisation over time (grid rows are ``port_key`` in the order of ``ports``)."""

    ports: list[PortHeadroom]
    grid: Grid


def _counter_rows(counter: str, column: str) -> str:
    # One row per read of one data counter; `sat` marks a read at the counter's all-ones maximum
    # (or flagged saturated by the collector): it stays a baseline but gives no rate.
    bits = f"TRY_CAST(json_extract_string(counter_bits, '$.{counter}') AS INTEGER)"
    return (
        f"SELECT port_key, ts, kafka_partition, kafka_offset, rate_bytes_per_second AS rate,"
        f" '{counter}' AS counter, {column} AS v,"
        f" list_contains(saturated, '{counter}') OR {column} = (CAST(1 AS HUGEINT) <<"
        f"  CASE WHEN {bits} BETWEEN 1 AND 64 THEN {bits} ELSE 64 END) - 1 AS sat"
        f" FROM ib_port_samples WHERE {column} IS NOT NULL"
    )


INTERVALS_SQL = (
    "WITH c AS ("
    + _counter_rows("PortXmitData", "port_xmit_data")
    + " UNION ALL "
    + _counter_rows("PortRcvData", "port_rcv_data")
    + "),"
    " d AS (SELECT port_key, counter, ts, rate, sat, lag(sat) OVER w AS prev_sat,"
    "  v - lag(v) OVER w AS dv, (epoch_us(ts) - lag(epoch_us(ts)) OVER w) / 1e6 AS dt"
    "  FROM c WINDOW w AS (PARTITION BY port_key, counter ORDER BY ts, kafka_partition, kafka_offset))"
    " SELECT port_key, ts, max(4 * CAST(dv AS DOUBLE) / (dt * rate)) AS util FROM d"
    " WHERE NOT sat AND NOT prev_sat AND dv >= 0 AND dt > 0 AND dt <= $max_gap AND rate > 0"
    " GROUP BY port_key, ts"
)
"""Utilisation of each port over each interval between two consecutive reads: for both data
counters, ``4 · Δwords / (Δt · rate_bytes_per_second)`` (:func:`contracts.counters.link_utilisation`;
``PortXmitData``/``PortRcvData`` count 4-octet words), the larger of the two directions, stamped
with the interval's end. As in :class:`contracts.counters.CounterTracker`: a drop (reset), a
saturated read on either end, a gap over ``$max_gap`` seconds or a non-positive interval gives no
value; an unreadable counter (NULL) is skipped, so the next read spans the longer interval."""


def fabric(
    con: duckdb.DuckDBPyConnection,
    *,
    max_columns: int = 400,
    max_cells: int = 1_000_000,
    max_gap_s: float = DEFAULT_MAX_GAP_S,
) -> FabricData | None:
    """Per-port utilisation over time and its p95 / max (:data:`INTERVALS_SQL`); ``None`` without
    port samples. Ports are ordered by host, device, port."""
    meta = con.execute(
        "SELECT port_key, arg_max(host, ts), arg_max(device, ts), arg_max(port, ts),"
        " arg_max(rate_bytes_per_second, ts), min(ts), max(ts), count(*)"
        " FROM ib_port_samples GROUP BY port_key"
    ).fetchall()
    if not meta:
        return None
    summary = {
        r[0]: r[1:]
        for r in con.execute(
            f"SELECT port_key, count(util), quantile_cont(util, 0.95), max(util)"
            f" FROM ({INTERVALS_SQL}) GROUP BY port_key",
            {"max_gap": max_gap_s},
        ).fetchall()
    }
    ports = sorted(
        (
            PortHeadroom(key, str(host), str(device), int(port), rate, *(summary.get(key) or (0, None, None)))
            for key, host, device, port, rate, *_ in meta
        ),
        key=lambda p: (p.host, p.device, p.port, p.port_key),
    )
    t0 = min(r[5] for r in meta)
    t1 = max(r[6] for r in meta)
    samples = sum(int(r[7]) for r in meta)
    bucket_us = bucket_width_us((t1 - t0).total_seconds(), len(meta), samples, max_columns, max_cells)
    cells = con.execute(
        f"SELECT port_key, time_bucket(to_microseconds(CAST($w AS BIGINT)), ts, $origin), avg(util)"
        f" FROM ({INTERVALS_SQL}) GROUP BY ALL",
        {"w": bucket_us, "origin": t0, "max_gap": max_gap_s},
    ).fetchall()
    grid = _grid([p.port_key for p in ports], cells, t0, t1, bucket_us, samples)
    return FabricData(ports, grid)
