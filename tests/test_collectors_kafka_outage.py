"""Issue 3, delivery without loss: the real Kafka broker is stopped for 30 s while the collector
runs with its spool (memory, then disk), then started again; every record is accounted for by
its sequence number: none lost, none twice, each key's records in order.

Integration test (real Kafka from deploy/local); about 45 s, most of it the required outage.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path


from collectors.service import CollectorService
from collectors.spool import REDELIVERY_HEADER, SpoolingProducer
from contracts import GpuSample, IbPortSample, decode, decode_gpu_samples
from contracts.bus import BusMessage
from contracts.topics import KafkaTopics
from runtime.kafka import KafkaBus
from tests.services import create_stage_topics, run_service
from tests.fake_exporters import FakeExporters

SYSFS_CASES = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "cases" / "sysfs_cases"
OUTAGE_S = 30.0


def _metric(svc: CollectorService, name: str, **labels: str) -> float:
    """A sample of ``svc``'s Prometheus registry (0 if absent)."""
    return svc.registry.get_sample_value(name, labels) or 0.0


async def _read_all(
    bus: KafkaBus, topics: list[str], count: int, timeout_s: float = 60.0
) -> list[BusMessage]:
    """Every record of ``topics``: at least ``count``, then whatever else arrives in 2 s."""
    consumer = bus.consumer(topics, f"g-{uuid.uuid4().hex}")
    await consumer.start()
    out: list[BusMessage] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < count and time.monotonic() < deadline:
            out.extend(await consumer.getmany(timeout_s=0.5, max_records=5000))
        out.extend(await consumer.getmany(timeout_s=2.0, max_records=5000))  # a duplicate would show here
    finally:
        await consumer.stop()
    return out


async def test_kafka_down_30s_nothing_lost_nothing_twice_in_order(
    kafka_bootstrap: str, kafka_bus: KafkaBus, kafka_topics: KafkaTopics, tmp_path: Path
) -> None:
    topics = [kafka_topics.telemetry_gpu, kafka_topics.telemetry_ib_port]
    await create_stage_topics(kafka_bootstrap, kafka_topics, partitions=4)
    exporters = FakeExporters()
    await exporters.start()
    svc = CollectorService(
        bus=kafka_bus,
        topics=kafka_topics,
        dcgm_targets=[exporters.url("/ok/1"), exporters.url("/ok/2")],  # 4 GPUs each
        sysfs_roots=[("ib-host", SYSFS_CASES / "saturated_pma_counters" / "sys")],  # 1 port
        interval_s=0.1,
        timeout_s=1.0,
        spool_dir=tmp_path / "spool",
        spool_memory_records=100,  # a 30 s outage (3 records a cycle) overflows memory: the disk tier is used too
    )
    disk_before = _metric(svc, "gpupool_collector_spool_spooled_total", tier="disk")
    redelivered_before = _metric(svc, "gpupool_collector_spool_redelivered_total")
    dropped_before = sum(
        _metric(svc, "gpupool_collector_spool_dropped_total", reason=r)
        for r in ("full", "too_large", "disk_error", "rejected", "corrupt", "shutdown")
    )
    stop = asyncio.Event()
    await svc.start()
    spool = svc._producer
    assert isinstance(spool, SpoolingProducer)
    run = asyncio.create_task(svc.run(stop))
    restarted = False
    try:
        await asyncio.sleep(3.0)
        assert spool.delivered > 0  # Kafka takes records before the outage
        done = await asyncio.to_thread(run_service, "kafka.sh", "stop")
        assert done.returncode == 0, done.stderr
        down_at = time.monotonic()
        seq_at_stop = svc.seq
        await asyncio.sleep(OUTAGE_S)
        assert svc.seq - seq_at_stop > 1000  # the collector kept collecting all along
        tiers = spool.queued_by_tier
        assert tiers["memory"] == 100 and tiers["disk"] > 0, tiers
        assert _metric(svc, "gpupool_collector_spool_bus_up") == 0
        done = await asyncio.to_thread(run_service, "kafka.sh", "start")
        restarted = done.returncode == 0
        assert restarted, done.stderr
        assert done.stdout.strip().splitlines()[-1] == kafka_bootstrap  # same address again
        assert time.monotonic() - down_at >= OUTAGE_S
        await asyncio.wait_for(spool.flush(), 90)  # the backlog drains once Kafka is back (a liveness bound, not a speed target)
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        await asyncio.wait_for(run, 10)
        await svc.stop()
        await exporters.stop()
        if not restarted:
            run_service("kafka.sh", "start")  # leave the session's broker running for the next tests

    total = svc.seq  # samples and ports numbered; a GPU scrape record holds several samples
    assert spool.queued == 0 and spool.delivered + spool.dropped == spool.accepted
    got = await _read_all(kafka_bus, topics, spool.accepted)
    # The spool's contract for a flush of unknown outcome (Kafka answering LeaderNotAvailable
    # while it comes back, say): the unit is sent again with the redelivery header, and a
    # consumer drops a flagged record it already holds. Read as such a consumer: an unflagged
    # record seen twice, or a flagged one not counted by the spool, is a failure.
    seqs: list[int] = []
    flagged = 0
    by_partition: dict[tuple[str, int], list[tuple[int, str, int]]] = defaultdict(list)
    for m in sorted(got, key=lambda m: REDELIVERY_HEADER in dict(m.headers)):
        assert m.value is not None and m.key is not None
        recs: list[GpuSample | IbPortSample] = (
            list(decode_gpu_samples(m.value))
            if m.topic == kafka_topics.telemetry_gpu
            else [decode(IbPortSample, m.value)]
        )
        assert all(rec.partition_key == m.key == rec.host for rec in recs)
        if REDELIVERY_HEADER in dict(m.headers):
            flagged += 1
            if recs[0].seq in seqs:
                continue  # a flagged redelivery the consumer already holds
        for rec in recs:
            seqs.append(rec.seq)
            by_partition[(m.topic, m.partition)].append((m.offset, m.key, rec.seq))
    assert flagged == _metric(svc, "gpupool_collector_spool_redelivered_total") - redelivered_before
    lost = sorted(set(range(total)) - set(seqs))
    duplicated = sorted(s for s, n in Counter(seqs).items() if n > 1)
    assert (len(lost), len(duplicated)) == (0, 0), f"lost {lost[:20]}, duplicated {duplicated[:20]}"
    assert len(seqs) == total
    for records in by_partition.values():  # per key, sequence numbers grow in offset order
        last: dict[str, int] = {}
        for _, key, seq in sorted(records):
            assert seq > last.get(key, -1), f"{key}: {seq} after {last[key]}"
            last[key] = seq
    assert _metric(svc, "gpupool_collector_spool_spooled_total", tier="disk") > disk_before
    dropped_after = sum(
        _metric(svc, "gpupool_collector_spool_dropped_total", reason=r)
        for r in ("full", "too_large", "disk_error", "rejected", "corrupt", "shutdown")
    )
    assert dropped_after == dropped_before
    assert list((tmp_path / "spool").glob("*.seg")) == []
