"""Decoding of :class:`contracts.GpuScrape` records (one Kafka record per read of a host's GPUs)
straight to columns.

A batch's scrape records are decoded by the msgspec twin of the model (:mod:`analytics.structs`),
which validates every value as the model does, the GPUs' maps included: the collectors write them
by name (:attr:`contracts.GpuColumns.field_columns` ...: name → one value per GPU), so a record
decodes into a few lists and no object per GPU. A record that still holds one map per GPU (written
before the columns) is turned into the same columns (:func:`contracts.telemetry.map_columns`).
The columns of the batch's records are then joined, name by name, into :class:`ScrapeColumns`:
the input of :func:`analytics.rows.gpu_scrapes_table` (the ``gpu_samples`` rows) and of the idle
classifier (:meth:`ScrapeColumns.observations`).

Like the per-sample twins, this path accepts a subset of what :class:`contracts.GpuScrape`
accepts, with the same values; a record it refuses is left to the caller, which has the reference
decide (:func:`analytics.decode.decode_telemetry`), and a record the reference refuses whole loses
only its bad GPUs (:func:`analytics.decode.salvage_scrape`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from analytics.structs import struct_for
from contracts import SCHEMA_VERSION, GpuScrape
from contracts.bus import BusMessage
from contracts.telemetry import GPU_MAP_COLUMNS, map_columns
from contracts.topics import gpu_id, gpu_key

SCALAR_COLUMNS: tuple[str, ...] = (
    "gpu_uuid",
    "gpu_index",
    "gpu_instance_id",
    "gpu_instance_profile",
    "model_name",
)
"""The per-GPU members of :class:`contracts.GpuColumns` decoded to Python values, ``None`` where
a record leaves the list empty."""

_SCRAPE = struct_for(GpuScrape)
if _SCRAPE is None:  # pragma: no cover - a contract change the twins do not cover
    raise ImportError("contracts.GpuScrape has no msgspec twin: extend analytics.structs")
if TYPE_CHECKING:
    ScrapeStruct = GpuScrape
else:
    ScrapeStruct = _SCRAPE
    """A :class:`contracts.GpuScrape` as this path decodes it (the model's msgspec twin)."""

SCRAPE_DECODER: msgspec.json.Decoder[Any] = msgspec.json.Decoder(_SCRAPE)
"""Decodes one scrape record's JSON; raises ``msgspec.ValidationError`` / ``DecodeError`` for a
record it refuses."""
_REFUSED = (msgspec.ValidationError, msgspec.DecodeError)


def is_scrape(value: bytes) -> bool:
    """Whether a ``telemetry.gpu`` record is worth decoding as a :class:`contracts.GpuScrape`
    first: its JSON text has a ``"gpus":`` member somewhere (cheap; a false guess only costs a
    refusal, and the reference decides by the top-level object)."""
    return b'"gpus":' in value


def decode_scrape(value: bytes) -> Any | None:
    """One record as :data:`ScrapeStruct`, or ``None`` if this path refuses it (malformed,
    invalid, another ``schema_version``, a non-finite ``ts``): the reference decides those."""
    try:
        rec = SCRAPE_DECODER.decode(value)
    except _REFUSED:
        return None
    if rec.schema_version != SCHEMA_VERSION or not all(map(math.isfinite, rec.gpus.ts)):
        return None
    return rec


class GpuObservation(msgspec.Struct, frozen=True, gc=False):
    """What the idle classifier reads of one GPU of a scrape record
    (:class:`analytics.classify.SampleLike`), made by :meth:`ScrapeColumns.observations`.

    Attributes:
        ts, host, gpu_uuid, gpu_index, gpu_instance_id, model_name: as in
            :class:`contracts.GpuSample`.
        fields, invalid: the GPU's entries of the fields asked for (valid values by DCGM field
            name; rejected field → reason), as in :class:`contracts.GpuSample`.
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


@dataclass(slots=True)
class ScrapeColumns:
    """The GPUs of a batch's scrape records, one element per GPU (records in batch order, GPUs
    in column order) unless said otherwise.

    Attributes:
        records: the records (:data:`ScrapeStruct`); ``msgs[k]`` is the message of ``records[k]``.
        counts: GPUs per record.
        ts, gpu_uuid, gpu_index, gpu_instance_id, gpu_instance_profile, model_name: per GPU, as
            in :class:`contracts.GpuSample` (``None`` where the record left the column empty).
        field_series: per GPU its ``field_series`` map (empty where the record has none; series
            are twins of :class:`contracts.SeriesValue`).
        fields, invalid, attributes: the GPUs' maps by name: name → per GPU the value, ``None``
            where that GPU's map has no entry (names in the order first seen in the batch).
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
    field_series: list[dict[str, list[Any]]] = field(default_factory=list)
    fields: dict[str, list[float | int | None]] = field(default_factory=dict)
    invalid: dict[str, list[str | None]] = field(default_factory=dict)
    attributes: dict[str, list[str | None]] = field(default_factory=dict)

    def __len__(self) -> int:
        """Number of GPUs."""
        return len(self.ts)

    def _shared(self) -> tuple[Iterable[str], Iterable[str], Iterable[str], Iterable[int]]:
        """Per GPU its record's ``host``, ``source``, ``target`` and its own ``seq``."""
        chain = itertools.chain.from_iterable
        pairs = list(zip(self.records, self.counts, strict=True))
        return (
            chain(itertools.repeat(r.host, n) for r, n in pairs),
            chain(itertools.repeat(r.source, n) for r, n in pairs),
            chain(itertools.repeat(r.target, n) for r, n in pairs),
            chain(range(r.seq, r.seq + n) for r, n in pairs),
        )

    def samples(self, sample_type: type[Any]) -> list[Any]:
        """Every GPU as a ``sample_type`` (:class:`contracts.GpuSample` or its twin) with all its
        maps, in order. The ``seq`` of GPU ``i`` of a record is the record's ``seq + i``."""
        return self._expanded(sample_type, _maps(self.fields), _maps(self.invalid), _maps(self.attributes))

    def observations(self, field_names: Iterable[str]) -> list[GpuObservation]:
        """Every GPU as a :class:`GpuObservation`, in order, with only the ``fields`` and
        ``invalid`` entries named in ``field_names``: what a reader of those fields only (the
        idle classifier, :data:`analytics.classify.CLASSIFIER_FIELDS`) needs, at a fraction of
        the cost of whole samples."""
        wanted = list(field_names)
        hosts, _, _, _ = self._shared()
        return list(
            map(
                GpuObservation,
                self.ts,
                hosts,
                self.gpu_uuid,
                self.gpu_index,
                self.gpu_instance_id,
                self.model_name,
                _some_maps({k: self.fields[k] for k in wanted if k in self.fields}, len(self)),
                _some_maps({k: self.invalid[k] for k in wanted if k in self.invalid}, len(self)),
            )
        )

    def _expanded(
        self,
        sample_type: type[Any],
        fields: Iterable[dict[str, Any]] | None,
        invalid: Iterable[dict[str, Any]] | None,
        attributes: Iterable[dict[str, Any]] | None,
    ) -> list[Any]:
        n = len(self)

        def empty() -> Iterable[dict[str, Any]]:
            return itertools.repeat({}, n)  # one shared map, never written to

        hosts, sources, targets, seqs = self._shared()
        return [
            sample_type(
                ts=ts,
                host=host,
                gpu_uuid=uuid,
                gpu_index=index,
                gpu_instance_id=gi,
                gpu_instance_profile=profile,
                model_name=model,
                fields=f,
                field_series=fs,
                invalid=inv,
                attributes=attrs,
                source=source,
                target=target,
                seq=seq,
            )  # fmt: skip
            for ts, host, uuid, index, gi, profile, model, f, fs, inv, attrs, source, target, seq in zip(
                self.ts,
                hosts,
                self.gpu_uuid,
                self.gpu_index,
                self.gpu_instance_id,
                self.gpu_instance_profile,
                self.model_name,
                empty() if fields is None else fields,
                self.field_series,
                empty() if invalid is None else invalid,
                empty() if attributes is None else attributes,
                sources,
                targets,
                seqs,
                strict=True,
            )  # fmt: skip
        ]


def _some_maps(columns: dict[str, list[Any]], n: int) -> Iterable[dict[str, Any]]:
    """Per GPU (``n``) the map of ``columns`` (name → per GPU value or ``None``): built by
    ``dict(zip(...))`` in C when no column has a ``None``, else as :func:`_maps` builds it."""
    if not columns:
        return itertools.repeat({}, n)  # one shared map, never written to
    if any(None in c for c in columns.values()):
        return _maps(columns) or ()
    return map(dict, map(zip, itertools.repeat(list(columns)), zip(*columns.values(), strict=True)))


def _maps(columns: dict[str, list[Any]]) -> Iterable[dict[str, Any]] | None:
    """Per GPU the map of ``columns`` (name → per GPU value or ``None``); ``None`` if there are
    no columns (every map empty)."""
    if not columns:
        return None
    names = list(columns)
    return (
        {k: v for k, v in zip(names, row, strict=True) if v is not None}
        for row in zip(*columns.values(), strict=True)
    )


def scrape_columns(records: Sequence[Any], msgs: Sequence[BusMessage]) -> ScrapeColumns:
    """The columns of ``records`` (decoded by :func:`decode_scrape`; ``msgs[k]`` is the message
    of ``records[k]``): every per-GPU list joined over the records, and every map column by name
    (``None`` for the GPUs of a record without that name)."""
    out = ScrapeColumns(records=list(records), msgs=list(msgs))
    if not records:
        return out
    chain = itertools.chain.from_iterable
    repeat = itertools.repeat
    cols = [r.gpus for r in records]
    out.counts = counts = [len(c.ts) for c in cols]
    gpus = sum(counts)
    out.ts = list(chain(c.ts for c in cols))
    pairs = list(zip(cols, counts, strict=True))
    for name in SCALAR_COLUMNS:
        if all(not getattr(c, name) for c in cols):
            values: list[Any] = [None] * gpus
        else:
            values = list(
                chain(column if (column := getattr(c, name)) else repeat(None, n) for c, n in pairs)
            )
        setattr(out, name, values)
    if any(c.field_series for c in cols):
        out.field_series = list(chain(c.field_series or repeat({}, n) for c, n in pairs))
    else:
        out.field_series = [{}] * gpus  # shared empty maps, never written to
    for per_gpu, by_name in GPU_MAP_COLUMNS.items():
        named = [getattr(c, by_name) or map_columns(getattr(c, per_gpu)) for c in cols]
        names = dict.fromkeys(k for m in named for k in m)
        setattr(
            out,
            per_gpu,
            {
                k: list(chain(m.get(k) or repeat(None, n) for m, n in zip(named, counts, strict=True)))
                for k in names
            },
        )
    return out
