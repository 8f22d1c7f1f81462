"""dcgm-exporter ``/metrics`` bodies → one :class:`contracts.GpuSample` per GPU or MIG instance.

Format: Prometheus text exposition 0.0.4 (Prometheus docs, "Exposition formats"; the pieces are
in :mod:`collectors.exposition`) as written by NVIDIA dcgm-exporter, with its real quirks:

* identity is ``(host, UUID[, GPU_I_ID])`` whatever the label spelling: ``Hostname`` (exporters
  up to 4.x) or ``hostname`` (main), ``UUID`` or ``uuid`` (1.x); an empty label value is absent;
* 1.x metric names (``dcgm_gpu_utilization``, ``dcgm_fi_prof_*``) are mapped to DCGM field names
  (:data:`collectors.dcgm_fields.LEGACY_NAMES`), as are the 1.x k8s label names
  (``pod_name``, ``pod_namespace``, ``container_name``);
* a MIG instance (``GPU_I_ID``) is a GPU of its own; GPU-level fields that dcgm-exporter repeats
  on every instance (power, temperature, XID...) stay per instance as read — never summed;
* DCGM blank / not-found / not-supported / not-permissioned sentinels (int32, int64 and fp64
  families), ``NaN`` and out-of-range values are kept out of ``fields`` and named in
  ``invalid`` (reasons ``sentinel``, ``not_a_number``, ``out_of_range``);
* ``pod``, ``namespace``, ``container`` and every other non-identity label go to
  ``attributes``;
* optional sample timestamps (ms), families in any order, ``# HELP``/``# TYPE`` without samples
  and samples under another family's ``# TYPE`` are all accepted; a malformed or truncated line
  is rejected with a reason and the rest of the body is kept.

Speed: a body repeats one label set per GPU on every metric line, so each distinct label text is
parsed once per body and its identity cached; metric names are resolved once per body too.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple, TypeVar, cast

from collectors.dcgm_fields import (
    DCGM_INT64_BLANK,
    SENTINELS,
    XID_COUNT_FIELD,
    XID_FIELD,
    derive_fields,
    field_name,
    field_range,
)
from collectors.exposition import (
    METRIC_TYPES,
    ExpositionError,
    parse_labels,
    parse_timestamp_ms,
    parse_value,
)
from collectors.xid import XidObservation
from contracts import GpuSample, NvSwitchSample, SeriesValue, gpu_key
from contracts.topics import gpu_id

_IDENTITY_LABELS = frozenset(
    {"UUID", "uuid", "Hostname", "hostname", "GPU_I_ID", "GPU_I_PROFILE", "gpu", "modelName", "nvswitch"}
)
"""Labels modelled as record fields (identity, index, model); every other label is kept."""
_SERIES_LABELS = frozenset({"err_code", "err_msg", "xid", "clock_event", "nvlink", "link"})
"""Labels that tell apart series of one metric on one GPU or switch: kept per series in
``field_series``, not as attributes of the whole GPU."""
_ATTRIBUTE_RENAMES = {"pod_name": "pod", "pod_namespace": "namespace", "container_name": "container"}
"""dcgm-exporter 1.x k8s label names → current ones."""
_MAX_DETAIL = 160
_GPU, _NVSWITCH = 0, 1


REJECTION_REASONS = frozenset(
    {
        "malformed_line",
        "truncated_line",
        "bad_labels",
        "duplicate_label",
        "bad_value",
        "bad_timestamp",
        "bad_type_line",
        "unknown_metric",
        "missing_uuid",
        "missing_host",
        "bad_gpu_instance_id",
        "duplicate_series",
        "invalid_sample",
        "sentinel",
        "not_a_number",
        "out_of_range",
    }
)
"""Every reason a :class:`Rejection` can carry."""


class Rejection(NamedTuple):
    """One input the parser refused.

    Attributes:
        reason: snake_case cause, the ``reason`` label of the rejection counter: line-level
            ``malformed_line``, ``truncated_line``, ``bad_labels``, ``duplicate_label``,
            ``bad_value``, ``bad_timestamp``, ``bad_type_line``, ``unknown_metric``,
            ``missing_uuid`` (no ``UUID``, no ``gpu`` index and no ``nvswitch`` label: nothing
            identifies the device), ``missing_host``, ``bad_gpu_instance_id``,
            ``duplicate_series`` (a second series of a field on one GPU with the same labels,
            whether its value is the same or not: the first is kept), ``invalid_sample``;
            value-level ``sentinel``, ``not_a_number``, ``out_of_range``.
        metric: the metric (or DCGM field) name, ``""`` when the line had none.
        detail: line number and the start of the line, or the offending value.
    """

    reason: str
    metric: str
    detail: str


@dataclass(slots=True)
class DcgmParseResult:
    """What one body yielded.

    Attributes:
        samples: one per ``(host, UUID[, GPU_I_ID])`` — or ``(host, gpu index[, GPU_I_ID])`` for
            series without a UUID — in order of first appearance, with ``seq`` numbered from
            ``seq_start``.
        switches: one per ``(host, nvswitch)``, numbered after the samples.
        rejected: every refused line and every invalid value (also in ``samples[i].invalid``).
        xid: one observation per GPU that reported ``DCGM_FI_DEV_XID_ERRORS`` or
            ``DCGM_EXP_XID_ERRORS_COUNT`` (see :class:`collectors.xid.XidTracker`).
        sample_lines: number of sample (non-comment, non-blank) lines read.
    """

    samples: list[GpuSample] = field(default_factory=list)
    switches: list[NvSwitchSample] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    xid: list[XidObservation] = field(default_factory=list)
    sample_lines: int = 0

    def rejected_by_reason(self) -> Counter[str]:
        """Count of :attr:`rejected` by reason."""
        return Counter(r.reason for r in self.rejected)


_Sig = tuple[tuple[str, str], ...]


class _Ident(NamedTuple):
    kind: int
    key: str
    host: str
    uuid: str | None
    gpu_index: int | None
    instance_id: int | None
    profile: str | None
    model: str | None
    attributes: dict[str, str]
    sig: _Sig
    per_series: bool
    err_msg: str | None
    xid: int | None


class _Acc:
    """Everything gathered for one GPU (or NVSwitch) identity while reading a body.

    ``fields`` holds each field's first series (the sum for windowed counts), ``sigs`` that
    series' labels when they are not ``base`` (the labels of the GPU's first label set, which
    most series share: the common case records nothing); ``series`` every series of a field
    split by a label (or carrying a per-series label), by labels.
    """

    __slots__ = (
        "attributes", "base", "fields", "ident", "invalid", "series", "sigs", "ts_ms", "xid_counts", "xid_msg",
    )  # fmt: skip

    def __init__(self, ident: _Ident) -> None:
        self.ident = ident
        self.base = ident.sig
        self.fields: dict[str, int | float] = {}
        self.sigs: dict[str, _Sig] = {}
        self.series: dict[str, dict[_Sig, int | float]] = {}
        self.invalid: dict[str, str] = {}
        self.attributes = dict(ident.attributes)
        self.ts_ms: int | None = None
        self.xid_msg: str | None = None
        self.xid_counts: dict[int, int] = {}


def _digits(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() else None


def _identity(label_text: str, default_host: str | None) -> _Ident | Rejection:
    """Resolve a label set to a GPU (or NVSwitch) identity, or say why it has none."""
    try:
        labels = parse_labels(label_text)
    except ExpositionError as e:
        return Rejection(e.reason, "", str(e)[:_MAX_DETAIL])
    host = labels.get("Hostname") or labels.get("hostname") or default_host
    uuid = labels.get("UUID") or labels.get("uuid") or None
    gpu_index = _digits(labels.get("gpu", ""))
    nvswitch = _digits(labels.get("nvswitch", ""))
    if uuid is None and gpu_index is None and nvswitch is None:
        return Rejection("missing_uuid", "", label_text[:_MAX_DETAIL])
    if not host:
        return Rejection("missing_host", "", label_text[:_MAX_DETAIL])
    gi_text = labels.get("GPU_I_ID")
    instance_id: int | None = None
    if gi_text:
        instance_id = _digits(gi_text)
        if instance_id is None:
            return Rejection("bad_gpu_instance_id", "", gi_text[:_MAX_DETAIL])
    own = {
        _ATTRIBUTE_RENAMES.get(k, k): v for k, v in labels.items() if v and k not in _IDENTITY_LABELS
    }
    per_series = not _SERIES_LABELS.isdisjoint(own)
    attributes = {k: v for k, v in own.items() if k not in _SERIES_LABELS} if per_series else own
    if uuid is None and gpu_index is None:  # an NVSwitch (or one of its links)
        kind, key = _NVSWITCH, f"{host}/nvswitch{nvswitch}"
        gpu_index = nvswitch
    else:
        kind, key = _GPU, gpu_key(host, gpu_id(uuid, gpu_index), instance_id)
    return _Ident(
        kind=kind,
        key=key,
        host=host,
        uuid=uuid,
        gpu_index=gpu_index,
        instance_id=instance_id,
        profile=labels.get("GPU_I_PROFILE") or None,
        model=labels.get("modelName") or None,
        attributes=attributes,
        sig=tuple(sorted(own.items())),
        per_series=per_series,
        err_msg=labels.get("err_msg") or None,
        xid=_digits(labels.get("xid", "")),
    )


_PLAIN, _COUNT, _XID_LAST, _XID_COUNT = 0, 1, 2, 3
"""How a field's series combine on one GPU: one value (a repeat must agree), windowed event
counts summed over their series (``DCGM_EXP_*_COUNT``), the last-XID gauge, the XID count."""


class _Metric(NamedTuple):
    field: str
    range: tuple[float, float] | None
    kind: int


@lru_cache(maxsize=4096)
def _metric(name: str) -> _Metric | None:
    """The DCGM field, value range and kind of a metric name; ``None`` if not a DCGM metric."""
    fname = field_name(name.strip(" \t"))
    if fname is None:
        return None
    if fname == XID_FIELD:
        kind = _XID_LAST
    elif fname == XID_COUNT_FIELD:
        kind = _XID_COUNT
    elif fname.startswith("DCGM_EXP_") and fname.endswith("_COUNT"):
        kind = _COUNT
    else:
        kind = _PLAIN
    return _Metric(fname, field_range(fname), kind)


def _classify(value: int | float, rng: tuple[float, float] | None) -> str | None:
    """``None`` for a valid value, else why it is invalid (``not_a_number``, ``sentinel``,
    ``out_of_range``)."""
    if value.__class__ is float:
        if math.isnan(value):
            return "not_a_number"
        if value == math.inf or value == -math.inf:
            return "out_of_range"
    if value in SENTINELS or value >= DCGM_INT64_BLANK:
        return "sentinel"
    if rng is not None and not rng[0] <= value <= rng[1]:
        return "out_of_range"
    return None


def parse_dcgm_exporter(
    body: str,
    *,
    ts: float,
    target: str = "",
    default_host: str | None = None,
    seq_start: int = 0,
) -> DcgmParseResult:
    """Parse one dcgm-exporter ``/metrics`` body.

    Args:
        body: the response text (Prometheus text format 0.0.4; see the module docstring).
        ts: scrape time, Unix seconds; a sample's ``ts`` is the newest exposition timestamp of
            its lines when they carry one, else this.
        target: the scrape target, copied into every sample.
        default_host: host for series without a ``Hostname``/``hostname`` label (e.g. the
            target's host name); without it such series are rejected as ``missing_host``.
        seq_start: ``seq`` of the first sample; the following ones count up by one.

    Returns:
        The samples, the rejections and the XID observations. Never raises on bad input: every
        line that cannot be used is a :class:`Rejection` and the rest is kept. A last line
        without its line feed was cut off (the format ends every line with one) and is rejected
        as ``truncated_line``.
    """
    result = DcgmParseResult()
    rejected = result.rejected
    accs: dict[str, _Acc] = {}
    series: dict[str, tuple[_Acc, _Ident, bool] | Rejection] = {}  # label text → its GPU, per body
    lines = body.split("\n")
    last = len(lines) - 1
    sample_lines = 0

    for index, line in enumerate(lines):
        if not line:
            continue
        if line[-1] == "\r":
            line = line[:-1]
        first = line[:1]
        if first == " " or first == "\t":
            line = line.strip()
            first = line[:1]
        if not first:
            continue
        if first == "#":
            if line.startswith("# TYPE"):
                _check_type_line(line, index + 1, rejected)
            continue
        sample_lines += 1
        if index == last:
            rejected.append(Rejection("truncated_line", "", f"line {index + 1}: {line[:_MAX_DETAIL]}"))
            continue
        try:
            # --- split ``name{labels} value [timestamp]``; label values may hold '}' but the
            # value and timestamp never do, so the last '}' closes the label set.
            brace = line.find("{")
            if brace >= 0:
                name = line[:brace]
                close = line.rfind("}")
                if close < brace:
                    rejected.append(
                        Rejection("bad_labels", name[:_MAX_DETAIL], f"line {index + 1}: no closing brace")
                    )
                    continue
                label_text = line[brace + 1 : close]
                tokens = line[close + 1 :].split()
            else:
                tokens = line.split()
                name = tokens.pop(0)
                label_text = ""
            metric = _metric(name)
            if metric is None:
                rejected.append(Rejection("unknown_metric", name[:_MAX_DETAIL], f"line {index + 1}"))
                continue
            if not 1 <= len(tokens) <= 2:
                rejected.append(
                    Rejection("malformed_line", metric.field, f"line {index + 1}: {line[:_MAX_DETAIL]}")
                )
                continue
            # --- the GPU this label set belongs to (resolved once per distinct label text)
            hit = series.get(label_text)
            if hit is None:
                hit = series[label_text] = _resolve(label_text, default_host, accs)
            if hit.__class__ is Rejection:
                rej: Rejection = hit
                rejected.append(Rejection(rej.reason, metric.field, f"line {index + 1}: {rej.detail}"))
                continue
            acc, ident, base = cast(tuple[_Acc, _Ident, bool], hit)  # not a Rejection (checked above)
            # --- value and optional timestamp
            vtext = tokens[0]
            value: int | float = int(vtext) if vtext.isdigit() and vtext.isascii() else parse_value(vtext)
            if len(tokens) == 2:
                ts_ms = parse_timestamp_ms(tokens[1])
                if acc.ts_ms is None or ts_ms > acc.ts_ms:
                    acc.ts_ms = ts_ms
            reason = _classify(value, metric.range)
            if reason is not None:
                rejected.append(Rejection(reason, metric.field, f"line {index + 1}: {vtext[:40]}"))
                if metric.field not in acc.fields:
                    acc.invalid[metric.field] = reason
                continue
            fname = metric.field
            fields = acc.fields
            if base and metric.kind == _PLAIN and fname not in fields:
                # the common case, inline: the first series of a plain field on this GPU, with
                # the GPU's base labels (so nothing to record in ``sigs``)
                fields[fname] = value
                if acc.invalid:
                    acc.invalid.pop(fname, None)
            else:
                _store(acc, ident.sig, ident.per_series, metric, value, f"line {index + 1}", rejected, ident)
        except ExpositionError as e:
            rejected.append(
                Rejection(e.reason, name[:_MAX_DETAIL], f"line {index + 1}: {str(e)[:_MAX_DETAIL]}")
            )
        except Exception as e:  # noqa: BLE001 — a bug on one line must not lose the rest of the body
            rejected.append(
                Rejection("malformed_line", "", f"line {index + 1}: {type(e).__name__}: {line[:80]}")
            )

    result.sample_lines = sample_lines
    _finish(result, accs, ts, target, seq_start)
    return result


def _check_type_line(line: str, lineno: int, rejected: list[Rejection]) -> None:
    """Reject a ``# TYPE`` line that is not ``# TYPE <name> <known type>`` (nothing else is lost)."""
    parts = line.split()
    if parts[1] == "TYPE" and (len(parts) != 4 or parts[3] not in METRIC_TYPES):
        rejected.append(
            Rejection(
                "bad_type_line",
                parts[2][:_MAX_DETAIL] if len(parts) > 2 else "",
                f"line {lineno}: {line[:_MAX_DETAIL]}",
            )
        )


def _resolve(
    label_text: str, default_host: str | None, accs: dict[str, _Acc]
) -> tuple[_Acc, _Ident, bool] | Rejection:
    """The accumulator of the GPU a label set names (created on first sight) and whether the set
    has the GPU's base labels and no per-series label (its plain fields take the fast path), or
    a rejection."""
    ident = _identity(label_text, default_host)
    if ident.__class__ is Rejection:
        return ident
    idt: _Ident = ident  # type: ignore[assignment]
    acc = accs.get(idt.key)
    if acc is None:
        acc = accs[idt.key] = _Acc(idt)
    else:  # another label set of a GPU already seen (pod labels on some series, XID labels...)
        for k, v in idt.attributes.items():
            acc.attributes.setdefault(k, v)
    return acc, idt, not idt.per_series and idt.sig == acc.base


def _store(
    acc: _Acc,
    sig: _Sig,
    per_series: bool,
    metric: _Metric,
    value: int | float,
    where: str,
    rejected: list[Rejection],
    ident: _Ident | None = None,
) -> None:
    """Put one valid series value into its GPU's fields (and ``series`` when the field is split).

    A series whose labels (``sig``) the field already has on this GPU is a duplicate, with the
    same value or not: counted, the first kept. A series with other labels is one more
    observation of a split field: plain fields keep their first value in ``fields``, windowed
    counts (``DCGM_EXP_*_COUNT``) add up.
    """
    fname = metric.field
    fields = acc.fields
    adds = metric.kind == _COUNT or metric.kind == _XID_COUNT
    if fname not in fields:
        fields[fname] = value
        if sig != acc.base:
            acc.sigs[fname] = sig
        if per_series:
            acc.series[fname] = {sig: value}
        if metric.kind == _XID_LAST and ident is not None:
            acc.xid_msg = ident.err_msg
    else:
        split = acc.series.get(fname)
        if split is None:  # one series so far: its labels and value (or count)
            split = {acc.sigs.get(fname, acc.base): fields[fname]}
        if sig in split:
            old = split[sig]
            what = "repeats it" if old == value else f"has {old!r}, dropped {value!r}"
            rejected.append(Rejection("duplicate_series", fname, f"{where}: {acc.ident.key} {what}"))
            return
        acc.series[fname] = split
        split[sig] = value
        if adds:
            fields[fname] = fields[fname] + value
    if metric.kind == _XID_COUNT and ident is not None and ident.xid is not None:
        acc.xid_counts[ident.xid] = acc.xid_counts.get(ident.xid, 0) + int(value)
    if acc.invalid:
        acc.invalid.pop(fname, None)


def _merge_indexed(accs: dict[str, _Acc], rejected: list[Rejection]) -> list[_Acc]:
    """Fold each GPU known only by its index (series without a UUID) into the GPU of the same
    host, index and instance that has a UUID in this body, when there is exactly one; the rest
    stay GPUs of their own (keyed ``host/gpu<index>``)."""
    by_slot: dict[tuple[str, int | None, int | None], list[_Acc]] = {}
    for acc in accs.values():
        i = acc.ident
        if i.kind == _GPU and i.uuid is not None:
            by_slot.setdefault((i.host, i.gpu_index, i.instance_id), []).append(acc)
    out: list[_Acc] = []
    for acc in accs.values():
        i = acc.ident
        targets = by_slot.get((i.host, i.gpu_index, i.instance_id)) if i.kind == _GPU and i.uuid is None else None
        if not targets or len(targets) != 1:
            out.append(acc)
            continue
        target = targets[0]
        for fname, value in acc.fields.items():
            metric = _metric(fname)
            assert metric is not None
            series = acc.series.get(fname) or {acc.sigs.get(fname, acc.base): value}
            for sig, v in series.items():
                _store(target, sig, fname in acc.series, metric, v, i.key, rejected)
        for fname, reason in acc.invalid.items():
            if fname not in target.fields:
                target.invalid.setdefault(fname, reason)
        for label, text in acc.attributes.items():
            target.attributes.setdefault(label, text)
        for xid, n in acc.xid_counts.items():
            target.xid_counts[xid] = target.xid_counts.get(xid, 0) + n
        target.xid_msg = target.xid_msg or acc.xid_msg
        if acc.ts_ms is not None and (target.ts_ms is None or acc.ts_ms > target.ts_ms):
            target.ts_ms = acc.ts_ms
    return out


def _field_series(acc: _Acc) -> dict[str, list[SeriesValue]]:
    return {
        fname: [SeriesValue(labels=dict(sig), value=v) for sig, v in split.items()]
        for fname, split in acc.series.items()
    }


_R = TypeVar("_R")


def _built(result: DcgmParseResult, key: str, make: Callable[[], _R]) -> _R | None:
    """``make()``, or ``None`` with an ``invalid_sample`` rejection when the record refuses it."""
    try:
        return make()
    except ValueError as e:  # pydantic.ValidationError is a ValueError
        result.rejected.append(Rejection("invalid_sample", "", f"{key}: {str(e)[:_MAX_DETAIL]}"))
        return None


def _finish(result: DcgmParseResult, accs: dict[str, _Acc], ts: float, target: str, seq_start: int) -> None:
    """Turn the accumulators into samples (numbered from ``seq_start``), switch samples (numbered
    after them) and XID observations."""
    seq = seq_start
    switches: list[_Acc] = []
    for acc in _merge_indexed(accs, result.rejected):
        ident = acc.ident
        if ident.kind == _NVSWITCH:
            switches.append(acc)
            continue
        sample_ts = acc.ts_ms / 1000.0 if acc.ts_ms is not None else ts
        derive_fields(acc.fields, acc.invalid)
        sample = _built(
            result,
            ident.key,
            functools.partial(
                GpuSample,
                ts=sample_ts,
                host=ident.host,
                gpu_uuid=ident.uuid,
                gpu_index=ident.gpu_index,
                gpu_instance_id=ident.instance_id,
                gpu_instance_profile=ident.profile,
                model_name=ident.model,
                fields=acc.fields,
                field_series=_field_series(acc) if acc.series else {},
                invalid=acc.invalid,
                attributes=acc.attributes,
                source="dcgm-exporter",
                target=target,
                seq=seq,
            ),
        )
        if sample is None:
            continue
        seq += 1
        result.samples.append(sample)
        last = acc.fields.get(XID_FIELD)
        if last is not None or acc.xid_counts:
            last_xid = int(last) if last is not None and float(last).is_integer() else None
            split = acc.series.get(XID_FIELD)
            codes = (
                tuple(int(v) for v in split.values() if float(v).is_integer())
                if split is not None and len(split) > 1
                else ()
            )
            result.xid.append(
                XidObservation(ident.key, sample_ts, last_xid, acc.xid_msg, dict(acc.xid_counts), codes)
            )
    for acc in switches:
        ident = acc.ident
        assert ident.gpu_index is not None  # an NVSwitch identity always has its index
        switch = _built(
            result,
            ident.key,
            functools.partial(
                NvSwitchSample,
                ts=acc.ts_ms / 1000.0 if acc.ts_ms is not None else ts,
                host=ident.host,
                nvswitch=ident.gpu_index,
                fields=acc.fields,
                field_series=_field_series(acc) if acc.series else {},
                invalid=acc.invalid,
                attributes=acc.attributes,
                target=target,
                seq=seq,
            ),
        )
        if switch is None:
            continue
        seq += 1
        result.switches.append(switch)
