"""Telemetry records produced by the collectors.

GPU fields are keyed by their DCGM field name (``DCGM_FI_DEV_GPU_UTIL``,
``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` ...; NVIDIA DCGM ``dcgm_fields.h``) whatever the source
(dcgm-exporter, NVML, nvidia-smi), so downstream code has one vocabulary. InfiniBand counters are
keyed by their PMA attribute name (``PortXmitData``, ``PortXmitWait`` ...; IBTA spec vol. 1,
16.1.3 PortCounters / PortCountersExtended) and stay Python ``int`` end to end: switch byte
counters pass 2**53 and must never go through float64.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from contracts.base import Record, decode
from contracts.topics import gpu_id, gpu_key, ib_port_key, telemetry_partition_key


class SeriesValue(BaseModel):
    """One series of a field that its source split by a label (one observation per label value).

    Attributes:
        labels: the series' own labels — every label of the series that is not modelled as a
            record field (``UUID``, ``gpu``, ``Hostname``, ``GPU_I_ID``... are not repeated), e.g.
            ``{"xid": "31", "err_msg": "..."}`` or ``{"nvlink": "3"}``.
        value: the series' value, in the field's unit; valid values only (an invalid one is in
            the record's ``invalid``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    labels: dict[str, str]
    value: float | int


class GpuSample(Record):
    """One scrape of one GPU (or one MIG GPU instance).

    Attributes:
        ts: sample time, Unix epoch seconds (the exposition timestamp when given, else scrape time).
        host: normalised host name (dcgm-exporter ``Hostname`` or ``hostname`` label).
        gpu_uuid: ``GPU-...`` UUID of the physical GPU; ``None`` when the source gave none (an
            older or trimmed exporter): the GPU is then known by ``host`` + ``gpu_index`` (+
            ``gpu_instance_id``), and one of ``gpu_uuid`` / ``gpu_index`` is always set.
        gpu_index: the ``gpu`` label (minor number / nvidia-smi index).
        gpu_instance_id: MIG GPU instance id (``GPU_I_ID``) or ``None`` for a whole GPU.
        gpu_instance_profile: MIG profile (``GPU_I_PROFILE``, e.g. ``3g.40gb``) or ``None``.
        model_name: e.g. ``NVIDIA H100 80GB HBM3``.
        fields: valid values only, by DCGM field name; units are DCGM's (% for ``*_UTIL``, ratio
            0..1 for ``DCGM_FI_PROF_*``, MiB for ``FB_*``, W, C, MHz). A field that was absent, a
            DCGM blank/not-supported sentinel or out of range is *not* here: see ``invalid``.
            ``DCGM_FI_DEV_FB_USED_PERCENT`` (ratio 0..1, DCGM's ``Used/(Total - Reserved)``) is
            derived by the collector when the source did not send it but sent ``FB_USED`` and
            ``FB_FREE`` (``used/(used+free)``), or ``FB_USED`` and ``FB_TOTAL`` (minus
            ``FB_RESERVED`` when known) — :func:`collectors.dcgm_fields.derive_fields`. A field
            split into several series by a label has its first series' value here (the sum of
            the series for the windowed ``DCGM_EXP_*_COUNT`` fields) and every series in
            ``field_series``.
        field_series: field name → one :class:`SeriesValue` per series, for a field that came as
            several series on this GPU differing in a label (``xid``, ``pod`` on a shared GPU...),
            or as one series with a per-series label (``err_code``, ``err_msg``, ``xid``,
            ``clock_event``); empty for everything else.
        invalid: field name → reason (``sentinel``, ``out_of_range``, ``not_a_number``) for values
            the collector rejected. Absent fields appear in neither map.
        attributes: every label of the GPU's series that is not modelled as a field (``pod``,
            ``namespace``, ``container``, ``device``, ``pci_bus_id``...; the first value seen
            when series differ) — carried, never part of the identity; an empty label value
            means absent. Per-series labels (``err_code``, ``err_msg``, ``xid``,
            ``clock_event``) are in ``field_series`` instead.
        source: which source produced it (``nvidia-smi`` for both its XML and CSV queries,
            ``dcgmi`` for ``dcgmi dmon``).
        target: the scrape target (URL or path) it came from.
        seq: per-producer sequence number, to account for every record end to end.
    """

    ts: float
    host: str
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    gpu_instance_id: int | None = None
    gpu_instance_profile: str | None = None
    model_name: str | None = None
    fields: dict[str, float | int] = Field(default_factory=dict)
    field_series: dict[str, list[SeriesValue]] = Field(default_factory=dict)
    invalid: dict[str, str] = Field(default_factory=dict)
    attributes: dict[str, str] = Field(default_factory=dict)
    source: Literal["dcgm-exporter", "nvml", "nvidia-smi", "dcgmi"] = "dcgm-exporter"
    target: str = ""
    seq: int = 0

    @model_validator(mode="after")
    def _identified(self) -> Self:
        if not self.gpu_uuid and self.gpu_index is None:
            raise ValueError("a GPU sample needs gpu_uuid or gpu_index")
        return self

    @property
    def gpu_id(self) -> str:
        """The GPU's id within its host: :func:`contracts.topics.gpu_id` (the UUID, else
        ``gpu<index>``)."""
        return gpu_id(self.gpu_uuid, self.gpu_index)

    @property
    def key(self) -> str:
        """GPU identity: :func:`contracts.topics.gpu_key` of :attr:`gpu_id` (``host/uuid[/gi]``,
        ``host/gpu<index>[/gi]`` without a UUID). Not the Kafka key: that is
        :attr:`partition_key`."""
        return gpu_key(self.host, self.gpu_id, self.gpu_instance_id)

    @property
    def partition_key(self) -> str:
        """Kafka record key on ``telemetry.gpu``: the host
        (:func:`contracts.topics.telemetry_partition_key`), so that a host's GPUs and InfiniBand
        ports share a partition number (:mod:`contracts.topics`)."""
        return telemetry_partition_key(self.host)


class GpuColumns(BaseModel):
    """The per-GPU members of the :class:`GpuSample` records of one read, one list per member,
    element ``i`` of every list belonging to GPU ``i`` (the record's ``gpus``).

    Every attribute has the meaning and units of the :class:`GpuSample` field of the same name;
    ``ts`` has one element per GPU and fixes the count ``n`` (at least 1). Every other list has
    ``n`` elements, or none: an empty list means the :class:`GpuSample` default for every GPU
    (``None``, or an empty map). Each GPU needs its ``gpu_uuid`` or its ``gpu_index`` (as a
    :class:`GpuSample` does).

    Attributes:
        ts: sample time of each GPU, Unix epoch seconds.
        gpu_uuid / gpu_index / gpu_instance_id / gpu_instance_profile / model_name: each GPU's.
        fields / field_series / invalid / attributes: each GPU's maps, as in :class:`GpuSample`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ts: list[float]
    gpu_uuid: list[str | None] = Field(default_factory=list)
    gpu_index: list[int | None] = Field(default_factory=list)
    gpu_instance_id: list[int | None] = Field(default_factory=list)
    gpu_instance_profile: list[str | None] = Field(default_factory=list)
    model_name: list[str | None] = Field(default_factory=list)
    fields: list[dict[str, float | int]] = Field(default_factory=list)
    field_series: list[dict[str, list[SeriesValue]]] = Field(default_factory=list)
    invalid: list[dict[str, str]] = Field(default_factory=list)
    attributes: list[dict[str, str]] = Field(default_factory=list)

    @model_validator(mode="after")
    def _aligned(self) -> Self:
        n = len(self.ts)
        if n == 0:
            raise ValueError("gpus.ts is empty: a GPU scrape holds at least one GPU")
        for name in GPU_COLUMNS_OPTIONAL:
            got = len(getattr(self, name))
            if got not in (0, n):
                raise ValueError(f"gpus.{name} has {got} elements, gpus.ts {n} (a column has n or none)")
        uuids, indexes = self.gpu_uuid, self.gpu_index
        if (uuids and all(uuids)) or (indexes and None not in indexes):
            return self  # every GPU has a UUID, or every GPU an index
        for i in range(n):
            if not (uuids and uuids[i]) and (not indexes or indexes[i] is None):
                raise ValueError(f"GPU {i} needs gpu_uuid or gpu_index")
        return self


GPU_COLUMNS_OPTIONAL: tuple[str, ...] = (
    "gpu_uuid",
    "gpu_index",
    "gpu_instance_id",
    "gpu_instance_profile",
    "model_name",
    "fields",
    "field_series",
    "invalid",
    "attributes",
)
"""The members of :class:`GpuColumns` that may be empty (= the default for every GPU)."""

GPU_SCRAPE_SHARED: tuple[str, ...] = ("host", "source", "target")
"""The :class:`GpuSample` fields a :class:`GpuScrape` holds once for all its GPUs."""


class GpuScrape(Record):
    """One read of one target's GPUs on one host: the :class:`GpuSample` records of that read in
    one Kafka record, the members that differ per GPU in columns (:class:`GpuColumns`).

    Carried on ``telemetry.gpu`` beside :class:`GpuSample` (older producers, replay files): a
    record whose JSON object has a top-level ``gpus`` member is a ``GpuScrape``, any other is a
    ``GpuSample``. ``schema_version`` follows :data:`contracts.base.SCHEMA_VERSION` like every
    record.

    Attributes:
        host: normalised host name of every GPU (the Kafka key, :attr:`partition_key`).
        source: the source that produced every sample (as :attr:`GpuSample.source`).
        target: the scrape target (as :attr:`GpuSample.target`).
        seq: ``seq`` of GPU 0's sample; GPU ``i``'s is ``seq + i`` (per-producer numbering, to
            account for every sample end to end).
        gpus: the per-GPU members, one element per GPU (:class:`GpuColumns`).
    """

    host: str
    source: Literal["dcgm-exporter", "nvml", "nvidia-smi", "dcgmi"] = "dcgm-exporter"
    target: str = ""
    seq: int = 0
    gpus: GpuColumns

    def __len__(self) -> int:
        """Number of GPUs (samples) in the record."""
        return len(self.gpus.ts)

    @property
    def partition_key(self) -> str:
        """Kafka record key on ``telemetry.gpu``: the host, as for :class:`GpuSample`."""
        return telemetry_partition_key(self.host)

    def samples(self) -> list[GpuSample]:
        """The :class:`GpuSample` of every GPU, in column order (GPU ``i`` with ``seq + i``).

        Raises:
            pydantic.ValidationError: a GPU's sample is not a valid :class:`GpuSample` (a record
                built without validation, e.g. by ``model_construct``).
        """
        cols = self.gpus
        out = []
        for i in range(len(cols.ts)):
            sample: dict[str, object] = {
                "ts": cols.ts[i],
                "host": self.host,
                "source": self.source,
                "target": self.target,
                "seq": self.seq + i,
            }
            for name in GPU_COLUMNS_OPTIONAL:
                column = getattr(cols, name)
                if column:
                    sample[name] = column[i]
            out.append(GpuSample.model_validate(sample))
        return out


def gpu_scrapes(samples: Sequence[GpuSample]) -> list[GpuScrape]:
    """``samples`` as :class:`GpuScrape` records: consecutive samples with the same ``host``,
    ``source``, ``target`` and ``schema_version`` and consecutive ``seq`` numbers share a record,
    in order, so that ``[s for r in gpu_scrapes(x) for s in r.samples()] == list(x)``. A column
    whose every element is the default is left empty. The records are built from the samples'
    values without validating them again (valid samples make a valid record).
    """
    out: list[GpuScrape] = []
    run: list[GpuSample] = []

    def flush() -> None:
        if not run:
            return
        first = run[0]
        columns: dict[str, Any] = {"ts": [s.ts for s in run]}
        for name in GPU_COLUMNS_OPTIONAL:
            values = [getattr(s, name) for s in run]
            columns[name] = values if any(v is not None and v != {} for v in values) else []
        # Valid samples make a valid record (columns of one length, every GPU identified):
        # built without validating every map again, every member given (no default factory).
        out.append(
            GpuScrape.model_construct(
                schema_version=first.schema_version,
                host=first.host,
                source=first.source,
                target=first.target,
                seq=first.seq,
                gpus=GpuColumns.model_construct(**columns),
            )
        )
        run.clear()

    for s in samples:
        if run:
            last = run[-1]
            same = (s.host, s.source, s.target, s.schema_version) == (
                last.host,
                last.source,
                last.target,
                last.schema_version,
            )
            if not same or s.seq != last.seq + 1:
                flush()
        run.append(s)
    flush()
    return out


def decode_gpu_samples(payload: bytes | str) -> list[GpuSample]:
    """The GPU samples of one ``telemetry.gpu`` record: those of a :class:`GpuScrape` (a JSON
    object with a top-level ``gpus`` member), else the one :class:`GpuSample`. Strict, like
    :func:`contracts.base.decode`.

    Raises:
        ValueError (``pydantic.ValidationError`` among them): not JSON, an invalid record or
            sample, another ``schema_version``.
    """
    obj = json.loads(payload)
    if isinstance(obj, dict) and "gpus" in obj:
        return decode(GpuScrape, payload).samples()
    return [decode(GpuSample, payload)]


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
        link_width: active link width as the IBTA names it: ``1X``, ``2X``, ``4X``, ``8X`` or
            ``12X``; ``None`` where the source does not say (``ibstat`` prints only the rate).
        link_speed: active per-lane speed: ``SDR``, ``DDR``, ``QDR``, ``FDR10``, ``FDR``, ``EDR``,
            ``HDR``, ``NDR``, ``XDR``; ``None`` where unknown (``???``, or not given).
        counters: PMA counters by PMA name, raw ``int``; ``PortXmitData``/``PortRcvData`` count
            4-octet words. ``None`` marks a counter that exists but could not be read (``N/A (no
            PMA)``, EINVAL, EACCES). Missing counters are absent, never 0.
        counter_bits: width of each counter as read (64 for extended, else 32/16/8/4).
        saturated: names of counters stuck at all-ones (a saturated PMA counter gives no rate).
        hw_counters: driver-specific ``hw_counters/`` values (RoCE congestion, irdma IP counters).
        source: ``sysfs``, ``perfquery`` (with ``ibnetdiscover``), ``ibstat`` (state, rate, no
            counters) or ``ufm-telemetry`` (UFM Telemetry's Prometheus endpoint).
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
    link_width: str | None = None
    link_speed: str | None = None
    counters: dict[str, int | None] = Field(default_factory=dict)
    counter_bits: dict[str, int] = Field(default_factory=dict)
    saturated: list[str] = Field(default_factory=list)
    hw_counters: dict[str, int | None] = Field(default_factory=dict)
    source: Literal["sysfs", "perfquery", "ibstat", "ufm-telemetry"] = "sysfs"
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


class NvSwitchSample(Record):
    """One scrape of one NVSwitch, as dcgm-exporter exports it (``{nvswitch="N"}`` series, and
    ``{nvswitch="N",nvlink="L"}`` per-link series): switches have no GPU UUID.

    Attributes:
        ts: sample time, Unix epoch seconds.
        host: normalised host name.
        nvswitch: the ``nvswitch`` label (the switch's index on its host).
        fields: valid values by DCGM field name (``DCGM_FI_DEV_NVSWITCH_*``); a per-link field
            holds its first link's value here and every link in ``field_series``.
        field_series: field name → one :class:`SeriesValue` per series (per ``nvlink``...).
        invalid: field name → reason, as in :class:`GpuSample`.
        attributes: the series' other labels.
        source: ``dcgm-exporter``.
        target: the scrape target.
        seq: per-producer sequence number.
    """

    ts: float
    host: str
    nvswitch: int
    fields: dict[str, float | int] = Field(default_factory=dict)
    field_series: dict[str, list[SeriesValue]] = Field(default_factory=dict)
    invalid: dict[str, str] = Field(default_factory=dict)
    attributes: dict[str, str] = Field(default_factory=dict)
    source: Literal["dcgm-exporter"] = "dcgm-exporter"
    target: str = ""
    seq: int = 0

    @property
    def key(self) -> str:
        """Switch identity: ``host/nvswitch<N>``."""
        return f"{self.host}/nvswitch{self.nvswitch}"

    @property
    def partition_key(self) -> str:
        """Kafka record key on ``telemetry.nvswitch``: the host, as on the other telemetry topics."""
        return telemetry_partition_key(self.host)
