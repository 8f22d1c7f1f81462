"""``gpupool analytics sql``, ``maintain`` (retention of a big store, with progress), the progress
of ``evaluate``, and argument and settings handling of ``gpupool analytics run``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analytics.cli import app, run_settings
from analytics.rows import gpu_samples_table
from analytics.store import AnalyticsStore, StoreBatch
from contracts import GpuSample
from contracts.bus import TopicPartition
from tests.support import settings_file


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
    assert res.exit_code == 1 and "query failed" in res.stderr
    res = CliRunner().invoke(app, ["sql", "SELECT 1", "--db", str(tmp_path / "missing.duckdb")])
    assert res.exit_code == 1 and "cannot open" in res.stderr and "locked" not in res.stderr


def test_sql_formats_csv_and_json_print_full_values(tmp_path: Path) -> None:
    """--format csv / json: every value in full (a long text, a HUGEINT, a timestamp, NULL, a list),
    every row unless --limit; table stays the default."""
    db = _db(tmp_path)
    long_text = "x" * 500
    query = (
        f"SELECT gpu_key, sample_ts, '{long_text}' AS long_text, 170141183460469231731687303715884105727::HUGEINT"
        " AS big, NULL AS nothing, [1, 2] AS list, 'a,\"b' AS quoted FROM gpu_state_now"
    )
    res = CliRunner().invoke(app, ["sql", query, "--db", db, "--format", "json"])
    assert res.exit_code == 0, res.output
    (row,) = json.loads(res.stdout)
    assert row == {
        "gpu_key": "node-7/GPU-q",
        "sample_ts": "2023-11-14T22:13:22",
        "long_text": long_text,
        "big": 170141183460469231731687303715884105727,
        "nothing": None,
        "list": [1, 2],
        "quoted": 'a,"b',
    }
    res = CliRunner().invoke(app, ["sql", query, "--db", db, "--format", "csv"])
    assert res.exit_code == 0, res.output
    import csv
    import io

    header, line = list(csv.reader(io.StringIO(res.stdout)))
    assert header == ["gpu_key", "sample_ts", "long_text", "big", "nothing", "list", "quoted"]
    assert line == ["node-7/GPU-q", "2023-11-14 22:13:22", long_text,
                    "170141183460469231731687303715884105727", "", "[1, 2]", 'a,"b']
    # every row for scripts; --limit still cuts, and says so on stderr
    rows = "SELECT * FROM range(1500) t(i)"
    res = CliRunner().invoke(app, ["sql", rows, "--db", db, "--format", "json"])
    assert res.exit_code == 0 and len(json.loads(res.stdout)) == 1500
    res = CliRunner().invoke(app, ["sql", rows, "--db", db, "--format", "csv", "--limit", "10"])
    assert res.exit_code == 0 and res.stdout.splitlines() == ["i", *map(str, range(10))]
    assert "printed 10 of 1500 rows" in res.stderr
    res = CliRunner().invoke(app, ["sql", rows, "--db", db], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "1500 rows (first 1000)" in " ".join(res.stdout.split())
    assert "│ 999 │" in res.stdout and "│ 1000 │" not in res.stdout
    res = CliRunner().invoke(app, ["sql", rows, "--db", db, "--format", "xml"])
    assert res.exit_code == 2


def test_sql_on_a_store_locked_by_a_running_stage_names_the_cause(tmp_path: Path) -> None:
    """Another process holding the file read-write (as `analytics run` does): exit 1, and the
    message names the cause, the holder's PID and the way that works."""
    import subprocess
    import sys

    db = _db(tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         f"import duckdb, sys; c = duckdb.connect({db!r}); print('open', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        res = CliRunner().invoke(app, ["sql", "SELECT 1", "--db", db], env={"COLUMNS": "300"})
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    assert res.exit_code == 1
    message = " ".join(res.stderr.split())
    assert f"the store is locked by a running analytics stage (PID {holder.pid}):" in message, message
    assert "--db COPY" in message
    # once the stage is stopped the same command works
    res = CliRunner().invoke(app, ["sql", "SELECT count(*) AS n FROM gpu_samples", "--db", db, "--format", "csv"])
    assert res.exit_code == 0 and res.stdout == "n\n3\n"


# developer words that must not reach an operator's --help
_INTERNALS = ("``", ":mod:", ":class:", "IdleConfig", "EvaluationConfig", "RetentionConfig", "issue 4",
              "about a minute", "ValueError", "analytics/", "contracts/")


@pytest.mark.parametrize("command", ["run", "sql", "maintain", "evaluate"])
def test_help_speaks_to_operators(command: str) -> None:
    """--help of each analytics command: what it does, when it cannot open the file, exit codes;
    no class or module names, no stale claims."""
    res = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    leaked = [w for w in _INTERNALS if w in res.output]
    assert not leaked, f"analytics {command} --help leaks {leaked}:\n{res.output}"
    assert "Exit code" in res.output


def test_evaluate_names_the_former_default_plainly() -> None:
    from analytics.evaluate import DEFAULT_VARIANTS

    names = [v.name for v in DEFAULT_VARIANTS]
    assert "gpu+pool (former default)" in names and not any("issue" in n for n in names)


def test_run_rejects_inconsistent_thresholds() -> None:
    res = CliRunner().invoke(
        app, ["run", "--kafka", "127.0.0.1:1", "--idle-threshold", "0.5", "--busy-threshold", "0.1"]
    )
    assert res.exit_code == 2


TRACE_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces" / "alibaba_genai_2026"
T0 = 1_700_000_000.0 - 1_700_000_000.0 % 60  # a whole minute


def _big_db(tmp_path: Path, minutes: int, gpus: int = 2) -> str:
    """A store with one sample per GPU per minute for ``minutes`` minutes, nothing rolled up."""
    db = str(tmp_path / "big.duckdb")
    store = AnalyticsStore(db)
    samples = [
        GpuSample(
            ts=T0 + 60 * m + 5, host="node-1", gpu_uuid=f"GPU-{g}", fields={"DCGM_FI_DEV_GPU_UTIL": m % 100}
        )
        for m in range(minutes)
        for g in range(gpus)
    ]
    store.write(
        StoreBatch(
            gpu_samples=gpu_samples_table(samples, [0] * len(samples), list(range(len(samples)))),
            offsets={TopicPartition("telemetry.gpu", 0): len(samples)},
        )
    )
    store.close()
    return db


def _progress(caplog: pytest.LogCaptureFixture, work: str) -> list[tuple[str, int, int]]:
    return [
        (r.step, r.done, r.total)  # type: ignore[attr-defined]
        for r in caplog.records
        if r.getMessage() == "progress" and getattr(r, "work", None) == work
    ]


def test_maintain_rolls_up_a_big_store_in_steps_with_progress(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = _big_db(tmp_path, minutes=180)
    now = T0 + 180 * 60 + 120  # the 180 minutes are complete (delay 120 s), no more
    caplog.set_level(logging.INFO, logger="analytics.cli")
    res = CliRunner().invoke(
        app,
        ["maintain", "--db", db, "--now", str(now), "--raw-retention-s", "3600", "--json", "--no-progress"],
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    # 180 minutes at most 60 per transaction: 3 that roll up, 1 that finds nothing left
    assert (summary["minutes"], summary["transactions"]) == (180, 4)
    assert summary["rollup_rows"]["gpu_rollup_1m"] == 360
    # raw rows older than an hour are gone (all but the last hour and the counter-gap margin)
    assert 240 <= summary["expired_rows"]["gpu_samples"] < 360
    steps = _progress(caplog, "maintain")
    assert steps[0] == ("roll up minutes", 0, 180) and steps[-1] == ("roll up minutes", 180, 180)
    assert [d for _, d, _ in steps] == sorted(d for _, d, _ in steps) and len(steps) >= 3
    names, rows = AnalyticsStore(db, read_only=True).sql("SELECT count(*) FROM gpu_rollup_1m")
    assert rows == [(360,)]

    # run again: nothing left to roll up, one transaction
    res = CliRunner().invoke(app, ["maintain", "--db", db, "--now", str(now), "--json", "--no-progress"])
    assert res.exit_code == 0, res.output
    again = json.loads(res.stdout)
    assert (again["minutes"], again["transactions"], again["rollup_rows"]["gpu_rollup_1m"]) == (0, 1, 0)


def test_maintain_errors(tmp_path: Path) -> None:
    db = _big_db(tmp_path, minutes=2)
    res = CliRunner().invoke(app, ["maintain", "--db", db, "--step-s", "10"])
    assert res.exit_code == 2 and "max_rollup_s" in res.output
    res = CliRunner().invoke(app, ["maintain", "--db", str(tmp_path / "no" / "such.duckdb")])
    assert res.exit_code == 1 and "cannot open" in res.output


def test_progress_bar_on_request_and_log_lines_otherwise(caplog: pytest.LogCaptureFixture) -> None:
    """--progress draws rich's bar (no log lines); --no-progress, or no terminal, logs JSON events."""
    caplog.set_level(logging.INFO, logger="analytics.cli")
    args = ["evaluate", "--trace", str(TRACE_DIR), "--slice-pods", "2", "--json"]
    res = CliRunner().invoke(app, [*args, "--progress"])
    assert res.exit_code == 0, res.output
    assert _progress(caplog, "evaluate") == []
    res = CliRunner().invoke(app, args)  # CliRunner's stderr is no terminal: log lines
    assert res.exit_code == 0, res.output
    steps = _progress(caplog, "evaluate")
    order = [name for name, _, _ in steps]
    runs = [n for i, n in enumerate(order) if i == 0 or order[i - 1] != n]
    assert runs == ["read trace", "classify", "score"]
    ends = {name: (done, total) for name, done, total in steps}
    assert ends["read trace"] == (3, 3) and ends["score"] == (7, 7)
    assert ends["classify"][0] == ends["classify"][1] > 1000  # time instants of 22.8 h at 57 s
    assert len([1 for n, _, _ in steps if n == "classify"]) <= 12  # every 10 %, not every instant
    assert json.loads(res.stdout)["pods"] == 2


def test_run_takes_what_no_flag_gives_from_the_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    toml = settings_file(
        tmp_path,
        monkeypatch,
        'kafka = "k-file:9092"\nanalytics_db = "/data/a.duckdb"\n'
        '[idle]\npool = "p-file"\nmin_idle_s = 120\n[analytics]\nmemory_limit = "1GB"\n',
    )
    monkeypatch.setenv("GPUPOOL_IDLE__MIN_IDLE_S", "90")
    s = run_settings(toml, kafka=None, pool="p-flag", min_idle_s=None, metrics_port=None)
    assert (s.kafka, str(s.analytics_db)) == ("k-file:9092", "/data/a.duckdb")  # the file
    assert (s.idle.pool, s.idle.min_idle_s) == ("p-flag", 90.0)  # the flag, the environment
    assert (s.analytics.memory_limit, s.metrics.analytics) == ("1GB", 9411)
    assert s.analytics.group_id == "gpupool-analytics"  # the default
    # the thresholds from the file are checked like flags: exit 2, the message says why
    toml.write_text('kafka = "k:9092"\n[idle]\nidle_threshold = 0.5\nbusy_threshold = 0.1\n')
    res = CliRunner().invoke(app, ["run", "--config", str(toml)])
    assert res.exit_code == 2 and "idle_threshold" in res.output
    res = CliRunner().invoke(app, ["run", "--config", str(tmp_path / "missing.toml")])
    assert res.exit_code == 2 and "does not exist" in res.output
    toml.write_text("[idle]\npool = 3\n")
    res = CliRunner().invoke(app, ["run", "--config", str(toml), "--kafka", "k:9092"])
    assert res.exit_code == 2 and "pool" in res.output
    res = CliRunner().invoke(app, ["run"])  # no Kafka anywhere
    assert res.exit_code == 2 and "GPUPOOL_KAFKA" in res.output
