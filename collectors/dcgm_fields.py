"""DCGM vocabulary: blank/not-supported sentinels, 1.x metric names, value ranges.

Sources:

* sentinels — NVIDIA DCGM ``dcgmlib/dcgm_structs.h`` (``DCGM_INT32_BLANK 0x7ffffff0``,
  ``DCGM_INT64_BLANK 0x7ffffffffffffff0``, ``DCGM_FP64_BLANK 140737488355328.0`` = 2**47, each
  followed by ``_NOT_FOUND`` (+1), ``_NOT_SUPPORTED`` (+2) and ``_NOT_PERMISSIONED`` (+3)).
  dcgm-exporter drops exactly these twelve values before exporting (``isBlankValue``), so a
  sentinel that reaches a ``/metrics`` body comes from an exporter version that did not.
* 1.x names — NVIDIA go-dcgm ``pkg/dcgm/legacy_fields.csv`` (legacy name → field id) with the
  ids resolved through ``dcgm_fields.h``; the same names are dcgm-exporter's
  ``etc/1.x-compatibility-metrics.csv``.
* ranges — the units stated in ``dcgm_fields.h``: ``*_UTIL`` are percent (0..100), the
  profiling ``DCGM_FI_PROF_*_ACTIVE`` / ``*_OCCUPANCY`` fields are ratios (0..1),
  ``DCGM_FI_DEV_FB_USED_PERCENT`` is "Range 0.0-1.0", counters and sizes are non-negative.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

DCGM_INT32_BLANK = 0x7FFFFFF0
"""Base of the int32 blank family; ``+1`` not found, ``+2`` not supported, ``+3`` not permissioned."""
DCGM_INT64_BLANK = 0x7FFFFFFFFFFFFFF0
"""Base of the int64 blank family; ``DCGM_INT64_IS_BLANK(v)`` is ``v >= DCGM_INT64_BLANK``."""
DCGM_FP64_BLANK = 140737488355328.0
"""Base of the fp64 blank family (2**47)."""

_FAMILY_OFFSETS = (0, 1, 2, 3)  # BLANK, NOT_FOUND, NOT_SUPPORTED, NOT_PERMISSIONED

SENTINELS: frozenset[int] = frozenset(
    [DCGM_INT32_BLANK + k for k in _FAMILY_OFFSETS]
    + [DCGM_INT64_BLANK + k for k in _FAMILY_OFFSETS]
    + [int(DCGM_FP64_BLANK) + k for k in _FAMILY_OFFSETS]
)
"""The twelve exact sentinel values. Stored as ``int``: an ``int`` or a ``float`` value is
tested with ``value in SENTINELS`` (Python compares 2147483634 and 2147483634.0 as equal and
hashes them alike; every fp64 sentinel is an integer-valued float)."""


def is_sentinel(value: int | float) -> bool:
    """True if ``value`` is a DCGM blank / not-found / not-supported / not-permissioned value.

    That is one of :data:`SENTINELS`, or anything ``>= DCGM_INT64_BLANK`` (DCGM's own
    ``DCGM_INT64_IS_BLANK``; no real int64 field reaches it, and a float that rounded an int64
    sentinel to 2**63 lands here too). Meant for finite values: ``NaN`` is not a sentinel, and
    ``+Inf`` compares above every bound, so callers classify non-finite values first.
    """
    return value in SENTINELS or value >= DCGM_INT64_BLANK


# go-dcgm legacy_fields.csv (name → id), ids resolved to their dcgm_fields.h names.
LEGACY_NAMES: dict[str, str] = {
    "dcgm_sm_clock": "DCGM_FI_DEV_SM_CLOCK",  # 100
    "dcgm_memory_clock": "DCGM_FI_DEV_MEM_CLOCK",  # 101
    "dcgm_memory_temp": "DCGM_FI_DEV_MEMORY_TEMP",  # 140
    "dcgm_gpu_temp": "DCGM_FI_DEV_GPU_TEMP",  # 150
    "dcgm_power_usage": "DCGM_FI_DEV_POWER_USAGE",  # 155
    "dcgm_total_energy_consumption": "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",  # 156
    "dcgm_pcie_tx_throughput": "DCGM_FI_DEV_PCIE_TX_THROUGHPUT",  # 200
    "dcgm_pcie_rx_throughput": "DCGM_FI_DEV_PCIE_RX_THROUGHPUT",  # 201
    "dcgm_pcie_replay_counter": "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",  # 202
    "dcgm_gpu_utilization": "DCGM_FI_DEV_GPU_UTIL",  # 203
    "dcgm_mem_copy_utilization": "DCGM_FI_DEV_MEM_COPY_UTIL",  # 204
    "dcgm_enc_utilization": "DCGM_FI_DEV_ENC_UTIL",  # 206
    "dcgm_dec_utilization": "DCGM_FI_DEV_DEC_UTIL",  # 207
    "dcgm_xid_errors": "DCGM_FI_DEV_XID_ERRORS",  # 230
    "dcgm_power_violation": "DCGM_FI_DEV_POWER_VIOLATION",  # 240
    "dcgm_thermal_violation": "DCGM_FI_DEV_THERMAL_VIOLATION",  # 241
    "dcgm_sync_boost_violation": "DCGM_FI_DEV_SYNC_BOOST_VIOLATION",  # 242
    "dcgm_board_limit_violation": "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION",  # 243
    "dcgm_low_util_violation": "DCGM_FI_DEV_LOW_UTIL_VIOLATION",  # 244
    "dcgm_reliability_violation": "DCGM_FI_DEV_RELIABILITY_VIOLATION",  # 245
    "dcgm_fb_free": "DCGM_FI_DEV_FB_FREE",  # 251
    "dcgm_fb_used": "DCGM_FI_DEV_FB_USED",  # 252
    "dcgm_ecc_sbe_volatile_total": "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",  # 310
    "dcgm_ecc_dbe_volatile_total": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",  # 311
    "dcgm_ecc_sbe_aggregate_total": "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",  # 312
    "dcgm_ecc_dbe_aggregate_total": "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",  # 313
    "dcgm_retired_pages_sbe": "DCGM_FI_DEV_RETIRED_SBE",  # 390
    "dcgm_retired_pages_dbe": "DCGM_FI_DEV_RETIRED_DBE",  # 391
    "dcgm_retired_pages_pending": "DCGM_FI_DEV_RETIRED_PENDING",  # 392
    "dcgm_nvlink_flit_crc_error_count_total": "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",  # 409
    "dcgm_nvlink_data_crc_error_count_total": "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",  # 419
    "dcgm_nvlink_replay_error_count_total": "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",  # 429
    "dcgm_nvlink_recovery_error_count_total": "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",  # 439
    "dcgm_nvlink_bandwidth_total": "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",  # 449
}
"""dcgm-exporter 1.x metric names (``--use-old-namespace``) → DCGM field names. The old
``dcgm_fi_prof_*`` names are the field names in lower case and are mapped by upper-casing."""

XID_FIELD = "DCGM_FI_DEV_XID_ERRORS"
"""The last XID error code seen on the GPU (a gauge holding a code, not a count)."""
XID_COUNT_FIELD = "DCGM_EXP_XID_ERRORS_COUNT"
"""dcgm-exporter's own windowed XID count, one series per ``xid`` label."""

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_PERCENT = (0.0, 100.0)
_RATIO = (0.0, 1.0)
_NON_NEGATIVE = (0.0, math.inf)


@lru_cache(maxsize=4096)
def field_name(metric: str) -> str | None:
    """The DCGM field name a metric name stands for, or ``None`` if it is not a DCGM metric.

    ``DCGM_FI_*`` and dcgm-exporter's own ``DCGM_EXP_*`` names are kept; ``dcgm_fi_*`` (1.x
    lower case) is upper-cased; other 1.x names go through :data:`LEGACY_NAMES`. A name that is
    not a valid Prometheus metric name is never a DCGM field.
    """
    if not _METRIC_NAME.match(metric):
        return None
    if metric.startswith(("DCGM_FI_", "DCGM_EXP_")):
        return metric
    if metric.startswith("dcgm_fi_"):
        return metric.upper()
    return LEGACY_NAMES.get(metric)


@lru_cache(maxsize=4096)
def field_range(field: str) -> tuple[float, float] | None:
    """Inclusive ``(low, high)`` bounds of a valid value of ``field``, or ``None`` if unchecked.

    Percent fields (``*_UTIL``) are 0..100; profiling ratios (``DCGM_FI_PROF_*_ACTIVE``,
    ``*_OCCUPANCY``) and ``DCGM_FI_DEV_FB_USED_PERCENT`` are 0..1; temperatures 0..200 C;
    power 0..10000 W; sizes, clocks, counters and byte rates are non-negative. Any value
    outside is a faulty reading (GPU-03: ``GPU_UTIL`` of 4294967295 or 1k..200k).
    """
    if field.endswith("_UTIL"):
        return _PERCENT
    if field.startswith("DCGM_FI_PROF_") and field.endswith(("_ACTIVE", "_OCCUPANCY")):
        return _RATIO
    if field == "DCGM_FI_DEV_FB_USED_PERCENT":
        return _RATIO
    if field.endswith("_TEMP"):
        return (0.0, 200.0)
    if field in ("DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_POWER_USAGE_INSTANT"):
        return (0.0, 10000.0)
    if (
        field.startswith(("DCGM_FI_DEV_FB_", "DCGM_FI_DEV_RETIRED_", "DCGM_FI_DEV_ECC_"))
        or field.endswith(
            (
                "_CLOCK",
                "_TOTAL",
                "_COUNTER",
                "_COUNT",
                "_VIOLATION",
                "_BYTES",
                "_ENERGY_CONSUMPTION",
                "_REMAPPED_ROWS",
                "_THROUGHPUT",
            )
        )
        or field == XID_FIELD
    ):
        return _NON_NEGATIVE
    return None


FB_USED_PERCENT = "DCGM_FI_DEV_FB_USED_PERCENT"
"""Framebuffer used, ratio 0..1: ``Used/(Total - Reserved)`` (``dcgm_fields.h``, field 254)."""


def derive_fields(fields: dict[str, int | float], invalid: dict[str, str]) -> None:
    """Add, in place, the fields a source did not send but that follow from those it sent.

    ``DCGM_FI_DEV_FB_USED_PERCENT`` (DCGM's ``Used/(Total - Reserved)``, 0..1), unless present
    or marked invalid: ``FB_USED / (FB_USED + FB_FREE)`` when both are known (NVML's total is
    used + free + reserved, so this is DCGM's formula), else ``FB_USED / (FB_TOTAL -
    FB_RESERVED)`` with ``FB_RESERVED`` taken as 0 when unknown. Nothing is added when the
    denominator is not positive; a result above 1 (used over total: inconsistent inputs) is
    marked ``out_of_range`` in ``invalid`` rather than kept.
    """
    if FB_USED_PERCENT in fields or FB_USED_PERCENT in invalid:
        return
    used = fields.get("DCGM_FI_DEV_FB_USED")
    if used is None:
        return
    free = fields.get("DCGM_FI_DEV_FB_FREE")
    if free is not None:
        denominator = used + free
    else:
        total = fields.get("DCGM_FI_DEV_FB_TOTAL")
        if total is None:
            return
        denominator = total - fields.get("DCGM_FI_DEV_FB_RESERVED", 0)
    if not denominator > 0:
        return
    ratio = used / denominator
    if 0.0 <= ratio <= 1.0:
        fields[FB_USED_PERCENT] = ratio
    else:
        invalid[FB_USED_PERCENT] = "out_of_range"
