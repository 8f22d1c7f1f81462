"""Leaf switches and their uplinks, from a fabric topology snapshot (pure logic).

From one :class:`contracts.fabric.FabricTopology` (``ibnetdiscover -p``, published by the
switch-side fabric collector to ``fabric.topology``), :func:`leaf_map` derives:

* **each host's leaf**: the switch (or switches) its HCA ports are cabled to. A host is the first
  word of a CA's node description (:func:`contracts.fabric.split_description`: rdma-ndd's
  ``%h %d``), the name its GPU samples carry. A host whose HCAs reach several switches (a
  rail-optimised fabric: HCA *i* of every node on leaf *i*) gets the sorted names joined by
  ``+`` (``leaf-1+leaf-2``): nodes with the same name sit under the same set of leaves, so traffic
  between them never leaves those leaves, which is what leaf-local matching needs.
* **each leaf's uplinks**: the ports of the leaf switch cabled to another switch (or router),
  and the peer port at the other end of each such link. Both ends are read: utilisation is the
  same link seen from either side, while PortXmitWait is per direction (the leaf's end waits to
  send up, the spine's end to send down into the leaf).

A leaf's name is the switch's node description when it is non-empty and no other switch has the
same description, else the switch's GUID (descriptions are set by the operator and need not be
unique).

:func:`leaf_headroom` folds the per-port figures of the analytics view ``fabric_headroom_over``
into one :class:`LeafHeadroom` per leaf: the headroom of its busiest uplink (least
``port_headroom``: 1 − p95 utilisation in the busier direction) and the worst XmitWait fraction
among its uplink ports. :func:`uplink_block_reason` decides whether that leaves room for lent
traffic (the share of a link lent traffic may take, ``[broker] lent_share``).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from contracts.fabric import FabricNode, FabricTopology, split_description
from contracts.topics import ib_port_key

__all__ = [
    "UPLINK_HEADROOM",
    "UPLINK_XMIT_WAIT",
    "LeafHeadroom",
    "LeafMap",
    "leaf_headroom",
    "leaf_map",
    "uplink_block_reason",
]

UPLINK_HEADROOM = "leaf_uplink_headroom"
"""Reason of an idle GPU held back because its leaf's busiest uplink has less headroom than the lent share."""
UPLINK_XMIT_WAIT = "leaf_uplink_xmit_wait"
"""Reason of an idle GPU held back because an uplink of its leaf waits for credits above the limit."""


@dataclass(frozen=True, slots=True)
class LeafMap:
    """Hosts → leaf, leaf → uplink ports, from one topology snapshot.

    Attributes:
        leaf_of: host name → leaf name (``a+b`` for a host cabled to several leaves).
        uplinks: leaf name → port keys (:func:`contracts.topics.ib_port_key`) of both ends of its
            switch-to-switch links, sorted; a leaf with no uplink (a one-switch fabric) maps to ``()``.
        ts: the snapshot's discovery time (Unix s); 0 for an empty map.
    """

    leaf_of: dict[str, str] = field(default_factory=dict)
    uplinks: dict[str, tuple[str, ...]] = field(default_factory=dict)
    ts: float = 0.0

    def uplink_ports(self) -> set[str]:
        """Every uplink port key of every leaf."""
        return {k for keys in self.uplinks.values() for k in keys}


@dataclass(frozen=True, slots=True)
class LeafHeadroom:
    """Training's use of one leaf's uplinks over the headroom window.

    Attributes:
        headroom: least ``port_headroom`` among the uplink ports (0..1, not clamped: a p95 above
            the nominal rate gives a negative value); ``None`` when no uplink port has a valid
            interval yet.
        xmit_wait: largest ``xmit_wait_fraction`` among the uplink ports (0..1); ``None`` if unknown.
        ports: uplink ports with a row in the window.
    """

    headroom: float | None
    xmit_wait: float | None
    ports: int


def _switch_names(switches: Iterable[FabricNode]) -> dict[str, str]:
    """Switch GUID → leaf name: its description when non-empty and unique among switches, else its GUID."""
    nodes = list(switches)
    counts = Counter(n.description.strip() for n in nodes)
    names = {}
    for n in nodes:
        desc = n.description.strip()
        names[n.guid] = desc if desc and counts[desc] == 1 else n.guid
    return names


def leaf_map(topology: FabricTopology) -> LeafMap:
    """The :class:`LeafMap` of ``topology`` (module docstring). Pure; never raises on a
    well-typed record: ports whose peer is not in the snapshot are ignored."""
    nodes = {n.guid: n for n in topology.nodes}
    switch_types = ("SW", "RT")
    names = _switch_names(n for n in topology.nodes if n.node_type == "SW")
    leaves_of: dict[str, set[str]] = defaultdict(set)
    for node in topology.nodes:
        if node.node_type != "CA":
            continue
        host, _ = split_description("CA", node.description)
        if not host:
            continue
        for port in node.ports:
            peer = nodes.get(port.peer_guid or "") if port.connected else None
            if peer is not None and peer.node_type == "SW":
                leaves_of[host].add(peer.guid)
    leaf_guids = {g for guids in leaves_of.values() for g in guids}
    uplinks: dict[str, tuple[str, ...]] = {}
    for guid in sorted(leaf_guids):
        keys: set[str] = set()
        for port in nodes[guid].ports:
            peer = nodes.get(port.peer_guid or "") if port.connected else None
            if peer is None or peer.node_type not in switch_types or port.peer_port is None:
                continue
            keys.add(ib_port_key(guid, port.port))
            keys.add(ib_port_key(peer.guid, port.peer_port))
        uplinks[names[guid]] = tuple(sorted(keys))
    leaf_of: dict[str, str] = {}
    for host, guids in leaves_of.items():
        name = "+".join(sorted(names[g] for g in guids))
        leaf_of[host] = name
        if len(guids) > 1:
            uplinks[name] = tuple(sorted({k for g in guids for k in uplinks[names[g]]}))
    return LeafMap(leaf_of=leaf_of, uplinks=uplinks, ts=topology.ts)


def leaf_headroom(
    leaves: LeafMap, ports: Mapping[str, tuple[float | None, float | None]]
) -> dict[str, LeafHeadroom]:
    """Per leaf of ``leaves``, its uplinks' :class:`LeafHeadroom`.

    Args:
        leaves: the leaf map.
        ports: port key → ``(port_headroom, xmit_wait_fraction)`` as the view
            ``fabric_headroom_over`` gives them (``None`` = unknown); ports absent from it have
            no reads in the window.

    Returns:
        leaf name → figures; a leaf with no uplink port in ``ports`` is absent (unknown).
    """
    out: dict[str, LeafHeadroom] = {}
    for leaf, keys in leaves.uplinks.items():
        rows = [ports[k] for k in keys if k in ports]
        if not rows:
            continue
        heads = [h for h, _ in rows if h is not None]
        waits = [w for _, w in rows if w is not None]
        out[leaf] = LeafHeadroom(
            headroom=min(heads) if heads else None,
            xmit_wait=max(waits) if waits else None,
            ports=len(rows),
        )
    return out


def uplink_block_reason(
    figures: LeafHeadroom | None, *, lent_share: float, max_xmit_wait: float
) -> str | None:
    """Why a node under a leaf with ``figures`` must not be offered, or ``None`` when it may be.

    * :data:`UPLINK_HEADROOM` when ``lent_share > 0`` and the busiest uplink's known headroom is
      below ``lent_share``: training leaves less of the link free than lent traffic may take;
    * :data:`UPLINK_XMIT_WAIT` when the worst known XmitWait fraction is above ``max_xmit_wait``
      (1 never blocks): the uplinks already wait for credits, lent traffic would add to it.

    Unknown figures (``None``, or ``None`` fields) never block, as unknown node headroom.
    """
    if figures is None:
        return None
    if lent_share > 0 and figures.headroom is not None and figures.headroom < lent_share:
        return UPLINK_HEADROOM
    if figures.xmit_wait is not None and figures.xmit_wait > max_xmit_wait:
        return UPLINK_XMIT_WAIT
    return None
