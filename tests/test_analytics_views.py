"""The operator views, rollups, retention and capacity gauges of the analytics stage.

The counter views are checked against :class:`contracts.counters.CounterTracker` and
:func:`contracts.counters.link_utilisation` on the same rows; ``idle_windows`` against the idle
runs the real service decided and against a gaps-and-islands query over the raw samples.
"""

from __future__ import annotations

import datetime as dt
import itertools
import random
import statistics
from pathlib import Path

import duckdb
import pytest

from analytics.classify import FB_TOTAL, FB_USED, GR_ENGINE_ACTIVE, IdleConfig
from analytics.retention import RetentionConfig
from analytics.rows import gpu_samples_table, gpu_states_table, ib_port_samples_table
from analytics.service import AnalyticsService
from analytics.store import STORE_SCHEMA_VERSION, AnalyticsStore, StoreBatch, StoreSchemaError
from analytics.views import HEADROOM_WINDOW_S, VIEWS, views_markdown
from contracts import CapacityUpdate, GpuSample, GpuState, IbPortSample, IdleGrade, KafkaTopics, encode
from contracts.bus import MemoryBus, TopicPartition
from contracts.counters import CounterTracker, link_utilisation
from tests.support import Clock

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z
RATE = 50_000_000_000  # NDR 400 Gb/s in bytes/s
TOPICS = KafkaTopics()
MODEL = "NVIDIA H100 80GB HBM3"


def utc(t: float) -> dt.datetime:
    return dt.datetime(1970, 1, 1) + dt.timedelta(microseconds=round(t * 1e6))


def port_sample(t: float, xmit: int | None, wait: int | None, *, port: int = 1, **kw: object) -> IbPortSample:
    return IbPortSample(
        ts=T0 + t,
        host="node-1",
        device="mlx5_0",
        node_guid="0x0000000000000001",
        port=port,
        rate_bytes_per_second=RATE,
        counters={"PortXmitData": xmit, "PortRcvData": xmit, "PortXmitWait": wait},
        counter_bits={"PortXmitData": 64, "PortRcvData": 64, "PortXmitWait": 32},
        **kw,  # type: ignore[arg-type]
    )


def write_ports(store: AnalyticsStore, samples: list[IbPortSample], first_offset: int = 0) -> None:
    offsets = list(range(first_offset, first_offset + len(samples)))
    store.write(StoreBatch(ib_port_samples=ib_port_samples_table(samples, [0] * len(samples), offsets)))


def tracker_intervals(
    samples: list[IbPortSample],
) -> list[tuple[float, int | None, int | None, float | None]]:
    """(ts, ΔPortXmitData, ΔPortXmitWait, utilisation) per read, as contracts.counters says."""
    tracker = CounterTracker()
    out = []
    for s in samples:
        sat = set(s.saturated)
        x = tracker.update(s.key, "PortXmitData", s.counters["PortXmitData"], s.ts, 64, "PortXmitData" in sat)
        w = tracker.update(s.key, "PortXmitWait", s.counters["PortXmitWait"], s.ts, 32, "PortXmitWait" in sat)
        util = None
        if x.delta is not None and x.dt_s is not None and s.rate_bytes_per_second:
            util = link_utilisation(x.delta, x.dt_s, s.rate_bytes_per_second)
        out.append((s.ts, x.delta, w.delta, util))
    return out


# ---------------------------------------------------------------------------------------------
# ib_port_intervals / fabric_headroom: the SQL agrees with contracts.counters on the same rows


EDGE_CASES: list[tuple[float, int | None, int | None, list[str]]] = [
    (0, 100, 5, []),  # first read: no delta
    (10, 2**53 + 100, 7, []),  # past 2**53: exact
    (20, None, 9, []),  # PortXmitData unreadable: baseline kept
    (30, 2**53 + 5000, 2**32 - 1, []),  # delta over 20 s; XmitWait saturated (32-bit all-ones)
    (40, 10, 3, []),  # both dropped: reset
    (40, 20, 4, []),  # same ts: clock step
    (500, 30, 5, []),  # gap 460 s > 300 s: clock step
    (510, 2**64 - 1, 6, []),  # PortXmitData saturated at 64-bit all-ones
    (520, 5, 7, []),  # after saturation: reset
    (530, 2**60, 8, ["PortXmitWait"]),  # flagged saturated by the source
    (540, 2**60 + 10**9, 9, []),
]


def test_intervals_match_counter_tracker_on_edge_cases() -> None:
    store = AnalyticsStore()
    samples = [port_sample(t, x, w, saturated=sat) for t, x, w, sat in EDGE_CASES]
    write_ports(store, samples)
    _, rows = store.sql(
        "SELECT epoch_us(ts) / 1e6, xmit_data_words, xmit_wait_ticks, utilisation, typeof(xmit_data_words)"
        " FROM ib_port_intervals ORDER BY ts"
    )
    # the two reads at t=40 sort by Kafka offset: the SQL's order is the tracker's order
    _, order = store.sql(
        "SELECT kafka_offset FROM ib_port_samples ORDER BY ts, kafka_partition, kafka_offset"
    )
    assert [o for (o,) in order] == list(range(len(samples)))
    expected = tracker_intervals(samples)
    assert [(r[0], r[1], r[2]) for r in rows] == [(ts, d, w) for ts, d, w, _ in expected]
    for (_, _, _, util, kind), (_, _, _, want) in zip(rows, expected, strict=True):
        assert kind == "HUGEINT"
        assert util == (None if want is None else pytest.approx(want, rel=1e-12))
    assert sum(1 for *_, u in expected if u is not None) == 4  # at t = 10, 30, 530, 540


def test_headroom_matches_python_on_random_traffic() -> None:
    rng = random.Random(4)
    store = AnalyticsStore()
    samples: list[IbPortSample] = []
    for port in (1, 2):
        xmit, wait, t = rng.randrange(2**62), rng.randrange(2**20), 0.0
        for _ in range(300):  # 300 reads, 5..15 s apart: ~50 min, beyond the 15 min window
            t += rng.choice((5.0, 10.0, 15.0))
            xmit += rng.randrange(int(0.9 * RATE * 15 / 4))
            wait += rng.randrange(10_000)
            samples.append(port_sample(t, xmit, wait, port=port))
    write_ports(store, samples)
    for port in (1, 2):
        mine = [s for s in samples if s.port == port]
        last = mine[-1].ts
        intervals = [iv for iv in tracker_intervals(mine) if iv[0] > last - HEADROOM_WINDOW_S]
        utils = [u for *_, u in intervals if u is not None]
        words = sum(d for _, d, _, _ in intervals if d is not None)
        waits = sum(w for _, d, w, _ in intervals if w is not None and d is not None)
        seconds = sum(b.ts - a.ts for a, b in itertools.pairwise(mine) if b.ts > last - HEADROOM_WINDOW_S)
        _, [row] = store.sql(
            "SELECT intervals, utilisation_p95, utilisation_max, utilisation_mean, headroom,"
            " xmit_wait_ticks, xmit_data_words, xmit_wait_fraction, utilisation_last"
            " FROM fabric_headroom WHERE port = ?",
            [port],
        )
        p95 = statistics.quantiles(utils, n=100, method="inclusive")[94]
        assert row[0] == len(utils) and 60 <= len(utils) < 300
        assert row[1] == pytest.approx(p95, rel=1e-9)
        assert row[2] == pytest.approx(max(utils), rel=1e-12)
        assert row[3] == pytest.approx(4 * words / (seconds * RATE), rel=1e-9)
        assert row[4] == pytest.approx(1 - p95, rel=1e-9)
        assert (row[5], row[6]) == (waits, words)  # exact integers
        assert row[7] == pytest.approx(waits / (waits + words), rel=1e-9)
        assert row[8] == pytest.approx(utils[-1], rel=1e-12)
    # another window through the macro
    _, [(n,)] = store.sql("SELECT intervals FROM fabric_headroom_over(60) WHERE port = 1")
    assert 4 <= n <= 12


# ---------------------------------------------------------------------------------------------
# idle_windows: from the stored transitions, equal to what the service decided


def gpu(ts: float, uuid: str, activity: float, fb: int = 100) -> GpuSample:
    return GpuSample(
        ts=ts,
        host="node-1",
        gpu_uuid=uuid,
        model_name=MODEL,
        fields={GR_ENGINE_ACTIVE: activity, FB_USED: fb, FB_TOTAL: 81_559},
    )


PATTERNS = {  # activity per 10 s sample, 0..290 s
    "GPU-a": [0.0] * 10 + [0.9] * 5 + [0.0] * 15,  # idle 0..90, busy 100..140, idle 150..290 (open)
    "GPU-b": [0.9] * 30,  # never idle
    "GPU-c": [0.0] * 8 + [0.5] + [0.0] * 3 + [0.9] * 18,  # short runs: idle 0..70 then busy
}


async def _run_service(tmp_path: Path, stale_gpu: bool = True) -> tuple[AnalyticsService, MemoryBus, Clock]:
    bus, clock = MemoryBus(), Clock(T0)
    svc = AnalyticsService(
        bus=bus,
        topics=TOPICS,
        db_path=str(tmp_path / "a.duckdb"),
        idle=IdleConfig(min_idle_s=30.0, stale_after_s=25.0),
        clock=clock,
        refresh_s=20.0,
    )
    await svc.start()
    producer = bus.producer()
    for i in range(30):
        t = T0 + 10 * i
        for uuid, pattern in PATTERNS.items():
            fb = 40_000 if uuid == "GPU-a" and 17 <= i <= 20 else 100  # memory held for a while
            s = gpu(t, uuid, pattern[i], fb)
            await producer.send(TOPICS.telemetry_gpu, encode(s), key=s.key)
        if stale_gpu and i < 12:  # GPU-d: idle, then silent: stale, a censored run
            s = gpu(t, "GPU-d", 0.0)
            await producer.send(TOPICS.telemetry_gpu, encode(s), key=s.key)
        clock.t = t
        while await svc.step(timeout_s=0.01):
            pass
    return svc, bus, clock


async def test_idle_windows_are_the_runs_the_service_decided(tmp_path: Path) -> None:
    svc, _, _ = await _run_service(tmp_path)
    try:
        _, rows = svc.store.sql(
            "SELECT gpu_key, epoch(start_ts) - ?, epoch(end_ts) - ?, duration_s, grade, ongoing, censored"
            " FROM idle_windows ORDER BY gpu_key, start_ts",
            [T0, T0],
        )
        assert rows == [
            ("node-1/GPU-a", 0.0, 90.0, 90.0, "free", False, False),
            ("node-1/GPU-a", 150.0, None, 140.0, "memory_held", True, None),
            ("node-1/GPU-c", 0.0, 70.0, 70.0, "free", False, False),  # 0.5 between thresholds: hysteresis
            ("node-1/GPU-d", 0.0, 110.0, 110.0, "free", False, True),  # went stale
        ]
        # Transitions are few; refreshes are many and flagged.
        _, [(transitions, refreshes)] = svc.store.sql(
            "SELECT count(*) FILTER (WHERE transition), count(*) FILTER (WHERE NOT transition) FROM gpu_states"
        )
        assert transitions < 20 < refreshes
        # The windows are the raw gaps-and-islands of idle samples lasting >= min_idle_s.
        _, islands = svc.store.sql(
            """WITH s AS (SELECT gpu_key, ts, gr_engine_active <= 0.05 AS idle FROM gpu_samples),
            g AS (SELECT *, row_number() OVER (PARTITION BY gpu_key ORDER BY ts)
                          - row_number() OVER (PARTITION BY gpu_key, idle ORDER BY ts) AS grp FROM s)
            SELECT gpu_key, min(ts), max(ts) FROM g WHERE idle GROUP BY gpu_key, grp
            HAVING max(ts) - min(ts) >= INTERVAL 30 SECOND ORDER BY 1, 2"""
        )
        _, ended = svc.store.sql(
            "SELECT gpu_key, start_ts, coalesce(end_ts, (SELECT max(ts) FROM gpu_samples s"
            " WHERE s.gpu_key = w.gpu_key)) FROM idle_windows w"
            " ORDER BY 1, 2"
        )
        # GPU-c's raw islands split at the 0.5 sample that hysteresis bridges: compare the others.
        assert [r for r in ended if "GPU-c" not in r[0]] == [r for r in islands if "GPU-c" not in r[0]]
    finally:
        await svc.stop()


async def test_window_cut_by_a_restart_is_censored_at_its_last_decision(tmp_path: Path) -> None:
    db = str(tmp_path / "s.duckdb")
    store = AnalyticsStore(db)
    idle = CapacityUpdate(
        ts=T0 + 60,
        host="h",
        gpu_uuid="GPU-x",
        state=GpuState.IDLE,
        since=T0,
        grade=IdleGrade.FREE,
        reason="DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    )
    refresh = idle.model_copy(update={"ts": T0 + 90})
    after = idle.model_copy(
        update={"ts": T0 + 300, "state": GpuState.UNKNOWN, "since": T0 + 300, "grade": None}
    )
    store.write(StoreBatch(gpu_states=gpu_states_table([idle, refresh], [True, False])))
    store.write(StoreBatch(gpu_states=gpu_states_table([after], [True])))  # the first row after a restart
    _, rows = store.sql(
        "SELECT epoch(start_ts) - ?, epoch(end_ts) - ?, ongoing, censored FROM idle_windows", [T0, T0]
    )
    # end at the last transition row kept of the window (refreshes are not read: conservative)
    assert rows == [(0.0, 60.0, False, True)]
    store.close()


# ---------------------------------------------------------------------------------------------
# retention: rollups, expiry, one transaction


def _raw_store(path: str) -> AnalyticsStore:
    """Ten minutes of one GPU and one port, a sample every 10 s from T0 (a minute boundary + 20 s)."""
    store = AnalyticsStore(path)
    gpus = [gpu(T0 + 10 * i, "GPU-r", activity=(i % 6) / 10, fb=1000 + i) for i in range(60)]
    store.write(StoreBatch(gpu_samples=gpu_samples_table(gpus, [0] * 60, list(range(60)))))
    ports = [port_sample(10 * i, 1_000_000 * i * i, 7 * i) for i in range(60)]
    write_ports(store, ports)
    states = [
        CapacityUpdate(
            ts=T0 + 10 * i, host="node-1", gpu_uuid="GPU-r", state=GpuState.BUSY, since=T0, reason="x"
        )
        for i in range(60)
    ]
    store.write(StoreBatch(gpu_states=gpu_states_table(states, [i == 0 for i in range(60)])))
    return store


def test_rollups_aggregate_complete_minutes_then_raw_rows_expire(tmp_path: Path) -> None:
    store = _raw_store(str(tmp_path / "r.duckdb"))
    cfg = RetentionConfig(raw_retention_s=300.0, rollup_retention_s=3600.0, delay_s=120.0)
    now = T0 + 600  # data up to T0 + 590; minutes complete up to floor(now - 120)
    result = store.maintain(cfg, now)
    first_minute = (T0 // 60) * 60
    assert result.rolled_from == first_minute and result.rolled_to == ((now - 120) // 60) * 60
    assert result.watermark == result.rolled_to
    _, rows = store.sql(
        "SELECT epoch(minute), samples, activity_samples, activity_mean, activity_max, fb_used_mib_mean"
        " FROM gpu_rollup_1m ORDER BY minute"
    )
    raw = [(T0 + 10 * i, (i % 6) / 10, 1000 + i) for i in range(60)]
    assert len(rows) == result.rollup_rows["gpu_rollup_1m"] == 8
    for minute, n, n_act, mean, mx, fb in rows:
        inside = [r for r in raw if minute <= r[0] < minute + 60]
        assert n == n_act == len(inside)
        assert mean == pytest.approx(statistics.fmean(a for _, a, _ in inside))
        assert mx == max(a for _, a, _ in inside)
        assert fb == pytest.approx(statistics.fmean(f for *_, f in inside))
    # IB: deltas of the intervals ENDING in each minute (xmit = 10^6·i², wait = 7·i)
    _, ib = store.sql(
        "SELECT epoch(minute), samples, intervals, interval_s, xmit_data_words, xmit_wait_ticks,"
        " xmit_wait_ticks_max, utilisation_mean, utilisation_max FROM ib_port_rollup_1m ORDER BY minute"
    )
    for minute, n, n_iv, secs, words, waits, wait_max, mean, mx in ib:
        idx = [i for i in range(60) if minute <= T0 + 10 * i < minute + 60]
        ivs = [i for i in idx if i > 0]
        assert n == len(idx) and n_iv == len(ivs) and secs == 10.0 * len(ivs)
        assert words == sum(1_000_000 * (i * i - (i - 1) ** 2) for i in ivs)
        assert waits == 7 * len(ivs) and wait_max == 7
        assert mean == pytest.approx(4 * words / (secs * RATE))
        assert mx == pytest.approx(4 * 1_000_000 * (2 * ivs[-1] - 1) / (10 * RATE))
    # Raw rows: older than now - 300 s AND older than watermark - 300 s (baseline of the next
    # interval) go; the refresh rows of gpu_states with them, transitions stay.
    cut = min(now - 300, result.watermark - 300)
    _, [(n_gpu, oldest)] = store.sql("SELECT count(*), min(epoch(ts)) FROM gpu_samples")
    assert oldest >= cut and n_gpu == sum(1 for t, *_ in raw if t >= cut)
    _, [(n_ib,)] = store.sql("SELECT count(*) FROM ib_port_samples")
    assert n_ib == n_gpu and result.expired_rows["gpu_samples"] == 60 - n_gpu
    _, [(refresh_left, transitions)] = store.sql(
        "SELECT count(*) FILTER (WHERE NOT transition AND ts < ?), count(*) FILTER (WHERE transition)"
        " FROM gpu_states",
        [utc(cut)],
    )
    assert (refresh_left, transitions) == (0, 1)
    # The next run rolls the later minutes from the rows kept, exactly as if none had expired.
    later = store.maintain(cfg, now + 600)
    assert later.rolled_from == result.rolled_to
    _, [(words_all,)] = store.sql("SELECT sum(xmit_data_words) FROM ib_port_rollup_1m")
    assert words_all == 1_000_000 * 59 * 59  # every interval once, none lost at the cut
    # Rollups expire after rollup_retention_s.
    gone = store.maintain(cfg, T0 + 600 + 3600 + 60)
    _, [(left,)] = store.sql("SELECT count(*) FROM gpu_rollup_1m")
    assert left == 0 and gone.expired_rows["gpu_rollup_1m"] > 0
    store.close()


def test_a_backlog_is_rolled_up_in_bounded_runs(tmp_path: Path) -> None:
    store = _raw_store(str(tmp_path / "b.duckdb"))
    cfg = RetentionConfig(raw_retention_s=None, rollup_retention_s=None, max_rollup_s=180.0)
    spans = []
    while (r := store.maintain(cfg, T0 + 3600)).rolled_to is not None:
        assert r.rolled_from is not None
        spans.append(r.rolled_to - r.rolled_from)
    assert spans == [180.0] * 4  # the 11 minutes holding data; the empty ones after are skipped
    _, [(n, words)] = store.sql("SELECT sum(samples), sum(xmit_data_words) FROM ib_port_rollup_1m")
    assert n == 60 and words == 1_000_000 * 59 * 59  # chunk borders lose no interval
    store.close()


def test_failed_maintenance_changes_nothing(tmp_path: Path) -> None:
    store = _raw_store(str(tmp_path / "f.duckdb"))
    # The IB rollup (after the GPU rollup) fails: a column it does not fill is NOT NULL.
    store.sql("ALTER TABLE ib_port_rollup_1m ADD COLUMN must INTEGER")
    store.sql("ALTER TABLE ib_port_rollup_1m ALTER COLUMN must SET NOT NULL")
    failures = store.metrics.registry.get_sample_value("gpupool_analytics_maintenance_failures_total") or 0.0
    with pytest.raises(duckdb.ConstraintException):
        store.maintain(RetentionConfig(raw_retention_s=60.0, rollup_retention_s=60.0), T0 + 3600)
    assert store.metrics.registry.get_sample_value("gpupool_analytics_maintenance_failures_total") == failures + 1
    _, [(rollups, raw, wm)] = store.sql(
        "SELECT (SELECT count(*) FROM gpu_rollup_1m), (SELECT count(*) FROM gpu_samples),"
        " (SELECT count(*) FROM analytics_meta WHERE key = 'rollup_watermark_us')"
    )
    assert (rollups, raw, wm) == (0, 60, 0)
    store.close()


def test_late_rows_are_counted(tmp_path: Path) -> None:
    store = _raw_store(str(tmp_path / "l.duckdb"))
    store.maintain(RetentionConfig(raw_retention_s=None, rollup_retention_s=None), T0 + 600)
    late_rows = ("gpupool_analytics_rollup_late_rows_total", {"table": "gpu_samples"})
    before = store.metrics.registry.get_sample_value(*late_rows) or 0
    late = [gpu(T0 + 5, "GPU-late", 0.0), gpu(T0 + 595, "GPU-late", 0.0)]  # one before the watermark
    store.write(StoreBatch(gpu_samples=gpu_samples_table(late, [0, 0], [100, 101])))
    after = store.metrics.registry.get_sample_value(*late_rows)
    assert after == before + 1
    store.close()


def test_retention_config_is_checked() -> None:
    for kw in (
        {"raw_retention_s": 0.0},
        {"raw_retention_s": 3600.0, "rollup_retention_s": 60.0},
        {"raw_retention_s": None, "rollup_retention_s": 60.0},
        {"delay_s": -1.0},
        {"interval_s": 0.0},
        {"max_rollup_s": 30.0},
    ):
        with pytest.raises(ValueError):
            RetentionConfig(**kw)  # type: ignore[arg-type]
    RetentionConfig(raw_retention_s=None, rollup_retention_s=None)


def test_version_1_file_is_migrated(tmp_path: Path) -> None:
    db = str(tmp_path / "v1.duckdb")
    con = duckdb.connect(db)  # the version-1 layout of gpu_states, with one row
    con.execute(
        "CREATE TABLE analytics_meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL);"
        "INSERT INTO analytics_meta VALUES ('schema_version', '1');"
        "CREATE TABLE gpu_states (ts TIMESTAMP, gpu_key VARCHAR, host VARCHAR, gpu_uuid VARCHAR,"
        " gpu_instance_id INTEGER, model_name VARCHAR, pool VARCHAR, state VARCHAR, since TIMESTAMP,"
        " grade VARCHAR, predicted_idle_until TIMESTAMP, confidence DOUBLE, reason VARCHAR);"
        "INSERT INTO gpu_states (ts, gpu_key, state, since) VALUES (now(), 'h/g', 'busy', now())"
    )
    con.close()
    store = AnalyticsStore(db)
    _, [(version,)] = store.sql("SELECT value FROM analytics_meta WHERE key = 'schema_version'")
    _, [(flag,)] = store.sql("SELECT transition FROM gpu_states")
    assert version == str(STORE_SCHEMA_VERSION) == "3" and flag is True
    store.close()
    con = duckdb.connect(db)  # a newer layout than this code knows is refused, not "migrated"
    con.execute("UPDATE analytics_meta SET value = '4' WHERE key = 'schema_version'")
    con.close()
    with pytest.raises(StoreSchemaError):
        AnalyticsStore(db)


def test_views_are_documented() -> None:
    md = views_markdown()
    for view in VIEWS:
        assert f"#### `{view.name}`" in md
        assert view.sql.startswith("CREATE OR REPLACE")
    assert {"gpu_state_now", "idle_windows", "fabric_headroom"} <= {v.name for v in VIEWS}


# ---------------------------------------------------------------------------------------------
# gauges: idle capacity per pool and model, consumer lag; scale-out forgets GPUs moved away


def gauge(svc: AnalyticsService, name: str, **labels: str) -> float | None:
    """A sample of ``svc``'s Prometheus registry (``None`` if absent)."""
    return svc.registry.get_sample_value(name, labels)


async def test_idle_capacity_gauges_follow_the_gpus(tmp_path: Path) -> None:
    svc, bus, clock = await _run_service(tmp_path, stale_gpu=False)
    try:
        labels = {"pool": "default", "model": MODEL}
        # GPU-a is idle with FB_USED back to 100 MiB (free); GPU-b and GPU-c are busy
        assert gauge(svc, "gpupool_analytics_idle_gpus", grade="free", **labels) == 1
        assert gauge(svc, "gpupool_analytics_idle_gpus", grade="memory_held", **labels) == 0  # 0, not absent
        assert gauge(svc, "gpupool_analytics_idle_gpu_memory_bytes", grade="free", **labels) == 81_559 * 2**20
        assert gauge(svc, "gpupool_analytics_gpus", state="busy") == 2
        # a second service in the same process counts on its own registry: its idle GPU is not here
        other_bus = MemoryBus()
        other = AnalyticsService(bus=other_bus, topics=TOPICS, db_path=":memory:", clock=clock)
        await other.start()
        for i in range(8):
            s = gpu(clock.t - 70 + 10 * i, "GPU-z", 0.0, fb=30_000)
            await other_bus.producer().send(TOPICS.telemetry_gpu, encode(s), key=s.key)
        await other.step(timeout_s=0.01)
        assert gauge(other, "gpupool_analytics_idle_gpus", grade="memory_held", **labels) == 1
        assert gauge(other, "gpupool_analytics_gpus", state="busy") == 0
        assert gauge(svc, "gpupool_analytics_idle_gpus", grade="memory_held", **labels) == 0
        assert gauge(svc, "gpupool_analytics_gpus", state="busy") == 2
        assert other.registry is not svc.registry
        await other.stop()
        assert gauge(other, "gpupool_analytics_idle_gpus", grade="memory_held", **labels) is None
        assert gauge(svc, "gpupool_analytics_idle_gpus", grade="free", **labels) == 1
        # GPU-a goes busy: the idle count drops at once
        s = gpu(clock.t + 10, "GPU-a", 0.9)
        await bus.producer().send(TOPICS.telemetry_gpu, encode(s), key=s.key)
        await svc.step(timeout_s=0.01)
        assert gauge(svc, "gpupool_analytics_idle_gpus", grade="free", **labels) == 0
    finally:
        await svc.stop()
    assert gauge(svc, "gpupool_analytics_idle_gpus", grade="free", **labels) is None


async def test_consumer_lag_gauge_counts_records_not_yet_in_duckdb() -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = AnalyticsService(bus=bus, topics=TOPICS, db_path=":memory:", clock=clock, max_records=4)
    producer = bus.producer()
    for i in range(10):
        s = gpu(T0 + i, "GPU-l", 0.9)
        await producer.send(TOPICS.telemetry_gpu, encode(s), key=s.key)
    await svc.start()
    try:
        lag = {"topic": TOPICS.telemetry_gpu, "partition": "0"}
        await svc.step(timeout_s=0.01)  # 4 of 10 stored
        assert gauge(svc, "gpupool_analytics_consumer_lag_records", **lag) == 6
        clock.t += 1
        await svc.step(timeout_s=0.01)
        clock.t += 1
        await svc.step(timeout_s=0.01)
        assert gauge(svc, "gpupool_analytics_consumer_lag_records", **lag) == 0
        assert svc.stored_offsets() == {TopicPartition(TOPICS.telemetry_gpu, 0): 10}
    finally:
        await svc.stop()
    assert gauge(svc, "gpupool_analytics_consumer_lag_records", **lag) is None


async def test_a_partition_moved_away_takes_its_gpus_with_it() -> None:
    bus, clock = MemoryBus(default_partitions=2), Clock(T0)

    def make() -> AnalyticsService:
        return AnalyticsService(
            bus=bus,
            topics=TOPICS,
            db_path=":memory:",
            clock=clock,
            group_id="g",
            idle=IdleConfig(stale_after_s=25.0),
        )

    a = make()
    await a.start()
    producer = bus.producer()
    keys = [f"GPU-{i}" for i in range(8)]
    for k in keys:
        s = gpu(T0, k, 0.9)
        await producer.send(TOPICS.telemetry_gpu, encode(s), key=s.key)
    await a.step(timeout_s=0.01)
    assert len(a.current_states()) == 8
    b = make()
    await b.start()  # rebalance: each owns one telemetry.gpu partition
    try:
        for k in keys:
            s = gpu(T0 + 10, k, 0.9)
            await producer.send(TOPICS.telemetry_gpu, encode(s), key=s.key)
        clock.t = T0 + 10
        await a.step(timeout_s=0.01)
        await b.step(timeout_s=0.01)
        owned_a = {tp.partition for tp in a.partitions() if tp.topic == TOPICS.telemetry_gpu}
        owned_b = {tp.partition for tp in b.partitions() if tp.topic == TOPICS.telemetry_gpu}
        assert owned_a and owned_b and not owned_a & owned_b
        assert set(a.current_states()).isdisjoint(b.current_states())
        assert len(a.current_states()) + len(b.current_states()) == 8
        # Much later: each marks only its own GPUs stale; A publishes nothing for B's GPUs.
        seen = {(m.partition, m.offset) for m in bus.records(TOPICS.capacity)}
        clock.t = T0 + 100
        await a.step(timeout_s=0.01)
        new = [m for m in bus.records(TOPICS.capacity) if (m.partition, m.offset) not in seen]
        assert sorted(m.key or "" for m in new) == sorted(a.current_states())
        assert {m.partition for m in new} <= owned_a  # capacity is keyed like telemetry
    finally:
        await b.stop()
        await a.stop()
