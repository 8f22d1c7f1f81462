"""The fabric path end to end on the simulated fabric (ibsim + OpenSM + infiniband-diags, the fat tree
of :func:`tests.fabric_fixture.sim_fabric`: 2 spines × 4 leaves × 4 HCAs ``node001``..``node016``).

Real pieces: the collector stage (:class:`collectors.service.CollectorService` running the
switch-side :class:`collectors.fabric_collector.FabricCollector` as ``gpupool collect run
--fabric`` does) reads the fabric with ``ibnetdiscover``/``perfquery``; the analytics stage
(:class:`analytics.service.AnalyticsService`) reads ``fabric.topology`` and the port counters from
the bus and publishes capacity updates; the broker's lease book (:class:`broker.leases.LeaseBook`,
the core of ``gpupool broker run``) turns the decoded capacity records into offers and matches a
claim. The bus is the in-process one (the Kafka bus is tested on its own); GPUs are sample records
(there are no GPUs here).

The scene: idle nodes are node001 (leaf-1), node005 and node006 (leaf-2), node009 and node010
(leaf-3), node013 (leaf-4); every other node is busy. Training saturates leaf-2's uplink to
spine-1 (its PortXmitData jumps, set on ibsim's console). A matched claim for 12 GPUs (8 per node)
needs two nodes: only leaf-3 has two idle nodes with room on its uplinks, so the lease lands on
node009 + node010. Without the topology no offer has a leaf (no_match); without the uplink gate
leaf-2 would win the tie on its name.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from analytics.classify import FB_USED, GR_ENGINE_ACTIVE, IdleConfig
from analytics.service import AnalyticsService
from broker.config import BrokerConfig
from broker.leases import LeaseBook, PendingGrant
from collectors.fabric_collector import FabricCollector
from collectors.service import CollectorService
from contracts import CapacityUpdate, GpuSample, GpuState, IbPortSample, KafkaTopics, decode, encode
from contracts.bus import MemoryBus
from contracts.mqtt import Claim, Requirements
from runtime.kafka import KafkaBus
from tests.fabric_fixture import SimFabric, sim_fabric  # noqa: F401 - the session fixture

pytestmark = pytest.mark.integration

TOPICS = KafkaTopics()
GPUS_PER_NODE = 8
IDLE_HOSTS = {"node001", "node005", "node006", "node009", "node010", "node013"}
H100 = "NVIDIA H100 80GB HBM3"


def _gpu_samples(now: float) -> list[GpuSample]:
    """Five samples 10 s apart ending at ``now`` for 8 GPUs on each of the 16 hosts."""
    out = []
    for k in range(5):
        ts = now - 10.0 * (4 - k)
        for h in range(1, 17):
            host = f"node{h:03d}"
            busy = host not in IDLE_HOSTS
            for i in range(GPUS_PER_NODE):
                out.append(
                    GpuSample(
                        ts=ts, host=host, gpu_uuid=f"GPU-{host}-{i}", model_name=H100,
                        fields={GR_ENGINE_ACTIVE: 0.9 if busy else 0.0, FB_USED: 100},
                    )
                )  # fmt: skip
    return out


async def _port_reads(bus: MemoryBus, node_guid: str, port: int) -> int:
    reads = 0
    for rec in bus.records(TOPICS.telemetry_ib_port):
        s = decode(IbPortSample, rec.value or b"")
        reads += s.node_guid == node_guid and s.port == port
    return reads


async def _wait_reads(bus: MemoryBus, node_guid: str, port: int, n: int, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await _port_reads(bus, node_guid, port) < n:
        assert time.monotonic() < deadline, f"fewer than {n} reads of {node_guid}/{port} in {timeout_s} s"
        await asyncio.sleep(0.2)


async def test_matched_claim_for_more_than_one_node_lands_under_one_leaf(
    sim_fabric: SimFabric,  # noqa: F811
) -> None:
    bus = MemoryBus()
    # OpenSM holds one of ibsim's 10 client slots; leave a couple for the reaper
    fabric = FabricCollector(bus, TOPICS, env=sim_fabric.env, concurrency=6, timeout_s=10.0)
    collector = CollectorService(
        bus=bus, topics=TOPICS, dcgm_targets=[], sysfs_roots=[], interval_s=5.0,
        fabric=fabric, fabric_interval_s=0.5, fabric_discover_every=100,
    )  # fmt: skip
    leaf2 = sim_fabric.node("leaf-2")
    uplink = 4 + 2  # hcas_per_leaf + 2: leaf-2's port to spine-1 (gen_topology.build_fat_tree)
    stop = asyncio.Event()
    await collector.start()
    run = asyncio.create_task(collector.run(stop))
    try:
        await _wait_reads(bus, leaf2["node_guid"], uplink, 1)
        # training fills leaf-2's uplink: far more words than the link can carry in a sweep
        await asyncio.to_thread(
            sim_fabric.console.performance_set,
            "leaf-2",
            uplink,
            "PortCountersExtended",
            "PortXmitData",
            2**50,
        )
        seen = await _port_reads(bus, leaf2["node_guid"], uplink)
        await _wait_reads(bus, leaf2["node_guid"], uplink, seen + 2)  # one whole sweep after the jump
    finally:
        stop.set()
        await run
        await collector.stop()
    assert len(bus.records(TOPICS.fabric_topology)) == 1  # discovered once: discover_every=100

    for s in _gpu_samples(time.time()):
        await bus.producer().send(TOPICS.telemetry_gpu, encode(s), key=s.partition_key)
    analytics = AnalyticsService(
        bus=bus, topics=TOPICS, db_path=":memory:", headroom_refresh_s=0.001, refresh_s=0.001,
        idle=IdleConfig(min_idle_s=20.0, stale_after_s=300.0), lent_share=0.2, max_uplink_xmit_wait=1.0,
    )  # fmt: skip
    await analytics.start()
    try:
        while await analytics.step(timeout_s=0.05):
            pass
        await analytics.step(timeout_s=0.05)  # a headroom refresh after every row is stored
        await analytics.step(timeout_s=0.05)
        leaves = analytics.leaves()
        figures = analytics.leaf_headroom()
    finally:
        await analytics.stop()
    assert {h: leaves.leaf_of[h] for h in ("node001", "node005", "node009", "node013", "edge-gw")} == {
        "node001": "leaf-1", "node005": "leaf-2", "node009": "leaf-3", "node013": "leaf-4",
        "edge-gw": "leaf-1",
    }  # fmt: skip
    assert len(leaves.uplinks["leaf-2"]) == 4  # two spine links, both ends
    assert figures["leaf-2"].headroom is not None and figures["leaf-2"].headroom < 0  # far over the rate
    for leaf in ("leaf-1", "leaf-3", "leaf-4"):
        assert figures[leaf].headroom is not None and figures[leaf].headroom > 0.9, (leaf, figures[leaf])

    latest: dict[str, CapacityUpdate] = {}
    for rec in bus.records(TOPICS.capacity):
        u = decode(CapacityUpdate, rec.value or b"")
        latest[u.key] = u
    by_host = {u.host: u for u in latest.values()}
    assert (by_host["node005"].state, by_host["node005"].reason) == (GpuState.UNKNOWN, "leaf_uplink_headroom")
    assert (by_host["node009"].state, by_host["node009"].leaf) == (GpuState.IDLE, "leaf-3")
    assert by_host["node009"].leaf_headroom == pytest.approx(figures["leaf-3"].headroom)
    assert all(u.leaf is not None for u in latest.values())

    counter = itertools.count(1)
    book = LeaseBook(BrokerConfig(), new_id=lambda p: f"{p}-{next(counter)}")
    now = time.time()
    for u in latest.values():
        book.apply_capacity(u, now)
    assert {o.host: o.leaf for o in book.offers.values()} == {
        "node001": "leaf-1", "node009": "leaf-3", "node010": "leaf-3", "node013": "leaf-4",
    }  # fmt: skip
    claim = Claim(claim_id="c1", site="edge-a", count=12, requirements=Requirements(), ts=now)
    step, _ = book.begin_claim("edge-a", claim, now)
    assert isinstance(step, PendingGrant), step
    assert step.record.hosts == ["node009", "node010"] and len(step.record.gpus) == 12
    assert step.record.reason == "match:leaf"
    answer, _ = book.grant(step, now)
    assert answer.ok and book.violations() == []


async def test_collect_run_fabric_feeds_analytics_leaves_over_kafka(
    sim_fabric: SimFabric,  # noqa: F811
    kafka_bootstrap: str,
    kafka_bus: KafkaBus,
    kafka_topics: KafkaTopics,
    tmp_path: Path,
) -> None:
    """``gpupool collect run --fabric`` (the command the deployments run) on the simulated fabric,
    real Kafka, and the analytics stage reading its topology: capacity updates carry the leaf."""
    t = kafka_topics
    await kafka_bus.create_topics(t.all(), partitions=2, compacted=[t.leases_log, t.fabric_topology])
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env.update(sim_fabric.env)
    argv = [
        str(Path(sys.executable).parent / "gpupool"), "collect", "run", "--kafka", kafka_bootstrap,
        "--topic-prefix", t.prefix, "--fabric", "--fabric-interval", "1", "--fabric-concurrency", "4",
        "--fabric-timeout", "10", "--metrics-port", "0",
    ]  # fmt: skip
    log = (tmp_path / "collect.log").open("w")
    proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    producer = kafka_bus.producer("gpupool-test")
    await producer.start()
    try:
        for s in _gpu_samples(time.time()):
            if s.host in ("node001", "node002"):
                await producer.send(t.telemetry_gpu, encode(s), key=s.partition_key)
        await producer.flush()
    finally:
        await producer.stop()
    analytics = AnalyticsService(
        bus=kafka_bus, topics=t, db_path=str(tmp_path / "a.duckdb"), group_id=f"{t.prefix}analytics",
        idle=IdleConfig(min_idle_s=20.0, stale_after_s=300.0), headroom_refresh_s=0.5,
    )  # fmt: skip
    await analytics.start()
    try:
        deadline = time.monotonic() + 90.0
        leaves: dict[str, str | None] = {}
        while time.monotonic() < deadline and not leaves.get("node002/GPU-node002-7"):
            await analytics.step(timeout_s=0.5)
            leaves = {k: u.leaf for k, u in analytics.current_states().items()}
        assert proc.poll() is None, (tmp_path / "collect.log").read_text()[-2000:]
    finally:
        await analytics.stop()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        log.close()
    assert rc == 0, (tmp_path / "collect.log").read_text()[-2000:]
    assert set(leaves.values()) == {"leaf-1"} and len(leaves) == 16, leaves
    assert analytics.leaves().leaf_of["node016"] == "leaf-4"
    assert set(analytics.leaves().uplinks) == {"leaf-1", "leaf-2", "leaf-3", "leaf-4"}
