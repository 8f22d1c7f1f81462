"""Matched claims, quotas and minimum guarantees end to end: the broker service and the edge SDK
(and ``gpupool edge claim`` without an offer id) over a real Mosquitto of this test only (MQTT 5,
per-site users and ACL from deploy/local/mosquitto.sh), with a fabric manager that records the
hosts it is asked to isolate.

What is asserted crosses the boundaries: replies and retained lease messages on MQTT, the
lease-log records on the bus, the hosts handed to the fabric manager, the CLI's JSON output."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

import pytest
from typer.testing import CliRunner

from broker.cli import edge_app
from broker.config import BrokerConfig
from broker.credentials import broker_service, edge_client
from broker.edge import ClaimRejected, EdgeClient
from contracts import (
    CapacityUpdate,
    GpuState,
    IdleGrade,
    KafkaTopics,
    LeaseLogRecord,
    LeaseState,
    PoolDemand,
    ReasonCode,
    decode,
    encode,
)
from contracts.bus import MemoryBus
from contracts.leases import Partition
from contracts.mqtt import Requirements
from tests.mqtt_support import running, until

pytestmark = pytest.mark.integration

H100 = "NVIDIA H100 80GB HBM3"


class _RecordingFabric:
    """An enforcing fabric manager that 'verifies' a partition per lease and remembers the hosts
    of every lease it isolated and the leases it removed."""

    enforced = True

    def __init__(self) -> None:
        self.isolated: dict[str, list[str]] = {}
        self.removed: list[str] = []

    async def isolate(self, lease: LeaseLogRecord) -> Partition | None:
        self.isolated[lease.lease_id] = sorted({g.split("/", 1)[0] for g in lease.gpus})
        assert lease.hosts == self.isolated[lease.lease_id]
        return Partition(
            pkey=0x100 + len(self.isolated),
            sl=1,
            limited_members=[f"guid-{h}" for h in lease.hosts],
            full_members=["guid-gw"],
            verified=True,
        )

    async def remove(self, lease: LeaseLogRecord) -> None:
        self.removed.append(lease.lease_id)


async def _capacity(bus: MemoryBus, topics: KafkaTopics, host: str, n: int, leaf: str) -> None:
    now = time.time()
    for i in range(n):
        u = CapacityUpdate(
            ts=now,
            host=host,
            gpu_uuid=f"GPU-{host}-{i}",
            state=GpuState.IDLE,
            since=now - 60,
            grade=IdleGrade.FREE,
            predicted_idle_until=now + 3600,
            model_name=H100,
            fb_total_mib=81559,
            leaf=leaf,
        )
        await bus.producer().send(topics.capacity, encode(u), key=u.key)


def _site(creds: dict[str, Any], site: str, run_id: str) -> EdgeClient:
    return edge_client(creds, site, client_id=f"{site}-{run_id}")


async def test_matched_claims_quotas_and_guarantees_over_mosquitto(
    private_mosquitto: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="broker.leases")
    creds = private_mosquitto
    run_id = uuid.uuid4().hex[:8]
    topics = KafkaTopics()
    bus = MemoryBus()
    fabric = _RecordingFabric()
    cfg = BrokerConfig(
        offer_ttl_s=60,
        notice_s=1.0,
        lease_ttl_s=30,
        tick_s=0.05,
        pool_zones={"default": "metro-1"},
        site_quotas={"edge-b": 2},
    )
    svc = broker_service(
        creds, bus=bus, topics=topics, config=cfg, fabric=fabric, client_id=f"gpupool-broker-{run_id}"
    )
    async with running(svc):
        await _capacity(bus, topics, "n1", 2, "leaf-1")
        await _capacity(bus, topics, "n2", 2, "leaf-1")
        await _capacity(bus, topics, "n3", 1, "leaf-2")
        await until(lambda: len(svc.book.offers) == 3, 10, "three offers")
        assert {o.zone for o in svc.book.offers.values()} == {"metro-1"}

        async with _site(creds, "edge-a", run_id) as a, _site(creds, "edge-b", run_id) as b:
            # 4 GPUs: no node has them, leaf-1 has (n1 + n2); isolated as one lease over both hosts
            lease = await a.request(
                4,
                Requirements(zone="metro-1", min_fb_total_mib=80_000, model_names=[H100]),
                duration_seconds=600,
                min_duration_seconds=300,
            )
            assert lease.state is LeaseState.GRANTED and lease.hosts == ["n1", "n2"]
            assert len(lease.gpus) == 4 and len(lease.offer_ids) == 2 and lease.offer_id == lease.offer_ids[0]
            assert lease.partition is not None and lease.partition.limited_members == ["guid-n1", "guid-n2"]
            assert lease.min_until == pytest.approx(lease.ts + 300)
            assert fabric.isolated[lease.lease_id] == ["n1", "n2"]

            # edge-b: 2 GPUs exist only across leaves (n3 alone is left) → no_match
            with pytest.raises(ClaimRejected) as no_match:
                await b.request(2, timeout_s=5)
            assert no_match.value.reply.code is ReasonCode.NO_MATCH
            assert "allow_cross_leaf" not in no_match.value.reply.text  # only 1 matching GPU is left
            # a zone nobody has → no_match with the reason
            with pytest.raises(ClaimRejected) as zoned:
                await b.request(1, Requirements(zone="metro-9"), timeout_s=5)
            assert zoned.value.reply.code is ReasonCode.NO_MATCH and "other zone" in zoned.value.reply.text

            # gpupool edge claim without an offer id, as a user runs it (its own event loop)
            res = await asyncio.to_thread(
                CliRunner().invoke,
                edge_app,
                [
                    "claim",
                    "--count",
                    "1",
                    "--zone",
                    "metro-1",
                    "--prefer",
                    H100,
                    "--avoid-host",  # the only node left: placed there all the same
                    "n3",
                    "--min-duration",
                    "5",
                    "--site",
                    "edge-b",
                    "--username",
                    "edge-b",
                    "--password",
                    creds["users"]["edge-b"],
                    "--mqtt",
                    f"{creds['host']}:{creds['port']}",
                    "--root",
                    creds["root"],
                ],
            )
            assert res.exit_code == 0, res.output
            cli_lease = json.loads(res.stdout)
            assert cli_lease["hosts"] == ["n3"] and cli_lease["state"] == "granted"
            on_avoided = [r.__dict__ for r in caplog.records if r.getMessage() == "match_on_avoided_hosts"]
            assert [(r["site"], r["avoided"]) for r in on_avoided] == [("edge-b", ["n3"])]
            # edge-b's quota is 2: holding 1, 2 more are refused before any matching
            await _capacity(bus, topics, "n4", 2, "leaf-2")
            await until(lambda: any(o.host == "n4" for o in svc.book.offers.values()), 10, "n4 offered")
            with pytest.raises(ClaimRejected) as quota:
                await b.request(2, timeout_s=5)
            assert (
                quota.value.reply.code is ReasonCode.QUOTA_EXCEEDED and "quota is 2" in quota.value.reply.text
            )
            # anti-affinity, a preference: off the avoided node while another can hold the lease
            # (n5, the tightest, is passed over), on it when none can (not refused)
            await _capacity(bus, topics, "n5", 1, "leaf-2")
            await until(lambda: any(o.host == "n5" for o in svc.book.offers.values()), 10, "n5 offered")
            avoids = (["n5"], ["n4"], ["n4", "n5"])
            spread = [await a.request(1, Requirements(avoid_hosts=avoid)) for avoid in avoids]
            assert [m.hosts for m in spread] == [["n4"], ["n5"], ["n4"]]
            # bad CLI input is refused locally with exit 2
            res = await asyncio.to_thread(
                CliRunner().invoke, edge_app, ["claim", "--site", "edge-b", "--mqtt", "127.0.0.1:1"]
            )
            assert res.exit_code == 2

            # an unforced demand inside the guarantee: reclaiming, GPUs back at min_until
            demand = PoolDemand(demand_id=f"d1-{run_id}", ts=time.time(), gpus=[lease.gpus[0]], reason="test")
            await bus.producer().send(topics.pool_demand, encode(demand), key=demand.demand_id)
            notice = await a.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 5)
            assert notice.reclaim_deadline == pytest.approx(lease.min_until)
            assert notice.reason == f"demand:d1-{run_id};deferred_to_guarantee_end"
            await asyncio.sleep(cfg.notice_s + 0.3)
            assert svc.book.leases[lease.lease_id].state is LeaseState.RECLAIMING  # notice passed, still held
            # an operator forces it: the guarantee is broken, reported, and the lease revoked
            forced = PoolDemand(
                demand_id=f"d2-{run_id}", ts=time.time(), gpus=[lease.gpus[0]], force=True, reason="test"
            )
            await bus.producer().send(topics.pool_demand, encode(forced), key=forced.demand_id)
            await until(
                lambda: (
                    svc.book.leases[lease.lease_id].state is LeaseState.RECLAIMING
                    and svc.book.leases[lease.lease_id].reason.endswith("guarantee_broken")
                ),
                5,
                "forced reclaim",
            )
            broken = svc.book.leases[lease.lease_id]
            assert broken.reclaim_deadline is not None and broken.reclaim_deadline < lease.min_until
            done = await a.wait_lease(lease.lease_id, lambda m: not m.state.live, 5)
            assert done.state is LeaseState.REVOKED
            await until(lambda: lease.lease_id in fabric.removed, 5, "partition removed")

    log = [decode(LeaseLogRecord, m.value) for m in bus.records(topics.leases_log) if m.value is not None]
    mine = [r for r in log if r.lease_id == lease.lease_id]
    assert [r.state for r in mine] == [
        LeaseState.GRANTED,
        LeaseState.RECLAIMING,
        LeaseState.RECLAIMING,
        LeaseState.REVOKED,
    ]
    assert mine[0].hosts == ["n1", "n2"] and mine[0].offer_ids == lease.offer_ids
    assert mine[2].reason == f"demand:d2-{run_id};guarantee_broken"
