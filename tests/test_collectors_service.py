"""CollectorService on the in-process MemoryBus: records on the topics, keys, sequence numbers,
failure accounting by reason, and a loop that survives its own exceptions."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from collectors.service import CollectorService, CollectStats
from contracts import GpuScrape, IbPortSample, KafkaTopics, decode, decode_gpu_samples
from contracts.bus import MemoryBus
from tests.fake_exporters import FakeExporters

SYSFS_CASES = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "cases" / "sysfs_cases"
TOPICS = KafkaTopics(prefix="t.")




def _metric(svc: CollectorService, name: str, **labels: str) -> float:
    """A sample of ``svc``'s Prometheus registry (0 if absent)."""
    return svc.registry.get_sample_value(name, labels) or 0.0


async def test_collect_once_produces_to_topics_and_counts_failures(exporters: FakeExporters) -> None:
    bus = MemoryBus(default_partitions=4)
    good, bad = exporters.url("/ok/7"), exporters.url("/500")
    targets = [
        good,
        bad,
        exporters.url("/truncated"),
        exporters.url("/garbage"),
        exporters.url("/empty"),
        exporters.url("/cut"),
        exporters.refused,
        exporters.url("/slow"),
    ]
    roots = [
        ("ib-host-1", SYSFS_CASES / "na_no_pma" / "sys"),
        ("ib-host-2", SYSFS_CASES / "no_infiniband_class" / "sys"),
        ("ib-host-3", SYSFS_CASES / "roce_link_layer_ethernet" / "sys"),
    ]
    svc = CollectorService(
        bus=bus,
        topics=TOPICS,
        dcgm_targets=targets,
        sysfs_roots=roots,
        interval_s=1.0,
        timeout_s=0.5,
        concurrency=8,
    )
    await svc.start()
    try:
        stats = await svc.collect_once()
    finally:
        await svc.stop()

    assert stats.targets == 8 and stats.targets_ok == 1
    assert stats.failures == {
        "http_500": 1,
        "truncated": 2,  # cut in transfer (connection closed) and cut by a proxy (no final newline)
        "garbage": 1,
        "empty_body": 1,
        "connect_error": 1,
        "timeout": 1,
    }
    assert (stats.gpu_samples, stats.ib_ports, stats.sysfs_errors) == (4, 3, 0)
    assert stats.produced == 4 and stats.produce_errors == 0  # the page's 4 GPUs in one record, 3 ports
    assert stats.xid_events == 1  # GPU 1 of the template shows XID 45

    [scrape] = [decode(GpuScrape, m.value) for m in bus.records(TOPICS.telemetry_gpu) if m.value]
    assert len(scrape) == 4 and scrape.host == scrape.partition_key == "gpu-node-7"
    gpu = [(m.key, s) for m in bus.records(TOPICS.telemetry_gpu) if m.value for s in decode_gpu_samples(m.value)]
    assert len(gpu) == 4
    assert all(key == s.partition_key == s.host == "gpu-node-7" and s.target == good for key, s in gpu)
    ib = [(m.key, decode(IbPortSample, m.value)) for m in bus.records(TOPICS.telemetry_ib_port) if m.value]
    assert sorted(s.key for _, s in ib) == ["0x0000000000000001/1", "0x0000000000000001/1", "ib-host-1:i40iw0/1"]
    assert all(key == s.partition_key == s.host for key, s in ib)  # Kafka key: the host
    roce = next(s for _, s in ib if s.host == "ib-host-3")
    assert roce.link_layer == "Ethernet" and roce.data_bytes("PortXmitData") == 4000
    seqs = sorted(s.seq for _, s in gpu + ib)  # type: ignore[operator]
    assert seqs == list(range(7)) and svc.seq == 7

    assert _metric(svc, "gpupool_collector_scrape_errors_total", target=bad, reason="http_500") == 1
    assert _metric(svc, "gpupool_collector_scrapes_total", target=good, result="success") == 1
    assert _metric(svc, "gpupool_collector_records_produced_total", topic=TOPICS.telemetry_gpu) == 1
    # TEST_METRIC of the good page, two lines of the garbage page (whose target failed as garbage)
    # and the cut line of the page cut by a proxy (whose target failed as truncated)
    assert stats.rejected == {"unknown_metric": 3, "truncated_line": 1}
    assert _metric(svc, "gpupool_collector_rejected_samples_total", reason="unknown_metric") == 3


async def test_sequence_numbers_keep_growing_across_cycles(exporters: FakeExporters) -> None:
    bus = MemoryBus()
    svc = CollectorService(
        bus=bus,
        topics=TOPICS,
        dcgm_targets=[exporters.url("/ok/1"), exporters.url("/ok/2")],
        sysfs_roots=[("h", SYSFS_CASES / "saturated_pma_counters" / "sys")],
    )
    await svc.start()
    try:
        for _ in range(3):
            await svc.collect_once()
    finally:
        await svc.stop()
    seqs = [s.seq for m in bus.records(TOPICS.telemetry_gpu) if m.value for s in decode_gpu_samples(m.value)]
    seqs += [decode(IbPortSample, m.value).seq for m in bus.records(TOPICS.telemetry_ib_port) if m.value]
    assert sorted(seqs) == list(range(27))  # (2 targets x 4 GPUs + 1 port) x 3 cycles, no gap, no repeat
    assert (
        svc.cycles == 3 and svc.last_stats is not None and svc.last_stats.xid_events == 0
    )  # XID 45 once only


async def test_run_survives_a_failing_cycle_and_stops_on_event(
    exporters: FakeExporters, monkeypatch: pytest.MonkeyPatch
) -> None:
    bus = MemoryBus()
    svc = CollectorService(
        bus=bus, topics=TOPICS, dcgm_targets=[exporters.url("/ok")], sysfs_roots=[], interval_s=0.05
    )
    real = svc.collect_once
    calls = 0

    async def flaky() -> CollectStats:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("boom")
        return await real()

    monkeypatch.setattr(svc, "collect_once", flaky)
    before = _metric(svc, "gpupool_collector_loop_errors_total", reason="RuntimeError")
    stop = asyncio.Event()
    await svc.start()
    task = asyncio.create_task(svc.run(stop))
    try:
        while calls < 4:
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.wait_for(task, 2.0)
    finally:
        await svc.stop()
    assert _metric(svc, "gpupool_collector_loop_errors_total", reason="RuntimeError") == before + 1
    assert len(bus.records(TOPICS.telemetry_gpu)) >= 2  # cycles 1, 3, 4 produced (one record each)


async def test_sysfs_roots_with_an_interval_of_their_own_are_read_apart_from_the_cycles(
    exporters: FakeExporters, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sysfs_interval_s`` other than ``interval_s``: ``collect_once`` leaves the roots out,
    ``read_sysfs_once`` reads them, and ``run`` reads them on their own schedule (a slow read
    delays no GPU scrape); equal to ``interval_s`` (or unset) every cycle reads them."""
    root = [("h", SYSFS_CASES / "saturated_pma_counters" / "sys")]
    bus = MemoryBus()
    svc = CollectorService(bus=bus, topics=TOPICS, dcgm_targets=[exporters.url("/ok/1")], sysfs_roots=root,
                           interval_s=0.05, sysfs_interval_s=0.3)  # fmt: skip
    with pytest.raises(RuntimeError):
        await svc.read_sysfs_once()
    await svc.start()
    try:
        cycle = await svc.collect_once()
        assert (cycle.gpu_samples, cycle.sysfs_roots, cycle.ib_ports) == (4, 0, 0)
        assert not bus.records(TOPICS.telemetry_ib_port)
        read = await svc.read_sysfs_once()
        assert (read.sysfs_roots, read.ib_ports, read.produced, read.gpu_samples) == (1, 1, 1, 0)
        assert len(bus.records(TOPICS.telemetry_ib_port)) == 1

        # run(): a sysfs read that hangs (a stuck file) must not hold the GPU cycles back
        release = asyncio.Event()
        reads = 0
        real_read = svc.read_sysfs_once

        async def slow_read() -> CollectStats:
            nonlocal reads
            reads += 1
            await release.wait()
            return await real_read()

        monkeypatch.setattr(svc, "read_sysfs_once", slow_read)
        stop = asyncio.Event()
        before = svc.cycles
        task = asyncio.create_task(svc.run(stop))
        while svc.cycles < before + 5:
            await asyncio.sleep(0.01)
        assert reads == 1  # started once, still hanging, while five GPU cycles ran
        release.set()

        async def next_read() -> None:
            while reads < 2:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(next_read(), 10.0)  # the sysfs loop goes on after the slow read
        stop.set()
        await asyncio.wait_for(task, 2.0)
    finally:
        await svc.stop()
    assert len(bus.records(TOPICS.telemetry_ib_port)) >= 2

    for every_cycle in (None, 0.05):
        bus = MemoryBus()
        svc = CollectorService(bus=bus, topics=TOPICS, dcgm_targets=[], sysfs_roots=root, interval_s=0.05,
                               sysfs_interval_s=every_cycle)  # fmt: skip
        await svc.start()
        try:
            cycle = await svc.collect_once()
        finally:
            await svc.stop()
        assert (cycle.sysfs_roots, cycle.ib_ports) == (1, 1)
    with pytest.raises(ValueError):
        CollectorService(bus=MemoryBus(), topics=TOPICS, dcgm_targets=[], sysfs_roots=root, sysfs_interval_s=0)


async def test_produce_errors_are_counted_not_raised(exporters: FakeExporters) -> None:
    class RefusingBus(MemoryBus):
        async def append(
            self, topic: str, value: bytes | None, key: str | None, headers: Sequence[tuple[str, bytes]]
        ) -> None:
            raise ConnectionError("broker gone")

    svc = CollectorService(
        bus=RefusingBus(), topics=TOPICS, dcgm_targets=[exporters.url("/ok")], sysfs_roots=[]
    )
    await svc.start()
    try:
        stats = await svc.collect_once()
    finally:
        await svc.stop()
    assert stats.gpu_samples == 4 and stats.produced == 0 and stats.produce_errors == 1  # one scrape record


async def test_collect_before_start_and_bad_settings() -> None:
    svc = CollectorService(bus=MemoryBus(), topics=TOPICS, dcgm_targets=[], sysfs_roots=[])
    with pytest.raises(RuntimeError):
        await svc.collect_once()
    with pytest.raises(ValueError):
        CollectorService(bus=MemoryBus(), topics=TOPICS, dcgm_targets=[], sysfs_roots=[], interval_s=0)
    await svc.stop()  # stopping a service never started is fine


async def test_two_collectors_in_one_process_keep_their_metrics_apart(exporters: FakeExporters) -> None:
    """Each collector counts on its own registry: A's scrapes, failures and records are not in B's
    ``/metrics`` and B's are not in A's; a fabric collector given A's registry shows up in A's only;
    nothing lands on prometheus_client's default registry."""
    from prometheus_client import REGISTRY

    from collectors.fabric_collector import FabricCollector
    from collectors.metrics import FabricCollectorMetrics

    a_bus, b_bus = MemoryBus(), MemoryBus()
    a = CollectorService(bus=a_bus, topics=TOPICS, dcgm_targets=[exporters.url("/ok/1"), exporters.url("/500")],
                         sysfs_roots=[])  # fmt: skip
    b = CollectorService(bus=b_bus, topics=TOPICS, dcgm_targets=[exporters.url("/ok/2")], sysfs_roots=[])
    fabric = FabricCollector(a_bus, TOPICS, metrics=FabricCollectorMetrics(a.registry))
    await a.start()
    await b.start()
    try:
        await a.collect_once()
        await a.collect_once()
        await b.collect_once()
    finally:
        await a.stop()
        await b.stop()
    ok1, bad, ok2 = exporters.url("/ok/1"), exporters.url("/500"), exporters.url("/ok/2")
    assert _metric(a, "gpupool_collector_scrapes_total", target=ok1, result="success") == 2
    assert _metric(a, "gpupool_collector_scrape_errors_total", target=bad, reason="http_500") == 2
    assert _metric(a, "gpupool_collector_records_produced_total", topic=TOPICS.telemetry_gpu) == 2
    assert _metric(b, "gpupool_collector_scrapes_total", target=ok2, result="success") == 1
    assert _metric(b, "gpupool_collector_records_produced_total", topic=TOPICS.telemetry_gpu) == 1
    for svc, other in ((a, ok2), (b, ok1)):
        assert svc.registry.get_sample_value("gpupool_collector_scrapes_total", {"target": other, "result": "success"}) is None
    assert b.registry.get_sample_value("gpupool_collector_scrape_errors_total", {"target": bad, "reason": "http_500"}) is None
    assert fabric.metrics.registry is a.registry
    assert a.registry.get_sample_value("gpupool_collector_fabric_samples_total") == 0
    assert b.registry.get_sample_value("gpupool_collector_fabric_samples_total") is None
    assert not [m.name for m in REGISTRY.collect() if m.name.startswith("gpupool_collector_")]
