"""Leases in the training scheduler, the same tests for every scheduler (``slurm``: the local
Slurm cluster, broker/lending.py; ``kubernetes``: the local control plane,
broker/lending_kubernetes.py, the broker acting as its ServiceAccount): a broker on a real Kafka
and Mosquitto lends every GPU of a node to a site (:class:`tests.lending_support.SchedulerUnderTest`
drives the scheduler).

* fencing: while a lease lives a training workload that needs its GPUs pends (and makes the
  scheduler take the lease back with notice); released, the lease's holds go within 1 s and
  training runs;
* gpupool down: with every gpupool process stopped, a training workload needing the lent GPUs
  gets them within the notice + 10 s, through the scheduler's own preemption.

Scheduler-specific tests: tests/test_broker_lending_slurm.py, tests/test_broker_lending_kubernetes.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

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
    lending_broker,
    until,
)
from tests.services import K8S_BUILD_TIMEOUT_S, SLURM_GRACE_S, kubernetes_built

# The first Kubernetes test's setup builds the control plane when its binaries are not cached yet.
pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(150 if kubernetes_built() else K8S_BUILD_TIMEOUT_S + 150),
]


@pytest.fixture(params=["slurm", "kubernetes"])
def scheduler(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[SchedulerUnderTest]:
    """Each training scheduler in turn (its cluster started by its session fixture), cleaned
    after the test."""
    if request.param == "slurm":
        slurm = SlurmUnderTest(request.getfixturevalue("slurm_conf"), tmp_path / "slurm", SLURM_GRACE_S)
        yield slurm
        slurm.clean()
    else:
        kube = KubernetesUnderTest(request.getfixturevalue("kubeconfig"), SLURM_GRACE_S)
        kube.clean()
        yield kube
        kube.clean()


@contextlib.asynccontextmanager
async def _lent_node(
    bus: Bus, topics: KafkaTopics, creds: dict[str, Any], sched: SchedulerUnderTest, lending: Lending, host: str
) -> AsyncIterator[tuple[EdgeClient, str]]:
    """Every GPU of ``host`` idle, a broker lending through ``lending``, a site: (the site, the
    offer of ``host`` once placeholders hold its 8 GPUs)."""
    await idle_capacity(bus, topics, host)
    async with lending_broker(bus, topics, creds, lending, sched.notice_s), edge_site(creds) as site:
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
