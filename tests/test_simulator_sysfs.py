"""simulator.sysfs: per-node InfiniBand sysfs trees whose counters advance with the GPUs' load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from simulator.fleet import Fleet
from simulator.sysfs import COUNTER_BITS, HW_COUNTERS, LINK_RATE_BYTES_PER_S, SysfsTree
from simulator.trace import Trace
from tests.support import T0



@pytest.fixture
def fleet(trace: Trace) -> Fleet:
    return Fleet(trace, nodes=2, gpus_per_node=8, seed=3, t0=T0, clock=lambda: T0)


def _read(path: Path) -> str:
    return path.read_text()


def _counter(tree: SysfsTree, host: str, dev: str, name: str) -> int:
    return int(_read(tree.device_dir(host, dev) / "ports" / "1" / "counters" / name))


def test_tree_layout_looks_like_mlx5(fleet: Fleet, tmp_path: Path) -> None:
    tree = SysfsTree(fleet, tmp_path, at=T0)
    assert tree.roots() == [(h, tmp_path / h / "sys") for h in fleet.hosts()]
    for _host, sys_root in tree.roots():
        devs = sorted(p.name for p in (sys_root / "class" / "infiniband").iterdir())
        assert devs == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
        for dev in devs:
            d = sys_root / "class" / "infiniband" / dev
            assert _read(d / "hca_type") == "MT4129\n"
            assert re.fullmatch(r"\d+\.\d+\.\d+\n", _read(d / "fw_ver"))
            assert re.fullmatch(r"0002:c903:[0-9a-f]{4}:[0-9a-f]{4}\n", _read(d / "node_guid"))
            p = d / "ports" / "1"
            assert _read(p / "rate") == "400 Gb/sec (4X NDR)\n"
            assert _read(p / "state") == "4: ACTIVE\n"
            assert _read(p / "phys_state") == "5: LinkUp\n"
            assert _read(p / "link_layer") == "InfiniBand\n"
            assert sorted(f.name for f in (p / "counters").iterdir()) == sorted(COUNTER_BITS)
            assert sorted(f.name for f in (p / "hw_counters").iterdir()) == sorted(HW_COUNTERS)
            for f in (p / "counters").iterdir():
                assert re.fullmatch(r"\d+\n", _read(f))
    guids = {h.node_guid for h in tree.hcas()}
    assert len(guids) == 8
    assert tree.hca_for_gpu("gpu-node-002", 5).device == "mlx5_2"
    assert tree.hca("gpu-node-001", "mlx5_0").guid_hex == "0x" + _read(
        tree.device_dir("gpu-node-001", "mlx5_0") / "node_guid").strip().replace(":", "")


def test_one_hca_per_node_is_an_option(fleet: Fleet, tmp_path: Path) -> None:
    tree = SysfsTree(fleet, tmp_path, gpus_per_hca=8, at=T0)
    assert [h.device for h in tree.hcas("gpu-node-001")] == ["mlx5_0"]
    assert tree.hca_for_gpu("gpu-node-001", 7).gpu_indices == tuple(range(8))
    with pytest.raises(ValueError):
        SysfsTree(fleet, tmp_path / "x", gpus_per_hca=0)


def test_counters_advance_with_the_load_and_data_counts_words(fleet: Fleet, tmp_path: Path) -> None:
    tree = SysfsTree(fleet, tmp_path, at=T0)
    before = {(h.host, h.device): _counter(tree, h.host, h.device, "port_xmit_data") for h in tree.hcas()}
    before_bytes = {(h.host, h.device): tree.xmit_bytes(h.host, h.device) for h in tree.hcas()}
    t_end = T0 + 90.0  # 90 trace steps at speedup 57
    for k in range(1, 19):
        tree.update(T0 + 5 * k)
    grew_more = 0
    for h in tree.hcas():
        key = (h.host, h.device)
        after = _counter(tree, h.host, h.device, "port_xmit_data")
        words = after - before[key]
        # data words = bytes / 4: the file's delta × 4 is exactly the bytes the port sent
        assert 4 * words == tree.xmit_bytes(h.host, h.device) - before_bytes[key]
        busy_s = sum(fleet.util_seconds(h.host, i, T0, t_end) for i in h.gpu_indices)
        want_bytes = busy_s * 0.6 * LINK_RATE_BYTES_PER_S / 2 + 256 * 90
        assert 4 * words == pytest.approx(want_bytes, abs=8)
        assert words >= 64 * 90 - 1  # management traffic alone
        rcv = _counter(tree, h.host, h.device, "port_rcv_data")
        assert rcv > 0
        pk = _counter(tree, h.host, h.device, "port_xmit_packets")
        assert pk == _counter(tree, h.host, h.device, "unicast_xmit_packets")
        if busy_s > 0:
            grew_more += 1
    assert grew_more >= 4, "several HCAs carried GPU traffic in 90 steps"
    assert list((tmp_path / ".staging").iterdir()) == [], "no temporary file is left behind"


def test_counters_never_decrease_and_time_going_back_changes_nothing(fleet: Fleet, tmp_path: Path) -> None:
    tree = SysfsTree(fleet, tmp_path, at=T0)
    tree.update(T0 + 10)
    snap = {h.device + h.host: dict(h.counters) for h in tree.hcas()}
    tree.update(T0 + 5)
    tree.update(T0 + 10)
    assert {h.device + h.host: dict(h.counters) for h in tree.hcas()} == snap
    tree.update(T0 + 20)
    for h in tree.hcas():
        old = snap[h.device + h.host]
        assert all(h.counters[n] >= old[n] for n in COUNTER_BITS)


def test_pma_counters_saturate_at_their_width(fleet: Fleet, tmp_path: Path) -> None:
    tree = SysfsTree(fleet, tmp_path, at=T0)
    host, dev = "gpu-node-001", "mlx5_1"
    tree.set_counter(host, dev, "symbol_error", 1 << 20)
    assert _counter(tree, host, dev, "symbol_error") == 0xFFFF
    tree.set_counter(host, dev, "port_xmit_wait", (1 << 32) - 1)
    tree.set_counter(host, dev, "port_xmit_data", (1 << 64) - 5)
    tree.update(T0 + 30)
    assert _counter(tree, host, dev, "port_xmit_wait") == (1 << 32) - 1
    assert _counter(tree, host, dev, "port_xmit_data") == (1 << 64) - 1  # 64-bit: saturates, no wrap
    with pytest.raises(KeyError):
        tree.set_counter(host, dev, "PortXmitData", 1)
    with pytest.raises(ValueError):
        tree.set_counter(host, dev, "symbol_error", -1)


def test_link_down_stops_traffic(fleet: Fleet, tmp_path: Path) -> None:
    tree = SysfsTree(fleet, tmp_path, at=T0)
    host, dev = "gpu-node-002", "mlx5_0"
    tree.set_link(host, dev, up=False)
    p = tree.device_dir(host, dev) / "ports" / "1"
    assert _read(p / "state") == "1: DOWN\n" and _read(p / "phys_state") == "2: Polling\n"
    assert _counter(tree, host, dev, "link_downed") == 1
    data = _counter(tree, host, dev, "port_xmit_data")
    tree.update(T0 + 20)
    assert _counter(tree, host, dev, "port_xmit_data") == data
    tree.set_link(host, dev, up=True)
    tree.update(T0 + 40)
    assert _counter(tree, host, dev, "port_xmit_data") > data
    assert _read(p / "state") == "4: ACTIVE\n"
