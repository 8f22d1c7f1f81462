"""Generate an ibsim net file for a two-level fat tree, and a JSON description of it.

Format written (ibsim ``ibsim/sim_net.c`` ``parse_netconf``; examples in Debian
``/usr/share/doc/ibsim-utils/net-examples``)::

    switchguid=0x<hex>                     # absolute GUID of the next Switch
    Switch <nports> "<nodeid>" # "<node description>"
    [<local port>] "<remote nodeid>"[<remote port>]
    ...                                    # one line per connected port; a blank line ends the record
    caguid=0x<hex>                         # absolute node GUID of the next Hca (port GUID = node + port)
    Hca <nports> "<nodeid>" # "<node description>"
    [1] "<switch nodeid>"[<switch port>]	# "<peer description>" lid 0 4x<speed>

The trailing ``# "<peer description>" lid 0 <width>x<speed>`` of a port line is what ibnetdiscover
writes; ibsim 0.10 reads the link width and enabled speed from it (``parse_port_connection_data``,
``parse_port_link_width_and_speed``) and warns "cannot parse remote lid and connection type" when
it is missing. ``lid 0`` leaves LID assignment to OpenSM.

Each connection is written from both ends, as ibsim requires. The node id (quoted after the type)
is ibsim's console handle (``PerformanceSet "leaf-1"[3] ...``); the node description is what the
fabric reports (``ibnetdiscover``, ``smpquery nodedesc``). Lines are kept under ibsim's 256-byte
``MAXLINE``; the ``#``/``@`` characters are reserved in node ids.

Wiring (deterministic):

* leaf ``l`` (1-based): ports ``1..hcas_per_leaf`` go to its HCAs (HCA port 1); port
  ``hcas_per_leaf + 1`` is the border port (leaf 1 only: the edge gateway HCA); ports
  ``hcas_per_leaf + 2 + (s-1)*uplinks + k`` (k = 0..uplinks-1) go to spine ``s``;
* spine ``s``: port ``(l-1)*uplinks + k + 1`` goes to leaf ``l``.

The first node written (spine-1) is ibsim's default attachment point, so OpenSM and the diags
run "on" spine-1's management port unless ``SIM_HOST`` says otherwise.

CLI: ``python gen_topology.py --out net [--json nodes.json] [--spines 2 --leaves 4 --hcas-per-leaf 4]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

SWITCH_GUID_BASE = 0x0002C90300A00000
"""First switch node GUID (Mellanox OUI 0x0002c9, a made-up device range)."""
HCA_GUID_BASE = 0x0002C90300B00000
"""First HCA node GUID; HCA ``i`` (0-based) gets ``HCA_GUID_BASE + 0x10 * i``."""


@dataclass(frozen=True)
class SimNode:
    """One node of the generated fabric.

    Attributes:
        nodeid: ibsim's node id (console handle), e.g. ``leaf-2`` or ``node007``.
        description: the NodeDescription the fabric reports, e.g. ``node007 mlx5_0``.
        kind: ``switch`` or ``hca``.
        role: ``spine``, ``leaf``, ``compute`` or ``edge-gateway``.
        guid: node GUID, ``0x`` + 16 lowercase hex digits; HCA port GUID = node GUID + port.
        ports: number of ports.
        leaf: for HCAs, the nodeid of the leaf it hangs off; ``None`` for switches.
        links: local port → ``[remote nodeid, remote port]``.
    """

    nodeid: str
    description: str
    kind: str
    role: str
    guid: str
    ports: int
    leaf: str | None = None
    links: dict[int, tuple[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class FatTree:
    """A generated fat tree: ``spines`` × ``leaves`` switches and their HCAs, plus the edge gateway."""

    spines: int
    leaves: int
    hcas_per_leaf: int
    uplinks: int
    switch_ports: int
    nodes: list[SimNode]

    def switches(self) -> list[SimNode]:
        """Spine and leaf switches, spines first."""
        return [n for n in self.nodes if n.kind == "switch"]

    def hcas(self) -> list[SimNode]:
        """Compute HCAs and the edge gateway."""
        return [n for n in self.nodes if n.kind == "hca"]


def _guid(value: int) -> str:
    return f"0x{value:016x}"


def build_fat_tree(
    spines: int = 2,
    leaves: int = 4,
    hcas_per_leaf: int = 4,
    *,
    uplinks: int = 1,
    switch_ports: int | None = None,
) -> FatTree:
    """Build the fat tree in memory.

    Args:
        spines: spine switches (>= 1).
        leaves: leaf switches (>= 1).
        hcas_per_leaf: compute HCAs under each leaf (>= 0).
        uplinks: parallel links between each leaf and each spine (>= 1).
        switch_ports: ports per switch; default: the smallest of 36/40/64/80/128/255 that fits.

    Raises:
        ValueError: a count is out of range or the wiring does not fit in ``switch_ports``
            (ibsim allows at most 255 ports per node).
    """
    if spines < 1 or leaves < 1 or hcas_per_leaf < 0 or uplinks < 1:
        raise ValueError("need spines >= 1, leaves >= 1, hcas_per_leaf >= 0, uplinks >= 1")
    leaf_need = hcas_per_leaf + 1 + spines * uplinks
    spine_need = leaves * uplinks
    need = max(leaf_need, spine_need)
    if switch_ports is None:
        switch_ports = next((p for p in (36, 40, 64, 80, 128, 255) if p >= need), need)
    if need > switch_ports or switch_ports > 255:
        raise ValueError(f"wiring needs {need} ports per switch; switch_ports={switch_ports} (max 255)")

    spine_ids = [f"spine-{s}" for s in range(1, spines + 1)]
    leaf_ids = [f"leaf-{i}" for i in range(1, leaves + 1)]
    # (nodeid, description, role, leaf) of every HCA, in GUID order; the edge gateway last
    hcas = [
        (f"node{h + 1:03d}", f"node{h + 1:03d} mlx5_0", "compute", leaf_ids[h // hcas_per_leaf])
        for h in range(leaves * hcas_per_leaf)
    ]
    hcas.append(("edge-gw", "edge-gw mlx5_0", "edge-gateway", leaf_ids[0]))

    links: dict[str, dict[int, tuple[str, int]]] = {n: {} for n in spine_ids + leaf_ids}

    def connect(a: str, pa: int, b: str, pb: int) -> None:
        links.setdefault(a, {})[pa] = (b, pb)
        links.setdefault(b, {})[pb] = (a, pa)

    for li, leaf in enumerate(leaf_ids):
        for si, spine in enumerate(spine_ids):
            for k in range(uplinks):
                connect(leaf, hcas_per_leaf + 2 + si * uplinks + k, spine, li * uplinks + k + 1)
    for h, (name, _, _, leaf) in enumerate(hcas[:-1]):
        connect(name, 1, leaf, h % hcas_per_leaf + 1)
    connect("edge-gw", 1, leaf_ids[0], hcas_per_leaf + 1)

    nodes = [
        SimNode(sid, sid, "switch", "spine" if sid in spine_ids else "leaf", _guid(SWITCH_GUID_BASE + i),
                switch_ports, None, links[sid])
        for i, sid in enumerate(spine_ids + leaf_ids)
    ]  # fmt: skip
    nodes += [
        SimNode(name, desc, "hca", role, _guid(HCA_GUID_BASE + 0x10 * h), 1, leaf, links[name])
        for h, (name, desc, role, leaf) in enumerate(hcas)
    ]
    return FatTree(spines, leaves, hcas_per_leaf, uplinks, switch_ports, nodes)


LINK_SPEEDS = ("SDR", "DDR", "QDR", "FDR", "EDR", "HDR", "NDR")
"""Speeds ibsim 0.10 accepts in a port line (``LINKSPEED_STR_*``)."""


def render_net(tree: FatTree, *, speed: str = "EDR") -> str:
    """The ibsim net file text for ``tree`` with 4x ``speed`` links (format: see the module docstring).

    Raises:
        ValueError: ``speed`` is not one of :data:`LINK_SPEEDS`.
    """
    if speed not in LINK_SPEEDS:
        raise ValueError(f"speed must be one of {LINK_SPEEDS}, not {speed!r}")
    desc = {n.nodeid: n.description for n in tree.nodes}
    out: list[str] = [
        (
            f"# gpupool fat tree: {tree.spines} spines x {tree.leaves} leaves x {tree.hcas_per_leaf}"
            " HCAs/leaf + edge gateway; generated by deploy/local/fabric/gen_topology.py"
        ),
        "",
    ]
    for n in tree.nodes:
        out.append(f"{'switchguid' if n.kind == 'switch' else 'caguid'}={n.guid}")
        kind = "Switch" if n.kind == "switch" else "Hca"
        out.append(f'{kind} {n.ports} "{n.nodeid}" # "{n.description}"')
        for port in sorted(n.links):
            peer, peer_port = n.links[port]
            out.append(f'[{port}] "{peer}"[{peer_port}]\t# "{desc[peer]}" lid 0 4x{speed}')
        out.append("")
    return "\n".join(out) + "\n"


def ibsim_limits(tree: FatTree) -> dict[str, int]:
    """Table sizes ibsim needs for ``tree`` (``ibsim -N nodes -S switches -P ports``), with headroom.

    ibsim's defaults are 2048 nodes, 256 switches and 13312 ports; a switch uses ``ports + 1``
    port entries (port 0 is its management port).
    """
    ports = sum(n.ports + 1 if n.kind == "switch" else n.ports for n in tree.nodes)
    return {
        "nodes": max(2048, len(tree.nodes) + 16),
        "switches": max(256, len(tree.switches()) + 4),
        "ports": max(13312, ports + 256),
    }


def describe(tree: FatTree) -> dict[str, object]:
    """A JSON-able description: shape and every node (GUIDs, roles, links)."""
    return {
        "spines": tree.spines,
        "leaves": tree.leaves,
        "hcas_per_leaf": tree.hcas_per_leaf,
        "uplinks": tree.uplinks,
        "switch_ports": tree.switch_ports,
        "ibsim_limits": ibsim_limits(tree),
        "nodes": [
            {**asdict(n), "links": {str(p): list(v) for p, v in sorted(n.links.items())}} for n in tree.nodes
        ],
    }


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; writes the net file (and optionally the JSON description). Exit 2 on bad args."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="net file to write")
    ap.add_argument("--json", type=Path, help="also write the node description JSON here")
    ap.add_argument("--spines", type=int, default=2)
    ap.add_argument("--leaves", type=int, default=4)
    ap.add_argument("--hcas-per-leaf", type=int, default=4)
    ap.add_argument("--uplinks", type=int, default=1, help="parallel links per leaf-spine pair")
    ap.add_argument("--switch-ports", type=int, default=None)
    ap.add_argument("--speed", default="EDR", choices=LINK_SPEEDS, help="link speed (4x links)")
    args = ap.parse_args(argv)
    try:
        tree = build_fat_tree(
            args.spines, args.leaves, args.hcas_per_leaf, uplinks=args.uplinks, switch_ports=args.switch_ports
        )
    except ValueError as exc:
        sys.stderr.write(f"gen_topology: {exc}\n")
        return 2
    args.out.write_text(render_net(tree, speed=args.speed))
    if args.json:
        args.json.write_text(json.dumps(describe(tree), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
