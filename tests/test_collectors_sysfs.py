"""InfiniBand sysfs reader on the handed sysfs cases, with the values of sysfs_cases/expected.json."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest

from collectors import sysfs_ib
from collectors.sysfs_ib import normalise_guid, parse_rate, parse_state, read_sysfs_infiniband
from contracts import IbPortSample, decode, encode

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
CASES_DIR = DATA / "cases" / "sysfs_cases"
EXPECTED = json.loads((CASES_DIR / "expected.json").read_text())
CASES = {c["id"]: c for c in json.loads((DATA / "cases" / "cases.json").read_text())}

PMA = {  # sysfs counter file → PMA name used on the bus
    "port_xmit_data": "PortXmitData",
    "port_rcv_data": "PortRcvData",
    "port_xmit_packets": "PortXmitPkts",
    "port_rcv_packets": "PortRcvPkts",
    "port_xmit_wait": "PortXmitWait",
    "symbol_error": "SymbolErrorCounter",
    "link_downed": "LinkDownedCounter",
    "link_error_recovery": "LinkErrorRecoveryCounter",
    "port_rcv_errors": "PortRcvErrors",
    "port_xmit_discards": "PortXmitDiscards",
    "local_link_integrity_errors": "LocalLinkIntegrityErrors",
    "excessive_buffer_overrun_errors": "ExcessiveBufferOverrunErrors",
    "VL15_dropped": "VL15Dropped",
    "port_rcv_remote_physical_errors": "PortRcvRemotePhysicalErrors",
    "port_rcv_switch_relay_errors": "PortRcvSwitchRelayErrors",
    "port_rcv_constraint_errors": "PortRcvConstraintErrors",
    "port_xmit_constraint_errors": "PortXmitConstraintErrors",
}


def _read(case: str, **kw: object) -> sysfs_ib.SysfsReadResult:
    return read_sysfs_infiniband(CASES_DIR / case / "sys", "host-a", 1000.0, **kw)  # type: ignore[arg-type]


def _port(res: sysfs_ib.SysfsReadResult, device: str, port: int = 1) -> IbPortSample:
    [p] = [p for p in res.ports if p.device == device and p.port == port]
    return p


def test_ib01_no_pma_counters_are_null_and_the_rest_is_collected() -> None:
    assert CASES["IB-01"]["input"]["path"] == "sysfs_cases/na_no_pma"
    res = _read("na_no_pma")
    want = EXPECTED["cases"]["na_no_pma"]["expect"]
    i40 = _port(res, "i40iw0")
    w = want["i40iw0/1"]
    assert (i40.state_id, i40.phys_state_id, i40.rate_bytes_per_second, i40.link_layer) == (
        w["state_id"],
        w["phys_state_id"],
        w["rate_bytes_per_second"],
        w["link_layer"],
    )
    assert i40.counters and all(v is None for v in i40.counters.values())
    assert set(i40.counters) == {
        PMA[f.name] for f in (CASES_DIR / "na_no_pma/sys/class/infiniband/i40iw0/ports/1/counters").iterdir()
    }
    assert res.devices["i40iw0"].hca_type == w["hca_type"] and i40.node_guid is w["node_guid"] is None
    mlx = _port(res, "mlx5_0")
    assert mlx.data_bytes("PortXmitData") == want["mlx5_0/1"]["port_xmit_bytes"] == 4000
    assert mlx.data_bytes("PortRcvData") == want["mlx5_0/1"]["port_rcv_bytes"] == 1000
    assert res.errors == []  # collector_ok
    assert i40.saturated == [] and mlx.saturated == []


def test_ib02_data_counters_are_4_octet_words() -> None:
    case = CASES["IB-02"]
    assert case["expected"] == "4000 bytes"
    p = _port(_read("na_no_pma"), "mlx5_0")
    assert (CASES_DIR / "na_no_pma/sys/class/infiniband/mlx5_0" / case["input"]["file"]).read_text() == case[
        "input"
    ]["content"]
    assert p.counters["PortXmitData"] == 1000 and p.data_bytes("PortXmitData") == 4000
    assert p.rate_bytes_per_second == 12_500_000_000  # bytes never scale with the link width


def test_ib04_unpopulated_cage_rate_is_zero() -> None:
    res = _read("rate_zero_unpopulated")
    w = EXPECTED["cases"]["rate_zero_unpopulated"]["expect"]["mlx5_1/1"]
    p = _port(res, "mlx5_1")
    assert (p.rate_bytes_per_second, p.state_id, p.state, p.phys_state_id, p.phys_state) == (
        w["rate_bytes_per_second"],
        w["state_id"],
        w["state"],
        w["phys_state_id"],
        w["phys_state"],
    )
    assert res.errors == []


def test_ib06_hw_counters_only_device_by_stat_not_name() -> None:
    res = _read("irdma_hw_counters_only")
    w = EXPECTED["cases"]["irdma_hw_counters_only"]["expect"]
    dev = res.devices["irdma0"]
    assert (dev.board_id, dev.hca_type, dev.fw_ver) == (
        w["irdma0"]["board_id"],
        w["irdma0"]["hca_type"],
        w["irdma0"]["fw_ver"],
    )
    p = _port(res, "irdma0")
    assert p.link_layer == w["irdma0"]["ports"]["1"]["link_layer"]
    assert p.counters == {} and p.hw_counters == w["irdma0"]["ports"]["1"]["hw_counters"]
    assert _port(res, "mlx5_0").data_bytes("PortXmitData") == w["mlx5_0/1"]["port_xmit_bytes"]
    assert res.errors == []


def test_ib06_renamed_devices_are_detected_by_stat(tmp_path: Path) -> None:
    src = CASES_DIR / "irdma_hw_counters_only" / "sys" / "class" / "infiniband"
    dst = tmp_path / "sys" / "class" / "infiniband"
    shutil.copytree(src / "irdma0", dst / "mlx5_9")  # an irdma device with an mlx-looking name
    shutil.copytree(src / "mlx5_0", tmp_path / "devices" / "hca0")
    (dst / "ib0").symlink_to(tmp_path / "devices" / "hca0")  # sysfs devices are symlinks
    (dst / "stray_file").write_text("x")
    res = read_sysfs_infiniband(tmp_path / "sys", "h", 1.0)
    assert sorted(res.devices) == ["ib0", "mlx5_9"]
    assert _port(res, "mlx5_9").hw_counters["ip4InReceives"] == 123 and _port(res, "mlx5_9").counters == {}
    assert _port(res, "ib0").counters["PortXmitData"] == 1000


def test_ib08_no_infiniband_class_is_an_empty_success(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("DEBUG", logger="collectors.sysfs_ib"):
        res = _read("no_infiniband_class")
    assert (
        res.ports == [] and res.devices == {} == EXPECTED["cases"]["no_infiniband_class"]["expect"]["devices"]
    )
    assert res.errors == []
    assert all(r.levelname == "DEBUG" for r in caplog.records)
    assert read_sysfs_infiniband(Path("/nonexistent/sys"), "h", 1.0).errors == []


def test_ib10_roce_ports_are_tagged_by_link_layer() -> None:
    res = _read("roce_link_layer_ethernet")
    w = EXPECTED["cases"]["roce_link_layer_ethernet"]["expect"]["mlx5_2/1"]
    p = _port(res, "mlx5_2")
    assert (p.link_layer, p.rate_bytes_per_second, p.data_bytes("PortXmitData")) == (
        w["link_layer"],
        w["rate_bytes_per_second"],
        w["port_xmit_bytes"],
    )
    assert {k: p.hw_counters[k] for k in w["hw_counters"] if k != "lifespan_ms"} == {
        k: v for k, v in w["hw_counters"].items() if k != "lifespan_ms"
    }
    assert p.hw_counters["lifespan"] == w["hw_counters"]["lifespan_ms"]


def test_ib14_saturated_counters_flagged_with_their_widths() -> None:
    res = _read("saturated_pma_counters")
    w = EXPECTED["cases"]["saturated_pma_counters"]["expect"]["mlx4_0/1"]
    p = _port(res, "mlx4_0")
    want = {}
    for item in w["saturated"]:  # "port_xmit_wait(32)"
        name, bits = item.rstrip(")").split("(")
        want[PMA[name]] = int(bits)
    assert set(p.saturated) == set(want)
    assert {n: p.counter_bits[n] for n in want} == want
    assert p.data_bytes("PortXmitData") == w["port_xmit_bytes_raw_x4"]
    assert "VL15Dropped" not in p.saturated and p.counters["VL15Dropped"] == 0


def test_extended_table_data_counters_are_64_bit(tmp_path: Path) -> None:
    port = tmp_path / "sys/class/infiniband/mlx5_0/ports/1"
    (port / "counters").mkdir(parents=True)
    for name, value in {
        "port_xmit_data": 4294967295,
        "port_xmit_wait": 4294967295,
        "unicast_xmit_packets": 5,
    }.items():
        (port / "counters" / name).write_text(f"{value}\n")
    p = read_sysfs_infiniband(tmp_path / "sys", "h", 1.0).ports[0]
    assert p.counter_bits == {"PortXmitData": 64, "PortXmitWait": 32, "PortUnicastXmitPkts": 64}
    assert p.saturated == ["PortXmitWait"]  # 2**32-1 of a 64-bit data counter is just a value


def test_unreadable_files_lose_only_their_own_value(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """EINVAL on VL15_dropped (procfs#704), EACCES on port_xmit_wait (procfs 919f5d1), EINVAL on rate
    (kernel rate_show without a cable), garbage in a counter: each loses one value."""
    shutil.copytree(CASES_DIR / "na_no_pma" / "sys", tmp_path / "sys")
    port = tmp_path / "sys/class/infiniband/mlx5_0/ports/1"
    (port / "counters" / "symbol_error").write_text("12abc\n")
    failing = {
        str(port / "counters" / "VL15_dropped"): errno.EINVAL,
        str(port / "counters" / "port_xmit_wait"): errno.EACCES,
        str(port / "rate"): errno.EINVAL,
    }
    real = sysfs_ib._read_file

    def fake(path: str) -> bytes:
        if path in failing:
            raise OSError(failing[path], "mock")
        return real(path)

    monkeypatch.setattr(sysfs_ib, "_read_file", fake)
    res = read_sysfs_infiniband(tmp_path / "sys", "h", 1.0)
    p = _port(res, "mlx5_0")
    assert p.counters["VL15Dropped"] is None and p.counters["PortXmitWait"] is None
    assert p.counters["SymbolErrorCounter"] is None
    assert p.rate_bytes_per_second is None and p.state_id == 4
    assert p.counters["PortXmitData"] == 1000 and p.counters["PortRcvData"] == 250
    assert sorted((Path(e.path).name, e.reason) for e in res.errors) == [
        ("VL15_dropped", "einval"),
        ("port_xmit_wait", "eacces"),
        ("rate", "einval"),
        ("symbol_error", "unparseable_counter"),
    ]
    assert _port(res, "i40iw0").rate_bytes_per_second == 1_250_000_000  # other devices untouched


def test_unparseable_state_rate_guid(tmp_path: Path) -> None:
    shutil.copytree(CASES_DIR / "na_no_pma" / "sys", tmp_path / "sys")
    dev = tmp_path / "sys/class/infiniband/mlx5_0"
    (dev / "node_guid").write_text("zzzz\n")
    (dev / "ports/1/state").write_text("ACTIVE\n")
    (dev / "ports/1/rate").write_text("fast\n")
    res = read_sysfs_infiniband(tmp_path / "sys", "h", 1.0)
    p = _port(res, "mlx5_0")
    assert (p.node_guid, p.state_id, p.state, p.rate_bytes_per_second) == (None, None, None, None)
    assert p.phys_state_id == 5 and p.counters["PortXmitData"] == 1000
    assert sorted(e.reason for e in res.errors) == [
        "unparseable_guid",
        "unparseable_rate",
        "unparseable_state",
    ]


@pytest.mark.parametrize("entry", EXPECTED["rate_strings"], ids=lambda e: e["text"])
def test_rate_strings(entry: dict[str, object]) -> None:
    assert parse_rate(str(entry["text"])) == entry["bytes_per_second"]


@pytest.mark.parametrize("text", ["", "Gb/sec", "fast Gb/sec", "-1 Gb/sec", "10 Mb/sec", "1.2.3 Gb/sec"])
def test_bad_rate_strings(text: str) -> None:
    with pytest.raises(ValueError):
        parse_rate(text)


def test_state_and_guid_parsing() -> None:
    assert parse_state("4: ACTIVE") == (4, "ACTIVE") and parse_state("5: LinkUp") == (5, "LinkUp")
    assert parse_state("1: DOWN\n") == (1, "DOWN")
    assert normalise_guid("0002:c903:00a1:b2c3") == "0x0002c90300a1b2c3"
    assert normalise_guid("0a7f:bc12:45ef:d23b") == "0x0a7fbc1245efd23b"
    assert normalise_guid("0x0002C90300A1B2C3") == "0x0002c90300a1b2c3"
    for bad in ("", "0002:c903:00a1", "zz:00:00:00", "0x" + "1" * 17):
        with pytest.raises(ValueError):
            normalise_guid(bad)


def test_samples_are_keyed_numbered_and_round_trip() -> None:
    res = _read("na_no_pma", seq_start=7)
    assert [(p.key, p.seq) for p in res.ports] == [("host-a:i40iw0/1", 7), ("0x0000000000000001/1", 8)]
    for p in res.ports:
        assert decode(IbPortSample, encode(p)) == p and p.source == "sysfs" and p.ts == 1000.0
    assert res.raw_counters["mlx5_0/ports/1/counters/port_xmit_data"] == 1000
