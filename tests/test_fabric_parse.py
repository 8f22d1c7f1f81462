"""collectors.fabric_parse / fabric_records on real infiniband-diags output (no fabric needed).

Inputs: ``../shared/data/telemetry/infiniband_exporter/`` (treydock/infiniband_exporter fixtures)
and cases IB-11 / IB-12 of ``../shared/data/cases/cases.json``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from collectors.fabric_parse import (
    LEGACY_COUNTER_BITS,
    link_rate_bytes_per_second,
    parse_ibnetdiscover,
    parse_perfquery,
)
from collectors.fabric_records import port_sample, split_description, topology_record
from contracts.base import decode, encode
from contracts.fabric import FabricTopology
from contracts.telemetry import IbPortSample

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
IBX = DATA / "telemetry" / "infiniband_exporter"
CASES = {c["id"]: c for c in json.loads((DATA / "cases" / "cases.json").read_text())}

PERFQUERY_FILES = sorted((IBX / "perfquery").glob("*.out")) + sorted(
    (IBX / "perfquery-rcv-error").glob("*.out")
)
IBNETDISCOVER_FILES = sorted((IBX / "ibnetdiscover").glob("*.out"))
_ORACLE_LINE = re.compile(r"^(\w+):\.+(\S+)$")


def test_fixture_files_are_there() -> None:
    assert len(PERFQUERY_FILES) == 10
    assert len(IBNETDISCOVER_FILES) == 3


@pytest.mark.parametrize("path", PERFQUERY_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_perfquery_fixture_value_is_read_exactly(path: Path) -> None:
    """Every ``Name:....value`` line of the file is in the parse, as the same Python int."""
    text = path.read_text()
    r = parse_perfquery(text)
    assert r.problems == []
    expected: list[tuple[str, int]] = []
    for line in text.splitlines():
        m = _ORACLE_LINE.match(line)
        if m and m.group(1) not in ("PortSelect", "CounterSelect", "CounterSelect2"):
            expected.append((m.group(1), int(m.group(2), 0)))
    got = [(name, v) for b in r.blocks for name, v in b.counters.items()]
    assert got == expected
    if not text.strip():
        assert r.error == "empty_output" and r.blocks == [] and not r.ok
    else:
        assert r.ok and all(type(v) is int for _, v in got)


def test_perfquery_extended_switch_two_ports() -> None:
    r = parse_perfquery((IBX / "perfquery" / "0x7cfe9003009ce5b0.out").read_text())
    assert [(b.kind, b.lid, b.port) for b in r.blocks] == [("extended", 1719, 1), ("extended", 1719, 2)]
    p1, p2 = r.blocks
    assert (p1.cap_mask, p1.cap_mask2, p1.counter_select, p1.counter_select2) == (0x5300, 0x2, 0, 0)
    assert p1.counters["PortXmitData"] == 36298026860928
    assert p1.counters["PortXmitWait"] == 22730501
    assert p2.counters["PortRcvData"] == 39078804993378
    assert p2.counters["PortMulticastXmitPkts"] == 0
    assert set(p1.counter_bits.values()) == {64} and len(p1.counters) == 22
    assert r.block(2) is p2 and r.block(3) is None


def test_perfquery_empty_file_is_an_error_result() -> None:
    r = parse_perfquery((IBX / "perfquery" / "0x506b4b0300cc02a6.out").read_text())
    assert (r.error, r.blocks, r.problems, r.ok) == ("empty_output", [], [], False)
    assert parse_perfquery(" \n\t\n").error == "empty_output"


def test_perfquery_rcv_error_details() -> None:
    r = parse_perfquery((IBX / "perfquery-rcv-error" / "0x7cfe9003009ce5b0-2.out").read_text())
    (b,) = r.blocks
    assert (b.kind, b.lid, b.port, b.counter_select) == ("PortRcvErrorDetails", 1719, 2, 0)
    assert b.counters == {
        "PortLocalPhysicalErrors": 0, "PortMalformedPktErrors": 0, "PortBufferOverrunErrors": 0,
        "PortDLIDMappingErrors": 0, "PortVLMappingErrors": 0, "PortLoopingErrors": 0,
    }  # fmt: skip
    assert set(b.counter_bits.values()) == {16}


def test_case_ib11_data_counters_are_words() -> None:
    """IB-11: PortXmitData 36298026860928 → 145192107443712 bytes; PortRcvData → 49116115103004."""
    r = parse_perfquery(CASES["IB-11"]["input"]["content"])
    assert r.ok and r.problems == []
    (b,) = r.blocks
    assert (b.kind, b.lid, b.port) == ("", None, None)
    assert b.counters == {"PortXmitData": 36298026860928, "PortRcvData": 12279028775751}
    # the same numbers through the record, and through its JSON on the wire
    topo = parse_ibnetdiscover((IBX / "ibnetdiscover" / "test.out").read_text())
    node = topo.nodes()["0x7cfe9003009ce5b0"]
    sample = decode(IbPortSample, encode(port_sample(node, 1, [b], ts=1.0)))
    assert sample.data_bytes("PortXmitData") == 145192107443712
    assert sample.data_bytes("PortRcvData") == 49116115103004


def test_case_ib12_unconnected_port_with_spaces_in_name() -> None:
    text = (DATA / "cases" / CASES["IB-12"]["input"]["file"]).read_text()
    topo = parse_ibnetdiscover(text)
    assert topo.problems == [] and topo.error is None
    (p,) = topo.ports
    assert (p.node_type, p.lid, p.port, p.guid, p.width, p.speed, p.connected, p.name) == (
        "SW", 478, 22, "0x0002c9020040f160", "4x", "QDR", False, "Infiniscale-IV Mellanox Technologies",
    )  # fmt: skip


def test_case_ib12_other_lines_unaffected() -> None:
    """The IB-12 line among others, plus lines that cannot parse: each bad line is reported alone."""
    ib12 = (DATA / "cases" / CASES["IB-12"]["input"]["file"]).read_text().strip()
    good = (IBX / "ibnetdiscover" / "test.out").read_text().splitlines()
    text = "\n".join(
        [
            good[0],
            ib12,
            "SW garbage",
            good[3],
            "XX 1 2 0x1 4x EDR 'x'",
            "SW 1 2 0xZZ 4x EDR 'x'",
            "CA 12 1 0x0000000000000001 4x EDR - SW 1 ( 'a' - 'b' )",
            good[7],
        ]
    )
    topo = parse_ibnetdiscover(text)
    assert [(p.lineno, p.reason) for p in topo.problems] == [
        (3, "too_few_fields"), (5, "bad_node_type"), (6, "bad_guid"), (7, "bad_peer"),
    ]  # fmt: skip
    assert [p.lineno for p in topo.ports] == [1, 2, 4, 8]
    assert topo.ports[1].name == "Infiniscale-IV Mellanox Technologies" and not topo.ports[1].connected
    assert topo.ports[0].peer_name == "ib-i1l1s01" and topo.ports[3].speed is None


def test_ibnetdiscover_test_out() -> None:
    topo = parse_ibnetdiscover((IBX / "ibnetdiscover" / "test.out").read_text())
    assert topo.problems == [] and len(topo.ports) == 9
    ca = topo.ports[0]
    assert (ca.node_type, ca.lid, ca.port, ca.guid, ca.width, ca.speed, ca.name, ca.connected) == (
        "CA", 134, 1, "0x7cfe9003003b4bde", "4x", "EDR", "o0001 HCA-1", True,
    )  # fmt: skip
    assert (ca.peer_type, ca.peer_lid, ca.peer_port, ca.peer_guid, ca.peer_name) == (
        "SW", 1719, 10, "0x7cfe9003009ce5b0", "ib-i1l1s01",
    )  # fmt: skip
    unknown_speed = topo.ports[7]  # SW 2052 37 ... 4x ???
    assert (unknown_speed.port, unknown_speed.width, unknown_speed.speed, unknown_speed.connected) == (
        37, "4x", None, False,
    )  # fmt: skip
    assert unknown_speed.rate_bytes_per_second is None
    split = topo.ports[8]  # split-mode port 80
    assert (split.lid, split.port, split.guid, split.speed, split.name) == (
        1781, 80, "0x08c0eb0300add20e", "SDR", "ib-i7l2s01",
    )  # fmt: skip
    nodes = topo.nodes()
    assert len(nodes) == 7  # 3 CAs, 3 switches with lines, ib-i1l2s01 known only as a peer
    assert sorted(nodes["0x7cfe9003009ce5b0"].ports) == [1, 10, 11]
    assert nodes["0x7cfe900300b07320"].name == "ib-i1l2s01" and nodes["0x7cfe900300b07320"].ports[1].connected
    assert len(topo.links()) == 4


def test_ibnetdiscover_padded_and_unquoted_names() -> None:
    topo2 = parse_ibnetdiscover((IBX / "ibnetdiscover" / "test2.out").read_text())
    assert topo2.problems == [] and len(topo2.ports) == 6
    # quoted names byte for byte: the switches' padding inside the quotes is part of their description
    assert [p.name for p in topo2.ports] == [
        "Mellanox Technologies Aggregation Node", "worker20 mlx5_3", "5FB0406-spine-IB01 ",
        " 5FB0406-spine-IB02 ", " 5FB0406-spine-IB03 ", "Infiniscale-IV Mellanox Technologies",
    ]  # fmt: skip
    assert topo2.ports[1].peer_name == "5FB0405-leaf-IB01 " and topo2.ports[0].speed == "HDR"
    assert topo2.ports[4].peer_name == "Mellanox Technologies Aggregation Node"
    topo3 = parse_ibnetdiscover((IBX / "ibnetdiscover" / "test3.out").read_text())
    (p,) = topo3.ports
    assert (p.lid, p.guid, p.name, p.connected) == (
        479,
        "0x0002c9020040f161",
        "Infiniscale-IV Mellanox Technologies",
        False,
    )


def test_ibnetdiscover_empty_output() -> None:
    topo = parse_ibnetdiscover("")
    assert (topo.error, topo.ports, topo.problems) == ("empty_output", [], [])
    assert topo.nodes() == {} and topo.links() == []


# ibsim's real legacy output (perfquery 44.0 against ibsim 0.10), with PortXmitWait saturated
LEGACY = """# Port counters: Lid 5 port 1 (CapMask: 0x1300)
PortSelect:......................1
CounterSelect:...................0x0000
SymbolErrorCounter:..............7
LinkErrorRecoveryCounter:........0
LinkDownedCounter:...............0
PortRcvErrors:...................0
PortRcvRemotePhysicalErrors:.....0
PortRcvSwitchRelayErrors:........0
PortXmitDiscards:................0
PortXmitConstraintErrors:........0
PortRcvConstraintErrors:.........0
CounterSelect2:..................0x00
LocalLinkIntegrityErrors:........15
ExcessiveBufferOverrunErrors:....0
QP1Dropped:......................0
VL15Dropped:.....................0
PortXmitData:....................1008
PortRcvData:.....................1008
PortXmitPkts:....................14
PortRcvPkts:.....................14
PortXmitWait:....................4294967295
"""
EXTENDED = """# Port extended counters: Lid 5 port 1 (CapMask: 0x1300 CapMask2: 0x0000000)
PortSelect:......................1
CounterSelect:...................0x0000
PortXmitData:....................18446744073709551072
PortRcvData:.....................864
PortXmitPkts:....................12
PortRcvPkts:.....................12
PortUnicastXmitPkts:.............0
PortUnicastRcvPkts:..............0
PortMulticastXmitPkts:...........0
PortMulticastRcvPkts:............0
"""


def test_legacy_widths_and_saturation() -> None:
    r = parse_perfquery(LEGACY)
    (b,) = r.blocks
    assert b.kind == "legacy" and b.cap_mask == 0x1300 and b.cap_mask2 is None and b.counter_select2 == 0
    assert b.counter_bits == {k: LEGACY_COUNTER_BITS[k] for k in b.counters}
    assert sorted(b.saturated()) == ["LocalLinkIntegrityErrors", "PortXmitWait"]


def test_extended_wins_over_legacy_in_a_sample() -> None:
    topo = parse_ibnetdiscover(
        "SW     5  1 0x0002c90300a00002 4x EDR - CA     3  1 0x0002c90300b00001"
        " ( 'leaf-1' - 'node001 mlx5_0' )\n"
        "SW     5  9 0x0002c90300a00002 4x EDR                                    'leaf-1'\n"
    )
    leaf = topo.nodes()["0x0002c90300a00002"]
    blocks = parse_perfquery(EXTENDED).blocks + parse_perfquery(LEGACY).blocks
    s = decode(IbPortSample, encode(port_sample(leaf, 1, blocks, ts=2.0, seq=9)))
    assert s.counters["PortXmitData"] == 18446744073709551072 and s.counter_bits["PortXmitData"] == 64
    assert s.counters["PortRcvData"] == 864  # extended, not the legacy 1008
    assert s.counters["PortXmitWait"] == 4294967295 and s.counter_bits["PortXmitWait"] == 32
    assert s.saturated == ["LocalLinkIntegrityErrors", "PortXmitWait"]
    assert (s.source, s.host, s.device, s.node_guid, s.port, s.seq) == (
        "perfquery", "leaf-1", "leaf-1", "0x0002c90300a00002", 1, 9,
    )  # fmt: skip
    assert (s.state, s.state_id, s.phys_state, s.phys_state_id) == (None, None, "LinkUp", 5)
    assert s.rate_bytes_per_second == 12_500_000_000 and s.key == "0x0002c90300a00002/1"
    down = port_sample(leaf, 9, [], ts=2.0)
    assert (down.state, down.state_id, down.phys_state_id, down.rate_bytes_per_second, down.counters) == (
        "DOWN", 1, None, None, {},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("PortXmitData:....................12a", "bad_value"),
        ("PortXmitData:....................-1", "bad_value"),
        ("PortXmitData:....................", "bad_value"),
        ("PortXmitData:....................18446744073709551616", "out_of_range"),
        ("ibwarn: [9460] sim_connect: attached as client 1", "bad_value"),
        ("something else entirely", "unrecognised_line"),
        ("# Port extended counters: nonsense", "unrecognised_line"),
        ("Port Xmit Data:....1", "unrecognised_line"),
    ],
)
def test_perfquery_bad_lines_lose_nothing_else(line: str, reason: str) -> None:
    lines = EXTENDED.splitlines()
    lines.insert(6, line)  # among the counters, after PortRcvPkts
    r = parse_perfquery("\n".join(lines))
    assert [p.reason for p in r.problems] == [reason]
    assert len(r.blocks[0].counters) == 8 and r.ok


def test_perfquery_legacy_value_wider_than_its_counter_and_duplicates() -> None:
    text = LEGACY.replace("LinkDownedCounter:...............0", "LinkDownedCounter:...............256")
    text += "PortXmitWait:....................1\n"
    r = parse_perfquery(text)
    assert [p.reason for p in r.problems] == ["out_of_range", "duplicate_counter"]
    assert (
        "LinkDownedCounter" not in r.blocks[0].counters and r.blocks[0].counters["PortXmitWait"] == 2**32 - 1
    )
    assert parse_perfquery("just words\n").error == "no_counters"


def test_link_rates() -> None:
    assert link_rate_bytes_per_second("4x", "EDR") == 12_500_000_000  # 100 Gb/s
    assert link_rate_bytes_per_second("4x", "HDR") == 25_000_000_000
    assert link_rate_bytes_per_second("1x", "SDR") == 312_500_000
    assert link_rate_bytes_per_second("4x", "FDR") == 7_000_000_000  # 56 Gb/s
    assert link_rate_bytes_per_second("4x", None) is None
    assert link_rate_bytes_per_second("3x", "EDR") is None


def test_topology_record_round_trip() -> None:
    topo = parse_ibnetdiscover((IBX / "ibnetdiscover" / "test.out").read_text())
    rec = topology_record(topo, ts=5.0, seq=3)
    back = decode(FabricTopology, encode(rec))
    assert back == rec and back.key == "topology"
    assert [n.guid for n in back.nodes] == sorted(topo.nodes())
    sw = next(n for n in back.nodes if n.guid == "0x506b4b03005c2740")
    assert (sw.node_type, sw.lid, sw.description) == ("SW", 2052, "ib-i4l1s01")
    assert [(p.port, p.connected, p.speed) for p in sw.ports] == [(35, True, "EDR"), (37, False, None)]
    assert len(back.links) == 4 and back.links[0].rate_bytes_per_second == 12_500_000_000


def test_split_description() -> None:
    assert split_description("CA", "worker20 mlx5_3") == ("worker20", "mlx5_3")
    assert split_description("CA", "Mellanox Technologies Aggregation Node") == (
        "Mellanox", "Technologies Aggregation Node",
    )  # fmt: skip
    assert split_description("CA", "node001") == ("node001", "node001")
    assert split_description("SW", "leaf 1") == ("leaf 1", "leaf 1")


@pytest.mark.parametrize("name", ["leaf-1 ", " leaf  1 ", "a\tb", "node 1 mlx5_0", "x' y", "  "])
def test_quoted_names_are_kept_byte_for_byte(name: str) -> None:
    """Whatever is between the quotes is the node description, padding and inner blanks included."""
    line_up = f"SW 5 1 0x0002c90300a00002 4x EDR - CA 3 1 0x0002c90300b00001 ( '{name}' - '{name}' )\n"
    line_down = f"SW 5 2 0x0002c90300a00002 4x EDR   '{name}'\n"
    topo = parse_ibnetdiscover(line_up + line_down)
    assert topo.problems == []
    assert (topo.ports[0].name, topo.ports[0].peer_name, topo.ports[1].name) == (name, name, name)
