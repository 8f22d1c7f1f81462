"""InfiniBand fabric topology snapshots (collectors → ``fabric.topology``, compacted, key ``topology``).

Built from ``ibnetdiscover -p`` (infiniband-diags): every node with its ports, and every link once.
The newest record is the fabric as last discovered; analytics uses it to map a host's HCA port to
its leaf and the path to the edge gateway, the fabric manager to find port GUIDs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from contracts.base import Record

TOPOLOGY_KEY = "topology"
"""The one Kafka key of ``fabric.topology``: compaction keeps only the newest snapshot."""


def split_description(node_type: str, description: str) -> tuple[str, str]:
    """``(host, device)`` of a node description (NodeDescription, IBTA vol. 1 14.2.5.2).

    CA descriptions are ``"<host> <device>"`` by default (rdma-ndd's ``%h %d``): split at the first
    space. A switch, router or one-word CA description is both host and device. The host is the
    Kafka key of a port read from the fabric (:mod:`collectors.fabric_records`) and the name
    analytics joins a CA to the GPUs of that host by (:mod:`analytics.fabric_leaf`).
    """
    if node_type == "CA":
        host, sep, device = description.partition(" ")
        if sep and host and device.strip():
            return host, device.strip()
    return description, description


class FabricPort(Record):
    """One port of a node as discovered.

    Attributes:
        port: port number (switch ports 1..N, CA ports 1..n).
        connected: a peer was discovered (the physical link is up); ``False`` = down.
        width / speed: active link width (``4x``) and speed (``EDR``); ``None`` if unknown (``???``).
        rate_bytes_per_second: nominal data rate (lanes × per-lane Gb/s × 125000000), ``None`` if
            width or speed is unknown.
        peer_guid / peer_port: the other end when connected.
    """

    port: int = Field(ge=0, le=255)
    connected: bool
    width: str | None = None
    speed: str | None = None
    rate_bytes_per_second: int | None = None
    peer_guid: str | None = None
    peer_port: int | None = None


class FabricNode(Record):
    """A switch (``SW``), channel adapter (``CA``) or router (``RT``).

    Attributes:
        guid: ``0x`` + 16 lowercase hex digits as ``ibnetdiscover -p`` prints it: the node GUID of
            a switch, the port GUID of a CA's port (on Mellanox HCAs port 1's GUID equals the node
            GUID; ibsim numbers them node GUID + port).
        node_type: ``SW``, ``CA`` or ``RT``.
        lid: LID (a switch's port 0; a CA port's own LID); 0 when not assigned yet.
        description: NodeDescription (HCAs: ``"<host> <device>"`` by rdma-ndd's default).
        ports: the node's ports, by port number.
    """

    guid: str
    node_type: Literal["SW", "CA", "RT"]
    lid: int = Field(ge=0, le=0xFFFF)
    description: str
    ports: list[FabricPort] = Field(default_factory=list)


class FabricLink(Record):
    """An undirected link, ends ordered so that ``(a_guid, a_port) < (b_guid, b_port)``."""

    a_guid: str
    a_port: int
    b_guid: str
    b_port: int
    width: str | None = None
    speed: str | None = None
    rate_bytes_per_second: int | None = None


class FabricTopology(Record):
    """One discovery of the whole fabric; keyed :data:`TOPOLOGY_KEY` on a compacted topic.

    Attributes:
        ts: discovery time, Unix epoch seconds.
        nodes: every node seen, sorted by GUID.
        links: every connected link once, sorted.
        source: the tool it came from.
        problems: lines of the tool's output that did not parse (counted by the collector).
        seq: per-producer sequence number.
    """

    ts: float
    nodes: list[FabricNode] = Field(default_factory=list)
    links: list[FabricLink] = Field(default_factory=list)
    source: Literal["ibnetdiscover"] = "ibnetdiscover"
    problems: int = 0
    seq: int = 0

    @property
    def key(self) -> str:
        """Kafka key: always :data:`TOPOLOGY_KEY`."""
        return TOPOLOGY_KEY
