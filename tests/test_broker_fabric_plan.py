"""broker.fabric_plan: PKey allocation, the managed sections of partitions.conf / qos-policy.conf,
and parsing what the fabric answers (``smpquery pkeys`` and ``saquery PR`` output captured from
ibsim 0.10 + OpenSM 3.3.23 + infiniband-diags 44 on the default fat tree)."""

from __future__ import annotations

import pytest

from broker.fabric_plan import (
    PARTITIONS_BEGIN,
    PARTITIONS_END,
    PKEY_MAX,
    QOS_BEGIN,
    QOS_END,
    LeasePartition,
    ManagedState,
    Membership,
    PlanError,
    membership,
    operator_pkeys,
    parse_partitions,
    parse_path_record,
    parse_pkey_table,
    plan,
    qos_pkeys,
    render_partitions,
    render_qos,
)

# what deploy/local/fabric.sh writes
OPERATOR_PARTITIONS = (
    "# gpupool simulated fabric: the default partition, every port a full member.\n"
    "# The fabric manager adds one partition per lease and sends OpenSM a SIGHUP.\n"
    "Default=0x7fff, ipoib : ALL=full, ALL_SWITCHES=full, SELF=full ;\n"
)
OPERATOR_QOS = (
    "# gpupool simulated fabric: everything on SL 0 until the fabric manager maps lease partitions.\n"
    "qos-ulps\n"
    "    default : 0\n"
    "end-qos-ulps\n"
)
HOST_A = "0x0002c90300b00041"
HOST_B = "0x0002c90300b00051"
GW = "0x0002c90300b00101"


def _smpquery_pkeys(*pkeys: str) -> str:
    """``smpquery pkeys`` stdout for a port whose 64-entry P_Key table starts with ``pkeys`` (hex,
    the full-member bit included) and is 0x0000 after them."""
    cells = [*pkeys, *["0x0000"] * (64 - len(pkeys))]
    rows = [f"{i:4d}:" + "".join(f" {c}" for c in cells[i : i + 8]) + "\n" for i in range(0, 64, 8)]
    return "".join(rows) + "64 pkeys capacity for this port\n"


# `smpquery pkeys 12` (node005, a limited member of 0x0006) — stdout
PKEYS_LIMITED = _smpquery_pkeys("0xffff", "0x0006")
# `smpquery pkeys 4` (edge-gw, a full member of 0x0005 and 0x0006)
PKEYS_GATEWAY = _smpquery_pkeys("0xffff", "0x0000", "0x0000", "0x0000", "0x8005", "0x8006")
# `smpquery pkeys 99` (no such LID): exit status 255, this on stdout
PKEYS_UNREACHABLE = "smpquery: iberror: failed: operation pkeys: node info query failed\n"
# `saquery PR --slid 4 --dlid 12 --pkey 0x6`
PATH_RECORD = (
    "PathRecord dump:\n\t\tservice_id..............0x0000000000000000\n"
    "\t\tdgid....................fe80::2:c903:b0:41\n\t\tsgid....................fe80::2:c903:b0:101\n"
    "\t\tdlid....................12\n\t\tslid....................4\n\t\thop_flow_raw............0x0\n"
    "\t\ttclass..................0x0\n\t\tnum_path_revers.........0x80\n\t\tpkey....................0x6\n"
    "\t\tqos_class...............0x0\n\t\tsl......................0x1\n\t\tmtu.....................0x84\n"
    "\t\trate....................0x90\n\t\tpkt_life................0x92\n\t\tpreference..............0x0\n"
    "\t\tresv2...................0x000000000000\n"
)


def _entry(name: str, pkey: int, *limited: str, sl: int = 1) -> LeasePartition:
    return LeasePartition(name, pkey, sl, tuple(limited), (GW,))


# allocation ------------------------------------------------------------------------------------------
def test_allocation_is_deterministic_skips_taken_keys_and_reuses_freed_keys_last() -> None:
    st = ManagedState()
    k1, st = st.allocate()
    st = st.with_entry(_entry("lease-1", k1, HOST_A))
    k2, st = st.allocate(reserved={0x0003, 0x8004})  # operator keys, one with the full bit
    assert (k1, k2) == (0x0002, 0x0005)
    st = st.with_entry(_entry("lease-2", k2, HOST_B))
    st = st.without("lease-1")
    k3, st2 = st.allocate()
    assert k3 == 0x0006, "a freed key is not reused while never-used keys are left"
    assert st.allocate() == (k3, st2)  # same state in, same key out
    # at the top of the range: freed keys round-robin from the cursor; never 0x7fff
    used = (_entry("lease-2", 0x0005, HOST_B), _entry("lease-9", 0x0009, HOST_A))
    top = ManagedState(entries=used, next_pkey=PKEY_MAX, reuse_from=0x0004)
    keys = []
    for _ in range(4):
        k, top = top.allocate(reserved={0x0007})
        keys.append(k)
    assert keys == [PKEY_MAX, 0x0004, 0x0006, 0x0008]  # 5 and 9 in use, 7 the operator's
    assert top.reuse_from == 0x0009
    wrap = ManagedState(entries=used, next_pkey=PKEY_MAX + 1, reuse_from=PKEY_MAX)
    k, wrap = wrap.allocate()
    assert (k, wrap.reuse_from) == (PKEY_MAX, 0x0002)
    assert wrap.allocate()[0] == 0x0002
    # every key taken
    everything = set(range(0x0002, PKEY_MAX + 1))
    with pytest.raises(PlanError, match="no PKey left"):
        ManagedState(next_pkey=PKEY_MAX + 1).allocate(reserved=everything)


def test_allocation_survives_a_restart_through_the_state_line() -> None:
    st = ManagedState()
    for i in range(3):
        k, st = st.allocate()
        st = st.with_entry(_entry(f"lease-{i}", k, HOST_A))
    st = st.without("lease-1")
    text = render_partitions(OPERATOR_PARTITIONS, st)
    again = parse_partitions(text)
    assert again == st
    assert again.allocate() == st.allocate()
    full = ManagedState(next_pkey=PKEY_MAX + 1, reuse_from=0x1234)
    line = full.state_line()
    assert line == "# gpupool-state next=0x7fff reuse=0x1234"
    assert parse_partitions(render_partitions("", full)) == ManagedState(next_pkey=0x7FFF, reuse_from=0x1234)


def test_with_entry_refuses_duplicates() -> None:
    st = ManagedState().with_entry(_entry("lease-1", 2, HOST_A))
    with pytest.raises(PlanError, match="already exists"):
        st.with_entry(_entry("lease-1", 3, HOST_A))
    with pytest.raises(PlanError, match="already in use"):
        st.with_entry(_entry("lease-2", 2, HOST_B))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "lease 1"}, "partition name"),
        ({"name": "lease;x"}, "partition name"),
        ({"pkey": 0x7FFF}, "outside"),
        ({"pkey": 1}, "outside"),
        ({"sl": 16}, "sl 16"),
        ({"limited": ("0x2C9",)}, "port GUID"),
        ({"limited": (GW,)}, "both limited and full"),
        ({"full": ()}, "no full member"),
    ],
)
def test_lease_partition_rejects_bad_values(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"name": "lease-1", "pkey": 2, "sl": 1, "limited": (HOST_A,), "full": (GW,)}
    args.update(kwargs)
    with pytest.raises(PlanError, match=match):
        LeasePartition(**args)  # type: ignore[arg-type]


# partitions.conf -------------------------------------------------------------------------------------
def test_rendering_keeps_the_operators_lines_and_writes_opensm_syntax() -> None:
    st = ManagedState(entries=(_entry("lease-1f2e", 2, HOST_A, HOST_B),), next_pkey=3)
    text = render_partitions(OPERATOR_PARTITIONS, st)
    assert text.startswith(OPERATOR_PARTITIONS)
    assert text[len(OPERATOR_PARTITIONS) :] == (
        f"{PARTITIONS_BEGIN}\n"
        "# gpupool-state next=0x0003 reuse=0x0002\n"
        "lease-1f2e=0x0002, ipoib, sl=1, defmember=limited : "
        f"{HOST_A}=limited, {HOST_B}=limited, {GW}=full ;\n"
        f"{PARTITIONS_END}\n"
    )
    # operator lines after the section and a missing final newline are kept as they are
    around = "Default=0x7fff : ALL=full ;" + "\n" + render_partitions("", st) + "Storage=0x0100 : ALL ;"
    emptied = render_partitions(around, ManagedState(next_pkey=3))
    assert emptied.startswith("Default=0x7fff : ALL=full ;\n" + PARTITIONS_BEGIN)
    assert emptied.endswith(f"{PARTITIONS_END}\nStorage=0x0100 : ALL ;")
    assert parse_partitions(emptied) == ManagedState(next_pkey=3)
    assert render_partitions("Default=0x7fff : ALL ;", ManagedState()).startswith(
        "Default=0x7fff : ALL ;\n# BEGIN"
    )
    # rendering the parsed state again changes nothing
    assert render_partitions(text, parse_partitions(text)) == text


def test_long_member_lists_continue_on_lines_opensm_can_read() -> None:
    hosts = [f"0x0002c90300b{i:05x}" for i in range(0x10, 0x10 + 9 * 0x10, 0x10)]
    entry = LeasePartition("lease-big", 0x0042, 3, tuple(hosts), (GW,))
    lines = entry.render().split("\n")
    assert lines == [
        "lease-big=0x0042, ipoib, sl=3, defmember=limited : "
        + ", ".join(f"{h}=limited" for h in hosts[:8])
        + ",",
        f"    {hosts[8]}=limited, {GW}=full ;",
    ]
    assert max(len(ln) for ln in lines) < 4000  # OpenSM's line buffer is 4096 bytes
    st = ManagedState(entries=(entry, _entry("lease-2", 2, HOST_A)), next_pkey=0x43)
    text = render_partitions(OPERATOR_PARTITIONS, st)
    assert parse_partitions(text) == st and render_partitions(text, st) == text
    # a continuation line edited by hand is refused
    with pytest.raises(PlanError, match="not written by gpupool"):
        parse_partitions(text.replace(f"    {hosts[8]}=limited", f"  {hosts[8]}=limited"))
    with pytest.raises(PlanError, match="not ended by"):
        parse_partitions(
            text.replace(f"{GW}=full ;\nlease-2", f"{GW}=full\nlease-2").replace(
                f"{GW}=full ;\n{PARTITIONS_END}", f"{GW}=full\n{PARTITIONS_END}"
            )
        )


@pytest.mark.parametrize(
    "text",
    [
        f"{PARTITIONS_BEGIN}\n{PARTITIONS_BEGIN}\n{PARTITIONS_END}\n",
        f"{PARTITIONS_END}\n{PARTITIONS_BEGIN}\n",
        f"{PARTITIONS_BEGIN}\nDefault=0x7fff : ALL ;\n",
        f"{PARTITIONS_BEGIN}\nlease-1=0x0002 : ALL=full ;\n{PARTITIONS_END}\n",
        f"{PARTITIONS_BEGIN}\nlease-1=0x0002, ipoib, sl=1, defmember=limited : ALL=full ;\n"
        f"{PARTITIONS_END}\n",
    ],
)
def test_a_broken_or_hand_edited_section_is_refused(text: str) -> None:
    with pytest.raises(PlanError):
        parse_partitions(text)
    with pytest.raises(PlanError):
        render_partitions(text, ManagedState())


def test_operator_pkeys_from_the_opensm_man_page_examples() -> None:
    text = (
        "Default=0x7fff : ALL, SELF=full ;\n"
        "NewPartition , ipoib : 0x123456=full, 0x3456789034=limi,  0x2134af2306 ;\n"
        "YetAnotherOne = 0x300 : SELF=full ;\n"
        "ShareIO = 0x80 , defmember=full : 0x123451, 0x123452;\n"
        "# Hidden=0x0042 : ALL ;\n"
        "Storage = 0x8101, ipoib : # a comment between\n"
        "    0x123453=full ;\n"
        + render_partitions("", ManagedState(entries=(_entry("lease-1", 0x0002, HOST_A),)))
    )
    assert operator_pkeys(text) == {0x7FFF, 0x0300, 0x0080, 0x0101}


# qos-policy.conf -------------------------------------------------------------------------------------
def test_qos_rules_go_first_in_qos_ulps_and_round_trip() -> None:
    st = ManagedState(entries=(_entry("lease-1", 2, HOST_A), _entry("lease-2", 3, HOST_B, sl=4)))
    text = render_qos(OPERATOR_QOS, st)
    assert text == (
        OPERATOR_QOS.split("qos-ulps\n")[0]
        + "qos-ulps\n"
        + f"{QOS_BEGIN}\n"
        + "    any, pkey 0x0002 : 1  # lease-1\n"
        + "    any, pkey 0x0003 : 4  # lease-2\n"
        + f"{QOS_END}\n"
        + "    default : 0\nend-qos-ulps\n"
    )
    assert qos_pkeys(text) == {2: 1, 3: 4}
    assert render_qos(text, st) == text
    emptied = render_qos(text, ManagedState())
    assert qos_pkeys(emptied) == {} and emptied.replace(f"{QOS_BEGIN}\n{QOS_END}\n", "") == OPERATOR_QOS


def test_qos_without_a_ulps_section_gets_one() -> None:
    st = ManagedState(entries=(_entry("lease-1", 2, HOST_A),))
    assert (
        render_qos("", st) == f"qos-ulps\n{QOS_BEGIN}\n    any, pkey 0x0002 : 1  # lease-1\n{QOS_END}\n"
        "    default : 0\nend-qos-ulps\n"
    )
    full = (
        "qos-levels\n    qos-level\n        name: DEFAULT\n        sl: 0\n    end-qos-level\nend-qos-levels"
    )
    out = render_qos(full, st)
    assert out.startswith(full + "\nqos-ulps\n") and "default : 0" not in out


def test_qos_section_outside_qos_ulps_or_edited_is_refused() -> None:
    with pytest.raises(PlanError, match="not inside qos-ulps"):
        render_qos(f"{QOS_BEGIN}\n{QOS_END}\nqos-ulps\ndefault : 0\nend-qos-ulps\n", ManagedState())
    with pytest.raises(PlanError, match="not written by gpupool"):
        qos_pkeys(f"qos-ulps\n{QOS_BEGIN}\n    ipoib : 3\n{QOS_END}\nend-qos-ulps\n")


def test_dry_run_diff_shows_both_files_and_nothing_when_unchanged() -> None:
    st = ManagedState(entries=(_entry("lease-1", 2, HOST_A),), next_pkey=3)
    fp = plan(OPERATOR_PARTITIONS, OPERATOR_QOS, st)
    d = fp.diff()
    assert fp.changed
    assert "--- a/partitions.conf\n+++ b/partitions.conf\n" in d
    assert f"+lease-1=0x0002, ipoib, sl=1, defmember=limited : {HOST_A}=limited, {GW}=full ;\n" in d
    assert (
        "--- a/qos-policy.conf\n+++ b/qos-policy.conf\n" in d
        and "+    any, pkey 0x0002 : 1  # lease-1\n" in d
    )
    assert not [ln for ln in d.splitlines() if ln.startswith("-") and not ln.startswith("---")]
    same = plan(fp.partitions_new, fp.qos_new, st)
    assert not same.changed and same.diff() == ""
    assert plan(OPERATOR_PARTITIONS, None, st).qos_new is None


# reading the fabric back ---------------------------------------------------------------------------------
def test_pkey_tables_from_smpquery() -> None:
    limited = parse_pkey_table(PKEYS_LIMITED)
    assert len(limited) == 64 and limited[:2] == [0xFFFF, 0x0006]
    assert membership(limited, 0x0006) is Membership.LIMITED
    assert membership(limited, 0x7FFF) is Membership.FULL
    assert membership(limited, 0x0005) is None
    gw = parse_pkey_table(PKEYS_GATEWAY)
    assert membership(gw, 0x0005) is Membership.FULL and membership(gw, 0x8006) is Membership.FULL
    assert membership([0xFFFF, 0x0007, 0x8007], 0x0007) is Membership.BOTH
    assert membership([0x0000, 0x8000], 0x0000) is None  # empty slots are no partition


@pytest.mark.parametrize(
    "text",
    [PKEYS_UNREACHABLE, "", "   8: 0x0000 0x0000\n", "   0: 0xffff 0x0000\n  16: 0x0000\n"],
)
def test_bad_pkey_tables_are_errors(text: str) -> None:
    with pytest.raises(ValueError, match="smpquery pkeys"):
        parse_pkey_table(text)


def test_path_record_from_saquery() -> None:
    pr = parse_path_record(PATH_RECORD)
    assert pr is not None
    assert (pr["sl"], pr["pkey"], pr["slid"], pr["dlid"], pr["mtu"]) == (1, 6, 4, 12, 0x84)
    assert "dgid" not in pr
    assert parse_path_record("") is None  # limited to limited: the SA has no path, saquery prints nothing
