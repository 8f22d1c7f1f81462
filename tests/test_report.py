"""``gpupool report``: the DuckDB queries against hand-computed values, the lease-log folding, and
the HTML page rendered by a real headless Chromium (Debian ``chromium``, installed by
``deploy/local/install-system.sh``), from a hand-built store and from a short demo run.

Chromium checks: ``--dump-dom`` after the page's scripts ran shows plotly drew every plot (its
``<div>`` got the ``js-plotly-plot`` class and an SVG with the trace type's layer), and a
``--screenshot`` PNG is decoded (pypng) and must not be blank.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import png
import pytest
from prometheus_client import REGISTRY
from typer.testing import CliRunner

from analytics.classify import IdleRun
from analytics.rows import gpu_samples_table, gpu_states_table, ib_port_samples_table, idle_runs_table
from analytics.store import AnalyticsStore, StoreBatch
from contracts import (
    CapacityUpdate,
    GpuSample,
    GpuState,
    IbPortSample,
    IdleGrade,
    LeaseLogRecord,
    LeaseState,
    encode,
)
from contracts.bus import MemoryBus
from contracts.counters import CounterTracker, link_utilisation
from contracts.topics import KafkaTopics
from gpupool.cli import app
from gpupool.report import data, figures
from gpupool.report.build import PLOT_IDS, build_report
from gpupool.report.leases import lease_spans, load_jsonl, parse_jsonl, read_from_bus, write_jsonl
from runtime.kafka import KafkaBus

T0 = 1_800_000_000.0
HOST = "node-1"
RATE = 12_500_000_000  # 100 Gb/s in bytes/s
UUIDS = {name: f"GPU-{name * 8}-0000-0000-0000-000000000000" for name in "abcde"}


def _key(name: str) -> str:
    return f"{HOST}/{UUIDS[name]}"


def _utilisation(name: str, t: int) -> float:
    """Synthetic GPU_UTIL (%) of GPU ``name`` at second ``t``: a busy, b idle 10..40, c idle from 20."""
    if (name == "b" and 10 <= t <= 40) or (name == "c" and t >= 20):
        return 0.0
    return 80.0 if name in "abc" else 40.0 + t % 7


def _gpu_samples() -> list[GpuSample]:
    return [
        GpuSample(
            ts=T0 + t,
            host=HOST,
            gpu_uuid=UUIDS[n],
            model_name="NVIDIA H100 80GB HBM3",
            fields={"DCGM_FI_DEV_GPU_UTIL": _utilisation(n, t), "DCGM_FI_DEV_FB_USED": 0},
            seq=t,
        )
        for t in range(61)
        for n in "abcd"
    ]


def _update(
    name: str, ts: float, since: float, until: float | None, conf: float | None = 0.9
) -> CapacityUpdate:
    return CapacityUpdate(
        ts=T0 + ts,
        host=HOST,
        gpu_uuid=UUIDS[name],
        state=GpuState.IDLE,
        since=T0 + since,
        grade=IdleGrade.FREE,
        predicted_idle_until=None if until is None else T0 + until,
        confidence=conf if until is not None else None,
        model_name="NVIDIA H100 80GB HBM3",
    )


def _states() -> list[CapacityUpdate]:
    return [
        CapacityUpdate(ts=T0, host=HOST, gpu_uuid=UUIDS["a"], state=GpuState.BUSY, since=T0),
        _update("b", 15, 10, 35),  # kept: idle until 40 >= 35
        _update("b", 25, 10, 45),  # a later refresh: not the first promise
        _update("c", 25, 20, 90),  # open: idle at the end (60) but promised 90
        _update("d", 8, 5, 30),  # broken: the run ended at 12
        _update("e", 33, 30, 50),  # censored: went unknown at 40
        _update("a", 50, 48, None),  # no prediction
    ]


def _runs() -> list[tuple[IdleRun, str]]:
    return [
        (IdleRun(_key("b"), None, T0 + 10, T0 + 40, False), "default"),
        (IdleRun(_key("d"), None, T0 + 5, T0 + 12, False), "default"),
        (IdleRun(_key("e"), None, T0 + 30, T0 + 40, True), "default"),
        (IdleRun(_key("a"), None, T0 + 48, T0 + 52, False), "default"),
    ]


def _port(
    ts: float,
    xmit: int | None,
    rcv: int | None,
    *,
    port: int = 1,
    bits: int = 64,
    saturated: tuple[str, ...] = (),
) -> IbPortSample:
    counters: dict[str, int | None] = {"PortXmitData": xmit, "PortRcvData": rcv}
    return IbPortSample(
        ts=ts,
        host=HOST,
        device="mlx5_0",
        node_guid="0x0002c90300000100",
        port=port,
        link_layer="InfiniBand",
        state_id=4,
        state="ACTIVE",
        phys_state_id=5,
        phys_state="LinkUp",
        rate_bytes_per_second=RATE,
        counters=counters,
        counter_bits={"PortXmitData": bits, "PortRcvData": bits},
        saturated=list(saturated),
    )


def _steady_ports() -> list[IbPortSample]:
    """Two ports read every second: port 1 at 30 % transmit, port 2 at 70 % receive."""
    words = RATE // 4
    out = []
    for t in range(61):
        out.append(_port(T0 + t, 2**60 + t * words * 3 // 10, t * words // 10, port=1))
        out.append(_port(T0 + t, t * words // 20, t * words * 7 // 10, port=2))
    return out


def _write_store(
    path: Path,
    *,
    gpus: list[GpuSample],
    states: list[CapacityUpdate],
    runs: list[tuple[IdleRun, str]],
    ports: list[IbPortSample],
) -> None:
    store = AnalyticsStore(str(path))
    try:
        store.write(
            StoreBatch(
                gpu_samples=gpu_samples_table(gpus, [0] * len(gpus), list(range(len(gpus)))),
                gpu_states=gpu_states_table(states),
                idle_runs=idle_runs_table(runs),
                ib_port_samples=ib_port_samples_table(ports, [0] * len(ports), list(range(len(ports)))),
            )
        )
    finally:
        store.close()


pytestmark = pytest.mark.usefixtures("detach_cli_log_handler")


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    path = tmp_path / "analytics.duckdb"
    _write_store(path, gpus=_gpu_samples(), states=_states(), runs=_runs(), ports=_steady_ports())
    return path


def _lease(
    lease_id: str,
    state: LeaseState,
    ts: float,
    seq: int,
    *,
    site: str = "edge-a",
    deadline: float | None = None,
    reason: str = "",
) -> LeaseLogRecord:
    return LeaseLogRecord(
        lease_id=lease_id,
        site=site,
        claim_id=f"c-{lease_id}",
        offer_id=f"o-{lease_id}",
        gpus=[_key("b")],
        state=state,
        ts=T0 + ts,
        granted_at=T0 + 12,
        expires_at=T0 + ts + 60,
        reclaim_deadline=None if deadline is None else T0 + deadline,
        notice_seconds=10.0,
        reason=reason,
        seq=seq,
    )


def _lease_log() -> list[LeaseLogRecord]:
    return [
        _lease("lease-1", LeaseState.GRANTED, 12, 1, reason="claim"),
        _lease("lease-1", LeaseState.ACTIVE, 13, 2, reason="renewal"),
        _lease("lease-1", LeaseState.RECLAIMING, 30, 3, deadline=40, reason="demand:d1"),
        _lease("lease-1", LeaseState.RELEASED, 35, 4, deadline=40, reason="site_release"),
        _lease("lease-2", LeaseState.ACTIVE, 20, 2, site="edge-b", reason="renewal"),
        # compacted: only the final record of a revoked lease is left
        _lease("lease-3", LeaseState.REVOKED, 52, 5, site="edge-b", deadline=52, reason="reclaim_deadline"),
    ]


# queries ---------------------------------------------------------------------------------------------
def test_utilisation_grid_means_per_bucket(store_path: Path) -> None:
    con = data.open_store(store_path)
    try:
        grid = data.utilisation_grid(con, max_columns=6)
    finally:
        con.close()
    assert grid is not None
    assert grid.rows == sorted(_key(n) for n in "abcd")
    assert grid.samples == 61 * 4
    assert grid.bucket_s == pytest.approx(10.0)  # 60 s / 6 columns (> 1.5 × the 1 s interval)
    assert len(grid.times) == 7  # 0-9, 10-19, ..., 50-59, 60
    b = grid.values[grid.rows.index(_key("b"))]
    assert b[0] == pytest.approx(80.0)
    assert b[1] == pytest.approx(0.0) and b[2] == pytest.approx(0.0) and b[3] == pytest.approx(0.0)
    assert b[4] == pytest.approx(0.0 * 1 / 10 + 80.0 * 9 / 10)  # 40 idle, 41..49 busy
    d = grid.values[grid.rows.index(_key("d"))]
    assert d[2] == pytest.approx(sum(40.0 + t % 7 for t in range(20, 30)) / 10)


def test_utilisation_falls_back_to_gr_engine_active_and_drops_out_of_range(tmp_path: Path) -> None:
    gpus = [
        GpuSample(ts=T0, host=HOST, gpu_uuid=UUIDS["a"], fields={"DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.25}),
        GpuSample(ts=T0 + 1, host=HOST, gpu_uuid=UUIDS["a"], fields={"DCGM_FI_DEV_GPU_UTIL": 250.0}),
        GpuSample(ts=T0 + 2, host=HOST, gpu_uuid=UUIDS["a"], fields={"DCGM_FI_DEV_GPU_UTIL": 75.0}),
    ]
    _write_store(tmp_path / "s.duckdb", gpus=gpus, states=[], runs=[], ports=[])
    con = data.open_store(tmp_path / "s.duckdb")
    try:
        grid = data.utilisation_grid(con, max_columns=400)
    finally:
        con.close()
    assert grid is not None
    assert [v for v in grid.values[0] if v is not None] == [pytest.approx(25.0), pytest.approx(75.0)]


def test_idle_window_outcomes(store_path: Path) -> None:
    con = data.open_store(store_path)
    try:
        windows, total = data.idle_windows(con)
    finally:
        con.close()
    assert total == 5
    by_gpu = {w.gpu_key: w for w in windows}
    name_of = {_key(n): n for n in UUIDS}
    assert {name_of[k]: w.outcome for k, w in by_gpu.items()} == {
        "b": "kept",
        "c": "open",
        "d": "broken",
        "e": "censored",
        "a": "no_prediction",
    }
    b = by_gpu[_key("b")]
    assert figures.utc(T0 + 35) == b.predicted_until  # the first promise, not the refresh's 45
    assert b.predicted_s == pytest.approx(20.0) and b.real_s == pytest.approx(25.0)
    assert by_gpu[_key("c")].ended_at is None
    assert by_gpu[_key("d")].real_s == pytest.approx(4.0)
    con = data.open_store(store_path)
    try:
        limited, total = data.idle_windows(con, limit=2)
    finally:
        con.close()
    assert total == 5 and [w.gpu_key for w in limited] == [_key("e"), _key("a")]  # the newest two


def test_fabric_utilisation_matches_counter_tracker(tmp_path: Path) -> None:
    """The SQL interval rules agree with contracts.counters on resets, saturation, missing reads,
    clock steps, long gaps and counters past 2**53."""
    w = RATE // 4
    big = 2**62
    reads = [  # (t, xmit, rcv, bits, saturated)
        (0, big, 0, 64, ()),
        (1, big + w // 2, w // 10, 64, ()),  # 50 % out, 10 % in
        (2, None, w // 5, 64, ()),  # xmit unreadable: its next delta spans 2 s
        (3, big + w // 2 + w, w // 5 + w // 4, 64, ()),
        (4, 100, w // 5 + w // 2, 64, ()),  # xmit reset (cleared)
        (5, 100 + w // 4, 2**32 - 1, 32, ("PortRcvData",)),  # rcv saturated
        (6, 100 + w // 2, 10, 32, ()),  # rcv cleared after saturation: no rate
        (7, 100 + w, 10 + w // 8, 64, ()),
        (400, 100 + 2 * w, 10 + w // 4, 64, ()),  # gap > 300 s: no rate
        (401, 100 + 2 * w + w // 3, 10 + w // 4, 64, ()),
    ]
    ports = [_port(T0 + t, x, r, bits=b, saturated=s) for t, x, r, b, s in reads]
    _write_store(tmp_path / "f.duckdb", gpus=[], states=[], runs=[], ports=ports)

    tracker = CounterTracker()
    expected: dict[float, float] = {}
    for p in ports:
        for name in ("PortXmitData", "PortRcvData"):
            res = tracker.update(
                p.key, name, p.counters[name], p.ts, bits=p.counter_bits[name], saturated=name in p.saturated
            )
            if res.event == "ok":
                assert res.delta is not None and res.dt_s is not None
                u = link_utilisation(res.delta, res.dt_s, RATE)
                expected[p.ts] = max(expected.get(p.ts, u), u)

    con = data.open_store(tmp_path / "f.duckdb")
    try:
        got = {
            (ts - figures.utc(T0)).total_seconds() + T0: u
            for _, ts, u in con.execute(data.INTERVALS_SQL, {"max_gap": 300.0}).fetchall()
        }
        fab = data.fabric(con)
    finally:
        con.close()
    assert got.keys() == expected.keys()
    for ts, u in expected.items():
        assert got[ts] == pytest.approx(u, rel=1e-9), ts
    # t=400 (gap) has none; the others have at least one direction left by the rules
    assert sorted(round(t - T0) for t in got) == [1, 2, 3, 4, 5, 6, 7, 401]
    assert got[T0 + 3] == pytest.approx(0.5)  # xmit over 2 s around the unreadable read
    assert got[T0 + 5] == pytest.approx(0.25)  # the saturated rcv read gave no (huge) rate
    assert fab is not None and len(fab.ports) == 1
    (port,) = fab.ports
    assert port.intervals == 8 and port.max_utilisation == pytest.approx(max(expected.values()))


def test_fabric_headroom_per_port(store_path: Path) -> None:
    con = data.open_store(store_path)
    try:
        fab = data.fabric(con)
    finally:
        con.close()
    assert fab is not None
    assert [p.port for p in fab.ports] == [1, 2]
    p1, p2 = fab.ports
    assert p1.intervals == 60 and p1.p95_utilisation == pytest.approx(0.3, abs=1e-6)
    assert p2.headroom_p95 == pytest.approx(0.3, abs=1e-6)  # 70 % receive
    row = fab.grid.values[1]
    assert all(v == pytest.approx(0.7, abs=1e-6) for v in row if v is not None)


def test_open_store_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        data.open_store(tmp_path / "missing.duckdb")
    import duckdb

    other = tmp_path / "other.duckdb"
    duckdb.connect(str(other)).execute("CREATE TABLE gpu_samples (x INTEGER)").close()
    with pytest.raises(data.ReportDataError, match="gpu_states"):
        data.open_store(other)


def test_bucket_width_limits_cells() -> None:
    assert data.bucket_width_us(3600.0, 10_000, 10_000 * 720, 400, 1_000_000) == 36_000_000  # 100 columns
    assert data.bucket_width_us(60.0, 1, 61, 400, 1_000_000) == pytest.approx(1.5 * 60 / 61 * 1e6, abs=1)
    with pytest.raises(ValueError):
        data.bucket_width_us(1.0, 0, 1, 1, 1)


# lease log -------------------------------------------------------------------------------------------
def test_lease_spans_full_and_compacted_log() -> None:
    records = _lease_log()
    spans = {s.lease_id: s for s in lease_spans(records + records[:2])}  # duplicates are harmless
    one, two, three = spans["lease-1"], spans["lease-2"], spans["lease-3"]
    assert one.reclaim_started_at == T0 + 30 and one.ended_at == T0 + 35 and one.state is LeaseState.RELEASED
    assert two.ended_at is None and not two.reclaimed and two.state is LeaseState.ACTIVE
    assert three.reclaim_started_at == T0 + 52 - 10.0  # deadline − notice, from the last record alone
    assert three.ended_at == T0 + 52 and three.reason == "reclaim_deadline"
    assert [s.lease_id for s in lease_spans(records)] == ["lease-1", "lease-2", "lease-3"]


def _rejected() -> float:
    return REGISTRY.get_sample_value("gpupool_report_rejected_records_total", {"reason": "bad_record"}) or 0.0


def test_jsonl_round_trip_and_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "leases.jsonl"
    write_jsonl(_lease_log(), path)
    assert load_jsonl(path) == (_lease_log(), 0)
    before = _rejected()
    lines = [encode(r).decode() for r in _lease_log()[:2]]
    records, rejected = parse_jsonl([lines[0], "{not json", "", json.dumps({"lease_id": "x"}), lines[1]])
    assert records == _lease_log()[:2] and rejected == 2
    assert _rejected() - before == 2


async def test_read_lease_log_from_bus() -> None:
    bus = MemoryBus()
    producer = bus.producer()
    await producer.start()
    for rec in _lease_log():
        await producer.send("leases.log", encode(rec), key=rec.lease_id)
    await producer.send("leases.log", b'{"broken": true}', key="lease-x")
    await producer.flush()
    await producer.stop()
    before = len(bus.records("leases.log"))
    records, rejected = await read_from_bus(bus, "leases.log", timeout_s=5.0)
    assert records == _lease_log() and rejected == 1
    assert len(bus.records("leases.log")) == before  # the report only reads


async def _end_offsets(bus: KafkaBus, topic: str) -> dict[object, int]:
    """End offset of every partition of ``topic`` (a fresh group's consumer, nothing committed)."""
    consumer = bus.consumer([topic], f"ends-{uuid.uuid4().hex}")
    await consumer.start()
    try:
        return dict(await consumer.end_offsets())
    finally:
        await consumer.stop()


# the page in a real browser --------------------------------------------------------------------------
def _chromium(html: Path, profile: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("chromium not found: install Debian's chromium (bash deploy/local/install-system.sh)")
    proc = subprocess.run(
        [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            "--window-size=1400,2400",
            "--virtual-time-budget=5000",
            *extra,
            html.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc


_HEATMAP, _BARS, _SCATTER = 'class="hm"', 'class="trace bars"', 'class="trace scatter '
"""What plotly draws for a heatmap, bar and scatter trace."""

ALL_PLOTS: dict[str, tuple[str, ...]] = {
    "plot-utilisation": (_HEATMAP,),
    "plot-idle-windows": (_BARS, _SCATTER),
    "plot-leases": (_BARS, _SCATTER),  # the scatter: reclaim deadlines
    "plot-fabric": (_HEATMAP, _BARS, _SCATTER),
}


def _check_rendered(html: Path, tmp: Path, plots: dict[str, tuple[str, ...]]) -> Path:
    """Open ``html`` in Chromium: plotly drew every plot ``<div>`` id of ``plots``, with the trace
    layers named there; the screenshot is not blank. Returns the screenshot's path."""
    dom = _chromium(html, tmp / "profile", "--dump-dom").stdout
    for div_id, layers in plots.items():
        m = re.search(rf'<div id="{div_id}"[^>]*class="[^"]*js-plotly-plot', dom)
        assert m, f"plotly did not draw {div_id}"
        section = dom[m.start() : dom.index("</section>", m.start())]
        assert 'class="main-svg"' in section, div_id
        for layer in layers:
            assert layer in section, f"{div_id}: no {layer}"
    shot = tmp / "report.png"
    _chromium(html, tmp / "profile", f"--screenshot={shot}")
    width, height, rows, _ = png.Reader(filename=str(shot)).asRGBA8()
    assert (width, height) == (1400, 2400)
    lums: list[int] = []
    colours: set[tuple[int, int, int]] = set()
    for y, row in enumerate(rows):
        if y % 4:
            continue
        for x in range(0, width * 4, 16):
            rgb = (row[x], row[x + 1], row[x + 2])
            colours.add(rgb)
            lums.append(sum(rgb))
    mean = sum(lums) / len(lums)
    variance = sum((v - mean) ** 2 for v in lums) / len(lums)
    non_white = sum(1 for v in lums if v < 735) / len(lums)
    assert variance > 1000, f"screenshot looks blank (variance {variance:.0f})"
    assert non_white > 0.1, f"screenshot mostly white ({non_white:.1%} non-white)"
    assert len(colours) > 100, f"only {len(colours)} colours: no heatmaps drawn"
    return shot


def test_report_renders_every_plot_in_chromium(store_path: Path, tmp_path: Path) -> None:
    leases = tmp_path / "leases.jsonl"
    write_jsonl(_lease_log(), leases)
    out = tmp_path / "out" / "report.html"
    steps: list[str] = []
    summary = build_report(store_path, out, lease_records=load_jsonl(leases)[0], on_step=steps.append)
    assert steps and steps[0] == "open database" and steps[-1] == "write file"
    assert summary.plots == tuple(PLOT_IDS.values())
    assert (summary.gpus, summary.leases, summary.reclaims, summary.ports) == (4, 3, 2, 2)
    assert summary.idle_outcomes == {"kept": 1, "open": 1, "broken": 1, "censored": 1, "no_prediction": 1}
    page = out.read_text(encoding="utf-8")
    for div_id in PLOT_IDS.values():
        assert f'id="{div_id}"' in page
    for title in (figures.UTILISATION_TITLE, figures.IDLE_TITLE, figures.LEASES_TITLE, figures.FABRIC_TITLE):
        assert f"<h2>{title}</h2>" in page
    assert not re.search(r"<script[^>]+src=", page), "the page must not load scripts from elsewhere"
    assert page.count("plotly.js v") >= 1 and len(page) > 3_000_000  # plotly.js inlined
    assert tuple(ALL_PLOTS) == tuple(PLOT_IDS.values())
    _check_rendered(out, tmp_path, ALL_PLOTS)


def test_report_of_an_empty_store_says_so(tmp_path: Path) -> None:
    _write_store(tmp_path / "e.duckdb", gpus=[], states=[], runs=[], ports=[])
    summary = build_report(tmp_path / "e.duckdb", tmp_path / "e.html")
    page = (tmp_path / "e.html").read_text(encoding="utf-8")
    assert summary.plots == () and "plotly.js v" not in page
    assert "No GPU samples in this database." in page and "No lease log given" in page


def test_cli_report_errors(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(
        app, ["report", "--db", str(tmp_path / "nope.duckdb"), "--out", str(tmp_path / "r.html")]
    )
    assert res.exit_code == 1 and "nope.duckdb" in res.output
    _write_store(tmp_path / "s.duckdb", gpus=[], states=[], runs=[], ports=[])
    res = runner.invoke(
        app, ["report", "--db", str(tmp_path / "s.duckdb"), "--leases", str(tmp_path / "x.jsonl")]
    )
    assert res.exit_code == 1 and "cannot read the lease log" in res.output
    res = runner.invoke(
        app, ["report", "--db", str(tmp_path / "s.duckdb"), "--leases", "a", "--kafka", "k:1"]
    )
    assert res.exit_code == 2


def test_report_help_speaks_to_operators() -> None:
    """``gpupool report --help``: what it draws, that it only reads; the developer notes below the
    docstring's form feed and internal names stay out."""
    res = CliRunner().invoke(app, ["report", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for word in ("``", ":mod:", ":func:", "Developer notes", "LeaseLogRecord", "tombstone", "end-marker"):
        assert word not in res.output, word
    assert "only reads the lease log" in " ".join(res.output.split())


def test_demo_then_report_in_chromium(tmp_path: Path) -> None:
    """A 12 s demo on 2 nodes writes its DuckDB file and its lease log; the report of them counts
    what the demo's broker counted and renders in Chromium."""
    from gpupool.demo import DemoConfig, run_demo

    state = tmp_path / "demo"
    demo = asyncio.run(run_demo(DemoConfig(duration_s=12.0, nodes=2, state_dir=state)))
    (db,) = state.glob("analytics-*.duckdb")
    (leases,) = state.glob("leases-*.jsonl")
    records, rejected = load_jsonl(leases)
    assert rejected == 0
    assert len({r.lease_id for r in records}) == demo.leases_granted
    out = tmp_path / "demo-report.html"
    res = CliRunner().invoke(app, ["report", "--db", str(db), "--leases", str(leases), "--out", str(out)])
    assert res.exit_code == 0, res.output
    m = re.search(
        r"(\d+) GPUs, (\d+) idle windows, (?:(\d+) leases \((\d+) reclaimed\)), (\d+) IB ports", res.output
    )
    assert m, res.output
    gpus, _, n_leases, reclaimed, ports = (int(g) for g in m.groups())
    assert (gpus, ports) == (demo.gpus, 2 * 4)  # the simulator gives each node 4 HCA ports
    assert (n_leases, reclaimed) == (demo.leases_granted, demo.reclaims_started)
    plots = {k: ALL_PLOTS[k] for k in ("plot-utilisation", "plot-fabric")}
    if demo.gpus_seen_idle:
        plots["plot-idle-windows"] = ALL_PLOTS["plot-idle-windows"]
    if demo.leases_granted:  # deadlines (a scatter) only if a lease was reclaimed
        plots["plot-leases"] = (_BARS, _SCATTER) if demo.reclaims_started else (_BARS,)
    _check_rendered(out, tmp_path, plots)


async def test_cli_reads_the_lease_log_from_kafka(
    store_path: Path, tmp_path: Path, kafka_bus: KafkaBus, kafka_topics: KafkaTopics, kafka_bootstrap: str
) -> None:
    """``--kafka``: the lease log is read from a real Kafka ``leases.log`` to its end (a tombstone
    last in a partition included), and nothing is written to it: its end offsets do not move."""
    topic = kafka_topics.leases_log
    await kafka_bus.create_topics([topic], partitions=2, compacted=[topic])
    producer = kafka_bus.producer()
    await producer.start()
    try:
        for rec in _lease_log():
            await producer.send(topic, encode(rec), key=rec.lease_id)
        await producer.send(topic, None, key="lease-gone")  # a tombstone last in its partition
        await producer.flush()
    finally:
        await producer.stop()
    before = await _end_offsets(kafka_bus, topic)
    assert len(before) == 2 and sum(before.values()) == len(_lease_log()) + 1
    out = tmp_path / "kafka-report.html"
    args = [
        "report",
        "--db",
        str(store_path),
        "--out",
        str(out),
        "--kafka",
        kafka_bootstrap,
        "--topic-prefix",
        kafka_topics.prefix,
        "--kafka-timeout",
        "60",
    ]
    res = await asyncio.to_thread(CliRunner().invoke, app, args)
    assert res.exit_code == 0, res.output
    assert "3 leases (2 reclaimed)" in res.stdout
    assert f"{topic} on {kafka_bootstrap}" in out.read_text(encoding="utf-8")
    assert await _end_offsets(kafka_bus, topic) == before  # the report wrote nothing
