"""Analytics scale-out by host (in-process bus, 2 partitions): with both telemetry topics keyed by
host, each instance owns whole hosts — their GPUs and their InfiniBand ports — and every capacity
update carries the headroom of all of its host's ports. When a rebalance takes a partition away,
the instance forgets the GPUs *and* the hosts of that partition: their headroom is no longer
reported (though their rows stay in its DuckDB file) until a sample of the host is read again.
"""

from __future__ import annotations

from analytics.classify import FB_USED, GR_ENGINE_ACTIVE, IdleConfig
from analytics.service import AnalyticsService
from contracts import CapacityUpdate, GpuSample, IbPortSample, KafkaTopics, decode, encode
from contracts.bus import MemoryBus, Producer, partition_for
from tests.analytics_support import drain
from tests.support import Clock

T0 = 1_700_000_000.0
TOPICS = KafkaTopics()
RATE = 25_000_000_000  # bytes/s
STEP = 10.0
PARTITIONS = 2
HOSTS = [f"node-{i}" for i in range(8)]
BY_PARTITION = {p: {h for h in HOSTS if partition_for(h, PARTITIONS) == p} for p in range(PARTITIONS)}


class Fleet:
    """Per host: one idle GPU and two HCA ports; port ``mlx5_1`` of ``node-k`` sends at
    ``(k + 1) / 10`` of its rate, ``mlx5_0`` at 1 %, so each host's headroom is ``1 - (k+1)/10``
    and comes from its busier port only."""

    def __init__(self) -> None:
        self.words = {(h, d): 0 for h in HOSTS for d in ("mlx5_0", "mlx5_1")}

    async def send(self, producer: Producer, ts: float) -> None:
        for k, host in enumerate(HOSTS):
            g = GpuSample(
                ts=ts, host=host, gpu_uuid=f"GPU-{host}", model_name="NVIDIA H100 80GB HBM3",
                fields={GR_ENGINE_ACTIVE: 0.0, FB_USED: 100},
            )  # fmt: skip
            await producer.send(TOPICS.telemetry_gpu, encode(g), key=g.partition_key)
            for n, (dev, use) in enumerate((("mlx5_0", 0.01), ("mlx5_1", (k + 1) / 10))):
                self.words[(host, dev)] += int(use * RATE * STEP / 4)
                p = IbPortSample(
                    ts=ts, host=host, device=dev, node_guid=f"0x{2 * k + n + 1:016x}", port=1,
                    rate_bytes_per_second=RATE, counters={"PortXmitData": self.words[(host, dev)]},
                )  # fmt: skip
                await producer.send(TOPICS.telemetry_ib_port, encode(p), key=p.partition_key)


def expected_headroom(hosts: set[str]) -> dict[str, float]:
    return {h: 1 - (HOSTS.index(h) + 1) / 10 for h in hosts}


def approx(got: dict[str, float], want: dict[str, float]) -> bool:
    return got.keys() == want.keys() and all(abs(got[h] - want[h]) < 1e-3 for h in want)


def service(bus: MemoryBus, clock: Clock) -> AnalyticsService:
    return AnalyticsService(
        bus=bus,
        topics=TOPICS,
        db_path=":memory:",
        group_id="g",
        clock=clock,
        idle=IdleConfig(min_idle_s=30.0, stale_after_s=1000.0),
        refresh_s=60.0,
        min_headroom=0.25,
        headroom_refresh_s=5.0,
        headroom_window_s=60.0,
    )


async def test_an_instance_owns_whole_hosts_and_forgets_those_it_gives_away() -> None:
    assert all(BY_PARTITION.values()), "both partitions hold hosts"
    bus, clock, fleet = MemoryBus(default_partitions=PARTITIONS), Clock(T0), Fleet()
    producer = bus.producer()
    a = service(bus, clock)
    await a.start()
    b = service(bus, clock)
    try:
        for i in range(6):
            await fleet.send(producer, T0 + STEP * i)
        clock.t = T0 + STEP * 5
        await drain(a)
        clock.t += 5.0
        await a.step(timeout_s=0.01)  # refresh: every host's headroom from both of its ports
        assert approx(a.headroom(), expected_headroom(set(HOSTS)))

        await b.start()  # rebalance: each owns partition p of both topics
        clock.t += 5.0
        await a.step(timeout_s=0.01)
        mine = {tp.partition for tp in a.partitions()}
        assert len(mine) == 1 and {tp.partition for tp in b.partitions()} == {1 - min(mine)}
        kept = BY_PARTITION[min(mine)]
        # A forgot the other partition's GPUs and hosts (their rows stay in its file) ...
        assert {u.host for u in a.current_states().values()} == kept
        assert approx(a.headroom(), expected_headroom(kept))
        clock.t += 5.0
        await a.step(timeout_s=0.01)  # ... and a later refresh does not bring them back
        assert approx(a.headroom(), expected_headroom(kept))
        count = a.store.sql("SELECT count(DISTINCT host) FROM ib_port_samples")[1][0][0]
        assert count == len(HOSTS)

        # New samples: B learns its hosts whole (both ports), A keeps its own.
        for i in range(6, 12):
            await fleet.send(producer, T0 + STEP * i)
        clock.t = T0 + STEP * 11
        await drain(a)
        await drain(b)
        clock.t += 5.0
        await a.step(timeout_s=0.01)
        await b.step(timeout_s=0.01)
        assert approx(a.headroom(), expected_headroom(kept))
        assert approx(b.headroom(), expected_headroom(set(HOSTS) - kept))
        clock.t += 61.0  # every GPU re-published by its owner, with its host's whole headroom
        await a.step(timeout_s=0.01)
        await b.step(timeout_s=0.01)
        latest: dict[str, CapacityUpdate] = {}
        for m in bus.records(TOPICS.capacity):
            u = decode(CapacityUpdate, m.value or b"")
            latest[u.host] = u
        assert approx({h: u.headroom or 0.0 for h, u in latest.items()}, expected_headroom(set(HOSTS)))
        blocked = {h for h, u in latest.items() if u.reason == "fabric_headroom"}
        assert blocked == {h for h, v in expected_headroom(set(HOSTS)).items() if v < 0.25}

        # B leaves: A gets the hosts back once their samples are read again.
        await b.stop()
        await fleet.send(producer, T0 + STEP * 12)
        await drain(a)  # from its own stored offsets: what B read, then the new sample
        clock.t += 5.0
        await a.step(timeout_s=0.01)
        assert approx(a.headroom(), expected_headroom(set(HOSTS)))
        assert {u.host for u in a.current_states().values()} == set(HOSTS)
    finally:
        await a.stop()
        await b.stop()
