"""Inference that survives a reclaim, end to end (issue 14, item 3): the broker on a real Kafka and
Mosquitto lends the local Slurm cluster's GPUs (tests/test_broker_lending_slurm.py's set-up), a
site keeps one lease of the simulated inference server (:class:`broker.kept_leases.KeptLeases`)
under an open-loop load (:class:`simulator.load.OpenLoopLoad`), and training jobs take the
lease's node back through Slurm: every request is answered, every lease is released before its
deadline. The numbers at scale: bench/edge_reclaim.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from broker.kept_leases import KeptLeases
from contracts import GpuState, KafkaTopics
from contracts.bus import Bus
from simulator.load import OpenLoopLoad, probe
from tests.services import SLURM_GRACE_S
from tests.lending_support import SlurmUnderTest, edge_site, idle_capacity, inference_profile, lending_broker, until

pytestmark = pytest.mark.timeout(240)

NODES = [f"gpu-node-00{i}" for i in (1, 2, 3, 4)]


@pytest.fixture
def slurm(slurm_conf: Path, tmp_path: Path) -> Iterator[SlurmUnderTest]:
    """The local Slurm cluster lending with :data:`PROFILE`; every job cancelled after the test."""
    sched = SlurmUnderTest(slurm_conf, tmp_path / "slurm", SLURM_GRACE_S, workloads=(PROFILE,))
    yield sched
    sched.clean()
RECLAIMS = 2
PROFILE = inference_profile("infer", 28200, drain_s=SLURM_GRACE_S, quiet_s=SLURM_GRACE_S, health_timeout_s=30)
"""Drains for the whole notice (``--quiet-s`` too: a load stalled for a moment must not look like
the end of traffic): the old endpoint answers until the replacement serves and the lease is released."""


async def test_a_kept_lease_is_handed_over_through_slurm_reclaims_without_a_failed_request(
    kafka_bus: Bus,
    kafka_stage_topics: KafkaTopics,
    mosquitto: dict[str, Any],
    slurm: SlurmUnderTest,
) -> None:
    topics = kafka_stage_topics
    lending = slurm.lending()
    for host in NODES:
        await idle_capacity(kafka_bus, topics, host)
    stop = asyncio.Event()
    async with (
        lending_broker(kafka_bus, topics, mosquitto, lending, SLURM_GRACE_S, (PROFILE,)),
        edge_site(mosquitto) as site,
    ):
        async with KeptLeases(
            site, target=1, workload=PROFILE.name, renew_every_s=5, ready_timeout_s=40,
            drain_timeout_s=SLURM_GRACE_S, probe=lambda ep, lid: probe(ep, lid, warmup=5),
            recheck=lambda ep, lid: probe(ep, lid, warmup=0),
        ) as kept:  # fmt: skip
            await kept.ready(90)
            load = OpenLoopLoad(kept.endpoints, rate_per_s=100)
            driving = asyncio.create_task(load.run(stop))
            for n in range(RECLAIMS):
                await until(lambda: len(kept.endpoints.serving) == 1 and len(kept.leases) == 1, 60)
                await asyncio.sleep(1.0)
                (lease_id,) = kept.leases
                host = site.known_leases[lease_id].hosts[0]
                await idle_capacity(kafka_bus, topics, host, state=GpuState.BUSY)  # what analytics sees
                job = slurm.submit_training(host, 8)  # needs the lease's GPUs back
                await until(
                    lambda n=n: len(kept.handovers) > n and kept.handovers[n].released_at is not None, 30
                )
                await until(lambda job=job: slurm.training_state(job) == "running", 15, 0.2)  # the GPUs went back
                slurm.cancel(job)
                await until(lambda job=job: slurm.training_state(job) == "GONE", 15, 0.2)
                await idle_capacity(kafka_bus, topics, host)
            await asyncio.sleep(1.0)
            stop.set()
            await driving
    assert len(kept.handovers) == RECLAIMS
    for h in kept.handovers:
        assert h.reason.startswith("scheduler_preempted:") and h.endpoint is not None
        assert h.deadline is not None and h.released_at is not None and h.released_at < h.deadline
        assert h.switched_at is not None and h.switched_at <= h.released_at and h.drained
    failed = [r for r in load.records if not r.ok]
    assert not failed, failed[:5]
    assert len({h.lease_id for h in kept.handovers}) == RECLAIMS  # the first lease, then a replacement
    assert len({r.endpoint for r in load.records}) >= 2  # a port comes back once its hold is gone
    assert len(load.records) >= 100 * 3
    print(
        f"{len(load.records)} requests, 0 failed; hand-overs (notice -> switched, -> released, s): "
        + ", ".join(
            f"{h.switched_at - h.noticed_at:.2f}/{h.released_at - h.noticed_at:.2f}" for h in kept.handovers
        )
        + f"; {time.time() - load.records[0].sent_at:.0f} s of load"
    )


async def test_two_kept_leases_sit_on_two_nodes_and_a_replacement_keeps_off_both(
    kafka_bus: Bus,
    kafka_stage_topics: KafkaTopics,
    mosquitto: dict[str, Any],
    slurm: SlurmUnderTest,
) -> None:
    """Anti-affinity end to end: with every node idle the tightest fit would put both leases on
    one node (one preemption would then take every endpoint); each claim names the nodes of the
    kept leases (``Requirements.avoid_hosts``), so they land on two, and the replacement of a
    lease Slurm takes back lands on a third."""
    topics = kafka_stage_topics
    lending = slurm.lending()
    for host in NODES:
        await idle_capacity(kafka_bus, topics, host)
    async with (
        lending_broker(kafka_bus, topics, mosquitto, lending, SLURM_GRACE_S, (PROFILE,)),
        edge_site(mosquitto) as site,
    ):
        async with KeptLeases(
            site, target=2, workload=PROFILE.name, renew_every_s=5, ready_timeout_s=40,
            drain_timeout_s=SLURM_GRACE_S,
        ) as kept:  # fmt: skip
            await kept.ready(90)
            first = {lid: tuple(site.known_leases[lid].hosts) for lid in kept.leases}
            assert len(first) == 2 and len(set(first.values())) == 2, first
            taken, (host,) = next(iter(first.items()))
            await idle_capacity(kafka_bus, topics, host, state=GpuState.BUSY)
            job = slurm.submit_training(host, 8)
            await until(lambda: bool(kept.handovers) and kept.handovers[0].released_at is not None, 30)
            assert kept.handovers[0].lease_id == taken
            (new,) = set(kept.leases) - set(first)
            replaced = tuple(site.known_leases[new].hosts)
            assert len(replaced) == 1 and replaced[0] not in {h for hs in first.values() for h in hs}, replaced
            slurm.cancel(job)
            await until(lambda: slurm.training_state(job) == "GONE", 15, 0.2)
