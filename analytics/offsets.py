"""Where the analytics store keeps its Kafka positions: the next offset to read per partition,
committed in the same DuckDB transaction as the rows read before it (exactly-once).

Two sources, and the position of a partition is the larger of the two:

* **The rows themselves.** Every raw row carries the position of the record it came from
  (``kafka_partition``, ``kafka_offset``; :mod:`analytics.rows`, :mod:`analytics.scheduler`). For
  a table whose topic the store was told (``kafka_sources``: table → topic, one topic per table),
  ``max(kafka_offset) + 1`` per partition is a committed position with no statement of its own.
* **``committed_offsets(topic, partition, next_offset)``**, written only for what the rows do not
  say: a batch whose last record of a partition wrote no row there (a refused or skipped record,
  a record of a topic without a source table), every batch of a store that was given no sources,
  and, by the maintenance step, the positions of raw rows it is about to expire.

The view ``consumer_offsets(topic, partition, next_offset)`` is that larger value, what
:meth:`analytics.store.AnalyticsStore.stored_offsets` returns and what operators query.

A table whose topic changes (a store reopened with another topic for it) stops deriving: its
derived positions under the old topic are first written to ``committed_offsets``, and its topic
becomes NULL, so rows of the old topic never count for the new one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import duckdb
import pyarrow as pa

from contracts.bus import TopicPartition
from contracts.topics import KafkaTopics

log = logging.getLogger(__name__)

SOURCED_TABLES: tuple[str, ...] = ("gpu_samples", "ib_port_samples", "scheduler_gpu_samples")
"""Raw tables whose rows carry the Kafka position of their record (``kafka_partition``,
``kafka_offset``)."""


def table_topics(topics: KafkaTopics) -> dict[str, str]:
    """Each table of :data:`SOURCED_TABLES` → the topic of ``topics`` its rows are read from (the
    ``sources`` of :class:`analytics.store.AnalyticsStore`)."""
    return {
        "gpu_samples": topics.telemetry_gpu,
        "ib_port_samples": topics.telemetry_ib_port,
        "scheduler_gpu_samples": topics.telemetry_scheduler,
    }


TABLES: tuple[str, ...] = (
    (
        "CREATE TABLE IF NOT EXISTS committed_offsets ("
        " topic VARCHAR NOT NULL, partition INTEGER NOT NULL,"
        " next_offset BIGINT NOT NULL CHECK (next_offset >= 0), PRIMARY KEY (topic, partition))"
    ),
    "CREATE TABLE IF NOT EXISTS kafka_sources (table_name VARCHAR PRIMARY KEY, topic VARCHAR)",
)
"""The tables of this module (module docstring); ``kafka_sources.topic`` NULL: not derived."""

MIGRATE_FROM_2: tuple[str, ...] = (
    "CREATE TABLE IF NOT EXISTS consumer_offsets (topic VARCHAR, partition INTEGER, next_offset BIGINT)",
    "INSERT INTO committed_offsets SELECT topic, partition, next_offset FROM consumer_offsets",
    "DROP TABLE consumer_offsets",
)
"""Layout 2 → 3: the positions of the former ``consumer_offsets`` table become committed ones
(the name is now the view's)."""


def _derived_sql(where: str = "", tables: tuple[str, ...] = SOURCED_TABLES) -> str:
    """``(topic, partition, next_offset)`` derived from the rows of ``tables`` (those matching
    ``where``, an SQL condition on the columns of a table's rows ``r``, if given)."""
    cond = f" WHERE {where}" if where else ""
    return " UNION ALL ".join(
        "SELECT k.topic, r.kafka_partition AS partition, max(r.kafka_offset) + 1 AS next_offset"
        f" FROM {table} r JOIN kafka_sources k ON k.table_name = '{table}' AND k.topic IS NOT NULL"
        f"{cond} GROUP BY ALL"
        for table in tables
    )


VIEW_SQL = (
    "CREATE OR REPLACE VIEW consumer_offsets AS"
    " SELECT topic, partition, max(next_offset) AS next_offset FROM ("
    " SELECT topic, partition, next_offset FROM committed_offsets"
    f" UNION ALL {_derived_sql()}"
    ") GROUP BY topic, partition"
)
"""The ``consumer_offsets`` view (module docstring)."""


def commit_derived(
    con: duckdb.DuckDBPyConnection,
    where: str = "",
    params: object = None,
    tables: tuple[str, ...] = SOURCED_TABLES,
) -> None:
    """Write to ``committed_offsets`` the positions derived from the rows of ``tables`` that match
    ``where`` (an SQL condition on a row ``r``, with ``params``; all rows if empty), keeping the
    larger position where one is stored: before those rows are deleted or stop counting. Runs in
    the caller's transaction; raises ``duckdb.Error``."""
    derived = _derived_sql(where, tables)
    con.execute(
        f"INSERT INTO committed_offsets SELECT topic, partition, max(next_offset) FROM ({derived})"
        " GROUP BY ALL ON CONFLICT (topic, partition)"
        " DO UPDATE SET next_offset = greatest(next_offset, excluded.next_offset)",
        params,
    )


def set_sources(con: duckdb.DuckDBPyConnection, sources: Mapping[str, str]) -> dict[str, str]:
    """Record the topic of each table of ``sources`` (table → topic) in ``kafka_sources``, in one
    transaction, and return the tables whose positions writes may leave to their rows, as topic →
    table. A table already recorded with another topic stops deriving (module docstring: its
    derived positions are committed first; logged as ``analytics_offsets_source_changed``).

    Raises:
        ValueError: a table is not one of :data:`SOURCED_TABLES`, or two tables name one topic.
        duckdb.Error: the transaction failed (rolled back).
    """
    unknown = sorted(set(sources) - set(SOURCED_TABLES))
    if unknown:
        raise ValueError(f"not a table with Kafka positions: {', '.join(unknown)} (one of {SOURCED_TABLES})")
    if len(set(sources.values())) != len(sources):
        raise ValueError(f"two tables read from one topic: {dict(sources)}")
    stored = dict(con.execute("SELECT table_name, topic FROM kafka_sources").fetchall())
    derived: dict[str, str] = {}
    con.begin()
    try:
        for table, topic in sources.items():
            if table not in stored:
                con.execute("INSERT INTO kafka_sources VALUES (?, ?)", [table, topic])
            elif stored[table] != topic:
                if stored[table] is not None:
                    commit_derived(con, tables=(table,))
                    con.execute("UPDATE kafka_sources SET topic = NULL WHERE table_name = ?", [table])
                    log.warning(
                        "analytics_offsets_source_changed",
                        extra={"table": table, "topic": stored[table], "new_topic": topic},
                    )
                continue
            derived[topic] = table
        con.commit()
    except BaseException:
        con.rollback()
        raise
    return derived


def uncovered(
    offsets: Mapping[TopicPartition, int], tables: Mapping[str, pa.Table], derived: Mapping[str, str]
) -> dict[TopicPartition, int]:
    """The positions of ``offsets`` (partition → next offset) that the rows of ``tables`` (table
    name → the batch's rows) do not commit by themselves: those of a topic without a derived table
    (``derived``: topic → table, :func:`set_sources`), or whose last record (``next - 1``) wrote
    no row of that partition into its table."""
    out: dict[TopicPartition, int] = {}
    last: dict[str, dict[int, int]] = {}
    for tp, nxt in offsets.items():
        table = derived.get(tp.topic)
        rows = tables.get(table) if table is not None else None
        if table is None or rows is None:
            out[tp] = nxt
            continue
        if table not in last:
            grouped = rows.group_by("kafka_partition").aggregate([("kafka_offset", "max")])
            last[table] = dict(
                zip(
                    grouped["kafka_partition"].to_pylist(),
                    grouped["kafka_offset_max"].to_pylist(),
                    strict=True,
                )
            )
        if last[table].get(tp.partition) != nxt - 1:
            out[tp] = nxt
    return out


def upsert(con: duckdb.DuckDBPyConnection, offsets: Mapping[TopicPartition, int]) -> None:
    """Set ``committed_offsets`` to ``offsets``: one ``UPDATE`` of the partitions' rows (the values
    as parameters), and only when some partition has no row yet (its first batch) an ``INSERT ...
    ON CONFLICT DO UPDATE`` of them all — DuckDB's upsert costs several times the update. Runs in
    the caller's transaction. Raises ``duckdb.ConstraintException`` for a negative offset."""
    items = sorted(offsets.items())
    rows = ", ".join(["(?, ?, ?)"] * len(items))
    params = [v for tp, off in items for v in (tp.topic, tp.partition, off)]
    updated = con.execute(
        f"UPDATE committed_offsets AS o SET next_offset = v.next_offset"
        f" FROM (VALUES {rows}) v(topic, partition, next_offset)"
        " WHERE o.topic = v.topic AND o.partition = v.partition",
        params,
    ).fetchone()
    if updated is not None and updated[0] == len(items):
        return
    con.execute(
        f"INSERT INTO committed_offsets VALUES {rows}"
        " ON CONFLICT (topic, partition) DO UPDATE SET next_offset = excluded.next_offset",
        params,
    )
