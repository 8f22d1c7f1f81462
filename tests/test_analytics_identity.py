"""One key per GPU whether its samples carry a UUID or not (analytics.identity): a GPU first seen
without a UUID keeps one history when its UUID appears, and later UUID-less samples join it."""

from __future__ import annotations

from pathlib import Path

from analytics.classify import FB_USED, GR_ENGINE_ACTIVE
from analytics.identity import GpuIdentities
from contracts import GpuSample, GpuState
from contracts.bus import MemoryBus
from tests.analytics_support import drain, service
from tests.support import Clock
from tests.test_analytics_service import T0, send, updates


def _s(ts: float, uuid: str | None, activity: float = 0.0, index: int = 0, gi: int | None = None) -> GpuSample:
    return GpuSample(
        ts=ts,
        host="node-1",
        gpu_uuid=uuid,
        gpu_index=index,
        gpu_instance_id=gi,
        fields={GR_ENGINE_ACTIVE: activity, FB_USED: 100},
    )


def test_resolve_stand_in_then_uuid_then_uuid_less_again() -> None:
    ids = GpuIdentities()
    first, renamed = ids.resolve(_s(T0, None))
    assert (first.gpu_uuid, first.key, renamed) == ("gpu0", "node-1/gpu0", None)
    with_uuid, renamed = ids.resolve(_s(T0 + 1, "GPU-a"))
    assert (with_uuid.key, renamed) == ("node-1/GPU-a", "node-1/gpu0")
    assert ids.resolve(_s(T0 + 2, "GPU-a"))[1] is None  # told once
    later, renamed = ids.resolve(_s(T0 + 3, None))
    assert (later.gpu_uuid, later.key, renamed) == ("GPU-a", "node-1/GPU-a", None)
    # another index, another instance: other GPUs
    assert ids.resolve(_s(T0, None, index=1))[0].key == "node-1/gpu1"
    assert ids.resolve(_s(T0, None, gi=3))[0].key == "node-1/gpu0/3"
    # a UUID seen first never renames anything
    assert ids.resolve(_s(T0, "GPU-b", index=2))[1] is None and len(ids) == 2


async def test_history_of_a_gpu_stays_under_one_key_when_its_uuid_appears() -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock, refresh_s=3600.0)
    await svc.start()
    try:
        for i in range(4):  # 0..30 s without a UUID: idle from 0, idle state reached at 30 s
            await send(bus, _s(T0 + 10 * i, None))
            clock.t = T0 + 10 * i
            await drain(svc)
        assert svc.current_states()["node-1/gpu0"].state is GpuState.IDLE
        await send(bus, _s(T0 + 40, "GPU-a"))  # the exporter now sends the UUID
        clock.t = T0 + 40
        await drain(svc)
        states = svc.current_states()
        assert list(states) == ["node-1/GPU-a"]
        now = states["node-1/GPU-a"]
        assert now.state is GpuState.IDLE and now.since == T0  # the idle run started without a UUID
        _, keys = svc.store.sql("SELECT gpu_key, gpu_uuid, count(*) FROM gpu_samples GROUP BY ALL")
        assert keys == [("node-1/GPU-a", "GPU-a", 5)]
        _, state_keys = svc.store.sql("SELECT DISTINCT gpu_key FROM gpu_states")
        assert state_keys == [("node-1/GPU-a",)]
        # the stand-in key published before is retired for the broker
        old = [u for u in updates(bus) if u.key == "node-1/gpu0"]
        assert old[-1].state is GpuState.UNKNOWN and old[-1].reason == "renamed"
        await send(bus, _s(T0 + 50, None, activity=0.9))  # UUID-less again: the same GPU
        clock.t = T0 + 50
        await drain(svc)
        assert list(svc.current_states()) == ["node-1/GPU-a"]
        assert svc.current_states()["node-1/GPU-a"].state is GpuState.BUSY
        _, [(runs,)] = svc.store.sql("SELECT count(*) FROM idle_runs WHERE gpu_key = 'node-1/GPU-a'")
        assert runs == 1
    finally:
        await svc.stop()


async def test_a_uuid_that_appears_after_a_restart_still_moves_the_stored_history(tmp_path: Path) -> None:
    db = str(tmp_path / "a.duckdb")
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock, db=db, refresh_s=3600.0)
    await svc.start()
    try:
        await send(bus, _s(T0, None, index=1, gi=2))
        await drain(svc)
    finally:
        await svc.stop()
    svc = service(bus, clock, db=db, refresh_s=3600.0)
    await svc.start()
    try:
        await send(bus, _s(T0 + 10, "GPU-z", index=1, gi=2))
        clock.t = T0 + 10
        await drain(svc)
        _, keys = svc.store.sql("SELECT DISTINCT gpu_key FROM gpu_samples UNION SELECT DISTINCT gpu_key FROM gpu_states")
        assert keys == [("node-1/GPU-z/2",)]
        assert svc.store.stand_in_gpus() == []
    finally:
        await svc.stop()


def test_remember_stand_in_only_takes_stand_in_ids() -> None:
    ids = GpuIdentities()
    assert ids.remember_stand_in("h", "gpu3", None) and not ids.remember_stand_in("h", "GPU-x", None)
    assert not ids.remember_stand_in("h", "gpux", None)
    assert ids.resolve(_s(T0, "GPU-a", index=3).model_copy(update={"host": "h"}))[1] == "h/gpu3"
