"""``dcgmi dmon -e <field ids>`` text → one :class:`contracts.GpuSample` per GPU.

Format: NVIDIA DCGM, ``dcgmi dmon`` reference and user guide: a header ``# Entity`` (or
``#Entity``) followed by each field's short column name, a line ``ID`` (or ``Id``) with the
units, then one row per entity and sample, ``GPU <gpu id>`` followed by one value per column
(``N/A`` for a blank value); the header repeats every few rows. Short names are DCGM's
(``dcgm_field_output_format_t.shortName``; :data:`SHORT_NAMES`). When the command's ``-e`` list
is given (:func:`field_ids`), the columns are those ids in order and the header names are not
needed.

dmon has no UUID: a GPU is ``host`` + its DCGM GPU id (``gpu_index``), keyed ``host/gpu<id>``.
With ``--count N`` a GPU has several rows: the last one is the sample (the newest reading).
Rows of other entities (``Switch``, ``GPU-I``, ``Link``...) are rejected (``unsupported_entity``),
a row with another number of values than columns ``malformed_line``, a value that is not a number
``not_a_number``, one out of the field's range ``out_of_range``
(:func:`collectors.nvsmi.check_value`). An ``Error: ...`` line (the host engine went away) ends
nothing: rows before it are kept, and it is a rejection (``dcgmi_error``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from collectors.dcgm import Rejection
from collectors.dcgm_fields import derive_fields
from collectors.nvsmi import NvsmiParseResult, check_value
from contracts import GpuSample

__all__ = ["FIELD_IDS", "SHORT_NAMES", "field_ids", "parse_dcgmi_dmon"]

_MAX_DETAIL = 160

FIELD_IDS: dict[int, str] = {
    100: "DCGM_FI_DEV_SM_CLOCK",
    101: "DCGM_FI_DEV_MEM_CLOCK",
    140: "DCGM_FI_DEV_MEMORY_TEMP",
    150: "DCGM_FI_DEV_GPU_TEMP",
    155: "DCGM_FI_DEV_POWER_USAGE",
    203: "DCGM_FI_DEV_GPU_UTIL",
    204: "DCGM_FI_DEV_MEM_COPY_UTIL",
    250: "DCGM_FI_DEV_FB_TOTAL",
    251: "DCGM_FI_DEV_FB_FREE",
    252: "DCGM_FI_DEV_FB_USED",
    1001: "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    1002: "DCGM_FI_PROF_SM_ACTIVE",
    1003: "DCGM_FI_PROF_SM_OCCUPANCY",
    1004: "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    1005: "DCGM_FI_PROF_DRAM_ACTIVE",
    1006: "DCGM_FI_PROF_PIPE_FP64_ACTIVE",
    1007: "DCGM_FI_PROF_PIPE_FP32_ACTIVE",
    1008: "DCGM_FI_PROF_PIPE_FP16_ACTIVE",
    1009: "DCGM_FI_PROF_PCIE_TX_BYTES",
    1010: "DCGM_FI_PROF_PCIE_RX_BYTES",
    1011: "DCGM_FI_PROF_NVLINK_TX_BYTES",
    1012: "DCGM_FI_PROF_NVLINK_RX_BYTES",
}
"""DCGM field id (``dcgm_fields.h``) → field name, for the ids :data:`SHORT_NAMES` covers."""

SHORT_NAMES: dict[str, str] = {
    "SMCLK": "DCGM_FI_DEV_SM_CLOCK",
    "MMCLK": "DCGM_FI_DEV_MEM_CLOCK",
    "MMTMP": "DCGM_FI_DEV_MEMORY_TEMP",
    "GTEMP": "DCGM_FI_DEV_GPU_TEMP",
    "POWER": "DCGM_FI_DEV_POWER_USAGE",
    "GPUTL": "DCGM_FI_DEV_GPU_UTIL",
    "MCUTL": "DCGM_FI_DEV_MEM_COPY_UTIL",
    "FBTTL": "DCGM_FI_DEV_FB_TOTAL",
    "FBFRE": "DCGM_FI_DEV_FB_FREE",
    "FBUSD": "DCGM_FI_DEV_FB_USED",
    "GRACT": "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "SMACT": "DCGM_FI_PROF_SM_ACTIVE",
    "SMOCC": "DCGM_FI_PROF_SM_OCCUPANCY",
    "TENSO": "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    "DRAMA": "DCGM_FI_PROF_DRAM_ACTIVE",
    "FP64A": "DCGM_FI_PROF_PIPE_FP64_ACTIVE",
    "FP32A": "DCGM_FI_PROF_PIPE_FP32_ACTIVE",
    "FP16A": "DCGM_FI_PROF_PIPE_FP16_ACTIVE",
    "PCITX": "DCGM_FI_PROF_PCIE_TX_BYTES",
    "PCIRX": "DCGM_FI_PROF_PCIE_RX_BYTES",
    "NVLTX": "DCGM_FI_PROF_NVLINK_TX_BYTES",
    "NVLRX": "DCGM_FI_PROF_NVLINK_RX_BYTES",
}
"""dmon column short name → DCGM field name."""


def field_ids(cmd: Sequence[str]) -> list[int] | None:
    """The ``-e 1001,1004`` (``--field-id``) list of a ``dcgmi dmon`` command line, or ``None``."""
    for i, arg in enumerate(cmd):
        text = None
        if arg in ("-e", "--field-id") and i + 1 < len(cmd):
            text = cmd[i + 1]
        elif arg.startswith("--field-id="):
            text = arg.split("=", 1)[1]
        if text is not None:
            parts = [p.strip() for p in text.split(",")]
            if all(p.isascii() and p.isdigit() for p in parts):
                return [int(p) for p in parts]
    return None


@dataclass(slots=True)
class _Row:
    lineno: int
    values: dict[str, int | float] = field(default_factory=dict)
    invalid: dict[str, str] = field(default_factory=dict)


def _number(text: str) -> int | float | None:
    if text.isascii() and text.isdigit():
        return int(text)
    try:
        value = float(text)
    except ValueError:
        return None
    return value


def parse_dcgmi_dmon(
    text: str,
    *,
    host: str,
    ts: float,
    ids: Sequence[int] | None = None,
    target: str = "dcgmi dmon",
    seq_start: int = 0,
) -> NvsmiParseResult:
    """Parse ``dcgmi dmon`` output (module docstring); never raises on bad input.

    Args:
        text: the command's output (stdout, stderr may follow).
        host: host name of every sample.
        ts: read time, Unix seconds.
        ids: the ``-e`` field ids (:func:`field_ids`), in column order; else the header's short
            names are used.
        target: copied into ``GpuSample.target``.
        seq_start: ``seq`` of the first sample.

    Returns:
        An :class:`collectors.nvsmi.NvsmiParseResult` (``error`` ``empty_output`` or
        ``no_header`` when nothing could be read).
    """
    result = NvsmiParseResult()
    if not text.strip():
        result.error = "empty_output"
        return result
    by_id = [FIELD_IDS.get(i) for i in ids] if ids else None
    columns: list[str | None] | None = by_id
    rows: dict[int, _Row] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            names = line.lstrip("#").split()
            if names and names[0].lower() == "entity":
                columns = by_id if by_id is not None else [SHORT_NAMES.get(n) for n in names[1:]]
            continue
        tokens = line.split()
        if tokens[0].lower() == "id":
            continue
        if tokens[0].startswith("Error"):
            result.rejected.append(Rejection("dcgmi_error", "", f"line {lineno}: {line[:_MAX_DETAIL]}"))
            continue
        if tokens[0] != "GPU" or len(tokens) < 2 or not (tokens[1].isascii() and tokens[1].isdigit()):
            reason = "unsupported_entity" if tokens[0] in ("GPU-I", "GPU-CI", "Switch", "Link", "CPU") else "malformed_line"
            result.rejected.append(Rejection(reason, "", f"line {lineno}: {line[:_MAX_DETAIL]}"))
            continue
        if columns is None:
            result.rejected.append(Rejection("malformed_line", "", f"line {lineno}: a row before any header"))
            continue
        cells = tokens[2:]
        if len(cells) != len(columns):
            result.rejected.append(
                Rejection("malformed_line", "", f"line {lineno}: {len(cells)} values for {len(columns)} columns")
            )
            continue
        row = _Row(lineno)
        for column, cell in zip(columns, cells, strict=True):
            if column is None or cell.upper() == "N/A":
                continue
            value = _number(cell)
            problem = "not_a_number" if value is None else check_value(column, value)
            if problem is None and value is not None:
                row.values[column] = value
            else:
                row.invalid[column] = problem or "not_a_number"
                result.rejected.append(Rejection(row.invalid[column], column, f"line {lineno}: {cell[:40]}"))
        rows[int(tokens[1])] = row  # the newest row of a GPU is its sample
    if columns is None and not rows:
        result.error, result.detail = "no_header", "no '# Entity' header line"
        return result
    for i, (gpu, row) in enumerate(rows.items()):
        derive_fields(row.values, row.invalid)
        result.samples.append(
            GpuSample(
                ts=ts,
                host=host,
                gpu_index=gpu,
                fields=row.values,
                invalid=row.invalid,
                source="dcgmi",
                target=target,
                seq=seq_start + i,
            )
        )
    return result
