"""Decoding of telemetry records read from the bus, with a reason code for every rejection.

:func:`decode_telemetry` decodes one record with pydantic (:func:`contracts.decode`): the
reference, which decides what is accepted and why a record is rejected. :func:`decode_batch`
decodes a batch: each record first with the JSON decoder of its model's msgspec twin
(:mod:`analytics.structs`), which accepts a subset of what the model accepts with the same
values; every record it refuses (malformed, invalid, lax spellings such as a number in a string,
an unknown field, another ``schema_version``, a ``ts`` that is not a storable time, :func:`analytics.timestamps.storable_ts`) goes to
:func:`decode_telemetry`, so the verdict and the reason are the reference's. Accepted records come
out as twins (same attributes, properties and methods as the model).

``telemetry.gpu`` carries two records: :class:`contracts.GpuScrape` (a read of a host's GPUs in
columns; a JSON object with a top-level ``gpus`` member) and :class:`contracts.GpuSample` (one
GPU; older producers, replay files). Scrape records are decoded by the compiled decoder of
:mod:`analytics.scrapes` (the msgspec twins' counterpart for them) and come out as columns
(:class:`analytics.scrapes.ScrapeColumns`); one the reference accepts after that decoder
refused it comes out as its samples. A scrape record whose envelope is valid but some of whose
GPUs are not loses only those GPUs: each is rejected with reason ``invalid_sample``
(:func:`salvage_scrape`).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from analytics.scrapes import ScrapeColumns, decode_scrapes, is_scrape
from analytics.structs import struct_for
from analytics.timestamps import storable_ts
from contracts import SCHEMA_VERSION, GpuColumns, GpuSample, GpuScrape, IbPortSample, KafkaTopics, decode
from contracts.bus import BusMessage
from contracts.scheduler import SchedulerNode

if TYPE_CHECKING:  # a twin has its model's attributes, properties and methods (analytics.structs)
    GpuRecord = GpuSample
    IbPortRecord = IbPortSample
else:
    GpuRecord = struct_for(GpuSample) or GpuSample
    """What :func:`decode_batch` returns for a GPU sample: the msgspec twin of
    :class:`contracts.GpuSample` (the model itself if it has no twin)."""
    IbPortRecord = struct_for(IbPortSample) or IbPortSample
    """Likewise for :class:`contracts.IbPortSample`."""


class RejectedRecord(ValueError):
    """A record (or one GPU of a scrape record) that cannot be used; :attr:`reason` is the metric
    label (``tombstone``, ``unknown_topic``, ``malformed_json``, ``invalid_record``,
    ``unsupported_version``, ``bad_timestamp``, ``invalid_sample``: one GPU of a scrape record)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        """Build with a reason code and a short human detail."""
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def decode_telemetry(
    msg: BusMessage, topics: KafkaTopics
) -> GpuSample | GpuScrape | IbPortSample | SchedulerNode:
    """Decode ``msg`` by its topic: :class:`GpuScrape` or :class:`GpuSample` on
    ``topics.telemetry_gpu`` (a scrape when the JSON object has a top-level ``gpus`` member),
    :class:`IbPortSample` on ``topics.telemetry_ib_port``, :class:`SchedulerNode` on
    ``topics.telemetry_scheduler`` (JSON, :func:`contracts.decode`).

    Raises:
        RejectedRecord: with the reason the record cannot be used.
    """
    model: type[GpuSample] | type[GpuScrape] | type[IbPortSample] | type[SchedulerNode]
    if msg.topic == topics.telemetry_gpu:
        model = GpuScrape if msg.value is not None and _top_level(msg.value, "gpus") else GpuSample
    elif msg.topic == topics.telemetry_ib_port:
        model = IbPortSample
    elif msg.topic == topics.telemetry_scheduler:
        model = SchedulerNode
    else:
        raise RejectedRecord("unknown_topic", msg.topic)
    if msg.value is None:
        raise RejectedRecord("tombstone")
    try:
        record = decode(model, msg.value)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if any(e.get("type") == "json_invalid" for e in errors):
            raise RejectedRecord("malformed_json", str(errors[0].get("msg", ""))) from exc
        raise RejectedRecord("invalid_record", _summary(errors)) from exc
    except ValueError as exc:  # contracts.decode: schema_version != SCHEMA_VERSION
        raise RejectedRecord("unsupported_version", f"expected {SCHEMA_VERSION}") from exc
    stamps = record.gpus.ts if isinstance(record, GpuScrape) else [record.ts]
    bad = next((t for t in stamps if not storable_ts(t)), None)
    if bad is not None:
        raise RejectedRecord("bad_timestamp", repr(bad))
    return record


def _top_level(value: bytes, member: str) -> bool:
    """Whether ``value`` is a JSON object with a top-level ``member`` (False if not JSON)."""
    try:
        obj = json.loads(value)
    except ValueError:
        return False
    return isinstance(obj, dict) and member in obj


def salvage_scrape(msg: BusMessage) -> tuple[list[GpuSample], list[RejectedRecord]] | None:
    """The GPUs of a :class:`GpuScrape` record the reference rejected whole, one by one: the
    valid ones as :class:`GpuSample` (GPU ``i`` with ``seq + i``), and one
    ``invalid_sample`` rejection per GPU that is not a valid sample. ``None`` when the record
    cannot be split so (not a JSON object with a ``gpus`` object of lists of one length, a
    member the model does not know, or an envelope — ``host``, ``source``, ``target``, ``seq``,
    ``schema_version`` — that is itself invalid): then the whole record is rejected.
    """
    if msg.value is None:
        return None
    try:
        obj = json.loads(msg.value)
    except ValueError:
        return None
    gpus = obj.get("gpus") if isinstance(obj, dict) else None
    ts = gpus.get("ts") if isinstance(gpus, dict) else None
    if not isinstance(gpus, dict) or not isinstance(ts, list) or not ts:
        return None
    n = len(ts)
    known = GpuScrape.model_fields.keys()
    if set(obj) - known or set(gpus) - GpuColumns.model_fields.keys():
        return None
    if any(not isinstance(c, list) or len(c) not in (0, n) for c in gpus.values()):
        return None
    envelope = {k: v for k, v in obj.items() if k != "gpus"}
    try:
        head = GpuScrape.model_validate({**envelope, "gpus": {"ts": [0.0], "gpu_index": [0]}})
    except ValidationError:
        return None
    if head.schema_version != SCHEMA_VERSION:
        return None
    shared = {"host": head.host, "source": head.source, "target": head.target}
    samples: list[GpuSample] = []
    rejected: list[RejectedRecord] = []
    for i in range(n):
        sample = {**shared, "seq": head.seq + i, **{k: c[i] for k, c in gpus.items() if c}}
        try:
            got = GpuSample.model_validate(sample)
        except ValidationError as exc:
            rejected.append(
                RejectedRecord("invalid_sample", f"GPU {i}: {_summary(exc.errors(include_url=False))}")
            )
            continue
        if not storable_ts(got.ts):
            rejected.append(RejectedRecord("invalid_sample", f"GPU {i}: ts {got.ts!r}"))
            continue
        samples.append(got)
    return samples, rejected


def _summary(errors: list[ErrorDetails]) -> str:
    if not errors:
        return ""
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"])
    return f"{loc}: {first['msg']}"[:200]


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for the block (restored on exit, also on error).

    Decoding a batch allocates tens of thousands of container objects (models, dicts) that all
    stay alive until the batch is written, in a process with a large live heap; each allocation
    burst triggers collections that walk that heap and free nothing. Pausing the collector over
    the batch measured 8.7 → 5.0 µs per record (``bench/analytics.py``). The objects made are
    freed by reference counting as usual; only cycles (rare: exception chains of rejected
    records) wait for the next collection, which runs as soon as the block ends.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(slots=True)
class DecodedBatch:
    """What :func:`decode_batch` made of a batch, every list in the batch's order.

    Attributes:
        gpu: decoded GPU samples (:data:`GpuRecord`) of :class:`GpuSample` records and of the
            scrape records the reference decided; ``gpu_msgs[k]`` is the message of ``gpu[k]``.
        scrapes: the GPUs of the scrape records the compiled decoder accepted, in columns.
        ib: decoded InfiniBand port samples (:data:`IbPortRecord`); ``ib_msgs[k]`` is the
            message of ``ib[k]``.
        rejected: ``(message, rejection)`` of every record that cannot be used.
        fallbacks: records the twin refused and :func:`decode_telemetry` decided (accepted or
            rejected).
    """

    gpu: list[GpuRecord] = field(default_factory=list)
    gpu_msgs: list[BusMessage] = field(default_factory=list)
    scrapes: ScrapeColumns = field(default_factory=ScrapeColumns)
    ib: list[IbPortRecord] = field(default_factory=list)
    ib_msgs: list[BusMessage] = field(default_factory=list)
    rejected: list[tuple[BusMessage, RejectedRecord]] = field(default_factory=list)
    fallbacks: int = 0


def _twin_decoder(twin: type[Any]) -> msgspec.json.Decoder[Any] | None:
    return msgspec.json.Decoder(twin) if issubclass(twin, msgspec.Struct) else None


_GPU_DECODER = _twin_decoder(GpuRecord)
_IB_DECODER = _twin_decoder(IbPortRecord)
_REFUSED = (msgspec.ValidationError, msgspec.DecodeError)


def _as_twin(record: GpuSample | IbPortSample, twin: type[Any]) -> Any:
    """``record`` (validated by its model) as ``twin``, sharing its values."""
    if not issubclass(twin, msgspec.Struct):
        return record
    return twin(**{name: getattr(record, name) for name in twin.__struct_fields__})


def decode_batch(msgs: Sequence[BusMessage], topics: KafkaTopics, threads: int | None = None) -> DecodedBatch:
    """Decode a batch of bus records (module docstring): each by its model's msgspec twin, and
    every record the twin refuses by :func:`decode_telemetry`, so a bad record is rejected alone
    with the reference's reason and detail and nothing else is lost. Raises nothing for bad
    records: they are in :attr:`DecodedBatch.rejected`. ``threads``: at most that many threads
    read the scrape records (:func:`analytics.scrapes.decode_scrapes`; its default if ``None``).

    Runs with the cyclic garbage collector paused (:func:`paused_gc`). The twins themselves are
    not tracked by it, and their dicts, holding only strings and numbers, are not either.
    """
    with paused_gc():
        return _decode_batch(msgs, topics, threads)


def _decode_batch(msgs: Sequence[BusMessage], topics: KafkaTopics, threads: int | None) -> DecodedBatch:
    out = DecodedBatch()
    gpu_topic, ib_topic = topics.telemetry_gpu, topics.telemetry_ib_port
    gpu_dec, ib_dec = _GPU_DECODER, _IB_DECODER
    gpu_ok, gpu_msgs, ib_ok, ib_msgs = out.gpu.append, out.gpu_msgs.append, out.ib.append, out.ib_msgs.append
    storable = storable_ts
    slow: list[BusMessage] = []
    scrape_msgs: list[BusMessage] = []
    for msg in msgs:
        topic, value = msg.topic, msg.value
        if topic == gpu_topic and value is not None and is_scrape(value):
            scrape_msgs.append(msg)
            continue
        if topic == gpu_topic:
            dec = gpu_dec
        elif topic == ib_topic:
            dec = ib_dec
        else:
            dec = None
        if dec is None or value is None:
            slow.append(msg)
            continue
        try:
            rec = dec.decode(value)
        except _REFUSED:
            slow.append(msg)
            continue
        if rec.schema_version != SCHEMA_VERSION or not storable(rec.ts):
            slow.append(msg)
            continue
        if dec is gpu_dec:
            gpu_ok(rec)
            gpu_msgs(msg)
        else:
            ib_ok(rec)
            ib_msgs(msg)
    out.scrapes, refused = decode_scrapes(scrape_msgs, threads)
    if refused:
        slow.extend(refused)
        index = {id(m): i for i, m in enumerate(msgs)}
        slow.sort(key=lambda m: index[id(m)])
    if slow:
        _decode_slow(slow, topics, out, msgs)
    return out


def _decode_slow(
    msgs: list[BusMessage], topics: KafkaTopics, out: DecodedBatch, batch: Sequence[BusMessage]
) -> None:
    """:func:`decode_telemetry` for each of ``msgs`` (part of ``batch``); accepted records are
    merged into ``out`` in the batch's order."""
    out.fallbacks += len(msgs)
    gpu: list[tuple[GpuRecord, BusMessage]] = []
    ib: list[tuple[IbPortRecord, BusMessage]] = []
    for msg in msgs:
        try:
            sample = decode_telemetry(msg, topics)
        except RejectedRecord as exc:
            salvaged = (
                salvage_scrape(msg)
                if exc.reason in ("invalid_record", "bad_timestamp") and msg.topic == topics.telemetry_gpu
                else None
            )
            if salvaged is None:
                out.rejected.append((msg, exc))
                continue
            good, bad = salvaged
            gpu.extend((_as_twin(s, GpuRecord), msg) for s in good)
            out.rejected.extend((msg, b) for b in bad)
            continue
        if isinstance(sample, GpuScrape):
            gpu.extend((_as_twin(s, GpuRecord), msg) for s in sample.samples())
        elif isinstance(sample, GpuSample):
            gpu.append((_as_twin(sample, GpuRecord), msg))
        elif isinstance(sample, SchedulerNode):  # read by analytics.service, not by this batch
            out.rejected.append((msg, RejectedRecord("unknown_topic", msg.topic)))
        else:
            ib.append((_as_twin(sample, IbPortRecord), msg))
    if not gpu and not ib:
        return
    index = {id(m): i for i, m in enumerate(batch)}
    for found, records, positions in ((gpu, out.gpu, out.gpu_msgs), (ib, out.ib, out.ib_msgs)):
        if found:
            merged = sorted([*zip(records, positions, strict=True), *found], key=lambda rm: index[id(rm[1])])
            records[:] = [r for r, _ in merged]
            positions[:] = [m for _, m in merged]
