"""Names of every Kafka and MQTT topic, in one place.

Kafka record keys (what the partition is chosen from: murmur2 of the key bytes modulo the partition
count, :func:`contracts.bus.partition_for`): ``telemetry.gpu`` and ``telemetry.ib_port`` are both
keyed by the **host** (:func:`telemetry_partition_key`), ``capacity`` by :func:`gpu_key`,
``leases.log`` by ``lease_id`` (a compacted topic), ``pool.demand`` by ``demand_id``.

Why the host, for both telemetry topics: the two topics are created with the same partition count,
so a host's GPU samples and its InfiniBand port samples land on the same partition number, and a
co-partitioning assignor (Kafka's range assignor; the in-process bus does the same) gives partition
``p`` of both topics to the same consumer of a group. One analytics instance then holds every GPU
*and* every port of a host, which node headroom (the analytics view ``node_headroom_over``: the
least headroom among a host's ports) needs. Records of one host stay in order; so do records of
one GPU or one port, which is all a consumer relies on.

The Kafka key is not the record's identity: a GPU is still :func:`gpu_key` (``host/uuid[/gi]``),
a port :func:`ib_port_key` (``node_guid/port``); the records expose both (``key`` for identity,
``partition_key`` for the Kafka key: :class:`contracts.telemetry.GpuSample`,
:class:`contracts.telemetry.IbPortSample`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def gpu_id(gpu_uuid: str | None, gpu_index: int | None) -> str:
    """A GPU's id within its host: its UUID, else ``gpu<index>`` (a source that gives no UUID,
    e.g. an older or trimmed exporter, still gives the ``gpu`` index). A UUID never looks like
    ``gpu<index>`` (it starts with ``GPU-`` or ``MIG-``).

    Raises:
        ValueError: neither is given.
    """
    if gpu_uuid:
        return gpu_uuid
    if gpu_index is None:
        raise ValueError("a GPU needs a UUID or an index")
    return f"gpu{gpu_index}"


def gpu_key(host: str, gpu_uuid: str, gpu_instance_id: int | None = None) -> str:
    """Identity of one GPU or one MIG GPU instance: ``host/uuid`` or ``host/uuid/gi``
    (``gpu_uuid`` is :func:`gpu_id`: ``host/gpu<index>`` for a GPU known without a UUID).

    A MIG GPU instance is a GPU of its own for idle detection and leasing.
    """
    base = f"{host}/{gpu_uuid}"
    return base if gpu_instance_id is None else f"{base}/{gpu_instance_id}"


def lease_hosts(hosts: Sequence[str], gpu_keys: Iterable[str]) -> tuple[str, ...]:
    """The nodes of a lease: ``hosts`` as its log record or MQTT message carries them (sorted by
    the broker), else, for one of a broker that did not send them, the host part of each of its
    GPU keys (:func:`gpu_key`: before the first ``/``), sorted and unique."""
    if hosts:
        return tuple(hosts)
    return tuple(sorted({key.partition("/")[0] for key in gpu_keys}))


def ib_port_key(node_guid: str, port: int) -> str:
    """Identity of one InfiniBand port: ``node_guid/port`` (GUID as ``0x`` + 16 hex digits)."""
    return f"{node_guid}/{port}"


def telemetry_partition_key(host: str) -> str:
    """Kafka record key of ``telemetry.gpu`` and ``telemetry.ib_port``: the host name, as is.

    ``host`` is the record's ``host`` field: the normalised host name of a GPU sample, the host of
    a port read from sysfs, and for a port read from the fabric (perfquery) the first word of its
    node description for an HCA (rdma-ndd's ``%h %d``: the same host name) or the whole description
    for a switch. It must be spelled the same on both topics for a host's records to meet: that is
    also what joins GPUs to their ports in ``node_headroom_over``. Keying by a function (rather
    than using the field at each producer) keeps one definition for both topics.
    """
    return host


@dataclass(frozen=True)
class KafkaTopics:
    """Kafka topic names; ``prefix`` lets several deployments (or tests) share one cluster."""

    prefix: str = ""

    @property
    def telemetry_gpu(self) -> str:
        """GPU samples (:class:`contracts.telemetry.GpuSample`), keyed by host
        (:func:`telemetry_partition_key`); same partition count as :attr:`telemetry_ib_port`."""
        return f"{self.prefix}telemetry.gpu"

    @property
    def telemetry_ib_port(self) -> str:
        """InfiniBand port samples (:class:`contracts.telemetry.IbPortSample`), keyed by host
        (:func:`telemetry_partition_key`); same partition count as :attr:`telemetry_gpu`."""
        return f"{self.prefix}telemetry.ib_port"

    @property
    def telemetry_nvswitch(self) -> str:
        """NVSwitch samples (:class:`contracts.telemetry.NvSwitchSample`), keyed by host."""
        return f"{self.prefix}telemetry.nvswitch"

    @property
    def telemetry_scheduler(self) -> str:
        """Training-scheduler state per node (:class:`contracts.scheduler.SchedulerNode`), keyed
        by host (:func:`telemetry_partition_key`); same partition count as :attr:`telemetry_gpu`."""
        return f"{self.prefix}telemetry.scheduler"

    @property
    def fabric_topology(self) -> str:
        """Fabric topology snapshots (compacted)."""
        return f"{self.prefix}fabric.topology"

    @property
    def capacity(self) -> str:
        """Per-GPU capacity updates (:class:`contracts.capacity.CapacityUpdate`)."""
        return f"{self.prefix}capacity"

    @property
    def pool_demand(self) -> str:
        """Training wants GPUs back (:class:`contracts.capacity.PoolDemand`)."""
        return f"{self.prefix}pool.demand"

    @property
    def leases_log(self) -> str:
        """Every lease transition (:class:`contracts.leases.LeaseLogRecord`), compacted by lease_id."""
        return f"{self.prefix}leases.log"

    def all(self) -> list[str]:
        """Every topic name, for creating them up front."""
        return [
            self.telemetry_gpu,
            self.telemetry_ib_port,
            self.telemetry_nvswitch,
            self.telemetry_scheduler,
            self.fabric_topology,
            self.capacity,
            self.pool_demand,
            self.leases_log,
        ]


@dataclass(frozen=True)
class MqttTopics:
    """MQTT topic names under ``root`` (default ``gpupool/v1``); see DESIGN.md "Broker protocol"."""

    root: str = "gpupool/v1"

    def offer(self, offer_id: str) -> str:
        """Retained offer, QoS 1; an empty retained payload withdraws it."""
        return f"{self.root}/offers/{offer_id}"

    @property
    def offers_filter(self) -> str:
        """Subscription filter for every offer."""
        return f"{self.root}/offers/+"

    def claims(self, site: str) -> str:
        """A site's claims (site → broker)."""
        return f"{self.root}/sites/{site}/claims"

    def lease(self, site: str, lease_id: str) -> str:
        """Retained lease state (broker → site)."""
        return f"{self.root}/sites/{site}/leases/{lease_id}"

    def leases_filter(self, site: str) -> str:
        """Subscription filter for one site's leases."""
        return f"{self.root}/sites/{site}/leases/+"

    def renewals(self, site: str) -> str:
        """Lease heartbeats (site → broker)."""
        return f"{self.root}/sites/{site}/renewals"

    def releases(self, site: str) -> str:
        """Early releases (site → broker)."""
        return f"{self.root}/sites/{site}/releases"

    def replies(self, site: str) -> str:
        """Rejections and acknowledgements with a reason code (broker → site)."""
        return f"{self.root}/sites/{site}/replies"

    def site_state(self, site: str) -> str:
        """A site's retained birth/death message (its Last Will)."""
        return f"{self.root}/sites/{site}/state"

    @property
    def broker_state(self) -> str:
        """The broker's retained birth/death message (its Last Will)."""
        return f"{self.root}/broker/state"

    @property
    def site_inbound_filters(self) -> list[str]:
        """What the broker subscribes to: every site's claims, renewals, releases and state."""
        return [
            f"{self.root}/sites/+/claims",
            f"{self.root}/sites/+/renewals",
            f"{self.root}/sites/+/releases",
            f"{self.root}/sites/+/state",
        ]

    def parse_site(self, topic: str) -> tuple[str, str] | None:
        """Split ``{root}/sites/{site}/{kind}`` into ``(site, kind)``; ``None`` if it is not one."""
        prefix = f"{self.root}/sites/"
        if not topic.startswith(prefix):
            return None
        parts = topic[len(prefix):].split("/")
        if len(parts) != 2 or not parts[0]:
            return None
        return parts[0], parts[1]
