"""Fabric isolation runs outside the broker's service lock: while one claim's partition is being
verified (a fabric double whose ``isolate`` blocks until the test lets it go), claims on other
GPUs are granted, renewals and releases are answered, and a slow partition removal holds nothing
up either. Over a real MQTT server (amqtt, MQTT 3.1.1, in-process) with the in-process bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Collection

import aiomqtt
import pytest

from broker.edge import EdgeClient
from broker.fabric import FabricError
from broker.service import BrokerService
from contracts import KafkaTopics, LeaseLogRecord, LeaseState, MqttTopics, Offer, ReasonCode, Reply, decode
from contracts.bus import MemoryBus
from contracts.leases import Partition
from tests.mqtt_support import until
from tests.test_broker_service import CFG, _idle, _log, _offer_on, _site, amqtt_server, mqtt_port  # noqa: F401

MT = MqttTopics()


class _SlowFabric:
    """Enforces isolation; ``isolate`` of a lease on a host in ``hold`` (and ``remove`` of a lease
    in ``hold_remove``) waits until the test sets that host's (lease's) event."""

    enforced = True

    def __init__(self) -> None:
        self.hold: dict[str, asyncio.Event] = {}
        self.hold_remove: dict[str, asyncio.Event] = {}
        self.started: list[str] = []
        self.removed: list[str] = []
        self.fail: set[str] = set()
        self.stale_calls: list[set[str]] = []

    async def isolate(self, lease: LeaseLogRecord) -> Partition | None:
        host = lease.gpus[0].split("/", 1)[0]
        self.started.append(lease.lease_id)
        gate = self.hold.get(host)
        if gate is not None:
            await gate.wait()
        if host in self.fail:
            raise FabricError(f"smpquery pkeys: {host} did not answer")
        return Partition(pkey=0x10 + len(self.started), sl=1, limited_members=["0x0002c90300a0b1c1"], verified=True)

    async def remove(self, lease: LeaseLogRecord) -> None:
        gate = self.hold_remove.get(lease.lease_id)
        if gate is not None:
            await gate.wait()
        self.removed.append(lease.lease_id)

    async def remove_stale(self, keep: Collection[str]) -> list[str]:
        self.stale_calls.append(set(keep))
        return []


@contextlib.asynccontextmanager
async def _service(bus: MemoryBus, port: int, fabric: _SlowFabric) -> AsyncIterator[BrokerService]:
    svc = BrokerService(
        bus=bus, topics=KafkaTopics(), mqtt_host="127.0.0.1", mqtt_port=port, protocol=4, config=CFG,
        fabric=fabric,
    )  # fmt: skip
    await svc.start()
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    svc.stop_serving = stop  # type: ignore[attr-defined]
    try:
        await svc.wait_connected(10)
        yield svc
    finally:
        for ev in [*fabric.hold.values(), *fabric.hold_remove.values()]:
            ev.set()  # a failed test must not leave stop() waiting for a held fabric call
        stop.set()
        await task
        await svc.stop()


async def _fresh_offer(site: EdgeClient, host: str, gpus: int) -> Offer:
    """The offer on ``host`` with ``gpus`` GPUs (not an older one whose withdrawal is still on
    its way)."""
    return await until(
        lambda: next((o for o in site.known_offers.values() if o.host == host and len(o.gpus) == gpus), None)
    )


async def test_a_slow_verification_does_not_stall_other_claims(mqtt_port: int) -> None:  # noqa: F811
    bus, fabric = MemoryBus(), _SlowFabric()
    fabric.hold["slow"] = asyncio.Event()
    async with _service(bus, mqtt_port, fabric) as svc, _site(mqtt_port) as a, _site(mqtt_port, "edge-b") as b:
        await _idle(bus, "slow", 1)
        await _idle(bus, "fast", 2)
        slow_offer, fast_offer = await _offer_on(a, "slow"), await _offer_on(b, "fast")
        slow = asyncio.create_task(a.claim(slow_offer.offer_id, claim_id="slow-1", timeout_s=20))
        await until(lambda: fabric.started)  # the slow claim holds its GPU, its isolation waits

        t0 = time.monotonic()
        fast = await b.claim(fast_offer.offer_id, count=1, timeout_s=5)
        assert fast.state is LeaseState.GRANTED and fast.partition is not None and fast.partition.verified
        assert (await b.renew(fast.lease_id)).code is ReasonCode.OK
        second = await b.claim((await _fresh_offer(b, "fast", gpus=1)).offer_id, timeout_s=5)
        await b.release(second.lease_id)
        assert time.monotonic() - t0 < 3, "claims, renewals and releases went on during the slow verification"
        assert not slow.done()
        # the slow claim's GPU stays reserved: not offered to anyone meanwhile
        assert not [o for o in b.known_offers.values() if o.host == "slow"]
        # a resent copy of the slow claim (same claim_id, e.g. after a reconnect) waits for the first
        again = asyncio.create_task(a.claim(slow_offer.offer_id, claim_id="slow-1", timeout_s=20))
        await asyncio.sleep(0.2)
        assert not again.done()

        fabric.hold["slow"].set()
        lease = await slow
        assert lease.state is LeaseState.GRANTED and lease.partition is not None
        assert (await again).lease_id == lease.lease_id
        assert len([r for r in _log(bus) if r.state is LeaseState.GRANTED and r.lease_id == lease.lease_id]) == 1
        assert svc.stats()["claims"] == {"ok": 4}
        assert svc.book.violations() == []


async def test_a_failed_slow_isolation_frees_the_gpus_and_stop_waits_for_isolation(mqtt_port: int) -> None:  # noqa: F811
    bus, fabric = MemoryBus(), _SlowFabric()
    fabric.hold["n1"] = asyncio.Event()
    fabric.fail.add("n1")
    async with _service(bus, mqtt_port, fabric) as svc, _site(mqtt_port) as site:
        await _idle(bus, "n1", 1)
        offer = await _offer_on(site, "n1")
        claim = asyncio.create_task(site.claim(offer.offer_id, timeout_s=20))
        await until(lambda: fabric.started)
        fabric.hold["n1"].set()
        with pytest.raises(Exception) as e:
            await claim
        assert getattr(e.value, "code", None) is ReasonCode.ISOLATION_FAILED
        again = await _offer_on(site, "n1")  # the reserved GPU is offered again
        assert [g.gpu for g in again.gpus] == [g.gpu for g in offer.gpus]
        assert _log(bus) == []

        # a claim still being isolated when the broker stops is decided and answered first
        fabric.fail.clear()
        fabric.hold["n1"] = asyncio.Event()
        pending = asyncio.create_task(site.claim(again.offer_id, timeout_s=20))
        await until(lambda: len(fabric.started) == 2)
        svc.stop_serving.set()  # type: ignore[attr-defined]
        stopping = asyncio.create_task(svc.stop())
        await asyncio.sleep(0.3)
        assert not stopping.done(), "stop waits for the isolation in progress"
        fabric.hold["n1"].set()
        await stopping
        assert [r.state for r in _log(bus)] == [LeaseState.GRANTED]
        lease = await asyncio.wait_for(pending, 5)  # its reply and lease went out before the goodbye
        assert lease.state is LeaseState.GRANTED


async def test_a_slow_partition_removal_does_not_hold_the_broker(mqtt_port: int) -> None:  # noqa: F811
    bus, fabric = MemoryBus(), _SlowFabric()
    gate = asyncio.Event()
    async with _service(bus, mqtt_port, fabric) as svc, _site(mqtt_port) as site:
        await _idle(bus, "n1", 2)
        first = await site.claim((await _offer_on(site, "n1")).offer_id, count=1)
        fabric.hold_remove[first.lease_id] = gate = asyncio.Event()
        await site.release(first.lease_id)
        t0 = time.monotonic()
        second = await site.claim((await _fresh_offer(site, "n1", gpus=2)).offer_id, timeout_s=5)
        assert time.monotonic() - t0 < 3 and second.state is LeaseState.GRANTED
        assert fabric.removed == []
        gate.set()
        await until(lambda: fabric.removed == [first.lease_id])
        assert fabric.stale_calls == [set()], "after the (empty) rebuild: nothing live to keep"
        assert svc.stats()["leases_by_state"]["released"] == 1


async def test_claims_in_flight_are_kept_by_the_stale_cleanup_after_a_restart(mqtt_port: int) -> None:  # noqa: F811
    """A restarted broker asks the fabric to remove every partition but those of its live leases."""
    bus, fabric = MemoryBus(), _SlowFabric()
    async with _service(bus, mqtt_port, fabric), _site(mqtt_port) as site:
        await _idle(bus, "n1", 2)
        kept = await site.claim((await _offer_on(site, "n1")).offer_id, count=1)
        gone = await site.claim((await _fresh_offer(site, "n1", gpus=1)).offer_id, count=1)
        await site.release(gone.lease_id)
        await until(lambda: gone.lease_id in fabric.removed)
    async with _service(bus, mqtt_port, fabric):
        await until(lambda: len(fabric.stale_calls) == 2)
        assert fabric.stale_calls[1] == {kept.lease_id}


async def test_a_claim_sent_raw_twice_at_once_is_granted_once(mqtt_port: int) -> None:  # noqa: F811
    """Two copies of one claim arrive back to back while its isolation is slow: one lease, the
    same answer on both."""
    bus, fabric = MemoryBus(), _SlowFabric()
    fabric.hold["n1"] = asyncio.Event()
    async with _service(bus, mqtt_port, fabric), _site(mqtt_port) as site:
        await _idle(bus, "n1", 1)
        offer = await _offer_on(site, "n1")
        body = json.dumps(
            {"claim_id": "twice", "site": "edge-a", "offer_id": offer.offer_id, "ts": time.time()}
        ).encode()
        replies: list[Reply] = []
        async with aiomqtt.Client("127.0.0.1", mqtt_port, identifier=f"raw-{uuid.uuid4().hex[:8]}") as c:
            await c.subscribe(MT.replies("edge-a"), qos=1)
            await c.publish(MT.claims("edge-a"), body, qos=1)
            await c.publish(MT.claims("edge-a"), body, qos=1)
            await until(lambda: fabric.started)
            await asyncio.sleep(0.2)
            fabric.hold["n1"].set()
            async with asyncio.timeout(5):
                async for msg in c.messages:
                    if msg.topic.matches(MT.replies("edge-a")):
                        replies.append(decode(Reply, bytes(msg.payload)))  # type: ignore[arg-type]
                        if len(replies) == 2:
                            break
        assert [r.code for r in replies] == [ReasonCode.OK, ReasonCode.OK]
        assert replies[0].lease_id == replies[1].lease_id is not None
        assert len(fabric.started) == 1
        assert [r.state for r in _log(bus)] == [LeaseState.GRANTED]
