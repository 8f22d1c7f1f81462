"""Operator views of the analytics store: documented SQL over the tables of :mod:`analytics.rows`.

Every view (and table macro) is one :class:`View`: its name, what a row means, its columns, and
the ``CREATE OR REPLACE`` statement. :class:`analytics.store.AnalyticsStore` creates them when it
opens a database for writing; ``gpupool analytics sql "SELECT * FROM idle_windows"`` reads them.
:func:`views_markdown` renders the same documentation for the README, so the two cannot drift.

Time columns are ``TIMESTAMP`` (UTC, microseconds); durations are seconds (``DOUBLE``). Counter
deltas stay ``HUGEINT`` (exact past 2**53); only ratios are ``DOUBLE``.

Counter intervals follow :mod:`contracts.counters` exactly (tested against
:class:`contracts.counters.CounterTracker` and :func:`contracts.counters.link_utilisation` on the
same rows): per port and counter, each read is compared with the previous read *that had the
counter* (``lag(... IGNORE NULLS)``: a missing read keeps the baseline); the delta is valid only
when the interval is in ``(0, DEFAULT_MAX_GAP_S]`` seconds (else ``clock_step``), the read is not
saturated (all-ones for its ``counter_bits`` width, default 64, or listed in ``saturated``), and
the value did not drop (a drop is a ``reset``: no delta). Reads of a port are ordered by ``ts``,
then Kafka partition and offset.
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts.counters import DEFAULT_MAX_GAP_S

HEADROOM_WINDOW_S = 900
"""Window of :data:`FABRIC_HEADROOM` (s): the last 15 minutes of each port's reads."""


@dataclass(frozen=True, slots=True)
class View:
    """One documented view or table macro.

    Attributes:
        name: the SQL name (a table macro is shown as ``name(args)``).
        summary: what one row is, in a sentence or two.
        columns: ``(column, meaning with unit)`` pairs, in output order.
        sql: the ``CREATE OR REPLACE VIEW`` / ``MACRO`` statement.
    """

    name: str
    summary: str
    columns: tuple[tuple[str, str], ...]
    sql: str


_MAX_GAP_US = int(DEFAULT_MAX_GAP_S * 1_000_000)


def _counter_interval(column: str, pma: str) -> str:
    """SELECT-list fragment: ``<column>_delta`` (HUGEINT or NULL) and ``<column>_dt_s`` for one
    PMA counter, with the rules of :class:`contracts.counters.CounterTracker`. Expects a window
    named ``w`` (per port, by time) and a ``ts`` column."""
    top = f"((1::HUGEINT << coalesce(TRY_CAST(counter_bits->>'{pma}' AS INTEGER), 64)) - 1)"
    prev = f"lag({column} IGNORE NULLS) OVER w"
    prev_us = f"lag(CASE WHEN {column} IS NOT NULL THEN epoch_us(ts) END IGNORE NULLS) OVER w"
    dt_us = f"(epoch_us(ts) - {prev_us})"
    return f"""
        CASE WHEN {column} IS NOT NULL AND {prev} IS NOT NULL
                  AND {dt_us} > 0 AND {dt_us} <= {_MAX_GAP_US}
                  AND {column} <> {top} AND NOT list_contains(coalesce(saturated, []), '{pma}')
                  AND {column} >= {prev}
             THEN {column} - {prev} END AS {column}_delta,
        CASE WHEN {column} IS NOT NULL THEN {dt_us} / 1e6 END AS {column}_dt_s"""


def _intervals_select(source: str) -> str:
    """The body of :data:`IB_PORT_INTERVALS` over relation ``source`` (a table or a CTE with
    the columns of ``ib_port_samples``)."""
    return f"""
    SELECT port_key, host, device, node_guid, port, ts, rate_bytes_per_second,
           port_xmit_data_delta AS xmit_data_words,
           port_xmit_data_dt_s AS dt_s,
           port_rcv_data_delta AS rcv_data_words,
           port_xmit_wait_delta AS xmit_wait_ticks,
           CASE WHEN port_xmit_data_delta IS NOT NULL AND rate_bytes_per_second > 0
                THEN (4 * port_xmit_data_delta)::DOUBLE / (port_xmit_data_dt_s * rate_bytes_per_second)
           END AS utilisation,
           port_rcv_data_dt_s AS rcv_dt_s,
           CASE WHEN port_rcv_data_delta IS NOT NULL AND rate_bytes_per_second > 0
                THEN (4 * port_rcv_data_delta)::DOUBLE / (port_rcv_data_dt_s * rate_bytes_per_second)
           END AS rcv_utilisation
    FROM (
        SELECT *,{_counter_interval("port_xmit_data", "PortXmitData")},
               {_counter_interval("port_rcv_data", "PortRcvData")},
               {_counter_interval("port_xmit_wait", "PortXmitWait")}
        FROM {source}
        WINDOW w AS (PARTITION BY port_key ORDER BY ts, kafka_partition, kafka_offset)
    )"""


GPU_STATE_NOW = View(
    name="gpu_state_now",
    summary=(
        "One row per GPU key (GPU or MIG instance) with raw samples kept: its latest sample "
        "(ties on `ts` broken by the later Kafka position) and the latest state the stage decided "
        "for it (NULL state columns when none was decided yet)."
    ),
    columns=(
        ("gpu_key, host, gpu_uuid, gpu_instance_id, gpu_instance_profile, model_name", "identity"),
        ("sample_ts", "time of the latest sample"),
        ("gpu_util", "DCGM_FI_DEV_GPU_UTIL, %"),
        ("gr_engine_active, sm_active", "DCGM profiling ratios, 0..1"),
        ("fb_used_mib, fb_free_mib", "framebuffer, MiB"),
        ("power_w", "board power, W"),
        ("invalid", "JSON: field -> reason the collector rejected it"),
        ("state", "busy / idle / unknown"),
        ("since", "when that state began"),
        ("grade", "free / memory_held for idle GPUs"),
        ("predicted_idle_until, confidence", "the promise of the latest update"),
        ("reason, pool", "as on the capacity update"),
        ("state_ts", "time of the latest decision"),
    ),
    # max(ts) per GPU joined back, then a window over the few rows left: a row_number() window or
    # max_by(row) over the whole table is several times slower on millions of rows.
    sql="""CREATE OR REPLACE VIEW gpu_state_now AS
    WITH latest AS (SELECT gpu_key, max(ts) AS ts FROM gpu_samples GROUP BY gpu_key),
    s AS (
        SELECT g.* FROM gpu_samples AS g JOIN latest USING (gpu_key, ts)
        QUALIFY row_number() OVER (PARTITION BY gpu_key ORDER BY kafka_partition DESC, kafka_offset DESC) = 1
    ),
    latest_state AS (SELECT gpu_key, max(ts) AS ts FROM gpu_states GROUP BY gpu_key),
    d AS (
        SELECT x.* FROM gpu_states AS x JOIN latest_state USING (gpu_key, ts)
        QUALIFY row_number() OVER (PARTITION BY gpu_key ORDER BY x.since DESC) = 1
    )
    SELECT s.gpu_key, s.host, s.gpu_uuid, s.gpu_instance_id, s.gpu_instance_profile, s.model_name,
           s.ts AS sample_ts, s.gpu_util, s.gr_engine_active, s.sm_active, s.fb_used_mib,
           s.fb_free_mib, s.power_w, s.invalid,
           d.state, d.since, d.grade, d.predicted_idle_until, d.confidence, d.reason, d.pool,
           d.ts AS state_ts
    FROM s LEFT JOIN d USING (gpu_key)""",
)

IDLE_WINDOWS = View(
    name="idle_windows",
    summary=(
        "One row per idle window of a GPU key: a run of idle decisions with one `since`, read from "
        "the stored state transitions (`gpu_states WHERE transition`, a few rows per window) "
        "and the ended runs (`idle_runs`), never from raw samples. A window that ended normally "
        "ends at its last idle sample (`idle_runs.end_ts`); a window cut by a stage restart (no "
        "run recorded, a later state stored) ends at its last stored transition, conservatively, "
        "and is `censored`; the current window has `end_ts` NULL and lasts until the GPU's "
        "latest decision. Runs that ended before any idle decision was "
        "stored (inside one batch) appear with `grade` NULL."
    ),
    columns=(
        ("gpu_key, host, model_name, pool", "identity (host, model and pool of the latest decision)"),
        ("start_ts", "first idle sample of the window (the update's `since`)"),
        ("end_ts", "last sample known idle; NULL while the window is open"),
        ("duration_s", "end_ts (or the latest decision, when open) minus start_ts, s"),
        ("grade", "memory_held if any decision of the window said so, else free"),
        ("ongoing", "true for the GPU's current window"),
        ("censored", "true when the window ended in unknown (missing data, stale, restart); NULL while open"),
    ),
    sql="""CREATE OR REPLACE VIEW idle_windows AS
    WITH t AS (
        SELECT gpu_key, state, since, ts, grade, host, model_name, pool
        FROM gpu_states WHERE transition
    ),
    ep AS (
        SELECT gpu_key, state, since, min(ts) AS first_ts, max(ts) AS last_ts,
               bool_or(grade = 'memory_held') AS held,
               arg_max(host, ts) AS host, arg_max(model_name, ts) AS model_name,
               arg_max(pool, ts) AS pool
        FROM t GROUP BY gpu_key, state, since
    ),
    seq AS (
        SELECT *, lead(since) OVER (PARTITION BY gpu_key ORDER BY first_ts, since) AS next_since
        FROM ep
    ),
    idle AS (SELECT * FROM seq WHERE state = 'idle'),
    last_decision AS (
        SELECT gpu_key, max(ts) AS ts FROM gpu_states
        WHERE gpu_key IN (SELECT gpu_key FROM idle WHERE next_since IS NULL) GROUP BY gpu_key
    ),
    runs AS (
        SELECT gpu_key, start_ts, max(end_ts) AS end_ts, bool_or(censored) AS censored,
               any_value(model_name) AS model_name, any_value(pool) AS pool
        FROM idle_runs GROUP BY gpu_key, start_ts
    )
    SELECT coalesce(i.gpu_key, r.gpu_key) AS gpu_key, i.host,
           coalesce(i.model_name, r.model_name) AS model_name, coalesce(i.pool, r.pool) AS pool,
           coalesce(i.since, r.start_ts) AS start_ts,
           CASE WHEN r.end_ts IS NOT NULL THEN r.end_ts
                WHEN i.next_since IS NOT NULL THEN i.last_ts END AS end_ts,
           (epoch_us(coalesce(r.end_ts, CASE WHEN i.next_since IS NULL THEN l.ts ELSE i.last_ts END))
            - epoch_us(coalesce(i.since, r.start_ts))) / 1e6 AS duration_s,
           CASE WHEN i.held THEN 'memory_held' WHEN NOT i.held THEN 'free' END AS grade,
           r.end_ts IS NULL AND i.next_since IS NULL AS ongoing,
           CASE WHEN r.end_ts IS NOT NULL THEN r.censored
                WHEN i.next_since IS NOT NULL THEN true END AS censored
    FROM idle AS i
    FULL OUTER JOIN runs AS r ON i.gpu_key = r.gpu_key AND i.since = r.start_ts
    LEFT JOIN last_decision AS l ON l.gpu_key = i.gpu_key""",
)

IB_PORT_INTERVALS = View(
    name="ib_port_intervals",
    summary=(
        "One row per InfiniBand port read (`ib_port_samples`), with the deltas since the "
        "previous read of each counter, by the rules of `contracts.counters` (module docstring "
        "of `analytics.views`): NULL where that read gives no delta (first read, reset, "
        "saturation, clock step, missing counter). The table macro "
        "`ib_port_intervals_between(t0, t1)` returns the reads with `t0 <= ts < t1` and reads only "
        "the raw rows from `t0` minus the largest gap on (fast on a time range)."
    ),
    columns=(
        ("port_key, host, device, node_guid, port", "identity"),
        ("ts", "time of the read that ends the interval"),
        ("rate_bytes_per_second", "link rate at that read, bytes/s"),
        ("xmit_data_words, rcv_data_words", "ΔPortXmitData, ΔPortRcvData, 4-octet words (HUGEINT)"),
        ("dt_s", "seconds since the previous read that had PortXmitData"),
        ("xmit_wait_ticks", "ΔPortXmitWait, ticks (HUGEINT)"),
        ("utilisation", "4·xmit_data_words / (dt_s·rate_bytes_per_second), 0..1 (not clamped)"),
        ("rcv_dt_s", "seconds since the previous read that had PortRcvData"),
        ("rcv_utilisation", "4·rcv_data_words / (rcv_dt_s·rate_bytes_per_second), 0..1 (not clamped)"),
    ),
    sql=f"CREATE OR REPLACE VIEW ib_port_intervals AS {_intervals_select('ib_port_samples')}",
)

IB_PORT_INTERVALS_BETWEEN = View(
    name="ib_port_intervals_between(t0, t1)",
    summary="Table macro: `ib_port_intervals` restricted to `t0 <= ts < t1` (TIMESTAMPs).",
    columns=(("(as ib_port_intervals)", ""),),
    sql=f"""CREATE OR REPLACE MACRO ib_port_intervals_between(t0, t1) AS TABLE
    WITH raw AS (
        SELECT * FROM ib_port_samples
        WHERE ts >= t0::TIMESTAMP - INTERVAL {int(DEFAULT_MAX_GAP_S)} SECOND AND ts < t1::TIMESTAMP
    )
    SELECT * FROM ({_intervals_select("raw")}) WHERE ts >= t0::TIMESTAMP""",
)

_HEADROOM_BODY = f"""
    WITH last AS (SELECT port_key, max(ts) AS last_ts FROM ib_port_samples GROUP BY port_key),
    raw AS (
        SELECT s.* FROM ib_port_samples AS s JOIN last USING (port_key)
        WHERE s.ts >= last.last_ts - to_seconds(window_s + {int(DEFAULT_MAX_GAP_S)})
    ),
    iv AS (
        SELECT i.* FROM ({_intervals_select("raw")}) AS i JOIN last USING (port_key)
        WHERE i.ts > last.last_ts - to_seconds(window_s)
    )
    SELECT port_key, arg_max(host, ts) AS host, arg_max(device, ts) AS device,
           arg_max(node_guid, ts) AS node_guid, arg_max(port, ts) AS port,
           max(ts) AS last_ts, arg_max(rate_bytes_per_second, ts) AS rate_bytes_per_second,
           count(utilisation) AS intervals,
           arg_max(utilisation, ts) AS utilisation_last,
           (4 * sum(xmit_data_words) FILTER (WHERE utilisation IS NOT NULL))::DOUBLE
             / nullif(sum(dt_s * rate_bytes_per_second) FILTER (WHERE utilisation IS NOT NULL), 0)
             AS utilisation_mean,
           quantile_cont(utilisation, 0.95) AS utilisation_p95,
           max(utilisation) AS utilisation_max,
           1 - quantile_cont(utilisation, 0.95) AS headroom,
           sum(xmit_wait_ticks) FILTER (WHERE xmit_data_words IS NOT NULL) AS xmit_wait_ticks,
           sum(xmit_data_words) FILTER (WHERE xmit_wait_ticks IS NOT NULL) AS xmit_data_words,
           (sum(xmit_wait_ticks) FILTER (WHERE xmit_data_words IS NOT NULL))::DOUBLE
             / nullif(sum(xmit_wait_ticks + xmit_data_words), 0) AS xmit_wait_fraction,
           count(rcv_utilisation) AS rcv_intervals,
           quantile_cont(rcv_utilisation, 0.95) AS rcv_utilisation_p95,
           1 - greatest(quantile_cont(utilisation, 0.95), quantile_cont(rcv_utilisation, 0.95))
             AS port_headroom
    FROM iv GROUP BY port_key"""

FABRIC_HEADROOM = View(
    name="fabric_headroom",
    summary=(
        f"One row per InfiniBand port: its link use over the last {HEADROOM_WINDOW_S // 60} minutes "
        "of its own reads (relative to its latest read, so replays and live data read alike), from "
        "`ib_port_intervals`. `fabric_headroom_over(window_s)` is the same over another window (s). "
        "XmitWait is given as a fraction of events, ΔXmitWait / (ΔXmitWait + ΔXmitData): a tick "
        "spent waiting against a word sent, so 0.5 is one tick per word (the "
        "GpupoolIbXmitWaitHigh alert's threshold); only intervals where both deltas are valid count."
    ),
    columns=(
        ("port_key, host, device, node_guid, port", "identity (of the latest read)"),
        ("last_ts", "latest read"),
        ("rate_bytes_per_second", "link rate of the latest read, bytes/s"),
        ("intervals", "intervals with a utilisation in the window"),
        ("utilisation_last", "utilisation of the latest such interval, 0..1"),
        ("utilisation_mean", "time-weighted: 4·Σwords / Σ(dt_s·rate), 0..1"),
        ("utilisation_p95, utilisation_max", "95th percentile (continuous) and maximum, 0..1"),
        ("headroom", "1 − utilisation_p95"),
        (
            "xmit_wait_ticks, xmit_data_words",
            "ΣΔPortXmitWait and ΣΔPortXmitData (HUGEINT) of the intervals where both are valid",
        ),
        ("xmit_wait_fraction", "xmit_wait_ticks / (xmit_wait_ticks + xmit_data_words), 0..1"),
        ("rcv_intervals", "intervals with a receive utilisation in the window"),
        ("rcv_utilisation_p95", "95th percentile (continuous) of `rcv_utilisation`, 0..1"),
        (
            "port_headroom",
            "1 − the larger of utilisation_p95 and rcv_utilisation_p95 (either alone when the "
            "other is NULL): the port's headroom in its busier direction",
        ),
    ),
    sql=f"CREATE OR REPLACE VIEW fabric_headroom AS SELECT * FROM fabric_headroom_over({HEADROOM_WINDOW_S})",
)

FABRIC_HEADROOM_OVER = View(
    name="fabric_headroom_over(window_s)",
    summary="Table macro: `fabric_headroom` over the last `window_s` seconds of each port.",
    columns=(("(as fabric_headroom)", ""),),
    sql=f"CREATE OR REPLACE MACRO fabric_headroom_over(window_s) AS TABLE {_HEADROOM_BODY}",
)

NODE_HEADROOM_OVER = View(
    name="node_headroom_over(window_s)",
    summary=(
        "Table macro: one row per host with InfiniBand reads, the headroom of its busiest port in "
        "its busier direction over the last `window_s` seconds of each port "
        "(`fabric_headroom_over(window_s)`): what `analytics.service` puts on every capacity "
        "update of the host's GPUs. A host whose ports have no valid interval yet has NULL "
        "headroom (unknown). Switch ports read from the fabric carry the switch's description as "
        "`host` and so match no GPU host."
    ),
    columns=(
        ("host", "host name, as on `ib_port_samples` (and on the GPU samples of that host)"),
        ("ports", "ports of the host in the window"),
        ("busiest_port_key", "port_key of the port with the least headroom (NULL if unknown)"),
        ("headroom", "min over the host's ports of `port_headroom`, 0..1 (not clamped); NULL if unknown"),
    ),
    sql="""CREATE OR REPLACE MACRO node_headroom_over(window_s) AS TABLE
    SELECT host, count(*) AS ports, arg_min(port_key, port_headroom) AS busiest_port_key,
           min(port_headroom) AS headroom
    FROM fabric_headroom_over(window_s) GROUP BY host""",
)

ALLOCATED_IDLE_GPU_HOURS = View(
    name="allocated_idle_gpu_hours",
    summary=(
        "One row per scheduler job that held GPUs: the GPU-hours its GPUs were allocated and, of "
        "those, idle by their telemetry (what the scheduler's own accounting counts as used). Each "
        "scheduler read of a GPU counts until the next read of that GPU (at most "
        f"{DEFAULT_MAX_GAP_S:.0f} s; the latest read counts 0) for the job it named, as idle when "
        "analytics had the GPU idle at that read."
    ),
    columns=(
        ("job_id, job_name, job_user, job_partition", "the job (as the scheduler names them)"),
        ("gpus", "distinct GPUs (host, index) it held"),
        ("allocated_gpu_hours", "GPU-hours allocated to it"),
        ("idle_gpu_hours", "of those, GPU-hours its GPUs were idle"),
        ("idle_share", "idle_gpu_hours / allocated_gpu_hours, 0..1"),
        ("first_ts, last_ts", "first and latest read that showed it holding a GPU"),
    ),
    sql=f"""CREATE OR REPLACE VIEW allocated_idle_gpu_hours AS
    WITH gaps AS (
        SELECT *, epoch_us(lead(ts) OVER (PARTITION BY host, gpu_index
                                          ORDER BY ts, kafka_partition, kafka_offset))
                  - epoch_us(ts) AS gap_us
        FROM scheduler_gpu_samples
    ),
    reads AS (
        SELECT *, CASE WHEN gap_us IS NOT NULL THEN least(gap_us, {_MAX_GAP_US}) / 3.6e9 END AS hours
        FROM gaps
    )
    SELECT job_id, any_value(job_name) AS job_name, any_value(job_user) AS job_user,
           any_value(job_partition) AS job_partition,
           count(DISTINCT (host, gpu_index)) AS gpus,
           coalesce(sum(hours), 0) AS allocated_gpu_hours,
           coalesce(sum(hours) FILTER (WHERE gpu_state = 'idle'), 0) AS idle_gpu_hours,
           CASE WHEN sum(hours) > 0
                THEN coalesce(sum(hours) FILTER (WHERE gpu_state = 'idle'), 0) / sum(hours) END
               AS idle_share,
           min(ts) AS first_ts, max(ts) AS last_ts
    FROM reads WHERE job_id IS NOT NULL
    GROUP BY job_id""",
)


VIEWS: tuple[View, ...] = (
    GPU_STATE_NOW,
    IDLE_WINDOWS,
    IB_PORT_INTERVALS,
    IB_PORT_INTERVALS_BETWEEN,
    FABRIC_HEADROOM_OVER,
    FABRIC_HEADROOM,
    NODE_HEADROOM_OVER,
    ALLOCATED_IDLE_GPU_HOURS,
)
"""Every view and macro, in creation order (a view after the macros it uses)."""


def views_markdown() -> str:
    """The README section documenting :data:`VIEWS` (Markdown: a heading per view, its summary,
    a table of columns)."""
    parts = [
        "### SQL views",
        "",
        (
            '`gpupool analytics sql "<query>" --db FILE` runs read-only SQL on the analytics DuckDB '
            "file. Besides the tables (`gpu_samples`, `ib_port_samples`, `gpu_states`, `idle_runs`, "
            "`gpu_rollup_1m`, `ib_port_rollup_1m`, `scheduler_gpu_samples`, `committed_offsets`, "
            "`kafka_sources`) and the view `consumer_offsets` (the next Kafka offset per partition: "
            "the larger of `committed_offsets` and the raw rows' own positions) it has these views. "
            "Times are UTC `TIMESTAMP`s, durations seconds; counter deltas are exact `HUGEINT`s."
        ),
        "",
    ]
    for v in VIEWS:
        parts += [f"#### `{v.name}`", "", v.summary, ""]
        if v.columns and v.columns[0][1]:
            parts += ["| column | meaning |", "| --- | --- |"]
            parts += [f"| `{c}` | {m} |" for c, m in v.columns]
            parts.append("")
    return "\n".join(parts)
