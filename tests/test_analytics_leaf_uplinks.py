"""Leaf and uplink headroom in capacity updates (analytics on the in-process bus): analytics reads
``fabric.topology``, puts each host's ``leaf`` and its leaf's busiest-uplink headroom on every
update, and holds back the idle GPUs of a leaf whose uplinks leave less than the lent share or wait
for credits, until they recover."""

from __future__ import annotations

import pytest

from analytics.service import AnalyticsService
from contracts import FabricTopology, GpuState, IbPortSample, encode
from contracts.bus import MemoryBus
from contracts.fabric import FabricNode, FabricPort
from tests.analytics_support import IDLE, TOPICS, drain, latest
from tests.support import Clock
from tests.test_analytics_headroom import RATE, STEP, T0, gpu, send

SPINE, LEAF1, LEAF2 = "0x0000000000001000", "0x0000000000001001", "0x0000000000001002"
HOSTS = {"node001": LEAF1, "node002": LEAF1, "node003": LEAF2}


def _topology() -> FabricTopology:
    """spine ← leaf-1 (node001, node002), spine ← leaf-2 (node003); leaf port 10 goes up."""
    def port(p: int, peer: str, peer_port: int) -> FabricPort:
        return FabricPort(
            port=p, connected=True, peer_guid=peer, peer_port=peer_port, rate_bytes_per_second=RATE
        )

    cas, leaf_ports = [], {LEAF1: [port(10, SPINE, 1)], LEAF2: [port(10, SPINE, 2)]}
    for i, (host, leaf) in enumerate(HOSTS.items()):
        guid = f"0x00000000000020{i:02x}"
        cas.append(FabricNode(guid=guid, node_type="CA", lid=10 + i, description=f"{host} mlx5_0",
                              ports=[port(1, leaf, i + 1)]))  # fmt: skip
        leaf_ports[leaf].append(port(i + 1, guid, 1))
    switches = [
        FabricNode(guid=SPINE, node_type="SW", lid=1, description="spine-1",
                   ports=[port(1, LEAF1, 10), port(2, LEAF2, 10)]),
        FabricNode(guid=LEAF1, node_type="SW", lid=2, description="leaf-1", ports=leaf_ports[LEAF1]),
        FabricNode(guid=LEAF2, node_type="SW", lid=3, description="leaf-2", ports=leaf_ports[LEAF2]),
    ]  # fmt: skip
    return FabricTopology(ts=T0, nodes=switches + cas)


class SwitchPort:
    """A switch port read by the fabric collector: keyed by the switch's description."""

    def __init__(self, switch: str, guid: str, port: int) -> None:
        self.switch, self.guid, self.port = switch, guid, port
        self.xmit = self.rcv = 1_000_000
        self.wait = 0

    def read(self, ts: float, xmit: float, wait_per_word: float = 0.0) -> IbPortSample:
        words = int(xmit * RATE * STEP / 4)
        self.xmit += words
        self.rcv += words // 10
        self.wait += int(wait_per_word * words)
        return IbPortSample(
            ts=ts, host=self.switch, device=self.switch, node_guid=self.guid, port=self.port,
            rate_bytes_per_second=RATE, source="perfquery",
            counters={"PortXmitData": self.xmit, "PortRcvData": self.rcv, "PortXmitWait": self.wait},
        )  # fmt: skip


def _service(bus: MemoryBus, clock: Clock, **kw: float) -> AnalyticsService:
    return AnalyticsService(
        bus=bus, topics=TOPICS, db_path=":memory:", idle=IDLE, clock=clock, refresh_s=3600.0,
        headroom_refresh_s=5.0, headroom_window_s=60.0, **kw,
    )  # fmt: skip


async def _feed(bus: MemoryBus, start: int, leaf1: float, leaf2: float, wait2: float = 0.0) -> None:
    for i in range(start, start + 7):
        t = T0 + STEP * i
        for host in HOSTS:
            await send(bus, gpu(t, host))
        await send(bus, UP1.read(t, leaf1))
        await send(bus, DOWN1.read(t, leaf1 / 2))
        await send(bus, UP2.read(t, leaf2))
        await send(bus, DOWN2.read(t, leaf2 / 2, wait2))


UP1, DOWN1 = SwitchPort("leaf-1", LEAF1, 10), SwitchPort("spine-1", SPINE, 1)
UP2, DOWN2 = SwitchPort("leaf-2", LEAF2, 10), SwitchPort("spine-1", SPINE, 2)


def _sample(svc: AnalyticsService, name: str, **labels: str) -> float | None:
    """A sample of ``svc``'s Prometheus registry (``None`` if absent)."""
    return svc.registry.get_sample_value(name, labels)


async def test_leaf_uplinks_without_room_for_the_lent_share_hold_the_leaf_back() -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = _service(bus, clock, lent_share=0.2, max_uplink_xmit_wait=0.5)
    await svc.start()
    try:
        rejected = _sample(svc, "gpupool_analytics_rejected_records_total", reason="invalid_topology") or 0.0
        await bus.producer().send(TOPICS.fabric_topology, b"{not a topology", key="topology")
        await bus.producer().send(TOPICS.fabric_topology, encode(_topology()), key="topology")
        # leaf-1's uplink carries 85 % of its rate (headroom 0.15 < 0.2); leaf-2's 10 %
        await _feed(bus, 0, leaf1=0.85, leaf2=0.10)
        clock.t = T0 + 60
        await drain(svc)
        assert svc.leaves().leaf_of == {"node001": "leaf-1", "node002": "leaf-1", "node003": "leaf-2"}
        assert _sample(svc, "gpupool_analytics_rejected_records_total", reason="invalid_topology") == rejected + 1
        clock.t = T0 + 70  # next headroom refresh: the rows are stored now
        await drain(svc)
        figures = svc.leaf_headroom()
        assert figures["leaf-1"].headroom == pytest.approx(0.15, abs=1e-6) and figures["leaf-1"].ports == 2
        assert figures["leaf-2"].headroom == pytest.approx(0.90, abs=1e-6)
        gauge = _sample(svc, "gpupool_analytics_leaf_uplink_headroom_ratio", leaf="leaf-1")
        assert gauge == pytest.approx(0.15, abs=1e-6)
        assert _sample(svc, "gpupool_analytics_lent_share_ratio") == 0.2
        assert _sample(svc, "gpupool_analytics_leaf_uplink_xmit_wait_ratio", leaf="leaf-2") == 0.0
        ups = latest(bus, "host")
        for host in ("node001", "node002"):
            u = ups[host]
            assert (u.state, u.reason, u.leaf) == (GpuState.UNKNOWN, "leaf_uplink_headroom", "leaf-1"), host
            assert u.leaf_headroom == pytest.approx(0.15, abs=1e-6) and u.grade is None
        now = svc.current_states()["node003/GPU-node003"]
        assert (now.state, now.leaf) == (GpuState.IDLE, "leaf-2")
        assert now.leaf_headroom == pytest.approx(0.90, abs=1e-6)

        # leaf-1 calms down, leaf-2's uplink starts waiting for credits (2 ticks per word down)
        await _feed(bus, 7, leaf1=0.05, leaf2=0.10, wait2=2.0)
        clock.t = T0 + 130
        await drain(svc)
        clock.t = T0 + 140  # the refresh after the rows are stored
        await drain(svc)
        ups = latest(bus, "host")
        assert {h: ups[h].state for h in HOSTS} == {
            "node001": GpuState.IDLE,
            "node002": GpuState.IDLE,
            "node003": GpuState.UNKNOWN,
        }
        assert ups["node003"].reason == "leaf_uplink_xmit_wait" and ups["node003"].leaf == "leaf-2"
        assert svc.leaf_headroom()["leaf-2"].xmit_wait == pytest.approx(2 / 3, rel=0.05)
    finally:
        await svc.stop()
    leaves = {
        s.labels["leaf"] for m in svc.registry.collect() if m.name.startswith("gpupool_analytics_leaf_") for s in m.samples
    }
    assert leaves == set(), "a stopped instance's leaf series must go"


async def test_no_topology_no_leaf_and_zero_share_never_blocks(caplog: pytest.LogCaptureFixture) -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = _service(bus, clock, lent_share=0.0, max_uplink_xmit_wait=1.0)
    await svc.start()
    try:
        await _feed(bus, 0, leaf1=0.99, leaf2=0.99, wait2=5.0)
        await send(bus, gpu(T0 + 60, "node-x"))  # a GPU host the fabric does not name
        clock.t = T0 + 70
        await drain(svc)
        assert all(u.leaf is None and u.leaf_headroom is None for u in svc.current_states().values())
        await bus.producer().send(TOPICS.fabric_topology, encode(_topology()), key="topology")
        await drain(svc)  # a new topology refreshes the leaf figures at once
        assert {u.leaf for u in latest(bus, "host").values()} == {"leaf-1", "leaf-2", None}  # and re-publishes
        (warning,) = [r for r in caplog.records if r.getMessage() == "analytics_hosts_without_leaf"]
        assert (warning.hosts, warning.first) == (1, ["node-x"])  # type: ignore[attr-defined]
        states = svc.current_states()
        assert states.pop("node-x/GPU-node-x").leaf is None
        assert {u.leaf for u in states.values()} == {"leaf-1", "leaf-2"}
        assert all(u.state is GpuState.IDLE for u in states.values())  # 0 and 1 turn the checks off
        assert states["node001/GPU-node001"].leaf_headroom == pytest.approx(0.01, abs=1e-6)
    finally:
        await svc.stop()
    with pytest.raises(ValueError, match="lent_share"):
        _service(bus, clock, lent_share=1.01)
    with pytest.raises(ValueError, match="max_uplink_xmit_wait"):
        _service(bus, clock, max_uplink_xmit_wait=-0.1)
