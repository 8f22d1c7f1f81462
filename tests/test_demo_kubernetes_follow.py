"""Simulated DCGM telemetry follows training pods on the local Kubernetes control plane
(gpupool.demo_kubernetes.PodStream, fed by the Kubernetes source's caches): a Job's pod on gpu-node-003 makes the simulated GPUs of its slots busy, the
same slots the Kubernetes source reports allocated; gpupool's lent pod leaves its GPU at 0 %; when
the Job ends its GPUs go back to 0 %."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from collectors.kube_collector import KubernetesCollector
from contracts import KafkaTopics
from contracts.bus import MemoryBus
from gpupool.demo_kubernetes import PodStream
from simulator.fleet import Fleet
from simulator.trace import Trace
from tests.kube_support import HOST, Team, as_collector
from tests.kube_support import team as team  # the fixture
from tests.services import K8S_BUILD_TIMEOUT_S, kubernetes_built

pytestmark = pytest.mark.timeout(120 if kubernetes_built() else K8S_BUILD_TIMEOUT_S + 120)


async def _until(cond: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.1)


async def test_simulated_gpus_follow_the_pods_on_the_slots_the_source_reports(
    kubeconfig: Path, team: Team, trace: Trace, tmp_path: Path
) -> None:
    fleet = Fleet(trace, nodes=4, gpus_per_node=8, seed=3)
    source = KubernetesCollector(MemoryBus(), KafkaTopics(), as_collector(kubeconfig), kueue=False)
    stream = PodStream(source, 1.0, tmp_path, {(g.host, g.index): g.key for g in fleet.gpus()}, poll_s=0.1)
    fleet.follow_scheduler(stream.history)
    for informer in source.informers:
        informer.start()
    stop = asyncio.Event()
    task = asyncio.create_task(stream.run(stop))
    key = {i: fleet.gpu(HOST, i).key for i in range(8)}
    try:
        team.pod("train", 3)
        team.lent_pod(7)

        def busy() -> set[int]:
            return {i for i in range(8) if fleet.is_busy_at(key[i], time.time())}

        await _until(lambda: busy() == {0, 1, 2}, 30, "the pod's three slots busy")
        records, _, _ = source.build()
        node = next(r for r in records if r.host == HOST)
        assert {g.index for g in node.gpus if g.allocated and g.job_id == f"{team.ns}/train"} == {0, 1, 2}
        assert node.gpus[7].allocated  # gpupool's hold: allocated in the records, idle in the telemetry
        now = time.time()
        for i in range(8):
            util = fleet.fields(HOST, i, now)["DCGM_FI_PROF_GR_ENGINE_ACTIVE"]
            assert (util > 0) if i < 3 else util == 0, (i, util)
        assert source.synced()  # no list or watch failed since

        team.core.delete_namespaced_pod("train", team.ns, grace_period_seconds=0)
        await _until(lambda: busy() == set(), 30, "the GPUs idle again")
    finally:
        stop.set()
        await task
        for informer in source.informers:
            informer.stop()
