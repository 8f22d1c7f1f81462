"""The sysfs reader against the reference exporters' own fixtures and outputs.

* node_exporter: ``node_exporter_sys_class_infiniband.ttar`` read by gpupool must give every value
  of node_exporter's ``node_exporter_e2e_output_infiniband.prom`` for the same tree (the .prom is
  parsed here with prometheus_client's parser, the yardstick).
* procfs: ``procfs_sys_class_infiniband.ttar`` must give the values prometheus/procfs's
  ``sysfs/class_infiniband_test.go`` expects (transcribed below; its data counters are in bytes).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from collectors.sysfs_ib import SysfsReadResult, read_sysfs_infiniband
from collectors.ttar import materialize_ttar

TELEMETRY = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "telemetry"

# node_exporter metric (without _total) → (directory, file, multiplier); directory "" = port file
NODE_EXPORTER_COUNTERS = {
    "node_infiniband_legacy_data_received_bytes": ("counters_ext", "port_rcv_data_64", 4),
    "node_infiniband_legacy_data_transmitted_bytes": ("counters_ext", "port_xmit_data_64", 4),
    "node_infiniband_legacy_multicast_packets_received": ("counters_ext", "port_multicast_rcv_packets", 1),
    "node_infiniband_legacy_multicast_packets_transmitted": (
        "counters_ext",
        "port_multicast_xmit_packets",
        1,
    ),
    "node_infiniband_legacy_packets_received": ("counters_ext", "port_rcv_packets_64", 1),
    "node_infiniband_legacy_packets_transmitted": ("counters_ext", "port_xmit_packets_64", 1),
    "node_infiniband_legacy_unicast_packets_received": ("counters_ext", "port_unicast_rcv_packets", 1),
    "node_infiniband_legacy_unicast_packets_transmitted": ("counters_ext", "port_unicast_xmit_packets", 1),
    "node_infiniband_link_downed": ("counters", "link_downed", 1),
    "node_infiniband_link_error_recovery": ("counters", "link_error_recovery", 1),
    "node_infiniband_multicast_packets_received": ("counters", "multicast_rcv_packets", 1),
    "node_infiniband_multicast_packets_transmitted": ("counters", "multicast_xmit_packets", 1),
    "node_infiniband_port_constraint_errors_received": ("counters", "port_rcv_constraint_errors", 1),
    "node_infiniband_port_constraint_errors_transmitted": ("counters", "port_xmit_constraint_errors", 1),
    "node_infiniband_port_data_received_bytes": ("counters", "port_rcv_data", 4),
    "node_infiniband_port_data_transmitted_bytes": ("counters", "port_xmit_data", 4),
    "node_infiniband_port_discards_received": ("counters", "port_rcv_discards", 1),
    "node_infiniband_port_discards_transmitted": ("counters", "port_xmit_discards", 1),
    "node_infiniband_port_errors_received": ("counters", "port_rcv_errors", 1),
    "node_infiniband_port_packets_received": ("counters", "port_rcv_packets", 1),
    "node_infiniband_port_packets_transmitted": ("counters", "port_xmit_packets", 1),
    "node_infiniband_port_transmit_wait": ("counters", "port_xmit_wait", 1),
    "node_infiniband_unicast_packets_received": ("counters", "unicast_rcv_packets", 1),
    "node_infiniband_unicast_packets_transmitted": ("counters", "unicast_xmit_packets", 1),
}


@pytest.fixture(scope="module")
def node_exporter_tree() -> Iterator[SysfsReadResult]:
    with materialize_ttar(TELEMETRY / "node_exporter_sys_class_infiniband.ttar") as root:
        yield read_sysfs_infiniband(root / "sys", "h", 1.0)


def _ours(res: SysfsReadResult, metric: str, device: str, port: int) -> float | None:
    p = next(p for p in res.ports if p.device == device and p.port == port)
    if metric == "node_infiniband_rate_bytes_per_second":
        return p.rate_bytes_per_second
    if metric == "node_infiniband_state_id":
        return p.state_id
    if metric == "node_infiniband_physical_state_id":
        return p.phys_state_id
    directory, name, factor = NODE_EXPORTER_COUNTERS[metric]
    raw = res.raw_counters.get(f"{device}/ports/{port}/{directory}/{name}")
    return None if raw is None else raw * factor


def test_every_node_exporter_value_matches(node_exporter_tree: SysfsReadResult) -> None:
    res = node_exporter_tree
    assert res.errors == []
    text = (TELEMETRY / "node_exporter_e2e_output_infiniband.prom").read_text()
    seen: set[tuple[str, str, int]] = set()
    checked = 0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "node_scrape_collector_success":
                assert s.value == 1
                continue
            if s.name == "node_infiniband_info":
                dev = res.devices[s.labels["device"]]
                assert (dev.board_id, dev.fw_ver, dev.hca_type) == (
                    s.labels["board_id"],
                    s.labels["firmware_version"],
                    s.labels["hca_type"],
                )
                checked += 1
                continue
            metric = s.name.removesuffix("_total")
            device, port = s.labels["device"], int(s.labels["port"])
            assert _ours(res, metric, device, port) == s.value, (metric, device, port)
            seen.add((metric, device, port))
            checked += 1
    assert checked == 51  # every node_infiniband_* sample of the file
    # ...and node_exporter leaves out exactly what gpupool has no value for (N/A, missing files).
    for metric in NODE_EXPORTER_COUNTERS:
        for p in res.ports:
            if (metric, p.device, p.port) not in seen:
                assert _ours(res, metric, p.device, p.port) is None, (metric, p.device, p.port)


def test_node_exporter_tree_merged_counters(node_exporter_tree: SysfsReadResult) -> None:
    ports = {(p.device, p.port): p for p in node_exporter_tree.ports}
    i40 = ports[("i40iw0", 1)]
    assert all(v is None for v in i40.counters.values()) and i40.rate_bytes_per_second == 1_250_000_000
    p1, p2 = ports[("mlx4_0", 1)], ports[("mlx4_0", 2)]
    # counters/ holds the extended table (its unicast_* files), so both sources are 64-bit and the
    # kernel's counters/ value is kept; counters_ext/ fills what counters/ lacks.
    assert p1.counters["PortRcvPkts"] == 6825908347 and p1.counter_bits["PortRcvPkts"] == 64
    assert p2.counters["PortXmitData"] == 0 and p2.counters["PortXmitPkts"] == 0
    assert p2.counters["PortUnicastXmitPkts"] == 0 and p1.counters["PortUnicastXmitPkts"] == 61239
    assert p1.saturated == ["PortXmitWait"] and p1.counter_bits["PortXmitWait"] == 32
    assert p1.counters["PortRcvDiscards"] == 0 and "PortRcvDiscards" not in p1.counter_bits


# prometheus/procfs sysfs/class_infiniband_test.go, TestInfiniBandClass (data counters in bytes there).
PROCFS_WANT = {
    ("hfi1_0", 1): {
        "rate": 12500000000,
        "state": (4, "ACTIVE"),
        "phys": (5, "LinkUp"),
        "PortRcvData": 1380366808104,
        "PortRcvPkts": 638036947,
        "PortXmitData": 1094233306172,
        "PortXmitPkts": 568318856,
        "PortXmitWait": 0,
    },
    ("mlx4_0", 1): {
        "rate": 5000000000,
        "state": (4, "ACTIVE"),
        "phys": (5, "LinkUp"),
        "PortRcvData": 8884894436,
        "PortRcvPkts": 87169372,
        "PortXmitData": 106036453180,
        "PortXmitPkts": 85734114,
        "PortXmitWait": 3599,
    },
    ("mlx4_0", 2): {
        "rate": 5000000000,
        "state": (4, "ACTIVE"),
        "phys": (5, "LinkUp"),
        "PortRcvData": 9841747136,
        "PortRcvPkts": 89332064,
        "PortXmitData": 106161427560,
        "PortXmitPkts": 88622850,
        "PortXmitWait": 3846,
    },
    ("mlx5_0", 1): {
        "rate": 3125000000,
        "state": (4, "ACTIVE"),
        "phys": (4, "ACTIVE"),
        "PortRcvData": 72505381512,
        "PortRcvPkts": 541889824,
        "PortXmitData": 11523046035392,
        "PortXmitPkts": 10907922116,
        "PortXmitWait": 0,
        "PortUnicastRcvPkts": 541889824,
        "PortUnicastXmitPkts": 10907922116,
        "PortMulticastRcvPkts": 0,
        "PortMulticastXmitPkts": 0,
    },
}
PROCFS_MLX5_HW = {
    "duplicate_request": 41,
    "implied_nak_seq_err": 0,
    "lifespan": 10,
    "local_ack_timeout_err": 131,
    "out_of_buffer": 0,
    "out_of_sequence": 1,
    "packet_seq_err": 1,
    "req_cqe_error": 3481,
    "req_cqe_flush_error": 80,
    "req_remote_access_errors": 0,
    "req_remote_invalid_request": 0,
    "resp_cqe_error": 8109,
    "resp_cqe_flush_error": 4708,
    "resp_local_length_error": 0,
    "resp_remote_access_errors": 0,
    "rnr_nak_retry_err": 0,
    "roce_adp_retrans": 99,
    "roce_adp_retrans_to": 4,
    "roce_slow_restart": 0,
    "roce_slow_restart_cnps": 131,
    "roce_slow_restart_trans": 0,
    "rx_atomic_requests": 0,
    "rx_dct_connect": 0,
    "rx_read_requests": 175528982,
    "rx_write_requests": 742114,
}
ERROR_COUNTERS = (
    "SymbolErrorCounter",
    "LinkErrorRecoveryCounter",
    "LinkDownedCounter",
    "PortRcvErrors",
    "PortRcvRemotePhysicalErrors",
    "PortRcvSwitchRelayErrors",
    "PortXmitDiscards",
    "PortXmitConstraintErrors",
    "PortRcvConstraintErrors",
    "LocalLinkIntegrityErrors",
    "ExcessiveBufferOverrunErrors",
    "VL15Dropped",
)


def test_procfs_fixture_values() -> None:
    with materialize_ttar(TELEMETRY / "procfs_sys_class_infiniband.ttar") as root:
        res = read_sysfs_infiniband(root / "fixtures" / "sys", "h", 1.0)
    assert res.errors == []
    assert {k: (d.board_id, d.fw_ver, d.hca_type, d.node_guid) for k, d in res.devices.items()} == {
        "hfi1_0": (
            "HPE 100Gb 1-port OP101 QSFP28 x16 PCIe Gen3 with Intel Omni-Path Adapter",
            "1.27.0",
            None,
            None,
        ),
        "mlx4_0": ("SM_1141000001000", "2.31.5050", "MT4099", None),
        "mlx5_0": ("SM_2001000001034", "14.28.2006", "MT4118", "0x0a7fbc1245efd23b"),  # no final newline
    }
    ports = {(p.device, p.port): p for p in res.ports}
    assert set(ports) == set(PROCFS_WANT)
    for key, want in PROCFS_WANT.items():
        p = ports[key]
        assert p.rate_bytes_per_second == want["rate"]
        assert (p.state_id, p.state) == want["state"] and (p.phys_state_id, p.phys_state) == want["phys"]
        assert p.link_layer == "InfiniBand"  # mlx4_0/2's file has a blank second line
        for name, value in want.items():
            if name[0].isupper():
                got = p.data_bytes(name) if name in ("PortRcvData", "PortXmitData") else p.counters[name]
                assert got == value, (key, name)
        assert all(p.counters[c] == 0 for c in ERROR_COUNTERS), key
    assert ports[("mlx5_0", 1)].hw_counters == PROCFS_MLX5_HW
    assert all(not p.hw_counters for k, p in ports.items() if k[0] != "mlx5_0")
