"""Turn parsed fabric output into contract records: :class:`IbPortSample` and :class:`FabricTopology`.

Port state comes from discovery (``ibnetdiscover -p``): a listed port with a peer has its
physical link up (``phys_state`` 5 ``LinkUp``; the logical state, INIT..ACTIVE, is not in that
output and stays ``None``); a port without a peer, or one seen connected before and missing now,
is down (``state`` 1 ``DOWN``; its physical state, Polling/Disabled/Sleep, is unknown).

Host of a fabric-read port (:func:`contracts.fabric.split_description`), which is also its Kafka key on
``telemetry.ib_port`` (:attr:`contracts.telemetry.IbPortSample.partition_key`): an HCA's host is
the first word of its node description, the host name its GPU samples carry (when rdma-ndd's
``%h`` and dcgm-exporter's ``Hostname`` agree, as node headroom needs anyway), so its ports
land on the partition of that host's GPUs and count in the host's node headroom (analytics view
``node_headroom_over``: the least headroom among the ports whose ``host`` is the GPU's host) as
if read from sysfs. A switch's ports carry the switch's whole description as host: they stay
together on one partition, match no GPU host and so never enter a node's headroom. Node headroom
is about the host's own links, and the leaf port facing a host reads the same link from the other
end: the HCA port's PortXmitData and PortRcvData already give both directions (the view takes the
busier). Attributing switch ports to hosts would need the topology (peer GUIDs) at the producer
and would put a switch's uplinks nowhere; they stay in ``fabric_headroom`` for the fabric view.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from collectors.fabric_parse import PerfqueryBlock, Topology, TopologyNode, link_rate_bytes_per_second
from collectors.ib_counters import link_width_speed
from contracts.fabric import FabricLink, FabricNode, FabricPort, FabricTopology, split_description
from contracts.telemetry import IbPortSample

__all__ = ["port_sample", "split_description", "topology_record"]

_KIND_PRIORITY = {"extended": 0, "legacy": 1}


def topology_record(topo: Topology, *, ts: float, seq: int = 0) -> FabricTopology:
    """The :class:`FabricTopology` of a parsed ``ibnetdiscover -p`` (nodes by GUID, links sorted)."""
    nodes = []
    for guid, n in sorted(topo.nodes().items()):
        ports = [
            FabricPort(
                port=p.port,
                connected=p.connected,
                width=p.width,
                speed=p.speed,
                rate_bytes_per_second=p.rate_bytes_per_second,
                peer_guid=p.peer_guid,
                peer_port=p.peer_port,
            )
            for _, p in sorted(n.ports.items())
        ]
        node_type: Literal["SW", "CA", "RT"] = (
            "SW" if n.node_type == "SW" else "RT" if n.node_type == "RT" else "CA"
        )
        nodes.append(FabricNode(guid=guid, node_type=node_type, lid=n.lid, description=n.name, ports=ports))
    links = [
        FabricLink(
            a_guid=lk.a_guid,
            a_port=lk.a_port,
            b_guid=lk.b_guid,
            b_port=lk.b_port,
            width=lk.width,
            speed=lk.speed,
            rate_bytes_per_second=link_rate_bytes_per_second(lk.width, lk.speed),
        )
        for lk in topo.links()
    ]
    return FabricTopology(ts=ts, nodes=nodes, links=links, problems=len(topo.problems), seq=seq)


def port_sample(
    node: TopologyNode, port: int, blocks: Iterable[PerfqueryBlock], *, ts: float, seq: int = 0
) -> IbPortSample:
    """One :class:`IbPortSample` (``source="perfquery"``) for ``node``'s ``port``.

    ``blocks`` are this port's perfquery blocks; when several attributes carry the same counter,
    the extended (64-bit) value wins over the legacy one. Counters are raw ``int`` by PMA name,
    ``counter_bits`` their width, ``saturated`` those stuck at all ones.
    """
    counters: dict[str, int | None] = {}
    bits: dict[str, int] = {}
    saturated: list[str] = []
    for b in sorted(blocks, key=lambda b: _KIND_PRIORITY.get(b.kind, 2)):
        for name, value in b.counters.items():
            if name in counters:
                continue
            counters[name] = value
            width = b.counter_bits.get(name)
            if width is not None:
                bits[name] = width
                if value == (1 << width) - 1:
                    saturated.append(name)
    host, device = split_description(node.node_type, node.name)
    tp = node.ports.get(port)
    up = tp is not None and tp.connected
    link_width, link_speed = link_width_speed(tp.width, tp.speed) if up and tp is not None else (None, None)
    return IbPortSample(
        ts=ts,
        host=host,
        device=device,
        node_guid=node.guid,
        port=port,
        link_layer="InfiniBand",
        state_id=None if up else 1,
        state=None if up else "DOWN",
        phys_state_id=5 if up else None,
        phys_state="LinkUp" if up else None,
        rate_bytes_per_second=tp.rate_bytes_per_second if up and tp is not None else None,
        link_width=link_width,
        link_speed=link_speed,
        counters=counters,
        counter_bits=bits,
        saturated=saturated,
        source="perfquery",
        seq=seq,
    )
