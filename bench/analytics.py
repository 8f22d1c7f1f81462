"""Benchmarks of the analytics stage, printed as ratios against a yardstick measured in the same run.

1. Ingest: ``--records`` GPU samples (1,000 GPUs, 8 per host, every 10 s) as the collectors
   produce them — one :class:`contracts.GpuScrape` record per read of a host's GPUs — through
   the stage's own ingest path: :func:`analytics.decode.decode_batch` (the record's JSON → the
   batch's columns), :func:`analytics.rows.gpu_scrapes_table` (→ the ``gpu_samples`` Arrow
   table), the classifier's input and :meth:`analytics.store.AnalyticsStore.write` (rows and
   offsets in one transaction; a store told its tables' topics, as the service's, so offsets
   the rows keep are not written again: :mod:`analytics.offsets`), as
   :meth:`analytics.service.AnalyticsService.step` calls them, timed from the records' bytes to
   the commit, in a process with the stage's allocator settings
   (:func:`analytics.allocator.keep_freed_heap`, as ``gpupool analytics run``). Yardstick: DuckDB's own bulk path on the same rows,
   ``INSERT INTO gpu_samples SELECT * FROM <arrow table>`` of the very tables the stage's path
   writes (built beforehand, not timed), one insert per transaction of the stage's path. Both
   into in-memory databases, run in turn ``--repeat`` times; the best of each is compared (a
   shared machine's noise only ever adds time). Target (issue 15): >= 50 %, with ``--batch``
   rows per transaction (the headline ratio). Also printed, each against its own yardstick:
   the same records ``--batch`` records per transaction (the stage's ``max_records``: 8 rows a
   record here), and the previous record format, one :class:`contracts.GpuSample` per GPU
   (older producers, replay files; :func:`analytics.rows.gpu_samples_table`), ``--batch``
   records per transaction. Each path's time includes the per-GPU input the stage makes of
   scrape records for the idle classifier (:meth:`analytics.scrapes.ScrapeColumns.observations`;
   per-sample records are decoded into such objects anyway). Then: the cost of each step per row
   (of the best run), the pydantic reference decode of per-sample records, and the classifier's
   throughput on the same samples. Each comparison prints the 1-minute load average before and after
   it.
2. Queries over ``--gpus`` GPUs × 24 h at 10 s (default 1,000 → 8.64 M rows, generated inside
   DuckDB, with the ``gpu_states`` / ``idle_runs`` rows the stage stores for them):
   ``gpu_state_now`` and the ``idle_windows`` view. Target: <= 1 s each. The gaps-and-islands
   query over the raw samples that the view replaces is timed too (and gives the same windows),
   and so is the maintenance step (1-minute rollups of the day, expiry).
3. Memory: in a child process (so its peak RSS is its own), ``--memory-rows`` GPU samples
   (default 8.64 M: 1,000 GPUs × 24 h at 10 s) generated batch by batch, one record per sample
   (the previous format, the one with the most Python objects per row), go through the same ingest
   path into a DuckDB file opened with ``--memory-limit`` (the process limit: DuckDB gets
   :data:`analytics.store.DUCKDB_MEMORY_SHARE` of it); its peak RSS (``VmHWM``) is printed
   against the limit. Target: under it.

Usage: ``python bench/analytics.py [--records 100000] [--repeat 3] [--clock wall|thread]
[--gpus 1000] [--memory-rows 8640000] [--memory-limit 2GB]`` (``--memory-rows 0`` skips phase 3,
``--gpus 0`` phase 2). ``--clock thread`` times phase 1 by CPU time with DuckDB on one thread
on both sides (see :class:`_Clock`): the figure to compare on a shared, loaded machine.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pyarrow as pa
from pydantic_core import to_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analytics.allocator import keep_freed_heap
from analytics.classify import FB_USED, GPU_UTIL, GR_ENGINE_ACTIVE, SM_ACTIVE, IdleClassifier
from analytics.decode import DecodedBatch, decode_batch, decode_telemetry, paused_gc
from analytics.offsets import table_topics
from analytics.retention import RetentionConfig
from analytics.rows import gpu_samples_table, gpu_scrapes_table
from analytics.store import DUCKDB_MEMORY_SHARE, AnalyticsStore, StoreBatch, parse_bytes
from contracts import GpuSample, KafkaTopics, encode, gpu_scrapes
from contracts.bus import BusMessage, TopicPartition

TOPICS = KafkaTopics()
T0 = 1_700_000_000.0


class _Clock:
    """What the ingest comparison times (``--clock``): ``wall`` — elapsed time
    (``time.perf_counter``), DuckDB with its default threads, as the stage runs; ``thread`` — CPU
    time of the benchmark's thread (``time.thread_time``) with DuckDB on one thread (which then
    runs every query on the calling thread) and the scrape records read by that thread alone
    (:data:`analytics.scrapes.DECODE_THREADS` otherwise), so both sides count all their work
    and none of the time other processes of a shared machine take."""

    def __init__(self) -> None:
        self.now = time.perf_counter
        self.threads: int | None = None

    def use(self, kind: str) -> None:
        """Switch to ``wall`` or ``thread`` (raises ``ValueError`` for another)."""
        if kind not in ("wall", "thread"):
            raise ValueError(f"clock {kind!r}: wall or thread")
        self.now = time.perf_counter if kind == "wall" else time.thread_time
        self.threads = None if kind == "wall" else 1


_CLOCK = _Clock()


def _fields(rng: random.Random) -> dict[str, float | int]:
    """The DCGM fields every generated H100 sample has (random activity and framebuffer use)."""
    return {
        GR_ENGINE_ACTIVE: round(rng.random(), 6),
        SM_ACTIVE: round(rng.random(), 6),
        GPU_UTIL: rng.randrange(101),
        FB_USED: rng.randrange(81_000),
        "DCGM_FI_DEV_FB_FREE": 1000,
        "DCGM_FI_DEV_POWER_USAGE": 123.456,
    }


def _messages(n: int, gpus: int) -> list[BusMessage]:
    """``n`` encoded GPU samples as the bus delivers them (one partition)."""
    rng = random.Random(1)
    out = []
    for i in range(n):
        g = i % gpus
        s = GpuSample(
            ts=T0 + (i // gpus) * 10.0,
            host=f"node-{g // 8:04d}",
            gpu_uuid=f"GPU-{g:08x}-0000-0000-0000-000000000000",
            gpu_index=g % 8,
            model_name="NVIDIA H100 80GB HBM3",
            fields={**_fields(rng), "DCGM_FI_DEV_GPU_TEMP": 41, "DCGM_FI_DEV_SM_CLOCK": 1980},
            attributes={"pod": f"pod-{g}", "namespace": "team-a"},
            target="http://127.0.0.1:9400/metrics",
            seq=i,
        )
        out.append(BusMessage(TOPICS.telemetry_gpu, 0, i, s.partition_key, encode(s)))
    return out


def _gpu(msg: BusMessage) -> GpuSample:
    rec = decode_telemetry(msg, TOPICS)
    assert isinstance(rec, GpuSample)
    return rec


def _ingest(store: AnalyticsStore, chunk: list[BusMessage], times: list[float]) -> int:
    """The stage's ingest path for one batch, as :meth:`analytics.service.AnalyticsService.step`
    runs it; adds the seconds of decode, rows, classifier input and write to ``times``; returns
    the rows written. Scrape records become rows with :func:`analytics.rows.gpu_scrapes_table`,
    per-sample records with :func:`analytics.rows.gpu_samples_table`. The classifier input is
    what the stage makes of scrape records for the idle classifier
    (:meth:`analytics.scrapes.ScrapeColumns.observations`: the per-GPU objects that the decode
    of per-sample records makes anyway), so both formats are timed for the same work."""
    tp = TopicPartition(TOPICS.telemetry_gpu, 0)
    t0 = _CLOCK.now()
    batch = decode_batch(chunk, TOPICS, _CLOCK.threads)
    t1 = _CLOCK.now()
    with paused_gc():
        table = _rows(batch)
        t2 = _CLOCK.now()
        observed = batch.scrapes.observations()
    t3 = _CLOCK.now()
    store.write(StoreBatch(gpu_samples=table, offsets={tp: chunk[-1].offset + 1}))
    t4 = _CLOCK.now()
    for k, dt in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
        times[k] += dt
    assert len(observed) + len(batch.gpu) == table.num_rows
    return table.num_rows


def _rows(batch: DecodedBatch) -> pa.Table:
    """The ``gpu_samples`` rows of a decoded batch (scrape records' and per-sample records')."""
    tables = []
    scrapes = batch.scrapes
    if scrapes.msgs:
        msgs = scrapes.msgs
        tables.append(gpu_scrapes_table(scrapes, [m.partition for m in msgs], [m.offset for m in msgs]))
    if batch.gpu:
        msgs = batch.gpu_msgs
        tables.append(gpu_samples_table(batch.gpu, [m.partition for m in msgs], [m.offset for m in msgs]))
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables)


def _chunks(msgs: list[BusMessage], per: int) -> list[list[BusMessage]]:
    return [msgs[i : i + per] for i in range(0, len(msgs), per)]


def _compare(
    label: str, chunks: list[list[BusMessage]], memory_limit: str, repeat: int
) -> tuple[float, float, list[float], int]:
    """Ingest ``chunks`` (one transaction each) through the stage's path and insert the same rows
    (the Arrow tables that path writes, built beforehand) with the yardstick, in turn ``repeat``
    times; print and return ``(yardstick s, path s, per-step s of the best run, rows)``."""
    with paused_gc():
        tables = [_rows(decode_batch(c, TOPICS)) for c in chunks]
    n = sum(t.num_rows for t in tables)
    gc.collect()
    load = os.getloadavg()[0]
    yard_runs: list[float] = []
    e2e_runs: list[tuple[float, list[float]]] = []
    for _ in range(max(1, repeat)):
        # in-memory databases, as the measurement (phase 3 writes a file)
        yard = AnalyticsStore(":memory:", memory_limit=memory_limit, threads=_CLOCK.threads)
        con = yard.cursor()
        t = _CLOCK.now()
        for tbl in tables:
            con.register("b", tbl)
            con.execute("INSERT INTO gpu_samples SELECT * FROM b")
            con.unregister("b")
        yard_runs.append(_CLOCK.now() - t)
        con.close()
        yard.close()
        # the stage's path: decode → Arrow → one transaction with offsets
        store = AnalyticsStore(
            ":memory:", memory_limit=memory_limit, threads=_CLOCK.threads, sources=table_topics(TOPICS)
        )
        steps = [0.0, 0.0, 0.0, 0.0]
        t = _CLOCK.now()
        rows = sum(_ingest(store, c, steps) for c in chunks)
        e2e_runs.append((_CLOCK.now() - t, steps))
        store.close()
        assert rows == n
        gc.collect()
    yard_s = min(yard_runs)
    e2e_s, steps = min(e2e_runs)
    us = 1e6 / n
    print(
        f"  {label}: {n:,} rows in {len(chunks)} transactions of up to {max(t.num_rows for t in tables):,} rows"
        f" (load average {load:.2f} -> {os.getloadavg()[0]:.2f})"
    )
    print(f"    yardstick  INSERT FROM arrow    {n / yard_s:12,.0f} rows/s   {yard_s * us:5.2f} us/row")
    print(
        f"    gpupool    decode→arrow→duckdb  {n / e2e_s:12,.0f} rows/s   {e2e_s * us:5.2f} us/row"
        f"   ratio {yard_s / e2e_s:6.1%}"
    )
    print(
        f"      per row: decode_batch {steps[0] * us:.2f} us, rows {steps[1] * us:.2f} us,"
        f" classifier input {steps[2] * us:.2f} us, store.write {steps[3] * us:.2f} us;"
        f" all runs, us/row: yardstick"
        f" {' '.join(f'{y * us:.2f}' for y in yard_runs)}; gpupool {' '.join(f'{e * us:.2f}' for e, _ in e2e_runs)}"
    )
    return yard_s, e2e_s, steps, n


def _scrape_messages(samples: list[GpuSample]) -> list[BusMessage]:
    """``samples`` as the collectors now produce them: one :class:`contracts.GpuScrape` record
    per read of a host (:func:`contracts.gpu_scrapes`), on one partition."""
    return [
        BusMessage(TOPICS.telemetry_gpu, 0, i, r.partition_key, encode(r))
        for i, r in enumerate(gpu_scrapes(samples))
    ]


def bench_ingest(n: int, batch: int, memory_limit: str, repeat: int = 3) -> None:
    """Print the ingest of ``n`` GPU samples (1,000 GPUs, 8 per host) against the Arrow bulk
    insert of the same rows (best of ``repeat`` runs of each, in turn): as scrape records,
    ``batch`` records per transaction (the stage's ``max_records``: the headline ratio) and
    ``batch`` rows per transaction; as per-sample records (the previous format), ``batch``
    records (= rows) per transaction."""
    msgs = _messages(n, gpus=1000)
    decoded = [_gpu(m) for m in msgs]
    scrape_msgs = _scrape_messages(decoded)
    per_record = n // len(scrape_msgs)
    t = time.perf_counter()
    clf = IdleClassifier()
    for s in decoded:
        clf.observe(s)
    clf_s = time.perf_counter() - t
    del decoded, clf  # the stage holds one batch of samples, not the whole run
    gc.collect()
    print(
        f"ingest of {n:,} GPU samples (1,000 GPUs, {per_record} per host), best of {max(1, repeat)} runs each:"
    )
    yard_s, e2e_s, _, _ = _compare(
        f"scrape records (GpuScrape), {batch} rows per transaction",
        _chunks(scrape_msgs, max(1, batch // per_record)),
        memory_limit,
        repeat,
    )
    print(f"    => ratio {yard_s / e2e_s:6.1%}  (target >= 50%)")
    _compare(
        f"scrape records (GpuScrape), {batch} records per transaction (the stage's max_records)",
        _chunks(scrape_msgs, batch),
        memory_limit,
        repeat,
    )
    _compare(
        f"per-sample records (GpuSample, the previous format), {batch} records per transaction",
        _chunks(msgs, batch),
        memory_limit,
        repeat,
    )
    t = time.perf_counter()
    for c in _chunks(msgs, batch):  # a batch's samples live until the next, as in the stage
        kept: list[object] = [decode_telemetry(m, TOPICS) for m in c]
    per_record_s = time.perf_counter() - t
    del kept
    fallbacks = sum(decode_batch(c, TOPICS).fallbacks for c in _chunks(scrape_msgs, batch))
    us = 1e6 / n
    print(
        f"  the pydantic reference decode_telemetry of per-sample records {per_record_s * us:.2f} us/row;"
        f" scrape records decided by the reference: {fallbacks}"
    )
    print(f"  classifier observe()              {n / clf_s:12,.0f} samples/s")


def _memory_messages(rows: int, gpus: int, batch: int) -> Iterator[list[BusMessage]]:
    """``rows`` GPU samples (``gpus`` GPUs, every 10 s) as bus messages, ``batch`` at a time, so
    the benchmark itself holds one batch. Encoded with pydantic-core's serializer from a dict in
    the model's member order: the bytes :func:`contracts.encode` writes (checked on the first)."""
    rng = random.Random(2)
    out: list[BusMessage] = []
    for i in range(rows):
        g = i % gpus
        record = {
            "schema_version": 1,
            "ts": T0 + (i // gpus) * 10.0,
            "host": f"node-{g // 8:04d}",
            "gpu_uuid": f"GPU-{g:08x}-0000-0000-0000-000000000000",
            "gpu_index": g % 8,
            "gpu_instance_id": None,
            "gpu_instance_profile": None,
            "model_name": "NVIDIA H100 80GB HBM3",
            "fields": _fields(rng),
            "field_series": {},
            "invalid": {},
            "attributes": {"pod": f"pod-{g}", "namespace": "team-a"},
            "source": "dcgm-exporter",
            "target": "http://127.0.0.1:9400/metrics",
            "seq": i,
        }
        value = to_json(record)
        if i == 0:
            assert value == encode(GpuSample.model_validate(record)), "generator drifted from encode()"
        out.append(BusMessage(TOPICS.telemetry_gpu, 0, i, record["host"], value))
        if len(out) == batch:
            yield out
            out = []
    if out:
        yield out


def memory_phase(rows: int, batch: int, memory_limit: str) -> None:
    """Phase 3, run in a child process: ingest ``rows`` samples into a DuckDB file and print one
    ``RESULT rows seconds peak_rss_bytes`` line."""
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as tmp:
        store = AnalyticsStore(
            str(Path(tmp) / "memory.duckdb"), memory_limit=memory_limit, sources=table_topics(TOPICS)
        )
        steps = [0.0, 0.0, 0.0, 0.0]
        t = time.perf_counter()
        done = sum(_ingest(store, chunk, steps) for chunk in _memory_messages(rows, 1000, batch))
        elapsed = time.perf_counter() - t
        _, [(stored,)] = store.sql("SELECT count(*) FROM gpu_samples")
        store.close()
    assert done == stored == rows
    print(f"RESULT {rows} {elapsed:.3f} {_peak_rss_bytes()}")


def _peak_rss_bytes() -> int:
    """This process's peak RSS: ``VmHWM`` of ``/proc/self/status`` (Linux). Not ``ru_maxrss``,
    which a child started by fork and exec inherits from its parent's size at the fork."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench_memory(rows: int, batch: int, memory_limit: str) -> None:
    """Run :func:`memory_phase` in a child process and print its peak RSS against the limit."""
    child = subprocess.run(
        [sys.executable, __file__, "--memory-phase", "--memory-rows", str(rows), "--batch", str(batch),
         "--memory-limit", memory_limit],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    line = next(x for x in child.stdout.splitlines() if x.startswith("RESULT "))
    _, n, seconds, rss = line.split()
    limit = parse_bytes(memory_limit)
    peak = int(rss)
    print(
        f"memory: ingest of {int(n):,} rows into a DuckDB file ({int(n) / float(seconds):,.0f} rows/s),"
        f" memory_limit {memory_limit} (DuckDB's share {DUCKDB_MEMORY_SHARE:.0%}):"
    )
    print(
        f"  peak RSS {peak / 2**20:,.0f} MiB = {peak / limit:.0%} of the limit"
        f" ({limit / 2**20:,.0f} MiB)   {'ok' if peak < limit else 'OVER'} (target: under the limit)"
    )


_STEP_S = 10  # sample interval
_BLOCK = 30  # samples per activity block (300 s): idle with probability 1/3
_MIN_IDLE_S = 60  # the stage's default IdleConfig.min_idle_s
_REFRESH_S = 30  # the stage's default refresh_s


def _generate(con: duckdb.DuckDBPyConnection, gpus: int) -> int:
    """Fill ``gpu_samples`` with ``gpus`` × 8,640 rows (24 h at 10 s), and ``gpu_states`` /
    ``idle_runs`` with what the stage stores for those samples (defaults: idle after 60 s, every
    GPU refreshed every 30 s); return the raw row count. Activity comes in 300 s blocks, idle
    with probability 1/3, so state episodes are the islands of equal blocks."""
    rows = gpus * 8640
    con.execute(
        f"""INSERT INTO gpu_samples BY NAME
        SELECT make_timestamp(CAST({int(T0)} + (i % 8640) * {_STEP_S} AS BIGINT) * 1000000) AS ts,
               'node-' || (g // 8) || '/GPU-' || g AS gpu_key, 'node-' || (g // 8) AS host,
               'GPU-' || g AS gpu_uuid, 'NVIDIA H100 80GB HBM3' AS model_name,
               CASE WHEN hash(g, (i % 8640) // {_BLOCK}) % 3 = 0 THEN 0.0 ELSE 0.6 END AS gr_engine_active,
               1024 AS fb_used_mib, '{{}}' AS fields, '{{}}' AS invalid, '{{}}' AS attributes,
               0 AS kafka_partition, i AS kafka_offset
        FROM (SELECT i, i // 8640 AS g FROM range({rows}) r(i))"""
    )
    block_s = _BLOCK * _STEP_S
    con.execute(
        f"""CREATE TEMP TABLE episodes AS
        WITH b AS (
            SELECT g, b, hash(g, b) % 3 = 0 AS idle FROM range({gpus}) t(g), range({8640 // _BLOCK}) u(b)
        ),
        isl AS (SELECT *, b - row_number() OVER (PARTITION BY g, idle ORDER BY b) AS grp FROM b)
        SELECT g, idle, min(b) AS b0, max(b) AS b1 FROM isl GROUP BY g, idle, grp"""
    )
    # since: first sample of the episode; decided at since (busy) or since + min_idle_s (idle);
    # refreshed every 30 s until the next episode is decided (or the end of the data).
    con.execute(
        f"""INSERT INTO gpu_states BY NAME
        WITH e AS (
            SELECT g, idle, {int(T0)} + b0 * {block_s} AS since,
                   {int(T0)} + b0 * {block_s} + CASE WHEN idle THEN {_MIN_IDLE_S} ELSE 0 END AS decided,
                   coalesce(lead({int(T0)} + b0 * {block_s} + CASE WHEN idle THEN {_MIN_IDLE_S} ELSE 0 END)
                            OVER (PARTITION BY g ORDER BY b0), {int(T0)} + 86400) AS until
            FROM episodes
        )
        SELECT make_timestamp(CAST(t AS BIGINT) * 1000000) AS ts, 'node-' || (g // 8) || '/GPU-' || g AS gpu_key,
               'node-' || (g // 8) AS host, 'GPU-' || g AS gpu_uuid, 'NVIDIA H100 80GB HBM3' AS model_name,
               'default' AS pool, CASE WHEN idle THEN 'idle' ELSE 'busy' END AS state,
               make_timestamp(CAST(since AS BIGINT) * 1000000) AS since,
               CASE WHEN idle THEN 'memory_held' END AS grade,
               'DCGM_FI_PROF_GR_ENGINE_ACTIVE' AS reason, t = decided AS transition
        FROM e, unnest(generate_series(decided, until - 1, {_REFRESH_S})) AS s(t)"""
    )
    con.execute(
        f"""INSERT INTO idle_runs BY NAME
        SELECT 'node-' || (g // 8) || '/GPU-' || g AS gpu_key, 'NVIDIA H100 80GB HBM3' AS model_name,
               'default' AS pool, make_timestamp(CAST({int(T0)} + b0 * {block_s} AS BIGINT) * 1000000) AS start_ts,
               make_timestamp(CAST({int(T0)} + (b1 + 1) * {block_s} - {_STEP_S} AS BIGINT) * 1000000) AS end_ts,
               (b1 + 1 - b0) * {block_s} - {_STEP_S} AS duration_s, false AS censored
        FROM episodes WHERE idle AND b1 < {8640 // _BLOCK - 1}"""
    )
    return rows


def bench_queries(gpus: int, memory_limit: str) -> None:
    """Print the time of the operator queries over ``gpus`` × 8,640 rows, and of the maintenance
    step (1-minute rollups, then expiry) over the same day."""
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as tmp:
        store = AnalyticsStore(str(Path(tmp) / "queries.duckdb"), memory_limit=memory_limit)
        try:
            _bench_queries(store, gpus)
        finally:
            store.close()


def _bench_queries(store: AnalyticsStore, gpus: int) -> None:
    con = store.cursor()
    t = time.perf_counter()
    rows = _generate(con, gpus)
    [(n_states, n_transitions)] = con.execute(
        "SELECT count(*), count(*) FILTER (WHERE transition) FROM gpu_states"
    ).fetchall()
    print(
        f"queries over {gpus:,} GPUs x 24 h at 10 s = {rows:,} rows, {n_states:,} state rows"
        f" ({n_transitions:,} transitions; generated in {time.perf_counter() - t:.1f} s):"
    )
    queries = {
        "gpu_state_now": "SELECT count(*), count(DISTINCT host) FROM gpu_state_now",
        "idle_windows (view)": "SELECT count(*), sum(duration_s) FROM idle_windows",
        "idle islands, raw scan": f"""
            WITH s AS (SELECT gpu_key, ts, gr_engine_active <= 0.05 AS idle FROM gpu_samples),
            g AS (SELECT *, row_number() OVER (PARTITION BY gpu_key ORDER BY ts)
                          - row_number() OVER (PARTITION BY gpu_key, idle ORDER BY ts) AS grp FROM s)
            SELECT count(*), sum(epoch(e) - epoch(b)) FROM (
                SELECT gpu_key, min(ts) AS b, max(ts) AS e FROM g WHERE idle GROUP BY gpu_key, grp
                HAVING max(ts) - min(ts) >= INTERVAL {_MIN_IDLE_S} SECOND)""",
    }
    for name, q in queries.items():
        t = time.perf_counter()
        result = con.execute(q).fetchall()
        dt = time.perf_counter() - t
        verdict = (
            "(yardstick: what the view replaces)"
            if "raw" in name
            else (f"{'ok' if dt <= 1.0 else 'over'} (target <= 1 s)")
        )
        print(f"  {name:24s} {dt:6.2f} s   {verdict}   {result[0]}")
    retention = RetentionConfig()  # raw 24 h, rollups 30 days, at most 1 h rolled per run
    now = T0 + 86_400 + 3600
    runs: list[float] = []
    rolled = expired = 0
    while True:  # catch up with the whole day, one bounded run at a time
        t = time.perf_counter()
        result = store.maintain(retention, now=now)
        runs.append(time.perf_counter() - t)
        rolled += result.rollup_rows["gpu_rollup_1m"]
        expired += sum(result.expired_rows.values())
        if result.rolled_to is None:
            break
    print(
        f"  maintenance, catch-up    {sum(runs):6.2f} s   {len(runs)} runs (longest {max(runs):.2f} s):"
        f" {rolled:,} GPU-minutes rolled up, {expired:,} rows expired"
    )
    t = time.perf_counter()
    store.maintain(retention, now=now + 60)
    print(f"  maintenance, one minute  {time.perf_counter() - t:6.2f} s   (steady state, every 60 s)")


def main() -> None:
    """Run every benchmark and print the results."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000, help="GPU samples for the ingest benchmark")
    ap.add_argument("--batch", type=int, default=5000, help="records per transaction")
    ap.add_argument("--repeat", type=int, default=3, help="ingest runs of each path (the best is compared)")
    ap.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="ingest timed by elapsed time (DuckDB's default threads) or by this thread's CPU time"
        " (DuckDB on one thread: steady on a loaded machine)",
    )
    ap.add_argument("--gpus", type=int, default=1000, help="GPUs for the query benchmark (x 8,640 rows)")
    ap.add_argument(
        "--memory-rows", type=int, default=8_640_000, help="GPU samples of the memory phase (0: skip)"
    )
    ap.add_argument(
        "--memory-limit", default="2GB", help="memory the stage's process may use (DuckDB gets a share)"
    )
    ap.add_argument("--memory-phase", action="store_true", help=argparse.SUPPRESS)  # the child of phase 3
    args = ap.parse_args()
    keep_freed_heap()  # as `gpupool analytics run` does
    if args.memory_phase:
        memory_phase(args.memory_rows, args.batch, args.memory_limit)
        return
    _CLOCK.use(args.clock)
    print(f"clock: {args.clock}")
    bench_ingest(args.records, args.batch, args.memory_limit, args.repeat)
    if args.gpus:
        bench_queries(args.gpus, args.memory_limit)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        f"peak RSS of phases 1-2 {rss / 2**20:,.0f} MiB = {rss / parse_bytes(args.memory_limit):.0%} of"
        f" memory_limit {args.memory_limit} (includes the benchmark's own messages and tables)"
    )
    if args.memory_rows:
        bench_memory(args.memory_rows, args.batch, args.memory_limit)


if __name__ == "__main__":
    main()
