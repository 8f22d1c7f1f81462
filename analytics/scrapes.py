"""Decoding of :class:`contracts.GpuScrape` records (one Kafka record per read of a host's GPUs)
straight to columns.

A batch's scrape records are decoded by a msgspec twin of the model (:mod:`analytics.structs`)
that keeps each GPU's maps (``fields``, ``field_series``, ``invalid``, ``attributes``) as their
raw JSON text (``msgspec.Raw``). The maps of the whole batch are then validated in one decoder
call per map column (the texts joined into one JSON array, decoded with the twin's types), and
their texts become the ``fields`` / ``invalid`` / ``attributes`` JSON columns as they are: the
producer's own JSON of the map (:func:`contracts.encode` writes it compactly; any other valid
spelling is kept as sent). Nothing is written per GPU in Python but the list elements msgspec
makes.

Like the per-sample twins, this path accepts a subset of what :class:`contracts.GpuScrape`
accepts, with the same values; a record it refuses (at decode, or because one of its maps does
not validate) is left to the caller, which has the reference decide
(:func:`analytics.decode.decode_telemetry`).
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import msgspec
import pyarrow as pa

from analytics.structs import struct_for, translate
from analytics.timestamps import storable_ts
from contracts import SCHEMA_VERSION, GpuColumns, GpuScrape
from contracts.bus import BusMessage
from contracts.telemetry import GPU_COLUMNS_OPTIONAL
from contracts.topics import gpu_id, gpu_key

MAP_COLUMNS: tuple[str, ...] = ("fields", "field_series", "invalid", "attributes")
"""The map-valued members of :class:`contracts.GpuColumns`: kept as raw JSON by the twin."""
SCALAR_COLUMNS: tuple[str, ...] = tuple(n for n in GPU_COLUMNS_OPTIONAL if n not in MAP_COLUMNS)
"""The other optional members (``gpu_uuid`` ... ``model_name``): decoded to Python values."""

_COLUMNS_RAW = struct_for(GpuColumns, tuple((n, list[msgspec.Raw]) for n in MAP_COLUMNS))
_SCRAPE_RAW = struct_for(GpuScrape, (("gpus", _COLUMNS_RAW),)) if _COLUMNS_RAW is not None else None
if _SCRAPE_RAW is None:  # pragma: no cover - a contract change the twins do not cover
    raise ImportError("contracts.GpuScrape has no msgspec twin: extend analytics.structs")
if TYPE_CHECKING:
    ScrapeStruct = GpuScrape
else:
    ScrapeStruct = _SCRAPE_RAW
    """A :class:`contracts.GpuScrape` as this path decodes it (maps as raw JSON)."""

SCRAPE_DECODER: msgspec.json.Decoder[Any] = msgspec.json.Decoder(_SCRAPE_RAW)
"""Decodes one scrape record's JSON; raises ``msgspec.ValidationError`` / ``DecodeError`` for a
record it refuses."""
_MAP_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    name: msgspec.json.Decoder(list[translate(GpuColumns.model_fields[name].annotation.__args__[0])])  # type: ignore[misc,union-attr]
    for name in MAP_COLUMNS
}
_EMPTY_MAP = b"{}"
_REFUSED = (msgspec.ValidationError, msgspec.DecodeError)


def is_scrape(value: bytes) -> bool:
    """Whether a ``telemetry.gpu`` record is worth decoding as a :class:`contracts.GpuScrape`
    first: its JSON text has a ``"gpus":`` member somewhere (cheap; a false guess only costs a
    refusal, and the reference decides by the top-level object)."""
    return b'"gpus":' in value


def decode_scrape(value: bytes) -> Any | None:
    """One record as :data:`ScrapeStruct`, or ``None`` if this path refuses it (malformed,
    invalid, another ``schema_version``, a ``ts`` that is not a storable time): the reference
    decides those."""
    try:
        rec = SCRAPE_DECODER.decode(value)
    except _REFUSED:
        return None
    ts = rec.gpus.ts
    # storable_ts of every element, in C: finite (no NaN for min/max to skip), then the bounds
    if rec.schema_version != SCHEMA_VERSION or not (
        all(map(math.isfinite, ts)) and storable_ts(min(ts)) and storable_ts(max(ts))
    ):
        return None
    return rec


@dataclass(slots=True)
class ScrapeColumns:
    """The GPUs of a batch's scrape records, one element per GPU (records in batch order, GPUs
    in column order) unless said otherwise.

    Attributes:
        records: the records (:data:`ScrapeStruct`); ``msgs[k]`` is the message of ``records[k]``.
        counts: GPUs per record.
        ts, gpu_uuid, gpu_index, gpu_instance_id, gpu_instance_profile, model_name: per GPU, as
            in :class:`contracts.GpuSample` (``None`` where the record left the column empty).
        fields, field_series, invalid, attributes: per GPU, the decoded maps (typed as the
            model's; a ``field_series`` entry's series are twins of
            :class:`contracts.SeriesValue`).
        texts: ``fields`` / ``invalid`` / ``attributes`` → per GPU the map's JSON text, as an
            Arrow ``string`` array.
    """

    records: list[Any] = field(default_factory=list)
    msgs: list[BusMessage] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    ts: list[float] = field(default_factory=list)
    gpu_uuid: list[str | None] = field(default_factory=list)
    gpu_index: list[int | None] = field(default_factory=list)
    gpu_instance_id: list[int | None] = field(default_factory=list)
    gpu_instance_profile: list[str | None] = field(default_factory=list)
    model_name: list[str | None] = field(default_factory=list)
    fields: list[dict[str, float | int]] = field(default_factory=list)
    field_series: list[dict[str, list[Any]]] = field(default_factory=list)
    invalid: list[dict[str, str]] = field(default_factory=list)
    attributes: list[dict[str, str]] = field(default_factory=list)
    texts: dict[str, pa.Array] = field(default_factory=dict)

    def __len__(self) -> int:
        """Number of GPUs."""
        return len(self.ts)

    def samples(self, sample_type: type[Any]) -> list[Any]:
        """Every GPU as a ``sample_type`` (:class:`contracts.GpuSample` or its twin), in order:
        what a per-sample consumer (the idle classifier) reads. The ``seq`` of GPU ``i`` of a
        record is the record's ``seq + i``."""
        chain = itertools.chain.from_iterable
        hosts = chain(itertools.repeat(r.host, n) for r, n in zip(self.records, self.counts, strict=True))
        sources = chain(itertools.repeat(r.source, n) for r, n in zip(self.records, self.counts, strict=True))
        targets = chain(itertools.repeat(r.target, n) for r, n in zip(self.records, self.counts, strict=True))
        seqs = chain(range(r.seq, r.seq + n) for r, n in zip(self.records, self.counts, strict=True))
        return [
            sample_type(
                ts=ts,
                host=host,
                gpu_uuid=uuid,
                gpu_index=index,
                gpu_instance_id=gi,
                gpu_instance_profile=profile,
                model_name=model,
                fields=fields,
                field_series=series,
                invalid=invalid,
                attributes=attributes,
                source=source,
                target=target,
                seq=seq,
            )  # fmt: skip
            for ts, host, uuid, index, gi, profile, model, fields, series, invalid, attributes, source, target, seq in zip(
                self.ts,
                hosts,
                self.gpu_uuid,
                self.gpu_index,
                self.gpu_instance_id,
                self.gpu_instance_profile,
                self.model_name,
                self.fields,
                self.field_series,
                self.invalid,
                self.attributes,
                sources,
                targets,
                seqs,
                strict=True,
            )  # fmt: skip
        ]


    def observations(self) -> list[GpuObservation]:
        """Every GPU as a :class:`GpuObservation` (what the idle classifier reads), in order:
        the decoded maps shared, no other object per GPU than the observation itself."""
        return list(
            map(
                GpuObservation,
                self.ts,
                _per_gpu(self.records, self.counts, "host"),
                self.gpu_uuid,
                self.gpu_index,
                self.gpu_instance_id,
                self.model_name,
                self.fields,
                self.invalid,
            )
        )


def _per_gpu(records: list[Any], counts: list[int], name: str) -> Iterable[Any]:
    """Per GPU the member ``name`` of its record (record ``k`` has ``counts[k]`` GPUs)."""
    return itertools.chain.from_iterable(
        itertools.repeat(getattr(r, name), n) for r, n in zip(records, counts, strict=True)
    )


class GpuObservation(msgspec.Struct, frozen=True, gc=False):
    """What the idle classifier reads of one GPU of a scrape record
    (:class:`analytics.classify.SampleLike`), made by :meth:`ScrapeColumns.observations`.

    Attributes:
        ts, host, gpu_uuid, gpu_index, gpu_instance_id, model_name, fields, invalid: as in
            :class:`contracts.GpuSample` (the maps are the decoded ones of the columns, shared).
    """

    ts: float
    host: str
    gpu_uuid: str | None
    gpu_index: int | None
    gpu_instance_id: int | None
    model_name: str | None
    fields: dict[str, float | int]
    invalid: dict[str, str]

    @property
    def key(self) -> str:
        """GPU identity, as :attr:`contracts.GpuSample.key`."""
        return gpu_key(self.host, gpu_id(self.gpu_uuid, self.gpu_index), self.gpu_instance_id)


CHUNK_GPUS = 4096
"""GPUs whose maps are validated in one decoder call: larger batches are cut into chunks of
whole records of about this many GPUs (a chunk's buffers stay in the CPU caches)."""


def scrape_columns(
    records: Sequence[Any], msgs: Sequence[BusMessage]
) -> tuple[ScrapeColumns, list[BusMessage]]:
    """The columns of ``records`` (decoded by :func:`decode_scrape`; ``msgs[k]`` is the message
    of ``records[k]``), with their maps validated, and the messages of the records whose maps do
    not validate (left out of the columns, in batch order: the reference decides them).

    The maps are validated a whole column of a chunk of records (:data:`CHUNK_GPUS`) at a time;
    only when one fails are that chunk's records validated one by one to find the bad ones.
    """
    out = ScrapeColumns()
    refused: list[BusMessage] = []
    texts: dict[str, list[pa.Array]] = {}
    start = gpus = 0
    for k, rec in enumerate(records):
        gpus += len(rec.gpus.ts)
        if gpus >= CHUNK_GPUS or k == len(records) - 1:
            columns, bad = _chunk_columns(records[start : k + 1], msgs[start : k + 1])
            _extend(out, columns)
            for name, text in columns.texts.items():
                texts.setdefault(name, []).append(text)
            refused += bad
            start, gpus = k + 1, 0
    out.texts = {
        name: parts[0] if len(parts) == 1 else pa.concat_arrays(parts) for name, parts in texts.items()
    }
    return out, refused


def _chunk_columns(
    records: Sequence[Any], msgs: Sequence[BusMessage]
) -> tuple[ScrapeColumns, list[BusMessage]]:
    """:func:`scrape_columns` of one chunk."""
    out = ScrapeColumns(records=list(records), msgs=list(msgs))
    if not records:
        return out, []
    decoded = _validate_maps(out.records)
    refused: list[BusMessage] = []
    if decoded is None:
        good: list[Any] = []
        good_msgs: list[BusMessage] = []
        for rec, msg in zip(records, msgs, strict=True):
            if _validate_maps([rec]) is None:
                refused.append(msg)
            else:
                good.append(rec)
                good_msgs.append(msg)
        columns, _ = _chunk_columns(good, good_msgs)
        return columns, refused
    _fill(out, decoded)
    return out, refused


_LISTS: tuple[str, ...] = ("records", "msgs", "counts", "ts", *SCALAR_COLUMNS, *MAP_COLUMNS)


def _extend(out: ScrapeColumns, more: ScrapeColumns) -> None:
    """Append ``more``'s GPUs to ``out``'s (all but the texts)."""
    if not out.records:
        for name in _LISTS:
            setattr(out, name, getattr(more, name))
        return
    for name in _LISTS:
        getattr(out, name).extend(getattr(more, name))


def _map_pieces(records: Iterable[Any], name: str) -> list[Any]:
    """Per GPU the raw JSON of map column ``name`` (``{}`` where a record left it empty)."""
    pieces: list[Any] = []
    extend = pieces.extend
    for rec in records:
        cols = rec.gpus
        column = getattr(cols, name)
        extend(column if column else itertools.repeat(_EMPTY_MAP, len(cols.ts)))
    return pieces


_NO_ENTRIES: dict[str, Any] = {}
"""The map of every GPU of a column that every record of a chunk left empty: one shared object
(samples and observations only read their maps)."""

_Maps = dict[str, tuple[list[Any] | None, list[Any]]]
"""Map column name → (per GPU its raw JSON, ``None`` when every record left the column empty;
per GPU the decoded map)."""


def _validate_maps(records: Sequence[Any]) -> _Maps | None:
    """The maps of ``records`` (:data:`_Maps`); ``None`` if one does not decode as the model's
    type."""
    out: _Maps = {}
    gpus = sum(len(r.gpus.ts) for r in records)
    for name in MAP_COLUMNS:
        if all(not getattr(r.gpus, name) for r in records):
            out[name] = (None, [_NO_ENTRIES] * gpus)
            continue
        pieces = _map_pieces(records, name)
        try:
            maps = _MAP_DECODERS[name].decode(b"[" + b",".join(pieces) + b"]")
        except _REFUSED:
            return None
        out[name] = (pieces, maps)
    return out


def _fill(out: ScrapeColumns, maps: _Maps) -> None:
    chain = itertools.chain.from_iterable
    cols = [r.gpus for r in out.records]
    out.counts = counts = [len(c.ts) for c in cols]
    gpus = sum(counts)
    out.ts = list(chain(c.ts for c in cols))
    for name in SCALAR_COLUMNS:
        if all(not getattr(c, name) for c in cols):
            values: list[Any] = [None] * gpus
        else:
            values = list(
                chain(
                    column if (column := getattr(c, name)) else itertools.repeat(None, n)
                    for c, n in zip(cols, counts, strict=True)
                )
            )
        setattr(out, name, values)
    for name in MAP_COLUMNS:
        pieces, decoded = maps[name]
        setattr(out, name, decoded)
        if name != "field_series":
            out.texts[name] = _empty_maps(gpus) if pieces is None else _text_array(pieces)


def _empty_maps(n: int) -> pa.Array:
    """An Arrow ``string`` array of ``n`` empty JSON objects (``{}``)."""
    offsets = array("i", range(0, 2 * n + 1, 2))
    return cast(pa.Array, pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(_EMPTY_MAP * n)))


def _text_array(pieces: list[Any]) -> pa.Array:
    """An Arrow ``string`` array of the JSON texts ``pieces`` (bytes or ``msgspec.Raw``, UTF-8:
    msgspec has checked them), built from their concatenation without a Python string each."""
    data = b"".join(pieces)
    if len(data) >= 2**31:  # past int32 offsets: one string at a time
        return pa.array([bytes(p).decode() for p in pieces], pa.string())
    offsets = array("i", itertools.accumulate(map(len, pieces), initial=0))
    return cast(pa.Array, pa.StringArray.from_buffers(len(pieces), pa.py_buffer(offsets), pa.py_buffer(data)))
