"""simulator.load: the open-loop request load over kept leases' endpoints and its summary."""

from __future__ import annotations

import asyncio
import math
import socket

import pytest

from broker.kept_leases import Endpoints
from simulator.inference_server import InferenceServer
from simulator.load import OpenLoopLoad, RequestRecord, probe, quantile, summarize


def test_quantile_is_the_nearest_rank() -> None:
    values = [float(v) for v in range(100, 0, -1)]
    assert quantile(values, 0.99) == 99.0
    assert quantile(values, 0.5) == 50.0
    assert quantile(values, 0.0) == 1.0 and quantile(values, 1.0) == 100.0
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([5.0] * 7 + [9.0], 0.875) == 5.0 and quantile([5.0] * 7 + [9.0], 0.876) == 9.0
    assert math.isnan(quantile([], 0.99))
    with pytest.raises(ValueError, match="outside"):
        quantile(values, 1.01)


def test_summarize_splits_by_window_ends_included() -> None:
    rec = [
        RequestRecord(9.999, 0.010, True, "a"),
        RequestRecord(10.0, 0.020, True, "a"),
        RequestRecord(12.0, 0.030, False, "a", "ClientConnectorError"),
        RequestRecord(15.0, 0.040, True, "b"),
        RequestRecord(15.001, 0.050, True, "b"),
    ]
    during, steady = summarize(rec, [(10.0, 15.0)])
    assert (during.total, during.failed, during.p50_s, during.p99_s) == (3, 1, 0.020, 0.040)
    assert (steady.total, steady.failed, steady.p50_s, steady.p99_s) == (2, 0, 0.010, 0.050)
    none, everything = summarize(rec, [])
    assert none.total == 0 and math.isnan(none.p99_s) and everything.total == 5
    assert math.isnan(none.lag_p99_s) and everything.lag_p99_s == 0.0


def test_summarize_from_the_send_takes_the_drivers_lag_off_and_reports_it() -> None:
    rec = [RequestRecord(1.0, 0.050, True, "a", "", lag_s=0.040), RequestRecord(2.0, 0.020, True, "a", "", lag_s=0.0)]
    (_, due) = summarize(rec, [])
    (_, sent) = summarize(rec, [], from_send=True)
    assert (due.p50_s, due.p99_s) == (0.020, 0.050)
    assert sent.p50_s == pytest.approx(0.010) and sent.p99_s == pytest.approx(0.020)
    assert due.lag_p99_s == sent.lag_p99_s == 0.040


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_open_loop_load_records_every_request_and_each_kind_of_failure() -> None:
    server = InferenceServer([0], "L1", 0.002)
    port = _free_port()
    await server.start("127.0.0.1", port)
    dead = f"127.0.0.1:{_free_port()}"
    endpoints = Endpoints()
    load = OpenLoopLoad(endpoints, rate_per_s=100, timeout_s=1.0)
    stop = asyncio.Event()
    try:
        driving = asyncio.create_task(load.run(stop))
        await asyncio.sleep(0.1)  # no endpoint yet
        endpoints._set([f"127.0.0.1:{port}"])
        await asyncio.sleep(0.3)
        endpoints._set([f"127.0.0.1:{port}", dead])
        await asyncio.sleep(0.2)
        stop.set()
        await driving
    finally:
        await server.close()
    errors = {r.error for r in load.records if not r.ok}
    assert {"no_endpoint", "ClientConnectorError"} <= errors, errors
    ok = [r for r in load.records if r.ok]
    assert server.served == len(ok) >= 30
    assert all(r.endpoint == f"127.0.0.1:{port}" and r.latency_s >= 0.002 for r in ok)
    assert 50 <= len(load.records) <= 62  # open loop: 100/s for ~0.6 s, whatever the answers
    assert [r.sent_at for r in sorted(load.records, key=lambda r: r.sent_at)][1] - min(
        r.sent_at for r in load.records
    ) == pytest.approx(0.01, abs=1e-6)
    with pytest.raises(ValueError, match="rate_per_s"):
        OpenLoopLoad(endpoints, rate_per_s=0)


async def test_probe_checks_the_leases_health_and_warms_it_up() -> None:
    server = InferenceServer([0], "L1", 0.0)
    port = _free_port()
    await server.start("127.0.0.1", port)
    try:
        assert await probe(f"127.0.0.1:{port}", "L1", warmup=3) and server.served == 3
        assert await probe(f"127.0.0.1:{port}", warmup=0) and server.served == 3
        assert not await probe(f"127.0.0.1:{port}", "L2", warmup=3)  # another lease's process
        assert server.served == 3
        server.draining = True
        assert not await probe(f"127.0.0.1:{port}", "L1")
    finally:
        await server.close()
    assert not await probe(f"127.0.0.1:{_free_port()}", "L1")


async def test_probe_warms_concurrently_over_the_loads_pool_and_can_require_fast_answers() -> None:
    server = InferenceServer([0], "L1", 0.002)
    port = _free_port()
    await server.start("127.0.0.1", port)
    ep = f"127.0.0.1:{port}"
    endpoints = Endpoints()
    try:
        async with OpenLoopLoad(endpoints, rate_per_s=100) as load:
            assert await load.probe(ep, "L1", warmup=8, concurrency=4)
            assert server.served == 8
            # the warm-up left its connections in the load's pool: the load's first requests reuse them
            endpoints._set([ep])
            stop = asyncio.Event()
            driving = asyncio.create_task(load.run(stop))
            await asyncio.sleep(0.1)
            stop.set()
            await driving
            assert load.records and all(r.ok for r in load.records)
            assert load.records[0].connect_s is None
            assert not await load.probe(ep, "L2", warmup=1)  # another lease's process
            assert server.served == 8 + len(load.records)  # refused at /health: no warm-up sent
            # answers of 2 ms: a bound below fails, one above passes
            assert not await load.probe(ep, "L1", warmup=2, fast_s=0.001)
            assert await load.probe(ep, "L1", warmup=2, concurrency=2, fast_s=1.0)
        with pytest.raises(ValueError, match="concurrency"):
            await probe(ep, warmup=1, concurrency=0)
        assert await probe(ep, "L1", warmup=0)  # a session of its own
    finally:
        await server.close()
    assert not await probe(ep, warmup=0)  # nothing listens any more
