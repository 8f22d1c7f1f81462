"""Atomic transitions (issue 10): the lease log refusing a write never leaves a change half made.

Real Kafka refuses the lease-log write of a claim in two ways — the record is too large for the
topic (``max.message.bytes``), and the Kafka process stops answering (SIGSTOP, then SIGCONT) —
over a real Mosquitto with real edge clients. After each: the site got an answer (``internal``),
nothing of the claim is left (memory, lease log, retained MQTT state), the book's invariants hold,
and another site's transitions (claims, renewals) go out. A unit test with an in-memory bus whose
producer refuses one record checks that one refused record fails only its own lease, not the
batch (a demand reclaiming two leases).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from broker.config import BrokerConfig
from broker.edge import ClaimRejected, EdgeClient
from broker.service import BrokerService
from contracts import (
    CapacityUpdate,
    Claim,
    GpuState,
    KafkaTopics,
    LeaseLogRecord,
    LeaseState,
    PoolDemand,
    ReasonCode,
    encode,
)
from contracts.bus import MemoryBus
from contracts.leases import LeaseReason
from contracts.mqtt import Requirements
from runtime.kafka import KafkaBus
from runtime.replay import read_to_end
from tests.mqtt_support import retained_leases, running, until
from tests.services import state_dir
from broker.credentials import edge_client

pytestmark = pytest.mark.integration

CFG = BrokerConfig(
    default_site_quota=None, lease_log_timeout_s=2.0, capacity_max_age_s=3600, offer_ttl_s=600,
    tick_s=0.2, lease_ttl_s=60, notice_s=5,
)  # fmt: skip
MAX_MESSAGE_BYTES = 1200
"""``max.message.bytes`` of the test's lease-log topic: a one-GPU lease record (about 700 bytes
of JSON, less compressed) fits, a 96-GPU one (random GPU UUIDs, > 1.5 KB even compressed) does not."""


def _capacity(nodes: int, per_node: int, run_id: str) -> list[CapacityUpdate]:
    now = time.time()
    return [
        CapacityUpdate(ts=now, host=f"n{n:02d}-{run_id}", gpu_uuid=f"GPU-{uuid.uuid4()}", state=GpuState.IDLE,
                       since=now - 60, predicted_idle_until=now + 3600, leaf="leaf-1")
        for n in range(nodes) for _ in range(per_node)
    ]  # fmt: skip


def _site(creds: dict[str, Any], name: str) -> EdgeClient:
    return edge_client(creds, name)


async def _lease_log(bootstrap: str, topics: KafkaTopics) -> dict[str, LeaseLogRecord]:
    bus = KafkaBus(bootstrap, client_id=f"refusal-reader-{uuid.uuid4().hex[:6]}")
    try:
        records, rejected = await read_to_end(bus, topics.leases_log, LeaseLogRecord,
                                              group_prefix=f"refusal-{uuid.uuid4().hex[:6]}",
                                              client_id="refusal-reader", timeout_s=30)  # fmt: skip
    finally:
        await bus.close()
    assert rejected == 0
    latest: dict[str, LeaseLogRecord] = {}
    for r in records:
        if r.lease_id not in latest or r.seq >= latest[r.lease_id].seq:
            latest[r.lease_id] = r
    return latest


def _kafka_pid() -> int:
    return int((state_dir() / "kafka" / "kafka.pid").read_text().split()[0])


def _free_gpus(svc: BrokerService) -> int:
    return sum(len(o.gpus) for o in svc.book.offers.values())


async def test_kafka_refusing_a_claims_lease_log_write(kafka_bootstrap: str, mosquitto: dict[str, Any]) -> None:
    run_id = uuid.uuid4().hex[:8]
    topics = KafkaTopics(prefix=f"t{run_id}.")
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topics.leases_log, 1, 1, topic_configs={
            "cleanup.policy": "compact", "max.message.bytes": str(MAX_MESSAGE_BYTES)})])  # fmt: skip
    finally:
        await admin.close()
    bus = KafkaBus(kafka_bootstrap, client_id=f"refusal-{run_id}")
    await bus.create_topics([topics.capacity, topics.pool_demand])  # as the operator does, before the broker
    svc = BrokerService(bus=bus, topics=topics, mqtt_host=mosquitto["host"], mqtt_port=mosquitto["port"],
                        mqtt_username="gpupool-broker", mqtt_password=mosquitto["users"]["gpupool-broker"],
                        root=mosquitto["root"], protocol=5, config=CFG)  # fmt: skip
    caps = _capacity(12, 8, run_id)
    a, b = _site(mosquitto, "edge-a"), _site(mosquitto, "edge-b")
    try:
        async with running(svc), a, b:
            producer = bus.producer(client_id=f"refusal-cap-{run_id}")
            await producer.start()
            for cap in caps:
                await producer.send(topics.capacity, encode(cap), key=cap.key)
            await producer.flush()
            await producer.stop()
            await until(lambda: _free_gpus(svc) == 96, 20, "96 GPUs offered")
            held = await a.request(1, claim_id=f"a-held-{run_id}", duration_seconds=600)

            # 1. the record is too large for the topic: refused by Kafka
            big = Requirements(allow_cross_leaf=True)
            with pytest.raises(ClaimRejected) as refused:
                await b.request(95, big, claim_id=f"b-big-{run_id}", timeout_s=15)
            assert refused.value.code is ReasonCode.INTERNAL, refused.value.reply
            assert svc.book.violations() == []
            assert [r.lease_id for r in svc.book.live_leases()] == [held.lease_id]
            await until(lambda: _free_gpus(svc) == 95, 5, "the 95 GPUs offered again")
            # another site's transitions go out meanwhile
            renewed = await a.renew(held.lease_id)
            assert renewed.code is ReasonCode.OK and renewed.expires_at is not None
            second = await a.request(1, claim_id=f"a-second-{run_id}")
            assert second.state is LeaseState.GRANTED

            # 2. Kafka stops answering while a claim is decided
            pid = _kafka_pid()
            os.kill(pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                with pytest.raises(ClaimRejected) as stalled:
                    await b.request(1, claim_id=f"b-stalled-{run_id}", timeout_s=15)
                answered_s = time.monotonic() - t0
                assert stalled.value.code is ReasonCode.INTERNAL
                assert answered_s < CFG.lease_log_timeout_s + 3.0, answered_s
                assert svc.book.violations() == []
                assert sorted(r.lease_id for r in svc.book.live_leases()) == sorted([held.lease_id, second.lease_id])
                assert _free_gpus(svc) == 94
            finally:
                os.kill(pid, signal.SIGCONT)
            # Kafka back: the same claim_id is decided afresh and granted; the held lease renews
            retried = await b.request(1, claim_id=f"b-stalled-{run_id}", timeout_s=30)
            assert retried.state is LeaseState.GRANTED
            assert (await a.renew(held.lease_id, timeout_s=15)).code is ReasonCode.OK

            # what crossed the boundaries agrees with the book: no trace of the refused claims
            log = await _lease_log(kafka_bootstrap, topics)
            live_logged = {i for i, r in log.items() if r.state.live}
            assert live_logged == {held.lease_id, second.lease_id, retried.lease_id}
            for lease_id in live_logged:
                assert log[lease_id] == svc.book.leases[lease_id]
            undone = [r for r in log.values() if r.reason == LeaseReason.LOG_WRITE_FAILED]
            assert all(r.state is LeaseState.REVOKED for r in undone)
            for site in ("edge-a", "edge-b"):
                retained = await retained_leases(mosquitto, site)
                assert {i for i, m in retained.items() if m.state.live} == {
                    i for i in live_logged if log[i].site == site
                }
            st = svc.stats()
            assert st["claims"].get("internal", 0) == 2
    finally:
        await bus.close()


class _RefusingProducer:
    """A MemoryBus producer that refuses every record whose value contains ``poison``."""

    def __init__(self, inner: Any, poison: bytes) -> None:
        self._inner, self._poison, self._failed = inner, poison, False

    async def start(self) -> None:
        await self._inner.start()

    async def stop(self) -> None:
        await self._inner.stop()

    async def send(self, topic: str, value: bytes | None, key: str | None = None,
                   headers: Sequence[tuple[str, bytes]] = ()) -> None:  # fmt: skip
        if value is not None and self._poison in value:
            self._failed = True
            return
        await self._inner.send(topic, value, key, headers)

    async def flush(self) -> None:
        failed, self._failed = self._failed, False
        if failed:
            raise RuntimeError("record refused")


class _RefusingBus(MemoryBus):
    """A MemoryBus whose producers refuse records containing ``poison`` (when set)."""

    poison: bytes | None = None

    def producer(self, client_id: str = "gpupool", *, linger_ms: float | None = None) -> Any:
        inner = super().producer(client_id, linger_ms=linger_ms)
        return inner if self.poison is None else _RefusingProducer(inner, self.poison)


async def test_one_refused_record_fails_only_its_own_lease() -> None:
    """A demand reclaims two leases of two sites; the lease log refuses one record: the other
    lease's reclaim is logged and kept, the refused one is undone (still active), and the
    invariants hold."""
    bus = _RefusingBus()
    topics = KafkaTopics(prefix="refuse.")
    svc = BrokerService(bus=bus, topics=topics, mqtt_host="127.0.0.1", mqtt_port=1, config=CFG)
    await bus.create_topics([topics.capacity, topics.pool_demand, topics.leases_log])
    svc._producer = bus.producer()  # noqa: SLF001 — the service's writer, without MQTT
    now = time.time()
    caps = _capacity(2, 1, "u")
    for cap in caps:
        svc.book.apply_capacity(cap, now)
    offers = sorted(svc.book.offers.values(), key=lambda o: o.host)
    leases = []
    for site, offer in zip(("edge-a", "edge-b"), offers, strict=True):
        answer, ch = svc.book.claim(site, Claim(claim_id=f"c-{site}", site=site, offer_id=offer.offer_id, ts=now), now)
        assert answer.ok
        assert await svc._apply(ch, now) == set()  # noqa: SLF001
        leases.append(answer.lease_id)
    bus.poison = leases[1].encode()
    svc._producer = bus.producer()  # noqa: SLF001
    _, ch = svc.book.apply_demand(PoolDemand(demand_id="d1", ts=now, gpus=[c.key for c in caps]), now)
    assert len(ch.records) == 2
    undone = await svc._apply(ch, now)  # noqa: SLF001
    assert undone == {leases[1]}
    assert svc.book.leases[leases[0]].state is LeaseState.RECLAIMING
    assert svc.book.leases[leases[1]].state is LeaseState.ACTIVE or svc.book.leases[leases[1]].state is LeaseState.GRANTED
    assert svc.book.violations() == []
    logged = [r for r in (m.value for m in bus.records(topics.leases_log)) if r]
    assert any(b'"reclaiming"' in v and leases[0].encode() in v for v in logged)
    assert not any(b'"reclaiming"' in v and leases[1].encode() in v for v in logged)
    # the undo record waits for the next write and supersedes the refused one
    assert [r.lease_id for r in svc._unlogged] == [leases[1]]  # noqa: SLF001
    bus.poison = None
    assert await svc._apply(ch.__class__(), now) == set()  # noqa: SLF001
    assert svc._unlogged == []  # noqa: SLF001
    # the demand may be applied again (its id was forgotten with the undo)
    result, again = svc.book.apply_demand(PoolDemand(demand_id="d1", ts=now, gpus=[c.key for c in caps]), now)
    assert result == "reclaimed" and [r.lease_id for r in again.records] == [leases[1]]
