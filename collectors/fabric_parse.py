"""Parsers for infiniband-diags output: ``perfquery`` counters and ``ibnetdiscover -p`` port lists.

Both parsers take the command's whole stdout as ``str`` and never raise on bad input: a line that
does not parse becomes a :class:`LineProblem` (with the reason) and every other line is kept; an
empty output is an error *result* (``error="empty_output"``), not an exception.

Formats (infiniband-diags, rdma-core ``infiniband-diags/perfquery.c`` and ``ibnetdiscover.c``;
real samples in ``../shared/data/telemetry/infiniband_exporter/``):

``perfquery [-x] LID PORT[,PORT...]`` — one block per port::

    # Port extended counters: Lid 2052 port 1 (CapMask: 0x5300 CapMask2: 0x0000002)
    PortSelect:......................1
    CounterSelect:...................0x0000
    PortXmitData:....................178791657177235
    ...

A header ``# Port counters: ...`` is the legacy PortCounters attribute (IBTA vol. 1 16.1.3.5:
fixed widths, 4..32 bits, saturating); ``# Port extended counters: ...`` is PortCountersExtended
(64-bit); ``# <Attribute> counters: ...`` any other PMA attribute (``-E`` PortRcvErrorDetails...).
``PortXmitData``/``PortRcvData`` count 4-octet words: bytes = 4 × value (never × link width).

``ibnetdiscover -p`` — one line per port::

    SW  1719 10 0x7cfe9003009ce5b0 4x EDR - CA   134  1 0x7cfe9003003b4bde ( 'ib-i1l1s01' - 'o0001 HCA-1' )
    SW  2052 37 0x506b4b03005c2740 4x ???                                    'ib-i4l1s01'

type, LID, port, GUID, width, speed, then either `` - `` and the peer's type, LID, port, GUID and
``( 'name' - 'peer name' )``, or (an unconnected port: physical link not up) the node's name,
quoted or not. Names may contain spaces; a quoted name is kept byte for byte, padding inside
the quotes included (it is the node description as the node reports it: ``'leaf-1 '`` is
not ``'leaf-1'``); only the blanks outside the quotes are layout. An unquoted name is stripped.
For a CA the GUID printed is the *port* GUID; for a switch, the node GUID.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = [
    "DETAIL_COUNTER_BITS",
    "LEGACY_COUNTER_BITS",
    "LineProblem",
    "PerfqueryBlock",
    "PerfqueryResult",
    "Topology",
    "TopologyLink",
    "TopologyNode",
    "TopologyPort",
    "link_rate_bytes_per_second",
    "parse_ibnetdiscover",
    "parse_perfquery",
]

LEGACY_COUNTER_BITS: dict[str, int] = {
    "SymbolErrorCounter": 16,
    "LinkErrorRecoveryCounter": 8,
    "LinkDownedCounter": 8,
    "PortRcvErrors": 16,
    "PortRcvRemotePhysicalErrors": 16,
    "PortRcvSwitchRelayErrors": 16,
    "PortXmitDiscards": 16,
    "PortXmitConstraintErrors": 8,
    "PortRcvConstraintErrors": 8,
    "LocalLinkIntegrityErrors": 4,
    "ExcessiveBufferOverrunErrors": 4,
    "VL15Dropped": 16,
    "PortXmitData": 32,
    "PortRcvData": 32,
    "PortXmitPkts": 32,
    "PortRcvPkts": 32,
    "PortXmitWait": 32,
    "QP1Dropped": 16,
}
"""Counter widths of the legacy PortCounters attribute (IBTA vol. 1, table "PortCounters")."""

DETAIL_COUNTER_BITS: dict[str, int] = {
    "PortRcvErrorDetails": 16,
    "PortXmitDiscardDetails": 16,
}
"""Width of every counter of the PMA detail attributes (``perfquery -E`` / ``-D``)."""

_SELECTORS = frozenset({"PortSelect", "CounterSelect", "CounterSelect2"})
_HEADER = re.compile(
    r"^# (?P<what>.+?) counters: (?P<addr>.*?) port (?P<port>\d+)(?: \((?P<caps>[^)]*)\))?\s*$"
)
_LID = re.compile(r"\bLid (\d+)")
_CAPMASK = re.compile(r"CapMask: (0x[0-9a-fA-F]+)")
_CAPMASK2 = re.compile(r"CapMask2: (0x[0-9a-fA-F]+)")
_MAX64 = (1 << 64) - 1
_HEX = frozenset("0123456789abcdefABCDEF")


@dataclass(frozen=True, slots=True)
class LineProblem:
    """A line that did not parse: 1-based ``lineno``, the ``line`` itself, and a ``reason``.

    Reasons: ``unrecognised_line``, ``bad_value``, ``out_of_range``, ``duplicate_counter``
    (perfquery); ``too_few_fields``, ``bad_node_type``, ``bad_number``, ``bad_guid``,
    ``bad_peer`` (ibnetdiscover).
    """

    lineno: int
    line: str
    reason: str


@dataclass(slots=True)
class PerfqueryBlock:
    """The counters of one port as printed by perfquery.

    Attributes:
        kind: ``extended`` (PortCountersExtended), ``legacy`` (PortCounters), another PMA
            attribute name (``PortRcvErrorDetails``), or ``""`` when the block had no header.
        lid: the LID from the header, ``None`` without one.
        port: ``PortSelect`` (else the header's port); 255 means all ports aggregated.
        cap_mask / cap_mask2: PMA ClassPortInfo capability masks from the header.
        counter_select / counter_select2: the selectors echoed by the PMA.
        counters: counter name → raw value (Python ``int``, never float).
        counter_bits: counter name → width in bits where the attribute defines it.
    """

    kind: str = ""
    lid: int | None = None
    port: int | None = None
    cap_mask: int | None = None
    cap_mask2: int | None = None
    counter_select: int | None = None
    counter_select2: int | None = None
    counters: dict[str, int] = field(default_factory=dict)
    counter_bits: dict[str, int] = field(default_factory=dict)

    def saturated(self) -> list[str]:
        """Counters whose value is all ones for their width (a PMA counter stuck there gives no rate)."""
        return [n for n, v in self.counters.items() if (b := self.counter_bits.get(n)) and v == (1 << b) - 1]


@dataclass(slots=True)
class PerfqueryResult:
    """Everything parsed from one perfquery output.

    Attributes:
        blocks: one per port, in output order.
        problems: lines that did not parse (the rest of the output is kept).
        error: ``empty_output`` (nothing but whitespace) or ``no_counters`` (text, but no counter
            line); ``None`` when at least one counter was read.
    """

    blocks: list[PerfqueryBlock] = field(default_factory=list)
    problems: list[LineProblem] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True when at least one counter was read."""
        return self.error is None

    def block(self, port: int) -> PerfqueryBlock | None:
        """The first block of ``port``, or ``None``."""
        return next((b for b in self.blocks if b.port == port), None)


def _header_block(m: re.Match[str]) -> PerfqueryBlock:
    what = m.group("what")
    kind = "extended" if what == "Port extended" else "legacy" if what == "Port" else what
    lid_m = _LID.search(m.group("addr"))
    caps = m.group("caps") or ""
    cm = _CAPMASK.search(caps)
    cm2 = _CAPMASK2.search(caps)
    return PerfqueryBlock(
        kind=kind,
        lid=int(lid_m.group(1)) if lid_m else None,
        port=int(m.group("port")),
        cap_mask=int(cm.group(1), 16) if cm else None,
        cap_mask2=int(cm2.group(1), 16) if cm2 else None,
    )


def _parse_uint(text: str) -> int | None:
    """Unsigned decimal or ``0x`` hex; ``None`` if neither."""
    if text[:2] in ("0x", "0X"):
        digits = text[2:]
        return int(digits, 16) if digits and _HEX.issuperset(digits) else None
    return int(text) if text.isdigit() and text.isascii() else None


def _bits_for(kind: str, name: str) -> int | None:
    if kind == "extended":
        return 64
    if kind == "legacy":
        return LEGACY_COUNTER_BITS.get(name)
    return DETAIL_COUNTER_BITS.get(kind)


def parse_perfquery(text: str) -> PerfqueryResult:
    """Parse ``perfquery`` / ``perfquery -x`` output (any number of port blocks; see module doc).

    Returns a :class:`PerfqueryResult`; never raises on bad input. Counter lines before any header
    form a block with ``kind=""`` and no LID/port (as in a pasted excerpt).
    """
    result = PerfqueryResult()
    if not text.strip():
        result.error = "empty_output"
        return result
    block: PerfqueryBlock | None = None
    seen_counter = False
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        if line[0] == "#":
            m = _HEADER.match(line)
            if m is None:
                result.problems.append(LineProblem(lineno, raw, "unrecognised_line"))
                continue
            block = _header_block(m)
            result.blocks.append(block)
            continue
        name, sep, rest = line.partition(":")
        if (
            not sep
            or not name.isalnum()
            or not name.isascii()
            or (not rest.startswith(".") and not rest[:1].isspace())
        ):
            result.problems.append(LineProblem(lineno, raw, "unrecognised_line"))
            continue
        value = _parse_uint(rest.lstrip(". \t"))
        if value is None:
            result.problems.append(LineProblem(lineno, raw, "bad_value"))
            continue
        if value > _MAX64:
            result.problems.append(LineProblem(lineno, raw, "out_of_range"))
            continue
        if block is None:
            block = PerfqueryBlock()
            result.blocks.append(block)
        if name in _SELECTORS:
            if name == "PortSelect":
                block.port = value
            elif name == "CounterSelect":
                block.counter_select = value
            else:
                block.counter_select2 = value
            continue
        if name in block.counters:
            result.problems.append(LineProblem(lineno, raw, "duplicate_counter"))
            continue
        bits = _bits_for(block.kind, name)
        if bits is not None and value >> bits:
            result.problems.append(LineProblem(lineno, raw, "out_of_range"))
            continue
        block.counters[name] = value
        if bits is not None:
            block.counter_bits[name] = bits
        seen_counter = True
    if not seen_counter:
        result.error = "no_counters"
    return result


# ---------------------------------------------------------------------------------------------
# ibnetdiscover -p

_LANE_TENTHS_GBPS: dict[str, int] = {
    "SDR": 25, "DDR": 50, "QDR": 100, "FDR10": 100, "FDR": 140,
    "EDR": 250, "HDR": 500, "NDR": 1000, "XDR": 2000,
}  # fmt: skip
_WIDTH_LANES: dict[str, int] = {"1x": 1, "2x": 2, "4x": 4, "8x": 8, "12x": 12}
_NODE_TYPES = frozenset({"SW", "CA", "RT"})


def link_rate_bytes_per_second(width: str | None, speed: str | None) -> int | None:
    """Nominal data rate of a link in bytes/s: lanes × per-lane Gb/s × 125000000.

    Per-lane rates are the kernel's (``ib_sysfs`` ``rate``; SDR 2.5, DDR 5, QDR/FDR10 10, FDR 14,
    EDR 25, HDR 50, NDR 100, XDR 200 Gb/s), so a 4x EDR port gives 12500000000 like sysfs's
    "100 Gb/sec (4X EDR)". ``None`` for an unknown width or speed (``???``).
    """
    lanes = _WIDTH_LANES.get(width or "")
    tenths = _LANE_TENTHS_GBPS.get(speed or "")
    if lanes is None or tenths is None:
        return None
    return lanes * tenths * 12_500_000


@dataclass(frozen=True, slots=True)
class TopologyPort:
    """One ``ibnetdiscover -p`` line.

    Attributes:
        node_type: ``SW``, ``CA`` or ``RT``.
        lid: the node's LID (switch: port 0's LID; CA: this port's LID); 0 = not assigned.
        port: port number.
        guid: ``0x`` + 16 lowercase hex digits (CA: port GUID, switch: node GUID).
        width / speed: active link width (``4x``) and speed (``EDR``); ``None`` for ``???``.
        name: the node description: inside the quotes byte for byte, or an unquoted one stripped.
        connected: a peer is listed (the physical link is up).
        peer_*: the peer's type, LID, port, GUID and name when connected, else ``None``.
        lineno: 1-based line number in the output.
    """

    node_type: str
    lid: int
    port: int
    guid: str
    width: str | None
    speed: str | None
    name: str
    connected: bool
    peer_type: str | None = None
    peer_lid: int | None = None
    peer_port: int | None = None
    peer_guid: str | None = None
    peer_name: str | None = None
    lineno: int = 0

    @property
    def rate_bytes_per_second(self) -> int | None:
        """:func:`link_rate_bytes_per_second` of this port's width and speed."""
        return link_rate_bytes_per_second(self.width, self.speed)


@dataclass(slots=True)
class TopologyNode:
    """A node seen in the port list: its own lines (``ports``) and, for nodes seen only as a peer,
    the ports their neighbours name (``ports`` then holds synthesised connected entries)."""

    guid: str
    node_type: str
    lid: int
    name: str
    ports: dict[int, TopologyPort] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TopologyLink:
    """An undirected link, ends ordered so that ``(a_guid, a_port) < (b_guid, b_port)``."""

    a_guid: str
    a_port: int
    b_guid: str
    b_port: int
    width: str | None
    speed: str | None


@dataclass(slots=True)
class Topology:
    """Everything parsed from one ``ibnetdiscover -p`` output.

    Attributes:
        ports: one entry per parsed line, in output order.
        problems: lines that did not parse (every other line is kept).
        error: ``empty_output`` when the output was blank, else ``None``.
    """

    ports: list[TopologyPort] = field(default_factory=list)
    problems: list[LineProblem] = field(default_factory=list)
    error: str | None = None

    def nodes(self) -> dict[str, TopologyNode]:
        """Nodes by GUID. A node seen only as a peer gets a connected port from its neighbour's line."""
        nodes: dict[str, TopologyNode] = {}
        for p in self.ports:
            n = nodes.get(p.guid)
            if n is None:
                n = nodes[p.guid] = TopologyNode(p.guid, p.node_type, p.lid, p.name)
            n.ports.setdefault(p.port, p)
        for p in self.ports:
            if not p.connected or p.peer_guid is None or p.peer_port is None:
                continue
            if p.peer_guid in nodes and p.peer_port in nodes[p.peer_guid].ports:
                continue
            n = nodes.get(p.peer_guid)
            if n is None:
                n = nodes[p.peer_guid] = TopologyNode(
                    p.peer_guid, p.peer_type or "", p.peer_lid or 0, p.peer_name or ""
                )
            n.ports[p.peer_port] = TopologyPort(
                n.node_type, n.lid, p.peer_port, p.peer_guid, p.width, p.speed, n.name, True,
                p.node_type, p.lid, p.port, p.guid, p.name, p.lineno,
            )  # fmt: skip
        return nodes

    def links(self) -> list[TopologyLink]:
        """Every connected link once, sorted."""
        seen: dict[tuple[str, int, str, int], TopologyLink] = {}
        for p in self.ports:
            if not p.connected or p.peer_guid is None or p.peer_port is None:
                continue
            a, b = sorted([(p.guid, p.port), (p.peer_guid, p.peer_port)])
            key = (a[0], a[1], b[0], b[1])
            if key not in seen:
                seen[key] = TopologyLink(a[0], a[1], b[0], b[1], p.width, p.speed)
        return [seen[k] for k in sorted(seen)]


def _guid(text: str) -> str | None:
    """``0x`` + 1..16 hex digits → ``0x`` + 16 lowercase hex digits; ``None`` otherwise."""
    digits = text[2:]
    if text[:2] not in ("0x", "0X") or not 0 < len(digits) <= 16 or not _HEX.issuperset(digits):
        return None
    return "0x" + digits.lower().rjust(16, "0")


def _unquote(text: str) -> str:
    """A node name: what is between the quotes, exactly; an unquoted name stripped."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] == "'":
        return text[1:-1]
    return text


def _split_names(text: str) -> tuple[str, str] | None:
    """``( 'a' - 'b' )`` → ``(a, b)`` (each exactly as quoted); unquoted names are split at the
    first `` - ``."""
    text = text.strip()
    if not (text.startswith("(") and text.endswith(")")):
        return None
    inner = text[1:-1].strip()
    if inner.startswith("'") and inner.endswith("'") and "' - '" in inner:
        a, b = inner[1:-1].split("' - '", 1)
        return a, b
    a, sep, b = inner.partition(" - ")
    if not sep:
        return None
    return _unquote(a), _unquote(b)


def _parse_port_line(line: str, lineno: int) -> TopologyPort | str:
    """One ``-p`` line → :class:`TopologyPort`, or the problem reason."""
    parts = line.split(None, 6)
    if len(parts) < 6:
        return "too_few_fields"
    ntype, lid_s, port_s, guid_s, width, speed = parts[:6]
    rest = parts[6].strip() if len(parts) == 7 else ""
    if ntype not in _NODE_TYPES:
        return "bad_node_type"
    if not (lid_s.isdigit() and port_s.isdigit()):
        return "bad_number"
    guid = _guid(guid_s)
    if guid is None:
        return "bad_guid"
    w = None if width == "???" else width
    s = None if speed == "???" else speed
    if rest == "-" or rest.startswith("- "):
        peer = rest[1:].split(None, 4)
        if len(peer) != 5 or peer[0] not in _NODE_TYPES or not (peer[1].isdigit() and peer[2].isdigit()):
            return "bad_peer"
        peer_guid = _guid(peer[3])
        names = _split_names(peer[4])
        if peer_guid is None or names is None:
            return "bad_peer"
        return TopologyPort(
            ntype, int(lid_s), int(port_s), guid, w, s, names[0], True,
            peer[0], int(peer[1]), int(peer[2]), peer_guid, names[1], lineno,
        )  # fmt: skip
    return TopologyPort(ntype, int(lid_s), int(port_s), guid, w, s, _unquote(rest), False, lineno=lineno)


def parse_ibnetdiscover(text: str) -> Topology:
    """Parse ``ibnetdiscover -p`` output (see module doc); never raises on bad input.

    Blank lines and ``#`` comments are skipped; a line that does not parse is recorded in
    :attr:`Topology.problems` and the others are kept.
    """
    topo = Topology()
    if not text.strip():
        topo.error = "empty_output"
        return topo
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        parsed = _parse_port_line(line, lineno)
        if isinstance(parsed, str):
            topo.problems.append(LineProblem(lineno, raw, parsed))
        else:
            topo.ports.append(parsed)
    return topo
