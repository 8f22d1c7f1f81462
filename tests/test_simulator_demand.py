"""simulator.demand: a pool demand per idle→busy edge of the trace, and only then."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from contracts import KafkaTopics, PoolDemand, decode
from contracts.bus import MemoryBus
from simulator.demand import TrainingDemand
from simulator.fleet import Fleet
from simulator.trace import Trace
from tests.support import T0, Clock



def _expected_edges(fleet: Fleet, trace: Trace, lo: int, hi: int) -> set[tuple[str, int]]:
    """(gpu key, step) for every idle→busy transition at steps lo+1..hi, straight from the trace."""
    out = set()
    for g in fleet.gpus():
        for s in range(lo + 1, hi + 1):
            before = trace.util(g.pod_idx, (s - 1 + g.offset) % trace.steps)
            now = trace.util(g.pod_idx, (s + g.offset) % trace.steps)
            if before == 0.0 and now > 0.0:
                out.add((g.key, s))
    return out


async def test_one_demand_per_idle_to_busy_edge(trace: Trace) -> None:
    clock = Clock()
    fleet = Fleet(trace, nodes=2, gpus_per_node=8, seed=9, t0=T0, clock=clock)
    bus, topics = MemoryBus(), KafkaTopics(prefix="t.")
    demand = TrainingDemand(fleet, bus, topics, tick_s=1.0)
    producer = bus.producer()
    await producer.start()
    got: set[tuple[str, int]] = set()
    for step in range(0, 301):
        clock.t = fleet.step_start(step) + 0.5
        for d in await demand.poll_once(producer):
            got.add((d.gpus[0], fleet.step_at(d.ts)))
    want = _expected_edges(fleet, trace, 0, 300)
    assert want, "the trace has idle→busy edges in 300 steps"
    assert got == want
    assert demand.emitted == len(want) and demand.failed == 0
    records = bus.records(topics.pool_demand)
    assert len(records) == len(want)
    for m in records:
        d = decode(PoolDemand, m.value or b"")
        assert m.key == d.demand_id and len(d.gpus) == 1 and d.count == 0 and not d.force
    assert len({m.key for m in records}) == len(records)


async def test_first_poll_is_a_baseline_and_a_gap_yields_one_demand_per_gpu(trace: Trace) -> None:
    clock = Clock()
    fleet = Fleet(trace, nodes=2, gpus_per_node=8, seed=9, t0=T0, clock=clock)
    bus = MemoryBus()
    demand = TrainingDemand(fleet, bus, KafkaTopics(), tick_s=1.0)
    producer = bus.producer()
    clock.t = fleet.step_start(20) + 0.1
    assert any(fleet.is_busy_at(k, clock.t) for k in fleet.gpu_keys())
    assert await demand.poll_once(producer) == []
    clock.t = fleet.step_start(80) + 0.1
    sent = await demand.poll_once(producer)
    keys = [d.gpus[0] for d in sent]
    assert len(keys) == len(set(keys))
    assert set(keys) == {k for k, _ in _expected_edges(fleet, trace, 20, 80)}
    assert await demand.poll_once(producer) == []  # same step again: nothing new


async def test_watched_subset_only(trace: Trace) -> None:
    clock = Clock()
    fleet = Fleet(trace, nodes=2, gpus_per_node=8, seed=9, t0=T0, clock=clock)
    watched = fleet.gpu_keys()[:3]
    demand = TrainingDemand(fleet, MemoryBus(), KafkaTopics(), gpus=watched)
    producer = MemoryBus().producer()
    await demand.poll_once(producer)
    clock.t = fleet.step_start(400)
    sent = await demand.poll_once(producer)
    assert {d.gpus[0] for d in sent} <= set(watched)
    with pytest.raises(KeyError):
        TrainingDemand(fleet, MemoryBus(), KafkaTopics(), gpus=["gpu-node-001/GPU-nope"])
    with pytest.raises(ValueError):
        TrainingDemand(fleet, MemoryBus(), KafkaTopics(), tick_s=0)


class _FailingProducer:
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    async def flush(self) -> None: ...

    async def send(self, topic: str, value: bytes | None, key: str | None = None,
                   headers: Sequence[tuple[str, bytes]] = ()) -> None:
        raise ConnectionError("broker unreachable")


async def test_send_errors_are_counted_not_raised(trace: Trace) -> None:
    clock = Clock()
    fleet = Fleet(trace, nodes=2, gpus_per_node=8, seed=9, t0=T0, clock=clock)
    demand = TrainingDemand(fleet, MemoryBus(), KafkaTopics())
    await demand.poll_once(_FailingProducer())
    clock.t = fleet.step_start(300)
    assert await demand.poll_once(_FailingProducer()) == []
    assert demand.failed > 0 and demand.emitted == 0


async def test_run_polls_until_stopped(trace: Trace) -> None:
    clock = Clock()
    fleet = Fleet(trace, nodes=2, gpus_per_node=8, seed=9, t0=T0, clock=clock)
    bus, topics = MemoryBus(), KafkaTopics()
    demand = TrainingDemand(fleet, bus, topics, tick_s=0.01)
    stop = asyncio.Event()

    async def advance() -> None:
        for _ in range(100):
            clock.t += 1.0  # one trace step per wall second at speedup 57
            await asyncio.sleep(0.005)
        stop.set()

    await asyncio.wait_for(asyncio.gather(demand.run(stop), advance()), 10.0)
    assert demand.emitted > 0
    assert len(bus.records(topics.pool_demand)) == demand.emitted
