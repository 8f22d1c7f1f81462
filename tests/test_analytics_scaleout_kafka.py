"""Scale-out over real Kafka: two analytics instances in one consumer group split the 4-partition
telemetry topics, each with its own DuckDB file, and together publish the same final capacity
state for every GPU as one instance does on the same input — node headroom included: both topics
are keyed by host (``partition_key``) and co-partitioned, so each instance holds every GPU and
every InfiniBand port of its hosts. One port (``BUSY_PORT``, of a host with idle GPUs) runs near
line rate, so that host's idle GPUs are held back (``fabric_headroom``); were ports keyed by their
identity (``node_guid/port``, the former key) that port would be read by the other instance, and
the pair would offer GPUs the single instance holds back.

The input is written twice, byte for byte, under two topic prefixes (4 partitions each, so every
key lands on the same partition number): one for the pair, one for the single instance. The
services run in this process, each with its own :class:`KafkaBus` and consumer. Their clock stands
at the start of the data while they ingest, so no decision depends on wall time (no stale tick, no
refresh). The last update published per GPU then reports the same state, ``since`` and grade from
the pair as from the single instance (its ``ts`` and ``reason`` are those of the newest sample of
the batch that changed the state, which depends on batching). The clock then moves 20 s past the last sample: the
periodic refresh re-publishes every GPU as of its newest sample, and those updates are equal in
every field, predictions and headroom included (the headroom refresh runs at that step too).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import duckdb

from analytics.classify import FB_USED, GPU_UTIL, GR_ENGINE_ACTIVE, SM_ACTIVE, IdleConfig
from analytics.service import AnalyticsService
from contracts import CapacityUpdate, GpuSample, IbPortSample, KafkaTopics, decode, encode
from contracts.bus import TopicPartition, partition_for
from runtime.kafka import KafkaBus
from tests.services import create_stage_topics
from tests.support import Clock

T0 = 1_700_000_000.0
PARTITIONS = 4
STEPS = 40  # samples per GPU and port, 10 s apart
IDLE = IdleConfig(min_idle_s=30.0, stale_after_s=25.0)
RATE = 50_000_000_000  # bytes/s
BUSY_PORT = 3  # node-1's mlx5_1: sends at 90 % of its rate (node-1 has idle GPUs)
SWITCH_GUID = "0x00000000000000f0"  # a switch port read from the fabric: keyed by the switch


def _activity(pattern: str, i: int, rng: random.Random) -> float | None:
    """Activity ratio of sample ``i`` of a GPU with ``pattern`` (``None``: a DCGM sentinel)."""
    match pattern:
        case "busy":
            return 0.3 + 0.6 * rng.random()
        case "idle":
            return 0.01 * rng.random()
        case "becomes_idle":
            return 0.8 if i < 15 else 0.0
        case "wakes_up":  # one idle run that ends: per-GPU history, too little for the pool
            return 0.0 if i < 20 else 0.9
        case "flaps":
            return 0.0 if (i // 3) % 2 == 0 else 0.07  # between the thresholds: hysteresis
        case _:  # "sentinel": busy, then a DCGM blank: unknown
            return 0.5 if i < 30 else None


def _inputs() -> tuple[list[GpuSample], list[IbPortSample]]:
    rng = random.Random(11)
    patterns = ["busy", "idle", "becomes_idle", "flaps", "sentinel"] * 9 + ["wakes_up"] * 2
    gpus: list[GpuSample] = []
    for i in range(STEPS):
        for g, pattern in enumerate(patterns):
            act = _activity(pattern, i, rng)
            fields: dict[str, float | int] = {
                FB_USED: 30_000 if g % 4 == 0 else 200,
                GPU_UTIL: rng.randrange(5),
            }
            invalid = {}
            if act is None:
                invalid[GR_ENGINE_ACTIVE] = "sentinel"
            else:
                fields[GR_ENGINE_ACTIVE] = act
                fields[SM_ACTIVE] = act / 2
            gpus.append(
                GpuSample(
                    ts=T0 + 10 * i,
                    host=f"node-{g // 8}",
                    gpu_uuid=f"GPU-{g // 2 if g < 16 else g:04d}-scale",
                    gpu_instance_id=g % 2 if g < 16 else None,  # MIG instances are GPUs of their own
                    model_name="NVIDIA H100 80GB HBM3" if g % 3 else "NVIDIA A100-SXM4-80GB",
                    fields=fields,
                    invalid=invalid,
                    seq=i,
                )
            )
    ports: list[IbPortSample] = []
    xmit = [rng.randrange(2**60) for _ in range(17)]
    for i in range(STEPS):
        for p in range(17):
            busy = p == BUSY_PORT
            xmit[p] += int(0.9 * RATE * 10 / 4) if busy else rng.randrange(10**10)
            switch = p == 16
            ports.append(
                IbPortSample(
                    ts=T0 + 10 * i,
                    host="ib-leaf-1" if switch else f"node-{p // 2}",
                    device="ib-leaf-1" if switch else f"mlx5_{p % 2}",
                    node_guid=SWITCH_GUID if switch else f"0x{p + 1:016x}",
                    port=7 if switch else 1,
                    rate_bytes_per_second=RATE,
                    counters={"PortXmitData": xmit[p], "PortXmitWait": i * p},
                    counter_bits={"PortXmitData": 64, "PortXmitWait": 32},
                    source="perfquery" if switch else "sysfs",
                    seq=i,
                )
            )
    return gpus, ports


async def _produce(
    bus: KafkaBus, topics: KafkaTopics, gpus: list[GpuSample], ports: list[IbPortSample]
) -> None:
    producer = bus.producer("scaleout-producer")
    await producer.start()
    try:
        for s in gpus:
            await producer.send(topics.telemetry_gpu, encode(s), key=s.partition_key)
        for p in ports:
            await producer.send(topics.telemetry_ib_port, encode(p), key=p.partition_key)
        await producer.flush()
    finally:
        await producer.stop()


async def _read_all(bootstrap: str, topic: str) -> list[CapacityUpdate]:
    """Every record of ``topic``, in partition order (a new group, from the earliest)."""
    bus = KafkaBus(bootstrap)
    consumer = bus.consumer([topic], f"reader-{uuid.uuid4().hex}")
    await consumer.start()
    try:
        ends = await consumer.end_offsets()
        assert len(ends) == PARTITIONS
        got: dict[TopicPartition, list[CapacityUpdate]] = {tp: [] for tp in ends}
        deadline = time.monotonic() + 30
        while sum(map(len, got.values())) < sum(ends.values()):
            assert time.monotonic() < deadline, "capacity topic not read in 30 s"
            for m in await consumer.getmany(timeout_s=0.5, max_records=5000):
                assert m.value is not None
                got[TopicPartition(m.topic, m.partition)].append(decode(CapacityUpdate, m.value))
        return [u for tp in sorted(got) for u in got[tp]]
    finally:
        await consumer.stop()
        await bus.close()


def _decision(u: CapacityUpdate) -> tuple[object, ...]:
    """What the stage decided about a GPU: without the publication time, the prediction made at
    that time, and the reason (a change of reason alone is not published, so the last published
    reason depends on batching)."""
    return (u.host, u.model_name, u.state, u.since, u.grade, u.fb_total_mib, u.pool)


def _final(updates: list[CapacityUpdate]) -> dict[str, CapacityUpdate]:
    """The last update per GPU key (one key is on one partition, in order)."""
    return {u.key: u for u in updates}


class _Ends:
    """Counts records per topic through one consumer's end offsets."""

    def __init__(self, bootstrap: str, topics: list[str]) -> None:
        self._bus = KafkaBus(bootstrap)
        self._consumer = self._bus.consumer(topics, f"ends-{uuid.uuid4().hex}")

    async def start(self) -> None:
        await self._consumer.start()

    async def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for tp, end in (await self._consumer.end_offsets()).items():
            out[tp.topic] = out.get(tp.topic, 0) + end
        return out

    async def settled(self, quiet_s: float = 1.0) -> None:
        """Return once the counts have not changed for ``quiet_s`` seconds."""
        last = await self.counts()
        while True:
            await asyncio.sleep(quiet_s)
            now = await self.counts()
            if now == last:
                return
            last = now

    async def stop(self) -> None:
        await self._consumer.stop()
        await self._bus.close()


class _Running:
    """One service with its own bus, run in a task until :meth:`stop`."""

    def __init__(
        self, bootstrap: str, topics: KafkaTopics, group: str, db: Path, name: str, clock: Clock
    ) -> None:
        self.bus = KafkaBus(bootstrap, client_id=name)
        self.service = AnalyticsService(
            bus=self.bus,
            topics=topics,
            db_path=str(db),
            idle=IDLE,
            group_id=group,
            client_id=name,
            clock=clock,
            refresh_s=300.0,
            max_records=500,
        )
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.service.start()
        self._task = asyncio.create_task(self.service.run(self._stop))

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        await self.service.stop()
        await self.bus.close()


async def _until(what: str, check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_two_instances_split_the_partitions_and_publish_what_one_does(
    kafka_bootstrap: str, kafka_bus: KafkaBus, tmp_path: Path
) -> None:
    run = uuid.uuid4().hex
    pair_topics, one_topics = KafkaTopics(f"t{run}.pair."), KafkaTopics(f"t{run}.one.")
    for t in (pair_topics, one_topics):
        await create_stage_topics(kafka_bootstrap, t, PARTITIONS)
    gpus, ports = _inputs()

    clock = Clock(T0)
    a = _Running(kafka_bootstrap, pair_topics, f"pair-{run}", tmp_path / "a.duckdb", "analytics-a", clock)
    b = _Running(kafka_bootstrap, pair_topics, f"pair-{run}", tmp_path / "b.duckdb", "analytics-b", clock)
    one = _Running(kafka_bootstrap, one_topics, f"one-{run}", tmp_path / "one.duckdb", "analytics-one", clock)
    ends = _Ends(kafka_bootstrap, [pair_topics.capacity, one_topics.capacity])
    every_tp = {TopicPartition(t, p) for t in (pair_topics.telemetry_gpu, pair_topics.telemetry_ib_port)
                for p in range(PARTITIONS)}  # fmt: skip
    try:
        for r in (a, b, one):
            await r.start()
        # The group settles: the pair owns disjoint halves of all 8 telemetry partitions.
        await _until(
            "the group to split the partitions",
            lambda: (
                a.service.partitions() | b.service.partitions() == every_tp
                and not a.service.partitions() & b.service.partitions()
            ),
        )
        owned = {name: r.service.partitions() for name, r in (("a", a), ("b", b))}
        assert all(any(tp.topic == pair_topics.telemetry_gpu for tp in tps) for tps in owned.values())
        # Co-partitioned: each owns partition p of both topics.
        for tps in owned.values():
            assert {tp.partition for tp in tps if tp.topic == pair_topics.telemetry_gpu} == {
                tp.partition for tp in tps if tp.topic == pair_topics.telemetry_ib_port
            }
        # The test can tell: keyed by identity, the busy port would go to the other instance.
        busy = next(p for p in ports if p.node_guid == f"0x{BUSY_PORT + 1:016x}")
        owner = {tp.partition: name for name, tps in owned.items() for tp in tps}
        assert owner[partition_for(busy.key, PARTITIONS)] != owner[partition_for(busy.host, PARTITIONS)]

        await asyncio.gather(
            _produce(kafka_bus, pair_topics, gpus, ports), _produce(kafka_bus, one_topics, gpus, ports)
        )

        def stored(runs: tuple[_Running, ...], topics: KafkaTopics) -> dict[str, int]:
            out = {topics.telemetry_gpu: 0, topics.telemetry_ib_port: 0}
            for r in runs:
                for tp, n in r.service.stored_offsets().items():
                    out[tp.topic] += n
            return out

        def done() -> bool:
            pair_ok = stored((a, b), pair_topics) == {
                pair_topics.telemetry_gpu: len(gpus),
                pair_topics.telemetry_ib_port: len(ports),
            }
            one_ok = stored((one,), one_topics) == {
                one_topics.telemetry_gpu: len(gpus),
                one_topics.telemetry_ib_port: len(ports),
            }
            return pair_ok and one_ok

        await _until("every record stored", done)
        assert {name: r.service.partitions() for name, r in (("a", a), ("b", b))} == owned  # no rebalance
        await ends.start()
        await ends.settled()  # the step that stored the last records publishes right after

        pair = _final(await _read_all(kafka_bootstrap, pair_topics.capacity))
        single = _final(await _read_all(kafka_bootstrap, one_topics.capacity))
        assert len(single) == len({s.key for s in gpus}) == 47  # 16 MIG instances, 31 whole GPUs
        assert {k: _decision(u) for k, u in pair.items()} == {k: _decision(u) for k, u in single.items()}
        states = {u.state.value for u in single.values()}
        grades = {u.grade.value for u in single.values() if u.grade}
        assert states == {"busy", "idle", "unknown"} and grades == {"free", "memory_held"}

        # Refresh: every GPU re-published as of its newest sample, by its owner only.
        before = await ends.counts()
        clock.t = T0 + 10 * (STEPS - 1) + 20
        expected = {t: n + 47 for t, n in before.items()}
        deadline = time.monotonic() + 30
        while await ends.counts() != expected:
            assert time.monotonic() < deadline, f"refresh: {await ends.counts()} != {expected}"
            await asyncio.sleep(0.1)
        await ends.settled()
        assert await ends.counts() == expected  # each GPU once, by its owner only
    finally:
        for r in (a, b, one):
            await r.stop()
        await ends.stop()

    pair_all = await _read_all(kafka_bootstrap, pair_topics.capacity)
    single_all = await _read_all(kafka_bootstrap, one_topics.capacity)
    # Every field, headroom included: each instance saw every port of its hosts.
    final = _final(single_all)
    assert _final(pair_all) == final
    assert {u.ts for u in final.values()} == {T0 + 10 * (STEPS - 1)}
    # Headroom is known on every GPU (all its hosts have ports) and node-1's busy port holds back
    # exactly its idle GPUs.
    assert all(u.headroom is not None for u in final.values())
    assert {u.host for u in final.values() if u.headroom is not None and u.headroom < 0.2} == {"node-1"}
    held = {k for k, u in final.items() if u.reason == "fabric_headroom"}
    assert held and {final[k].host for k in held} == {"node-1"}
    assert all(final[k].state.value == "unknown" for k in held)

    # Each file holds only its own partitions, and together every sample exactly once.
    rows: dict[str, set[tuple[str, int]]] = {}
    headroom: dict[str, set[tuple[object, ...]]] = {}
    for name in ("a", "b", "one"):
        con = duckdb.connect(str(tmp_path / f"{name}.duckdb"), read_only=True)
        try:
            got = con.execute("SELECT gpu_key, seq, kafka_partition FROM gpu_samples").fetchall()
            headroom[name] = set(
                con.execute(
                    "SELECT port_key, intervals, utilisation_p95, xmit_wait_ticks FROM fabric_headroom"
                ).fetchall()
            )
        finally:
            con.close()
        rows[name] = {(k, s) for k, s, _ in got}
        assert len(rows[name]) == len(got)
        if name != "one":
            parts = {p for _, _, p in got}
            assert parts == {tp.partition for tp in owned[name] if tp.topic == pair_topics.telemetry_gpu}
    assert rows["a"].isdisjoint(rows["b"]) and rows["a"] | rows["b"] == rows["one"]
    assert len(rows["one"]) == len(gpus)
    assert headroom["a"].isdisjoint(headroom["b"]) and headroom["a"] | headroom["b"] == headroom["one"]
    assert len(headroom["one"]) == 17  # 16 HCA ports and the switch port
