"""End to end over real services: simulator → collectors → Kafka → analytics → broker →
Mosquitto → an edge site's lease → training demand on Kafka → reclaim.

Assertions read the real Kafka topics and the real MQTT retained lease messages, never the
stages' in-process state.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import aiomqtt
import pytest

from contracts import (
    CapacityUpdate,
    decode_gpu_samples,
    GpuState,
    KafkaTopics,
    LeaseLogRecord,
    LeaseMessage,
    LeaseState,
    MqttTopics,
    PoolDemand,
    decode,
    encode,
)
from gpupool.demo import DemoConfig, run_demo
from runtime.kafka import KafkaBus

pytestmark = pytest.mark.integration


async def _read_all(bus: KafkaBus, topic: str, idle_s: float = 3.0) -> list[bytes]:
    """Every record of ``topic`` from the beginning (a fresh group), until ``idle_s`` of silence."""
    c = bus.consumer([topic], group_id=f"e2e-reader-{uuid.uuid4().hex[:6]}")
    await c.start()
    out: list[bytes] = []
    try:
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < idle_s:
            batch = await c.getmany(timeout_s=0.5)
            if batch:
                quiet_since = time.monotonic()
                out.extend(m.value for m in batch if m.value is not None)
    finally:
        await c.stop()
    return out


async def _wait_lease_log(bus: KafkaBus, topic: str, pred, timeout_s: float) -> list[LeaseLogRecord]:
    """Follow ``leases.log`` until ``pred(records)`` is true; returns all records read."""
    c = bus.consumer([topic], group_id=f"e2e-follow-{uuid.uuid4().hex[:6]}")
    await c.start()
    recs: list[LeaseLogRecord] = []
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for m in await c.getmany(timeout_s=0.5):
                if m.value is not None:
                    recs.append(decode(LeaseLogRecord, m.value))
            if pred(recs):
                return recs
        raise AssertionError(f"lease log never satisfied the condition; read {len(recs)} records")
    finally:
        await c.stop()


async def test_pipeline_over_real_kafka_and_mosquitto(kafka_bootstrap: str, mosquitto: dict, tmp_path: Path) -> None:
    prefix = f"e2e-{uuid.uuid4().hex[:8]}."
    topics = KafkaTopics(prefix=prefix)
    cred_file = tmp_path / "credentials.json"
    cred_file.write_text(json.dumps(mosquitto))
    cfg = DemoConfig(
        duration_s=45.0, nodes=2, gpus_per_node=8, kafka=kafka_bootstrap,
        mqtt=f"{mosquitto['host']}:{mosquitto['port']}", mqtt_credentials=cred_file, mqtt_protocol=5,
        state_dir=tmp_path / "state", topic_prefix=prefix, notice_s=3.0, sites=("edge-a",),
        # sites never release on their own in this test: the reclaim must come from demand
    )
    demo = asyncio.create_task(run_demo(cfg))
    bus = KafkaBus(kafka_bootstrap)
    try:
        # 1. a site holds a lease (granted on the real lease log)
        recs = await _wait_lease_log(bus, topics.leases_log,
                                     lambda rs: any(r.state is LeaseState.GRANTED for r in rs), timeout_s=35)
        lease = next(r for r in recs if r.state is LeaseState.GRANTED)
        assert lease.site == "edge-a" and lease.gpus
        # 2. training wants those GPUs back: a demand on the real pool.demand topic
        producer = bus.producer()
        await producer.start()
        demand = PoolDemand(demand_id=f"e2e-{uuid.uuid4().hex[:6]}", ts=time.time(), gpus=lease.gpus,
                            reason="e2e training job")
        await producer.send(topics.pool_demand, encode(demand), key=demand.demand_id)
        await producer.flush()
        await producer.stop()
        # 3. the lease goes reclaiming with a deadline, then released or revoked by the deadline
        recs = await _wait_lease_log(
            bus, topics.leases_log,
            lambda rs: any(r.lease_id == lease.lease_id and r.state in (LeaseState.RELEASED, LeaseState.REVOKED)
                           for r in rs),
            timeout_s=cfg.notice_s + 10)
        mine = [r for r in recs if r.lease_id == lease.lease_id]
        states = [r.state for r in mine]
        assert LeaseState.RECLAIMING in states, states
        reclaiming = next(r for r in mine if r.state is LeaseState.RECLAIMING)
        assert reclaiming.reclaim_deadline is not None
        assert reclaiming.reclaim_deadline <= reclaiming.ts + cfg.notice_s + 0.5
        end = next(r for r in mine if r.state in (LeaseState.RELEASED, LeaseState.REVOKED))
        assert end.ts <= reclaiming.reclaim_deadline + 2.0, "GPUs came back after the notice"
        assert [r.seq for r in mine] == sorted(r.seq for r in mine)
    finally:
        summary = await demo
        await bus.close()

    # 4. the real topics hold what each stage produced
    gpu_records = [s for v in await _read_all(bus, topics.telemetry_gpu) for s in decode_gpu_samples(v)]
    assert len({g.key for g in gpu_records}) == 16
    caps = [decode(CapacityUpdate, v) for v in await _read_all(bus, topics.capacity)]
    assert any(c.state is GpuState.IDLE for c in caps)
    assert summary.offer_violations == 0
    # 5. the site sees its lease's final state as a retained MQTT message
    mt = MqttTopics(mosquitto.get("root", "gpupool/v1"))
    async with aiomqtt.Client(mosquitto["host"], mosquitto["port"], username="edge-a",
                              password=mosquitto["users"]["edge-a"],
                              identifier=f"e2e-check-{uuid.uuid4().hex[:6]}") as client:
        await client.subscribe(mt.lease("edge-a", lease.lease_id), qos=1)
        msg = await asyncio.wait_for(anext(aiter(client.messages)), 10)
        final = decode(LeaseMessage, bytes(msg.payload))  # type: ignore[arg-type]
        assert final.state in (LeaseState.RELEASED, LeaseState.REVOKED)
