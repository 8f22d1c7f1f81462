"""Decoding of :class:`contracts.GpuScrape` records (one Kafka record per read of a host's GPUs)
straight to columns, by the compiled decoder :class:`analytics_native.ScrapeDecoder` (the crate in
``analytics/native``).

One call decodes a batch's scrape records and returns, per record, its GPU count and, per GPU,
the ``gpu_samples`` columns as Arrow arrays built on the decoder's own buffers (what a record holds
once, ``host``, ``source``, ``target``, ``seq``, repeated per GPU) (the maps ``fields`` / ``invalid`` / ``attributes`` as
the producer's JSON text of each map, validated: :func:`contracts.encode` writes it compactly and
any other valid spelling is kept as sent) plus what the idle classifier reads: one
:class:`GpuObservation` per GPU, with of its ``fields`` / ``invalid`` only the entries of
:data:`analytics.classify.READ_FIELDS`.
The decoder is built from the model's own constants (schema version, ``source`` values,
defaults), the stage's storable times (:mod:`analytics.timestamps`) and the field columns of
:mod:`analytics.rows`, so nothing here is defined twice.

Like the msgspec twins of the per-sample records, the decoder accepts a subset of what
:class:`contracts.GpuScrape` accepts, with the same values; a record it refuses is left to the
caller, which has the reference decide (:func:`analytics.decode.decode_telemetry`).
"""

from __future__ import annotations

import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import pyarrow as pa
from analytics_native import COLUMN_MEMBERS, RECORD_MEMBERS, SERIES_MEMBERS, ScrapeDecoder

from analytics.classify import READ_FIELDS, FieldReadings
from analytics.rows import GPU_FLOAT_FIELDS, GPU_WHOLE_FIELDS
from analytics.timestamps import TS_MAX_S, TS_MIN_S
from contracts import SCHEMA_VERSION, GpuColumns, GpuSample, GpuScrape, decode
from contracts.bus import BusMessage
from contracts.telemetry import SeriesValue
from contracts.topics import gpu_id, gpu_key

if typing.TYPE_CHECKING:
    from analytics_native import Buffers

if (
    tuple(GpuScrape.model_fields) != tuple(RECORD_MEMBERS)
    or tuple(GpuColumns.model_fields) != tuple(COLUMN_MEMBERS)
    or tuple(SeriesValue.model_fields) != tuple(SERIES_MEMBERS)
):  # pragma: no cover - a contract change the compiled decoder does not follow
    raise ImportError("contracts.GpuScrape changed: update analytics/native/src/lib.rs")


class GpuObservation(NamedTuple):
    """What the idle classifier reads of one GPU of a scrape record
    (:class:`analytics.classify.SampleLike`), made by the compiled decoder: one named tuple per
    GPU, whose first items are its :data:`analytics.classify.FieldReadings` (so the classifier
    reads them in place), left out of the cyclic garbage collector's tracking (numbers and
    strings only).

    Attributes:
        gr_engine_active ... fb_reserved: the valid values of
            :data:`analytics.classify.READ_FIELDS` in the GPU's ``fields`` (in that order; ``int``
            or ``float``), ``None`` where it has none.
        gr_engine_active_invalid ... fb_reserved_invalid: their reasons in the GPU's ``invalid``,
            ``None`` where it has none.
        ts, host, gpu_uuid, gpu_index, gpu_instance_id, model_name: as in
            :class:`contracts.GpuSample`.
    """

    gr_engine_active: float | int | None
    sm_active: float | int | None
    gpu_util: float | int | None
    fb_used: float | int | None
    fb_free: float | int | None
    fb_total: float | int | None
    fb_reserved: float | int | None
    gr_engine_active_invalid: str | None
    sm_active_invalid: str | None
    gpu_util_invalid: str | None
    fb_used_invalid: str | None
    fb_free_invalid: str | None
    fb_total_invalid: str | None
    fb_reserved_invalid: str | None
    ts: float
    host: str
    gpu_uuid: str | None
    gpu_index: int | None
    gpu_instance_id: int | None
    model_name: str | None

    @property
    def readings(self) -> FieldReadings:
        """The :data:`analytics.classify.FieldReadings` (a new tuple)."""
        return self[: 2 * len(READ_FIELDS)]

    @property
    def fields(self) -> dict[str, float | int]:
        """The valid entries of :data:`analytics.classify.READ_FIELDS` (a map, as in
        :class:`contracts.GpuSample`'s ``fields``; a new dict)."""
        values = cast("tuple[float | int | None, ...]", self[: len(READ_FIELDS)])
        return {name: v for name, v in zip(READ_FIELDS, values, strict=True) if v is not None}

    @property
    def invalid(self) -> dict[str, str]:
        """The rejected entries of :data:`analytics.classify.READ_FIELDS`: field → reason (a new
        dict)."""
        reasons = cast("tuple[str | None, ...]", self[len(READ_FIELDS) : 2 * len(READ_FIELDS)])
        return {name: r for name, r in zip(READ_FIELDS, reasons, strict=True) if r is not None}

    @property
    def key(self) -> str:
        """GPU identity, as :attr:`contracts.GpuSample.key`."""
        return gpu_key(self.host, gpu_id(self.gpu_uuid, self.gpu_index), self.gpu_instance_id)


_READ_NAMES = tuple(f.removeprefix("DCGM_FI_PROF_").removeprefix("DCGM_FI_DEV_").lower() for f in READ_FIELDS)
if GpuObservation._fields[: 2 * len(READ_FIELDS)] != (
    *_READ_NAMES,
    *(f"{n}_invalid" for n in _READ_NAMES),
):  # pragma: no cover - READ_FIELDS changed without GpuObservation
    raise ImportError("analytics.classify.READ_FIELDS changed: update analytics.scrapes.GpuObservation")

_SOURCE = GpuScrape.model_fields["source"]
DECODER = ScrapeDecoder(
    schema_version=SCHEMA_VERSION,
    sources=list(typing.get_args(_SOURCE.annotation)),
    default_source=_SOURCE.default,
    default_target=GpuScrape.model_fields["target"].default,
    default_seq=GpuScrape.model_fields["seq"].default,
    ts_min=TS_MIN_S,
    ts_max=TS_MAX_S,
    float_fields=list(GPU_FLOAT_FIELDS.values()),
    whole_fields=list(GPU_WHOLE_FIELDS.values()),
    observed=list(READ_FIELDS),
    observation=GpuObservation,
)
"""The stage's compiled scrape decoder."""

DECODE_THREADS = max(1, min(4, len(os.sched_getaffinity(0))))
"""Threads that read a large batch of scrape records (:func:`decode_scrapes`): the CPUs this
process may run on, at most 4."""

_STRING_ARRAYS = (
    "host", "source", "target", "gpu_uuid", "gpu_instance_profile", "model_name", "fields", "invalid", "attributes"
)  # fmt: skip
_ARRAY_TYPES: dict[str, pa.DataType] = {
    "ts": pa.timestamp("us"),
    "seq": pa.int64(),
    "gpu_index": pa.int64(),
    "gpu_instance_id": pa.int64(),
    **dict.fromkeys(_STRING_ARRAYS, pa.string()),
}


def is_scrape(value: bytes) -> bool:
    """Whether a ``telemetry.gpu`` record is worth decoding as a :class:`contracts.GpuScrape`
    first: its JSON text has a ``"gpus":`` member somewhere (cheap; a false guess only costs a
    refusal, and the reference decides by the top-level object)."""
    return b'"gpus":' in value


@dataclass(slots=True)
class ScrapeColumns:
    """The GPUs of a batch's scrape records: per record (``msgs[k]`` is record ``k``'s message)
    and per GPU (records in batch order, GPUs in column order).

    Attributes:
        msgs, counts: per record its message and its number of GPUs.
        observed: per GPU its :class:`GpuObservation` (``None`` where the record left a column
            empty; values as decoded: ``int`` or ``float``).
        arrays: per GPU Arrow columns (chunked: one chunk per run of records a thread read,
            :data:`DECODE_THREADS`): ``ts`` (``timestamp[us]``: the Unix seconds times 10**6,
            rounded half to even), ``host``, ``source``, ``target`` (string: its record's),
            ``seq`` (int64: its record's ``seq`` plus its place in the record, NULL past int64),
            ``gpu_uuid``, ``gpu_instance_profile``, ``model_name`` (string), ``gpu_index``,
            ``gpu_instance_id`` (int64), ``fields`` / ``invalid`` / ``attributes`` (string: each
            map's JSON text as sent), and the field columns of ``gpu_samples``
            (:data:`analytics.rows.GPU_FLOAT_FIELDS`: float64,
            :data:`analytics.rows.GPU_WHOLE_FIELDS`: int64).
    """

    msgs: list[BusMessage] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    observed: list[GpuObservation] = field(default_factory=list)
    arrays: dict[str, pa.ChunkedArray] = field(default_factory=dict)

    def __len__(self) -> int:
        """Number of GPUs."""
        return len(self.observed)

    def samples(self, sample_type: type[Any]) -> list[Any]:
        """Every GPU as a ``sample_type`` (:class:`contracts.GpuSample` or its msgspec twin), in
        order, as the reference decodes the records (:meth:`contracts.GpuScrape.samples`: GPU
        ``i`` of a record with ``seq + i``): the whole samples, for a consumer that needs more
        than the columns. Raises ``pydantic.ValidationError`` only if the reference refuses a
        record the decoder accepted (a disagreement between the two)."""
        out: list[Any] = []
        for msg in self.msgs:
            for s in decode(GpuScrape, cast(bytes, msg.value)).samples():
                if sample_type is GpuSample:
                    out.append(s)
                else:
                    out.append(sample_type(**{name: getattr(s, name) for name in GpuSample.model_fields}))
        return out

    def observations(self) -> list[GpuObservation]:
        """Every GPU as a :class:`GpuObservation` (what the idle classifier reads), in order: the
        decoder's own list (read only)."""
        return self.observed


def _array(arrow_type: pa.DataType, rows: Sequence[int], chunks: Sequence[Buffers]) -> pa.ChunkedArray:
    """An Arrow column of the decoder's chunks: ``rows[k]`` values on the buffers ``chunks[k]``
    ``(validity or None, values, offsets or None, null count)``."""
    arrays = []
    for n, (validity, data, offsets, nulls) in zip(rows, chunks, strict=True):
        bufs = [None if validity is None else pa.py_buffer(validity)]
        if offsets is not None:
            bufs.append(pa.py_buffer(offsets))
        bufs.append(pa.py_buffer(data))
        arrays.append(pa.Array.from_buffers(arrow_type, n, bufs, null_count=nulls))
    return pa.chunked_array(arrays, arrow_type)


def decode_scrapes(
    msgs: Sequence[BusMessage], threads: int | None = None
) -> tuple[ScrapeColumns, list[BusMessage]]:
    """The columns of the scrape records ``msgs`` (values not ``None``) that the compiled decoder
    accepts, and the messages it refused, in batch order (the reference decides those). The
    records are read by at most ``threads`` threads (default :data:`DECODE_THREADS`; each reads
    a run of at least 1 MiB of JSON, without the GIL). Raises nothing for a record's content."""
    if not msgs:
        return ScrapeColumns(), []
    got = DECODER.decode([cast(bytes, m.value) for m in msgs], DECODE_THREADS if threads is None else threads)
    accepted: list[int] = got.accepted
    rows = got.chunk_rows
    arrays = {name: _array(_ARRAY_TYPES[name], rows, bufs) for name, bufs in got.arrays.items()}
    for column, name in GPU_FLOAT_FIELDS.items():
        arrays[column] = _array(pa.float64(), rows, got.float_fields[name])
    for column, name in GPU_WHOLE_FIELDS.items():
        arrays[column] = _array(pa.int64(), rows, got.whole_fields[name])
    out = ScrapeColumns(
        msgs=[msgs[k] for k in accepted],
        counts=got.counts,
        observed=cast("list[GpuObservation]", got.observations),
        arrays=arrays,
    )
    if len(accepted) == len(msgs):
        return out, []
    taken = set(accepted)
    return out, [m for k, m in enumerate(msgs) if k not in taken]
