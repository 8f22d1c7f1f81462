"""Table layouts of the analytics store and the conversion of records into Arrow tables.

One column list per table defines both the DuckDB DDL and the Arrow schema, so the two cannot
drift. Timestamps are ``TIMESTAMP`` (UTC, microseconds). GPU fields the stage uses get columns
named after their meaning (DCGM units: % for ``gpu_util``, ratio for ``*_active``, MiB, W); every
valid field is also kept in the ``fields`` JSON column. InfiniBand PMA counters are ``HUGEINT``
(the Arrow side is ``uint64``: PMA counters are at most 64-bit unsigned), never ``DOUBLE``, so
deltas of switch byte counters past 2**53 stay exact; the whole counter map is also kept as JSON.
"""

from __future__ import annotations

import itertools
import math
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
from pydantic_core import to_json

from analytics.classify import FB_FREE, FB_USED, GPU_UTIL, GR_ENGINE_ACTIVE, SM_ACTIVE, IdleRun
from contracts import CapacityUpdate, GpuSample, IbPortSample

if TYPE_CHECKING:  # analytics.scrapes reads this module's field columns
    from analytics.scrapes import ScrapeColumns


@dataclass(frozen=True, slots=True)
class Column:
    """One column: its name, DuckDB type and Arrow type."""

    name: str
    sql_type: str
    arrow_type: pa.DataType


_TS = pa.timestamp("us")
_JSON = pa.string()

POWER_USAGE = "DCGM_FI_DEV_POWER_USAGE"
"""Board power draw, W (DCGM field 155)."""

GPU_SAMPLE_COLUMNS: tuple[Column, ...] = (
    Column("ts", "TIMESTAMP", _TS),
    Column("gpu_key", "VARCHAR", pa.string()),
    Column("host", "VARCHAR", pa.string()),
    Column("gpu_uuid", "VARCHAR", pa.string()),
    Column("gpu_index", "INTEGER", pa.int32()),
    Column("gpu_instance_id", "INTEGER", pa.int32()),
    Column("gpu_instance_profile", "VARCHAR", pa.string()),
    Column("model_name", "VARCHAR", pa.string()),
    Column("gpu_util", "DOUBLE", pa.float64()),
    Column("gr_engine_active", "DOUBLE", pa.float64()),
    Column("sm_active", "DOUBLE", pa.float64()),
    Column("fb_used_mib", "BIGINT", pa.int64()),
    Column("fb_free_mib", "BIGINT", pa.int64()),
    Column("power_w", "DOUBLE", pa.float64()),
    Column("fields", "JSON", _JSON),
    Column("invalid", "JSON", _JSON),
    Column("attributes", "JSON", _JSON),
    Column("source", "VARCHAR", pa.string()),
    Column("target", "VARCHAR", pa.string()),
    Column("seq", "BIGINT", pa.int64()),
    Column("kafka_partition", "INTEGER", pa.int32()),
    Column("kafka_offset", "BIGINT", pa.int64()),
)
"""``gpu_samples``: one row per :class:`contracts.GpuSample`."""

GPU_FLOAT_FIELDS: dict[str, str] = {
    "gpu_util": GPU_UTIL,
    "gr_engine_active": GR_ENGINE_ACTIVE,
    "sm_active": SM_ACTIVE,
    "power_w": POWER_USAGE,
}
"""``gpu_samples`` column → the DCGM field it holds as a ``DOUBLE`` (an integer value as the
nearest float; NULL where the sample has no valid value)."""
GPU_WHOLE_FIELDS: dict[str, str] = {"fb_used_mib": FB_USED, "fb_free_mib": FB_FREE}
"""``gpu_samples`` column → the DCGM field it holds as a ``BIGINT`` of whole MiB (a float rounded
half to even; NULL where absent or past int64)."""

IB_COUNTERS: tuple[str, ...] = (
    "PortXmitData",
    "PortRcvData",
    "PortXmitPkts",
    "PortRcvPkts",
    "PortXmitWait",
    "SymbolErrorCounter",
    "LinkErrorRecoveryCounter",
    "LinkDownedCounter",
    "PortRcvErrors",
    "PortRcvRemotePhysicalErrors",
    "PortXmitDiscards",
    "LocalLinkIntegrityErrors",
    "ExcessiveBufferOverrunErrors",
)
"""PMA counters (IBTA vol. 1, 16.1.3) given a column each, named in snake case
(``PortXmitData`` → ``port_xmit_data``; data counters in 4-octet words)."""


def counter_column(pma_name: str) -> str:
    """Snake-case column name of a PMA counter: ``PortXmitData`` → ``port_xmit_data``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", pma_name).lower()


IB_PORT_SAMPLE_COLUMNS: tuple[Column, ...] = (
    Column("ts", "TIMESTAMP", _TS),
    Column("port_key", "VARCHAR", pa.string()),
    Column("host", "VARCHAR", pa.string()),
    Column("device", "VARCHAR", pa.string()),
    Column("node_guid", "VARCHAR", pa.string()),
    Column("port", "INTEGER", pa.int32()),
    Column("link_layer", "VARCHAR", pa.string()),
    Column("state_id", "INTEGER", pa.int32()),
    Column("state", "VARCHAR", pa.string()),
    Column("phys_state_id", "INTEGER", pa.int32()),
    Column("phys_state", "VARCHAR", pa.string()),
    Column("rate_bytes_per_second", "BIGINT", pa.int64()),
    *(Column(counter_column(c), "HUGEINT", pa.uint64()) for c in IB_COUNTERS),
    Column("counters", "JSON", _JSON),
    Column("counter_bits", "JSON", _JSON),
    Column("saturated", "VARCHAR[]", pa.list_(pa.string())),
    Column("hw_counters", "JSON", _JSON),
    Column("source", "VARCHAR", pa.string()),
    Column("seq", "BIGINT", pa.int64()),
    Column("kafka_partition", "INTEGER", pa.int32()),
    Column("kafka_offset", "BIGINT", pa.int64()),
)
"""``ib_port_samples``: one row per :class:`contracts.IbPortSample`."""

GPU_STATE_COLUMNS: tuple[Column, ...] = (
    Column("ts", "TIMESTAMP", _TS),
    Column("gpu_key", "VARCHAR", pa.string()),
    Column("host", "VARCHAR", pa.string()),
    Column("gpu_uuid", "VARCHAR", pa.string()),
    Column("gpu_instance_id", "INTEGER", pa.int32()),
    Column("model_name", "VARCHAR", pa.string()),
    Column("pool", "VARCHAR", pa.string()),
    Column("state", "VARCHAR", pa.string()),
    Column("since", "TIMESTAMP", _TS),
    Column("grade", "VARCHAR", pa.string()),
    Column("predicted_idle_until", "TIMESTAMP", _TS),
    Column("confidence", "DOUBLE", pa.float64()),
    Column("reason", "VARCHAR", pa.string()),
    Column("transition", "BOOLEAN", pa.bool_()),
)
"""``gpu_states``: every capacity update decided (state changes and periodic refreshes).

``transition`` is true when the row's ``(state, since, grade)`` differs from the previous row stored
for the GPU by this process (the first row after a start is always a transition); refreshes are
false. Views read transitions; retention drops old refreshes (:mod:`analytics.retention`)."""

IDLE_RUN_COLUMNS: tuple[Column, ...] = (
    Column("gpu_key", "VARCHAR", pa.string()),
    Column("model_name", "VARCHAR", pa.string()),
    Column("pool", "VARCHAR", pa.string()),
    Column("start_ts", "TIMESTAMP", _TS),
    Column("end_ts", "TIMESTAMP", _TS),
    Column("duration_s", "DOUBLE", pa.float64()),
    Column("censored", "BOOLEAN", pa.bool_()),
)
"""``idle_runs``: ended idle runs (the predictor's history, reloaded at start)."""

GPU_ROLLUP_COLUMNS: tuple[Column, ...] = (
    Column("minute", "TIMESTAMP", _TS),
    Column("gpu_key", "VARCHAR", pa.string()),
    Column("host", "VARCHAR", pa.string()),
    Column("gpu_uuid", "VARCHAR", pa.string()),
    Column("gpu_instance_id", "INTEGER", pa.int32()),
    Column("model_name", "VARCHAR", pa.string()),
    Column("samples", "BIGINT", pa.int64()),
    Column("activity_samples", "BIGINT", pa.int64()),
    Column("activity_mean", "DOUBLE", pa.float64()),
    Column("activity_max", "DOUBLE", pa.float64()),
    Column("fb_used_mib_mean", "DOUBLE", pa.float64()),
    Column("fb_used_mib_max", "BIGINT", pa.int64()),
    Column("power_w_mean", "DOUBLE", pa.float64()),
)
"""``gpu_rollup_1m``: per GPU key and UTC minute (``minute`` = start of the minute): raw samples,
samples with an activity, mean/max activity ratio (0..1: the larger of GR_ENGINE_ACTIVE and
SM_ACTIVE, else GPU_UTIL / 100), mean/max FB_USED (MiB), mean power (W). Written by
:mod:`analytics.retention`."""

IB_PORT_ROLLUP_COLUMNS: tuple[Column, ...] = (
    Column("minute", "TIMESTAMP", _TS),
    Column("port_key", "VARCHAR", pa.string()),
    Column("host", "VARCHAR", pa.string()),
    Column("device", "VARCHAR", pa.string()),
    Column("node_guid", "VARCHAR", pa.string()),
    Column("port", "INTEGER", pa.int32()),
    Column("samples", "BIGINT", pa.int64()),
    Column("intervals", "BIGINT", pa.int64()),
    Column("interval_s", "DOUBLE", pa.float64()),
    Column("rate_bytes_per_second", "BIGINT", pa.int64()),
    Column("xmit_data_words", "HUGEINT", pa.uint64()),
    Column("rcv_data_words", "HUGEINT", pa.uint64()),
    Column("xmit_wait_ticks", "HUGEINT", pa.uint64()),
    Column("xmit_wait_ticks_max", "HUGEINT", pa.uint64()),
    Column("utilisation_mean", "DOUBLE", pa.float64()),
    Column("utilisation_max", "DOUBLE", pa.float64()),
)
"""``ib_port_rollup_1m``: per port key and UTC minute, over the intervals (consecutive reads, view
``ib_port_intervals``) that END in the minute: raw samples, intervals with a valid PortXmitData
delta and their summed length (s), the latest link rate (bytes/s), summed deltas of PortXmitData
and PortRcvData (4-octet words) and of PortXmitWait (ticks), the largest single PortXmitWait
delta, time-weighted mean utilisation ``4·words / (interval_s·rate)`` and the largest interval's
utilisation. Written by :mod:`analytics.retention`."""


def arrow_schema(columns: Sequence[Column]) -> pa.Schema:
    """The Arrow schema of a column list."""
    return pa.schema([(c.name, c.arrow_type) for c in columns])


def create_table_sql(table: str, columns: Sequence[Column]) -> str:
    """``CREATE TABLE IF NOT EXISTS`` statement for a column list."""
    cols = ", ".join(f"{c.name} {c.sql_type}" for c in columns)
    return f"CREATE TABLE IF NOT EXISTS {table} ({cols})"


def gpu_samples_table(
    samples: Sequence[GpuSample], partitions: Sequence[int], offsets: Sequence[int]
) -> pa.Table:
    """Rows of ``gpu_samples`` for ``samples`` read at ``(partitions[i], offsets[i])``.

    Values that do not fit their column (an integer past int64, a non-finite float in JSON) become
    NULL rather than failing the batch. Columns are built a whole column at a time; a column whose
    fast conversion fails (a value out of range) is converted value by value with the same
    result. Raises ``ValueError`` if the three sequences differ in length or a timestamp is not
    finite (and ``pyarrow.ArrowInvalid`` if a timestamp is past the int64 microsecond range).
    """
    if not len(samples) == len(partitions) == len(offsets):
        raise ValueError("samples, partitions and offsets differ in length")
    fields = [s.fields for s in samples]
    cols: dict[str, pa.Array | list[Any]] = {
        "ts": _micros_array([s.ts for s in samples]),
        "gpu_key": [s.key for s in samples],
        "host": [s.host for s in samples],
        "gpu_uuid": [s.gpu_uuid for s in samples],
        "gpu_index": _int_array([s.gpu_index for s in samples], 32),
        "gpu_instance_id": _int_array([s.gpu_instance_id for s in samples], 32),
        "gpu_instance_profile": [s.gpu_instance_profile for s in samples],
        "model_name": [s.model_name for s in samples],
        "fields": _json_array(fields, floats=True),
        "invalid": _json_array([s.invalid for s in samples]),
        "attributes": _json_array([s.attributes for s in samples]),
        "source": [s.source for s in samples],
        "target": [s.target for s in samples],
        "seq": _int_array([s.seq for s in samples], 64),
        "kafka_partition": list(partitions),
        "kafka_offset": list(offsets),
    }
    for col, name in GPU_FLOAT_FIELDS.items():
        cols[col] = _float_array([f.get(name) for f in fields])
    for col, name in GPU_WHOLE_FIELDS.items():
        cols[col] = _whole_array([f.get(name) for f in fields])
    return _table(GPU_SAMPLE_COLUMNS, cols)


def gpu_scrapes_table(
    scrapes: ScrapeColumns,
    partitions: Sequence[int],
    offsets: Sequence[int],
    gpu_uuid: Sequence[str | None] | None = None,
) -> pa.Table:
    """Rows of ``gpu_samples`` for the GPUs of scrape records (one row per GPU, the same row
    :func:`gpu_samples_table` makes of that GPU's :class:`contracts.GpuSample`), record ``k``
    read at ``(partitions[k], offsets[k])``. ``gpu_uuid`` replaces the GPUs' UUIDs (one per GPU:
    the identities the stage resolved, :mod:`analytics.identity`).

    Columns are the decoder's Arrow arrays (:attr:`analytics.scrapes.ScrapeColumns.arrays`: the
    JSON columns are the maps' texts as sent, the field columns already extracted, what each
    record holds once — ``host``, ``source``, ``target``, ``seq`` — already repeated per GPU); the
    Kafka position is repeated and ``gpu_key`` joined by Arrow. Values that do not fit their
    column become NULL as in :func:`gpu_samples_table` (a GPU's ``seq`` past int64 too). Raises
    ``ValueError`` if the lengths differ.
    """
    n_records = len(scrapes.msgs)
    if not n_records == len(partitions) == len(offsets):
        raise ValueError("records, partitions and offsets differ in length")
    arrays = scrapes.arrays
    if gpu_uuid is None:
        uuid_array = arrays["gpu_uuid"]
    else:
        if len(gpu_uuid) != len(scrapes):
            raise ValueError("gpu_uuid and the GPUs differ in length")
        uuid_array = pa.array(gpu_uuid, pa.string())
    starts = list(itertools.accumulate(scrapes.counts, initial=0))
    record_of = pc.list_parent_indices(
        pa.ListArray.from_arrays(pa.array(starts, pa.int32()), pa.nulls(len(scrapes)))
    )
    host = arrays["host"]
    cols: dict[str, pa.Array | pa.ChunkedArray | list[Any]] = {
        "ts": arrays["ts"],
        "gpu_key": _gpu_keys(host, uuid_array, arrays["gpu_index"], arrays["gpu_instance_id"]),
        "host": host,
        "gpu_uuid": uuid_array,
        "gpu_index": _int32(arrays["gpu_index"]),
        "gpu_instance_id": _int32(arrays["gpu_instance_id"]),
        "gpu_instance_profile": arrays["gpu_instance_profile"],
        "model_name": arrays["model_name"],
        "fields": arrays["fields"],
        "invalid": arrays["invalid"],
        "attributes": arrays["attributes"],
        "source": arrays["source"],
        "target": arrays["target"],
        "seq": arrays["seq"],
        "kafka_partition": pa.array(partitions, pa.int32()).take(record_of),
        "kafka_offset": pa.array(offsets, pa.int64()).take(record_of),
    }
    for col in (*GPU_FLOAT_FIELDS, *GPU_WHOLE_FIELDS):
        cols[col] = arrays[col]
    return _table(GPU_SAMPLE_COLUMNS, cols)


def _int32(values: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray:
    """An int64 array as ``int32``, NULL where a value is out of range (:func:`_as_int`)."""
    try:
        return pc.cast(values, pa.int32())
    except pa.ArrowInvalid:
        fits = pc.and_(pc.greater_equal(values, -(2**31)), pc.less(values, 2**31))
        return pc.cast(pc.if_else(fits, values, pa.scalar(None, pa.int64())), pa.int32())


def _gpu_keys(
    host: pa.ChunkedArray, uuid: pa.Array | pa.ChunkedArray, index: pa.ChunkedArray, instance: pa.ChunkedArray
) -> pa.ChunkedArray:
    """:func:`contracts.topics.gpu_key` of every row, by Arrow: ``host/<id>[/<instance>]`` with
    ``<id>`` the UUID (``uuid``), else (NULL or empty) ``gpu<index>``; ``index`` and
    ``instance`` are int64 arrays."""
    if uuid.null_count or pc.any(pc.equal(uuid, "")).as_py():
        named = pc.if_else(pc.equal(uuid, ""), pa.scalar(None, pa.string()), uuid)
        uuid = pc.coalesce(named, pc.binary_join_element_wise("gpu", pc.cast(index, pa.string()), ""))
    key = pc.binary_join_element_wise(host, uuid, "/")
    if instance.null_count == len(instance):
        return key
    return pc.coalesce(pc.binary_join_element_wise(key, pc.cast(instance, pa.string()), "/"), key)


def _fits_u64(raw: int | None) -> bool:
    """``raw`` is absent or fits an unsigned 64-bit column."""
    return raw is None or 0 <= raw < 2**64


def counters_out_of_range(samples: Iterable[IbPortSample]) -> int:
    """Counter values of ``samples`` that :func:`ib_port_samples_table` stores as NULL (outside
    ``0 .. 2**64-1``; only the columns of :data:`IB_COUNTERS`)."""
    return sum(1 for s in samples for name in IB_COUNTERS if not _fits_u64(s.counters.get(name)))


def ib_port_samples_table(
    samples: Sequence[IbPortSample], partitions: Sequence[int], offsets: Sequence[int]
) -> pa.Table:
    """Rows of ``ib_port_samples`` for ``samples`` read at ``(partitions[i], offsets[i])``.

    A counter outside ``0 .. 2**64-1`` is NULL in its column (kept verbatim in ``counters``;
    :func:`counters_out_of_range` counts them).
    Raises ``ValueError`` like :func:`gpu_samples_table`.
    """
    if not len(samples) == len(partitions) == len(offsets):
        raise ValueError("samples, partitions and offsets differ in length")
    cols: dict[str, list[Any]] = {c.name: [] for c in IB_PORT_SAMPLE_COLUMNS}
    counter_cols = [(name, counter_column(name)) for name in IB_COUNTERS]
    for s in samples:
        cols["ts"].append(_micros(s.ts))
        cols["port_key"].append(s.key)
        cols["host"].append(s.host)
        cols["device"].append(s.device)
        cols["node_guid"].append(s.node_guid)
        cols["port"].append(_as_int(s.port, 32))
        cols["link_layer"].append(s.link_layer)
        cols["state_id"].append(_as_int(s.state_id, 32))
        cols["state"].append(s.state)
        cols["phys_state_id"].append(_as_int(s.phys_state_id, 32))
        cols["phys_state"].append(s.phys_state)
        cols["rate_bytes_per_second"].append(_as_int(s.rate_bytes_per_second, 64))
        for name, col in counter_cols:
            raw = s.counters.get(name)
            cols[col].append(raw if _fits_u64(raw) else None)
        cols["saturated"].append(list(s.saturated))
        cols["source"].append(s.source)
        cols["seq"].append(_as_int(s.seq, 64))
    table: dict[str, pa.Array | list[Any]] = dict(cols)
    for name in ("counters", "counter_bits", "hw_counters"):
        table[name] = _json_array([getattr(s, name) for s in samples])
    table["kafka_partition"] = list(partitions)
    table["kafka_offset"] = list(offsets)
    return _table(IB_PORT_SAMPLE_COLUMNS, table)


def gpu_states_table(
    updates: Sequence[CapacityUpdate], transitions: Sequence[bool] | None = None
) -> pa.Table:
    """Rows of ``gpu_states`` for capacity updates; ``transitions[i]`` flags update ``i`` as a
    change of state, ``since`` or grade (all true when ``None``). Raises ``ValueError`` if the
    two sequences differ in length."""
    if transitions is None:
        transitions = [True] * len(updates)
    if len(transitions) != len(updates):
        raise ValueError("updates and transitions differ in length")
    cols: dict[str, list[Any]] = {c.name: [] for c in GPU_STATE_COLUMNS}
    cols["transition"] = list(transitions)
    for u in updates:
        cols["ts"].append(_micros(u.ts))
        cols["gpu_key"].append(u.key)
        cols["host"].append(u.host)
        cols["gpu_uuid"].append(u.gpu_uuid)
        cols["gpu_instance_id"].append(_as_int(u.gpu_instance_id, 32))
        cols["model_name"].append(u.model_name)
        cols["pool"].append(u.pool)
        cols["state"].append(u.state.value)
        cols["since"].append(_micros(u.since))
        cols["grade"].append(None if u.grade is None else u.grade.value)
        cols["predicted_idle_until"].append(
            None if u.predicted_idle_until is None else _micros(u.predicted_idle_until)
        )
        cols["confidence"].append(u.confidence)
        cols["reason"].append(u.reason)
    return _table(GPU_STATE_COLUMNS, cols)


def idle_runs_table(runs: Iterable[tuple[IdleRun, str]]) -> pa.Table:
    """Rows of ``idle_runs`` for ``(run, pool)`` pairs."""
    cols: dict[str, list[Any]] = {c.name: [] for c in IDLE_RUN_COLUMNS}
    for run, pool in runs:
        cols["gpu_key"].append(run.key)
        cols["model_name"].append(run.model_name)
        cols["pool"].append(pool)
        cols["start_ts"].append(_micros(run.start))
        cols["end_ts"].append(_micros(run.end))
        cols["duration_s"].append(run.duration_s)
        cols["censored"].append(run.censored)
    return _table(IDLE_RUN_COLUMNS, cols)


def _table(columns: Sequence[Column], cols: Mapping[str, pa.Array | pa.ChunkedArray | list[Any]]) -> pa.Table:
    return pa.Table.from_arrays(
        [_array(cols[c.name], c.arrow_type) for c in columns], schema=arrow_schema(columns)
    )


def _array(values: pa.Array | pa.ChunkedArray | list[Any], arrow_type: pa.DataType) -> pa.Array | pa.ChunkedArray:
    return values if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(values, type=arrow_type)


def _micros_array(ts: list[float]) -> pa.Array:
    """:func:`_micros` of every value, as a ``timestamp[us]`` array (same IEEE product and
    half-to-even rounding). Raises ``ValueError`` if a value is not finite and
    ``pyarrow.ArrowInvalid`` if one is past the int64 microsecond range."""
    seconds = pa.array(ts, type=pa.float64())
    if seconds.null_count or not pc.all(pc.is_finite(seconds), min_count=0).as_py():
        bad = next(t for t in seconds.to_pylist() if t is None or not math.isfinite(t))
        raise ValueError(f"timestamp not finite: {bad!r}")
    micros = pc.round(pc.multiply(seconds, 1_000_000.0), 0, round_mode="half_to_even")
    return pc.cast(micros, pa.int64()).cast(_TS)


def _int_array(values: list[int | None], bits: int) -> pa.Array:
    """:func:`_as_int` of every value, as an ``int32``/``int64`` array."""
    arrow_type = pa.int32() if bits == 32 else pa.int64()
    if float not in set(map(type, values)):  # pyarrow would truncate a float silently
        try:
            return pa.array(values, type=arrow_type)
        except (pa.ArrowInvalid, OverflowError):
            pass  # a value out of range: NULL for it, below
    return pa.array([_as_int(v, bits) for v in values], type=arrow_type)


def _float_array(values: list[float | int | None]) -> pa.Array:
    """:func:`_as_float` of every value, as a ``float64`` array."""
    try:
        return pa.array(values, type=pa.float64())
    except (pa.ArrowInvalid, OverflowError):  # an int pyarrow will not round (past 2**53)
        return pa.array([_as_float(v) for v in values], type=pa.float64())


def _whole_array(values: list[float | int | None]) -> pa.Array:
    """:func:`_as_whole` of every value, as an ``int64`` array."""
    if float not in set(map(type, values)):
        try:
            return pa.array(values, type=pa.int64())
        except (pa.ArrowInvalid, OverflowError):
            pass
    return pa.array([_as_whole(v) for v in values], type=pa.int64())


def _micros(ts: float) -> int:
    """Unix seconds → integer microseconds. Raises ``ValueError`` if not finite."""
    if not math.isfinite(ts):
        raise ValueError(f"timestamp not finite: {ts!r}")
    return round(ts * 1_000_000)


def _as_int(v: float | int | None, bits: int) -> int | None:
    """``v`` as a signed ``bits``-bit integer, or ``None`` if absent or out of range."""
    if v is None or isinstance(v, float) or not -(2 ** (bits - 1)) <= v < 2 ** (bits - 1):
        return None
    return int(v)


def _as_float(v: float | int | None) -> float | None:
    """``v`` as a float (NaN/inf kept; DuckDB DOUBLE holds them), ``None`` if absent or too large."""
    if v is None:
        return None
    try:
        return float(v)
    except OverflowError:
        return None


def _as_whole(v: float | int | None) -> int | None:
    """A MiB count as an int64 (a float is rounded), ``None`` if absent, not finite or too large."""
    if isinstance(v, float):
        if not math.isfinite(v):
            return None
        v = round(v)
    return _as_int(v, 64)


_ENCODER = msgspec.json.Encoder()
_POSITIVE_EXPONENT = re.compile(rb"[0-9]e[0-9]")


def _json_array(objs: Sequence[Mapping[str, Any]], floats: bool = False) -> pa.Array:
    """:func:`_json` of every dict, as a ``string`` array, the same text byte for byte.

    The dicts are encoded in one call (msgspec) as one JSON array ``[{...},{...}]``; each ``},{``
    becomes ``}`` NUL ``{`` and Arrow splits the text at the NULs (msgspec escapes NUL inside
    strings, so a raw NUL is only ever a separator). The split is right when it gives exactly one
    piece per dict: a ``},{`` inside a key or a string value adds a piece, and then, as when
    msgspec cannot encode a value, each dict is encoded alone with :func:`_json`. msgspec writes
    what pydantic-core writes (same escapes, integers exact, NaN and infinities as ``null``)
    except a positive exponent (``1e21`` against ``1e+21``): with ``floats`` (dicts that may hold
    floats) a text with one falls back to :func:`_json` too.
    """
    n = len(objs)
    try:
        text = _ENCODER.encode(objs)
    except (TypeError, ValueError, OverflowError):
        text = b""
    if n and text and len(text) < 2**31 and not (floats and b"e" in text and _POSITIVE_EXPONENT.search(text)):
        text = text.replace(b"},{", b"}\x00{")
        whole = pa.StringArray.from_buffers(
            1, pa.py_buffer(struct.pack("<ii", 1, len(text) - 1)), pa.py_buffer(text)
        )
        pieces = pc.split_pattern(whole, "\x00").flatten()
        if len(pieces) == n:
            return pieces
    return pa.array([_json(o) for o in objs], pa.string())


def _json(obj: Mapping[str, Any]) -> str:
    """Compact JSON text of ``obj``; integers stay exact, non-finite floats become ``null``
    (JSON has no NaN)."""
    return to_json(obj, inf_nan_mode="null").decode() if obj else "{}"
