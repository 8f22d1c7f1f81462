"""The DCGM fields a simulated H100 node exposes, as dcgm-exporter publishes them.

Names, Prometheus types and HELP texts are dcgm-exporter's ``etc/default-counters.csv`` (copy in
``../shared/data/telemetry/dcgm_exporter/``), plus ``DCGM_FI_PROF_SM_ACTIVE`` which that file lists
commented out (HELP from the same file). Field ids are NVIDIA DCGM ``dcgm_fields.h``:
dcgm-exporter renders families in field-id order, which is the order here.

``kind`` is how the exporter prints the value: DCGM int64 fields with Go's ``%d``, double fields
with ``%f`` (six decimals).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class DcgmField:
    """One exported DCGM field.

    Attributes:
        name: DCGM field name, e.g. ``DCGM_FI_DEV_GPU_UTIL``.
        field_id: numeric id in ``dcgm_fields.h``.
        prom_type: ``gauge`` or ``counter`` (as the counters CSV declares it).
        help: HELP text, verbatim from the counters CSV.
        kind: ``int`` (printed ``%d``) or ``float`` (printed ``%f``).
    """

    name: str
    field_id: int
    prom_type: Literal["gauge", "counter"]
    help: str
    kind: Literal["int", "float"]


DRIVER_VERSION_FIELD = "DCGM_FI_DRIVER_VERSION"
"""Field id 1, exported as a label on every series (``label`` type in the counters CSV)."""

FIELDS: tuple[DcgmField, ...] = (
    DcgmField("DCGM_FI_DEV_SM_CLOCK", 100, "gauge", "SM clock frequency (in MHz).", "int"),
    DcgmField("DCGM_FI_DEV_MEM_CLOCK", 101, "gauge", "Memory clock frequency (in MHz).", "int"),
    DcgmField("DCGM_FI_DEV_MEMORY_TEMP", 140, "gauge", "Memory temperature (in C).", "int"),
    DcgmField("DCGM_FI_DEV_GPU_TEMP", 150, "gauge", "GPU temperature (in C).", "int"),
    DcgmField("DCGM_FI_DEV_POWER_USAGE", 155, "gauge", "Power draw (in W).", "float"),
    DcgmField("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 156, "counter",
              "Total energy consumption since boot (in mJ).", "int"),
    DcgmField("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", 202, "counter", "Total number of PCIe retries.", "int"),
    DcgmField("DCGM_FI_DEV_GPU_UTIL", 203, "gauge", "GPU utilization (in %).", "int"),
    DcgmField("DCGM_FI_DEV_MEM_COPY_UTIL", 204, "gauge", "Memory utilization (in %).", "int"),
    DcgmField("DCGM_FI_DEV_ENC_UTIL", 206, "gauge", "Encoder utilization (in %).", "int"),
    DcgmField("DCGM_FI_DEV_DEC_UTIL", 207, "gauge", "Decoder utilization (in %).", "int"),
    DcgmField("DCGM_FI_DEV_XID_ERRORS", 230, "gauge", "Value of the last XID error encountered.", "int"),
    DcgmField("DCGM_FI_DEV_FB_FREE", 251, "gauge", "Framebuffer memory free (in MiB).", "int"),
    DcgmField("DCGM_FI_DEV_FB_USED", 252, "gauge", "Framebuffer memory used (in MiB).", "int"),
    DcgmField("DCGM_FI_DEV_FB_RESERVED", 253, "gauge", "Framebuffer memory reserved (in MiB).", "int"),
    DcgmField("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", 393, "counter",
              "Number of remapped rows for uncorrectable errors", "int"),
    DcgmField("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", 394, "counter",
              "Number of remapped rows for correctable errors", "int"),
    DcgmField("DCGM_FI_DEV_ROW_REMAP_FAILURE", 395, "gauge", "Whether remapping of rows has failed", "int"),
    DcgmField("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", 449, "counter",
              "Total number of NVLink bandwidth counters for all lanes.", "int"),
    DcgmField("DCGM_FI_DEV_VGPU_LICENSE_STATUS", 526, "gauge", "vGPU License status", "int"),
    DcgmField("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 1001, "gauge", "Ratio of time the graphics engine is active.",
              "float"),
    DcgmField("DCGM_FI_PROF_SM_ACTIVE", 1002, "gauge",
              "The ratio of cycles an SM has at least 1 warp assigned.", "float"),
    DcgmField("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", 1004, "gauge",
              "Ratio of cycles the tensor (HMMA) pipe is active.", "float"),
    DcgmField("DCGM_FI_PROF_DRAM_ACTIVE", 1005, "gauge",
              "Ratio of cycles the device memory interface is active sending or receiving data.", "float"),
    DcgmField("DCGM_FI_PROF_PCIE_TX_BYTES", 1009, "gauge",
              "The rate of data transmitted over the PCIe bus - including both protocol headers and data "
              "payloads - in bytes per second.", "int"),
    DcgmField("DCGM_FI_PROF_PCIE_RX_BYTES", 1010, "gauge",
              "The rate of data received over the PCIe bus - including both protocol headers and data "
              "payloads - in bytes per second.", "int"),
)
"""Every exported field, in field-id order."""

FIELD_BY_NAME: dict[str, DcgmField] = {f.name: f for f in FIELDS}
""":data:`FIELDS` by name."""
