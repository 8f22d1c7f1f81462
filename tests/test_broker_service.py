"""The broker service and the edge-site SDK over a real MQTT server: amqtt (MQTT 3.1.1) started
in-process on a free loopback port, the in-process bus, protocol=4 on both sides.

Assertions read what crosses the boundaries: retained MQTT messages, replies, and the records
on the lease-log topic — not the service's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiomqtt
import pytest

from broker.config import BrokerConfig
from broker.edge import ClaimRejected, EdgeClient, LeaseRequestRejected, OfferWithdrawn
from broker.fabric import FabricError
from broker.service import BrokerService
from contracts import (
    CapacityUpdate,
    GpuState,
    KafkaTopics,
    LeaseLogRecord,
    LeaseMessage,
    LeaseState,
    MqttTopics,
    Offer,
    PeerState,
    PoolDemand,
    ReasonCode,
    Reply,
    decode,
    encode,
)
from contracts.bus import Bus, MemoryBus
from contracts.leases import Partition
from tests.mqtt_support import running, until

TOPICS = KafkaTopics()
MT = MqttTopics()
CFG = BrokerConfig(
    offer_ttl_s=30, notice_s=1.5, lease_ttl_s=10, tick_s=0.05, reconnect_min_s=0.05, reconnect_max_s=0.5
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Amqtt:
    """An amqtt server (MQTT 3.1.1, anonymous, in this process) on a fixed loopback port."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._broker: object | None = None

    async def start(self) -> None:
        from amqtt.broker import Broker

        for name in ("amqtt", "transitions"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self._broker = Broker(
            {
                "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{self.port}"}},
                "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
            }
        )
        await self._broker.start()  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self._broker is not None:
            broker, self._broker = self._broker, None
            await broker.shutdown()  # type: ignore[attr-defined]


@pytest.fixture
async def amqtt_server() -> AsyncIterator[_Amqtt]:
    """A fresh amqtt server on a free loopback port, stopped after the test."""
    server = _Amqtt(_free_port())
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def mqtt_port(amqtt_server: _Amqtt) -> int:
    """The port of :func:`amqtt_server`."""
    return amqtt_server.port


@contextlib.asynccontextmanager
async def _service(
    bus: Bus, port: int, config: BrokerConfig = CFG, topics: KafkaTopics = TOPICS, **options: Any
) -> AsyncIterator[BrokerService]:
    """A broker (MQTT 3.1.1, anonymous) on the local server at ``port``, started and serving for the
    block; ``options`` are further ``BrokerService`` keyword arguments (``fabric``...)."""
    svc = BrokerService(
        bus=bus, topics=topics, mqtt_host="127.0.0.1", mqtt_port=port, protocol=4, config=config, **options
    )
    async with running(svc):
        yield svc


def _site(port: int, site: str = "edge-a") -> EdgeClient:
    return EdgeClient(
        site=site, host="127.0.0.1", port=port, protocol=4, reconnect_min_s=0.05, reconnect_max_s=0.5
    )


async def _idle(
    bus: Bus, host: str, gpus: int, state: GpuState = GpuState.IDLE, topics: KafkaTopics = TOPICS
) -> list[str]:
    producer = bus.producer()
    await producer.start()
    now = time.time()
    keys = []
    for i in range(gpus):
        u = CapacityUpdate(
            ts=now,
            host=host,
            gpu_uuid=f"GPU-{host}-{i}",
            state=state,
            since=now - 60,
            predicted_idle_until=now + 3600 if state is GpuState.IDLE else None,
            model_name="NVIDIA A100-SXM4-80GB",
        )
        await producer.send(topics.capacity, encode(u), key=u.key)
        keys.append(u.key)
    await producer.flush()
    await producer.stop()
    return keys


def metric(svc: BrokerService, name: str, **labels: str) -> float:
    """A sample of ``svc``'s Prometheus registry (0 if absent)."""
    return svc.registry.get_sample_value(name, labels) or 0.0


def _log(bus: MemoryBus) -> list[LeaseLogRecord]:
    return [decode(LeaseLogRecord, m.value) for m in bus.records(TOPICS.leases_log) if m.value is not None]


async def _retained(port: int, topic: str, wait_s: float = 0.5) -> list[tuple[str, bytes]]:
    """The retained messages a fresh 3.1.1 client gets for ``topic`` (a filter).

    amqtt 0.12 also sends a new client the retained messages matching *other* clients'
    subscriptions (``Broker.client_connected`` loops over every session's filters), and some
    twice: keep only what matches ``topic``, once per topic."""
    out: list[tuple[str, bytes]] = []
    async with aiomqtt.Client("127.0.0.1", port, identifier=f"probe-{uuid.uuid4().hex[:8]}") as c:
        await c.subscribe(topic, qos=1)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                async for msg in c.messages:
                    if msg.retain and msg.topic.matches(topic) and msg.topic.value not in dict(out):
                        out.append((msg.topic.value, bytes(msg.payload)))  # type: ignore[arg-type]
    return out


async def _offer_on(site: EdgeClient, host: str) -> Offer:
    return await until(lambda: next((o for o in site.known_offers.values() if o.host == host), None))


async def test_offer_claim_renew_demand_release(mqtt_port: int) -> None:
    bus = MemoryBus()
    async with _service(bus, mqtt_port) as svc, _site(mqtt_port) as site:
        gpus = await _idle(bus, "n1", 4)
        offer = await _offer_on(site, "n1")
        assert [g.gpu for g in offer.gpus] == gpus and offer.notice_seconds == CFG.notice_s
        assert [o.offer_id for o in await site.offers(timeout_s=1.0)] == [offer.offer_id]

        lease = await site.claim(offer.offer_id, count=2, duration_seconds=600)
        assert lease.state is LeaseState.GRANTED and lease.gpus == gpus[:2] and lease.site == "edge-a"
        # the rest of the node is offered anew; the claimed offer is withdrawn from the server
        rest = await until(lambda: [o for o in site.known_offers.values() if o.offer_id != offer.offer_id])
        assert [g.gpu for g in rest[0].gpus] == gpus[2:]
        retained = dict(await _retained(mqtt_port, MT.offers_filter))
        assert list(retained) == [MT.offer(rest[0].offer_id)]
        retained = dict(await _retained(mqtt_port, MT.lease("edge-a", lease.lease_id)))
        assert decode(LeaseMessage, retained[MT.lease("edge-a", lease.lease_id)]).state is LeaseState.GRANTED

        reply = await site.renew(lease.lease_id)
        assert reply.code is ReasonCode.OK and reply.in_reply_to == lease.lease_id
        await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.ACTIVE, 5)

        demand = PoolDemand(demand_id="job-1", ts=time.time(), gpus=[gpus[1]], reason="training job 1")
        await bus.producer().send(TOPICS.pool_demand, encode(demand), key=demand.demand_id)
        notice = await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 5)
        assert notice.reclaim_deadline == pytest.approx(notice.ts + CFG.notice_s)
        assert notice.reason == "demand:job-1"
        await site.release(lease.lease_id)
        final = await site.wait_lease(lease.lease_id, lambda m: not m.state.live, 5)
        assert final.state is LeaseState.RELEASED and time.time() < notice.reclaim_deadline  # type: ignore[operator]

        states = [r.state for r in _log(bus) if r.lease_id == lease.lease_id]
        assert states == [LeaseState.GRANTED, LeaseState.ACTIVE, LeaseState.RECLAIMING, LeaseState.RELEASED]
        assert [r.seq for r in _log(bus)] == [1, 2, 3, 4]
        st = svc.stats()
        # the lease gauges are kept per transition, never by counting the book: they still agree
        assert svc.tally.lease_counts() == svc.book.lease_counts()
        assert metric(svc, "gpupool_broker_leases", state="released") == 1
        assert metric(svc, "gpupool_broker_leases", state="granted") == 0
        assert st["leases_granted"] == 1 and st["reclaims_started"] == 1
        assert st["reclaims"]["released_in_notice"] == 1 and st["reclaims_completed"] == 1
        assert st["demands"] == {"reclaimed": 1} and st["claims"] == {"ok": 1}
        # the reclaimed GPUs are held for training: not offered again
        await asyncio.sleep(0.2)
        offered = {g.gpu for o in site.known_offers.values() for g in o.gpus}
        assert offered == set(gpus[2:])


async def test_reclaim_deadline_revokes_a_lease_the_site_keeps(mqtt_port: int) -> None:
    bus = MemoryBus()
    async with _service(bus, mqtt_port) as svc, _site(mqtt_port) as site:
        await _idle(bus, "n1", 1)
        offer = await _offer_on(site, "n1")
        lease = await site.claim(offer.offer_id)
        await bus.producer().send(
            TOPICS.pool_demand, encode(PoolDemand(demand_id="d", ts=time.time(), count=1))
        )
        notice = await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 5)
        await site.renew(lease.lease_id)  # renewing does not stop the reclaim
        final = await site.wait_lease(lease.lease_id, lambda m: not m.state.live, CFG.notice_s + 3)
        assert final.state is LeaseState.REVOKED and final.reason == "reclaim_deadline"
        assert notice.reclaim_deadline is not None
        assert notice.reclaim_deadline <= final.ts <= notice.reclaim_deadline + 0.5
        assert svc.stats()["reclaims"]["revoked_at_deadline"] == 1
        with pytest.raises(LeaseRequestRejected) as e:
            await site.renew(lease.lease_id)
        assert e.value.code is ReasonCode.LEASE_NOT_LIVE


async def _raw_request(port: int, topic: str, payload: bytes, site: str = "edge-a") -> Reply:
    return decode(Reply, await _raw_reply_payload(port, topic, payload, site))


async def _raw_reply_payload(port: int, topic: str, payload: bytes, site: str = "edge-a") -> bytes:
    async with aiomqtt.Client("127.0.0.1", port, identifier=f"raw-{uuid.uuid4().hex[:8]}") as c:
        await c.subscribe(MT.replies(site), qos=1)
        await c.publish(topic, payload, qos=1)
        async with asyncio.timeout(5):
            async for msg in c.messages:
                if msg.topic.matches(MT.replies(site)):  # amqtt also sends others' retained messages
                    return bytes(msg.payload)  # type: ignore[arg-type]
    raise AssertionError("no reply")


async def test_a_site_of_the_first_release_gets_replies_it_can_decode(mqtt_port: int) -> None:
    """Edge sites of the first v1 release refuse unknown fields: a request without a request_id
    gets a reply of exactly that release's fields; one with a request_id the whole reply."""
    first_release_fields = {"schema_version", "in_reply_to", "site", "code", "text", "lease_id", "ts"}
    bus = MemoryBus()
    async with _service(bus, mqtt_port):
        claim = {"claim_id": "old-1", "site": "edge-a", "count": 1, "ts": time.time()}
        old = json.loads(await _raw_reply_payload(mqtt_port, MT.claims("edge-a"), json.dumps(claim).encode()))
        assert set(old) == first_release_fields and old["code"] == "no_match"
        claim = {**claim, "claim_id": "new-1", "request_id": "r-1"}
        new = json.loads(await _raw_reply_payload(mqtt_port, MT.claims("edge-a"), json.dumps(claim).encode()))
        assert set(new) == first_release_fields | {"request", "request_id", "expires_at", "ttl_seconds"}
        assert (new["request"], new["request_id"]) == ("claim", "r-1")


async def test_malformed_claims_get_a_reason_code_and_change_nothing(mqtt_port: int) -> None:
    bus = MemoryBus()
    async with _service(bus, mqtt_port) as svc, _site(mqtt_port) as site:
        await _idle(bus, "n1", 2)
        offer = await _offer_on(site, "n1")
        claims = MT.claims("edge-a")
        good = {"claim_id": "k", "site": "edge-a", "offer_id": offer.offer_id, "ts": time.time()}
        cases = [
            (b"{not json", ReasonCode.MALFORMED, ""),
            (b"[1, 2]", ReasonCode.MALFORMED, ""),
            (json.dumps({"claim_id": "k1", "site": "edge-a"}).encode(), ReasonCode.MALFORMED, "k1"),
            (json.dumps({**good, "claim_id": "k2", "count": -1}).encode(), ReasonCode.MALFORMED, "k2"),
            (json.dumps({**good, "claim_id": "k3", "count": True}).encode(), ReasonCode.MALFORMED, "k3"),
            (
                json.dumps({**good, "claim_id": "k4", "schema_version": 0}).encode(),
                ReasonCode.UNSUPPORTED_VERSION,
                "k4",
            ),
            (
                json.dumps({**good, "claim_id": "k5", "site": "edge-b"}).encode(),
                ReasonCode.SITE_MISMATCH,
                "k5",
            ),
            (b"\xff\xfe", ReasonCode.MALFORMED, ""),
        ]
        for payload, code, in_reply_to in cases:
            reply = await _raw_request(mqtt_port, claims, payload)
            assert (reply.code, reply.in_reply_to, reply.site) == (code, in_reply_to, "edge-a"), payload
            assert reply.text
        bad_renewal = await _raw_request(mqtt_port, MT.renewals("edge-a"), b'{"lease_id": "x"}')
        assert (bad_renewal.code, bad_renewal.in_reply_to) == (ReasonCode.MALFORMED, "x")
        # nothing changed: no lease, the same offer still retained, the broker still serves
        assert _log(bus) == []
        assert [t for t, _ in await _retained(mqtt_port, MT.offers_filter)] == [MT.offer(offer.offer_id)]
        st = svc.stats()
        assert metric(svc, "gpupool_broker_rejected_messages_total", reason="malformed") == 7
        assert st["rejected_messages"] == {"malformed": 7, "unsupported_version": 1, "site_mismatch": 1}
        assert st["claims"] == {"malformed": 6, "unsupported_version": 1, "site_mismatch": 1}
        assert st["leases_granted"] == 0
        lease = await site.claim(offer.offer_id)
        assert lease.state is LeaseState.GRANTED


async def test_claim_on_a_leased_gpu_is_gpu_unavailable_and_claims_are_idempotent(mqtt_port: int) -> None:
    bus = MemoryBus()
    async with _service(bus, mqtt_port) as svc, _site(mqtt_port) as a, _site(mqtt_port, "edge-b") as b:
        gpus = await _idle(bus, "n1", 2)
        offer = await _offer_on(b, "n1")
        lease = await a.claim(offer.offer_id, gpus=[gpus[0]], claim_id="a-1")
        with pytest.raises(ClaimRejected) as e:
            await b.claim(offer.offer_id, gpus=[gpus[0]])
        assert e.value.code is ReasonCode.GPU_UNAVAILABLE and "leased" in e.value.reply.text
        with pytest.raises(ClaimRejected) as e:
            await b.claim("offer-that-never-was")
        assert e.value.code is ReasonCode.UNKNOWN_OFFER
        with pytest.raises(ClaimRejected) as e:
            await b.claim((await _offer_on(b, "n1")).offer_id, min_notice_seconds=CFG.notice_s + 1)
        assert e.value.code is ReasonCode.NOTICE_TOO_SHORT
        again = await a.claim(offer.offer_id, gpus=[gpus[0]], claim_id="a-1")
        assert again.lease_id == lease.lease_id
        assert len([r for r in _log(bus) if r.state is LeaseState.GRANTED]) == 1
        assert svc.stats()["rejections"] == {"gpu_unavailable": 1, "unknown_offer": 1, "notice_too_short": 1}


async def test_gpu_turning_busy_withdraws_its_offer(mqtt_port: int) -> None:
    bus = MemoryBus()
    async with _service(bus, mqtt_port), _site(mqtt_port) as site:
        await _idle(bus, "n1", 1)
        offer = await _offer_on(site, "n1")
        events: list[object] = []

        async def follow() -> None:
            async with contextlib.aclosing(site.watch()) as stream:
                async for ev in stream:
                    events.append(ev)

        watcher = asyncio.create_task(follow())
        await _idle(bus, "n1", 1, state=GpuState.BUSY)
        await until(lambda: OfferWithdrawn(offer.offer_id) in events)
        watcher.cancel()
        assert not site.known_offers
        assert await _retained(mqtt_port, MT.offers_filter) == []


async def test_restart_rebuilds_from_the_lease_log_and_the_reclaim_completes(mqtt_port: int) -> None:
    bus = MemoryBus()
    cfg = CFG.model_copy(update={"notice_s": 2.0})
    async with _site(mqtt_port) as site:
        async with _service(bus, mqtt_port, cfg):
            await _idle(bus, "n1", 2)
            offer = await _offer_on(site, "n1")
            lease = await site.claim(offer.offer_id, count=1, claim_id="c-1")
            await bus.producer().send(
                TOPICS.pool_demand, encode(PoolDemand(demand_id="d1", ts=time.time(), count=1))
            )
            notice = await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 5)
        # the old broker is gone; a stale offer of an earlier incarnation lingers on the server
        async with aiomqtt.Client("127.0.0.1", mqtt_port, identifier="stale-writer") as c:
            await c.publish(MT.offer("offer-stale"), b'{"stale": true}', qos=1, retain=True)
        async with _service(bus, mqtt_port, cfg) as svc2:
            assert [r.lease_id for r in svc2.book.live_leases()] == [lease.lease_id]
            again = await site.claim(offer.offer_id, count=1, claim_id="c-1")  # idempotent across the restart
            assert again.lease_id == lease.lease_id
            final = await site.wait_lease(lease.lease_id, lambda m: not m.state.live, cfg.notice_s + 3)
            assert final.state is LeaseState.REVOKED
            assert notice.reclaim_deadline is not None and final.ts <= notice.reclaim_deadline + 0.5
            await until(lambda: [o for o in site.known_offers.values() if o.host == "n1"])
            topics = [t for t, _ in await _retained(mqtt_port, MT.offers_filter)]
            assert MT.offer("offer-stale") not in topics and len(topics) == 1
            assert svc2.tally.lease_counts() == svc2.book.lease_counts()
        states = [r.state for r in _log(bus) if r.lease_id == lease.lease_id]
        assert states == [LeaseState.GRANTED, LeaseState.RECLAIMING, LeaseState.REVOKED]


async def test_service_and_site_reconnect_after_the_mqtt_server_restarts(amqtt_server: _Amqtt) -> None:
    bus = MemoryBus()
    port = amqtt_server.port
    async with _service(bus, port) as svc, _site(port) as site:
        await _idle(bus, "n1", 2)
        offer = await _offer_on(site, "n1")
        lease = await site.claim(offer.offer_id, count=1)
        # the claim's offer changes go out after its reply: let them land, for amqtt 0.12's
        # shutdown hangs while a QoS 1 delivery to a client is in flight
        await until(lambda: [o for o in site.known_offers.values() if o.offer_id != offer.offer_id])
        await amqtt_server.stop()  # amqtt keeps nothing: every retained message is gone
        await until(lambda: not site.connected and not svc.stats()["mqtt_connected"])
        await amqtt_server.start()
        await svc.wait_connected(10)
        await until(lambda: site.connected, 10)
        assert site.reconnects >= 1
        reply = await site.renew(lease.lease_id)
        assert reply.code is ReasonCode.OK
        retained = dict(await _retained(port, f"{MT.root}/#", 1.0))
        assert MT.lease("edge-a", lease.lease_id) in retained, "lease republished after the outage"
        assert [t for t in retained if t.startswith(f"{MT.root}/offers/")], "offers republished"


async def test_restart_over_kafka_rebuilds_from_the_real_lease_log(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mqtt_port: int
) -> None:
    """Same as the restart test, on real Kafka with a 4-partition compacted lease log: the new
    broker reads the log to its end offsets and carries on."""
    kafka_topics = kafka_stage_topics  # every topic, 4 partitions, made as `gpupool topics create` does
    cfg = CFG.model_copy(update={"notice_s": 3.0, "group_id": f"broker-{uuid.uuid4().hex[:8]}"})
    async with _site(mqtt_port) as site:
        async with _service(kafka_bus, mqtt_port, cfg, kafka_topics):
            for host in ("n1", "n2", "n3"):
                await _idle(kafka_bus, host, 1, topics=kafka_topics)
            leases = []
            for host in ("n1", "n2", "n3"):
                leases.append(await site.claim((await _offer_on(site, host)).offer_id))
            await site.release(leases[2].lease_id)
            producer = kafka_bus.producer()
            await producer.start()
            demand = PoolDemand(demand_id="d1", ts=time.time(), gpus=leases[0].gpus)
            await producer.send(kafka_topics.pool_demand, encode(demand), key="d1")
            await producer.stop()
            notice = await site.wait_lease(leases[0].lease_id, lambda m: m.state is LeaseState.RECLAIMING, 15)
        async with _service(kafka_bus, mqtt_port, cfg, kafka_topics) as svc2:
            live = {r.lease_id: r.state for r in svc2.book.live_leases()}
            assert live == {leases[0].lease_id: LeaseState.RECLAIMING, leases[1].lease_id: LeaseState.GRANTED}
            assert svc2.book.leases[leases[2].lease_id].state is LeaseState.RELEASED
            await site.renew(leases[1].lease_id)
            final = await site.wait_lease(leases[0].lease_id, lambda m: not m.state.live, cfg.notice_s + 5)
            assert final.state is LeaseState.REVOKED
            assert notice.reclaim_deadline is not None and final.ts <= notice.reclaim_deadline + 0.5
            assert svc2.stats()["demands"] == {}, (
                "the demand was committed by the first broker: not applied twice"
            )


async def test_simulated_sites_claim_renew_and_answer_reclaims(mqtt_port: int) -> None:
    from simulator.sites import SimulatedSite

    bus = MemoryBus()
    cfg = CFG.model_copy(update={"notice_s": 1.0, "lease_ttl_s": 1.0})
    common = {
        "host": "127.0.0.1",
        "port": mqtt_port,
        "protocol": 4,
        "claim_every_s": 0.1,
        "claim_probability": 1.0,
        "max_live_leases": 1,
        "renew_every_s": 0.25,
    }
    keeper = SimulatedSite(name="edge-a", seed=1, release_on_reclaim=1.0, **common)  # type: ignore[arg-type]
    holder = SimulatedSite(name="edge-b", seed=2, release_on_reclaim=0.0, **common)  # type: ignore[arg-type]
    stop = asyncio.Event()
    async with _service(bus, mqtt_port, cfg) as svc:
        for host in ("n1", "n2"):
            await _idle(bus, host, 2)
        tasks = [asyncio.create_task(s.run(stop)) for s in (keeper, holder)]
        try:
            await until(lambda: keeper.counts["leases_granted"] and holder.counts["leases_granted"], 10)
            await asyncio.sleep(2 * cfg.lease_ttl_s)  # outlive the TTL: renewals must keep the leases
            assert len(svc.book.live_leases()) == 2
            assert keeper.counts["renewals"] >= 2 and holder.counts["renewals"] >= 2
            await bus.producer().send(TOPICS.pool_demand, encode(PoolDemand(demand_id="all", ts=time.time())))
            await until(lambda: keeper.counts["released_in_notice"] and holder.counts["revoked"], 10)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
    assert keeper.counts["reclaims_seen"] == 1 and holder.counts["let_revoke"] == 1
    st = svc.stats()
    assert st["reclaims"] == {"started": 2, "released_in_notice": 1, "revoked_at_deadline": 1}
    assert st["expired"] == 0


class _Fabric:
    """A fabric manager double that enforces isolation; ``mode`` says what ``isolate`` does."""

    enforced = True

    def __init__(self) -> None:
        self.mode = "verified"
        self.removed: list[str] = []

    async def isolate(self, lease: LeaseLogRecord) -> Partition | None:
        if self.mode == "raise":
            raise FabricError("smpquery pkeys: port 1 of node 0x0002c9 did not answer")
        return Partition(
            pkey=0x12, sl=1, limited_members=["0x0002c90300a0b1c1"], verified=self.mode == "verified"
        )

    async def remove(self, lease: LeaseLogRecord) -> None:
        self.removed.append(lease.lease_id)


async def test_grant_waits_for_a_verified_partition(mqtt_port: int) -> None:
    bus = MemoryBus()
    fabric = _Fabric()
    async with _service(bus, mqtt_port, fabric=fabric) as svc:
        async with _site(mqtt_port) as site:
            await _idle(bus, "n1", 1)
            for mode in ("unverified", "raise"):
                fabric.mode = mode
                with pytest.raises(ClaimRejected) as e:
                    await site.claim((await _offer_on(site, "n1")).offer_id)
                assert e.value.code is ReasonCode.ISOLATION_FAILED
            # the partition made but not verified is taken off again (in the background)
            await until(lambda: len(fabric.removed) == 1)
            assert _log(bus) == []
            fabric.mode = "verified"
            lease = await site.claim((await _offer_on(site, "n1")).offer_id)  # the GPU was offered again
            assert lease.partition is not None and lease.partition.verified and lease.partition.pkey == 0x12
            await site.release(lease.lease_id)
            await until(lambda: lease.lease_id in fabric.removed)
            assert "pkey=0x0012 sl=1 verified" in svc.stats()["partitions"][0]


class _Proxy:
    """A TCP proxy in front of the MQTT server whose connections can be cut: a network failure
    that neither side announces (the server then publishes the client's Last Will)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._conns: list[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        self._conns.append((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        for a, b in self._conns:
            a.transport.abort()
            b.transport.abort()
        self._conns.clear()

    async def stop(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()


async def test_last_will_marks_a_cut_site_offline_and_it_comes_back_with_a_higher_seq(mqtt_port: int) -> None:
    proxy = _Proxy(mqtt_port)
    await proxy.start()
    bus = MemoryBus()
    site = EdgeClient(
        site="edge-a", host="127.0.0.1", port=proxy.port, protocol=4, reconnect_min_s=1.0, reconnect_max_s=1.0
    )
    state_topic = MT.site_state("edge-a")

    async def state() -> PeerState:
        ((_, payload),) = await _retained(mqtt_port, state_topic, 0.3)
        return decode(PeerState, payload)

    try:
        async with _service(bus, mqtt_port) as svc, site:
            await until(lambda: svc.stats()["sites_online"] == ["edge-a"])
            born = await state()
            assert born.online and born.peer == "edge-a"
            proxy.cut()
            await until(lambda: svc.stats()["sites_online"] == [])  # the Will reached the broker
            dead = await state()
            assert (dead.online, dead.seq) == (False, born.seq)
            await until(lambda: svc.stats()["sites_online"] == ["edge-a"], 5)
            reborn = await state()
            assert reborn.online and reborn.seq > born.seq and site.reconnects == 1
        gone = await state()  # a clean exit says goodbye
        assert (gone.online, gone.seq) == (False, reborn.seq)
    finally:
        await proxy.stop()


async def test_lease_log_producer_linger_is_per_producer(kafka_bus: Bus, kafka_topics: KafkaTopics) -> None:
    """``Bus.producer(linger_ms=...)``: a Kafka producer lingering 200 ms holds every lone record
    that long before sending it; one lingering 0 ms sends at once. The memory bus takes and
    ignores it; a negative linger is refused everywhere."""
    from runtime.kafka import DEFAULT_LINGER_MS

    await kafka_bus.create_topics([kafka_topics.leases_log])
    assert kafka_bus.producer().linger_ms == DEFAULT_LINGER_MS == 20.0  # type: ignore[attr-defined]

    async def lone_record_s(linger_ms: float) -> float:
        producer = kafka_bus.producer(client_id="linger-test", linger_ms=linger_ms)
        await producer.start()
        try:
            await producer.send(kafka_topics.leases_log, b"{}", key="warm-up")
            await producer.flush()
            took = []
            for i in range(5):
                t0 = time.perf_counter()
                await producer.send(kafka_topics.leases_log, b"{}", key=f"k{i}")
                await producer.flush()
                took.append(time.perf_counter() - t0)
            return sorted(took)[2]
        finally:
            await producer.stop()

    slow, fast = await lone_record_s(200), await lone_record_s(0)
    assert slow >= 0.19 and fast < 0.1, (slow, fast)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="linger_ms"):
            kafka_bus.producer(linger_ms=bad)
        with pytest.raises(ValueError, match="linger_ms"):
            MemoryBus().producer(linger_ms=bad)
    MemoryBus().producer(linger_ms=0)
    with pytest.raises(ValueError, match="lease_log_linger_ms"):
        BrokerService(bus=MemoryBus(), topics=TOPICS, mqtt_host="x", mqtt_port=1, lease_log_linger_ms=-1)


def test_tune_gc_freezes_and_the_tick_refreezes_and_fully_collects() -> None:
    """Checked on the objects themselves (frozen ones are outside ``gc.get_objects()``; a weak
    reference tells when a frozen cycle is freed), not on ``gc.get_freeze_count()``, which other
    threads of the test process change by freeing frozen objects at any time."""
    import gc
    import weakref

    from broker.service import _GC, tune_gc

    class _Cycle:
        def __init__(self) -> None:
            self.me = self

    def frozen(obj: object) -> bool:
        return not any(o is obj for o in gc.get_objects())

    try:
        tune_gc(refreeze_every_s=0.5, full_every_s=10.0)
        assert gc.get_freeze_count() > 0
        young = [_Cycle() for _ in range(100)]
        t = time.monotonic()
        _GC.run_due(t + 0.1)  # not yet due
        assert not frozen(young[0]) and not frozen(young[-1])
        _GC.run_due(t + 0.6)  # refreeze: the young survivors join the permanent generation
        assert frozen(young[0]) and frozen(young[-1])
        first = weakref.ref(young[0])
        del young  # 100 cycles, now garbage among frozen objects: only the full collection finds them
        assert gc.collect() < 100
        assert first() is not None
        _GC.run_due(t + 11.0)
        assert first() is None
        with pytest.raises(ValueError, match="refreeze_every_s"):
            tune_gc(refreeze_every_s=0)
    finally:
        _GC.set(0.0, 0.0, time.monotonic())
        gc.unfreeze()


async def test_a_site_past_its_rate_limit_is_answered_rate_limited(mqtt_port: int) -> None:
    """The per-site token bucket: ``burst`` requests pass at once, the next is answered
    ``rate_limited`` (and changes nothing); another site is not affected."""
    cfg = CFG.model_copy(update={"site_request_rate_per_s": 0.5, "site_request_burst": 2.0})
    async with _service(MemoryBus(), mqtt_port, cfg) as svc:
        codes = []
        for i in range(3):
            claim = {"claim_id": f"rl-{i}", "site": "edge-a", "count": 1, "ts": time.time(), "request_id": f"r{i}"}
            codes.append((await _raw_request(mqtt_port, MT.claims("edge-a"), json.dumps(claim).encode())).code)
        assert codes == [ReasonCode.NO_MATCH, ReasonCode.NO_MATCH, ReasonCode.RATE_LIMITED]
        other = {"claim_id": "rl-b", "site": "edge-b", "count": 1, "ts": time.time()}
        reply = await _raw_request(mqtt_port, MT.claims("edge-b"), json.dumps(other).encode(), site="edge-b")
        assert reply.code is ReasonCode.NO_MATCH
        assert svc.stats()["rejected_messages"].get("rate_limited") == 1


async def test_an_unexpected_failure_is_answered_internal(mqtt_port: int) -> None:
    """A bug in handling a request still gets the site an answer (``internal``), and the broker
    keeps serving."""
    bus = MemoryBus()
    async with _service(bus, mqtt_port) as svc:

        def broken(*_: object) -> object:
            raise RuntimeError("a bug")

        svc.book.renew = broken  # type: ignore[method-assign]
        renewal = {"lease_id": "lease-x", "site": "edge-a", "ts": time.time()}
        reply = await _raw_request(mqtt_port, MT.renewals("edge-a"), json.dumps(renewal).encode())
        assert (reply.code, reply.in_reply_to) == (ReasonCode.INTERNAL, "lease-x")
        claim = {"claim_id": "after", "site": "edge-a", "count": 1, "ts": time.time()}
        assert (await _raw_request(mqtt_port, MT.claims("edge-a"), json.dumps(claim).encode())).code is ReasonCode.NO_MATCH


async def test_the_mqtt_loop_reconnects_after_a_failed_resync(mqtt_port: int) -> None:
    """An error inside a connection's resync ends only that connection: the loop reconnects."""
    svc = BrokerService(bus=MemoryBus(), topics=TOPICS, mqtt_host="127.0.0.1", mqtt_port=mqtt_port, protocol=4,
                        config=CFG)  # fmt: skip
    real = svc._on_connect  # noqa: SLF001
    calls = 0

    async def flaky(client: aiomqtt.Client) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("resync failed oddly")
        await real(client)

    svc._on_connect = flaky  # type: ignore[method-assign]  # noqa: SLF001
    async with running(svc, connect_timeout_s=15):
        assert calls == 2 and svc.stats()["mqtt_connected"]


async def test_two_brokers_in_one_process_keep_their_metrics_apart(mqtt_port: int) -> None:
    """Each service counts on its own registry: a claim answered by broker A shows in A's
    ``/metrics`` only, broker B (same process, another MQTT root) shows none of it, and nothing
    lands on prometheus_client's default registry."""
    from prometheus_client import REGISTRY

    bus_a = MemoryBus()
    b = BrokerService(bus=MemoryBus(), topics=TOPICS, mqtt_host="127.0.0.1", mqtt_port=mqtt_port, protocol=4,
                      config=CFG, root="gpupool-b/v1", client_id="gpupool-broker-b")  # fmt: skip
    async with _service(bus_a, mqtt_port) as a, running(b), _site(mqtt_port) as site:
        await _idle(bus_a, "n1", 2)
        lease = await site.claim((await _offer_on(site, "n1")).offer_id, count=1)
        assert lease.state is LeaseState.GRANTED
        assert metric(a, "gpupool_broker_claims_total", result="ok") == 1
        assert metric(a, "gpupool_broker_claim_decisions_total", site="edge-a", kind="offer", result="ok") == 1
        assert metric(a, "gpupool_broker_leases", state="granted") == 1
        assert metric(a, "gpupool_broker_offers_published_total") >= 1
        assert metric(a, "gpupool_broker_records_produced_total", topic=TOPICS.leases_log) == 1
        for name, labels in [
            ("gpupool_broker_claims_total", {"result": "ok"}),
            ("gpupool_broker_claim_decisions_total", {"site": "edge-a", "kind": "offer", "result": "ok"}),
            ("gpupool_broker_offers_published_total", {}),
            ("gpupool_broker_records_produced_total", {"topic": TOPICS.leases_log}),
            ("gpupool_broker_site_up", {"site": "edge-a"}),
        ]:
            assert metric(b, name, **labels) == 0, name
        assert metric(b, "gpupool_broker_leases", state="granted") == 0
        assert metric(a, "gpupool_broker_site_up", site="edge-a") == 1
    assert not [m.name for m in REGISTRY.collect() if m.name.startswith("gpupool_broker_")]
