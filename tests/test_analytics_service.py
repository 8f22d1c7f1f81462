"""The analytics stage on the in-process bus: samples in, capacity updates out, bad records
counted and skipped, exactly-once resume from DuckDB's offsets."""

from __future__ import annotations

from pathlib import Path

import pytest

from analytics.service import AnalyticsService
from analytics.classify import FB_USED, GR_ENGINE_ACTIVE
from analytics.store import StoreBatch
from contracts import (
    CapacityUpdate,
    GpuSample,
    GpuState,
    IbPortSample,
    IdleGrade,
    decode,
    encode,
)
from contracts.bus import MemoryBus, TopicPartition
from tests.test_analytics_cases import mig_samples
from tests.analytics_support import IDLE, TOPICS, drain, service
from tests.support import Clock

T0 = 1_700_000_000.0


def sample(ts: float, uuid: str, activity: float, fb: int = 100) -> GpuSample:
    return GpuSample(
        ts=ts,
        host="node-1",
        gpu_uuid=uuid,
        model_name="NVIDIA H100 80GB HBM3",
        fields={GR_ENGINE_ACTIVE: activity, FB_USED: fb},
    )


async def send(bus: MemoryBus, s: GpuSample | IbPortSample, topic: str | None = None) -> None:
    await bus.producer().send(
        topic or (TOPICS.telemetry_gpu if isinstance(s, GpuSample) else TOPICS.telemetry_ib_port),
        encode(s),
        key=s.key,
    )


def updates(bus: MemoryBus) -> list[CapacityUpdate]:
    return [decode(CapacityUpdate, m.value) for m in bus.records(TOPICS.capacity) if m.value is not None]


def metric(svc: AnalyticsService, name: str, **labels: str) -> float:
    """A sample of ``svc``'s Prometheus registry (0 if absent)."""
    return svc.registry.get_sample_value(name, labels) or 0.0


async def test_samples_in_capacity_updates_out() -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock, refresh_s=3600.0)
    await svc.start()
    try:
        for i in range(5):  # 0..40 s: GPU-busy busy throughout, GPU-idle idle from 0
            await send(bus, sample(T0 + 10 * i, "GPU-busy", 0.9))
            await send(bus, sample(T0 + 10 * i, "GPU-idle", 0.0, fb=40_000))
            clock.t = T0 + 10 * i
            await drain(svc)
        await send(
            bus,
            IbPortSample(
                ts=T0,
                host="node-1",
                device="mlx5_0",
                node_guid="0x0000000000000001",
                port=1,
                counters={"PortXmitData": 2**60},
            ),
        )
        await drain(svc)
        ups = updates(bus)
        by_key: dict[str, list[CapacityUpdate]] = {}
        for u in ups:
            by_key.setdefault(u.key, []).append(u)
        assert [u.state for u in by_key["node-1/GPU-busy"]] == [GpuState.BUSY]  # once: no change since
        idle = by_key["node-1/GPU-idle"]
        assert [u.state for u in idle] == [GpuState.UNKNOWN, GpuState.IDLE]  # pending, then idle at 30 s
        last = idle[-1]
        assert last.ts == T0 + 30 and last.since == T0 and last.grade is IdleGrade.MEMORY_HELD
        assert last.predicted_idle_until == pytest.approx(T0 + 30 + IDLE.min_idle_s)  # no history: default
        assert last.confidence == pytest.approx(0.5)
        assert all(m.key == u.key for m, u in zip(bus.records(TOPICS.capacity), ups, strict=True))
        now = svc.current_states()
        assert now["node-1/GPU-idle"].state is GpuState.IDLE and now["node-1/GPU-busy"].state is GpuState.BUSY
        _, [(n_gpu,)] = svc.store.sql("SELECT count(*) FROM gpu_samples")
        _, [(xmit,)] = svc.store.sql("SELECT port_xmit_data FROM ib_port_samples")
        assert n_gpu == 10 and xmit == 2**60 and svc.rows_ingested() == 11
        assert svc.gpus_seen_idle() == 1
        _, states = svc.store.sql("SELECT state, count(*) FROM gpu_state_now GROUP BY ALL ORDER BY 1")
        assert states == [("busy", 1), ("idle", 1)]
        assert (
            metric(
                svc,
                "gpupool_analytics_idle_gpus",
                pool="default",
                model="NVIDIA H100 80GB HBM3",
                grade="memory_held",
            )
            == 1.0
        )
        # Busy again: published at once, and the ended run feeds the prediction history.
        await send(bus, sample(T0 + 50, "GPU-idle", 0.5))
        clock.t = T0 + 50
        await drain(svc)
        assert updates(bus)[-1].state is GpuState.BUSY
        _, [(runs,)] = svc.store.sql("SELECT count(*) FROM idle_runs WHERE NOT censored")
        assert runs == 1
    finally:
        await svc.stop()


async def test_garbage_records_are_counted_and_skipped() -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock)
    await svc.start()
    before = {
        r: metric(svc, "gpupool_analytics_rejected_records_total", reason=r)
        for r in ("malformed_json", "invalid_record", "unsupported_version", "tombstone", "bad_timestamp")
    }
    consumed = metric(svc, "gpupool_analytics_records_consumed_total", topic=TOPICS.telemetry_gpu)
    try:
        p = bus.producer()
        await p.send(TOPICS.telemetry_gpu, b"\x00not json", key="x")
        await p.send(TOPICS.telemetry_gpu, b'{"ts": 1, "host": "h"}', key="x")  # gpu_uuid missing
        await p.send(
            TOPICS.telemetry_gpu,
            sample(T0, "GPU-a", 0.9).model_copy(update={"schema_version": 99}).model_dump_json().encode(),
            key="x",
        )
        await p.send(TOPICS.telemetry_gpu, None, key="x")
        await p.send(TOPICS.telemetry_gpu, b'{"ts": NaN, "host": "h", "gpu_uuid": "u"}', key="x")
        await send(bus, sample(T0, "GPU-a", 0.9))
        assert await drain(svc) == 6
        for reason, was in before.items():
            assert metric(svc, "gpupool_analytics_rejected_records_total", reason=reason) == was + 1, reason
        assert metric(svc, "gpupool_analytics_records_consumed_total", topic=TOPICS.telemetry_gpu) == consumed + 6
        assert [u.key for u in updates(bus)] == ["node-1/GPU-a"]
        assert (
            svc.store.stored_offsets()[TopicPartition(TOPICS.telemetry_gpu, 0)] == 6
        )  # past the garbage too
    finally:
        await svc.stop()


async def test_restart_resumes_from_duckdb_offsets_without_duplicates(tmp_path: Path) -> None:
    db = str(tmp_path / "analytics.duckdb")
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock, db=db, group_id="g1")
    await svc.start()
    for i in range(3):
        await send(bus, sample(T0 + i, "GPU-a", 0.9))
    await drain(svc)
    await svc.stop()
    for i in range(3, 5):
        await send(bus, sample(T0 + i, "GPU-a", 0.9))
    # A new group has no committed offset at all: only DuckDB's offsets prevent re-reading.
    svc2 = service(bus, clock, db=db, group_id="another-group")
    await svc2.start()
    try:
        assert await drain(svc2) == 2
        _, [(n, distinct)] = svc2.store.sql("SELECT count(*), count(DISTINCT kafka_offset) FROM gpu_samples")
        assert n == distinct == 5
    finally:
        await svc2.stop()


async def test_failed_write_stores_and_publishes_nothing_then_recovers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock)
    await svc.start()
    try:
        for i in range(3):
            await send(bus, sample(T0 + i, "GPU-a", 0.9))
        real_write = svc.store.write
        calls = {"n": 0}

        def failing_write(batch: StoreBatch) -> dict[str, int]:
            calls["n"] += 1
            if calls["n"] == 1:
                raise OSError("disk full")
            return real_write(batch)

        monkeypatch.setattr(svc.store, "write", failing_write)
        failures = metric(svc, "gpupool_analytics_ingest_failures_total")
        assert await svc.step(timeout_s=0.01) == 3
        assert metric(svc, "gpupool_analytics_ingest_failures_total") == failures + 1
        assert updates(bus) == [] and svc.store.stored_offsets() == {}
        assert await drain(svc) == 3  # read again from the stored offsets
        _, [(n,)] = svc.store.sql("SELECT count(*) FROM gpu_samples")
        assert n == 3 and [u.state for u in updates(bus)] == [GpuState.BUSY]
    finally:
        await svc.stop()


async def test_stale_gpus_go_unknown_and_updates_are_refreshed() -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock, refresh_s=5.0, publish_interval_s=1.0)
    await svc.start()
    try:
        await send(bus, sample(T0, "GPU-a", 0.9))
        await drain(svc)
        assert len(updates(bus)) == 1
        clock.t = T0 + 6  # refresh due, nothing changed
        await svc.step(timeout_s=0.01)
        assert [u.state for u in updates(bus)] == [GpuState.BUSY, GpuState.BUSY]
        clock.t = T0 + 26  # not seen for more than stale_after_s (25 s)
        await svc.step(timeout_s=0.01)
        last = updates(bus)[-1]
        assert last.state is GpuState.UNKNOWN and last.reason == "stale" and last.since == T0 + 25
    finally:
        await svc.stop()


async def test_gpu05_mig_instances_through_the_service() -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock)
    await svc.start()
    try:
        for t in (0.0, 15.0, 30.0):
            for s in mig_samples("GPU-05", ts=T0 + t).values():
                await send(bus, s)
            clock.t = T0 + t
            await drain(svc)
        states = {k.rsplit("/", 1)[1]: u.state for k, u in svc.current_states().items()}
        assert states == {"13": GpuState.BUSY, "5": GpuState.BUSY, "14": GpuState.IDLE, "1": GpuState.IDLE}
        _, rows = svc.store.sql(
            "SELECT gpu_instance_id, gpu_util, fb_used_mib FROM gpu_samples WHERE gpu_instance_id = 13"
        )
        assert rows[0] == (13, None, None)  # absent, stored as NULL, never 0
    finally:
        await svc.stop()


async def test_step_before_start_raises() -> None:
    svc = service(MemoryBus(), Clock(T0))
    with pytest.raises(RuntimeError):
        await svc.step()
    with pytest.raises(ValueError):
        service(MemoryBus(), Clock(T0), refresh_s=0.0)


FORGET_S = 100.0


def _a100(ts: float, uuid: str) -> GpuSample:
    return GpuSample(ts=ts, host="node-2", gpu_uuid=uuid, model_name="NVIDIA A100-SXM4-80GB",
                     fields={GR_ENGINE_ACTIVE: 0.0, FB_USED: 10})  # fmt: skip


@pytest.mark.parametrize("gone_for", [FORGET_S - 0.5, FORGET_S])
async def test_a_gpu_gone_for_forget_after_s_is_forgotten_with_its_series(gone_for: float) -> None:
    """A GPU not sampled for ``forget_after_s`` (by the clock, from its latest sample) is dropped:
    no longer in the states, no more (refresh) updates, and its model's idle-GPU series are gone
    once it was the model's last GPU. Just under that it is still there, stale (unknown)."""
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock, refresh_s=10.0, forget_after_s=FORGET_S)
    gone, model = "node-2/GPU-gone", "NVIDIA A100-SXM4-80GB"
    idle_series = {"pool": "default", "model": model, "grade": "free"}
    await svc.start()
    try:
        for t in range(0, 50, 10):  # both idle from T0; the A100 is last sampled at T0 + 40
            await send(bus, sample(T0 + t, "GPU-stay", 0.0))
            await send(bus, _a100(T0 + t, "GPU-gone"))
            clock.t = T0 + t
            await drain(svc)
        assert svc.current_states()[gone].state is GpuState.IDLE
        assert metric(svc, "gpupool_analytics_idle_gpus", **idle_series) == 1
        t = 40.0
        while t + 10 < 40 + gone_for:
            t += 10
            await send(bus, sample(T0 + t, "GPU-stay", 0.0))
            clock.t = T0 + t
            await drain(svc)
        clock.t = T0 + 40 + gone_for
        await drain(svc)
        states = svc.current_states()
        if gone_for < FORGET_S:
            assert states[gone].state is GpuState.UNKNOWN and states[gone].reason == "stale"
            assert svc.registry.get_sample_value("gpupool_analytics_idle_gpus", idle_series) == 0.0
            assert metric(svc, "gpupool_analytics_gpus", state="unknown") == 1
            return
        assert gone not in states and "node-1/GPU-stay" in states
        assert svc.registry.get_sample_value("gpupool_analytics_idle_gpus", idle_series) is None
        assert svc.registry.get_sample_value("gpupool_analytics_idle_gpu_memory_bytes", idle_series) is None
        assert metric(svc, "gpupool_analytics_gpus", state="unknown") == 0
        sent = len([u for u in updates(bus) if u.key == gone])
        for _ in range(5):  # five refresh periods later: not one more update of the forgotten GPU
            clock.t += 10
            await send(bus, sample(clock.t, "GPU-stay", 0.0))
            await drain(svc)
        assert "node-1/GPU-stay" in svc.current_states()
        assert len([u for u in updates(bus) if u.key == gone]) == sent
        await send(bus, _a100(clock.t, "GPU-gone"))  # back: a new GPU, unknown until idle long enough
        await drain(svc)
        assert svc.current_states()[gone].state is GpuState.UNKNOWN
        assert svc.registry.get_sample_value("gpupool_analytics_idle_gpus", idle_series) == 0.0
    finally:
        await svc.stop()


def test_forget_after_s_must_be_above_stale_after_s() -> None:
    with pytest.raises(ValueError, match="forget_after_s"):
        service(MemoryBus(), Clock(T0), forget_after_s=IDLE.stale_after_s)
