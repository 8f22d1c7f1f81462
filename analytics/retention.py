"""Retention of the analytics store: 1-minute rollups, then expiry of raw rows, in one transaction.

:func:`maintain` (run by :class:`analytics.service.AnalyticsService` every
:attr:`RetentionConfig.interval_s`, or by hand):

1. **Rollup.** Every UTC minute from the rollup watermark up to ``now - delay_s`` (floored to the
   minute; at most ``max_rollup_s`` of them per run) is aggregated into ``gpu_rollup_1m`` (from ``gpu_samples``) and ``ib_port_rollup_1m``
   (from the counter intervals of ``ib_port_samples``, macro ``ib_port_intervals_between``);
   the watermark (``analytics_meta`` key ``rollup_watermark_us``) moves to that minute. A minute
   is rolled up once: ``delay_s`` is the allowed lateness. A raw row that arrives for a minute
   already rolled up is kept raw until it expires, and counted by the store in
   ``gpupool_analytics_rollup_late_rows_total`` when it is written.
2. **Raw expiry.** Raw samples older than ``raw_retention_s`` are deleted — never a row at or past
   ``watermark - DEFAULT_MAX_GAP_S`` (not rolled up yet, or the baseline of the next interval) —
   after the Kafka positions they keep are committed (:func:`analytics.offsets.commit_derived`).
   Refresh rows of ``gpu_states`` (``NOT transition``) expire with the raw rows.
3. **Rollup expiry.** Rollups, state transitions and idle runs older than ``rollup_retention_s``
   are deleted.

All of it commits in ONE DuckDB transaction (rolled back on any error), so a crash leaves either
the old or the new state. Times are the caller's clock (Unix s); raw rows are judged by their own
``ts``.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

import duckdb

from analytics.offsets import SOURCED_TABLES, commit_derived
from contracts.counters import DEFAULT_MAX_GAP_S

WATERMARK_KEY = "rollup_watermark_us"
"""``analytics_meta`` key of the rollup watermark: Unix microseconds of the first minute not yet
rolled up."""


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """How long rows are kept, and how often :func:`maintain` runs.

    Attributes:
        raw_retention_s: raw samples (``gpu_samples``, ``ib_port_samples``,
            ``scheduler_gpu_samples``) and refresh rows of
            ``gpu_states`` are kept this long (s) after their ``ts``; ``None`` keeps them forever.
        rollup_retention_s: 1-minute rollups, state transitions and idle runs are kept this long
            (s); ``None`` keeps them forever.
        delay_s: a minute is rolled up once ``now`` is this far (s) past its end: the lateness
            allowed to telemetry (collector spools, consumer lag).
        interval_s: period (s) of the maintenance step in the service.
        max_rollup_s: at most this much data time (s) is rolled up per run, so one run stays
            short (the store is busy meanwhile); a backlog (e.g. at first start on a full file) is
            caught up over the following runs.

    Raises:
        ValueError: on construction, for a non-positive retention or interval, a negative delay,
            or a rollup retention shorter than the raw retention.
    """

    raw_retention_s: float | None = 86_400.0
    rollup_retention_s: float | None = 30 * 86_400.0
    delay_s: float = 120.0
    interval_s: float = 60.0
    max_rollup_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("raw_retention_s", "rollup_retention_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds or None")
        if not (math.isfinite(self.delay_s) and self.delay_s >= 0):
            raise ValueError("delay_s must be >= 0")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError("interval_s must be > 0")
        if not (math.isfinite(self.max_rollup_s) and self.max_rollup_s >= 60):
            raise ValueError("max_rollup_s must be >= 60 (one minute)")
        raw, rollup = self.raw_retention_s, self.rollup_retention_s
        if rollup is not None and (raw is None or rollup < raw):
            raise ValueError("rollup_retention_s must be >= raw_retention_s (rollups outlive raw rows)")


@dataclass(frozen=True, slots=True)
class MaintenanceResult:
    """What one :func:`maintain` did.

    Attributes:
        rolled_from / rolled_to: the minutes rolled up, ``[from, to)`` in Unix s; ``None`` when
            no minute was complete.
        rollup_rows: rows written per rollup table.
        expired_rows: rows deleted per table.
        watermark: the rollup watermark after the run (Unix s), ``None`` while nothing was rolled.
    """

    rolled_from: float | None
    rolled_to: float | None
    rollup_rows: dict[str, int]
    expired_rows: dict[str, int]
    watermark: float | None


_GPU_ROLLUP = """
    INSERT INTO gpu_rollup_1m BY NAME
    SELECT time_bucket(INTERVAL 1 MINUTE, ts) AS minute, gpu_key,
           arg_max(host, ts) AS host, arg_max(gpu_uuid, ts) AS gpu_uuid,
           arg_max(gpu_instance_id, ts) AS gpu_instance_id, arg_max(model_name, ts) AS model_name,
           count(*) AS samples, count(activity) AS activity_samples,
           avg(activity) AS activity_mean, max(activity) AS activity_max,
           avg(fb_used_mib) AS fb_used_mib_mean, max(fb_used_mib) AS fb_used_mib_max,
           avg(power_w) AS power_w_mean
    FROM (
        SELECT *, coalesce(greatest(gr_engine_active, sm_active), gpu_util / 100.0) AS activity
        FROM gpu_samples WHERE ts >= $t0 AND ts < $t1
    )
    GROUP BY ALL"""

_IB_ROLLUP = """
    INSERT INTO ib_port_rollup_1m BY NAME
    SELECT time_bucket(INTERVAL 1 MINUTE, ts) AS minute, port_key,
           arg_max(host, ts) AS host, arg_max(device, ts) AS device,
           arg_max(node_guid, ts) AS node_guid, arg_max(port, ts) AS port,
           count(*) AS samples, count(utilisation) AS intervals,
           coalesce(sum(dt_s) FILTER (WHERE utilisation IS NOT NULL), 0) AS interval_s,
           arg_max(rate_bytes_per_second, ts) AS rate_bytes_per_second,
           sum(xmit_data_words) AS xmit_data_words, sum(rcv_data_words) AS rcv_data_words,
           sum(xmit_wait_ticks) AS xmit_wait_ticks, max(xmit_wait_ticks) AS xmit_wait_ticks_max,
           (4 * sum(xmit_data_words) FILTER (WHERE utilisation IS NOT NULL))::DOUBLE
             / nullif(sum(dt_s * rate_bytes_per_second) FILTER (WHERE utilisation IS NOT NULL), 0)
             AS utilisation_mean,
           max(utilisation) AS utilisation_max
    FROM ib_port_intervals_between($t0, $t1)
    GROUP BY ALL"""


def read_watermark(con: duckdb.DuckDBPyConnection) -> float | None:
    """The rollup watermark (Unix s) stored in ``analytics_meta``, or ``None``."""
    row = con.execute("SELECT value FROM analytics_meta WHERE key = ?", [WATERMARK_KEY]).fetchone()
    return None if row is None else int(row[0]) / 1e6


def maintain(con: duckdb.DuckDBPyConnection, config: RetentionConfig, now: float) -> MaintenanceResult:
    """Roll up complete minutes, then expire old rows (module docstring), in one transaction on
    ``con`` (a connection to a store opened for writing, used by no other thread meanwhile).

    Args:
        con: the store's connection.
        config: retention settings.
        now: the current time, Unix s (finite).

    Raises:
        ValueError: ``now`` is not finite.
        duckdb.Error: the transaction failed; nothing of it was applied.
    """
    if not math.isfinite(now):
        raise ValueError(f"now must be finite, got {now!r}")
    con.begin()
    try:
        result = _maintain(con, config, now)
        con.commit()
    except BaseException:
        con.rollback()
        raise
    return result


def _minute_floor(t: float) -> int:
    """Unix microseconds of the start of the UTC minute holding ``t`` (Unix s)."""
    return math.floor(t / 60.0) * 60 * 1_000_000


def _maintain(con: duckdb.DuckDBPyConnection, config: RetentionConfig, now: float) -> MaintenanceResult:
    stored = read_watermark(con)
    watermark_us = None if stored is None else round(stored * 1e6)
    to_us = _minute_floor(now - config.delay_s)
    # From the first minute holding a raw row at or after the watermark: empty stretches (the
    # first run, a stage that was down) are skipped at once rather than rolled up minute by minute.
    row = con.execute(
        "SELECT epoch_us(least((SELECT min(ts) FROM gpu_samples WHERE ts >= $t),"
        " (SELECT min(ts) FROM ib_port_samples WHERE ts >= $t)))",
        {"t": _ts(watermark_us if watermark_us is not None else 0)},
    ).fetchone()
    from_us = None if row is None or row[0] is None else _minute_floor(int(row[0]) / 1e6)
    if from_us is not None:
        to_us = min(to_us, from_us + _minute_floor(config.max_rollup_s))
    rollup_rows: dict[str, int] = {"gpu_rollup_1m": 0, "ib_port_rollup_1m": 0}
    rolled = from_us is not None and from_us < to_us
    if rolled:
        assert from_us is not None
        params = {"t0": _ts(from_us), "t1": _ts(to_us)}
        for table, sql in (("gpu_rollup_1m", _GPU_ROLLUP), ("ib_port_rollup_1m", _IB_ROLLUP)):
            # A crash after an earlier run's inserts but before its watermark cannot happen (one
            # transaction); deleting the range first keeps a hand-reset watermark harmless too.
            con.execute(f"DELETE FROM {table} WHERE minute >= $t0 AND minute < $t1", params)
            rollup_rows[table] = _count(con.execute(sql, params))
        watermark_us = to_us
        con.execute(
            "INSERT INTO analytics_meta VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            [WATERMARK_KEY, str(watermark_us)],
        )
    expired: dict[str, int] = {}
    if config.raw_retention_s is not None and watermark_us is not None:
        raw_cut_us = min(
            round((now - config.raw_retention_s) * 1e6), watermark_us - int(DEFAULT_MAX_GAP_S * 1e6)
        )
        cut = {"cut": _ts(raw_cut_us)}
        # the positions these rows keep (analytics.offsets) outlive them
        commit_derived(con, "r.ts < $cut", cut)
        for table in SOURCED_TABLES:
            expired[table] = _count(con.execute(f"DELETE FROM {table} WHERE ts < $cut", cut))
        expired["gpu_states"] = _count(
            con.execute("DELETE FROM gpu_states WHERE ts < $cut AND NOT transition", cut)
        )
    if config.rollup_retention_s is not None:
        cut = {"cut": _ts(round((now - config.rollup_retention_s) * 1e6))}
        for table, col in (
            ("gpu_rollup_1m", "minute"),
            ("ib_port_rollup_1m", "minute"),
            ("gpu_states", "ts"),
            ("idle_runs", "end_ts"),
        ):
            n = _count(con.execute(f"DELETE FROM {table} WHERE {col} < $cut", cut))
            expired[table] = expired.get(table, 0) + n
    return MaintenanceResult(
        rolled_from=from_us / 1e6 if rolled and from_us is not None else None,
        rolled_to=to_us / 1e6 if rolled else None,
        rollup_rows=rollup_rows,
        expired_rows=expired,
        watermark=None if watermark_us is None else watermark_us / 1e6,
    )


_EPOCH = dt.datetime(1970, 1, 1)


def _ts(micros: int) -> dt.datetime:
    """A DuckDB ``TIMESTAMP`` parameter for Unix microseconds (a naive UTC ``datetime``)."""
    return _EPOCH + dt.timedelta(microseconds=micros)


def _count(rel: duckdb.DuckDBPyConnection) -> int:
    """Rows affected by the INSERT/DELETE that produced ``rel``."""
    row = rel.fetchone()
    return 0 if row is None else int(row[0])
