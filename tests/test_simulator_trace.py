"""simulator.trace: the real Alibaba GenAI 2026 trace, loaded from its tarballs and aligned."""

from __future__ import annotations

import csv
import io
import tarfile
import time
from collections import defaultdict
from pathlib import Path

import pytest

from simulator.trace import (
    DUTY_CYCLE_FILE,
    MEMORY_FILE,
    STEP_S,
    TraceError,
    default_trace_dir,
    load_trace,
)

TRACE_DIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "traces" / "alibaba_genai_2026"


def _raw_rows(name: str) -> list[dict[str, str]]:
    """The CSV rows of one tarball, read independently with tarfile + csv."""
    with tarfile.open(TRACE_DIR / name) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith(".csv"))
        fh = tf.extractfile(member)
        assert fh is not None
        return list(csv.DictReader(io.TextIOWrapper(fh, encoding="utf-8")))


def test_default_trace_dir_is_the_shared_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("GPUPOOL_TRACE_DIR", raising=False)
    assert default_trace_dir() == TRACE_DIR.resolve()
    assert (default_trace_dir() / DUTY_CYCLE_FILE).is_file()
    monkeypatch.setenv("GPUPOOL_TRACE_DIR", str(tmp_path))
    assert default_trace_dir() == tmp_path


def test_trace_matches_provenance_numbers() -> None:
    started = time.perf_counter()
    t = load_trace(TRACE_DIR, cache=False)
    elapsed = time.perf_counter() - started
    assert t.stats.util_rows == 157_417
    assert len(t.pods) == 143
    assert t.steps == 1_441
    assert t.step_s == STEP_S == 57.0
    assert abs(t.stats.zero_fraction - 0.668) <= 0.001
    assert (t.steps - 1) * t.step_s / 3600 == pytest.approx(22.8, abs=0.05)
    assert elapsed < 2.0, f"loading took {elapsed:.2f} s"


def test_every_raw_sample_lands_on_its_grid_cell_and_gaps_carry_the_previous_value() -> None:
    t = load_trace(TRACE_DIR)
    index = {p: i for i, p in enumerate(t.pods)}
    t0 = t.stats.t0_anon
    seen: dict[int, dict[int, float]] = defaultdict(dict)
    for row in _raw_rows(DUTY_CYCLE_FILE):
        i = index[row["container_ip"]]
        step = round((float(row["timestamp_anon"]) - t0) / 57)
        assert t.util(i, step) == float(row["value"])
        seen[i][step] = float(row["value"])
    carried = 0
    for i, samples in seen.items():
        first, last = min(samples), max(samples)
        assert (t.first_step[i], t.last_step[i]) == (first, last)
        prev = None
        for step in range(t.steps):
            if step < first or step > last:
                assert t.util(i, step) == 0.0 and t.mem_bytes(i, step) == 0
                assert not t.alive(i, step)
            elif step in samples:
                prev = samples[step]
            else:
                assert t.util(i, step) == prev
                carried += 1
    assert carried == t.stats.carried_util > 0


def test_memory_is_aligned_on_the_same_grid() -> None:
    t = load_trace(TRACE_DIR)
    index = {p: i for i, p in enumerate(t.pods)}
    checked = 0
    for row in _raw_rows(MEMORY_FILE):
        i = index.get(row["container_ip"])
        if i is None:
            continue
        step = round((float(row["timestamp_anon"]) - t.stats.t0_anon) / 57)
        if t.alive(i, step):
            assert t.mem_bytes(i, step) == int(float(row["value"]))
            checked += 1
    assert checked > 150_000
    assert t.stats.mem_only_pods == 1
    # PROVENANCE: idle samples still hold GPU memory (the model stays resident); a few hundred
    # live cells of the real file do read 0 bytes
    live = [t.mem_bytes(i, s) for i in range(len(t.pods)) for s in range(t.first_step[i], t.last_step[i] + 1)]
    assert sum(1 for v in live if v > 0) / len(live) > 0.995


def test_out_of_range_steps_raise() -> None:
    t = load_trace(TRACE_DIR)
    with pytest.raises(IndexError):
        t.util(0, t.steps)
    with pytest.raises(IndexError):
        t.mem_bytes(0, -1)


# --- small synthetic traces for the error paths ---------------------------------------------------

def _write_tar(folder: Path, name: str, csv_text: str) -> None:
    data = csv_text.encode()
    info = tarfile.TarInfo(name.replace(".tar.gz", ".csv"))
    info.size = len(data)
    with tarfile.open(folder / name, "w:gz") as tf:
        tf.addfile(info, io.BytesIO(data))


def _mk(folder: Path, duty: str, mem: str) -> Path:
    _write_tar(folder, DUTY_CYCLE_FILE, duty)
    _write_tar(folder, MEMORY_FILE, mem)
    return folder


def test_small_trace_carries_gaps_and_columns_may_come_in_any_order(tmp_path: Path) -> None:
    duty = ("value,timestamp_anon,container_ip\n"
            "0.0,1000.0,a\n5.0,1057.0,a\n7.5,1228.0,a\n"  # steps 0,1,(2,3 missing),4
            "1.0,1114.0,b\n")                              # b lives at step 2 only
    mem = ("timestamp_anon,value,container_ip\n"
           "1057.0,100.0,a\n1228.0,300.0,a\n1114.0,9.0,b\n1000.0,1.0,zz\n")
    t = load_trace(_mk(tmp_path, duty, mem), cache=False)
    assert t.pods == ["a", "b"] and t.steps == 5
    assert [t.util(0, s) for s in range(5)] == [0.0, 5.0, 5.0, 5.0, 7.5]
    assert [t.mem_bytes(0, s) for s in range(5)] == [100, 100, 100, 100, 300]
    assert [t.util(1, s) for s in range(5)] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert t.stats.carried_util == 2
    assert t.stats.carried_mem == 2 and t.stats.backfilled_mem == 1
    assert t.stats.mem_only_pods == 1
    assert t.stats.zero_fraction == 0.25


@pytest.mark.parametrize(
    ("duty", "message"),
    [
        ("value,timestamp_anon,container_ip\n1.0,1000.0,a\n1.0,1030.0,a\n", "off the 57 s grid"),
        ("value,timestamp_anon,container_ip\n101.0,1000.0,a\n", "outside 0..100"),
        ("value,timestamp_anon,container_ip\n1.0,1000.0,a\n2.0,1000.0,a\n", "duplicate"),
        ("value,timestamp_anon\n1.0,1000.0\n", "unexpected CSV content"),
        ("value,timestamp_anon,container_ip\n,1000.0,a\n", "empty values"),
    ],
)
def test_malformed_trace_is_a_clear_error(tmp_path: Path, duty: str, message: str) -> None:
    folder = _mk(tmp_path, duty, "timestamp_anon,value,container_ip\n1000.0,1.0,a\n")
    with pytest.raises(TraceError, match=message):
        load_trace(folder, cache=False)


def test_missing_tarball_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path, cache=False)


def test_not_a_tarball_is_a_trace_error(tmp_path: Path) -> None:
    (tmp_path / DUTY_CYCLE_FILE).write_bytes(b"not a tar archive at all")
    _write_tar(tmp_path, MEMORY_FILE, "timestamp_anon,value,container_ip\n")
    with pytest.raises(TraceError, match="not a readable tar archive"):
        load_trace(tmp_path, cache=False)


def test_a_truncated_tarball_is_a_trace_error(tmp_path: Path) -> None:
    """A download cut short ends the gzip stream mid-member (EOFError inside tarfile): a TraceError
    the CLI reports, not a traceback."""
    rows = "".join(f"{i % 100}.0,{1000 + 57 * i}.0,pod-{i % 7}\n" for i in range(20_000))
    _mk(tmp_path, "value,timestamp_anon,container_ip\n" + rows, "timestamp_anon,value,container_ip\n")
    whole = (tmp_path / DUTY_CYCLE_FILE).read_bytes()
    (tmp_path / DUTY_CYCLE_FILE).write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TraceError, match="not a readable tar archive"):
        load_trace(tmp_path, cache=False)
