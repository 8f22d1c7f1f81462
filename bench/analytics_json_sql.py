"""Benchmark of analytics ingest with DuckDB parsing the records' JSON itself, against the
yardstick of ``bench/analytics.py`` (issue 15: ingest at >= 50 % of DuckDB's bulk path).

The records are the headline records of ``bench/analytics.py``: ``--records`` GPU samples
(1,000 GPUs, 8 per host, every 10 s) as :class:`contracts.GpuScrape` records, ``--batch`` rows
per transaction, on one partition. Each transaction goes through five steps, each timed:

1. ``values``: the records' JSON as one Arrow ``string`` column, with their Kafka offsets
   (Python: one buffer of the values, checked as UTF-8 by Arrow);
2. ``parse``: DuckDB's JSON reader (``from_json`` with the :class:`contracts.GpuScrape`
   structure, the maps kept as ``JSON``) makes one row per GPU in a temporary table, with the
   fields the classifier and the ``gpu_samples`` columns read typed (``from_json`` of each
   GPU's ``fields``);
3. ``shape check``: the exact-type check such a path needs before it may accept a record, because
   DuckDB's reader converts where the record models refuse (a number read as a string, ``true``
   as 1.0, 1.5 as the integer 2; trailing commas and ``NaN`` are accepted): one RE2 regular
   expression of the records' canonical encoding (:func:`contracts.encode`: compact, members in
   model order), strings without ``\\u`` escapes, integers of at most 18 digits, numbers of at
   most 15 integer digits and 2 exponent digits. A record it refuses would go to the Python
   decoder (none does here);
4. ``classifier input``: the columns the idle classifier reads (time, identity, model, the
   seven fields of :mod:`analytics.classify`, ``invalid``) read back as Arrow and made Python
   lists;
5. ``write``: one transaction: ``INSERT INTO gpu_samples SELECT ... FROM`` the temporary table,
   and the offsets (as :meth:`analytics.store.AnalyticsStore.write` stores them).

Yardstick: ``INSERT INTO gpu_samples SELECT * FROM <arrow table>`` of the rows step 5 wrote
(read back afterwards, not timed), one insert per transaction, as ``bench/analytics.py``. Both
timed by this thread's CPU time with DuckDB on one thread (``bench/analytics.py --clock
thread``), in-memory databases, in turn ``--repeat`` times; the best of each is compared.

The steps leave out work the stage would also need (checking column lengths, GPU identity and
the time range, ``field_series``, the reject path and its reasons, identity resolution, the
classifier's objects built from the lists): the printed ratio is an upper bound for this design.
The ratio without step 3 is printed too: the bound if the exact check cost nothing. The rows
written are checked against the stage's own (:func:`analytics.rows.gpu_scrapes_table`) on the
first transaction.

Usage: ``python bench/analytics_json_sql.py [--records 100000] [--batch 5000] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from array import array
from pathlib import Path
from typing import cast

import duckdb
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from analytics.classify import FB_FREE, FB_RESERVED, FB_TOTAL, FB_USED, GPU_UTIL, GR_ENGINE_ACTIVE, SM_ACTIVE
from analytics.decode import decode_batch
from analytics.rows import POWER_USAGE
from analytics import offsets as kafka_offsets  # the offsets as the stage stores them
from analytics.store import AnalyticsStore
from bench.analytics import TOPICS, _gpu, _messages, _rows, _scrape_messages
from contracts.bus import BusMessage, TopicPartition

_SCRAPE = (
    '{"schema_version":"BIGINT","host":"VARCHAR","source":"VARCHAR","target":"VARCHAR","seq":"BIGINT",'
    '"gpus":{"ts":["DOUBLE"],"gpu_uuid":["VARCHAR"],"gpu_index":["INTEGER"],"gpu_instance_id":["INTEGER"],'
    '"gpu_instance_profile":["VARCHAR"],"model_name":["VARCHAR"],'
    '"fields":["JSON"],"invalid":["JSON"],"attributes":["JSON"]}}'
)
"""The ``from_json`` structure of a :class:`contracts.GpuScrape` (maps as JSON text)."""
_TYPED = (GR_ENGINE_ACTIVE, SM_ACTIVE, GPU_UTIL, FB_USED, FB_FREE, FB_TOTAL, FB_RESERVED, POWER_USAGE)
"""The fields read typed: the classifier's seven and the ``power_w`` column's."""
_FIELDS = "{" + ",".join(f'"{name}":"DOUBLE"' for name in _TYPED) + "}"

_PARSE = f"""CREATE OR REPLACE TEMP TABLE staged AS
SELECT *, from_json(fields, '{_FIELDS}') AS f FROM (
    SELECT o, j.host AS host, j.source AS source, j.target AS target, j.seq AS seq0,
           unnest(j.gpus.ts) AS ts_s, unnest(j.gpus.gpu_uuid) AS gpu_uuid,
           unnest(j.gpus.gpu_index) AS gpu_index, unnest(j.gpus.gpu_instance_id) AS gpu_instance_id,
           unnest(j.gpus.gpu_instance_profile) AS gpu_instance_profile,
           unnest(j.gpus.model_name) AS model_name, unnest(j.gpus.fields) AS fields,
           unnest(j.gpus.invalid) AS invalid, unnest(j.gpus.attributes) AS attributes,
           generate_subscripts(j.gpus.ts, 1) - 1 AS i
    FROM (SELECT o, from_json(v, '{_SCRAPE}') AS j FROM records))"""

_STR = r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])*"'
_NUM = r"-?(?:0|[1-9][0-9]{0,14})(?:\.[0-9]+)?(?:[eE][+-]?[0-9]{1,2})?"
_INT = r"-?(?:0|[1-9][0-9]{0,17})"


def _list(item: str) -> str:
    """RE2: a compact JSON list of ``item`` (maybe empty)."""
    return rf"\[(?:{item}(?:,{item})*)?\]"


def _map(value: str) -> str:
    """RE2: a compact JSON object of string keys to ``value`` (maybe empty)."""
    return rf"\{{(?:{_STR}:{value}(?:,{_STR}:{value})*)?\}}"


_SHAPE = (
    rf'\{{"schema_version":1,"host":{_STR},"source":"(?:dcgm-exporter|nvml|nvidia-smi|dcgmi)",'
    rf'"target":{_STR},"seq":{_INT},"gpus":\{{"ts":{_list(_NUM)},'
    rf'"gpu_uuid":{_list(f"(?:{_STR}|null)")},"gpu_index":{_list(f"(?:{_INT}|null)")},'
    rf'"gpu_instance_id":{_list(f"(?:{_INT}|null)")},'
    rf'"gpu_instance_profile":{_list(f"(?:{_STR}|null)")},"model_name":{_list(f"(?:{_STR}|null)")},'
    rf'"fields":{_list(_map(_NUM))},"field_series":\[\],"invalid":{_list(_map(_STR))},'
    rf'"attributes":{_list(_map(_STR))}\}}\}}'
)
"""The canonical encoding of a :class:`contracts.GpuScrape` without ``field_series`` (module
docstring, step 3), as an RE2 pattern."""
_CHECK = (
    "SELECT count(*) FILTER (WHERE NOT regexp_full_match(v, '"
    + _SHAPE.replace("'", "''")
    + "')) FROM records"
)

_READ = (
    "SELECT ts_s, host, gpu_uuid, gpu_index, gpu_instance_id, model_name, "
    + ", ".join(f"f.{name}" for name in _TYPED[:-1])
    + ", invalid FROM staged"
)


def _micros(seconds: str) -> str:
    """SQL: Unix ``seconds`` as a ``TIMESTAMP`` rounded half to even to the microsecond, as
    :func:`analytics.rows.gpu_scrapes_table` stores it."""
    return f"make_timestamp(CAST(round_even({seconds} * 1000000.0, 0) AS BIGINT))"


_WRITE = f"""INSERT INTO gpu_samples
SELECT {_micros("ts_s")},
       host || '/' || coalesce(nullif(gpu_uuid, ''), 'gpu' || gpu_index) || coalesce('/' || gpu_instance_id, ''),
       host, gpu_uuid, gpu_index, gpu_instance_id, gpu_instance_profile, model_name,
       f.{GPU_UTIL}, f.{GR_ENGINE_ACTIVE}, f.{SM_ACTIVE},
       TRY_CAST(round_even(f.{FB_USED}, 0) AS BIGINT), TRY_CAST(round_even(f.{FB_FREE}, 0) AS BIGINT),
       f.{POWER_USAGE}, coalesce(fields, '{{}}'), coalesce(invalid, '{{}}'), coalesce(attributes, '{{}}'),
       source, target, seq0 + i, ?, o
FROM staged"""

_STEPS = ("values", "parse", "shape check", "classifier input", "write")


def _values(chunk: list[BusMessage]) -> pa.Table:
    """Step 1: the records' values as one ``string`` column ``v`` with their offsets ``o``.
    Raises ``pyarrow.ArrowInvalid`` if a value is not UTF-8."""
    values = [cast(bytes, m.value) for m in chunk]
    offsets = array("i", itertools.accumulate(map(len, values), initial=0))
    text = pa.StringArray.from_buffers(len(values), pa.py_buffer(offsets), pa.py_buffer(b"".join(values)))
    text.validate(full=True)
    return pa.table({"o": pa.array([m.offset for m in chunk], pa.int64()), "v": text})


def _ingest(con: duckdb.DuckDBPyConnection, chunk: list[BusMessage], steps: list[float]) -> int:
    """Steps 1-5 for one transaction's records; adds each step's seconds to ``steps`` and
    returns the rows written."""
    tp = TopicPartition(TOPICS.telemetry_gpu, 0)
    clock = time.thread_time
    t0 = clock()
    records = _values(chunk)
    t1 = clock()
    con.register("records", records)
    con.execute(_PARSE)
    t2 = clock()
    [(refused,)] = con.execute(_CHECK).fetchall()
    con.unregister("records")
    t3 = clock()
    columns = [c.to_pylist() for c in con.sql(_READ).to_arrow_table().columns]
    t4 = clock()
    con.begin()
    con.execute(_WRITE, [tp.partition])
    kafka_offsets.upsert(con, {tp: chunk[-1].offset + 1})
    con.commit()
    t5 = clock()
    for k, dt in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
        steps[k] += dt
    assert refused == 0, f"{refused} records refused by the shape check"
    return len(columns[0])


def _check_rows(written: pa.Table, chunk: list[BusMessage]) -> None:
    """Raise ``AssertionError`` unless ``written`` (this path's rows of ``chunk``, in offset and
    ``seq`` order) holds the values the stage's own path makes of ``chunk``."""
    stage = _rows(decode_batch(chunk, TOPICS))
    for name in stage.column_names:
        assert written.column(name).to_pylist() == stage.column(name).to_pylist(), f"column {name} differs"


def bench(n: int, batch: int, repeat: int) -> None:
    """Print the steps' costs and the ratio against the yardstick (module docstring)."""
    msgs = _scrape_messages([_gpu(m) for m in _messages(n, gpus=1000)])
    per_record = n // len(msgs)
    chunks = [msgs[i : i + batch // per_record] for i in range(0, len(msgs), batch // per_record)]
    load = os.getloadavg()[0]
    path_runs: list[tuple[float, list[float]]] = []
    yard_runs: list[float] = []
    clock = time.thread_time
    for _ in range(max(1, repeat)):
        store = AnalyticsStore(":memory:", threads=1)
        con = store.cursor()
        steps = [0.0] * len(_STEPS)
        t = clock()
        rows = sum(_ingest(con, c, steps) for c in chunks)
        path_runs.append((clock() - t, steps))
        tables = [
            con.sql(
                f"SELECT * FROM gpu_samples WHERE kafka_offset BETWEEN {c[0].offset} AND {c[-1].offset}"
                " ORDER BY kafka_offset, seq"
            )
            .to_arrow_table()
            .combine_chunks()
            for c in chunks
        ]
        con.close()
        store.close()
        assert rows == n == sum(t.num_rows for t in tables)
        _check_rows(tables[0], chunks[0])
        yard = AnalyticsStore(":memory:", threads=1)
        con = yard.cursor()
        t = clock()
        for table in tables:
            con.register("b", table)
            con.execute("INSERT INTO gpu_samples SELECT * FROM b")
            con.unregister("b")
        yard_runs.append(clock() - t)
        con.close()
        yard.close()
    yard_s = min(yard_runs)
    path_s, steps = min(path_runs)
    us = 1e6 / n
    print(
        f"DuckDB parsing the JSON: {n:,} GPU samples as GpuScrape records ({per_record} per record),"
        f" {batch} rows per transaction, thread clock, best of {max(1, repeat)}; load average"
        f" {load:.2f} -> {os.getloadavg()[0]:.2f}"
    )
    print(f"  yardstick  INSERT FROM arrow     {yard_s * us:5.2f} us/row")
    print(
        f"  JSON in DuckDB                   {path_s * us:5.2f} us/row   ratio {yard_s / path_s:6.1%} (upper bound)"
    )
    unchecked = path_s - steps[_STEPS.index("shape check")]
    print(
        f"  the same without the shape check {unchecked * us:5.2f} us/row   ratio {yard_s / unchecked:6.1%}"
    )
    print(
        "    per row: " + ", ".join(f"{name} {s * us:.2f} us" for name, s in zip(_STEPS, steps, strict=True))
    )
    print(
        f"    all runs, us/row: yardstick {' '.join(f'{y * us:.2f}' for y in yard_runs)};"
        f" path {' '.join(f'{p * us:.2f}' for p, _ in path_runs)}"
    )


def main() -> None:
    """Parse the arguments and run :func:`bench`."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000, help="GPU samples")
    ap.add_argument("--batch", type=int, default=5000, help="rows per transaction")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each side (the best is compared)")
    args = ap.parse_args()
    bench(args.records, args.batch, args.repeat)


if __name__ == "__main__":
    main()
