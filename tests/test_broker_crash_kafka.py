"""Durability (issue 5, item 5): ``gpupool broker run`` as a separate process on real Kafka and a
real Mosquitto (MQTT 5), SIGKILLed while one of two leases is being reclaimed, then started again.

What must hold after the restart, read from what crosses the boundaries (the ``leases.log`` topic
on Kafka and the retained lease messages on Mosquitto), not from the broker's memory:

* both leases are intact: the untouched one is still live and renewable, the reclaiming one is
  still ``reclaiming`` with the very same ``reclaim_deadline``;
* the reclaim completes by its deadline (revoked at the deadline: the site keeps the GPUs);
* the demand the first broker consumed is not applied again, and nothing else changed.

Mosquitto is a private instance started with ``deploy/local/mosquitto.sh`` under its own
``GPUPOOL_STATE`` (so no other broker on the shared server can clear this test's retained
messages); Kafka is the session's node (``kafka_bootstrap``) with a fresh topic prefix.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, TypeVar

import pytest

from contracts import (
    CapacityUpdate,
    GpuState,
    KafkaTopics,
    LeaseLogRecord,
    LeaseState,
    Offer,
    PoolDemand,
    encode,
)
from runtime.kafka import KafkaBus
from runtime.replay import read_to_end
from tests.mqtt_support import retained_leases, until
from tests.services import create_stage_topics
from broker.credentials import edge_client

pytestmark = pytest.mark.integration

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
NOTICE_S = 8.0
"""Reclaim notice of every lease, seconds: the kill and the restart happen inside it."""
LEASE_TTL_S = 30.0
TICK_SLACK_S = 1.0
"""A deadline is enforced by the broker's tick (every 0.5 s): revoked within this of it."""


class _BrokerProcess:
    """``gpupool broker run`` in a child process; its JSON logs go to ``log_path``."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.args, self.env, self.log_path = args, env, log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"=== start {time.time():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from gpupool.cli import app; app(prog_name='gpupool')", *self.args],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=REPO,
            )

    def kill(self) -> int:
        """SIGKILL (no goodbye, no flush, no clean disconnect); returns the exit status."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        return self.proc.wait(10)

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait (SIGKILL if it does not exit in time); returns the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
                return -999
        return self.proc.returncode

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


async def _lease_log(bootstrap: str, topics: KafkaTopics) -> list[LeaseLogRecord]:
    """Every record of the lease log on Kafka, read to its end (the broker's own reader)."""
    bus = KafkaBus(bootstrap, client_id="crash-test-reader")
    try:
        records, rejected = await read_to_end(
            bus, topics.leases_log, LeaseLogRecord, group_prefix="crash-test", client_id="crash-test", timeout_s=30
        )
    finally:
        await bus.close()
    assert rejected == 0
    return records


async def _send(bootstrap: str, topic: str, records: list[tuple[str, bytes]]) -> None:
    bus = KafkaBus(bootstrap, client_id="crash-test-writer")
    producer = bus.producer(client_id="crash-test-writer")
    await producer.start()
    try:
        for key, value in records:
            await producer.send(topic, value, key=key)
        await producer.flush()
    finally:
        await producer.stop()
        await bus.close()


async def test_sigkill_during_a_reclaim_keeps_leases_and_the_deadline(
    kafka_bootstrap: str, kafka_topics: KafkaTopics, private_mosquitto: dict[str, Any], tmp_path: Path
) -> None:
    creds = private_mosquitto
    root = creds["root"]
    run_id = uuid.uuid4().hex[:8]
    broker = _BrokerProcess(
        [
            "--log-level",
            "INFO",
            "broker",
            "run",
            "--kafka",
            kafka_bootstrap,
            "--mqtt",
            f"{creds['host']}:{creds['port']}",
            "--username",
            "gpupool-broker",
            "--protocol",
            "5",
            "--root",
            root,
            "--topic-prefix",
            kafka_topics.prefix,
            "--group-id",
            f"crash-broker-{run_id}",
            "--client-id",
            f"crash-broker-{run_id}",
            "--metrics-port",
            "0",
            "--notice",
            str(NOTICE_S),
            "--lease-ttl",
            str(LEASE_TTL_S),
        ],
        {**os.environ, "GPUPOOL_MQTT_PASSWORD": creds["users"]["gpupool-broker"]},
        tmp_path / "broker.log",
    )
    now = time.time()
    hosts = [f"n1-{run_id}", f"n2-{run_id}"]
    caps = [
        CapacityUpdate(
            ts=now,
            host=h,
            gpu_uuid=f"GPU-{h}",
            state=GpuState.IDLE,
            since=now - 60,
            predicted_idle_until=now + 3600,
            model_name="NVIDIA A100-SXM4-80GB",
        )
        for h in hosts
    ]
    # the lease log with 2 partitions: the rebuild must find the end of each
    await create_stage_topics(kafka_bootstrap, kafka_topics, partitions=2)
    await _send(kafka_bootstrap, kafka_topics.capacity, [(c.key, encode(c)) for c in caps])
    site = edge_client(
        creds, "edge-a", client_id=f"crash-edge-a-{run_id}", reconnect_min_s=0.1, reconnect_max_s=0.5
    )
    broker.start()
    try:
        async with site:
            # two leases, one GPU each, both renewed (active)
            offers: dict[str, Offer] = await until(
                lambda: (
                    {o.host: o for o in site.known_offers.values() if o.host in hosts}
                    if {o.host for o in site.known_offers.values()} >= set(hosts)
                    else None
                ),
                60,
                "offers of both nodes",
            )
            keep = await site.claim(offers[hosts[0]].offer_id, duration_seconds=600)
            take = await site.claim(offers[hosts[1]].offer_id, duration_seconds=600)
            for lease in (keep, take):
                await site.renew(lease.lease_id)
                await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.ACTIVE, 5)

            # training wants the second one back
            demand = PoolDemand(demand_id=f"d-{run_id}", ts=time.time(), gpus=take.gpus, reason="crash test")
            await _send(kafka_bootstrap, kafka_topics.pool_demand, [(demand.demand_id, encode(demand))])
            notice = await site.wait_lease(take.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 15)
            deadline = notice.reclaim_deadline
            assert deadline is not None and deadline == pytest.approx(notice.ts + NOTICE_S)
            assert deadline - time.time() > NOTICE_S - 2, "the notice arrived late; nothing left to test"

            # SIGKILL in the middle of the notice, start again at once
            await asyncio.sleep(1.0)
            assert broker.alive(), broker.log_tail()
            assert broker.kill() == -signal.SIGKILL
            killed_at = time.time()
            await until(lambda: site.broker_online is False, 10, "the broker's Last Will (offline)")
            broker.start()
            await until(lambda: site.broker_online is True, 30, "the restarted broker's birth")
            up_at = time.time()
            assert up_at < deadline - 1.0, (
                f"the restarted broker took {up_at - killed_at:.1f} s to come back: the reclaim "
                f"deadline ({deadline - killed_at:.1f} s after the kill) was not still ahead\n"
                f"{broker.log_tail()}"
            )

            # both leases intact on MQTT: one active, one reclaiming with the same deadline
            retained = await retained_leases(creds, "edge-a", root)
            assert retained[keep.lease_id].state is LeaseState.ACTIVE
            assert retained[take.lease_id].state is LeaseState.RECLAIMING
            assert retained[take.lease_id].reclaim_deadline == deadline
            assert retained[take.lease_id].seq == notice.seq
            # the untouched lease is renewable on the new broker
            reply = await site.renew(keep.lease_id)
            assert reply.lease_id == keep.lease_id

            # the reclaim completes by its deadline: the site keeps the GPU, the broker revokes it
            final = await site.wait_lease(
                take.lease_id, lambda m: not m.state.live, deadline - time.time() + 5
            )
            assert final.state is LeaseState.REVOKED and final.reason == "reclaim_deadline"
            assert deadline <= final.ts <= deadline + TICK_SLACK_S
            assert time.time() <= deadline + TICK_SLACK_S + 0.5, "the revocation reached the site late"
            await site.renew(keep.lease_id)  # still live after the revocation
            retained = await retained_leases(creds, "edge-a", root)
            assert retained[take.lease_id].state is LeaseState.REVOKED
            assert retained[keep.lease_id].state is LeaseState.ACTIVE
            # the reclaimed GPU is held for training: not offered again
            await asyncio.sleep(0.5)
            assert not [o for o in site.known_offers.values() if o.host == hosts[1]]
    finally:
        status = broker.terminate()
    assert status == 0, f"clean stop failed ({status}):\n{broker.log_tail()}"

    # the lease log on Kafka tells the same story, across both incarnations
    log = await _lease_log(kafka_bootstrap, kafka_topics)
    kept = [r for r in log if r.lease_id == keep.lease_id]
    taken = [r for r in log if r.lease_id == take.lease_id]
    assert {r.lease_id for r in log} == {keep.lease_id, take.lease_id}
    assert [r.seq for r in kept] == list(range(1, len(kept) + 1))
    assert [r.state for r in kept] == [LeaseState.GRANTED] + [LeaseState.ACTIVE] * (len(kept) - 1)
    assert len(kept) >= 3, "renewed before the kill and after the restart"
    assert [r.state for r in taken] == [
        LeaseState.GRANTED,
        LeaseState.ACTIVE,
        LeaseState.RECLAIMING,
        LeaseState.REVOKED,
    ], "the demand was applied once (the first broker committed it), the deadline revoked once"
    assert taken[2].reason == f"demand:{demand.demand_id}"
    assert taken[2].reclaim_deadline == taken[3].reclaim_deadline == deadline
    assert taken[3].ts >= killed_at and taken[3].ts <= deadline + TICK_SLACK_S
    assert [line for line in broker.log_path.read_text().splitlines() if "lease_book_rebuilt" in line]
