"""``nvidia-smi -q -x`` XML → one :class:`contracts.GpuSample` per GPU or MIG GPU instance.

Format: NVIDIA's ``nvsmi_device_v11.dtd`` … ``nvsmi_device_v13.dtd`` (the ``<!DOCTYPE>`` of the
output; nvidia-smi(1), "XML output"). Values are text with a unit (``45 %``, ``1032 MiB``,
``67.03 W``, ``27 C``, ``1275 MHz``, ``16x``, ``4000 KB/s``, ``P0``). Parsed with the standard
library's ``xml.etree.ElementTree`` (expat: no external DTD or entity is fetched; expat >= 2.4.1
limits entity amplification) — the input is the local nvidia-smi's own output.

Every value goes to the DCGM field of the same quantity (``dcgm_fields.h``), so downstream code
has one vocabulary whatever the source: ``utilization/gpu_util`` → ``DCGM_FI_DEV_GPU_UTIL``,
``fb_memory_usage/used`` → ``DCGM_FI_DEV_FB_USED`` (MiB), ``gpu_power_readings/power_draw``
(v12) or ``power_readings/power_draw`` (v11) or ``…/average_power_draw`` (v13) →
``DCGM_FI_DEV_POWER_USAGE`` (W), ``instant_power_draw`` (v13) → ``DCGM_FI_DEV_POWER_USAGE_INSTANT``
… (the whole table is :data:`FIELD_SPECS`). Per value:

* ``N/A``, ``[N/A]``, ``Not Supported``, ``Requested functionality has been deprecated`` (v13) and
  elements the schema version does not have → the field is **absent** (the dcgm-exporter
  convention for not-supported values: neither in ``fields`` nor in ``invalid``);
* ``Unknown Error`` → ``invalid`` ``unknown_error``; ``Insufficient Permissions`` →
  ``no_permission``; ``GPU is lost`` / ``GPU requires reset`` → ``gpu_lost``; text that is not a
  number with the expected unit → ``not_a_number``; a value outside the field's range
  (:func:`value_range`) → ``out_of_range``. Each is also a :class:`collectors.dcgm.Rejection`.

MIG: a GPU whose ``mig_mode/current_mig`` is ``Enabled`` and that lists ``mig_devices/mig_device``
elements yields one sample per GPU instance (``gpu_instance_id``), keyed
``host/GPU-uuid/gi`` like dcgm-exporter's, with the instance's own ``fb_memory_usage`` and
``bar1_memory_usage``; the GPU-level fields in :data:`DEVICE_LEVEL_FIELDS` (temperatures, power,
clocks, PCIe, P-state, ECC...) are repeated on each instance as read, never split or summed — as
dcgm-exporter does. Several compute instances of one GPU instance share its memory: one sample per
GPU instance. The whole GPU itself is not emitted then (its utilisation is ``N/A`` under MIG and
its memory is the instances'); a MIG-enabled GPU without instances is emitted as a whole GPU.

The XML carries no host name: the caller gives it. Its ``<timestamp>`` is local time without a
zone, so the caller's read time is used instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import shlex
import socket
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from collectors.dcgm import Rejection
from collectors.dcgm_fields import derive_fields, field_range
from contracts import GpuSample

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_COMMAND",
    "DEVICE_LEVEL_FIELDS",
    "FIELD_SPECS",
    "FieldSpec",
    "NvsmiParseResult",
    "NvsmiReadResult",
    "check_value",
    "parse_nvidia_smi_xml",
    "parse_value_text",
    "read_nvidia_smi",
    "value_range",
]

DEFAULT_COMMAND: tuple[str, ...] = ("nvidia-smi", "-q", "-x")
"""The command whose output :func:`parse_nvidia_smi_xml` reads."""

_MAX_DETAIL = 160
_Kind = Literal["number", "pstate", "yes_no"]


class FieldSpec(NamedTuple):
    """Where one DCGM field is in the XML of one GPU.

    Attributes:
        field: DCGM field name.
        paths: ``ElementTree`` paths below ``<gpu>`` (or ``<mig_device>``), tried in order: the
            first one present with a usable value wins (schema versions differ).
        unit: the unit text nvidia-smi writes after the number (``""`` for none).
        kind: ``number`` (``int`` unless it has a decimal point), ``pstate`` (``P0`` → 0) or
            ``yes_no`` (``Yes`` → 1, ``No`` → 0).
    """

    field: str
    paths: tuple[str, ...]
    unit: str
    kind: _Kind = "number"


_LINK = "pci/pci_gpu_link_info"
FIELD_SPECS: tuple[FieldSpec, ...] = (
    FieldSpec("DCGM_FI_DEV_GPU_UTIL", ("utilization/gpu_util",), "%"),
    FieldSpec("DCGM_FI_DEV_MEM_COPY_UTIL", ("utilization/memory_util",), "%"),
    FieldSpec("DCGM_FI_DEV_ENC_UTIL", ("utilization/encoder_util",), "%"),
    FieldSpec("DCGM_FI_DEV_DEC_UTIL", ("utilization/decoder_util",), "%"),
    FieldSpec("DCGM_FI_DEV_FB_TOTAL", ("fb_memory_usage/total",), "MiB"),
    FieldSpec("DCGM_FI_DEV_FB_USED", ("fb_memory_usage/used",), "MiB"),
    FieldSpec("DCGM_FI_DEV_FB_FREE", ("fb_memory_usage/free",), "MiB"),
    FieldSpec("DCGM_FI_DEV_FB_RESERVED", ("fb_memory_usage/reserved",), "MiB"),
    FieldSpec("DCGM_FI_DEV_BAR1_TOTAL", ("bar1_memory_usage/total",), "MiB"),
    FieldSpec("DCGM_FI_DEV_BAR1_USED", ("bar1_memory_usage/used",), "MiB"),
    FieldSpec("DCGM_FI_DEV_BAR1_FREE", ("bar1_memory_usage/free",), "MiB"),
    FieldSpec("DCGM_FI_DEV_GPU_TEMP", ("temperature/gpu_temp",), "C"),
    FieldSpec("DCGM_FI_DEV_MEMORY_TEMP", ("temperature/memory_temp",), "C"),
    FieldSpec("DCGM_FI_DEV_GPU_TEMP_LIMIT", ("temperature/gpu_temp_tlimit",), "C"),
    FieldSpec("DCGM_FI_DEV_SHUTDOWN_TEMP", ("temperature/gpu_temp_max_threshold",), "C"),
    FieldSpec("DCGM_FI_DEV_SLOWDOWN_TEMP", ("temperature/gpu_temp_slow_threshold",), "C"),
    FieldSpec("DCGM_FI_DEV_GPU_MAX_OP_TEMP", ("temperature/gpu_temp_max_gpu_threshold",), "C"),
    FieldSpec("DCGM_FI_DEV_MEM_MAX_OP_TEMP", ("temperature/gpu_temp_max_mem_threshold",), "C"),
    # v11 power_readings; v12 gpu_power_readings; v13 average_/instant_power_draw.
    FieldSpec(
        "DCGM_FI_DEV_POWER_USAGE",
        (
            "gpu_power_readings/average_power_draw",
            "gpu_power_readings/power_draw",
            "power_readings/average_power_draw",
            "power_readings/power_draw",
        ),
        "W",
    ),
    FieldSpec(
        "DCGM_FI_DEV_POWER_USAGE_INSTANT",
        ("gpu_power_readings/instant_power_draw", "power_readings/instant_power_draw"),
        "W",
    ),
    # v11 "power_limit"/"enforced_power_limit" became v12 "requested_"/"current_power_limit".
    FieldSpec(
        "DCGM_FI_DEV_POWER_MGMT_LIMIT",
        ("gpu_power_readings/requested_power_limit", "power_readings/power_limit"),
        "W",
    ),
    FieldSpec(
        "DCGM_FI_DEV_ENFORCED_POWER_LIMIT",
        ("gpu_power_readings/current_power_limit", "power_readings/enforced_power_limit"),
        "W",
    ),
    FieldSpec(
        "DCGM_FI_DEV_POWER_MGMT_LIMIT_DEF",
        ("gpu_power_readings/default_power_limit", "power_readings/default_power_limit"),
        "W",
    ),
    FieldSpec(
        "DCGM_FI_DEV_POWER_MGMT_LIMIT_MIN",
        ("gpu_power_readings/min_power_limit", "power_readings/min_power_limit"),
        "W",
    ),
    FieldSpec(
        "DCGM_FI_DEV_POWER_MGMT_LIMIT_MAX",
        ("gpu_power_readings/max_power_limit", "power_readings/max_power_limit"),
        "W",
    ),
    FieldSpec("DCGM_FI_DEV_SM_CLOCK", ("clocks/sm_clock",), "MHz"),
    FieldSpec("DCGM_FI_DEV_MEM_CLOCK", ("clocks/mem_clock",), "MHz"),
    FieldSpec("DCGM_FI_DEV_VIDEO_CLOCK", ("clocks/video_clock",), "MHz"),
    # Graphics and SM share one clock domain (sm_clock == graphics_clock in every sample file).
    FieldSpec("DCGM_FI_DEV_APP_SM_CLOCK", ("applications_clocks/graphics_clock",), "MHz"),
    FieldSpec("DCGM_FI_DEV_APP_MEM_CLOCK", ("applications_clocks/mem_clock",), "MHz"),
    FieldSpec("DCGM_FI_DEV_MAX_SM_CLOCK", ("max_clocks/sm_clock",), "MHz"),
    FieldSpec("DCGM_FI_DEV_MAX_MEM_CLOCK", ("max_clocks/mem_clock",), "MHz"),
    FieldSpec("DCGM_FI_DEV_MAX_VIDEO_CLOCK", ("max_clocks/video_clock",), "MHz"),
    FieldSpec("DCGM_FI_DEV_PCIE_LINK_GEN", (f"{_LINK}/pcie_gen/current_link_gen",), ""),
    FieldSpec("DCGM_FI_DEV_PCIE_MAX_LINK_GEN", (f"{_LINK}/pcie_gen/max_link_gen",), ""),
    FieldSpec("DCGM_FI_DEV_PCIE_LINK_WIDTH", (f"{_LINK}/link_widths/current_link_width",), "x"),
    FieldSpec("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", (f"{_LINK}/link_widths/max_link_width",), "x"),
    FieldSpec("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", ("pci/replay_counter",), ""),
    FieldSpec("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", ("pci/tx_util",), "KB/s"),
    FieldSpec("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", ("pci/rx_util",), "KB/s"),
    FieldSpec("DCGM_FI_DEV_FAN_SPEED", ("fan_speed",), "%"),
    FieldSpec("DCGM_FI_DEV_PSTATE", ("performance_state",), "", "pstate"),
    FieldSpec("DCGM_FI_DEV_RETIRED_SBE", ("retired_pages/multiple_single_bit_retirement/retired_count",), ""),
    FieldSpec("DCGM_FI_DEV_RETIRED_DBE", ("retired_pages/double_bit_retirement/retired_count",), ""),
    FieldSpec("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", ("remapped_rows/remapped_row_corr",), ""),
    FieldSpec("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", ("remapped_rows/remapped_row_unc",), ""),
    FieldSpec("DCGM_FI_DEV_ROW_REMAP_PENDING", ("remapped_rows/remapped_row_pending",), "", "yes_no"),
    FieldSpec("DCGM_FI_DEV_ROW_REMAP_FAILURE", ("remapped_rows/remapped_row_failure",), "", "yes_no"),
)
"""Every DCGM field read from a ``<gpu>`` element, plus the derived ones:
``DCGM_FI_DEV_CLOCKS_EVENT_REASONS`` (the bitmask of ``clocks_event_reasons`` (v12+) or
``clocks_throttle_reasons`` (v11), bits as ``DCGM_CLOCKS_EVENT_REASON_*``) and
``DCGM_FI_DEV_ECC_{SBE,DBE}_{VOL,AGG}_TOTAL`` (the sums of the SRAM and DRAM corrected /
uncorrected counts, as ``nvmlDeviceGetTotalEccErrors`` sums every memory location)."""

MIG_FIELD_SPECS: tuple[FieldSpec, ...] = tuple(
    s for s in FIELD_SPECS if s.paths[0].startswith(("fb_memory_usage/", "bar1_memory_usage/"))
)
"""The fields a ``<mig_device>`` has of its own: its framebuffer and BAR1 memory."""

CLOCKS_EVENT_REASONS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
_EVENT_REASON_BITS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clocks_setting": 0x100,
}
"""nvidia-smi reason element suffix → ``DCGM_CLOCKS_EVENT_REASON_*`` bit (= NVML's
``nvmlClocksEventReason*``; ``dcgm_fields.h``)."""

_ECC_TOTALS: dict[str, tuple[str, tuple[str, ...]]] = {
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("volatile", ("sram_correctable", "dram_correctable")),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("volatile", ("sram_uncorrectable", "dram_uncorrectable")),
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": ("aggregate", ("sram_correctable", "dram_correctable")),
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": ("aggregate", ("sram_uncorrectable", "dram_uncorrectable")),
}
"""ECC totals: the ``ecc_errors/<volatile|aggregate>`` elements summed. v13 splits
``sram_uncorrectable`` into ``sram_uncorrectable_parity`` + ``sram_uncorrectable_secded``."""

_INSTANCE_SCOPED = (
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_ENC_UTIL",
    "DCGM_FI_DEV_DEC_UTIL",
    "DCGM_FI_DEV_FB_",
    "DCGM_FI_DEV_BAR1_",
)

DEVICE_LEVEL_FIELDS: frozenset[str] = frozenset(
    [s.field for s in FIELD_SPECS if not s.field.startswith(_INSTANCE_SCOPED)]
    + [CLOCKS_EVENT_REASONS, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", *_ECC_TOTALS]
)
"""Fields of the physical GPU — temperatures, power and energy, clocks, PCIe, fan, P-state, ECC,
retired pages, remapped rows — repeated on each of its MIG instances as read (dcgm-exporter
repeats every GPU-entity field on each instance): never divided or summed. Utilisation, FB and
BAR1 memory belong to an instance and are not repeated. Shared with :mod:`collectors.nvml`."""

_LOCAL_RANGES: dict[str, tuple[float, float]] = {
    "DCGM_FI_DEV_PSTATE": (0.0, 15.0),
    "DCGM_FI_DEV_FAN_SPEED": (0.0, 100.0),
    "DCGM_FI_DEV_GPU_TEMP_LIMIT": (-200.0, 200.0),
    "DCGM_FI_DEV_ROW_REMAP_PENDING": (0.0, 1.0),
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": (0.0, 1.0),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": (0.0, 10000.0),
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": (0.0, 10000.0),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT_DEF": (0.0, 10000.0),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT_MIN": (0.0, 10000.0),
    "DCGM_FI_DEV_POWER_MGMT_LIMIT_MAX": (0.0, 10000.0),
    "DCGM_FI_DEV_PCIE_LINK_GEN": (1.0, 16.0),
    "DCGM_FI_DEV_PCIE_MAX_LINK_GEN": (1.0, 16.0),
    "DCGM_FI_DEV_PCIE_LINK_WIDTH": (0.0, 32.0),
    "DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH": (0.0, 32.0),
    CLOCKS_EVENT_REASONS: (0.0, float((1 << 64) - 1)),
}


def value_range(field: str) -> tuple[float, float] | None:
    """Inclusive ``(low, high)`` bounds of a valid ``field`` value, or ``None`` if unchecked.

    :func:`collectors.dcgm_fields.field_range` (percent, ratios, temperatures, power, sizes,
    clocks, counters), plus the fields nvidia-smi and NVML give that it does not bound: P-state
    0..15 (``dcgm_fields.h``), fan 0..100 %, PCIe generation 1..16 and width 0..32 lanes,
    power limits 0..10000 W, yes/no flags 0..1, the thermal margin ±200 C, BAR1 sizes >= 0.
    """
    rng = _LOCAL_RANGES.get(field)
    if rng is not None:
        return rng
    if field.startswith("DCGM_FI_DEV_BAR1_"):
        return (0.0, math.inf)
    return field_range(field)


def check_value(field: str, value: float) -> str | None:
    """``None`` if ``value`` is a valid reading of ``field``, else the reason: ``not_a_number``
    (NaN), ``out_of_range`` (infinite or outside :func:`value_range`)."""
    if isinstance(value, float):
        if math.isnan(value):
            return "not_a_number"
        if math.isinf(value):
            return "out_of_range"
    rng = value_range(field)
    if rng is not None and not rng[0] <= value <= rng[1]:
        return "out_of_range"
    return None


_ABSENT_TEXT = frozenset(
    {"", "n/a", "not supported", "requested functionality has been deprecated", "none", "not available"}
)
"""Value texts meaning "this GPU or driver does not have it" (case-insensitive, brackets removed)."""
_ERROR_TEXT: dict[str, str] = {
    "unknown error": "unknown_error",
    "insufficient permissions": "no_permission",
    "no permission": "no_permission",
    "gpu is lost": "gpu_lost",
    "gpu requires reset": "gpu_lost",
    "gpu requires restart": "gpu_lost",
}
"""Value texts meaning "it exists but the read failed" → ``invalid`` reason."""
_NUMBER = re.compile(r"([+-]?\d+(?:\.\d+)?)\s*(\S*)\Z")
_PSTATE = re.compile(r"P(\d{1,2})\Z")


class _Value(NamedTuple):
    """A parsed value: ``value`` when usable, else ``reason`` (``None`` for both: absent)."""

    value: int | float | None
    reason: str | None
    text: str


_ABSENT = _Value(None, None, "")


def _parse_text(text: str | None, spec: FieldSpec) -> _Value:
    if text is None:
        return _ABSENT
    raw = text.strip()
    inner = raw[1:-1].strip() if raw.startswith("[") and raw.endswith("]") else raw
    low = inner.lower()
    if low in _ABSENT_TEXT:
        return _ABSENT
    err = _ERROR_TEXT.get(low)
    if err is not None:
        return _Value(None, err, raw)
    value: int | float
    if spec.kind == "pstate":
        m = _PSTATE.match(inner)
        if m is None:
            return _Value(None, "not_a_number", raw)
        value = int(m.group(1))
    elif spec.kind == "yes_no":
        if low not in ("yes", "no"):
            return _Value(None, "not_a_number", raw)
        value = 1 if low == "yes" else 0
    else:
        m = _NUMBER.match(inner)
        if m is None or m.group(2) != spec.unit:
            return _Value(None, "not_a_number", raw)
        num = m.group(1)
        value = float(num) if "." in num else int(num)
    reason = check_value(spec.field, value)
    return _Value(None, reason, raw) if reason else _Value(value, None, raw)


def parse_value_text(text: str | None, spec: FieldSpec) -> tuple[int | float | None, str | None]:
    """One nvidia-smi value text read as ``spec`` says (the rules of the module docstring):
    ``(value, None)`` when usable, ``(None, reason)`` when it is invalid, ``(None, None)`` when
    absent (``N/A``, ``[Not Supported]``...). Shared with :mod:`collectors.nvsmi_csv`."""
    v = _parse_text(text, spec)
    return v.value, v.reason


@dataclass(slots=True)
class _Acc:
    """Fields and rejections gathered for one sample."""

    fields: dict[str, int | float] = field(default_factory=dict)
    invalid: dict[str, str] = field(default_factory=dict)

    def put(self, name: str, v: _Value, where: str, rejected: list[Rejection]) -> None:
        if v.value is not None:
            self.fields[name] = v.value
            self.invalid.pop(name, None)
        elif v.reason is not None and name not in self.fields:
            self.invalid[name] = v.reason
            rejected.append(Rejection(v.reason, name, f"{where}: {v.text[:_MAX_DETAIL]}"))


def _read_specs(
    elem: ET.Element, specs: Sequence[FieldSpec], acc: _Acc, where: str, rejected: list[Rejection]
) -> None:
    for spec in specs:
        best = _ABSENT
        for path in spec.paths:
            v = _parse_text(elem.findtext(path), spec)
            if v.value is not None:
                best = v
                break
            if v.reason is not None and best.reason is None:
                best = v
        acc.put(spec.field, best, where, rejected)


def _read_event_reasons(gpu: ET.Element, acc: _Acc, where: str, rejected: list[Rejection]) -> None:
    """``DCGM_FI_DEV_CLOCKS_EVENT_REASONS`` from ``clocks_event_reasons`` (v12+) or
    ``clocks_throttle_reasons`` (v11): present only when every reason reads Active / Not Active;
    a failed read of one reason makes the mask invalid, an ``N/A`` one makes it absent."""
    for parent, prefix in (
        ("clocks_event_reasons", "clocks_event_reason_"),
        ("clocks_throttle_reasons", "clocks_throttle_reason_"),
    ):
        elem = gpu.find(parent)
        if elem is None or len(elem) == 0:
            continue
        mask = 0
        for child in elem:
            state = (child.text or "").strip().lower()
            if state == "not active":
                continue
            if state != "active":
                v = _parse_text(child.text, _MASK_SPEC)  # N/A: absent; Unknown Error: its reason
                if v.value is not None:
                    v = _Value(None, "not_a_number", v.text)
                acc.put(CLOCKS_EVENT_REASONS, v, where, rejected)
                return
            mask |= _EVENT_REASON_BITS.get(child.tag.removeprefix(prefix), 0)  # newer reasons: no bit
        acc.put(CLOCKS_EVENT_REASONS, _Value(mask, None, ""), where, rejected)
        return


_MASK_SPEC = FieldSpec(CLOCKS_EVENT_REASONS, (), "")


def _read_ecc(gpu: ET.Element, acc: _Acc, where: str, rejected: list[Rejection]) -> None:
    """ECC totals (:data:`_ECC_TOTALS`): the sum of the parts; absent when a part is absent,
    invalid when a part failed."""
    for name, (scope, parts) in _ECC_TOTALS.items():
        block = gpu.find(f"ecc_errors/{scope}")
        if block is None:
            continue
        spec = FieldSpec(name, (), "")
        total = _Value(0, None, "")
        for part in parts:
            if part == "sram_uncorrectable" and block.find(part) is None:
                names: tuple[str, ...] = ("sram_uncorrectable_parity", "sram_uncorrectable_secded")
            else:
                names = (part,)
            for n in names:
                v = _parse_text(block.findtext(n), spec)
                if v.value is None or isinstance(v.value, float):
                    total = v if v.value is None else _Value(None, "not_a_number", v.text)
                    break
                total = _Value(int(total.value or 0) + int(v.value), None, "")
            if total.value is None:
                break
        acc.put(name, total, where, rejected)


@dataclass(slots=True)
class NvsmiParseResult:
    """What one ``nvidia-smi -q -x`` document yielded.

    Attributes:
        samples: one per GPU (or MIG GPU instance), in document order, ``seq`` counted up from
            ``seq_start``.
        rejected: every value marked invalid (also in ``samples[i].invalid``) and every
            ``<gpu>`` that could not be used (``missing_uuid``, ``bad_gpu_instance_id``).
        error: ``None``, or why the whole document was unusable: ``malformed_xml`` (not
            well-formed, e.g. cut off), ``not_nvidia_smi`` (root is not ``<nvidia_smi_log>``).
        detail: the parser's message for ``error``.
        driver_version: ``<driver_version>`` text, if any.
    """

    samples: list[GpuSample] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    error: str | None = None
    detail: str = ""
    driver_version: str | None = None

    def rejected_by_reason(self) -> Counter[str]:
        """Count of :attr:`rejected` by reason."""
        return Counter(r.reason for r in self.rejected)


def parse_nvidia_smi_xml(
    xml: str | bytes,
    *,
    host: str,
    ts: float,
    target: str = "nvidia-smi",
    seq_start: int = 0,
) -> NvsmiParseResult:
    """Parse one ``nvidia-smi -q -x`` document (schema v11–v13; module docstring).

    Args:
        xml: the command's standard output (bytes are decoded per the XML declaration).
        host: host name for every sample (the XML has none).
        ts: read time, Unix seconds, for every sample.
        target: copied into ``GpuSample.target`` (e.g. the command line).
        seq_start: ``seq`` of the first sample.

    Returns:
        The samples and rejections. Never raises on bad input: a document that does not parse
        has :attr:`NvsmiParseResult.error` set and no samples; a ``<gpu>`` without a usable
        ``<uuid>`` is rejected alone; a bad value loses only its field.
    """
    result = NvsmiParseResult()
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as e:
        result.error, result.detail = "malformed_xml", str(e)[:_MAX_DETAIL]
        return result
    if root.tag != "nvidia_smi_log":
        result.error, result.detail = "not_nvidia_smi", f"root element <{root.tag[:40]}>"
        return result
    result.driver_version = (root.findtext("driver_version") or "").strip() or None
    seq = seq_start
    for n, gpu in enumerate(root.iter("gpu"), 1):
        for sample in _gpu_samples(gpu, n, host, ts, target, result.rejected):
            result.samples.append(sample.model_copy(update={"seq": seq}))
            seq += 1
    return result


class _Identity(NamedTuple):
    """What every sample of one ``<gpu>`` shares."""

    ts: float
    host: str
    uuid: str
    gpu_index: int | None
    model: str | None
    attributes: dict[str, str]
    target: str

    def sample(self, acc: _Acc, gpu_instance_id: int | None = None) -> GpuSample:
        derive_fields(acc.fields, acc.invalid)
        return GpuSample(
            ts=self.ts,
            host=self.host,
            gpu_uuid=self.uuid,
            gpu_index=self.gpu_index,
            gpu_instance_id=gpu_instance_id,
            model_name=self.model,
            fields=acc.fields,
            invalid=acc.invalid,
            attributes=dict(self.attributes),
            source="nvidia-smi",
            target=self.target,
        )


def _gpu_samples(
    gpu: ET.Element, n: int, host: str, ts: float, target: str, rejected: list[Rejection]
) -> list[GpuSample]:
    """The sample(s) of one ``<gpu>``: itself, or its MIG GPU instances."""
    bus_id = gpu.get("id", "")
    where = f"gpu {n} {bus_id}".strip()
    uuid = (gpu.findtext("uuid") or "").strip()
    if not uuid.startswith("GPU-"):
        rejected.append(Rejection("missing_uuid", "", f"{where}: uuid {uuid[:60]!r}"))
        return []
    minor = (gpu.findtext("minor_number") or "").strip()
    ident = _Identity(
        ts=ts,
        host=host,
        uuid=uuid,
        gpu_index=int(minor) if minor.isascii() and minor.isdigit() else None,
        model=(gpu.findtext("product_name") or "").strip() or None,
        attributes={"pci_bus_id": bus_id} if bus_id else {},
        target=target,
    )
    acc = _Acc()
    _read_specs(gpu, FIELD_SPECS, acc, where, rejected)
    _read_event_reasons(gpu, acc, where, rejected)
    _read_ecc(gpu, acc, where, rejected)
    mig_on = (gpu.findtext("mig_mode/current_mig") or "").strip().lower() == "enabled"
    migs = gpu.findall("mig_devices/mig_device") if mig_on else []
    if not migs:
        return [ident.sample(acc)]

    shared = {k: v for k, v in acc.fields.items() if k in DEVICE_LEVEL_FIELDS}
    shared_invalid = {k: v for k, v in acc.invalid.items() if k in DEVICE_LEVEL_FIELDS}
    samples: list[GpuSample] = []
    seen: set[int] = set()
    for mig in migs:
        gi_text = (mig.findtext("gpu_instance_id") or "").strip()
        mig_where = f"{where} mig {(mig.findtext('index') or '?').strip()}"
        if not (gi_text.isascii() and gi_text.isdigit()):
            rejected.append(Rejection("bad_gpu_instance_id", "", f"{mig_where}: {gi_text[:40]!r}"))
            continue
        gi = int(gi_text)
        if gi in seen:
            continue  # another compute instance of the same GPU instance: same memory, same GPU
        seen.add(gi)
        macc = _Acc(dict(shared), dict(shared_invalid))
        _read_specs(mig, MIG_FIELD_SPECS, macc, mig_where, rejected)
        samples.append(ident.sample(macc, gi))
    return samples


# --- running the command ----------------------------------------------------------------------------
@dataclass(slots=True)
class NvsmiReadResult:
    """One run of ``nvidia-smi -q -x``.

    Attributes:
        reason: ``ok``, or why there is no data: ``binary_not_found`` (no such command: a host
            without the NVIDIA driver), ``exec_error`` (could not start it), ``timeout`` (killed
            at the deadline), ``exit_status`` (non-zero exit, e.g. "couldn't communicate with the
            NVIDIA driver"), ``malformed_xml`` / ``not_nvidia_smi`` (output unusable), for a CSV
            query ``empty_output`` / ``no_properties``.
        parsed: the parse of the output when it ran and exited 0.
        duration_s: wall time of the run, seconds.
        returncode: the exit status, when it ran to its end.
        detail: the error text (stderr start, exception, parser message), for logs.
    """

    reason: str
    parsed: NvsmiParseResult | None = None
    duration_s: float = 0.0
    returncode: int | None = None
    detail: str = ""

    @property
    def samples(self) -> list[GpuSample]:
        """The samples (empty unless ``reason == "ok"``)."""
        return self.parsed.samples if self.parsed is not None and self.reason == "ok" else []


async def read_nvidia_smi(
    cmd: Sequence[str] = DEFAULT_COMMAND,
    timeout_s: float = 5.0,
    *,
    host: str | None = None,
    ts: float | None = None,
    seq_start: int = 0,
) -> NvsmiReadResult:
    """Run ``cmd`` (``nvidia-smi -q -x``, possibly behind a wrapper such as ``ssh node``) and parse
    its output: as XML, or as CSV when ``cmd`` has a ``--query-gpu`` list
    (:func:`collectors.nvsmi_csv.parse_nvidia_smi_csv`, ``--format=csv[,noheader][,nounits]``).

    The result says what the caller counts (:meth:`collectors.service.CollectorService`: the run
    in ``gpupool_collector_scrapes_total{target, result}``, a failure in
    ``gpupool_collector_scrape_errors_total{target, reason}``, the wall time in
    ``gpupool_collector_scrape_duration_seconds{source="nvidia-smi"}``, every rejected value in
    ``gpupool_collector_rejected_samples_total{reason}``; ``target`` is the command line).

    Args:
        cmd: argv; the first element is looked up on ``PATH``.
        timeout_s: the process is killed after this many seconds.
        host: host name of the samples; default: this machine's (``socket.gethostname()``).
        ts: read time of the samples, Unix seconds; default: when the command started.
        seq_start: ``seq`` of the first sample.

    Returns:
        A :class:`NvsmiReadResult`. Never raises for a missing binary, a hung or failing command
        or bad output: that is a ``reason`` other than ``ok`` with no samples.

    Raises:
        ValueError: ``cmd`` is empty or ``timeout_s`` is not positive.
    """
    if not cmd:
        raise ValueError("cmd must not be empty")
    if not timeout_s > 0:
        raise ValueError("timeout_s must be > 0")
    target = shlex.join(cmd)
    started = time.time() if ts is None else ts
    t0 = time.monotonic()
    res, stdout = await _run(cmd, timeout_s)
    if stdout is not None:
        from collectors.nvsmi_csv import parse_nvidia_smi_csv, query_properties  # it imports this module

        properties = query_properties(cmd)
        if properties is not None:
            res.parsed = parse_nvidia_smi_csv(
                stdout.decode(errors="replace"),
                host=host or socket.gethostname(),
                ts=started,
                properties=properties,
                target=target,
                seq_start=seq_start,
            )
        else:
            res.parsed = parse_nvidia_smi_xml(
                stdout,
                host=host or socket.gethostname(),
                ts=started,
                target=target,
                seq_start=seq_start,
            )
        if res.parsed.error is not None:
            res.reason, res.detail = res.parsed.error, res.parsed.detail
    res.duration_s = time.monotonic() - t0
    log.debug(
        "nvidia_smi_read",
        extra={"target": target, "reason": res.reason, "gpus": len(res.samples), "duration_s": round(res.duration_s, 4)},
    )
    return res


async def _run(cmd: Sequence[str], timeout_s: float) -> tuple[NvsmiReadResult, bytes | None]:
    """Run the command; its stdout when it exited 0, else ``None`` and the failure."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError as e:
        return NvsmiReadResult("binary_not_found", detail=str(e)[:_MAX_DETAIL]), None
    except OSError as e:
        return NvsmiReadResult("exec_error", detail=str(e)[:_MAX_DETAIL]), None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return NvsmiReadResult("timeout", detail=f"killed after {timeout_s} s"), None
    if proc.returncode != 0:
        text = (err or out).decode(errors="replace").strip()
        return NvsmiReadResult("exit_status", returncode=proc.returncode, detail=text[:_MAX_DETAIL]), None
    return NvsmiReadResult("ok", returncode=0), out
