"""Fabric headroom in capacity updates (analytics on the in-process bus): every update carries its
node's headroom from ``node_headroom_over``; a node below ``min_headroom`` is not offerable (its
idle GPUs go out ``unknown`` / ``fabric_headroom``) until it recovers; unknown headroom never
blocks; one query per refresh, never per GPU."""

from __future__ import annotations

from typing import Any

import pytest

from analytics.classify import FB_USED, GR_ENGINE_ACTIVE
from analytics.service import AnalyticsService
from contracts import GpuSample, GpuState, IbPortSample, encode
from contracts.bus import MemoryBus
from tests.analytics_support import TOPICS, drain, latest, service
from tests.support import Clock

T0 = 1_700_000_000.0
RATE = 25_000_000_000  # 200 Gb/s, bytes/s
STEP = 10.0


def gpu(ts: float, host: str) -> GpuSample:
    return GpuSample(
        ts=ts,
        host=host,
        gpu_uuid=f"GPU-{host}",
        model_name="NVIDIA H100 80GB HBM3",
        fields={GR_ENGINE_ACTIVE: 0.0, FB_USED: 100},
    )


class Port:
    """One HCA port whose counters advance by ``xmit`` / ``rcv`` of its link rate per read."""

    def __init__(self, host: str, device: str) -> None:
        self.host, self.device = host, device
        self.xmit = self.rcv = 1_000_000

    def read(self, ts: float, xmit: float, rcv: float) -> IbPortSample:
        self.xmit += int(xmit * RATE * STEP / 4)
        self.rcv += int(rcv * RATE * STEP / 4)
        return IbPortSample(
            ts=ts,
            host=self.host,
            device=self.device,
            port=1,
            rate_bytes_per_second=RATE,
            counters={"PortXmitData": self.xmit, "PortRcvData": self.rcv},
        )


async def send(bus: MemoryBus, s: GpuSample | IbPortSample) -> None:
    topic = TOPICS.telemetry_gpu if isinstance(s, GpuSample) else TOPICS.telemetry_ib_port
    await bus.producer().send(topic, encode(s), key=s.key)


async def test_a_node_without_headroom_is_not_offerable_until_it_recovers() -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock, refresh_s=3600.0, min_headroom=0.2, headroom_refresh_s=5.0, headroom_window_s=60.0)
    queries: list[str] = []
    await svc.start()
    real_sql = svc.store.sql

    def counting_sql(query: str, params: Any = ()) -> Any:
        queries.append(query)
        return real_sql(query, params)

    svc.store.sql = counting_sql  # type: ignore[method-assign]
    # node-a: port 1 receives at 90 % of its rate (sends 5 %), port 2 is quiet; node-b sends at
    # 10 %; node-c has GPUs but no InfiniBand at all.
    a1, a2, b1 = Port("node-a", "mlx5_0"), Port("node-a", "mlx5_1"), Port("node-b", "mlx5_0")
    try:
        for i in range(7):  # T0 .. T0+60
            t = T0 + STEP * i
            for host in ("node-a", "node-b", "node-c"):
                await send(bus, gpu(t, host))
            await send(bus, a1.read(t, 0.05, 0.9))
            await send(bus, a2.read(t, 0.01, 0.01))
            await send(bus, b1.read(t, 0.1, 0.02))
        clock.t = T0 + 60
        await drain(svc)
        # The first refresh ran before these rows were stored: headroom unknown, nothing blocked.
        assert {h: u.state for h, u in latest(bus, "host").items()} == dict.fromkeys(
            ("node-a", "node-b", "node-c"), GpuState.IDLE
        )
        assert all(u.headroom is None for u in latest(bus, "host").values())

        clock.t = T0 + 70  # next refresh: one query for every host
        await drain(svc)
        ups = latest(bus, "host")
        now = svc.current_states()  # b and c did not change state: their headroom goes out at refresh_s
        _, [(view_a,)] = svc.store.sql(
            "SELECT min(1 - greatest(utilisation_p95, rcv_utilisation_p95)) FROM fabric_headroom_over(60)"
            " WHERE host = 'node-a'"
        )
        _, [(view_b,)] = svc.store.sql("SELECT headroom FROM fabric_headroom_over(60) WHERE host = 'node-b'")
        a, b, c = ups["node-a"], now["node-b/GPU-node-b"], now["node-c/GPU-node-c"]
        assert ups["node-b"].state is GpuState.IDLE and ups["node-c"].state is GpuState.IDLE
        assert a.headroom == pytest.approx(view_a, rel=1e-12) and a.headroom == pytest.approx(0.1, abs=1e-6)
        assert (a.state, a.reason, a.grade, a.predicted_idle_until) == (
            GpuState.UNKNOWN,
            "fabric_headroom",
            None,
            None,
        )
        assert a.since == T0 + 60  # when the block began, not when the GPU became idle
        assert b.headroom == pytest.approx(view_b, rel=1e-12) and b.headroom == pytest.approx(0.9, abs=1e-6)
        assert b.state is GpuState.IDLE and b.since == T0 and b.predicted_idle_until is not None
        assert c.state is GpuState.IDLE and c.headroom is None  # no IB data: never blocks
        assert svc.headroom() == {
            "node-a": pytest.approx(0.1, abs=1e-6),
            "node-b": pytest.approx(0.9, abs=1e-6),
        }
        assert svc.current_states()["node-a/GPU-node-a"].state is GpuState.UNKNOWN
        headroom_queries = [q for q in queries if "node_headroom_over" in q]
        assert len(headroom_queries) == 2  # per refresh, not per GPU (3 GPUs, 2 refreshes)

        # node-a's receive traffic stops: once the window holds only quiet reads, it is offered
        # again, idle since the start of its run.
        for i in range(7, 15):  # T0+70 .. T0+140
            t = T0 + STEP * i
            for host in ("node-a", "node-b", "node-c"):
                await send(bus, gpu(t, host))
            await send(bus, a1.read(t, 0.05, 0.05))
            await send(bus, a2.read(t, 0.01, 0.01))
        clock.t = T0 + 140
        await drain(svc)
        clock.t = T0 + 150
        await drain(svc)
        a = latest(bus, "host")["node-a"]  # published at once: its state changed
        assert a.state is GpuState.IDLE and a.since == T0 and a.predicted_idle_until is not None
        assert a.headroom == pytest.approx(0.95, abs=1e-6)
    finally:
        await svc.stop()


async def test_min_headroom_zero_never_blocks_and_bad_settings_are_rejected() -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock, min_headroom=0.0, headroom_refresh_s=1.0)
    await svc.start()
    port = Port("node-a", "mlx5_0")
    try:
        for i in range(7):
            await send(bus, gpu(T0 + STEP * i, "node-a"))
            await send(bus, port.read(T0 + STEP * i, 1.0, 1.0))  # saturated link: headroom 0
        clock.t = T0 + 60
        await drain(svc)
        clock.t = T0 + 70
        await drain(svc)
        u = svc.current_states()["node-a/GPU-node-a"]
        assert latest(bus, "host")["node-a"].state is GpuState.IDLE
        assert u.state is GpuState.IDLE and u.headroom == pytest.approx(0.0, abs=1e-6)
    finally:
        await svc.stop()
    bad: list[dict[str, float]] = [
        {"min_headroom": 1.5},
        {"min_headroom": -0.1},
        {"headroom_refresh_s": 0.0},
        {"headroom_window_s": 0.0},
    ]
    for kw in bad:
        with pytest.raises(ValueError):
            AnalyticsService(bus=bus, topics=TOPICS, db_path=":memory:", **kw)  # type: ignore[arg-type]
