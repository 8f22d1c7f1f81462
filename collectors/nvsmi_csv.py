"""``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]`` → :class:`contracts.GpuSample`.

Format: nvidia-smi(1), "--query-gpu" and "--format=csv" (``nvidia-smi --help-query-gpu`` lists the
properties): one line per GPU, values in the order of the query, separated by ``", "``; a header
line of the property names with their unit in brackets (``utilization.gpu [%]``) unless
``noheader``; values with their unit (``45 %``, ``1032 MiB``, ``67.03 W``, ``1410 MHz``) unless
``nounits``. A value nvidia-smi cannot give is ``[N/A]`` or ``[Not Supported]`` (absent, as in the
XML reader), ``[Unknown Error]``, ``[Insufficient Permissions]``, ``[GPU requires reset]``
(invalid, with the XML reader's reasons: :func:`collectors.nvsmi.parse_value_text`).

Each property is mapped to the DCGM field of the same quantity (:data:`QUERY_FIELDS`, the same
vocabulary as :mod:`collectors.nvsmi`); ``index``, ``uuid``, ``name`` give the identity
(a GPU with neither a UUID nor an index is rejected: ``missing_uuid``); every other property
(``pci.bus_id``, ``driver_version``, ``serial``...) is kept in ``attributes`` under its query
name. Without a header the property names come from the command's ``--query-gpu=`` list
(:func:`query_properties`); with one, from the header. A line with another number of values than
properties is rejected alone (``malformed_line``).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence

from collectors.dcgm import Rejection
from collectors.dcgm_fields import derive_fields
from collectors.nvsmi import FieldSpec, NvsmiParseResult, parse_value_text
from contracts import GpuSample

__all__ = ["QUERY_FIELDS", "is_csv_query", "parse_nvidia_smi_csv", "query_properties"]

_MAX_DETAIL = 160

QUERY_FIELDS: dict[str, FieldSpec] = {
    spec.paths[0]: spec
    for spec in (
        FieldSpec("DCGM_FI_DEV_GPU_UTIL", ("utilization.gpu",), "%"),
        FieldSpec("DCGM_FI_DEV_MEM_COPY_UTIL", ("utilization.memory",), "%"),
        FieldSpec("DCGM_FI_DEV_ENC_UTIL", ("utilization.encoder",), "%"),
        FieldSpec("DCGM_FI_DEV_DEC_UTIL", ("utilization.decoder",), "%"),
        FieldSpec("DCGM_FI_DEV_FB_TOTAL", ("memory.total",), "MiB"),
        FieldSpec("DCGM_FI_DEV_FB_USED", ("memory.used",), "MiB"),
        FieldSpec("DCGM_FI_DEV_FB_FREE", ("memory.free",), "MiB"),
        FieldSpec("DCGM_FI_DEV_FB_RESERVED", ("memory.reserved",), "MiB"),
        FieldSpec("DCGM_FI_DEV_GPU_TEMP", ("temperature.gpu",), ""),
        FieldSpec("DCGM_FI_DEV_MEMORY_TEMP", ("temperature.memory",), ""),
        FieldSpec("DCGM_FI_DEV_POWER_USAGE", ("power.draw",), "W"),
        FieldSpec("DCGM_FI_DEV_POWER_USAGE", ("power.draw.average",), "W"),
        FieldSpec("DCGM_FI_DEV_POWER_USAGE_INSTANT", ("power.draw.instant",), "W"),
        FieldSpec("DCGM_FI_DEV_POWER_MGMT_LIMIT", ("power.limit",), "W"),
        FieldSpec("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", ("enforced.power.limit",), "W"),
        FieldSpec("DCGM_FI_DEV_SM_CLOCK", ("clocks.current.sm",), "MHz"),
        FieldSpec("DCGM_FI_DEV_MEM_CLOCK", ("clocks.current.memory",), "MHz"),
        FieldSpec("DCGM_FI_DEV_VIDEO_CLOCK", ("clocks.current.video",), "MHz"),
        FieldSpec("DCGM_FI_DEV_MAX_SM_CLOCK", ("clocks.max.sm",), "MHz"),
        FieldSpec("DCGM_FI_DEV_MAX_MEM_CLOCK", ("clocks.max.memory",), "MHz"),
        FieldSpec("DCGM_FI_DEV_FAN_SPEED", ("fan.speed",), "%"),
        FieldSpec("DCGM_FI_DEV_PSTATE", ("pstate",), "", "pstate"),
        FieldSpec("DCGM_FI_DEV_PCIE_LINK_GEN", ("pcie.link.gen.current",), ""),
        FieldSpec("DCGM_FI_DEV_PCIE_MAX_LINK_GEN", ("pcie.link.gen.max",), ""),
        FieldSpec("DCGM_FI_DEV_PCIE_LINK_WIDTH", ("pcie.link.width.current",), ""),
        FieldSpec("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", ("pcie.link.width.max",), ""),
        FieldSpec("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", ("ecc.errors.corrected.volatile.total",), ""),
        FieldSpec("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", ("ecc.errors.uncorrected.volatile.total",), ""),
        FieldSpec("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", ("ecc.errors.corrected.aggregate.total",), ""),
        FieldSpec("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", ("ecc.errors.uncorrected.aggregate.total",), ""),
    )
}
"""``--query-gpu`` property → the DCGM field it fills, its unit and kind."""

ALIASES: dict[str, str] = {
    "gpu_uuid": "uuid",
    "gpu_name": "name",
    "gpu_bus_id": "pci.bus_id",
    "clocks.sm": "clocks.current.sm",
    "clocks.mem": "clocks.current.memory",
    "clocks.video": "clocks.current.video",
    "clocks.max.mem": "clocks.max.memory",
}
"""nvidia-smi's alternative property names (``--help-query-gpu``) → the canonical ones."""


def _canonical(header: str) -> str:
    """``utilization.gpu [%]`` → ``utilization.gpu``; aliases resolved."""
    name = header.split("[", 1)[0].strip()
    return ALIASES.get(name, name)


def query_properties(cmd: Sequence[str]) -> list[str] | None:
    """The property list of a ``--query-gpu=a,b`` (or ``--query-gpu a,b``) argument in ``cmd``,
    canonical names; ``None`` when there is none."""
    for i, arg in enumerate(cmd):
        if arg.startswith("--query-gpu="):
            text = arg.split("=", 1)[1]
        elif arg == "--query-gpu" and i + 1 < len(cmd):
            text = cmd[i + 1]
        else:
            continue
        return [_canonical(p) for p in text.split(",") if p.strip()]
    return None


def is_csv_query(cmd: Sequence[str]) -> bool:
    """True when ``cmd`` runs an nvidia-smi ``--query-gpu`` (CSV) query rather than ``-q -x``."""
    return query_properties(cmd) is not None


def _identity_int(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() else None


def parse_nvidia_smi_csv(
    text: str,
    *,
    host: str,
    ts: float,
    properties: Sequence[str] | None = None,
    target: str = "nvidia-smi",
    seq_start: int = 0,
) -> NvsmiParseResult:
    """Parse ``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]`` output.

    Args:
        text: the command's standard output.
        host: host name of every sample.
        ts: read time, Unix seconds.
        properties: the ``--query-gpu`` list (:func:`query_properties`); needed for
            ``noheader`` output. When the first line is a header it wins.
        target: copied into ``GpuSample.target``.
        seq_start: ``seq`` of the first sample.

    Returns:
        An :class:`collectors.nvsmi.NvsmiParseResult`; ``error`` is ``no_properties`` when
        there is neither a header nor a property list, ``empty_output`` for no line at all.
        Never raises on bad input.
    """
    result = NvsmiParseResult()
    rows = [r for r in csv.reader(text.splitlines(), skipinitialspace=True) if r and any(c.strip() for c in r)]
    if not rows:
        result.error, result.detail = "empty_output", ""
        return result
    names = [_canonical(c) for c in rows[0]]
    known = set(QUERY_FIELDS) | {"index", "uuid", "name"}
    looks_header = any("[" in c for c in rows[0]) or (
        properties is not None and len(properties) > 0 and names == list(properties)
    ) or (not properties and bool(set(names) & known))
    if looks_header:
        rows = rows[1:]
    elif properties:
        names = list(properties)
    else:
        result.error, result.detail = "no_properties", "noheader output needs the --query-gpu list"
        return result
    seq = seq_start
    for n, row in enumerate(rows, 2 if looks_header else 1):
        where = f"line {n}"
        if len(row) != len(names):
            result.rejected.append(Rejection("malformed_line", "", f"{where}: {len(row)} values for {len(names)} properties"))
            continue
        values = {name: cell.strip() for name, cell in zip(names, row, strict=True)}
        uuid = values.get("uuid", "")
        index = _identity_int(values.get("index", ""))
        if not uuid.startswith(("GPU-", "MIG-")):
            uuid = ""
        if not uuid and index is None:
            result.rejected.append(Rejection("missing_uuid", "", f"{where}: {','.join(row)[:_MAX_DETAIL]}"))
            continue
        fields: dict[str, int | float] = {}
        invalid: dict[str, str] = {}
        attributes: dict[str, str] = {}
        for name, cell in values.items():
            spec = QUERY_FIELDS.get(name)
            if spec is None:
                if name not in ("index", "uuid", "name") and cell and cell.strip("[]").lower() != "n/a":
                    attributes[name] = cell
                continue
            value, reason = parse_value_text(cell, spec)
            if reason == "not_a_number" and spec.unit:  # nounits: the number alone
                value, reason = parse_value_text(cell, spec._replace(unit=""))
            if value is not None:
                fields[spec.field] = value
                invalid.pop(spec.field, None)
            elif reason is not None and spec.field not in fields:
                invalid[spec.field] = reason
                result.rejected.append(Rejection(reason, spec.field, f"{where}: {cell[:_MAX_DETAIL]}"))
        derive_fields(fields, invalid)
        model = values.get("name", "")
        result.samples.append(
            GpuSample(
                ts=ts,
                host=host,
                gpu_uuid=uuid or None,
                gpu_index=index,
                model_name=model if model and model.strip("[]").lower() != "n/a" else None,
                fields=fields,
                invalid=invalid,
                attributes=attributes,
                source="nvidia-smi",
                target=target,
                seq=seq,
            )
        )
        seq += 1
    return result
