"""FabricCollector on a real simulated fabric: ibsim + OpenSM + infiniband-diags (Debian packages),
a generated fat tree (2 spines × 4 leaves × 4 HCAs + the edge gateway) started by
``deploy/local/fabric.sh`` through :func:`tests.fabric_fixture.sim_fabric`.

Test order matters (pytest runs a module top to bottom): the Unlink test comes last because the
trap it causes makes OpenSM sweep every node, which moves counters.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from collectors.fabric_collector import FabricCollector
from contracts.base import decode
from contracts.bus import MemoryBus
from contracts.fabric import FabricTopology
from contracts.telemetry import IbPortSample
from contracts.topics import KafkaTopics
from tests.fabric_fixture import SimFabric, sim_fabric  # noqa: F401 - the session fixture

pytestmark = pytest.mark.integration
log = logging.getLogger(__name__)


def _collector(fab: SimFabric, bus: MemoryBus, **kw: object) -> FabricCollector:
    # OpenSM holds one of ibsim's 10 client slots; leave a couple for the reaper's checks and others
    return FabricCollector(bus, KafkaTopics(), env=fab.env, concurrency=6, timeout_s=10.0, **kw)  # type: ignore[arg-type]


async def test_discovery_finds_the_whole_fat_tree(sim_fabric: SimFabric) -> None:  # noqa: F811
    bus = MemoryBus()
    async with _collector(sim_fabric, bus) as fc:
        topo = await fc.discover()
    assert topo.error is None and topo.problems == []
    nodes = topo.nodes()
    expected = sim_fabric.info["nodes"]
    assert {n["port_guid"] for n in expected.values()} == set(nodes)
    for nodeid, n in expected.items():
        got = nodes[n["port_guid"]]
        assert (got.name, got.lid) == (n["description"], n["lid"]), nodeid
        assert got.node_type == ("SW" if n["kind"] == "switch" else "CA")
    assert sum(n.node_type == "SW" for n in nodes.values()) == 6
    assert sum(n.node_type == "CA" for n in nodes.values()) == 17
    links = topo.links()
    assert len(links) == sim_fabric.info["links"] == 25
    assert all((lk.width, lk.speed) == ("4x", "EDR") for lk in links)
    # every HCA hangs off its leaf; the edge gateway off leaf-1's border port
    gw = nodes[expected["edge-gw"]["port_guid"]]
    assert (gw.ports[1].peer_guid, gw.ports[1].peer_port) == (expected["leaf-1"]["node_guid"], 5)
    (rec,) = bus.records(KafkaTopics().fabric_topology)
    topology = decode(FabricTopology, rec.value or b"")
    assert rec.key == "topology" and len(topology.nodes) == 23 and len(topology.links) == 25


async def test_performance_set_values_arrive_exactly(sim_fabric: SimFabric) -> None:  # noqa: F811
    """Counters set on ibsim's console come back in the next sweep with the exact value, > 2**53 too."""
    xmit = 2**60 + 12345  # far beyond float64's exact integers
    rcv = 2**53 + 1
    bus = MemoryBus()
    async with _collector(sim_fabric, bus) as fc:
        await fc.discover()  # discovery's SMPs cross every link: set the counters after it
        con = sim_fabric.console
        # leaf-2 port 3 faces node007: no MAD crosses it while the switches are read
        await asyncio.to_thread(
            con.performance_set, "leaf-2", 3, "PortCountersExtended", "PortXmitData", xmit
        )
        await asyncio.to_thread(con.performance_set, "leaf-2", 3, "PortCountersExtended", "PortRcvData", rcv)
        await asyncio.to_thread(con.performance_set, "leaf-2", 3, "PortCounters", "PortXmitWait", 123456)
        await asyncio.to_thread(con.performance_set, "leaf-3", 2, "PortCounters", "PortXmitWait", 2**32 - 1)
        await asyncio.to_thread(con.performance_set, "leaf-3", 2, "PortCounters", "SymbolErrorCounter", 7)
        t0 = time.perf_counter()
        samples = await fc.sweep()
        elapsed = time.perf_counter() - t0
    log.info("fabric_sweep_default_topology", extra={"seconds": round(elapsed, 3), "samples": len(samples)})
    print(f"\nfabric sweep, default topology: {elapsed:.3f} s for {len(samples)} port samples")
    # every connected port from both ends: 25 links × 2
    assert len(samples) == 50
    leaf2 = sim_fabric.node("leaf-2")["node_guid"]
    leaf3 = sim_fabric.node("leaf-3")["node_guid"]
    by_key = {s.key: s for s in samples}
    s = by_key[f"{leaf2}/3"]
    assert s.counters["PortXmitData"] == xmit and s.counter_bits["PortXmitData"] == 64
    assert s.counters["PortRcvData"] == rcv
    assert s.data_bytes("PortXmitData") == 4 * xmit
    assert s.counters["PortXmitWait"] == 123456 and s.counter_bits["PortXmitWait"] == 32
    assert (s.phys_state, s.rate_bytes_per_second, s.host) == ("LinkUp", 12_500_000_000, "leaf-2")
    t = by_key[f"{leaf3}/2"]
    assert t.counters["PortXmitWait"] == 2**32 - 1 and t.counters["SymbolErrorCounter"] == 7
    assert t.saturated == ["PortXmitWait"]
    # through the bus's JSON, the integers stay exact
    on_bus = {
        d.key: d
        for d in (decode(IbPortSample, r.value or b"") for r in bus.records(KafkaTopics().telemetry_ib_port))
    }
    # every record is keyed by its host on the bus (both telemetry topics: contracts.topics)
    assert {r.key for r in bus.records(KafkaTopics().telemetry_ib_port)} >= {"leaf-2", "leaf-3"}
    assert on_bus[f"{leaf2}/3"].counters["PortXmitData"] == xmit
    hca = by_key[f"{sim_fabric.node('node007')['port_guid']}/1"]
    assert (hca.host, hca.device) == ("node007", "mlx5_0") and (hca.counters["PortXmitData"] or 0) > 0


async def test_unlink_mid_sweep_reports_the_port_down_and_the_collector_goes_on(
    sim_fabric: SimFabric,  # noqa: F811
) -> None:
    leaf4 = sim_fabric.node("leaf-4")
    node016 = sim_fabric.node("node016")
    bus = MemoryBus()
    con = sim_fabric.console
    async with _collector(sim_fabric, bus) as fc:
        await fc.discover()
        first = await fc.sweep()
        assert len(first) == 50
        # pull node016's cable while a sweep runs
        sweep = asyncio.create_task(fc.sweep())
        await asyncio.sleep(0.02)
        await asyncio.to_thread(con.unlink, "node016", 1)
        during = await sweep  # completes: a failed device is counted, never raised
        assert len(during) >= 48
        try:
            topo = await fc.discover()
            after = {s.key: s for s in await fc.sweep()}
            assert node016["port_guid"] not in topo.nodes()
            port = topo.nodes()[leaf4["node_guid"]].ports[4]
            assert (port.connected, port.peer_guid) == (False, None)
            down = after[f"{leaf4['node_guid']}/4"]
            assert (down.state, down.state_id, down.phys_state_id, down.rate_bytes_per_second) == (
                "DOWN",
                1,
                None,
                None,
            )
            assert "PortXmitData" in down.counters  # the leaf still answers for its dead port
            assert len(after) == 49  # node016's own port is gone; every other port still read
            assert all(s.phys_state == "LinkUp" for k, s in after.items() if k != f"{leaf4['node_guid']}/4")
        finally:
            await asyncio.to_thread(con.relink, "node016", 1)
        # after ReLink, OpenSM's sweep gives node016 a LID again and the port comes back up
        deadline = time.monotonic() + 60
        while True:
            topo = await fc.discover()
            n = topo.nodes().get(node016["port_guid"])
            if n is not None and n.lid > 0:
                break
            assert time.monotonic() < deadline, "node016 did not come back after ReLink"
            await asyncio.sleep(0.5)
        back = {s.key: s for s in await fc.sweep()}
        assert back[f"{leaf4['node_guid']}/4"].phys_state == "LinkUp"
        assert f"{node016['port_guid']}/1" in back
