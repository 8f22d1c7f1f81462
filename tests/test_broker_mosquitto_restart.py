"""Issue 5 "done when": a Mosquitto restart mid-run. The broker service and two edge sites with
persistent MQTT 5 sessions hold four leases on a real Mosquitto (per-site users and ACL,
persistence on); Mosquitto is stopped (SIGTERM: it saves its sessions and retained messages),
kept down 3 s and started again on the same port.

Must hold: the broker and both sites reconnect by themselves; no lease is lost (renewals resume
and nothing expires); a reclaim notice published just before the stop, and one published while
Mosquitto is down, both reach their site, which then gives the GPUs back within the notice.

Mosquitto is a private instance (``deploy/local/mosquitto.sh`` under its own ``GPUPOOL_STATE``):
restarting the shared one would cut off every other client of it. The bus is the in-process
:class:`contracts.bus.MemoryBus` (the outage is on the MQTT side).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest

from broker.config import BrokerConfig
from broker.credentials import broker_service, edge_client
from broker.edge import BrokerRejected, EdgeClient
from broker.service import BrokerService
from contracts import (
    CapacityUpdate,
    GpuState,
    KafkaTopics,
    LeaseLogRecord,
    LeaseMessage,
    LeaseState,
    Offer,
    PoolDemand,
    decode,
    encode,
)
from contracts.bus import MemoryBus
from tests.mqtt_support import mosquitto_script_async, retained_leases, running, until

pytestmark = pytest.mark.integration

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
TOPICS = KafkaTopics()
CFG = BrokerConfig(
    offer_ttl_s=60,
    notice_s=10.0,
    lease_ttl_s=8.0,
    tick_s=0.1,
    reconnect_min_s=0.1,
    reconnect_max_s=0.5,
)
RENEW_EVERY_S = 1.0
DOWN_S = 3.0


@dataclass
class _SiteRun:
    """One site's client plus what it saw and did."""

    client: EdgeClient
    seen: list[tuple[float, LeaseMessage]] = field(default_factory=list)
    renewed: dict[str, list[float]] = field(default_factory=dict)
    rejected: list[str] = field(default_factory=list)
    timeouts: list[str] = field(default_factory=list)
    released: dict[str, float] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def first_reclaim(self, lease_id: str) -> tuple[float, LeaseMessage] | None:
        return next(
            ((t, m) for t, m in self.seen if m.lease_id == lease_id and m.state is LeaseState.RECLAIMING),
            None,
        )

    async def follow(self) -> None:
        """Record every lease message; answer each reclaim notice with a release."""
        async with contextlib.aclosing(self.client.watch()) as events:
            async for ev in events:
                if not isinstance(ev, LeaseMessage):
                    continue
                self.seen.append((time.time(), ev))
                if ev.state is LeaseState.RECLAIMING and ev.lease_id not in self.released:
                    self.released[ev.lease_id] = 0.0
                    self.tasks.append(asyncio.create_task(self._release(ev.lease_id)))

    async def _release(self, lease_id: str) -> None:
        try:
            await self.client.release(lease_id, timeout_s=15)
            self.released[lease_id] = time.time()
        except (BrokerRejected, TimeoutError) as e:
            self.rejected.append(f"release {lease_id}: {e!r}")

    async def renew_loop(self, lease_id: str) -> None:
        """Heartbeat ``lease_id`` every second while the site holds it and it is not reclaimed."""
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            known = self.client.known_leases.get(lease_id)
            if (
                known is None
                or known.state is not LeaseState.ACTIVE
                and known.state is not LeaseState.GRANTED
            ):
                return
            try:
                await self.client.renew(lease_id, timeout_s=15)  # resent after a reconnect
                self.renewed.setdefault(lease_id, []).append(time.time())
            except BrokerRejected as e:
                self.rejected.append(f"renew {lease_id}: {e.code.value}")
            except TimeoutError:
                self.timeouts.append(lease_id)


def _log(bus: MemoryBus) -> list[LeaseLogRecord]:
    return [decode(LeaseLogRecord, m.value) for m in bus.records(TOPICS.leases_log) if m.value is not None]


@contextlib.asynccontextmanager
async def _broker(bus: MemoryBus, creds: dict[str, Any], client_id: str) -> AsyncIterator[BrokerService]:
    async with running(broker_service(creds, bus=bus, topics=TOPICS, config=CFG, client_id=client_id)) as svc:
        yield svc


def _site(creds: dict[str, Any], name: str, run_id: str) -> EdgeClient:
    return edge_client(
        creds, name, persistent=True, client_id=f"restart-{name}-{run_id}", reconnect_min_s=0.1, reconnect_max_s=0.5
    )


def _offer_on(client: EdgeClient, host: str) -> Offer | None:
    return next((o for o in client.known_offers.values() if o.host == host), None)


async def _claim_two(run: _SiteRun, hosts: list[str]) -> list[LeaseMessage]:
    leases = []
    for host in hosts:
        offer: Offer = await until(functools.partial(_offer_on, run.client, host), 10, f"offer of {host}")
        leases.append(await run.client.claim(offer.offer_id, duration_seconds=600))
    return leases


async def _reclaiming_logged(bus: MemoryBus, lease_id: str) -> LeaseLogRecord:
    return await until(
        lambda: next(
            (r for r in _log(bus) if r.lease_id == lease_id and r.state is LeaseState.RECLAIMING), None
        ),
        10,
        f"reclaim of {lease_id} in the lease log",
    )


async def test_mosquitto_restart_mid_run_loses_no_lease_and_no_notice(
    private_mosquitto: dict[str, Any],
) -> None:
    creds = private_mosquitto
    run_id = uuid.uuid4().hex[:8]
    bus = MemoryBus()
    hosts = [f"n{i}-{run_id}" for i in range(4)]
    a, b = _SiteRun(_site(creds, "edge-a", run_id)), _SiteRun(_site(creds, "edge-b", run_id))
    async with _broker(bus, creds, f"restart-broker-{run_id}") as svc, a.client, b.client:
        now = time.time()
        producer = bus.producer()
        for h in hosts:
            cap = CapacityUpdate(
                ts=now,
                host=h,
                gpu_uuid=f"GPU-{h}",
                state=GpuState.IDLE,
                since=now - 60,
                predicted_idle_until=now + 3600,
            )
            await producer.send(TOPICS.capacity, encode(cap), key=cap.key)
        a_leases = await _claim_two(a, hosts[:2])
        b_leases = await _claim_two(b, hosts[2:])
        a_take, a_keep = a_leases
        b_take, b_keep = b_leases
        for run in (a, b):
            run.tasks.append(asyncio.create_task(run.follow()))
        for run, leases in ((a, a_leases), (b, b_leases)):
            for lease in leases:
                run.tasks.append(asyncio.create_task(run.renew_loop(lease.lease_id)))
        try:
            await asyncio.sleep(2.5 * RENEW_EVERY_S)

            # a demand just before the stop: the notice is published around it
            await producer.send(
                TOPICS.pool_demand,
                encode(PoolDemand(demand_id=f"before-{run_id}", ts=time.time(), gpus=b_take.gpus)),
            )
            b_reclaim = await _reclaiming_logged(bus, b_take.lease_id)
            rc, _, err = await mosquitto_script_async(creds["state"], "stop")
            assert rc == 0, err
            down_at = time.time()
            await until(
                lambda: not (a.client.connected or b.client.connected or svc.stats()["mqtt_connected"]),
                5,
                f"everyone notices the outage (a {a.client.connected}, b {b.client.connected}, "
                f"broker {svc.stats()['mqtt_connected']})",
            )
            # a demand while Mosquitto is down: the broker cannot publish the notice now
            await producer.send(
                TOPICS.pool_demand,
                encode(PoolDemand(demand_id=f"during-{run_id}", ts=time.time(), gpus=a_take.gpus)),
            )
            a_reclaim = await _reclaiming_logged(bus, a_take.lease_id)
            await asyncio.sleep(max(0.0, down_at + DOWN_S - time.time()))
            rc, out, err = await mosquitto_script_async(creds["state"], "start")
            assert rc == 0, err
            assert out.strip().splitlines()[-1] == f"{creds['host']}:{creds['port']}", "the same port"
            up_at = time.time()

            # everyone comes back by themselves
            await until(
                lambda: (
                    all(s.connected and s.reconnects >= 1 for s in (a.client, b.client))
                    and svc.stats()["mqtt_connected"]
                ),
                10,
                "broker and sites reconnect",
            )

            # both notices arrive, with the deadlines the broker logged; the sites release in time
            for run, rec in ((a, a_reclaim), (b, b_reclaim)):
                seen = await until(functools.partial(run.first_reclaim, rec.lease_id), 10, "notice")
                assert seen[1].reclaim_deadline == rec.reclaim_deadline
                await until(functools.partial(run.released.get, rec.lease_id), 10, "release")
                assert rec.reclaim_deadline is not None and run.released[rec.lease_id] < rec.reclaim_deadline
            # (made while everyone was cut off: it can only have come through after the restart)
            a_seen = a.first_reclaim(a_take.lease_id)
            assert a_seen is not None and a_seen[0] > a_reclaim.ts > down_at

            # no lease lost: renewals go on past a whole TTL after the restart, nothing expires
            await asyncio.sleep(CFG.lease_ttl_s + 2 * RENEW_EVERY_S)
            for run, keep in ((a, a_keep), (b, b_keep)):
                after = [t for t in run.renewed.get(keep.lease_id, []) if t > up_at]
                assert len(after) >= CFG.lease_ttl_s / RENEW_EVERY_S, (keep.lease_id, len(after))
                assert run.client.known_leases[keep.lease_id].state is LeaseState.ACTIVE
            assert a.rejected == [] and b.rejected == [] and a.timeouts == [] and b.timeouts == []

            log = _log(bus)
            assert not [r for r in log if r.state in (LeaseState.EXPIRED, LeaseState.REVOKED)], log
            final = {r.lease_id: r for r in log}
            assert {i: final[i].state for i in (a_take.lease_id, b_take.lease_id)} == {
                a_take.lease_id: LeaseState.RELEASED,
                b_take.lease_id: LeaseState.RELEASED,
            }
            assert {r.lease_id for r in svc.book.live_leases()} == {a_keep.lease_id, b_keep.lease_id}
            st = svc.stats()
            assert st["reclaims"].get("released_in_notice") == 2 and st["expired"] == 0
            # the server's retained state agrees with the book
            for site, keep, take in (("edge-a", a_keep, a_take), ("edge-b", b_keep, b_take)):
                retained = await retained_leases(creds, site)
                assert retained[keep.lease_id].state is LeaseState.ACTIVE
                assert retained[keep.lease_id].expires_at > time.time()
                assert retained[take.lease_id].state is LeaseState.RELEASED
        finally:
            for run in (a, b):
                for t in run.tasks:
                    t.cancel()
                await asyncio.gather(*run.tasks, return_exceptions=True)
