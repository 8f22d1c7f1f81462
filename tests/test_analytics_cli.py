"""``gpupool analytics sql`` and argument checking of ``gpupool analytics run``."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from analytics.cli import app
from analytics.rows import gpu_samples_table
from analytics.store import AnalyticsStore, StoreBatch
from contracts import GpuSample
from contracts.bus import TopicPartition


def _db(tmp_path: Path) -> str:
    db = str(tmp_path / "a.duckdb")
    store = AnalyticsStore(db)
    s = [
        GpuSample(
            ts=1_700_000_000.0 + i, host="node-7", gpu_uuid="GPU-q", fields={"DCGM_FI_DEV_GPU_UTIL": 42}
        )
        for i in range(3)
    ]
    store.write(
        StoreBatch(
            gpu_samples=gpu_samples_table(s, [0, 0, 0], [0, 1, 2]),
            offsets={TopicPartition("telemetry.gpu", 0): 3},
        )
    )
    store.close()
    return db


def test_sql_prints_a_table(tmp_path: Path) -> None:
    db = _db(tmp_path)
    res = CliRunner().invoke(
        app, ["sql", "SELECT gpu_key, gpu_util FROM gpu_state_now", "--db", db], env={"COLUMNS": "200"}
    )
    assert res.exit_code == 0, res.output
    assert "gpu_key" in res.output and "node-7/GPU-q" in res.output and "42.0" in res.output
    res = CliRunner().invoke(app, ["sql", "SELECT * FROM consumer_offsets", "--db", db, "--limit", "0"])
    assert res.exit_code == 0 and "first 0" in res.output


def test_sql_errors_exit_1(tmp_path: Path) -> None:
    db = _db(tmp_path)
    res = CliRunner().invoke(app, ["sql", "SELECT * FROM no_such_table", "--db", db])
    assert res.exit_code == 1 and "query failed" in res.output
    res = CliRunner().invoke(app, ["sql", "SELECT 1", "--db", str(tmp_path / "missing.duckdb")])
    assert res.exit_code == 1 and "cannot open" in res.output


def test_run_rejects_inconsistent_thresholds() -> None:
    res = CliRunner().invoke(
        app, ["run", "--kafka", "127.0.0.1:1", "--idle-threshold", "0.5", "--busy-threshold", "0.1"]
    )
    assert res.exit_code == 2
