"""broker.fabric_qos and broker.fabric_paths: the QoS plan for lent traffic as opensm.conf text,
reading smpquery's tables, and the ports on the paths (pure logic, no fabric)."""

from __future__ import annotations

import pytest

from broker.fabric_paths import LinkGraph, PathPort
from broker.fabric_plan import PlanError
from broker.fabric_qos import (
    MIN_SHARE_PERCENT,
    QOS_BEGIN,
    QOS_END,
    effective_share_percent,
    high_limit_for,
    managed_block,
    operator_options,
    plan_qos,
    render_opensm_conf,
    sl2vl_problem,
    vlarb_problem,
)
from broker.fabric_smp import decode_sl2vl, decode_vlarb, encode_vlarb

CONF = "# opensm.conf of the operator\nqos TRUE\nqos_max_vls 8\nqos_policy_file /etc/qos-policy.conf\n"

def test_the_default_plan_gives_the_lent_sl_a_vl_of_its_own_and_bounds_its_share() -> None:
    plan = plan_qos(CONF, sl=1, vl=1, share_percent=10)
    assert plan.share_percent == 10.0
    for cls in ("ca", "sw0", "swe"):
        cp = plan.classes[cls]
        # OpenSM's default maps SL i to VL i mod 8: SL 9 shared VL 1 and moves to VL 0
        assert cp.sl2vl == (0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 2, 3, 4, 5, 6, 7)
        assert cp.moved == (9,)
        assert [s for s, v in enumerate(cp.sl2vl) if v == 1] == [1], "only the inference SL on the lent VL"
        # training VLs high (weights from the operator's tables), the lent VL alone in the low table
        assert cp.high == ((0, 4), (2, 4), (3, 4), (4, 4), (5, 4), (6, 4), (7, 4))
        assert cp.low == ((1, 64),)
        assert cp.high_limit == 9
    block = plan.block()
    assert block.startswith(QOS_BEGIN + "\nqos_high_limit 9\n") and block.endswith(QOS_END + "\n")
    assert "qos_swe_vlarb_low 1:64\n" in block and "qos_ca_sl2vl 0,1,2,3,4,5,6,7,0,0,2,3,4,5,6,7\n" in block
    assert "qos_sw0_vlarb_high 0:4,2:4,3:4,4:4,5:4,6:4,7:4\n" in block


@pytest.mark.parametrize(
    ("share", "limit"), [(50, 1), (33.4, 2), (33.3, 3), (25, 3), (10, 9), (9.99, 10), (MIN_SHARE_PERCENT, 254)]
)
def test_high_limit_bounds_the_share_from_above(share: float, limit: int) -> None:
    assert high_limit_for(share) == limit
    assert effective_share_percent(share) <= share + 1e-9
    assert effective_share_percent(share) == pytest.approx(100 / (limit + 1))


@pytest.mark.parametrize("share", [0.0, 0.39, 50.01, 100])
def test_a_share_the_plan_cannot_give_is_refused(share: float) -> None:
    with pytest.raises(PlanError, match="lent share"):
        high_limit_for(share)


def test_operator_values_are_the_base_class_lines_beat_generic_ones() -> None:
    conf = CONF + (
        "qos_vlarb_high 0:16,2:8\n"
        "qos_vlarb_low 3:2,1:4\n"
        "qos_swe_vlarb_high 0:32,2:16\n"
        "qos_sl2vl 0,1,2,3,0,1,2,3,0,1,2,3,0,1,2,3\n"
        "qos_ca_sl2vl (null)\n"  # unset: the generic line applies
        "qos_high_limit 200\n"  # the bound overrides it by rule
    )
    plan = plan_qos(conf, sl=1, vl=1, share_percent=20)
    swe, ca = plan.classes["swe"], plan.classes["ca"]
    assert swe.sl2vl == ca.sl2vl == (0, 1, 2, 3, 0, 0, 2, 3, 0, 0, 2, 3, 0, 0, 2, 3)
    assert swe.moved == (5, 9, 13)
    assert swe.high == ((0, 32), (2, 16), (3, 2)), "swe: its own high weights, VL 3's from the low table"
    assert ca.high == ((0, 16), (2, 8), (3, 2))
    assert swe.high_limit == ca.high_limit == 4 and plan.share_percent == 20
    assert operator_options(conf)["qos_high_limit"] == "200" and "qos_ca_sl2vl" not in operator_options(conf)


def test_a_training_vl_without_weight_gets_the_default_and_the_lent_vl_may_be_another() -> None:
    conf = CONF + "qos_vlarb_high 0:8\nqos_vlarb_low 0:0\nqos_sl2vl 0,1,5,0,0,0,0,0,0,0,0,0,0,0,0,15\n"
    cp = plan_qos(conf, sl=1, vl=3, share_percent=10).classes["swe"]
    assert cp.sl2vl == (0, 3, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15)
    assert cp.high == ((0, 8), (5, 64)), "VL 15 (management) is never arbitrated"
    assert cp.low == ((3, 64),)


@pytest.mark.parametrize(
    ("conf", "kw", "match"),
    [
        ("qos FALSE\n", {}, "qos TRUE"),
        ("# no qos line at all\n", {}, "qos TRUE"),
        (CONF + "qos FALSE\n", {}, "qos TRUE"),  # the last line wins, as in OpenSM
        (CONF, {"vl": 0}, "lent vl 0"),
        (CONF, {"vl": 15}, "lent vl 15"),
        (CONF, {"sl": 16}, "inference sl 16"),
        (CONF + "qos_sl2vl 0,1,2\n", {}, "16 VLs"),
        (CONF + "qos_swe_vlarb_high 0-4\n", {}, "qos_swe option does not parse"),
        (CONF + "qos_vlarb_low 1:300\n", {}, "out of range"),
    ],
)
def test_plans_that_cannot_be_made(conf: str, kw: dict[str, int], match: str) -> None:
    args = {"sl": 1, "vl": 1, "share_percent": 10.0, **kw}
    with pytest.raises(PlanError, match=match):
        plan_qos(conf, **args)  # type: ignore[arg-type]


def test_the_operators_lines_are_kept_byte_for_byte_and_the_block_goes_last() -> None:
    operator = CONF + "qos_swe_vlarb_high 0:32,2:16   # training first\r\n\n# trailing comment"
    plan = plan_qos(operator, sl=1, vl=1, share_percent=10)
    once = render_opensm_conf(operator, plan)
    assert once == operator + "\n" + plan.block()
    assert render_opensm_conf(once, plan) == once, "idempotent"
    assert managed_block(once) == plan.block() and managed_block(operator) is None
    # an operator line added after the block stays where it is, and the block moves below it
    later = once + "qos_high_limit 255\n"
    again = render_opensm_conf(later, plan_qos(later, sl=1, vl=1, share_percent=10))
    assert again == operator + "\nqos_high_limit 255\n" + plan.block()
    # a new plan replaces the old block only
    wider = plan_qos(once, sl=1, vl=1, share_percent=50)
    assert render_opensm_conf(once, wider) == operator + "\n" + wider.block()


@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t.replace("qos_swe_vlarb_low 1:64", "qos_swe_vlarb_low 1:64,0:1  # mine"),
        lambda t: t.replace("qos_sw0_high_limit 9\n", "qos TRUE\n"),
        lambda t: t.replace(QOS_END + "\n", ""),
        lambda t: t + QOS_BEGIN + "\n",
    ],
)
def test_a_hand_edited_managed_block_is_never_overwritten(edit) -> None:  # noqa: ANN001
    plan = plan_qos(CONF, sl=1, vl=1, share_percent=10)
    edited = edit(render_opensm_conf(CONF, plan))
    with pytest.raises(PlanError):
        render_opensm_conf(edited, plan)


def test_tables_read_back_compare_with_the_plan() -> None:
    """SMP attribute bytes (IBA vol. 1 SLtoVLMappingTable, VLArbitrationTable) → tables → problems."""
    cp = plan_qos(CONF, sl=1, vl=1, share_percent=10).classes["swe"]
    planned = bytes([0x01, 0x23, 0x45, 0x67, 0x00, 0x23, 0x45, 0x67])  # SL 2i high nibble, 2i+1 low
    default = bytes([0x01, 0x23, 0x45, 0x67, 0x01, 0x23, 0x45, 0x67])
    assert decode_sl2vl(planned) == list(cp.sl2vl)
    rows = {(0, 7): decode_sl2vl(planned), (1, 7): decode_sl2vl(planned), (2, 7): decode_sl2vl(default)}
    assert sl2vl_problem(cp, {k: v for k, v in rows.items() if k != (2, 7)}) == ""
    assert sl2vl_problem(cp, rows) == "sl2vl in 2 out 7: SL9→VL1 (want VL0)"
    low = decode_vlarb(encode_vlarb([(1, 64)]))
    high = decode_vlarb(encode_vlarb([(0, 4), (2, 4), (3, 4), (4, 4), (5, 4), (6, 4), (7, 4), (0, 0)]))
    assert (low, high) == ([[1, 64]], [[0, 4], [2, 4], [3, 4], [4, 4], [5, 4], [6, 4], [7, 4]])
    assert vlarb_problem(cp, tuple(map(tuple, low)), tuple(map(tuple, high))) == ""  # type: ignore[arg-type]
    # OpenSM's defaults on an 8-VL port: VL 0 high, VLs 1-7 low
    low = ((1, 4), (2, 4), (3, 4), (4, 4), (5, 4), (6, 4), (7, 4))
    problem = vlarb_problem(cp, low, ((0, 4),))
    assert problem.startswith("vlarb low 1:4,2:4,3:4,4:4,5:4,6:4,7:4 (want 1:64); high 0:4 (want 0:4,2:4")
    assert encode_vlarb([(0xF, 255)])[:2] == b"\x0f\xff" and len(encode_vlarb([])) == 64
    with pytest.raises(ValueError, match="out of range"):
        encode_vlarb([(16, 1)])
    with pytest.raises(ValueError, match="at most 32"):
        encode_vlarb([(0, 1)] * 33)


def _line(a: tuple[str, int, int, str], b: tuple[str, int, int, str]) -> str:
    """An ``ibnetdiscover -p`` line: (type, lid, port, guid) of both ends."""
    return f"{a[0]}    {a[1]}  {a[2]} {a[3]} 4x EDR - {b[0]}     {b[1]}  {b[2]} {b[3]} ( 'x' - 'y' )"


SP1, SP2, L1, L2 = (f"0x00000000000000a{i}" for i in (1, 2, 3, 4))
HOST, OTHER, GW = "0x00000000000000b1", "0x00000000000000b2", "0x00000000000000b9"
# two spines, two leaves; HOST and OTHER under leaf 2, the gateway under leaf 1
TOPO = "\n".join(
    [
        _line(("CA", 11, 1, HOST), ("SW", 4, 1, L2)),
        _line(("CA", 12, 1, OTHER), ("SW", 4, 2, L2)),
        _line(("CA", 19, 1, GW), ("SW", 3, 1, L1)),
        _line(("SW", 4, 5, L2), ("SW", 1, 2, SP1)),
        _line(("SW", 4, 6, L2), ("SW", 2, 2, SP2)),
        _line(("SW", 3, 5, L1), ("SW", 1, 1, SP1)),
        _line(("SW", 3, 6, L1), ("SW", 2, 1, SP2)),
        "SW     4  7 0x00000000000000a4 4x SDR                                    'leaf-2'",
        "# a comment, and a line that does not parse",
    ]
)


def test_the_paths_are_every_shortest_path_both_ways() -> None:
    g = LinkGraph.parse(TOPO)
    got = {(p.guid, p.port) for p in g.path_ports(HOST, GW)}
    assert got == {
        (HOST, 1), (L2, 1), (L2, 5), (L2, 6), (SP1, 2), (SP2, 2), (SP1, 1), (SP2, 1),
        (L1, 5), (L1, 6), (L1, 1), (GW, 1),
    }  # fmt: skip
    assert (OTHER, 1) not in got and (L2, 2) not in got, "a neighbour's port is not on the path"
    ports = {(p.guid, p.port): p for p in g.path_ports(HOST, GW)}
    assert ports[(HOST, 1)] == PathPort(HOST, 1, 11, False) and ports[(SP2, 1)] == PathPort(SP2, 1, 2, True)
    # two hosts under one leaf: two ports of that switch and the two CAs
    near = g.path_ports(OTHER, HOST)
    assert {(p.guid, p.port) for p in near} == {(OTHER, 1), (L2, 2), (L2, 1), (HOST, 1)}
    assert g.path_ports(HOST, "0x00000000000000ff") == [] and "0xb9" in g and "0xff" not in g
    assert len(g.switch_ports()) == 11  # leaf 2: 4, leaf 1: 3, spines: 2 each


def test_a_cut_link_takes_its_ports_off_the_paths() -> None:
    g = LinkGraph.parse("\n".join(ln for ln in TOPO.splitlines() if f"{L2} 4x EDR - SW     2" not in ln
                                   and "2  2 " + SP2 not in ln))  # fmt: skip
    got = {(p.guid, p.port) for p in g.path_ports(HOST, GW)}
    assert (SP2, 1) not in got and (L2, 6) not in got and (SP1, 2) in got
