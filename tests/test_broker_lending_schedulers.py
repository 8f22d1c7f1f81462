"""Leases in the training scheduler, the same tests for every scheduler (``slurm``: the local
Slurm cluster, broker/lending.py; ``kubernetes``: the local control plane,
broker/lending_kubernetes.py, the broker acting as its ServiceAccount): a broker on a real Kafka
and Mosquitto lends every GPU of a node to a site (:class:`tests.lending_support.SchedulerUnderTest`
drives the scheduler).

* fencing: while a lease lives a training workload that needs its GPUs pends (and makes the
  scheduler take the lease back with notice); released, the lease's holds go within 1 s and
  training runs;
* gpupool down: with every gpupool process stopped, a training workload needing the lent GPUs
  gets them within the notice + 10 s, through the scheduler's own preemption;
* the workload's endpoint: a claim naming a workload profile gets an endpoint where the site's
  workload (``simulator.inference_server``) answers on the lease's GPUs; training needing them
  makes the scheduler take the lease back: the site gets the deadline (notice), the workload gets
  SIGTERM and drains, the lease is revoked at the deadline, and training runs. On Kubernetes the
  workload runs on the node with a kubelet and a container runtime (``kube_node``), in the local
  workload image.

Scheduler-specific tests: tests/test_broker_lending_slurm.py, tests/test_broker_lending_kubernetes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from broker.edge import EdgeClient
from broker.lending import Lending
from contracts import KafkaTopics, LeaseState
from contracts.bus import Bus
from tests.lending_support import (
    KubernetesUnderTest,
    SchedulerUnderTest,
    SlurmUnderTest,
    edge_site,
    held_offer,
    idle_capacity,
    inference_profile,
    lending_broker,
    until,
)
from tests.services import K8S_BUILD_TIMEOUT_S, SLURM_GRACE_S, kubernetes_built

# The first Kubernetes test's setup builds the control plane when its binaries are not cached yet.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(150 if kubernetes_built() else K8S_BUILD_TIMEOUT_S + 150),
]


PROFILE = inference_profile("infer", 28100, drain_s=2, quiet_s=0.3, health_timeout_s=20)
"""The site's workload on Slurm: the inference server on the node."""
CONTAINER = inference_profile("infer", 28100, drain_s=2, quiet_s=0.3, health_timeout_s=30, container=True)
"""The same workload on Kubernetes: in the local node's workload image."""


@pytest.fixture(params=["slurm", "kubernetes"])
def scheduler(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SchedulerUnderTest]:
    """Each training scheduler in turn (its cluster started by its session fixture), cleaned
    after the test."""
    if request.param == "slurm":
        slurm = SlurmUnderTest(
            request.getfixturevalue("slurm_conf"), tmp_path / "slurm", SLURM_GRACE_S, workloads=(PROFILE,)
        )
        yield slurm
        slurm.clean()
    else:
        kube = KubernetesUnderTest(
            request.getfixturevalue("kubeconfig"), SLURM_GRACE_S, workloads=(CONTAINER,)
        )
        kube.clean()
        yield kube
        kube.clean()


@contextlib.asynccontextmanager
async def _lent_node(
    bus: Bus,
    topics: KafkaTopics,
    creds: dict[str, Any],
    sched: SchedulerUnderTest,
    lending: Lending,
    host: str,
) -> AsyncIterator[tuple[EdgeClient, str]]:
    """Every GPU of ``host`` idle, a broker lending through ``lending``, a site: (the site, the
    offer of ``host`` once placeholders hold its 8 GPUs)."""
    await idle_capacity(bus, topics, host)
    async with (
        lending_broker(bus, topics, creds, lending, sched.notice_s, sched.workloads),
        edge_site(creds) as site,
    ):
        yield site, await held_offer(site, lambda: sched.idle_held(lending, host), host, 8)


async def test_fencing_training_pends_while_the_lease_lives_and_runs_once_it_is_released(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], scheduler: SchedulerUnderTest
) -> None:
    host, sched = "gpu-node-001", scheduler
    lending = sched.lending()
    async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, sched, lending, host) as (site, offer):
        lease = await site.claim(offer, count=8, duration_seconds=600)
        assert sorted(lease.gpus) == sorted(f"{host}/gpu{i}" for i in range(8))
        await until(lambda: len(sched.lent_holding(host)) == 8, 5)
        train = sched.submit_training(host, 1)
        # the scheduler chooses a lent hold for preemption: the lease is reclaimed, training pends
        msg = await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 15)
        assert msg.reason is not None and msg.reason.startswith("scheduler_preempted:")
        assert sched.training_state(train) == "pending"
        await asyncio.sleep(1.0)
        assert sched.training_state(train) == "pending"  # a second later: still fenced
        t0 = time.monotonic()
        await site.release(lease.lease_id)
        gone_s = await until(lambda: not sched.lent_holding(host), 3.0, 0.02)
        assert gone_s <= 1.0, f"holds still there {gone_s:.2f} s after the release"
        run_s = await until(lambda: sched.training_state(train) == "running", 10)
        print(
            f"holds gone {gone_s:.3f} s after release; training running {time.monotonic() - t0:.3f} s after ({run_s:.3f})"
        )


async def test_gpupool_down_training_still_takes_the_lent_gpus(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], scheduler: SchedulerUnderTest
) -> None:
    host, sched = "gpu-node-004", scheduler
    lending = sched.lending()
    async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, sched, lending, host) as (site, offer):
        await site.claim(offer, count=4, duration_seconds=600)
    # every gpupool process of this test is stopped (broker, its watch, the site); the scheduler alone
    assert sched.stopped(lending)
    await until(lambda: len(sched.lent_holding(host)) == 8, 5)
    submitted = time.monotonic()
    train = sched.submit_training(host, 8)
    run_s = await until(lambda: sched.training_state(train) == "running", sched.notice_s + 10, 0.1)
    assert not sched.lent_holding(host)
    print(
        f"training needing the lent GPUs running {time.monotonic() - submitted:.3f} s after submit ({run_s:.3f})"
    )


async def test_the_workload_serves_on_the_lease_gpus_and_drains_when_the_scheduler_takes_them_back(
    kafka_bus: Bus, kafka_stage_topics: KafkaTopics, mosquitto: dict[str, Any], scheduler: SchedulerUnderTest,
    request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    sched = scheduler
    host = request.getfixturevalue("kube_node") if isinstance(sched, KubernetesUnderTest) else "gpu-node-002"
    lending = sched.lending()
    async with _lent_node(kafka_bus, kafka_stage_topics, mosquitto, sched, lending, host) as (site, offer):
        lease = await site.claim(offer, count=2, duration_seconds=600, workload="infer")
        assert lease.workload == "infer"
        ready = await site.wait_lease(lease.lease_id, lambda m: m.endpoint is not None, 30)
        assert ready.endpoint is not None
        async with httpx.AsyncClient(timeout=2.0) as http:
            answer = (await http.post(f"http://{ready.endpoint}/v1/infer", json={})).json()
            assert sched.served_gpus(answer) == sched.lease_gpus(lending, lease.lease_id)
            assert len(sched.served_gpus(answer)) == 2
            assert answer["lease_id"] == lease.lease_id
            submitted = time.time()
            train = sched.submit_training(host, 8)  # needs the lent GPUs
            msg = await site.wait_lease(lease.lease_id, lambda m: m.state is LeaseState.RECLAIMING, 5)
            notice_s = time.time() - submitted
            assert msg.reclaim_deadline is not None
            assert msg.reason is not None and msg.reason.startswith("scheduler_preempted:")
            assert msg.reclaim_deadline - submitted <= sched.notice_s + 1.5
            assert msg.reclaim_deadline - time.time() >= sched.notice_s - 2.5
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
        assert sched.training_state(train) == "pending"
        revoked = await site.wait_lease(
            lease.lease_id, lambda m: m.state is LeaseState.REVOKED, sched.notice_s + 5
        )
        assert revoked.ts <= msg.reclaim_deadline + 1.0
        await until(lambda: sched.training_state(train) == "running", msg.reclaim_deadline - time.time() + 10)
        print(
            f"endpoint {ready.endpoint}; notice at the site {notice_s:.3f} s after the training submit; "
            f"deadline {msg.reclaim_deadline - submitted:.2f} s"
        )
