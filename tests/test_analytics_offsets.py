"""Kafka positions kept by the rows themselves (analytics.offsets): which offsets a batch still
writes, the ``consumer_offsets`` view after writes, reopening, expiry, a changed topic and the
layout-2 migration."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from analytics.offsets import SOURCED_TABLES, table_topics, uncovered
from analytics.retention import RetentionConfig
from analytics.rows import gpu_samples_table
from analytics.store import STORE_SCHEMA_VERSION, AnalyticsStore, StoreBatch
from contracts import GpuSample, KafkaTopics
from contracts.bus import TopicPartition

T0 = 1_700_000_000.0
TOPICS = KafkaTopics()
SOURCES = table_topics(TOPICS)
P0 = TopicPartition(TOPICS.telemetry_gpu, 0)
P1 = TopicPartition(TOPICS.telemetry_gpu, 1)
IB0 = TopicPartition(TOPICS.telemetry_ib_port, 0)


def rows(partition: int, offsets: list[int], t0: float = T0) -> pa.Table:
    """``gpu_samples`` rows of one sample per record at ``offsets`` of ``partition``."""
    items = [
        GpuSample(ts=t0 + k, host="n1", gpu_uuid=f"GPU-{k}", fields={"DCGM_FI_DEV_GPU_UTIL": 0}, seq=k)
        for k in range(len(offsets))
    ]
    return gpu_samples_table(items, [partition] * len(items), offsets)


def committed(store: AnalyticsStore) -> dict[tuple[str, int], int]:
    _, out = store.sql("SELECT topic, partition, next_offset FROM committed_offsets")
    return {(t, p): o for t, p, o in out}


def test_uncovered_is_what_the_last_record_did_not_write() -> None:
    table = pa.concat_tables([rows(0, [3, 4, 4]), rows(1, [7])])
    derived = {TOPICS.telemetry_gpu: "gpu_samples"}
    tables = {"gpu_samples": table}
    # offset 4 was partition 0's last record, 7 partition 1's: nothing left to write
    assert uncovered({P0: 5, P1: 8}, tables, derived) == {}
    # records 5 (partition 0) and 8-9 (partition 1) wrote no row
    assert uncovered({P0: 6, P1: 10}, tables, derived) == {P0: 6, P1: 10}
    # a partition without rows, a topic without a table, a store told no sources
    p2 = TopicPartition(TOPICS.telemetry_gpu, 2)
    assert uncovered({p2: 1, IB0: 3}, tables, derived) == {p2: 1, IB0: 3}
    assert uncovered({P0: 5}, tables, {}) == {P0: 5}
    assert uncovered({IB0: 3}, tables, {TOPICS.telemetry_ib_port: "ib_port_samples"}) == {IB0: 3}


def test_covered_batches_write_no_offsets_and_the_view_has_them(tmp_path: Path) -> None:
    db = str(tmp_path / "a.duckdb")
    store = AnalyticsStore(db, sources=SOURCES)
    store.write(StoreBatch(gpu_samples=rows(0, [0, 1, 2]), offsets={P0: 3}))
    assert committed(store) == {} and store.stored_offsets() == {P0: 3}
    # the last record of the batch (3) wrote no row: its position is committed
    store.write(StoreBatch(gpu_samples=rows(0, [2]), offsets={P0: 4}))
    assert committed(store) == {(TOPICS.telemetry_gpu, 0): 4} and store.stored_offsets() == {P0: 4}
    # later rows pass it again: the larger position wins
    store.write(StoreBatch(gpu_samples=rows(0, [4, 5]), offsets={P0: 6}))
    assert committed(store) == {(TOPICS.telemetry_gpu, 0): 4} and store.stored_offsets() == {P0: 6}
    store.close()
    # reopened without sources (an operator's tool) and read-only: the same positions
    again = AnalyticsStore(db)
    assert again.stored_offsets() == {P0: 6}
    again.close()
    ro = AnalyticsStore(db, read_only=True)
    _, view = ro.sql("SELECT topic, partition, next_offset FROM consumer_offsets")
    assert view == [(TOPICS.telemetry_gpu, 0, 6)]
    ro.close()


def test_a_store_without_sources_writes_every_offset() -> None:
    store = AnalyticsStore(":memory:")
    store.write(StoreBatch(gpu_samples=rows(0, [0, 1]), offsets={P0: 2}))
    assert committed(store) == {(TOPICS.telemetry_gpu, 0): 2}
    _, sources = store.sql("SELECT * FROM kafka_sources")
    assert sources == []


def test_expired_rows_leave_their_positions_behind() -> None:
    store = AnalyticsStore(":memory:", sources=SOURCES)
    store.write(StoreBatch(gpu_samples=rows(0, [0, 1, 2]), offsets={P0: 3}))
    # partition 1: its last record (offset 5) wrote no row; the committed 6 outlives the rows' 5
    store.write(StoreBatch(gpu_samples=rows(1, [3, 4]), offsets={P1: 6}))
    cfg = RetentionConfig(raw_retention_s=60.0, rollup_retention_s=3600.0)
    result = store.maintain(cfg, T0 + 7200)
    assert result.expired_rows["gpu_samples"] == 5
    _, [(left,)] = store.sql("SELECT count(*) FROM gpu_samples")
    assert left == 0
    assert store.stored_offsets() == {P0: 3, P1: 6}
    assert committed(store) == {(TOPICS.telemetry_gpu, 0): 3, (TOPICS.telemetry_gpu, 1): 6}


def test_a_table_read_from_another_topic_stops_deriving(tmp_path: Path) -> None:
    db = str(tmp_path / "a.duckdb")
    store = AnalyticsStore(db, sources=SOURCES)
    store.write(StoreBatch(gpu_samples=rows(0, [0, 1]), offsets={P0: 2}))
    store.close()
    renamed = dict(SOURCES, gpu_samples="site2.telemetry.gpu")
    store = AnalyticsStore(db, sources=renamed)
    # the old topic's position is kept, the old rows count for no other topic
    assert store.stored_offsets() == {P0: 2} and committed(store) == {(TOPICS.telemetry_gpu, 0): 2}
    new = TopicPartition("site2.telemetry.gpu", 0)
    store.write(StoreBatch(gpu_samples=rows(0, [0]), offsets={new: 1}))
    assert store.stored_offsets() == {P0: 2, new: 1}
    assert committed(store)[("site2.telemetry.gpu", 0)] == 1
    _, [(topic,)] = store.sql("SELECT topic FROM kafka_sources WHERE table_name = 'gpu_samples'")
    assert topic is None
    store.close()
    # and it does not derive again when reopened with the first topic
    store = AnalyticsStore(db, sources=SOURCES)
    store.write(StoreBatch(gpu_samples=rows(0, [2]), offsets={P0: 3}))
    assert committed(store)[(TOPICS.telemetry_gpu, 0)] == 3
    store.close()


def test_sources_are_checked() -> None:
    with pytest.raises(ValueError, match="gpu_states"):
        AnalyticsStore(":memory:", sources={"gpu_states": "x"})
    with pytest.raises(ValueError, match="one topic"):
        AnalyticsStore(":memory:", sources={"gpu_samples": "x", "ib_port_samples": "x"})
    assert set(SOURCES) == set(SOURCED_TABLES)


def test_layout_2_offsets_become_committed_ones(tmp_path: Path) -> None:
    db = str(tmp_path / "v2.duckdb")
    con = duckdb.connect(db)
    con.execute(
        "CREATE TABLE analytics_meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL);"
        "INSERT INTO analytics_meta VALUES ('schema_version', '2');"
        "CREATE TABLE consumer_offsets (topic VARCHAR NOT NULL, partition INTEGER NOT NULL,"
        " next_offset BIGINT NOT NULL CHECK (next_offset >= 0), PRIMARY KEY (topic, partition));"
        f"INSERT INTO consumer_offsets VALUES ('{TOPICS.telemetry_gpu}', 0, 41), ('{TOPICS.telemetry_gpu}', 1, 7)"
    )
    con.close()
    store = AnalyticsStore(db, sources=SOURCES)
    assert store.stored_offsets() == {P0: 41, P1: 7}
    _, [(version,)] = store.sql("SELECT value FROM analytics_meta WHERE key = 'schema_version'")
    assert version == str(STORE_SCHEMA_VERSION) == "3"
    store.close()
