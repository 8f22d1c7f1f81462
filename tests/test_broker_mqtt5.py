"""The broker and the edge SDK over real Mosquitto with MQTT 5 (per-site credentials and ACL from
deploy/local/mosquitto.sh): message expiry on offers, response topic + correlation data on claims,
reason codes in replies, a reclaim with notice."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import aiomqtt
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from broker.config import BrokerConfig
from broker.edge import EdgeClient
from broker.service import BrokerService
from contracts import (
    CapacityUpdate,
    Claim,
    GpuState,
    KafkaTopics,
    LeaseLogRecord,
    LeaseState,
    MqttTopics,
    Offer,
    PoolDemand,
    ReasonCode,
    Reply,
    decode,
    encode,
)
from contracts.bus import MemoryBus
from tests.mqtt_support import running

pytestmark = pytest.mark.integration


async def test_protocol_5_over_mosquitto(mosquitto: dict) -> None:
    host, port, root, users = (
        mosquitto["host"],
        mosquitto["port"],
        mosquitto.get("root", "gpupool/v1"),
        mosquitto["users"],
    )
    mt = MqttTopics(root)
    topics = KafkaTopics()
    bus = MemoryBus()
    run_id = uuid.uuid4().hex[:8]
    node = f"n-{run_id}"
    cfg = BrokerConfig(offer_ttl_s=20, notice_s=2, lease_ttl_s=10, tick_s=0.05)
    svc = BrokerService(
        bus=bus,
        topics=topics,
        mqtt_host=host,
        mqtt_port=port,
        mqtt_username="gpupool-broker",
        mqtt_password=users["gpupool-broker"],
        root=root,
        protocol=5,
        config=cfg,
        client_id=f"gpupool-broker-{run_id}",
    )
    async with running(svc):
        now = time.time()
        for i in range(2):
            u = CapacityUpdate(
                ts=now,
                host=node,
                gpu_uuid=f"GPU-{i}",
                state=GpuState.IDLE,
                since=now,
                predicted_idle_until=now + 600,
            )
            await bus.producer().send(topics.capacity, encode(u), key=u.key)

        async with aiomqtt.Client(
            host,
            port,
            username="edge-a",
            password=users["edge-a"],
            protocol=aiomqtt.ProtocolVersion.V5,
            identifier=f"raw-{run_id}",
        ) as raw:
            await raw.subscribe(mt.offers_filter, qos=1)
            await raw.subscribe(mt.replies("edge-a"), qos=1)
            offer: Offer | None = None
            async with asyncio.timeout(10):
                async for msg in raw.messages:
                    if msg.topic.matches(mt.offers_filter) and msg.payload:
                        o = decode(Offer, bytes(msg.payload))  # type: ignore[arg-type]
                        if o.host == node and len(o.gpus) == 2:
                            offer = o
                            expiry = msg.properties.MessageExpiryInterval  # type: ignore[union-attr]
                            assert 0 < expiry <= cfg.offer_ttl_s
                            break
            assert offer is not None

            # a claim with MQTT 5 request/response: the reply carries our correlation data
            props = Properties(PacketTypes.PUBLISH)
            props.ResponseTopic = mt.replies("edge-a")
            props.CorrelationData = b"corr-" + run_id.encode()
            bad = json.dumps({"claim_id": "bad-1", "site": "edge-a"}).encode()
            await raw.publish(mt.claims("edge-a"), bad, qos=1, properties=props)
            claim = Claim(
                claim_id=f"raw-{run_id}", site="edge-a", offer_id=offer.offer_id, count=1, ts=time.time()
            )
            await raw.publish(mt.claims("edge-a"), encode(claim), qos=1, properties=props)
            replies: list[tuple[Reply, bytes]] = []
            async with asyncio.timeout(10):
                async for msg in raw.messages:
                    if msg.topic.matches(mt.replies("edge-a")):
                        corr = bytes(msg.properties.CorrelationData)  # type: ignore[union-attr]
                        replies.append((decode(Reply, bytes(msg.payload)), corr))  # type: ignore[arg-type]
                        if len(replies) == 2:
                            break
            (r_bad, c_bad), (r_ok, c_ok) = replies
            assert (r_bad.code, r_bad.in_reply_to, c_bad) == (
                ReasonCode.MALFORMED,
                "bad-1",
                b"corr-" + run_id.encode(),
            )
            assert (r_ok.code, r_ok.in_reply_to, c_ok) == (
                ReasonCode.OK,
                claim.claim_id,
                b"corr-" + run_id.encode(),
            )
            assert r_ok.lease_id

        async with EdgeClient(
            site="edge-a",
            host=host,
            port=port,
            username="edge-a",
            password=users["edge-a"],
            root=root,
            protocol=5,
            client_id=f"edge-a-{run_id}",
        ) as site:
            first = await site.wait_lease(r_ok.lease_id, lambda m: m.state is LeaseState.GRANTED, 5)
            assert first.site == "edge-a" and len(first.gpus) == 1
            rest = next(o for o in (await site.offers(timeout_s=2)) if o.host == node)
            lease = await site.claim(rest.offer_id)
            await site.renew(lease.lease_id)
            demand = PoolDemand(demand_id=f"d-{run_id}", ts=time.time(), gpus=lease.gpus, reason="mqtt5 test")
            await bus.producer().send(topics.pool_demand, encode(demand), key=demand.demand_id)
            notice = await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 5)
            assert notice.reclaim_deadline == pytest.approx(notice.ts + cfg.notice_s)
            await site.release(lease.lease_id)
            done = await site.wait_lease(lease.lease_id, lambda m: not m.state.live, 5)
            assert done.state is LeaseState.RELEASED
            assert site.broker_online is True
        log = [decode(LeaseLogRecord, m.value) for m in bus.records(topics.leases_log) if m.value is not None]
        assert [r.state for r in log if r.lease_id == lease.lease_id] == [
            LeaseState.GRANTED,
            LeaseState.ACTIVE,
            LeaseState.RECLAIMING,
            LeaseState.RELEASED,
        ]
        assert svc.stats()["reclaims"]["released_in_notice"] == 1
