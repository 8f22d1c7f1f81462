"""The ports on the paths between two HCA ports, from the fabric's own topology.

Input: ``ibnetdiscover -p`` (infiniband-diags; ``man ibnetdiscover``, "--ports"), one line per
connected or unconnected port::

    CA    23  1 0x0002c90300b000f1 4x EDR - SW     8  4 0x0002c90300a00005 ( 'node016 mlx5_0' - 'leaf-4' )

(type, LID, port, GUID, width, speed, then ``-`` and the peer's type, LID, port and GUID when
connected). Only connected lines are needed here: they are the links. The fabric collector has
the full parser (``collectors.fabric_parse``); stages do not import each other, so the broker
reads the few fields it needs itself.

Paths: every minimal-hop path between the two ends (a fat tree's routing spreads destinations over
all spines, and a re-sweep may move a route to another one), as the set of ports that send on
them in either direction: both ends of every link that lies on some shortest path.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

_LINK = re.compile(
    r"^(SW|CA|RT)\s+(\d+)\s+(\d+)\s+(0x[0-9a-fA-F]{1,16})\s+\S+\s+\S+\s+-\s+"
    r"(SW|CA|RT)\s+(\d+)\s+(\d+)\s+(0x[0-9a-fA-F]{1,16})\s"
)


@dataclass(frozen=True, order=True)
class PathPort:
    """One port of a path.

    Attributes:
        guid: node GUID of a switch, port GUID of a CA port (as ``ibnetdiscover -p`` prints).
        port: port number (a CA's port, a switch's external port).
        lid: LID to address it with ``smpquery`` (a switch's port 0 LID, a CA port's own LID).
        switch: True for a switch port (``smpquery ... <lid> <port>``), False for a CA port.
    """

    guid: str
    port: int
    lid: int
    switch: bool


@dataclass
class LinkGraph:
    """The links of one ``ibnetdiscover -p`` output.

    Attributes:
        ends: (guid, port) → (its :class:`PathPort`, the peer's (guid, port)).
        neighbours: guid → the (guid, port) ends of its links.
    """

    ends: dict[tuple[str, int], tuple[PathPort, tuple[str, int]]] = field(default_factory=dict)
    neighbours: dict[str, list[tuple[str, int]]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> LinkGraph:
        """Every connected line of ``text`` (other lines are skipped); never raises."""
        g = cls()
        for line in text.splitlines():
            m = _LINK.match(line.strip())
            if not m:
                continue
            a = PathPort(_guid(m.group(4)), int(m.group(3)), int(m.group(2)), m.group(1) != "CA")
            b = PathPort(_guid(m.group(8)), int(m.group(7)), int(m.group(6)), m.group(5) != "CA")
            g._add(a, b)
            g._add(b, a)
        return g

    def _add(self, a: PathPort, b: PathPort) -> None:
        if (a.guid, a.port) in self.ends:
            return
        self.ends[(a.guid, a.port)] = (a, (b.guid, b.port))
        self.neighbours.setdefault(a.guid, []).append((a.guid, a.port))

    def __contains__(self, guid: str) -> bool:
        return _guid(guid) in self.neighbours

    def _distances(self, start: str) -> dict[str, int]:
        dist = {start: 0}
        todo = deque([start])
        while todo:
            node = todo.popleft()
            for end in self.neighbours.get(node, ()):
                peer = self.ends[end][1][0]
                if peer not in dist:
                    dist[peer] = dist[node] + 1
                    todo.append(peer)
        return dist

    def path_ports(self, a: str, b: str) -> list[PathPort]:
        """The ports on every shortest path between GUIDs ``a`` and ``b`` (sorted); ``[]`` when
        they are not connected (or either is unknown)."""
        a, b = _guid(a), _guid(b)
        da, db = self._distances(a), self._distances(b)
        if b not in da:
            return []
        hops = da[b]
        out: set[PathPort] = set()
        for (guid, _port), (pp, (peer, peer_port)) in self.ends.items():
            if guid in da and peer in db and da[guid] + 1 + db[peer] == hops:
                out.add(pp)
                out.add(self.ends[(peer, peer_port)][0])
        return sorted(out)

    def switch_ports(self) -> list[PathPort]:
        """Every connected switch port (sorted)."""
        return sorted(pp for pp, _ in self.ends.values() if pp.switch)


def union(groups: Iterable[Iterable[PathPort]]) -> list[PathPort]:
    """The distinct ports of several paths, sorted."""
    return sorted({p for g in groups for p in g})


def _guid(text: str) -> str:
    return f"0x{int(text, 16):016x}"
