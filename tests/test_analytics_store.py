"""DuckDB store: batched Arrow inserts, rows and offsets in one transaction, exact counters."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from analytics.classify import FB_USED, GPU_UTIL, GR_ENGINE_ACTIVE, IdleRun
from analytics.rows import (
    counters_out_of_range,
    counter_column,
    gpu_samples_table,
    gpu_states_table,
    ib_port_samples_table,
    idle_runs_table,
)
from analytics.store import AnalyticsStore, StoreBatch, StoreSchemaError
from contracts import CapacityUpdate, GpuSample, GpuState, IbPortSample, IdleGrade
from contracts.bus import TopicPartition

GPU_TP = TopicPartition("telemetry.gpu", 0)
IB_TP = TopicPartition("telemetry.ib_port", 0)


def samples(n: int, t0: float = 1_700_000_000.0) -> list[GpuSample]:
    return [
        GpuSample(
            ts=t0 + i,
            host="n1",
            gpu_uuid=f"GPU-{i % 3}",
            gpu_instance_id=(7 if i % 3 == 2 else None),
            model_name="NVIDIA H100 80GB HBM3",
            fields={GR_ENGINE_ACTIVE: 0.25, GPU_UTIL: 30, FB_USED: 1024.0, "DCGM_FI_DEV_POWER_USAGE": 71.5},
            invalid={"DCGM_FI_DEV_MEMORY_TEMP": "sentinel"},
            attributes={"pod": "p, with comma"},
            seq=i,
        )
        for i in range(n)
    ]


def port(ts: float, xmit: int | None) -> IbPortSample:
    return IbPortSample(
        ts=ts,
        host="n1",
        device="mlx5_0",
        node_guid="0x0002c90300a1b2c3",
        port=1,
        link_layer="InfiniBand",
        state_id=4,
        state="ACTIVE",
        rate_bytes_per_second=25_000_000_000,
        counters={"PortXmitData": xmit, "PortRcvData": 2**53 + 1, "PortXmitWait": None, "VL15Dropped": 3},
        counter_bits={"PortXmitData": 64},
        saturated=["SymbolErrorCounter"],
    )


def gpu_batch(items: list[GpuSample], first_offset: int) -> pa.Table:
    return gpu_samples_table(items, [0] * len(items), list(range(first_offset, first_offset + len(items))))


def count(store: AnalyticsStore, table: str) -> int:
    return int(store.sql(f"SELECT count(*) FROM {table}")[1][0][0])


def test_batch_rows_and_offsets_commit_together() -> None:
    store = AnalyticsStore(":memory:")
    ib = ib_port_samples_table([port(1.0, 2**64 - 1), port(2.0, None)], [0, 0], [0, 1])
    written = store.write(
        StoreBatch(gpu_samples=gpu_batch(samples(5), 0), ib_port_samples=ib, offsets={GPU_TP: 5, IB_TP: 2})
    )
    assert written == {"gpu_samples": 5, "ib_port_samples": 2}
    assert store.stored_offsets() == {GPU_TP: 5, IB_TP: 2}
    assert store.stored_offsets(["telemetry.gpu"]) == {GPU_TP: 5}
    store.write(StoreBatch(gpu_samples=gpu_batch(samples(3, t0=1_700_000_100.0), 5), offsets={GPU_TP: 8}))
    assert store.stored_offsets()[GPU_TP] == 8 and count(store, "gpu_samples") == 8
    _, rows = store.sql(
        "SELECT gpu_key, gr_engine_active, gpu_util, fb_used_mib, power_w,"
        " invalid->>'DCGM_FI_DEV_MEMORY_TEMP', attributes->>'pod', epoch(ts), kafka_offset"
        " FROM gpu_samples ORDER BY kafka_offset LIMIT 3"
    )
    assert rows[0] == ("n1/GPU-0", 0.25, 30.0, 1024, 71.5, "sentinel", "p, with comma", 1_700_000_000.0, 0)
    assert rows[2][0] == "n1/GPU-2/7"


def test_counters_outside_u64_are_null_and_counted() -> None:
    """2**64 - 1 still fits; 2**64 and -1 are stored NULL and counted once each (the service adds
    them to ``gpupool_analytics_rejected_records_total{reason="counter_out_of_range"}``)."""
    items = [port(1.0, 2**64 - 1), port(2.0, 2**64), port(3.0, -1), port(4.0, None)]
    ib = ib_port_samples_table(items, [0] * 4, [0, 1, 2, 3])
    assert ib.column("port_xmit_data").to_pylist() == [2**64 - 1, None, None, None]
    assert counters_out_of_range(items) == 2
    assert counters_out_of_range(items[:1]) == 0


def test_ib_counters_stay_exact_integers() -> None:
    store = AnalyticsStore(":memory:")
    ib = ib_port_samples_table([port(1.0, 2**64 - 1), port(2.0, 5)], [0, 0], [0, 1])
    store.write(StoreBatch(ib_port_samples=ib, offsets={IB_TP: 2}))
    _, rows = store.sql(
        "SELECT port_xmit_data, port_rcv_data, port_xmit_wait, typeof(port_xmit_data),"
        " counters->>'VL15Dropped', saturated, port_key FROM ib_port_samples ORDER BY ts"
    )
    assert rows[0][:4] == (2**64 - 1, 2**53 + 1, None, "HUGEINT")  # None: unreadable, not 0
    assert rows[0][4:] == ("3", ["SymbolErrorCounter"], "0x0002c90300a1b2c3/1")
    # A drop (counter reset) gives an exact negative delta, no overflow, no float rounding.
    _, [(delta,)] = store.sql(
        "SELECT port_xmit_data - lag(port_xmit_data) OVER (ORDER BY ts) FROM ib_port_samples"
        " ORDER BY ts DESC LIMIT 1"
    )
    assert delta == 5 - (2**64 - 1)
    assert counter_column("PortXmitData") == "port_xmit_data"
    assert counter_column("VL15Dropped") == "vl15_dropped"


def test_failure_mid_batch_leaves_neither_rows_nor_offsets() -> None:
    store = AnalyticsStore(":memory:")
    store.write(StoreBatch(gpu_samples=gpu_batch(samples(2), 0), offsets={GPU_TP: 2}))
    # The GPU rows are inserted first, then the offsets fail their CHECK: everything rolls back.
    with pytest.raises(duckdb.ConstraintException):
        store.write(StoreBatch(gpu_samples=gpu_batch(samples(4), 2), offsets={GPU_TP: 6, IB_TP: -1}))
    assert count(store, "gpu_samples") == 2 and store.stored_offsets() == {GPU_TP: 2}
    # A table that does not fit fails after the GPU rows went in: rolled back as well.
    bad = pa.table({"no_such_column": [1]})
    with pytest.raises(duckdb.Error):
        store.write(
            StoreBatch(gpu_samples=gpu_batch(samples(4), 2), ib_port_samples=bad, offsets={GPU_TP: 6})
        )
    assert count(store, "gpu_samples") == 2 and store.stored_offsets() == {GPU_TP: 2}
    # The store is usable afterwards.
    store.write(StoreBatch(gpu_samples=gpu_batch(samples(4), 2), offsets={GPU_TP: 6}))
    assert count(store, "gpu_samples") == 6 and store.stored_offsets() == {GPU_TP: 6}


def test_a_batch_of_one_statement_is_stored_whole_or_not_at_all() -> None:
    """One table whose rows hold their own offsets (a store told its tables' topics): its insert
    is the batch's only statement, run without BEGIN / COMMIT. A last row that fails the JSON
    cast after three went in leaves none stored; the same rows fixed are all stored."""
    store = AnalyticsStore(":memory:", sources={"gpu_samples": GPU_TP.topic})
    rows = gpu_batch(samples(4), 0)
    fields = rows.schema.get_field_index("fields")
    broken = rows.set_column(fields, "fields", pa.array(["{}"] * 3 + ["{"]))
    with pytest.raises(duckdb.Error):
        store.write(StoreBatch(gpu_samples=broken, offsets={GPU_TP: 4}))
    assert count(store, "gpu_samples") == 0 and store.stored_offsets() == {}
    fixed = rows.set_column(fields, "fields", pa.array(["{}"] * 4))
    store.write(StoreBatch(gpu_samples=fixed, offsets={GPU_TP: 4}))
    assert count(store, "gpu_samples") == 4 and store.stored_offsets() == {GPU_TP: 4}
    assert int(store.sql("SELECT count(*) FROM committed_offsets")[1][0][0]) == 0  # the rows hold it


def test_offsets_of_known_and_new_partitions_in_one_batch() -> None:
    """A batch's offsets update the partitions that have a row and insert the others; a
    negative offset for a partition that has a row fails the batch like one for a new one."""
    store = AnalyticsStore(":memory:")
    tp1, tp2 = TopicPartition("telemetry.gpu", 1), TopicPartition("telemetry.gpu", 2)
    store.write(StoreBatch(offsets={GPU_TP: 4}))
    store.write(StoreBatch(offsets={GPU_TP: 5, tp1: 7}))  # one known, one new
    assert store.stored_offsets() == {GPU_TP: 5, tp1: 7}
    store.write(StoreBatch(offsets={GPU_TP: 6, tp1: 8}))  # both known
    store.write(StoreBatch(offsets={tp2: 0}))  # a new one alone, at offset 0
    assert store.stored_offsets() == {GPU_TP: 6, tp1: 8, tp2: 0}
    for bad in ({GPU_TP: -1}, {GPU_TP: 9, tp1: -1}):
        with pytest.raises(duckdb.ConstraintException):
            store.write(StoreBatch(gpu_samples=gpu_batch(samples(1), 0), offsets=bad))
    assert store.stored_offsets() == {GPU_TP: 6, tp1: 8, tp2: 0} and count(store, "gpu_samples") == 0


def test_offsets_and_history_survive_reopening(tmp_path: Path) -> None:
    db = str(tmp_path / "a.duckdb")
    store = AnalyticsStore(db)
    run = IdleRun("n1/GPU-0", "H100", start=100.0, end=400.0, censored=True)
    store.write(
        StoreBatch(
            gpu_samples=gpu_batch(samples(3), 0),
            idle_runs=idle_runs_table([(run, "p1")]),
            offsets={GPU_TP: 3},
        )
    )
    store.close()
    store.close()  # idempotent
    again = AnalyticsStore(db)
    assert again.stored_offsets() == {GPU_TP: 3}
    assert again.idle_runs() == [("n1/GPU-0", "p1", 300.0, True)]
    again.close()
    ro = AnalyticsStore(db, read_only=True)
    assert count(ro, "gpu_samples") == 3
    ro.close()


def test_a_file_of_another_layout_is_refused(tmp_path: Path) -> None:
    db = str(tmp_path / "old.duckdb")
    AnalyticsStore(db).close()
    con = duckdb.connect(db)
    con.execute("UPDATE analytics_meta SET value = '0' WHERE key = 'schema_version'")
    con.close()
    with pytest.raises(StoreSchemaError):
        AnalyticsStore(db)


def test_gpu_state_now_is_latest_sample_with_latest_state() -> None:
    store = AnalyticsStore(":memory:")
    store.write(StoreBatch(gpu_samples=gpu_batch(samples(9), 0), offsets={GPU_TP: 9}))
    upd = CapacityUpdate(
        ts=1_700_000_008.0,
        host="n1",
        gpu_uuid="GPU-2",
        gpu_instance_id=7,
        state=GpuState.IDLE,
        since=1_700_000_000.0,
        grade=IdleGrade.FREE,
        predicted_idle_until=1_700_000_600.0,
        confidence=0.9,
    )
    older = upd.model_copy(update={"ts": 1_700_000_001.0, "state": GpuState.BUSY, "grade": None})
    store.write(StoreBatch(gpu_states=gpu_states_table([older, upd])))
    _, rows = store.sql(
        "SELECT gpu_key, epoch(sample_ts), state, grade, confidence FROM gpu_state_now ORDER BY 1"
    )
    assert rows == [
        ("n1/GPU-0", 1_700_000_006.0, None, None, None),
        ("n1/GPU-1", 1_700_000_007.0, None, None, None),
        ("n1/GPU-2/7", 1_700_000_008.0, "idle", "free", 0.9),
    ]


def test_non_finite_and_oversized_values_do_not_fail_the_batch() -> None:
    s = GpuSample(
        ts=1.0,
        host="n1",
        gpu_uuid="GPU-x",
        gpu_index=2**40,
        fields={GR_ENGINE_ACTIVE: float("nan"), FB_USED: 10**30, "X": float("inf")},
    )
    store = AnalyticsStore(":memory:")
    store.write(StoreBatch(gpu_samples=gpu_samples_table([s], [0], [0])))
    _, [(gi, fb, fields)] = store.sql("SELECT gpu_index, fb_used_mib, fields FROM gpu_samples")
    assert gi is None and fb is None and '"X":null' in fields
    with pytest.raises(ValueError):
        gpu_samples_table([s], [0, 1], [0])


def test_columns_built_at_once_equal_the_value_by_value_rules() -> None:
    """gpu_samples_table converts a column at a time; every value must be what the scalar rules
    (_micros, _as_int, _as_float, _as_whole) give, including the values that force the slow way."""
    from analytics.rows import _as_float, _as_int, _as_whole, _micros

    odd: list[float | int] = [1.5, 2.5, -0.5, 0.49999999999999994, 1e30, 2**63 - 1, 2**63, -(2**63), 7]
    odd += [2**53 + 1, 10**400, float("nan"), float("inf"), -0.0, 2**64 + 3]
    items = [
        GpuSample(
            ts=1_700_000_000.0000005 + i * 1.5e-6,
            host="n1",
            gpu_uuid=f"GPU-{i}",
            gpu_index=[0, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1][i % 5],
            gpu_instance_id=[None, 2**40, 3][i % 3],
            seq=[0, 2**63 - 1, 2**63, -(2**63) - 1][i % 4],
            fields={FB_USED: v, GR_ENGINE_ACTIVE: v, "DCGM_FI_DEV_FB_FREE": odd[-1 - i]},
        )
        for i, v in enumerate(odd)
    ]
    for chunk in (items, items[:1], [s for s in items if isinstance(s.fields[FB_USED], int)]):
        got = gpu_samples_table(chunk, [0] * len(chunk), list(range(len(chunk))))
        want = {
            "ts": [_micros(s.ts) for s in chunk],
            "gpu_index": [_as_int(s.gpu_index, 32) for s in chunk],
            "gpu_instance_id": [_as_int(s.gpu_instance_id, 32) for s in chunk],
            "seq": [_as_int(s.seq, 64) for s in chunk],
            "gr_engine_active": [_as_float(s.fields[GR_ENGINE_ACTIVE]) for s in chunk],
            "fb_used_mib": [_as_whole(s.fields[FB_USED]) for s in chunk],
            "fb_free_mib": [_as_whole(s.fields["DCGM_FI_DEV_FB_FREE"]) for s in chunk],
        }
        for col, values in want.items():
            column = got.column(col)
            if col == "ts":
                column = column.cast(pa.int64())
            assert repr(column.to_pylist()) == repr(values), col
    assert gpu_samples_table([], [], []).num_rows == 0
    with pytest.raises(ValueError):
        gpu_samples_table([items[0].model_copy(update={"ts": float("nan")})], [0], [0])
    with pytest.raises(pa.ArrowInvalid):  # past the int64 microsecond range: the service drops it
        gpu_samples_table([items[0].model_copy(update={"ts": 1e300})], [0], [0])


def test_duckdb_gets_its_share_of_the_memory_limit() -> None:
    from analytics.store import DUCKDB_MEMORY_SHARE, duckdb_memory_limit, parse_bytes

    assert parse_bytes("2GB") == 2_000_000_000 and parse_bytes("1.5 GiB") == 1_610_612_736
    assert parse_bytes("800mb") == 800_000_000 and parse_bytes("4096") == 4096
    assert duckdb_memory_limit("2GB") == f"{int(2e9 * DUCKDB_MEMORY_SHARE)}B"
    for bad in ("", "two GB", "2 parsecs", "-1GB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    store = AnalyticsStore(":memory:", memory_limit="1GiB")
    _, [(limit,)] = store.sql("SELECT current_setting('memory_limit')")
    number, unit = limit.split()
    assert unit == "MiB" and abs(float(number) - DUCKDB_MEMORY_SHARE * 1024) < 0.2  # DuckDB truncates
    with pytest.raises(ValueError):
        AnalyticsStore(":memory:", memory_limit="lots")
