"""Topology → leaf and uplinks (analytics.fabric_leaf): the mapping, the per-leaf figures and the
offer gate, with their boundaries."""

from __future__ import annotations

import pytest

from analytics.fabric_leaf import (
    UPLINK_HEADROOM,
    UPLINK_XMIT_WAIT,
    LeafHeadroom,
    LeafMap,
    leaf_headroom,
    leaf_map,
    uplink_block_reason,
)
from contracts.fabric import FabricNode, FabricPort, FabricTopology


def _guid(n: int) -> str:
    return f"0x{n:016x}"


class _Fabric:
    """A small hand-wired fabric: switches and CAs by name, links by (name, port)."""

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[str, str, str]] = {}  # name -> (guid, type, description)
        self.links: list[tuple[str, int, str, int]] = []

    def switch(self, name: str, description: str | None = None) -> None:
        desc = name if description is None else description
        self.nodes[name] = (_guid(0x1000 + len(self.nodes)), "SW", desc)

    def ca(self, name: str, description: str) -> None:
        self.nodes[name] = (_guid(0x2000 + len(self.nodes)), "CA", description)

    def link(self, a: str, pa: int, b: str, pb: int) -> None:
        self.links.append((a, pa, b, pb))

    def guid(self, name: str) -> str:
        return self.nodes[name][0]

    def key(self, name: str, port: int) -> str:
        return f"{self.guid(name)}/{port}"

    def topology(self, down: tuple[tuple[str, int], ...] = ()) -> FabricTopology:
        ports: dict[str, list[FabricPort]] = {n: [] for n in self.nodes}
        for a, pa, b, pb in self.links:
            for x, px, y, py in ((a, pa, b, pb), (b, pb, a, pa)):
                if (x, px) in down:
                    ports[x].append(FabricPort(port=px, connected=False))
                    continue
                if (y, py) in down:
                    continue
                ports[x].append(FabricPort(port=px, connected=True, peer_guid=self.guid(y), peer_port=py))
        nodes = [
            FabricNode(
                guid=g,
                node_type=t,  # type: ignore[arg-type]
                lid=i + 1,
                description=d,
                ports=sorted(ports[n], key=lambda p: p.port),
            )
            for i, (n, (g, t, d)) in enumerate(self.nodes.items())
        ]
        return FabricTopology(ts=100.0, nodes=sorted(nodes, key=lambda n: n.guid))


@pytest.fixture
def fat_tree() -> _Fabric:
    """2 spines × 2 leaves, 2 hosts per leaf, one rail-optimised host on both leaves, an edge
    gateway on leaf-1 and a lone leaf-3 with one host and no uplink."""
    f = _Fabric()
    for s in ("spine-1", "spine-2", "leaf-1", "leaf-2", "leaf-3"):
        f.switch(s)
    for h in ("node001", "node002", "node003", "node004"):
        f.ca(h, f"{h} mlx5_0")
    f.ca("rail-a", "node005 mlx5_0")
    f.ca("rail-b", "node005 mlx5_1")
    f.ca("gw", "edge-gw mlx5_0")
    f.ca("node006", "node006 mlx5_0")
    f.link("node001", 1, "leaf-1", 1)
    f.link("node002", 1, "leaf-1", 2)
    f.link("node003", 1, "leaf-2", 1)
    f.link("node004", 1, "leaf-2", 2)
    f.link("rail-a", 1, "leaf-1", 3)
    f.link("rail-b", 1, "leaf-2", 3)
    f.link("gw", 1, "leaf-1", 4)
    f.link("node006", 1, "leaf-3", 1)
    for li, leaf in enumerate(("leaf-1", "leaf-2")):
        for si, spine in enumerate(("spine-1", "spine-2")):
            f.link(leaf, 10 + si, spine, 1 + li)
    return f


def test_each_host_gets_the_leaf_its_hca_is_cabled_to(fat_tree: _Fabric) -> None:
    m = leaf_map(fat_tree.topology())
    assert m.leaf_of == {
        "node001": "leaf-1",
        "node002": "leaf-1",
        "node003": "leaf-2",
        "node004": "leaf-2",
        "node005": "leaf-1+leaf-2",  # rail-optimised: one HCA per leaf
        "edge-gw": "leaf-1",
        "node006": "leaf-3",
    }
    assert m.ts == 100.0


def test_uplinks_are_both_ends_of_every_switch_to_switch_link(fat_tree: _Fabric) -> None:
    f = fat_tree
    m = leaf_map(f.topology())
    assert m.uplinks["leaf-1"] == tuple(
        sorted([f.key("leaf-1", 10), f.key("spine-1", 1), f.key("leaf-1", 11), f.key("spine-2", 1)])
    )
    assert m.uplinks["leaf-2"] == tuple(
        sorted([f.key("leaf-2", 10), f.key("spine-1", 2), f.key("leaf-2", 11), f.key("spine-2", 2)])
    )
    assert m.uplinks["leaf-3"] == ()  # no uplink: nothing to measure
    assert set(m.uplinks["leaf-1+leaf-2"]) == set(m.uplinks["leaf-1"]) | set(m.uplinks["leaf-2"])
    # host-facing ports and the spines themselves are never uplinks of a leaf
    assert f.key("leaf-1", 1) not in m.uplink_ports() and "spine-1" not in m.uplinks


def test_a_link_that_is_down_is_not_an_uplink_and_a_lone_hca_has_no_leaf(fat_tree: _Fabric) -> None:
    f = fat_tree
    m = leaf_map(f.topology(down=(("leaf-1", 11), ("node002", 1))))
    assert f.key("leaf-1", 11) not in m.uplinks["leaf-1"] and f.key("spine-2", 1) not in m.uplinks["leaf-1"]
    assert len(m.uplinks["leaf-1"]) == 2
    assert "node002" not in m.leaf_of


def test_duplicate_or_empty_switch_descriptions_fall_back_to_the_guid() -> None:
    f = _Fabric()
    f.switch("a", "MF0;switch:MQM8700/U1")
    f.switch("b", "MF0;switch:MQM8700/U1")
    f.switch("c", "")
    f.switch("d", "unique-leaf")
    for i, sw in enumerate("abcd"):
        f.ca(f"h{i}", f"host{i} mlx5_0")
        f.link(f"h{i}", 1, sw, 1)
    m = leaf_map(f.topology())
    assert m.leaf_of == {
        "host0": f.guid("a"),
        "host1": f.guid("b"),
        "host2": f.guid("c"),
        "host3": "unique-leaf",
    }


def test_empty_topology_maps_nothing() -> None:
    m = leaf_map(FabricTopology(ts=1.0))
    assert m.leaf_of == {} and m.uplinks == {} and m.uplink_ports() == set()
    assert LeafMap().uplink_ports() == set()


def test_leaf_headroom_is_the_busiest_uplink_and_the_worst_wait(fat_tree: _Fabric) -> None:
    f = fat_tree
    m = leaf_map(f.topology())
    ports = {
        f.key("leaf-1", 10): (0.70, 0.01),
        f.key("spine-1", 1): (0.65, 0.30),  # the same link read from the spine: busier direction
        f.key("leaf-1", 11): (0.90, None),
        f.key("spine-2", 1): (None, 0.02),  # no valid utilisation interval yet
        f.key("leaf-1", 1): (0.01, 0.99),  # a host-facing port: not an uplink, ignored
    }
    got = leaf_headroom(m, ports)
    assert got["leaf-1"] == LeafHeadroom(headroom=0.65, xmit_wait=0.30, ports=4)
    assert got["leaf-1+leaf-2"] == LeafHeadroom(headroom=0.65, xmit_wait=0.30, ports=4)
    assert "leaf-2" not in got and "leaf-3" not in got  # no uplink read: unknown


def test_leaf_with_rows_but_no_valid_figure_is_known_to_be_unknown(fat_tree: _Fabric) -> None:
    f = fat_tree
    got = leaf_headroom(leaf_map(f.topology()), {f.key("leaf-2", 10): (None, None)})
    assert got["leaf-2"] == LeafHeadroom(headroom=None, xmit_wait=None, ports=1)
    assert uplink_block_reason(got["leaf-2"], lent_share=0.9, max_xmit_wait=0.0) is None


@pytest.mark.parametrize(
    ("headroom", "lent_share", "blocked"),
    [
        (0.20, 0.20, False),  # exactly the lent share left: room
        (0.1999, 0.20, True),
        (0.0, 0.0, False),  # lent_share 0 turns the check off ...
        (-0.3, 0.0, False),  # ... even for a link above its nominal rate
        (-0.3, 0.01, True),
        (1.0, 1.0, False),
    ],
)
def test_uplink_headroom_gate_boundaries(headroom: float, lent_share: float, blocked: bool) -> None:
    fig = LeafHeadroom(headroom=headroom, xmit_wait=0.0, ports=2)
    want = UPLINK_HEADROOM if blocked else None
    assert uplink_block_reason(fig, lent_share=lent_share, max_xmit_wait=0.5) == want


@pytest.mark.parametrize(
    ("xmit_wait", "limit", "blocked"),
    [
        (0.5, 0.5, False),  # at the limit: not above it
        (0.5001, 0.5, True),
        (1.0, 1.0, False),  # 1 turns the check off
        (0.0, 0.0, False),
        (0.0001, 0.0, True),
    ],
)
def test_uplink_xmit_wait_gate_boundaries(xmit_wait: float, limit: float, blocked: bool) -> None:
    fig = LeafHeadroom(headroom=0.9, xmit_wait=xmit_wait, ports=2)
    want = UPLINK_XMIT_WAIT if blocked else None
    assert uplink_block_reason(fig, lent_share=0.2, max_xmit_wait=limit) == want


def test_headroom_reason_wins_and_unknown_never_blocks() -> None:
    both = LeafHeadroom(headroom=0.05, xmit_wait=0.9, ports=2)
    assert uplink_block_reason(both, lent_share=0.2, max_xmit_wait=0.5) == UPLINK_HEADROOM
    assert uplink_block_reason(None, lent_share=1.0, max_xmit_wait=0.0) is None
