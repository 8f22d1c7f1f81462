"""Telemetry records produced by the collectors.

GPU fields are keyed by their DCGM field name (``DCGM_FI_DEV_GPU_UTIL``,
``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` ...; NVIDIA DCGM ``dcgm_fields.h``) whatever the source
(dcgm-exporter, NVML, nvidia-smi), so downstream code has one vocabulary. InfiniBand counters are
keyed by their PMA attribute name (``PortXmitData``, ``PortXmitWait`` ...; IBTA spec vol. 1,
16.1.3 PortCounters / PortCountersExtended) and stay Python ``int`` end to end: switch byte
counters pass 2**53 and must never go through float64.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from contracts.base import Record
from contracts.topics import gpu_key, ib_port_key, telemetry_partition_key


class GpuSample(Record):
    """One scrape of one GPU (or one MIG GPU instance).

    Attributes:
        ts: sample time, Unix epoch seconds (the exposition timestamp when given, else scrape time).
        host: normalised host name (dcgm-exporter ``Hostname`` or ``hostname`` label).
        gpu_uuid: ``GPU-...`` UUID of the physical GPU.
        gpu_index: the ``gpu`` label (minor number).
        gpu_instance_id: MIG GPU instance id (``GPU_I_ID``) or ``None`` for a whole GPU.
        gpu_instance_profile: MIG profile (``GPU_I_PROFILE``, e.g. ``3g.40gb``) or ``None``.
        model_name: e.g. ``NVIDIA H100 80GB HBM3``.
        fields: valid values only, by DCGM field name; units are DCGM's (% for ``*_UTIL``, ratio
            0..1 for ``DCGM_FI_PROF_*``, MiB for ``FB_*``, W, C, MHz). A field that was absent, a
            DCGM blank/not-supported sentinel or out of range is *not* here: see ``invalid``.
        invalid: field name → reason (``sentinel``, ``out_of_range``, ``not_a_number``) for values
            the collector rejected. Absent fields appear in neither map.
        attributes: workload labels (``pod``, ``namespace``, ``container``...) — carried, never
            part of the identity; an empty label value means absent.
        source: which source produced it.
        target: the scrape target (URL or path) it came from.
        seq: per-producer sequence number, to account for every record end to end.
    """

    ts: float
    host: str
    gpu_uuid: str
    gpu_index: int | None = None
    gpu_instance_id: int | None = None
    gpu_instance_profile: str | None = None
    model_name: str | None = None
    fields: dict[str, float | int] = Field(default_factory=dict)
    invalid: dict[str, str] = Field(default_factory=dict)
    attributes: dict[str, str] = Field(default_factory=dict)
    source: Literal["dcgm-exporter", "nvml", "nvidia-smi"] = "dcgm-exporter"
    target: str = ""
    seq: int = 0

    @property
    def key(self) -> str:
        """GPU identity: :func:`contracts.topics.gpu_key` (``host/uuid[/gi]``). Not the Kafka key:
        that is :attr:`partition_key`."""
        return gpu_key(self.host, self.gpu_uuid, self.gpu_instance_id)

    @property
    def partition_key(self) -> str:
        """Kafka record key on ``telemetry.gpu``: the host
        (:func:`contracts.topics.telemetry_partition_key`), so that a host's GPUs and InfiniBand
        ports share a partition number (:mod:`contracts.topics`)."""
        return telemetry_partition_key(self.host)


class IbPortSample(Record):
    """One read of one InfiniBand (or RoCE) port's state and counters.

    Attributes:
        ts: read time, Unix epoch seconds.
        host: host the port is on (sysfs source); from the fabric (perfquery source) the first
            word of an HCA's node description (rdma-ndd's ``%h %d``), a switch's whole
            description. Also the Kafka key (:attr:`partition_key`).
        device: HCA name (``mlx5_0``) or switch description.
        node_guid: ``0x`` + 16 lowercase hex digits, or ``None`` where the device exposes none.
        port: port number.
        link_layer: ``InfiniBand`` or ``Ethernet`` (RoCE); ``None`` if unknown.
        state_id / state: logical state (``4`` / ``ACTIVE``); the id is authoritative.
        phys_state_id / phys_state: physical state (``5`` / ``LinkUp``).
        rate_bytes_per_second: nominal signalling rate, ``Gb/sec × 125000000`` (procfs/node_exporter
            convention); ``None`` if unreadable.
        counters: PMA counters by PMA name, raw ``int``; ``PortXmitData``/``PortRcvData`` count
            4-octet words. ``None`` marks a counter that exists but could not be read (``N/A (no
            PMA)``, EINVAL, EACCES). Missing counters are absent, never 0.
        counter_bits: width of each counter as read (64 for extended, else 32/16/8/4).
        saturated: names of counters stuck at all-ones (a saturated PMA counter gives no rate).
        hw_counters: driver-specific ``hw_counters/`` values (RoCE congestion, irdma IP counters).
        source: ``sysfs`` or ``perfquery``.
        seq: per-producer sequence number.
    """

    ts: float
    host: str
    device: str
    node_guid: str | None = None
    port: int
    link_layer: str | None = None
    state_id: int | None = None
    state: str | None = None
    phys_state_id: int | None = None
    phys_state: str | None = None
    rate_bytes_per_second: int | None = None
    counters: dict[str, int | None] = Field(default_factory=dict)
    counter_bits: dict[str, int] = Field(default_factory=dict)
    saturated: list[str] = Field(default_factory=list)
    hw_counters: dict[str, int | None] = Field(default_factory=dict)
    source: Literal["sysfs", "perfquery"] = "sysfs"
    seq: int = 0

    @property
    def key(self) -> str:
        """Port identity: ``node_guid/port`` (``host:device/port`` when the GUID is unknown), as in
        :func:`contracts.topics.ib_port_key`. Not the Kafka key: that is :attr:`partition_key`."""
        return ib_port_key(self.node_guid or f"{self.host}:{self.device}", self.port)

    @property
    def partition_key(self) -> str:
        """Kafka record key on ``telemetry.ib_port``: the host
        (:func:`contracts.topics.telemetry_partition_key`), the same as the host's GPU samples on
        ``telemetry.gpu``. For a port read from the fabric, ``host`` is the HCA's host name (first
        word of its node description) or, for a switch port, the switch's description: a switch's
        ports stay together and match no GPU host (no node headroom uses them)."""
        return telemetry_partition_key(self.host)

    def data_bytes(self, counter: str) -> int | None:
        """Bytes for a data counter (``PortXmitData`` / ``PortRcvData``): 4 × raw words, or ``None``."""
        raw = self.counters.get(counter)
        return None if raw is None else raw * 4
